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

What is found only places cuts: a file that merely looks like one of these
is stored byte for byte all the same.
"""

from __future__ import annotations

import io
import json
import re
import struct
import zipfile
from typing import Iterator, List, Optional, Tuple

_LOCAL_HEADER = b"PK\x03\x04"
_STORAGE_RECORD = re.compile(rb"(?:^|/)data/\d+$")
_MAX_SAFETENSORS_HEADER = 100 << 20


class UnitFinder:
    """Splits each write of one file into (piece, is_unit) in order."""

    def __init__(self) -> None:
        self._pos = 0  # bytes of the file written so far
        self._name: Optional[bytearray] = None  # the name of the record whose header came last
        self._name_at = 0  # where that name starts
        self._name_len = 0
        self._data_at = -1  # where that record's data starts

    def split(self, view: memoryview) -> Iterator[Tuple[memoryview, bool]]:
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
            storage = bool(_STORAGE_RECORD.search(bytes(self._name)))
            self._name, self._data_at = None, -1
            if storage:
                yield view, True
                return
        if n == 30 and view[:4] == _LOCAL_HEADER:
            name_len, extra_len = struct.unpack_from("<HH", view, 26)
            self._name, self._name_at, self._name_len = bytearray(), pos + 30, name_len
            self._data_at = pos + 30 + name_len + extra_len
            yield view, False
            return
        yield from _split_whole(view)


def _split_whole(view: memoryview) -> Iterator[Tuple[memoryview, bool]]:
    """A write that may hold a whole archive or safetensors file."""
    units = _units_of_whole(view)
    at = 0
    for start, end in units:
        if start > at:
            yield view[at:start], False
        yield view[start:end], True
        at = end
    if at < view.nbytes:
        yield view[at:], False


def _units_of_whole(view: memoryview) -> List[Tuple[int, int]]:
    """Sorted, disjoint (start, end) of the tensors in `view`; [] when none
    are found or it is neither format."""
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
    found = sorted((s, e) for s, e in found if 0 <= s < e <= n)
    disjoint: List[Tuple[int, int]] = []
    for s, e in found:
        if disjoint and s < disjoint[-1][1]:
            return []  # overlapping: not a file this module understands
        disjoint.append((s, e))
    return disjoint


class _ViewReader(io.RawIOBase):
    """A read-only, seekable file over a memoryview, without a copy of it."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        got = self._view[self._pos:self._pos + out.nbytes]
        out[:got.nbytes] = got
        self._pos += got.nbytes
        return got.nbytes


def _zip_storages(view: memoryview) -> List[Tuple[int, int]]:
    found = []
    with zipfile.ZipFile(_ViewReader(view)) as archive:  # reads the central directory only
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size == 0:
                continue
            if not _STORAGE_RECORD.search(info.filename.encode("utf-8", "surrogateescape")):
                continue
            at = info.header_offset
            if view[at:at + 4] != _LOCAL_HEADER:
                raise ValueError("no local header where the central directory says")
            name_len, extra_len = struct.unpack_from("<HH", view, at + 26)
            start = at + 30 + name_len + extra_len
            found.append((start, start + info.file_size))
    return found


def _safetensors_tensors(view: memoryview) -> List[Tuple[int, int]]:
    (header_len,) = struct.unpack_from("<Q", view, 0)
    if not 2 <= header_len <= min(_MAX_SAFETENSORS_HEADER, view.nbytes - 8) or view[8] != ord("{"):
        return []
    header = json.loads(bytes(view[8:8 + header_len]))
    base = 8 + header_len
    found = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if not (isinstance(begin, int) and isinstance(end, int)):
            raise TypeError("data_offsets are not integers")
        found.append((base + begin, base + end))
    return found


__all__ = ["UnitFinder"]
