"""Where a tensor's bytes lie in a file being written, for the formats
ckptfs knows, so that they are stored as units (BlobPiece::kUnit): cut at
their ends and at fixed offsets inside, as a tensor's bytes are, with no
content cuts to find. Everything else is cut by content.

Two ways a file arrives:

- In pieces, as ``torch.save`` streams an archive (and DCP's writers one
  archive per tensor into a ``.distcp`` file): a record's 30-byte local
  header, its name, its extra field, then its data in one write. A write
  that is a whole ``.../data/N`` record (a storage's bytes) is a unit.
- Whole, in one write (Lightning's ``torch.save`` to a buffer, safetensors'
  ``save``): a zip archive's storage records, found through its central
  directory, and a safetensors file's tensors, found through its header.

A unit's element type, where the file says it (a storage's class in the
archive's ``data.pkl``, a tensor's dtype in a safetensors header), lets the
engine encode it as a tensor's bytes (byte grouping), which is about twice
as fast as encoding bytes of no known type.

What is found only places cuts: a file that merely looks like one of these
is stored byte for byte all the same.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import struct
import zipfile
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ._dtypes import ELEMENT_SIZE, STORAGE_CLASSES
from ._streams import ViewReader

_LOCAL_HEADER = b"PK\x03\x04"
_STORAGE_RECORD = re.compile(rb"(?:^|/)data/(\d+)$")
_PICKLE_RECORD = re.compile(rb"(?:^|/)data\.pkl$")
_MAX_SAFETENSORS_HEADER = 100 << 20
_MAX_PICKLE = 64 << 20  # a data.pkl larger than this is not read for its storages' types

Unit = Tuple[int, int, str]  # start, end, dtype


class UnitFinder:
    """Splits each write of one file into (piece, dtype) in order: dtype is
    the element type of a unit ("U8" where the file does not say), None
    for bytes cut by content."""

    def __init__(self) -> None:
        self._pos = 0  # bytes of the file written so far
        self._name: Optional[bytearray] = None  # the name of the record whose header came last
        self._name_at = 0  # where that name starts
        self._name_len = 0
        self._data_at = -1  # where that record's data starts
        self._types: Dict[str, str] = {}  # storage key -> dtype, from the archive's data.pkl

    def split(self, view: memoryview) -> Iterator[Tuple[memoryview, Optional[str]]]:
        pos, n = self._pos, view.nbytes
        self._pos += n
        if n == 0:
            return
        if self._name is not None and pos < self._name_at + self._name_len:
            lo = max(pos, self._name_at)
            hi = min(pos + n, self._name_at + self._name_len)
            if lo < hi:
                self._name += view[lo - pos:hi - pos]
        if pos == self._data_at and self._name is not None:
            name = bytes(self._name)
            self._name, self._data_at = None, -1
            storage = _STORAGE_RECORD.search(name)
            if storage:
                yield view, _whole(self._types.get(storage.group(1).decode(), "U8"), n)
                return
            if _PICKLE_RECORD.search(name):
                self._types = storage_types(view)  # a new archive (DCP's files hold one per tensor)
        if n == 30 and view[:4] == _LOCAL_HEADER:
            name_len, extra_len = struct.unpack_from("<HH", view, 26)
            self._name, self._name_at, self._name_len = bytearray(), pos + 30, name_len
            self._data_at = pos + 30 + name_len + extra_len
            yield view, None
            return
        yield from _split_whole(view)


def _whole(dtype: str, n: int) -> str:
    """`dtype` if `n` bytes are whole elements of it, else U8."""
    return dtype if n % ELEMENT_SIZE.get(dtype, 1) == 0 else "U8"


class _Stub:
    """What every global of a pickle read by storage_types stands for:
    nothing is imported or called, whatever the pickle names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Stub":
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _StorageType:
    def __init__(self, dtype: str):
        self.dtype = dtype


class _StorageTypes(pickle.Unpickler):
    def __init__(self, data: memoryview):
        super().__init__(io.BytesIO(data))
        self.types: Dict[str, str] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in STORAGE_CLASSES:
            return _StorageType(STORAGE_CLASSES[name])
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[2], str):
            if isinstance(pid[1], _StorageType):
                self.types[pid[2]] = pid[1].dtype
        return _Stub()


