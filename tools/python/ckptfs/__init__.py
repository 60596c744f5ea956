"""ckptfs: save and load training state in a ckptfs repository.

A repository keeps checkpoints of named tensors (and named byte blobs),
deduplicated and compressed. Each rank of a job saves its part (whole
tensors, or shards: a ``Box`` of the global tensor or a ``Flat`` run of its
row-major elements); the checkpoint becomes visible when the last rank has
committed. Any region of any tensor can be loaded back, at any sharding.

    import ckptfs, torch
    repo = ckptfs.init("/data/ckpt")            # or ckptfs.open(...)
    repo.save("step-100", model.state_dict(), step=100)
    state = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    repo.load("step-100", state)

Values are torch tensors (CPU or CUDA), NumPy arrays, or bytes (blobs).
Errors raise ckptfs.Error subclasses whose text is the command-line tool's
one-line message. See docs/PYTHON.md.
"""

from __future__ import annotations

from . import _core
from ._core import (
    AlreadyExistsError,
    CollectiveError,
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
    StorageError,
    UnsupportedError,
)
from .repository import (  # noqa: A004
    Repository,
    SaveHandle,
    copy,
    cuda_available,
    init,
    new_save_attempt,
    open,
    release_staging_memory,
)
from .shards import Box, Flat, Shard
from .tiers import TierHandle, TieredRepository

__version__ = _core.__version__

__all__ = [
    "Box",
    "new_save_attempt",
    "release_staging_memory",
    "Flat",
    "Shard",
    "Repository",
    "SaveHandle",
    "TieredRepository",
    "TierHandle",
    "init",
    "open",
    "copy",
    "cuda_available",
    "Error",
    "NotFoundError",
    "InvalidArgumentError",
    "AlreadyExistsError",
    "CorruptionError",
    "StorageError",
    "UnsupportedError",
    "CollectiveError",
]
