"""A storage backend of torch_checkpointing (``torch-checkpointing`` on PyPI)
over a ckptfs repository::

    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from ckptfs.torch_checkpointing import CkptfsStorageConfig

    manager = CheckpointManager.Config(storage_config=CkptfsStorageConfig("/data/ckpt")).build()
    manager.save("/data/ckpt/step-100", {"model": model.state_dict()})   # or "step-100"

Checkpoint paths are inside the repository (absolute, or relative to it); a
directory is a checkpoint and its files are blobs, as for ``ckptfs://``
(ckptfs.filesystem). torch_checkpointing commits a save by renaming its
temporary directory into place: here that rename is one commit of a
manifest, with no byte copied, on a local and an S3 repository alike.
Reads return bytes checked against their chunks' ids.
"""

from __future__ import annotations

import io
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from ._core import InvalidArgumentError
from .filesystem import CkptfsFileSystem


@dataclass
class CkptfsStorageConfig(StorageConfig):
    """`repository`: a local path or s3://BUCKET/PREFIX, made with ckpt init."""

    repository: str = ""

    def create_storage(self) -> "CkptfsStorage":
        return CkptfsStorage(self)


class CkptfsStorage(Storage):
    def __init__(self, config: CkptfsStorageConfig):
        repository = os.fspath(config.repository).rstrip("/")
        if not repository:
            raise InvalidArgumentError("CkptfsStorageConfig needs the repository (a path or s3://BUCKET/PREFIX)")
        self._remote = repository.startswith("s3://")
        if not self._remote:
            repository = os.path.abspath(repository)
        self._repository = repository
        self._base = "ckptfs://" + (repository[len("s3://"):] if self._remote else repository)
        self._fs = CkptfsFileSystem(skip_instance_cache=True)

    def _url(self, path) -> str:
        p = os.fspath(path)
        if p.startswith("s3:/") and not p.startswith("s3://"):
            p = "s3://" + p[len("s3:/"):]  # pathlib folds the double slash
        if p == self._repository or p.startswith(self._repository + "/"):
            rel = p[len(self._repository):]
        elif not p.startswith("/") and "://" not in p:
            rel = p
        else:
            raise InvalidArgumentError(f"{p}: not inside the ckptfs repository {self._repository}")
        rel = posixpath.normpath("/" + rel).strip("/")
        return f"{self._base}/{rel}" if rel else self._base

    def stream_read(self, path: Path, read_args: Optional[ReadArgs] = None) -> io.RawIOBase:
        url = self._url(path)
        if read_args is None or read_args.pre_read_full_file:
            return io.BytesIO(self._fs.cat_file(url))
        return self._fs.open(url, "rb")

    def stream_write(self, path: Path) -> io.IOBase:
        return self._fs.open(self._url(path), "wb")

    def write(self, path: Path, data) -> None:
        with self._fs.open(self._url(path), "wb") as f:
            f.write(memoryview(data).cast("B"))

    def delete(self, path: Path) -> None:
        self._fs.rm_file(self._url(path))

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        self._fs.makedirs(self._url(path), exist_ok=True)

    def rmdir(self, path: Path) -> None:
        self._fs.rm(self._url(path), recursive=True)

    def rename(self, src_path: Path, dst_path: Path, is_directory: bool = False,
               background_cleanup: bool = False) -> None:
        self._fs.mv(self._url(src_path), self._url(dst_path), recursive=is_directory)

    def ls(self, path: Path) -> List[str]:
        return [posixpath.basename(n) for n in self._fs.ls(self._url(path), detail=False)]

    def exists(self, path: Path) -> bool:
        return self._fs.exists(self._url(path))

    def getsize(self, path: Path) -> int:
        return int(self._fs.info(self._url(path))["size"])

    def isdir(self, path: Path) -> bool:
        return self._fs.isdir(self._url(path))

    def remap_path(self, path: Path) -> str:
        return self._url(path)


__all__ = ["CkptfsStorageConfig", "CkptfsStorage"]
