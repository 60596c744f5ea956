"""Reading a torch.save archive without torch.load.

A torch.save file (since torch 1.6) is a zip archive: ``data.pkl`` pickles
the object, and each tensor storage is a record ``data/KEY`` stored
uncompressed. torch.load(weights_only=True) builds a torch tensor per entry
through a pickle reader written in Python: about 70 us a tensor, minutes
for a state of 200,000 tiny tensors. This reader unpickles with the C
unpickler, admitting only what a state dict of plain tensors holds (the
tensor rebuild functions, storage classes, dtypes and OrderedDict; nothing
it names is imported or called), and describes each tensor as a region of
the mapped file, which the import puts from in place.

Anything else (a legacy pickle file, a big-endian archive, compressed
records, another global, tensor metadata) raises Fallback: the caller then
reads the file with torch.load(weights_only=True), whose admitted globals
are a superset of these, so the result is the same either way.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import pickle
import struct
import zipfile
from typing import Any, Dict, List, Optional, Tuple

import ckptfs
from ckptfs._dtypes import ELEMENT_SIZE, STORAGE_CLASSES


class Fallback(Exception):  # noqa: N818 - a signal, not an error
    """The archive holds something this reader leaves to torch.load."""


# The legacy storage classes (typed) and the dtypes named beside an
# untyped storage (torch.save of dtypes without a legacy class).
_STORAGES = STORAGE_CLASSES
_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "uint16": "U16",
    "uint32": "U32", "uint64": "U64", "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
ITEM_SIZE = ELEMENT_SIZE


class _StorageType:
    __slots__ = ("dtype",)

    def __init__(self, dtype: Optional[str]):
        self.dtype = dtype  # None: untyped (bytes)


class _DType:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _Storage:
    __slots__ = ("key", "dtype")

    def __init__(self, key: str, dtype: Optional[str]):
        self.key, self.dtype = key, dtype


class StoredTensor:
    """A tensor of an archive: `dtype` (a ckptfs name), `shape`, and where
    its elements lie in the mapped file (`archive`, storage `key`, element
    `offset` and `stride`)."""

    __slots__ = ("archive", "key", "dtype", "shape", "stride", "offset", "numel", "nbytes")

    def __init__(self, archive: "Archive", key: str, dtype: str, shape: Tuple[int, ...], stride: Tuple[int, ...],
                 offset: int):
        self.archive, self.key, self.dtype = archive, key, dtype
        self.shape, self.stride, self.offset = shape, stride, offset
        n = 1
        for s in shape:
            n *= s
        self.numel = n
        self.nbytes = n * ITEM_SIZE[dtype]

    def contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def host(self) -> Tuple[int, Any]:
        """(address, keep) of the elements in row-major order: the mapped
        file's own bytes when contiguous, else a copy (`keep` holds it)."""
        start = self.archive.start(self.key) + self.offset * ITEM_SIZE[self.dtype]
        if self.contiguous() or self.numel == 0:
            return self.archive.address + start, None
        import numpy as np  # noqa: PLC0415

        item = ITEM_SIZE[self.dtype]
        region = self.archive.array[start:start + self._reach()].view(f"u{item}")
        view = np.lib.stride_tricks.as_strided(region, shape=self.shape, strides=[s * item for s in self.stride],
                                               writeable=False)
        copy = np.ascontiguousarray(view)
        return copy.__array_interface__["data"][0], copy

    def _reach(self) -> int:
        """Bytes from the first element to the end of the last one."""
        if self.numel == 0:
            return 0
        return (sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1) * ITEM_SIZE[self.dtype]


class Archive:
    """A torch.save archive mapped for reading, its records by storage key.
    Given `stream` (a seekable file object of `size` bytes; `path` then only
    names it in errors), the archive is read from it and not mapped: its
    records and tensors are described, but host() cannot be used."""

    def __init__(self, path: str, stream: Any = None, size: int = 0):
        import numpy as np  # noqa: PLC0415

        self.path = path
        self._stream = stream
        with (open(path, "rb") if stream is None else contextlib.nullcontext(stream)) as f:
            if stream is None:
                size = os.fstat(f.fileno()).st_size
            try:
                zf = zipfile.ZipFile(f)
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                raise ckptfs.CorruptionError(f"{path}: not a readable zip archive: {e}") from None
            infos = zf.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pickles) != 1:
                raise Fallback("no single data.pkl record")
            self.prefix = pickles[0].filename[: -len("data.pkl")]
            by_name = {i.filename: i for i in infos}
            order = by_name.get(self.prefix + "byteorder")
            if order is not None and zf.read(order) != b"little":
                raise Fallback("not a little-endian archive")
            self.records: Dict[str, Tuple[int, int]] = {}  # key: (header offset, size), checked by start()
            data = self.prefix + "data/"
            for i in infos:
                if i.filename.startswith(data):
                    if i.compress_type != zipfile.ZIP_STORED:
                        raise Fallback("compressed records")
                    self.records[i.filename[len(data):]] = (i.header_offset, i.file_size)
            try:
                self.pickle = zf.read(pickles[0])
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                raise ckptfs.CorruptionError(f"{path}: cannot read {pickles[0].filename}: {e}") from None
            self.size = size
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size and stream is None else None
        self.array = np.frombuffer(self.map, dtype=np.uint8) if self.map is not None else np.zeros(0, np.uint8)
        self.address = self.array.__array_interface__["data"][0]
        self._starts: Dict[str, int] = {}

    def start(self, key: str) -> int:
        """The file offset of storage `key`'s bytes (from its local header)."""
        start = self._starts.get(key)
        if start is None:
            header, _size = self.records[key]
            local = self._bytes(header, 30) if header + 30 <= self.size else b""
            if len(local) != 30 or local[:4] != b"PK\x03\x04":
                raise ckptfs.CorruptionError(f"{self.path}: the record of storage '{key}' has no local header")
            name_len, extra_len = struct.unpack_from("<HH", local, 26)
            start = header + 30 + name_len + extra_len
            self._starts[key] = start
        return start

    def _bytes(self, at: int, n: int) -> bytes:
        if self.map is not None:
            return self.map[at:at + n]
        if self._stream is None:
            return b""
        self._stream.seek(at)
        return self._stream.read(n)

    def check(self, t: StoredTensor) -> None:
        """Raises CorruptionError unless every element of `t` lies in its
        storage's record, inside the file."""
        record = self.records.get(t.key)
        if record is None:
            raise ckptfs.CorruptionError(f"{self.path}: a tensor names storage '{t.key}', which the archive lacks")
        reach = t.offset * ITEM_SIZE[t.dtype] + t._reach()
        if t.numel and (reach > record[1] or self.start(t.key) + record[1] > self.size):
            raise ckptfs.CorruptionError(f"{self.path}: a tensor reaches past the end of storage '{t.key}' "
                                         f"({reach} bytes of {record[1]})")


