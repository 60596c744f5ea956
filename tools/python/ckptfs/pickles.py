"""Reading the pickles of other tools without running code they name.

A pickle is a program: each global it names is imported and may be called
on load. DCP writes its ``.metadata`` file as a pickle of a few of torch's
own classes; a file from elsewhere can name ``os.system`` instead. These
readers admit only the globals such a file holds, and refuse any other,
naming it, before anything is called.
"""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any, BinaryIO, Callable, Dict, Set

from ._core import UnsupportedError

# DCP's metadata: its dataclasses and enums, torch's value types (a dtype,
# a layout, a memory format, torch.Size), and plain containers. Older torch
# releases kept TensorProperties under torch.distributed._shard.
_DCP_CLASSES: Dict[str, Set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties", "MEM_FORMAT_ENCODING"},
    "torch.distributed._shard.metadata": {"ShardMetadata"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # maps "torch.strided" to the layout
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "bytearray", "complex", "slice", "range"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath"},
}


def _torch_value(module: str, name: str) -> Any:
    """torch.<name> when it is a dtype, a layout or a memory format (values,
    not callables: loading one runs nothing)."""
    if module != "torch":
        return None
    import torch  # noqa: PLC0415

    value = getattr(torch, name, None)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    return None


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, f: BinaryIO, what: str, allowed: Callable[[str, str], Any]):
        super().__init__(f)
        self._what = what
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        value = self._allowed(module, name)
        if value is None:
            raise UnsupportedError(
                f"{self._what} names {module}.{name}, which a DCP metadata file does not hold; it was not loaded, "
                "since loading it could run code (for a file you wrote yourself, --trust-pickle, or "
                "trust_pickle=True in Python, reads it as torch does)")
        return value

    def persistent_load(self, pid: Any) -> Any:
        raise UnsupportedError(f"{self._what} holds a persistent reference, which a DCP metadata file does not")


def _dcp_global(module: str, name: str) -> Any:
    value = _torch_value(module, name)
    if value is not None:
        return value
    if name not in _DCP_CLASSES.get(module, ()):
        return None
    return getattr(importlib.import_module(module), name)


def load_dcp_metadata(data: bytes, what: str, trust: bool = False) -> Any:
    """The object pickled in `data`, a DCP ``.metadata`` file (`what` names
    it in errors). Unless `trust`, only DCP's metadata classes, torch's
    dtypes, layouts, memory formats and sizes, and plain containers are
    admitted; any other global raises UnsupportedError naming it, before
    anything it names is called."""
    if trust:
        return pickle.loads(data)  # noqa: S301 - the caller trusts the file
    return _RestrictedUnpickler(io.BytesIO(data), what, _dcp_global).load()

