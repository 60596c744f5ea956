"""Read-only, seekable streams over bytes kept elsewhere (a range of an open
file, of a stored blob, a memoryview), for readers such as zipfile and
torch.load that want a file object, without a copy of the whole."""

from __future__ import annotations

import io


class RangeReader(io.RawIOBase):
    """`length` bytes as a seekable stream; a subclass says where they are
    (`_fill`)."""

    def __init__(self, length: int):
        super().__init__()
        self._len, self._pos = length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(out.nbytes, self._len - self._pos))
        got = self._fill(self._pos, out[:n]) if n else 0
        self._pos += got
        return got

    def _fill(self, pos: int, out: memoryview) -> int:
        """Fills `out` with the bytes from `pos` on; returns how many it filled."""
        raise NotImplementedError


class ViewReader(RangeReader):
    """The bytes of a memoryview."""

    def __init__(self, view: memoryview):
        super().__init__(view.nbytes)
        self._view = view

    def _fill(self, pos: int, out: memoryview) -> int:
        out[:] = self._view[pos:pos + out.nbytes]
        return out.nbytes


__all__ = ["RangeReader", "ViewReader"]
