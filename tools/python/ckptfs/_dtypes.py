"""ckptfs's element types as file formats name them: their sizes, and the
typed storage classes torch.save names in an archive's data.pkl."""

ELEMENT_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8, "F16": 2,
                "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
"""Bytes an element of each dtype takes (safetensors names dtypes the same)."""

STORAGE_CLASSES = {
    "BoolStorage": "BOOL", "ByteStorage": "U8", "CharStorage": "I8", "ShortStorage": "I16", "IntStorage": "I32",
    "LongStorage": "I64", "HalfStorage": "F16", "BFloat16Storage": "BF16", "FloatStorage": "F32",
    "DoubleStorage": "F64",
}
"""torch's legacy typed storage classes -> the dtype of their elements."""

__all__ = ["ELEMENT_SIZE", "STORAGE_CLASSES"]
