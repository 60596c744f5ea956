"""Minimal safetensors writer/reader for tests, written from the published
format description and independent of ckptfs's own code."""
import json
import struct

import numpy as np

# dtype name -> (numpy dtype used to hold the bits, element size)
DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
    "BF16": np.uint16, "F32": np.float32, "F64": np.float64, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
}


def write(path, tensors, metadata=None):
    """tensors: list of (name, dtype_name, numpy array)."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    blobs, pos = [], 0
    for name, dt, arr in tensors:
        data = np.ascontiguousarray(arr).astype(DTYPES[dt], copy=False).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read(path):
    """Returns ({name: (dtype_name, numpy array)}, metadata)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        arr = np.frombuffer(raw[8 + n + b:8 + n + end], dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
        out[name] = (e["dtype"], arr)
    return out, meta


def random_array(rng, dtype_name, shape):
    """Random values of a safetensors dtype, held in its NumPy stand-in."""
    np_dtype = DTYPES[dtype_name]
    if np_dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(np_dtype, np.floating):
        return rng.standard_normal(size=shape).astype(np_dtype)
    info = np.iinfo(np_dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=np_dtype, endpoint=True)
