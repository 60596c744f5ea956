"""torch.distributed.checkpoint (DCP) storage backed by a ckptfs repository.

    import torch.distributed.checkpoint as dcp
    from ckptfs.torch import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter("/data/ckpt", "step-100"))
    dcp.load(state_dict, storage_reader=StorageReader("/data/ckpt", "step-100"))

    # or one writer for every step, naming each checkpoint as DCP does:
    writer = StorageWriter("/data/ckpt")
    dcp.save(state_dict, storage_writer=writer, checkpoint_id="step-200")

Every rank writes its items as one rank of ckptfs checkpoint `name` (rank and
world size from the default process group); tensor chunks become box shards
of their global tensors, non-tensor items (pickled by DCP) become blobs. The
coordinator commits last, after DCP's finish, so the checkpoint becomes
visible only when the whole save succeeded. The result is deduplicated,
compressed and readable like any other checkpoint (mount, export, np.load).

The reader builds DCP's metadata from the checkpoint's records, one whole
chunk per tensor (ckptfs merges shards on read), so any ckptfs checkpoint,
however it was saved, loads at any sharding; no pickled metadata is stored.

Needs torch >= 2.4; with an older torch, constructing either class raises
ckptfs.UnsupportedError.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from typing import Any, Dict, List, Optional, Union

import ckptfs
from ckptfs import UnsupportedError
from ckptfs.memory import NAME_TO_TORCH, put_value, read_value, sync_cuda, torch_module, writable_mappings
from ckptfs import _core

__all__ = ["StorageWriter", "StorageReader", "dcp_unavailable_reason"]


def dcp_unavailable_reason() -> Optional[str]:
    """None when this torch has the DCP storage interfaces ckptfs implements
    (torch >= 2.4); otherwise why not."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return "torch is not installed"
    try:
        major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    except ValueError:
        return f"cannot read torch version '{torch.__version__}'"
    if (major, minor) < (2, 4):
        return f"ckptfs.torch needs torch >= 2.4 (torch.distributed.checkpoint); this is torch {torch.__version__}"
    try:
        import torch.distributed.checkpoint  # noqa: F401, PLC0415
    except ImportError as e:
        return f"torch.distributed.checkpoint cannot be imported: {e}"
    return None


_REASON = dcp_unavailable_reason()

# The engine's rule for checkpoint names (engine/ckpt/repository.cc):
# '/'-separated parts, none starting with '.', the last not digits only when
# there are groups.
_PART = r"[A-Za-z0-9_-][A-Za-z0-9._-]*"
_NAME = re.compile(rf"(?=.{{1,200}}$){_PART}(?:/{_PART})*")
_GROUPED_DIGITS = re.compile(r"/[0-9]+$")
_TRAILING_NUMBER = re.compile(r"([0-9]+)$")


def _under_repository(path: str, url: str) -> str:
    """`path` (a checkpoint_id) relative to the repository at `url` when it
    is a path inside it (DCP's checkpoint_id is a directory: /repo/run1/step-100
    is checkpoint run1/step-100 of /repo); else `path` as given."""
    if url.startswith("s3://"):
        base = url.rstrip("/") + "/"
        return path[len(base):] if path.startswith(base) else path
    if not (os.path.isabs(path) or path.startswith(".")):
        return path  # a name
    full, base = os.path.abspath(path), os.path.abspath(url)
    if not full.startswith(base + os.sep):
        raise ckptfs.InvalidArgumentError(f"checkpoint_id {path!r} is a path outside the repository at {url!r}: "
                                          "give a checkpoint name, or a path inside the repository")
    return os.path.relpath(full, base).replace(os.sep, "/")


def _checkpoint_name(checkpoint_id: Union[str, os.PathLike], url: Optional[str] = None) -> str:
    name = os.fspath(checkpoint_id)
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_id must be a str or a path, not {type(name).__name__}")
    if url is not None:
        name = _under_repository(name, url)
    if not _NAME.fullmatch(name) or _GROUPED_DIGITS.search(name):
        raise ckptfs.InvalidArgumentError(
            f"checkpoint_id {name!r} is not a checkpoint name (1 to 200 letters, digits, '.', '_', '-', and '/' "
            "between groups such as run1/step-100; no part starting with '.', and the last part of a grouped "
            "name not digits only)")
    return name


