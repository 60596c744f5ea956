"""Shards: how a rank's tensor lies in the global tensor it is part of."""

from __future__ import annotations

from typing import Sequence, Union

from ._core import InvalidArgumentError

class Box:
    """A shard that is an N-d box of a global tensor.

    ``global_shape`` is the whole tensor's shape and ``offsets`` the global
    index of the shard's first element; the box's lengths are the shape of
    the tensor or array it is given with (tensor parallelism, DTensor).
    """

    __slots__ = ("global_shape", "offsets")

    def __init__(self, global_shape: Sequence[int], offsets: Sequence[int]):
        self.global_shape = tuple(int(d) for d in global_shape)
        self.offsets = tuple(int(o) for o in offsets)
        if len(self.offsets) != len(self.global_shape):
            raise InvalidArgumentError(
                f"Box offsets {list(self.offsets)} do not match the rank of global shape {list(self.global_shape)}"
            )

    def __repr__(self) -> str:
        return f"Box(global_shape={list(self.global_shape)}, offsets={list(self.offsets)})"


class Flat:
    """A shard that is a run of a global tensor's row-major elements.

    ``global_shape`` is the whole tensor's shape and ``start`` the index of
    the run's first element in the flattened tensor; its length is the
    number of elements of the tensor or array it is given with (FSDP/ZeRO
    flat parameters, which split tensors at arbitrary elements).
    """

    __slots__ = ("global_shape", "start")

    def __init__(self, global_shape: Sequence[int], start: int):
        self.global_shape = tuple(int(d) for d in global_shape)
        self.start = int(start)
        if self.start < 0:
            raise InvalidArgumentError(f"Flat start {self.start} is negative")

    def __repr__(self) -> str:
        return f"Flat(global_shape={list(self.global_shape)}, start={self.start})"


Shard = Union[Box, Flat]
