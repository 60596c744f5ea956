"""What the format modules share: the names of their blobs and files,
format detection, torch (or why it is missing), dtype names."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Union

import ckptfs
from ckptfs import InvalidArgumentError, UnsupportedError
from ckptfs.memory import TORCH_TO_NAME, torch_module


PARTIAL_SUFFIX = ".ckpt-export-partial"
PROGRESS_FILE = ".ckptfs-export.json"

# The blob holding a torch.save file's dict shape (import_torch).
STRUCTURE_BLOB = "ckptfs.torch.structure"
# The blob naming the blobs that were files beside a DCP directory's data
# (Megatron-Core's common.pt and metadata.json): a DCP export writes them
# back as files.
DCP_FILES_BLOB = "ckptfs.dcp.files"
INTERNAL_BLOBS = (STRUCTURE_BLOB, DCP_FILES_BLOB)

PICKLE_MAGIC = b"\x80"
ZIP_MAGIC = b"PK\x03\x04"

PathLike = Union[str, "os.PathLike[str]"]


def detect(path: PathLike) -> str:
    """The format of `path`: "dcp" (a directory with a .metadata file),
    "hf" (another directory: a model directory), "safetensors" or "torch"
    (a torch.save file: a zip archive or a legacy pickle). Raises
    InvalidArgumentError naming the path when it is none of them."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return "dcp" if os.path.isfile(os.path.join(path, ".metadata")) else "hf"
    if not os.path.isfile(path):
        raise ckptfs.NotFoundError(f"{path}: no such file or directory")
    if path.endswith(".safetensors"):
        return "safetensors"
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(ZIP_MAGIC) or head.startswith(PICKLE_MAGIC):
        return "torch"
    if len(head) == 8 and 2 <= int.from_bytes(head, "little") < 100 << 20:
        return "safetensors"  # an 8-byte header length, whatever the file is called
    raise InvalidArgumentError(f"{path}: not a safetensors file, torch.save file, DCP directory or model directory")


def torch_or_raise():
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise UnsupportedError("this format is read with torch, which is not installed here: it needs "
                               "pip install 'ckptfs[torch]', or the torch build your training uses (CPU or its CUDA "
                               "release) in this environment") from None
    return torch


def describe(entries: List[Dict[str, Any]], blobs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"tensors": entries, "blobs": blobs,
            "tensor_bytes": sum(e["bytes"] for e in entries), "blob_bytes": sum(b["bytes"] for b in blobs)}


def ckptfs_dtype(dtype) -> str:
    torch_module()  # fills the tables
    name = TORCH_TO_NAME.get(dtype)
    if name is None:
        raise UnsupportedError(f"torch dtype {dtype} has no ckptfs dtype")
    return name