def storage_types(data: memoryview) -> Dict[str, str]:
    """Storage key -> dtype of a torch.save archive's data.pkl, for the
    storages of a typed class; {} for anything it cannot read. The pickle's
    globals all stand for stubs: nothing it names is imported or run."""
    if data.nbytes > _MAX_PICKLE:
        return {}
    reader = _StorageTypes(data)
    try:
        reader.load()
    except Exception:  # noqa: BLE001 - any pickle at all: what was read so far stands
        pass
    return reader.types


def _split_whole(view: memoryview) -> Iterator[Tuple[memoryview, Optional[str]]]:
    """A write that may hold a whole archive or safetensors file."""
    at = 0
    for start, end, dtype in _units_of_whole(view):
        if start > at:
            yield view[at:start], None
        yield view[start:end], _whole(dtype, end - start)
        at = end
    if at < view.nbytes:
        yield view[at:], None


def _units_of_whole(view: memoryview) -> List[Unit]:
    """Sorted, disjoint units of the tensors in `view`; [] when none are
    found or it is neither format."""
    n = view.nbytes
    if n < 64:
        return []
    try:
        if view[:4] == _LOCAL_HEADER:
            found = _zip_storages(view)
        else:
            found = _safetensors_tensors(view)
    except (ValueError, KeyError, TypeError, struct.error, zipfile.BadZipFile, OverflowError,
            UnicodeDecodeError, RecursionError):
        return []
    found = sorted(u for u in found if 0 <= u[0] < u[1] <= n)
    disjoint: List[Unit] = []
    for unit in found:
        if disjoint and unit[0] < disjoint[-1][1]:
            return []  # overlapping: not a file this module understands
        disjoint.append(unit)
    return disjoint


def _zip_storages(view: memoryview) -> List[Unit]:
    found = []
    with zipfile.ZipFile(ViewReader(view)) as archive:  # reads the central directory
        types: Dict[str, str] = {}
        for info in archive.infolist():
            if (_PICKLE_RECORD.search(info.filename.encode("utf-8", "surrogateescape"))
                    and info.file_size <= _MAX_PICKLE):
                types = storage_types(memoryview(archive.read(info)))
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size == 0:
                continue
            storage = _STORAGE_RECORD.search(info.filename.encode("utf-8", "surrogateescape"))
            if not storage:
                continue
            at = info.header_offset
            if view[at:at + 4] != _LOCAL_HEADER:
                raise ValueError("no local header where the central directory says")
            name_len, extra_len = struct.unpack_from("<HH", view, at + 26)
            start = at + 30 + name_len + extra_len
            found.append((start, start + info.file_size, types.get(storage.group(1).decode(), "U8")))
    return found


def safetensors_header_length(first: bytes, size: int) -> int:
    """The length of a safetensors file's JSON header from its first 8
    bytes, for a file of `size` bytes; 0 when it cannot be one."""
    if len(first) < 8 or size < 10:
        return 0
    (n,) = struct.unpack_from("<Q", first, 0)
    return n if 2 <= n <= min(_MAX_SAFETENSORS_HEADER, size - 8) else 0


def safetensors_entries(header: bytes, size: int) -> List[Tuple[str, str, List[int], int, int]]:
    """(name, dtype, shape, start, end) of each tensor a safetensors header
    (its JSON, the file being `size` bytes) names, start and end offsets in
    the file; a tensor whose dtype, shape or offsets do not agree, or that
    reaches past the file, is left out. Raises ValueError (or TypeError,
    KeyError) for a header that is not JSON of the format."""
    entries = json.loads(header)
    if not isinstance(entries, dict):
        raise ValueError("a safetensors header is a JSON object")
    base = 8 + len(header)
    found = []
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        dtype, shape = entry["dtype"], [int(d) for d in entry["shape"]]
        begin, end = (int(x) for x in entry["data_offsets"])
        count = 1
        for d in shape:
            count *= d
        if (dtype in ELEMENT_SIZE and min(shape, default=0) >= 0 and begin >= 0
                and end - begin == count * ELEMENT_SIZE[dtype] and base + end <= size):
            found.append((name, dtype, shape, base + begin, base + end))
    return found


def _safetensors_tensors(view: memoryview) -> List[Unit]:
    header_len = safetensors_header_length(bytes(view[:8]), view.nbytes)
    if not header_len or view[8] != ord("{"):
        return []
    return [(start, end, dtype) for _, dtype, _, start, end in
            safetensors_entries(bytes(view[8:8 + header_len]), view.nbytes)]


__all__ = ["UnitFinder", "safetensors_entries", "safetensors_header_length", "storage_types"]
