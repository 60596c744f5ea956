"""Exporting a checkpoint as one torch.save file, one tensor in memory at
a time."""

from __future__ import annotations

import io
import os
import sys
from typing import Any, Callable, Dict, List

from ckptfs import UnsupportedError
from ckptfs.memory import read_value
from .common import INTERNAL_BLOBS, torch_or_raise
from .torch_in import unflatten
from .writing import ExportTensors, read_tensor


_MAP_NORESERVE = getattr(__import__("mmap"), "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def write_torch_export(path: str, repo, reader, name: str, order: List[str], shown, sizes: "ExportTensors",
                       cast, structure, advance: Callable[[int], None]) -> None:
    """Writes the checkpoint as one torch.save file at `path` with no more
    than one tensor in memory: torch.save writes the file's structure with
    every tensor's bytes left as empty space (torch.serialization.skip_data;
    the tensors it is given are mapped, never touched), torch.load maps
    the file back shared (so a write to a tensor is a write to the file),
    and each tensor is read from the repository straight into its place.
    Then the file is made durable and renamed into place, as every export
    file is."""
    import io  # noqa: PLC0415
    import mmap  # noqa: PLC0415

    torch = torch_or_raise()
    skip_data = getattr(torch.serialization, "skip_data", None)
    if skip_data is None:
        raise UnsupportedError(f"--format torch needs torch.serialization.skip_data (torch >= 2.5), not torch "
                               f"{torch.__version__}")
    # Every tensor a view of one anonymous mapping, 64-byte aligned: address
    # space only, not counted against the machine's memory (MAP_NORESERVE),
    # so tensors larger than the memory are no problem; one mmap call however
    # many tensors.
    places, end = {}, 0
    for n in order:
        places[n] = end
        end += -(-sizes.nbytes(n) // 64) * 64
    space = mmap.mmap(-1, max(end, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)

    def untouched(n: str):
        if sizes.nbytes(n) == 0:
            return torch.empty(sizes.shape(n), dtype=sizes.dtype(n))
        return torch.frombuffer(space, dtype=sizes.dtype(n), count=sizes.numel(n),
                                offset=places[n]).reshape(sizes.shape(n))

    empty = {n: untouched(n) for n in order}
    if structure is not None:
        state = unflatten(structure, empty.__getitem__,
                           lambda b: torch.load(io.BytesIO(repo.blob(name, b)), weights_only=True))
    else:
        state = dict(empty)
        for b in sorted({b["name"] for b in shown["blobs"]} - set(INTERNAL_BLOBS)):
            state[b] = repo.blob(name, b)
    tmp = path + ".tmp"
    with skip_data():
        torch.save(state, tmp)
    del state, empty, space
    # The file was written a moment ago, by torch.save of tensors, raw blob
    # bytes and objects that torch.load(weights_only=True) gave; loaded
    # whole, since weights_only refuses some of what pickle writes for
    # them (an empty bytes value is a call of the global `bytes`).
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        mapped = torch.load(tmp, mmap=True, weights_only=False)
    targets: Dict[str, Any] = {}
    if structure is not None:
        _tensors_at(structure, mapped, targets)
    else:
        targets = {n: mapped[n] for n in order}
    for n in order:
        target = targets.pop(n)
        if target.dtype == sizes.stored(n):
            read_value(reader, n, target, None)
        else:
            target.copy_(read_tensor(reader, n))
        _let_go(target.data_ptr(), target.numel() * target.element_size())
        advance(sizes.nbytes(n))
        del target
    del mapped
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _let_go(address: int, nbytes: int) -> None:
    """Drops this process's pages of a shared file mapping's range once
    written: the data stays in the page cache (dirty, written back by the
    kernel or the fsync), so the export's memory stays one tensor's."""
    if nbytes <= 0:
        return
    import ctypes  # noqa: PLC0415

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED; advice only


_libc = None  # the C library, for madvise (_let_go)


def _tensors_at(node, obj, out: Dict[str, Any]) -> None:
    """The tensors of `obj`, an object unflatten(node, ...) built (or a
    copy of one), by name."""
    if "dict" in node:
        for k, child in node["dict"]:
            _tensors_at(child, obj[k], out)
    elif "list" in node or "tuple" in node:
        for i, child in enumerate(node.get("list", node.get("tuple"))):
            _tensors_at(child, obj[i], out)
    elif "tensor" in node:
        out[node["tensor"]] = obj
