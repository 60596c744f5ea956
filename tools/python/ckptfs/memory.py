"""torch and NumPy memory as the engine takes it: dtype names, where a
value's elements lie (address, size, device), which targets are writable,
and putting a value into a writer or reading one out of a reader."""

from __future__ import annotations

import bisect
import builtins
import sys
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ._core import InvalidArgumentError
from .shards import Box, Flat, Shard

_TORCH_NAMES = [
    ("bool", "BOOL"), ("uint8", "U8"), ("int8", "I8"), ("int16", "I16"), ("int32", "I32"),
    ("int64", "I64"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
    ("float16", "F16"), ("bfloat16", "BF16"), ("float32", "F32"), ("float64", "F64"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
]
_module: Any = None
TORCH_TO_NAME: Dict[Any, str] = {}
NAME_TO_TORCH: Dict[str, Any] = {}


def torch_module():
    """torch, or None when it cannot be imported (NumPy-only use)."""
    global _module
    if _module is None:
        try:
            import torch  # noqa: PLC0415
        except ImportError:
            _module = False
        else:
            _module = torch
            for attr, name in _TORCH_NAMES:
                dt = getattr(torch, attr, None)  # newer dtypes exist only in newer torch
                if dt is not None:
                    TORCH_TO_NAME[dt] = name
                    NAME_TO_TORCH[name] = dt
    return _module or None


def is_tensor(value) -> bool:
    # No torch tensor exists before torch is imported, so NumPy-only use
    # never pays for importing it (about a second).
    if "torch" not in sys.modules:
        return False
    torch = torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


def numpy_name(dtype) -> Optional[str]:
    if dtype.kind == "b":
        return "BOOL"
    if dtype.kind in "iuf" and dtype.itemsize in (1, 2, 4, 8):
        name = {"i": "I", "u": "U", "f": "F"}[dtype.kind] + str(8 * dtype.itemsize)
        return None if name == "F8" else name
    return None


class Memory:
    """Where a value's elements lie: dtype name, shape, address, size, device
    (-1 for host memory), and the object that keeps the memory alive."""

    __slots__ = ("dtype", "shape", "address", "nbytes", "device", "keep")

    def __init__(self, dtype, shape, address, nbytes, device, keep):
        self.dtype, self.shape, self.address, self.nbytes, self.device, self.keep = (
            dtype, shape, address, nbytes, device, keep)


def device_index(tensor, what: str) -> int:
    if tensor.device.type == "cpu":
        return -1
    if tensor.device.type == "cuda":
        return tensor.device.index if tensor.device.index is not None else torch_module().cuda.current_device()
    raise InvalidArgumentError(f"{what} is on device '{tensor.device}'; ckptfs reads CPU and CUDA tensors")


def source_memory(value, what: str) -> Memory:
    """The memory of a value to save (a contiguous copy when it is not)."""
    if is_tensor(value):
        t = value.detach()
        if t.layout != torch_module().strided:
            raise InvalidArgumentError(f"{what} has layout {t.layout}; only dense (strided) tensors can be saved")
        name = TORCH_TO_NAME.get(t.dtype)
        if name is None:
            raise InvalidArgumentError(f"{what} has dtype {t.dtype}, which ckptfs does not store")
        device = device_index(t, what)
        if not t.is_contiguous():
            t = t.contiguous()
        return Memory(name, tuple(t.shape), t.data_ptr(), t.numel() * t.element_size(), device, t)
    import numpy as np  # noqa: PLC0415

    if isinstance(value, (np.ndarray, np.generic)):
        a = np.asarray(value)
        name = numpy_name(a.dtype)
        if name is None:
            raise InvalidArgumentError(f"{what} has dtype {a.dtype}, which ckptfs does not store")
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
        return Memory(name, tuple(a.shape), a.__array_interface__["data"][0], a.nbytes, -1, a)
    raise InvalidArgumentError(
        f"{what} is a {type(value).__name__}; values are torch tensors, NumPy arrays or bytes "
        "(serialize other state into bytes)")


def writable_mappings() -> List[Tuple[int, int]]:
    """The address ranges [start, end) of this process's writable mappings,
    sorted, adjacent ones merged (Linux's /proc/self/maps)."""
    ranges: List[Tuple[int, int]] = []
    try:
        with builtins.open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split(None, 2)[:2]
                if "w" not in perms:
                    continue
                lo, hi = (int(x, 16) for x in span.split("-"))
                if ranges and ranges[-1][1] == lo:
                    ranges[-1] = (ranges[-1][0], hi)
                else:
                    ranges.append((lo, hi))
    except OSError:
        return []
    return ranges


def check_writable(address: int, nbytes: int, what: str, mappings: List[Tuple[int, int]]) -> None:
    """Raises InvalidArgumentError unless [address, address + nbytes) lies
    inside one writable mapping (merged runs count as one)."""
    if nbytes == 0 or not mappings:
        return
    lo = bisect.bisect_right(mappings, (address, float("inf"))) - 1
    if lo < 0 or not (mappings[lo][0] <= address and address + nbytes <= mappings[lo][1]):
        raise InvalidArgumentError(f"{what} is read-only memory (a read-only mapping, such as a file opened "
                                   "with mmap for reading); load into a writable tensor")


class Target:
    """A load target's memory: the target itself when it is contiguous,
    otherwise a contiguous scratch copied into it by finish()."""

    def __init__(self, target, what: str, mappings: Optional[List[Tuple[int, int]]] = None):
        self.target = target
        self.scratch = None
        if is_tensor(target):
            t = target.detach()
            name = TORCH_TO_NAME.get(t.dtype)
            if name is None:
                raise InvalidArgumentError(f"{what} has dtype {t.dtype}, which ckptfs does not store")
            device = device_index(t, what)
            if t.layout != torch_module().strided:
                raise InvalidArgumentError(f"{what} has layout {t.layout}; load targets are dense tensors")
            if any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
                raise InvalidArgumentError(f"{what} has elements that share memory (an expanded tensor); "
                                           "load into a tensor of its own, such as t.clone()")
            if device < 0 and mappings is not None:
                # The whole storage the view reaches: a write through it would
                # crash the process (SIGSEGV) on a read-only mapping.
                check_writable(t.data_ptr(), t.numel() * t.element_size() if t.is_contiguous() else
                                t.untyped_storage().nbytes() - t.storage_offset() * t.element_size(), what, mappings)
            if not t.is_contiguous():
                self.scratch = t = torch_module().empty(t.shape, dtype=t.dtype, device=t.device)
            self.memory = Memory(name, tuple(t.shape), t.data_ptr(), t.numel() * t.element_size(), device, t)
            return
        import numpy as np  # noqa: PLC0415

        if not isinstance(target, np.ndarray):
            raise InvalidArgumentError(
                f"{what} is a {type(target).__name__}; load targets are torch tensors or NumPy arrays")
        if not target.flags.writeable:
            raise InvalidArgumentError(f"{what} is a read-only array")
        if any(s == 0 and n > 1 for s, n in zip(target.strides, target.shape)):
            raise InvalidArgumentError(f"{what} has elements that share memory (a broadcast view); "
                                       "load into an array of its own, such as a.copy()")
        name = numpy_name(target.dtype)
        if name is None:
            raise InvalidArgumentError(f"{what} has dtype {target.dtype}, which ckptfs does not store")
        a = target
        if not a.flags.c_contiguous or a.dtype.byteorder == ">":
            self.scratch = a = np.empty(a.shape, dtype=a.dtype.newbyteorder("="))
        self.memory = Memory(name, tuple(a.shape), a.__array_interface__["data"][0], a.nbytes, -1, a)

    def finish(self):
        if self.scratch is None:
            return
        if is_tensor(self.target):
            with torch_module().no_grad():
                self.target.copy_(self.scratch)
        else:
            self.target[...] = self.scratch


def region(shard: Optional[Shard], memory: Memory, what: str):
    """(global shape, kind, offsets, start) of a value saved or loaded as `shard`."""
    if shard is None:
        return memory.shape, "whole", [], 0
    if isinstance(shard, Box):
        if len(shard.offsets) != len(memory.shape):
            raise InvalidArgumentError(
                f"{what}: {shard!r} has rank {len(shard.offsets)}, the tensor has shape {list(memory.shape)}")
        return shard.global_shape, "box", list(shard.offsets), 0
    if isinstance(shard, Flat):
        return shard.global_shape, "flat", [], shard.start
    raise InvalidArgumentError(f"{what}: shards must be ckptfs.Box or ckptfs.Flat, not {type(shard).__name__}")


def nbytes(value) -> int:
    """Bytes of a state-dict value or load target (for progress reports)."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    if is_tensor(value):
        return value.numel() * value.element_size()
    return int(getattr(value, "nbytes", 0))


def put_value(writer, key: str, value, shard: Optional[Shard], sharded: bool, kept: List[Memory],
              stage: bool = False) -> None:
    """Puts one state-dict entry into a core writer; device memory that the
    commit still has to copy is appended to `kept`. With `stage` (an
    asynchronous save), large host values are copied and hashed and encoded
    from the copy in the background."""
    what = f"'{key}'"
    if isinstance(value, (bytes, bytearray, memoryview)):
        if sharded:
            raise InvalidArgumentError(f"{what} is bytes (a blob) and cannot be a shard")
        if isinstance(value, memoryview) and not value.c_contiguous:
            value = value.tobytes()  # its bytes in logical order, whatever the strides
        writer.put_blob(key, value)
        return
    memory = source_memory(value, what)
    global_shape, kind, offsets, start = region(shard, memory, what)
    if memory.device >= 0:
        kept.append(memory)
    writer.put(key, memory.dtype, list(global_shape), kind, list(memory.shape), offsets, start, memory.address,
               memory.nbytes, memory.device, stage)


def read_value(reader, key: str, target, shard: Optional[Shard],
                mappings: Optional[List[Tuple[int, int]]] = None) -> None:
    """Fills one load target from a core reader."""
    t = Target(target, f"target '{key}'", mappings)
    m = t.memory
    global_shape, kind, offsets, start = region(shard, m, f"target '{key}'")
    reader.read(key, m.dtype, list(global_shape), kind, list(m.shape), offsets, start, m.address, m.nbytes, m.device)
    t.finish()


def sync_cuda(memories: Iterable[Memory]) -> None:
    """Waits for the work queued on the CUDA devices holding these tensors,
    so the copies ckptfs makes on its own stream see their final values."""
    devices = {m.device for m in memories if m.device >= 0}
    for d in devices:
        torch_module().cuda.synchronize(d)