def _naturals(offset: Any, size: tuple, stride: tuple) -> bool:
    if type(offset) is not int or offset < 0:
        return False
    for v in size:
        if type(v) is not int or v < 0:
            return False
    for v in stride:
        if type(v) is not int or v < 0:
            return False
    return True


class _Unpickler(pickle.Unpickler):
    def __init__(self, archive: Archive):
        import io  # noqa: PLC0415

        super().__init__(io.BytesIO(archive.pickle))
        self.archive = archive
        self.tensors: List[StoredTensor] = []

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils":
            if name == "_rebuild_tensor_v2":
                return self._rebuild_v2
            if name == "_rebuild_tensor_v3":
                return self._rebuild_v3
            if name == "_rebuild_parameter":
                return self._parameter
        if module == "torch" and name in _STORAGES:
            return _StorageType(_STORAGES[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in _DTYPES:
            return _DType(_DTYPES[name])
        raise Fallback(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)):
            raise Fallback("a persistent reference other than a storage")
        return _Storage(pid[2], pid[1].dtype)

    def _tensor(self, storage: Any, offset: Any, size: Any, stride: Any, hooks: Any, dtype: Optional[str],
                metadata: Any) -> StoredTensor:
        if metadata or hooks or not isinstance(storage, _Storage) or dtype is None:
            raise Fallback("tensor metadata, hooks or an unknown storage")
        if (type(size) is not tuple or type(stride) is not tuple or len(size) != len(stride)
                or not _naturals(offset, size, stride)):
            raise ckptfs.CorruptionError(f"{self.archive.path}: a tensor of storage '{storage.key}' has a malformed "
                                         f"shape, stride or offset")
        t = StoredTensor(self.archive, storage.key, dtype, size, stride, offset)
        self.tensors.append(t)
        return t

    def _rebuild_v2(self, storage, offset, size, stride, _requires_grad=False, hooks=None, metadata=None):
        return self._tensor(storage, offset, size, stride, hooks, getattr(storage, "dtype", None), metadata)

    def _rebuild_v3(self, storage, offset, size, stride, _requires_grad, hooks, dtype, metadata=None):
        if getattr(storage, "dtype", "") is not None or not isinstance(dtype, _DType):
            raise Fallback("a typed storage with a dtype")
        return self._tensor(storage, offset, size, stride, hooks, dtype.name, metadata)

    def _parameter(self, data, _requires_grad=False, hooks=None):
        if not isinstance(data, StoredTensor) or hooks:
            raise Fallback("a parameter of something other than a tensor")
        return data


def load(path: str, stream: Any = None, size: int = 0) -> Any:
    """The object of the torch.save archive at `path`, its tensors
    StoredTensors of the mapped file (the object keeps the mapping), or of
    `stream` (Archive). Raises Fallback where torch.load should read it
    instead, and CorruptionError naming the file where it is damaged."""
    archive = Archive(path, stream, size)
    unpickler = _Unpickler(archive)
    try:
        obj = unpickler.load()
    except (Fallback, ckptfs.Error):
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle: any of the unpickler's errors
        raise ckptfs.CorruptionError(f"{path}: {archive.prefix}data.pkl cannot be read: {type(e).__name__}: "
                                     f"{e}") from None
    # Tensors anywhere but in dicts, lists and tuples (a set, a dict key)
    # are left to torch.load, which makes them torch tensors there.
    reached = set()
    seen = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, StoredTensor):
            reached.add(id(x))
        elif isinstance(x, (dict, list, tuple)) and id(x) not in seen:
            seen.add(id(x))
            stack.extend(x.values() if isinstance(x, dict) else x)
    if any(id(t) not in reached for t in unpickler.tensors):
        raise Fallback("a tensor outside dicts, lists and tuples")
    for t in unpickler.tensors:
        archive.check(t)
    return obj
