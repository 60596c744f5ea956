"""The tensors of a directory of files written through ``ckptfs://``, for
its commit: a DCP directory's (its ``.metadata`` names each saved chunk's
file and archive), or those of its safetensors files (their headers) and
torch.save files (their pickles, read restricted), become tensors of the
checkpoint, whose shards reference the chunks the
files already hold. The files stay as they are, so the
directory reads back byte for byte, and the checkpoint also shows whole
tensors (the mount, ``load``, ``ckpt export``).

A tensor is taken only when every saved chunk of it lies raw in its file
(one torch.save archive per chunk, as DCP's file writers save it) and was
stored as a unit (ckptfs._units): anything else (another writer's layout,
compressed items, files written by builds that cut them by content) leaves
that tensor to the files alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from ._streams import RangeReader
from ._units import safetensors_entries, safetensors_header_length
from .pickles import load_dcp_metadata

TensorShard = Tuple[str, str, List[int], List[int], List[int], str, str, int]
_READERS = 8  # archives read at once from an object store


class _BlobSlice(RangeReader):
    """Bytes [offset, offset + length) of a stored blob as a seekable stream
    (one DCP item), each read checked against its chunks' ids. torch's
    archive reader makes dozens of small reads at its start and its end:
    they are served from two windows of _WINDOW bytes, read once each."""

    _WINDOW = 16 << 10

    def __init__(self, blobs: Any, blob: str, offset: int, length: int):
        super().__init__(length)
        self._blobs, self._blob, self._start = blobs, blob, offset
        self._windows: List[Tuple[int, bytes]] = []  # (start in the slice, bytes), newest last

    def _fill(self, pos: int, out: memoryview) -> int:
        n = out.nbytes
        if n <= self._WINDOW // 4:
            out[:] = self._window(pos, n)
        else:
            self._blobs.read_into(self._blob, self._start + pos, out)
        return n

    def _window(self, pos: int, n: int) -> memoryview:
        for start, data in self._windows:
            if start <= pos and pos + n <= start + len(data):
                return memoryview(data)[pos - start:pos - start + n]
        # A window ending at the slice's end when the read is near it (the
        # archive's central directory), else one starting at the read.
        start = max(0, min(pos, self._len - self._WINDOW))
        data = self._blobs.read(self._blob, self._start + start, min(self._WINDOW, self._len - start))
        self._windows = self._windows[-1:] + [(start, data)]
        return memoryview(data)[pos - start:pos - start + n]


class _Files:
    """The checkpoints a directory's files lie in, each opened once (its
    manifest read, a read lease taken) for everything that looks into them."""

    def __init__(self, repo: Any):
        self.remote = str(getattr(repo, "path", "")).startswith("s3://")
        self._repo = repo
        self._opened: Dict[str, Any] = {}

    def __call__(self, checkpoint: str) -> Any:
        if checkpoint not in self._opened:
            self._opened[checkpoint] = self._repo.blobs(checkpoint)
        return self._opened[checkpoint]


def _dcp_tensors(blobs_of: _Files, members: Dict[str, Tuple[str, str]]) -> List[TensorShard]:
    """Shards (Repository.compose's `tensors`) of the tensors of a DCP
    directory whose files are `members` (name in the directory ->
    (checkpoint, blob) holding it); [] when it is not one, or none can be
    taken. The metadata is read with the restricted unpickler: a hostile
    ``.metadata`` runs nothing."""
    where = members.get(".metadata")
    if where is None:
        return []
    try:
        import torch  # noqa: PLC0415 - DCP directories come from torch
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata  # noqa: PLC0415

        from .formats.common import ckptfs_dtype  # noqa: PLC0415
        from .formats.dcp_in import raw_tensor_in  # noqa: PLC0415
    except ImportError:
        return []
    try:
        metadata = load_dcp_metadata(blobs_of(where[0]).read(where[1]), ".metadata")
        state = metadata.state_dict_metadata
        storage = metadata.storage_data or {}
    except Exception:  # noqa: BLE001 - not DCP metadata this build reads: the files alone
        return []
    # Each saved chunk's archive is read on its own: a few small reads,
    # many at a time where each is a request to an object store.
    jobs = []  # (fqn, dtype, shape, chunk, info, checkpoint, blob, blobs)
    for fqn, m in state.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        try:
            dtype = ckptfs_dtype(m.properties.dtype)
        except Exception:  # noqa: BLE001 - a dtype ckptfs has no name for
            continue
        shape = [int(s) for s in m.size]
        for i, chunk in enumerate(m.chunks):
            info = storage.get(MetadataIndex(fqn, chunk.offsets, i))
            source = members.get(getattr(info, "relative_path", None) or "")
            if info is None or source is None:
                jobs.append((fqn, dtype, shape, chunk, None, "", "", None))
            else:
                jobs.append((fqn, dtype, shape, chunk, info, source[0], source[1], blobs_of(source[0])))

    def locate(job) -> Optional[TensorShard]:
        fqn, dtype, shape, chunk, info, checkpoint, blob, blobs = job
        if info is None:
            return None
        view = _BlobSlice(blobs, blob, int(info.offset), int(info.length))
        at = raw_tensor_in(torch, view, info, state[fqn].properties.dtype, chunk.sizes)
        if at is None:
            return None
        return (fqn, dtype, shape, [int(o) for o in chunk.offsets], [int(s) for s in chunk.sizes], checkpoint, blob,
                at)

    if blobs_of.remote:
        with ThreadPoolExecutor(max_workers=_READERS) as pool:
            located = list(pool.map(locate, jobs))
    else:  # local reads are quick: threads would only contend for the GIL
        located = [locate(job) for job in jobs]
    # A tensor is taken only with every one of its saved chunks.
    missing = {job[0] for job, shard in zip(jobs, located) if shard is None}
    return [shard for shard in located if shard is not None and shard[0] not in missing]


def _safetensors_tensors(blobs_of: _Files, members: Dict[str, Tuple[str, str]]) -> List[TensorShard]:
    """Shards (Repository.compose's `tensors`) of the tensors of the
    directory's safetensors files, each whole, named as in its file; a file
    whose header this build does not read is left out."""
    found: List[TensorShard] = []
    for member, (checkpoint, blob) in sorted(members.items()):
        if not member.endswith(".safetensors"):
            continue
        try:
            blobs = blobs_of(checkpoint)
            size = blobs.sizes[blob]
            header_len = safetensors_header_length(blobs.read(blob, 0, 8) if size >= 8 else b"", size)
            if not header_len:
                continue
            for name, dtype, shape, start, _ in safetensors_entries(blobs.read(blob, 8, header_len), size):
                found.append((name, dtype, shape, [0] * len(shape), shape, checkpoint, blob, start))
        except Exception:  # noqa: BLE001 - not a safetensors file this build reads: the file alone
            continue
    return found


def _torch_tensors(blobs_of: _Files, members: Dict[str, Tuple[str, str]]) -> List[TensorShard]:
    """Shards (Repository.compose's `tensors`) of the tensors of the
    directory's torch.save files (zip archives), each whole, named as
    ``ckpt import`` names them (keys joined with "."). A tensor is taken
    when it fills its storage, contiguous; a file the restricted reader
    leaves to torch.load (other globals than a state dict holds) is left
    out. Two tensors of one storage (tied weights) share its chunks."""
    try:
        from .formats import torch_zip  # noqa: PLC0415
        from .formats.torch_in import tensors_of  # noqa: PLC0415
    except ImportError:
        return []
    found: List[TensorShard] = []
    for member, (checkpoint, blob) in sorted(members.items()):
        if member.endswith((".distcp", ".safetensors", ".metadata")):
            continue
        try:
            blobs = blobs_of(checkpoint)
            size = blobs.sizes[blob]
            if size < 22 or blobs.read(blob, 0, 4) != b"PK\x03\x04":
                continue
            stream = _BlobSlice(blobs, blob, 0, size)
            obj = torch_zip.load(member, stream, size)
            archive_tensors = tensors_of(obj, member)
        except Exception:  # noqa: BLE001 - not an archive this reader takes: the file alone
            continue
        for name, t in archive_tensors.items():
            if not name or not isinstance(t, torch_zip.StoredTensor):
                continue
            record = t.archive.records.get(t.key)
            if record is None or t.offset != 0 or not t.contiguous() or t.nbytes != record[1]:
                continue
            shape = [int(d) for d in t.shape]
            found.append((name, t.dtype, shape, [0] * len(shape), shape, checkpoint, blob, t.archive.start(t.key)))
    return found


def directory_tensors(repo: Any, members: Dict[str, Tuple[str, str]]) -> List[TensorShard]:
    """The tensors a directory's commit gives its checkpoint: a DCP
    directory's, else those of its safetensors and torch.save files, where a
    name more than one file holds stays in the files."""
    blobs_of = _Files(repo)
    shards = _dcp_tensors(blobs_of, members)
    if shards:
        return shards
    shards = _safetensors_tensors(blobs_of, members) + _torch_tensors(blobs_of, members)
    files: Dict[str, set] = {}
    for shard in shards:
        files.setdefault(shard[0], set()).add((shard[5], shard[6]))
    return [shard for shard in shards if len(files[shard[0]]) == 1]


__all__ = ["directory_tensors"]