def _rank_and_world() -> "tuple[int, int]":
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rank_in(group) -> int:
    import torch.distributed as dist  # noqa: PLC0415

    return dist.get_rank(group)


if _REASON is None:
    import torch
    from torch.distributed.checkpoint import storage as _storage
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
    from torch.futures import Future

    _WriterBase: Any = _storage.StorageWriter
    _ReaderBase: Any = _storage.StorageReader
else:
    _WriterBase = object
    _ReaderBase = object


class StorageWriter(_WriterBase):
    """Writes a DCP save as checkpoint `name` of the repository at `url`.

    A checkpoint_id given to dcp.save names the checkpoint instead, so one
    writer serves every step. `tags` are recorded with the checkpoint, and
    `step` too; without `step`, a name that ends in digits (step-000300)
    records that number as its step. `blobs` ({name: bytes}) are stored as
    they are beside DCP's items, by the coordinator: a model's config.json
    there makes the mounted checkpoint loadable with from_pretrained.

    `overwrite` (True, as with DCP's FileSystemWriter) replaces a checkpoint
    the name already holds when the save commits, in one step: readers of
    the old version keep it until they are done. False refuses to save a
    committed name (AlreadyExistsError).

    `fast_tier` (a local directory on this host) makes `url` the shared
    tier of two (ckptfs.open's fast_tier, keep_last): the save commits to
    the fast tier and drains to `url` in the background; after dcp.save,
    `tiers` is the save's TierHandle. With `replicas` (and replica_jump,
    replica_strategy, as ckptfs.open's), call replicate() on every rank
    once dcp.save has returned: DCP has no step of its own after every
    rank's commit.
    """

    def __init__(self, url: Union[str, os.PathLike], name: Optional[str] = None, *, step: Optional[int] = None,
                 tags: Optional[dict] = None, blobs: Optional[Dict[str, bytes]] = None,
                 cache_dir: Optional[Union[str, os.PathLike]] = None, overwrite: bool = True,
                 fast_tier: Optional[Union[str, os.PathLike]] = None, keep_last: int = 2, replicas: int = 1,
                 replica_jump: Optional[int] = None, replica_strategy: str = "ring", process_group: Any = None,
                 timeout: Optional[float] = None):
        if _REASON is not None:
            raise UnsupportedError(_REASON)
        super().__init__()
        self.url = os.fspath(url)
        self.name = name
        self.step = step
        self.tags = dict(tags or {})
        self.blobs = {str(k): bytes(v) for k, v in (blobs or {}).items()}
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        if not isinstance(overwrite, bool):
            raise ckptfs.InvalidArgumentError(f"overwrite must be True or False, not {type(overwrite).__name__}")
        self.overwrite = overwrite
        self.fast_tier = None if fast_tier is None else os.fspath(fast_tier)
        self.keep_last = keep_last
        self.replicas, self.replica_jump, self.replica_strategy = replicas, replica_jump, replica_strategy
        # The group replicate() exchanges over (default: the default group,
        # DCP's); it does not travel with a pickled writer.
        self.process_group, self.timeout = process_group, timeout
        self._tiers = None
        self.tiers = None  # the last save's TierHandle, with a fast tier
        if self.fast_tier is None:
            if replicas != 1:
                raise ckptfs.InvalidArgumentError("replicas are kept in fast tiers: give fast_tier too")
            self._repo = ckptfs.open(self.url, cache_dir=self.cache_dir)
        else:
            self._tiers = ckptfs.open(self.url, cache_dir=self.cache_dir, fast_tier=self.fast_tier,
                                      keep_last=keep_last, replicas=replicas, replica_jump=replica_jump,
                                      replica_strategy=replica_strategy)
            self._repo = self._tiers.fast
        self._writer = None
        self._kept: List[Any] = []
        self._is_coordinator = False

    # dcp.async_save in a process sends the writer there pickled: it carries
    # its settings, and the new process opens the repository again.
    def __getstate__(self):
        return {"url": self.url, "name": self.name, "step": self.step, "tags": self.tags, "blobs": self.blobs,
                "cache_dir": self.cache_dir, "overwrite": self.overwrite, "fast_tier": self.fast_tier,
                "keep_last": self.keep_last, "replicas": self.replicas, "replica_jump": self.replica_jump,
                "replica_strategy": self.replica_strategy}

    def __setstate__(self, state):
        self.__init__(state["url"], state["name"], step=state["step"], tags=state["tags"], blobs=state["blobs"],
                      cache_dir=state.get("cache_dir"), overwrite=state.get("overwrite", True),
                      fast_tier=state.get("fast_tier"), keep_last=state.get("keep_last", 2),
                      replicas=state.get("replicas", 1), replica_jump=state.get("replica_jump"),
                      replica_strategy=state.get("replica_strategy", "ring"))

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.name = _checkpoint_name(checkpoint_id, self.url)
        self._abort()

    def replicate(self) -> Dict[str, int]:
        """Keeps copies of this rank's part of the last save in its peers'
        fast tiers (ckptfs.open's replicas): a collective call, made by
        every rank after dcp.save (or the async save's future) returned.
        Returns what it cost; the save's handle (`tiers`) then says
        "replicated". Raises on every rank when any rank's copy failed."""
        if self._tiers is None or self.tiers is None:
            raise ckptfs.InvalidArgumentError("replicate() follows a dcp.save with this writer and a fast_tier")
        group = self.process_group
        if group is None:
            group = torch.distributed.group.WORLD
        self.tiers.replicas = self._tiers._replicate(self.tiers.name, group, self.timeout)
        return self.tiers.replicas

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """Whether checkpoint_id can name a checkpoint of a repository."""
        try:
            _checkpoint_name(checkpoint_id)
        except (ckptfs.InvalidArgumentError, TypeError):
            return False
        return True

    def _step(self) -> Optional[int]:
        if self.step is not None:
            return self.step
        m = _TRAILING_NUMBER.search(self.name or "")
        return int(m.group(1)) if m else None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        # The checkpoint this rank writes travels to the coordinator with
        # its plan: ranks naming different ones would each leave a part of
        # a checkpoint that never completes, and return as if saved.
        return dataclasses.replace(plan, storage_data=self.name)

    def prepare_global_plan(self, plans):
        names = [p.storage_data for p in plans]
        for r, other in enumerate(names):
            if other != names[0]:
                raise ckptfs.InvalidArgumentError(
                    f"rank 0 saves checkpoint '{names[0]}' and rank {r} saves '{other}': every rank of a DCP save "
                    "names the same checkpoint (give each rank's StorageWriter, or dcp.save, the same checkpoint_id)")
        # One attempt for every rank of this save: a job restarted after a
        # crash makes a new one, which takes over the name from the crashed
        # job's pending ranks instead of joining them.
        attempt = _core.new_save_attempt()
        return [dataclasses.replace(p, storage_data=attempt) for p in plans]

    def write_data(self, plan, planner):
        if self.name is None:
            raise ckptfs.InvalidArgumentError("no checkpoint name: give StorageWriter a name, or dcp.save a checkpoint_id")
        rank, world = _rank_and_world()
        attempt = plan.storage_data if isinstance(plan.storage_data, str) else ""
        writer = self._repo._repo.begin(self.name, rank, world, self._step(),
                                        [(str(k), str(v)) for k, v in self.tags.items()], attempt=attempt,
                                        overwrite=self.overwrite)
        self._writer = writer
        results = []
        try:
            for item in plan.items:
                fqn = item.index.fqn
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    payload = data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)
                    put_value(writer, fqn, bytes(payload), None, False, self._kept)
                    size = len(payload)
                else:
                    chunk = item.tensor_data.chunk
                    tensor = data.detach()
                    shard = ckptfs.Box(tuple(item.tensor_data.size), tuple(chunk.offsets))
                    put_value(writer, fqn, tensor, shard, True, self._kept)
                    size = tensor.numel() * tensor.element_size()
                results.append(_storage.WriteResult(index=item.index, size_in_bytes=size, storage_data=fqn))
            if self._is_coordinator:
                for blob_name, data in self.blobs.items():
                    put_value(writer, blob_name, data, None, False, self._kept)
            else:
                self._commit()  # the coordinator commits in finish(), last
        except BaseException:
            self._abort()
            raise
        future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata, results) -> None:
        # DCP's metadata is not stored: the reader rebuilds it from the
        # records. The nesting it flattened is (formats.STRUCTURE_BLOB), so
        # that exports give the state back nested ({"model": ..., "optim":
        # ...}) and know which blobs are DCP's items, not a release's files.
        from ckptfs import formats  # noqa: PLC0415

        structure = formats.structure_of_dcp_metadata(metadata)
        if structure is not None and self._writer is not None and \
                formats.STRUCTURE_BLOB not in metadata.state_dict_metadata:
            try:
                put_value(self._writer, formats.STRUCTURE_BLOB, json.dumps(structure).encode(), None, False, self._kept)
            except BaseException:
                self._abort()
                raise
        self._commit()

    def storage_meta(self):
        return None

    # DCP's AsyncStager: dcp.async_save stages the state dict through the
    # writer. Tensors' storages are copied into buffers of the save's own
    # (_core.StagingBuffer, at the blocking copy's cost), which the writer
    # then lends to the engine as they are: nothing changes them, so its
    # threads hash and encode them in place rather than copy each chunk.
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        return _stager().stage(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _commit(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        sync_cuda(self._kept)
        handle = writer.commit(snapshot=False)
        self._kept = []
        handle.wait(None)
        handle.result()
        if self._tiers is not None:
            self.tiers = self._tiers._saved(self.name)

    def _abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        self._writer = None
        self._kept = []


def _stager():
    """A new stager for one dcp.async_save: DCP's StateDictStager (which
    copies any state dict: nested containers, DTensors, shared storages),
    with every storage of _core.STAGE_MIN_BYTES and more copied into a
    _core.StagingBuffer (memory kept from the last save, when there is).
    A new one per save: a stager reused would copy the next save into
    buffers the last one may still be encoding."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager  # noqa: PLC0415

    class Stager(StateDictStager):
        staged_bytes = 0

        def _stage_untyped_storage(self, storage, non_blocking=False):
            n = storage.nbytes()
            if n < _core.STAGE_MIN_BYTES:
                return super()._stage_untyped_storage(storage, non_blocking=non_blocking)
            self.staged_bytes += n
            _core.note_staged_save(self.staged_bytes)  # as much may be kept for the next save
            buffer = _core.StagingBuffer(n)
            staged = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()  # keeps `buffer`
            if storage.device.type == "cpu":
                buffer.copy_from(storage.data_ptr(), n)  # without the GIL
            else:
                staged.copy_(storage)
            return staged

    return Stager()


def _stored_dtype_buffer(fqn: str, stored: str, target):
    """`target` itself when it has the stored dtype, else a new tensor of
    its shape, on its device, in the stored dtype, to read into and then
    copy_ from (the conversion DCP's FileSystemReader makes)."""
    torch = torch_module()
    dtype = NAME_TO_TORCH.get(stored)
    if dtype is None:
        raise UnsupportedError(f"tensor '{fqn}' is {stored}, which torch {torch.__version__} has no dtype for")
    if target.dtype == dtype:
        return target
    return torch.empty(target.shape, dtype=dtype, device=target.device)


class StorageReader(_ReaderBase):
    """Reads checkpoint `name` of the repository at `url` for dcp.load, at
    any sharding. A checkpoint_id given to dcp.load names the checkpoint
    instead, so one reader serves every step. With `fast_tier`, `url` is
    the shared tier of two (as StorageWriter's): each chunk is read from
    this host's fast tier when it holds it intact. With `replicas` (as the
    writer's) and a process group, a rank whose fast tier lacks its part
    (a replaced host) first gets it back from a peer's copy; `restored`
    says what came back."""

    def __init__(self, url: Union[str, os.PathLike], name: Optional[str] = None, *,
                 cache_dir: Optional[Union[str, os.PathLike]] = None, process_group: Any = None,
                 timeout: Optional[float] = None, fast_tier: Optional[Union[str, os.PathLike]] = None,
                 replicas: int = 1, replica_jump: Optional[int] = None, replica_strategy: str = "ring"):
        if _REASON is not None:
            raise UnsupportedError(_REASON)
        super().__init__()
        self.url = os.fspath(url)
        self.name = name
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        # With a process group, the repository is opened with one listing of
        # its store for the group, and read_data is collective
        # (ckptfs.collective): each distinct region is fetched by one rank
        # and sent to the others.
        self.process_group = process_group
        self.timeout = timeout
        self.fast_tier = None if fast_tier is None else os.fspath(fast_tier)
        self._tiers = None
        self.restored: Optional[Dict[str, Any]] = None
        if self.fast_tier is None:
            if replicas != 1:
                raise ckptfs.InvalidArgumentError("replicas are kept in fast tiers: give fast_tier too")
            self._repo = ckptfs.open(self.url, cache_dir=self.cache_dir, process_group=process_group,
                                     timeout=timeout)
        else:
            self._tiers = ckptfs.open(self.url, cache_dir=self.cache_dir, process_group=process_group,
                                      timeout=timeout, fast_tier=self.fast_tier, replicas=replicas,
                                      replica_jump=replica_jump, replica_strategy=replica_strategy)
            self._repo = self._tiers.shared

    def __getstate__(self):
        # A process group does not travel: an unpickled reader reads alone.
        return {"url": self.url, "name": self.name, "cache_dir": self.cache_dir, "fast_tier": self.fast_tier}

    def __setstate__(self, state):
        self.__init__(state["url"], state["name"], cache_dir=state.get("cache_dir"), fast_tier=state.get("fast_tier"))

    def _source(self):
        """(repository, nearer core repositories) that checkpoint `name` is
        read from."""
        if self._tiers is None:
            return self._repo, []
        repo, nearer, _where = self._tiers._source(self.name)
        return repo, nearer

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.name = _checkpoint_name(checkpoint_id, self.url)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """Whether checkpoint_id can name a checkpoint of a repository."""
        return StorageWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any):
        if self.name is None:
            raise ckptfs.InvalidArgumentError("no checkpoint name: give StorageReader a name, or dcp.load a checkpoint_id")
        shown = self._source()[0].show(self.name)
        torch_module()  # fills the dtype tables
        entries = {}
        for t in shown["tensors"]:
            dtype = NAME_TO_TORCH.get(t["dtype"])
            if dtype is None:
                raise UnsupportedError(f"tensor '{t['name']}' is {t['dtype']}, which torch {torch.__version__} lacks")
            size = torch.Size(t["shape"])
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
            entries[t["name"]] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=size,
                                                       chunks=[chunk])
        for b in shown["blobs"]:
            entries[b["name"]] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=entries)

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        # With a process group the job holds one read lease, rank 0's
        # (ckptfs.collective takes it for the tensors); the other ranks read
        # their blobs under it, or fail clearly if the checkpoint was
        # removed and collected first, never with other bytes.
        lease = self.process_group is None or _rank_in(self.process_group) == 0
        if self._tiers is not None and self._tiers.replicas > 1 and self.process_group is not None:
            # Parts this host lost come back from peers first (every rank
            # is here); a failure leaves those ranks to the shared tier.
            try:
                self.restored = self._tiers._replicate(self.name, self.process_group, self.timeout, back=True)
            except ckptfs.Error as e:
                self.restored = {"error": str(e)}
        repo, nearer = self._source()
        reader = repo._repo.open_checkpoint(self.name, lease=lease, nearer=nearer)
        mappings = writable_mappings()
        together = []  # (item, tensor name, target, box) for a collective read
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(reader.blob(fqn)))
                continue
            info_dtype, shape = reader.tensor_info(fqn)
            base = item.storage_index.offset or torch.Size([0] * len(shape))
            offsets = tuple(int(b) + int(o) for b, o in zip(base, item.storage_offsets))
            target = planner.resolve_tensor(item).detach()  # a view into the state dict; filled in place
            if tuple(target.shape) != tuple(item.lengths):
                raise ckptfs.InvalidArgumentError(
                    f"DCP asked for {list(item.lengths)} elements of '{fqn}' into a target of shape {list(target.shape)}")
            box = ckptfs.Box(tuple(shape), offsets)
            # A target of another dtype is filled as DCP's FileSystemReader
            # fills it: the stored values, converted by copy_.
            read_into = _stored_dtype_buffer(fqn, info_dtype, target)
            if self.process_group is not None:
                together.append((item, fqn, target, box, read_into))
                continue
            read_value(reader, fqn, read_into, box, mappings)
            if read_into is not target:
                target.copy_(read_into)
            planner.commit_tensor(item, target)
        if self.process_group is not None:
            from . import collective  # noqa: PLC0415

            group = collective.Group(self.process_group, self.timeout, f"dcp.load of '{self.name}'")
            collective.load_items(repo, self.name, [(fqn, buf, box) for _i, fqn, _t, box, buf in together],
                                  group, nearer=nearer)
            for item, _fqn, target, _box, read_into in together:
                if read_into is not target:
                    target.copy_(read_into)
                planner.commit_tensor(item, target)
        future = Future()
        future.set_result(None)
        return future
