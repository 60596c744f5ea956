"""Repositories: opening and creating them (init, open, copy), saving and
loading checkpoints (Repository), and the handles of saves in flight
(SaveHandle). The package's face, ckptfs/__init__.py, re-exports what is
public here."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union,
                    overload)

from . import _core, memory
from ._core import AlreadyExistsError, Error, InvalidArgumentError, NotFoundError, UnsupportedError
from .shards import Shard

if TYPE_CHECKING:
    from .tiers import TieredRepository


def new_save_attempt() -> str:
    """A new save attempt for save's and async_save's `attempt`: make one
    per save, on one rank, and give it to every rank of that save."""
    return _core.new_save_attempt()


def release_staging_memory() -> int:
    """Frees the host memory that async_save keeps from one save for the
    next (its copies of CPU tensors, kept so that the next save touches no
    new memory; at most what one save staged). Returns the bytes freed.
    Saves in flight keep theirs."""
    return _core.release_staging_memory()


def group_name(group: Optional[str]) -> str:
    """A group of checkpoint names as given ("run1", "run1/"), as the
    engine takes it ("run1"; "" for none)."""
    if group is None:
        return ""
    if not isinstance(group, str):
        raise InvalidArgumentError(f"group must be a string, not {type(group).__name__}")
    return group.rstrip("/") or group


def _check_names(kind: str, names: Iterable[Any]) -> None:
    for n in names:
        if not isinstance(n, str):
            raise InvalidArgumentError(f"{kind} names must be str, not {type(n).__name__} ({n!r})")


# ---- saves in flight ----------------------------------------------------------------

def _checked_shards(values: Any, what: str, holding: str, where: str, shards: Optional[Mapping[str, Shard]]) -> dict:
    """`shards` as a dict, once `values` is a mapping (`what`, of
    `holding`) of valid tensor names and every shard names one of them."""
    if not isinstance(values, Mapping):
        raise InvalidArgumentError(f"{what} must be a mapping of {holding}, not {type(values).__name__}")
    shards = dict(shards or {})
    _check_names("tensor", values.keys())
    unknown = sorted(set(shards) - set(values))
    if unknown:
        raise InvalidArgumentError(f"shards names {unknown} that are not in {where}")
    return shards


_in_flight: "set[SaveHandle]" = set()
_in_flight_lock = threading.Lock()


def _forget_parents_saves() -> None:
    # A forked child has none of its parent's save threads: it must neither
    # wait for those saves at exit nor find the lock held by a parent thread.
    global _in_flight_lock
    _in_flight.clear()
    _in_flight_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parents_saves)


@atexit.register
def _finish_saves_at_exit() -> None:
    # A save handed to the background finishes before the interpreter exits.
    with _in_flight_lock:
        pending = list(_in_flight)
    for h in pending:
        h._core.wait(None)


class SaveHandle:
    """A save in progress (from Repository.async_save).

    The tensors passed to async_save have been copied or consumed when it
    returns; the checkpoint is durable (and visible, when this was the last
    rank) once result() returns.
    """

    def __init__(self, core_handle, blocking_seconds: float):
        self._core = core_handle
        self._blocking = blocking_seconds
        with _in_flight_lock:
            _in_flight.add(self)

    @property
    def blocking_seconds(self) -> float:
        """Seconds the async_save call blocked the caller."""
        return self._blocking

    def done(self) -> bool:
        """True once the save has finished, successfully or not."""
        return self._core.done()

    def result(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Waits until the save is durable and returns its summary
        (checkpoint_visible, chunks_written, chunks_deduplicated,
        logical_bytes, stored_bytes). Raises the save's error, or
        TimeoutError when `timeout` seconds pass first."""
        if not self._core.wait(timeout):
            raise TimeoutError(f"the save did not finish within {timeout} s")
        with _in_flight_lock:
            _in_flight.discard(self)
        return self._core.result()


# ---- the repository ------------------------------------------------------------------


class CheckpointBlobs:
    """The blobs of one committed checkpoint (Repository.blobs)."""

    def __init__(self, core_reader, name: str):
        self._reader = core_reader
        self.name = name
        self.sizes: Dict[str, int] = dict(core_reader.blobs())
        """Blob name -> size in bytes."""

    def read(self, blob: str, offset: int = 0, size: Optional[int] = None) -> bytes:
        """`size` bytes of `blob` from `offset` (to its end when None),
        verified against their chunks' ids."""
        total = self._size(blob)
        if size is None:
            size = total - offset
        if size < 0 or offset < 0 or offset + size > total:
            raise InvalidArgumentError(f"a read of {size} bytes at {offset} of blob '{blob}' of checkpoint "
                                       f"'{self.name}' ({total} bytes)")
        return self._reader.read_blob_bytes(blob, offset, size) if size else b""

    def _size(self, blob: str) -> int:
        total = self.sizes.get(blob)
        if total is None:
            raise NotFoundError(f"checkpoint '{self.name}' has no blob '{blob}'")
        return total

    def read_into(self, blob: str, offset: int, out: Any) -> None:
        """Fills the writable buffer `out` with bytes of `blob` from `offset`."""
        view = memoryview(out).cast("B")
        total = self._size(blob)
        if offset < 0 or offset + len(view) > total:
            raise InvalidArgumentError(f"bytes {offset}..{offset + len(view)} are outside blob '{blob}' "
                                       f"({total} bytes) of checkpoint '{self.name}'")
        if len(view):
            self._reader.read_blob(blob, offset, view)


class Repository:
    """A ckptfs repository. Obtain one with ckptfs.init or ckptfs.open.

    Thread safety: one Repository may be used by many threads; calls that do
    I/O release the GIL. Opening one repository twice in a process shares
    one engine instance.
    """

    def __init__(self, core_repo):
        self._repo = core_repo

    def __repr__(self) -> str:
        return f"ckptfs.Repository({self._repo.path!r})"

    @property
    def path(self) -> str:
        """The repository's location."""
        return self._repo.path

    @property
    def config(self) -> Dict[str, Any]:
        """chunk_size, pack_size, compression, level, adaptive."""
        return self._repo.config

    # -- save --

    def _put_all(self, name, state_dict, step, rank, world_size, shards, tags, progress=None, skip=(), group=None,
                 attempt=None, overwrite=False, stage=False):
        shards = _checked_shards(state_dict, "state_dict", "names to values", "the state dict", shards)
        begin = (name, int(rank), int(world_size), None if step is None else int(step),
                 [(str(k), str(v)) for k, v in (tags or {}).items()])
        if attempt is not None and not isinstance(attempt, str):
            raise InvalidArgumentError(f"attempt must be a string, not {type(attempt).__name__}")
        if not isinstance(overwrite, bool):
            raise InvalidArgumentError(f"overwrite must be True or False, not {type(overwrite).__name__}")
        if group is None:
            writer = self._repo.begin(*begin, attempt=attempt or "", overwrite=overwrite)
        else:
            from . import collective  # noqa: PLC0415

            writer, error = collective.begin(self._repo, begin, group, attempt or "", overwrite)
            if writer is None:
                group.agree("put the values", error)  # raises on every rank
        kept = []  # device memory must stay alive until the commit has copied it
        total = sum(memory.nbytes(v) for v in state_dict.values()) if progress else 0
        done = 0
        try:
            for key, value in state_dict.items():
                if key in skip:
                    continue  # another rank of the group puts the same region
                memory.put_value(writer, key, value, shards.get(key), key in shards, kept, stage)
                if progress:
                    done += memory.nbytes(value)
                    progress(done, total)
        except BaseException as e:
            writer.abort()
            if group is not None and isinstance(e, Error):
                group.agree("put the values", str(e))  # raises on every rank
            raise
        if group is not None:
            try:
                group.agree("put the values", None)  # no rank commits unless every rank's puts succeeded
            except BaseException:
                writer.abort()
                raise
        return writer, kept

    def _put_and_commit(self, name, state_dict, step, rank, world_size, shards, tags, *, snapshot, progress=None,
                        process_group=None, verify_replicas=False, timeout=None, attempt=None, overwrite=False):
        """Puts everything and starts the commit; the core's save handle,
        the collective plan's figures and the group (both None without a
        process group). CUDA tensors stay referenced until the commit has
        copied them."""
        skip, plan, group = (), None, None
        if process_group is not None:
            from . import collective  # noqa: PLC0415

            group = collective.Group(process_group, timeout, f"collective save of '{name}'")
            if (rank, world_size) not in ((0, 1), (group.rank, group.size)):
                raise InvalidArgumentError(f"rank {rank} of {world_size} disagrees with the process group "
                                           f"(rank {group.rank} of {group.size}); leave them out")
            rank, world_size = group.rank, group.size
            skip, plan = collective.plan_save(state_dict, dict(shards or {}), group, verify_replicas, name)
        writer, kept = self._put_all(name, state_dict, step, rank, world_size, shards, tags, progress, skip, group,
                                     attempt, overwrite, stage=snapshot)
        memory.sync_cuda(kept)
        return writer.commit(snapshot=snapshot), plan, group

    def save(self, name: str, state_dict: Mapping[str, Any], *, step: Optional[int] = None, rank: int = 0,
             world_size: int = 1, shards: Optional[Mapping[str, Shard]] = None,
             tags: Optional[Mapping[str, str]] = None,
             progress: Optional[Callable[[int, int], None]] = None, process_group: Any = None,
             verify_replicas: bool = False, timeout: Optional[float] = None,
             attempt: Optional[str] = None, overwrite: bool = False) -> Dict[str, Any]:
        """Saves this rank's part of checkpoint `name` and returns once it is durable.

        state_dict maps names to torch tensors (CPU or CUDA), NumPy arrays
        or bytes (blobs). A tensor is whole unless shards[name] is a Box or
        Flat saying which part of a global tensor it is. With world_size N,
        the checkpoint becomes visible when all N ranks have saved; their
        shards must tile every tensor exactly (replicas with equal bytes are
        allowed). Returns this rank's summary (checkpoint_visible,
        chunks_written, chunks_deduplicated, logical_bytes, stored_bytes).
        Raises AlreadyExistsError when `name` is committed, InvalidArgumentError
        for values, shards or ranks that do not fit. `progress(done_bytes,
        total_bytes)`, when given, is called after each value is consumed.

        With `process_group` (a torch.distributed group; rank and world
        size come from it), the ranks plan together first: a region several
        ranks hold (replicas) is hashed, encoded and written by one of them
        only, balanced by bytes; the result's "collective" gives the plan's
        unique_bytes, held_bytes and bytes_per_rank. `verify_replicas`
        compares the replicas' bytes first and raises naming the tensor
        where they differ. A rank that fails or dies makes every rank raise
        CollectiveError within `timeout` seconds (default 300), naming the
        step; nothing becomes visible. (docs/PYTHON.md, "Collective saves
        and restores".)

        `attempt` (new_save_attempt()'s, the same on every rank of one save)
        lets a job restarted after a crash save the name again: the crashed
        job's pending ranks are dropped, never merged with the new ones, at
        any world size, and a rank of the older attempt is refused
        (ckptfs.Error). A collective save makes one itself. Without
        it, ranks join a pending checkpoint saved without one.

        `overwrite=True` replaces a committed `name` when this save commits,
        in one step (readers of the old version keep reading it; gc
        collects it once they are done) instead of raising
        AlreadyExistsError. A save of several ranks without a process group
        needs its `attempt` then.
        """
        handle, plan, group = self._put_and_commit(name, state_dict, step, rank, world_size, shards, tags,
                                                   snapshot=False, progress=progress, process_group=process_group,
                                                   verify_replicas=verify_replicas, timeout=timeout, attempt=attempt,
                                                   overwrite=overwrite)
        handle.wait(None)
        try:
            result = handle.result()
        except Error as e:
            if group is None:
                raise
            group.agree("commit", str(e))  # raises on every rank
            raise
        if group is not None:
            group.agree("commit", None)  # rank 0's commit completes the checkpoint: every rank hears how it went
            result["collective"] = plan
        return result

    def async_save(self, name: str, state_dict: Mapping[str, Any], *, step: Optional[int] = None, rank: int = 0,
                   world_size: int = 1, shards: Optional[Mapping[str, Shard]] = None,
                   tags: Optional[Mapping[str, str]] = None,
                   progress: Optional[Callable[[int, int], None]] = None, process_group: Any = None,
                   verify_replicas: bool = False, timeout: Optional[float] = None,
                   attempt: Optional[str] = None, overwrite: bool = False) -> SaveHandle:
        """Like save, but returns as soon as the caller may modify its
        tensors: CPU tensors and arrays of 256 KiB and more have been copied
        to host memory of the save's own, smaller ones and blobs hashed and
        encoded, CUDA tensors copied to pinned host memory. The rest
        (hashing and compressing the copies, writes, fsync, commit) runs in
        the background; the copies' memory is kept for the next save
        (release_staging_memory frees it). Wait for it with the handle's
        result(). Saves still running when the
        interpreter exits are finished first. `process_group`,
        `verify_replicas`, `timeout`, `attempt` and `overwrite` are as for save: the
        planning and the puts happen before this returns.
        """
        start = time.perf_counter()
        handle, _plan, _group = self._put_and_commit(name, state_dict, step, rank, world_size, shards, tags,
                                                     snapshot=True, progress=progress, process_group=process_group,
                                                     verify_replicas=verify_replicas, timeout=timeout,
                                                     attempt=attempt, overwrite=overwrite)
        return SaveHandle(handle, time.perf_counter() - start)

    # -- load --

    def load(self, name: str, targets: Mapping[str, Any], *, shards: Optional[Mapping[str, Shard]] = None,
             progress: Optional[Callable[[int, int], None]] = None, process_group: Any = None,
             timeout: Optional[float] = None, _nearer=()):
        """Fills pre-allocated tensors or arrays from checkpoint `name`.

        targets maps tensor names to CPU or CUDA tensors or NumPy arrays. A
        target receives the whole tensor, or, when shards[name] is a Box or
        Flat, that region of the global tensor: any sharding, whatever the
        sharding it was saved at. Raises NotFoundError for an unknown
        checkpoint or tensor, InvalidArgumentError when a target's dtype or
        shape does not match. Returns `targets`. `progress(done_bytes,
        total_bytes)`, when given, is called after each target is filled.

        With `process_group`, every rank of the group calls load together
        (each with its own targets, torch tensors): the union of their
        needs is planned once, each distinct region is fetched from the
        store by one rank needing it (balanced by bytes) and sent to the
        others over the group. Failures raise CollectiveError on every rank
        within `timeout` seconds, naming the step.
        """
        shards = _checked_shards(targets, "targets", "names to tensors", "targets", shards)
        if process_group is not None:
            from . import collective  # noqa: PLC0415

            group = collective.Group(process_group, timeout, f"collective load of '{name}'")
            collective.load(self, name, targets, shards, group, progress, nearer=_nearer)
            return targets
        reader = self._repo.open_checkpoint(name, True, list(_nearer))
        mappings = memory.writable_mappings()  # read once per load: targets may be any memory
        total = sum(memory.nbytes(t) for t in targets.values()) if progress else 0
        done = 0
        for key, target in targets.items():
            memory.read_value(reader, key, target, shards.get(key), mappings)
            if progress:
                done += memory.nbytes(target)
                progress(done, total)
        return targets

    def tensor(self, name: str, tensor_name: str, *, device: Any = "cpu"):
        """The whole tensor `tensor_name` of checkpoint `name`, merged from
        its shards, as a new torch tensor of its stored dtype on `device`."""
        torch = memory.torch_module()
        if torch is None:
            raise UnsupportedError("Repository.tensor needs torch; load into a NumPy array with Repository.load")
        reader = self._repo.open_checkpoint(name)
        dtype_name, shape = reader.tensor_info(tensor_name)
        dtype = memory.NAME_TO_TORCH.get(dtype_name)
        if dtype is None:
            raise UnsupportedError(
                f"tensor '{tensor_name}' is {dtype_name}, which torch {torch.__version__} has no dtype for")
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
        memory.read_value(reader, tensor_name, out, None)
        return out

    def resume_point(self, which: str = "latest", *, process_group: Any = None,
                     timeout: Optional[float] = None, group: Optional[str] = None) -> Optional[Dict[str, Any]]:
        """The committed checkpoint to resume from, as checkpoints() lists
        it: "latest" (the newest committed, of `group` when given: "run1"
        for run1/step-100 and the like; None when there is none) or a
        name (NotFoundError when it is not committed). With
        `process_group`, rank 0 alone asks the repository and every rank of
        the group gets the same answer (or the same error): one resume
        point for the whole job, however the hosts' catalogs lag."""
        from . import collective  # noqa: PLC0415

        together = None
        if process_group is not None:
            together = collective.Group(process_group, timeout, f"resume point '{which}'")
        return collective.resume_point(self, which, together, group_name(group))

    def store_counters(self) -> Dict[str, int]:
        """What this Repository object has cost its store so far:
        chunks_fetched and stored_bytes_fetched (chunks loads read from
        packs; the cache's hits are not counted again), and requests to an
        object store (get_requests, list_requests, put_requests, requests;
        zero for a local repository)."""
        return self._repo.store_counters()

    def blob(self, name: str, blob_name: str) -> bytes:
        """The bytes of blob `blob_name` of checkpoint `name`."""
        return self._repo.open_checkpoint(name).blob(blob_name)

    def blobs(self, name: str, *, lease: bool = True) -> "CheckpointBlobs":
        """The blobs of checkpoint `name`, their sizes and their bytes by
        range. With `lease` (the default) the bytes stay readable while the
        object lives, even if the checkpoint is removed meanwhile."""
        return CheckpointBlobs(self._repo.open_checkpoint(name, lease=bool(lease)), name)

    def compose(self, name: str, blobs: Sequence[Tuple[str, str, str]], *, step: Optional[int] = None,
                tags: Optional[Mapping[str, str]] = None, overwrite: bool = False,
                tensors: Sequence[Tuple[str, str, Sequence[int], Sequence[int], Sequence[int], str, str, int]] = (),
                ) -> Dict[str, Any]:
        """Commits checkpoint `name` made of blobs of other committed
        checkpoints: each of `blobs` is (checkpoint, blob, name in the new
        one). No byte is copied: the new checkpoint references the same
        chunks, so this costs one commit whatever the sizes. Returns what
        save returns. `overwrite` is as for save.

        `tensors` adds tensor shards whose bytes lie in such blobs, each
        (tensor, dtype, shape, box offsets, box lengths, checkpoint, blob,
        byte offset): the box's elements in row-major order from that offset,
        starting and ending at chunk boundaries of the blob (a tensor of a
        file written through ckptfs://). The shards of each tensor must tile
        it."""
        shards = [(str(t), str(d), [int(x) for x in shape], [int(x) for x in offsets], [int(x) for x in lengths],
                   str(c), str(b), int(at)) for t, d, shape, offsets, lengths, c, b, at in tensors]
        return self._repo.compose(name, [(str(c), str(b), str(a)) for c, b, a in blobs],
                                  None if step is None else int(step),
                                  [(str(k), str(v)) for k, v in (tags or {}).items()], bool(overwrite), shards)

    # -- inspect and maintain --

    def refresh(self) -> None:
        """Brings this host's view of an S3 repository up to date with the
        store (one listing), so that checkpoints other hosts committed or
        removed since it was opened show in checkpoints(). Nothing to do for
        a local repository, which every process sees as it is."""
        self._repo.refresh()

    def checkpoints(self, *, include_pending: bool = False, group: Optional[str] = None) -> List[Dict[str, Any]]:
        """Committed checkpoints in commit order (pending ones too when asked),
        with the fields of `ckpt ls --json`; with `group` ("run1"), those of
        that group only (run1/step-100, run1/eval/step-3)."""
        listed = self._repo.checkpoints(bool(include_pending))
        group = group_name(group)
        if not group:
            return listed
        return [c for c in listed if c["name"].startswith(group + "/")]

    def import_safetensors(self, name: str, paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]], *,
                           step: Optional[int] = None, rank: int = 0, world_size: int = 1,
                           tags: Optional[Mapping[str, str]] = None,
                           blobs: Optional[Mapping[str, Union[str, os.PathLike]]] = None,
                           follow_symlinks: bool = False, overwrite: bool = False) -> Dict[str, Any]:
        """Imports safetensors files, or Hugging Face model directories (as
        save_pretrained writes them), as this rank's part of checkpoint
        `name`, as `ckpt import` does: a directory gives its *.safetensors
        files as tensors, checked against its *.safetensors.index.json, and
        every other file as a blob of the same name. `blobs` maps more blob
        names to files. Every input is read and checked before anything is
        written. Returns what save returns, plus `left_out`: the
        subdirectories and hidden files of a directory that were skipped.
        A symbolic link in a directory is followed only if it stays inside
        it; one to elsewhere raises InvalidArgumentError naming it, unless
        `follow_symlinks`. Files of /proc, /sys and the like are refused.
        `overwrite` is as for save."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        return self._repo.import_safetensors(
            name, [os.fspath(p) for p in paths], [(str(k), os.fspath(v)) for k, v in (blobs or {}).items()],
            int(rank), int(world_size), None if step is None else int(step),
            [(str(k), str(v)) for k, v in (tags or {}).items()], bool(follow_symlinks), overwrite=bool(overwrite))

    def pending_ranks(self, name: str) -> List[Dict[str, Any]]:
        """For pending checkpoint `name` of an S3 repository, each rank that
        began its save: `rank`, `committed`, `host`, `pid`,
        `started_unix_ms` (`ranks_started` of `ckpt show NAME --json`).
        Ranks not listed never began. Empty for a local repository;
        NotFoundError when no checkpoint of that name is pending."""
        return self._repo.pending_ranks(name)

    def show(self, name: str) -> Dict[str, Any]:
        """Checkpoint `name` with its tensors, shards and blobs: the fields of
        `ckpt show --json`."""
        # The manifest alone: no chunk is read, so no read lease is taken
        # (a lease costs a PUT and a DELETE on an object store).
        return self._repo.open_checkpoint(name, lease=False).show()

    def rm(self, *names: str) -> None:
        """Removes checkpoints, all or none (NotFoundError when any is
        unknown). Their space is reclaimed by gc."""
        if len(names) == 1 and not isinstance(names[0], str):
            names = tuple(names[0])
        _check_names("checkpoint", names)
        self._repo.rm(list(names))

    def gc(self, *, keep_last: Optional[int] = None, keep_every: Optional[int] = None,
           keep_within: Union[str, int, float, None] = None, keep: Sequence[str] = (),
           allow_removing_newest: bool = False, dry_run: bool = False,
           rewrite_below: float = 0.5, on_phase: Optional[Callable[[str], None]] = None,
           progress: Optional[Callable[[int, int], None]] = None, group: Optional[str] = None,
           thin_older_than: Optional[int] = None, thin_keep: Sequence[str] = ()) -> Dict[str, Any]:
        """Applies a retention policy (keep the newest `keep_last`, steps that
        are multiples of `keep_every`, those committed within `keep_within`
        of the newest — a duration such as "36h" or "1w2d", or seconds — and
        the names in `keep`; without any, nothing is removed), then reclaims
        the space no checkpoint uses. A policy that would remove the newest
        committed checkpoint, or every one, raises ckptfs.Error
        and removes nothing unless `allow_removing_newest` is true.
        `on_phase(line)` is called as each phase starts ("waiting for saves
        in progress", "deleting 12 packs"), `progress(done_bytes,
        total_bytes)` while packs are rewritten; both run between gc's steps
        and must not use the repository. With `group` ("run1"), the policy
        applies to the checkpoints of that group only (run1/step-100, ...),
        and the newest is the group's.

        With `thin_older_than` N, every checkpoint kept but the newest N
        keeps only its model: its optimizer, scheduler and RNG state are
        dropped (or, with `thin_keep`, every tensor and blob whose name
        matches none of those shell patterns), and their space reclaimed.
        A thinned checkpoint replaces the whole one atomically, stays
        loadable, and carries the tag "ckptfs.thinned" (`show(name)["thinned"]`, `checkpoints()`).
        Returns the fields of `ckpt gc --json` ("thinned" lists the
        checkpoints thinned).

        On a fast tier (a directory that names a shared tier: ckptfs.open's
        fast_tier), no rule removes a checkpoint with a rank not yet drained
        to the shared tier, as with `ckpt gc`."""
        if isinstance(keep, str):
            keep = [keep]
        if isinstance(thin_keep, str):
            thin_keep = [thin_keep]
        if thin_older_than is not None and (isinstance(thin_older_than, bool) or thin_older_than < 1):
            raise InvalidArgumentError(f"thin_older_than: {thin_older_than!r} is not at least 1")
        if keep_within is not None and not isinstance(keep_within, str):
            if isinstance(keep_within, bool) or keep_within < 0:
                raise InvalidArgumentError(f"keep_within: {keep_within!r} is not a duration")
            keep_within = f"{int(keep_within)}s"
        held: List[Tuple[str, str]] = []
        shared_url = None if "://" in self.path else _core.read_shared_tier(self.path)
        if shared_url is not None:
            held = self._repo.undrained(open(shared_url)._repo)
        return self._repo.gc(keep_last, keep_every, keep_within, list(keep), bool(allow_removing_newest),
                             bool(dry_run), float(rewrite_below), on_phase, progress, group_name(group),
                             thin_older_than, list(thin_keep), held)

    def stats(self, name: str, tensors: Sequence[str] = ()) -> List[Dict[str, Any]]:
        """Statistics of the tensors `tensors` of checkpoint `name` (every
        tensor when empty), each read in one streaming pass: name, dtype,
        elements, nan_count, inf_count, zero_count, and over the finite
        elements min, max, mean, std (None when none is finite) and l2_norm,
        as `ckpt show NAME --stats --json` prints them."""
        if isinstance(tensors, str):
            tensors = [tensors]
        _check_names("tensor", tensors)
        return self._repo.stats(name, list(tensors))

    def verify(self, name: Optional[str] = None) -> Dict[str, Any]:
        """Re-reads and re-hashes every chunk (of `name`, or of every
        checkpoint) and checks every tensor is tiled; the report's `ok` is
        False and `problems` lists what is wrong otherwise; `bad_chunks`
        lists the stored chunks that fail their id, each with the
        checkpoints using it. The same report as `ckpt verify --json`."""
        return self._repo.verify(name)

    def diff(self, a: str, b: str, *, all: bool = False) -> List[Dict[str, Any]]:  # noqa: A002
        """Compares checkpoints `a` and `b` tensor by tensor, then blob by
        blob, as `ckpt diff --json` does: for each, name, kind ("tensor" or
        "blob"), status ("unchanged", "changed", "removed", "added",
        "dtype/shape changed"), changed, shared_fraction (of a's bytes, in
        chunks b also holds), chunks and changed_chunks, and for float
        tensors max_abs_diff, mean_abs_diff and relative_l2 (None when not
        computed; "inf" for an infinite difference). Unchanged ones are
        left out unless `all`. Tensors whose chunk lists are equal are not
        read."""
        return [d for d in self._repo.diff(a, b) if all or d["changed"]]

    def du(self, *names: str, by_kind: bool = False) -> Dict[str, Any]:
        """The space `names` use (every committed checkpoint when none are
        given), as `ckpt du --json` reports it: "checkpoints" (each one's
        logical, referenced and exclusive bytes) and "total" (logical,
        unique, referenced and pack bytes, pending and removed ones,
        garbage, what a gc would reclaim now, dedup and compression
        ratios). Runs a dry run of gc to say what it would reclaim. With
        `by_kind`, also "kinds" as `ckpt du --by-kind --json` gives them:
        per kind of state (weights_16bit, weights_fp32, adam_exp_avg,
        adam_exp_avg_sq, other) its tensors, logical bytes, the decoded and
        stored bytes of its distinct chunks, and stored_fraction."""
        _check_names("checkpoint", names)
        if not isinstance(by_kind, bool):
            raise InvalidArgumentError(f"by_kind must be True or False, not {type(by_kind).__name__}")
        return self._repo.du(list(names), by_kind)


def init(url: str, *, chunk_size: int = 4 << 20, pack_size: int = 256 << 20, compression: str = "zstd",
         level: int = 1, adaptive: bool = True, threads: int = 0, cache_bytes: int = 512 << 20,
         cache_dir: Optional[str] = None, io_threads: int = 0) -> Repository:
    """Creates a repository at `url` (an empty or missing directory, whose
    missing parents are made too, or s3://BUCKET/PREFIX) and opens it.

    chunk_size: bytes per chunk, a multiple of 8 in [64 KiB, 256 MiB];
    pack_size: a pack file is sealed at this size; compression: "zstd" or
    "none"; level: zstd level; adaptive: store raw while the disk is idle.
    threads, cache_bytes, cache_dir and io_threads are as for open().
    """
    _core.Repository.init(url, int(chunk_size), int(pack_size), compression, int(level), bool(adaptive),
                          _path_or_empty(cache_dir))
    return open(url, threads=threads, cache_bytes=cache_bytes, cache_dir=cache_dir, io_threads=io_threads)


@overload
def open(url: str, *, threads: int = ..., cache_bytes: int = ..., cache_dir: Optional[str] = ...,  # noqa: A001
         io_threads: int = ..., process_group: Any = ..., timeout: Optional[float] = ..., fast_tier: None = ...,
         keep_last: int = ..., on_drain_phase: Optional[Callable[[str], None]] = ..., replicas: int = ...,
         replica_jump: Optional[int] = ..., replica_strategy: str = ...) -> Repository: ...


@overload
def open(url: str, *, threads: int = ..., cache_bytes: int = ..., cache_dir: Optional[str] = ...,  # noqa: A001
         io_threads: int = ..., process_group: Any = ..., timeout: Optional[float] = ...,
         fast_tier: Union[str, "os.PathLike[str]"], keep_last: int = ...,
         on_drain_phase: Optional[Callable[[str], None]] = ..., replicas: int = ...,
         replica_jump: Optional[int] = ..., replica_strategy: str = ...) -> "TieredRepository": ...


def open(url: str, *, threads: int = 0, cache_bytes: int = 512 << 20,  # noqa: A001
         cache_dir: Optional[str] = None, io_threads: int = 0, process_group: Any = None,
         timeout: Optional[float] = None, fast_tier: Optional[Union[str, "os.PathLike[str]"]] = None,
         keep_last: int = 2, on_drain_phase: Optional[Callable[[str], None]] = None, replicas: int = 1,
         replica_jump: Optional[int] = None, replica_strategy: str = "ring") -> Union[Repository, "TieredRepository"]:
    """Opens the repository at `url`: a local directory, or
    s3://BUCKET/PREFIX on an S3 store (endpoint and credentials from
    AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or the AWS
    profile files, as the ckpt command finds them).

    threads: worker threads for hashing, compression and reads (0: one per
    core); cache_bytes: bound of the decoded-chunk cache; cache_dir: where
    this host keeps the catalog of a repository on S3 (default:
    $CKPT_CACHE_DIR, else a directory per repository under
    ~/.cache/ckptfs); io_threads: requests to an S3 store sent at once by
    one operation, such as reading pack indexes (0: 16). Raises
    NotFoundError when there is no repository there.

    process_group: open it on every rank of this torch.distributed group
    together (a collective call; every rank calls it). On S3, rank 0 alone
    lists the store and fetches the new manifests, and the other ranks
    bring their catalogs to the same state from what it sends, so a job's
    restart lists the store once, not once per process. An error on any
    rank raises CollectiveError on every rank, within `timeout` seconds
    (default 300) when a rank is gone.

    fast_tier: a local directory on this host to save to first (made when
    missing): returns a TieredRepository (ckptfs.tiers) whose saves commit
    there at local speed and drain to `url`, the shared tier, in the
    background. keep_last: checkpoints the fast tier keeps (it drops older
    ones once they are durable in the shared tier, never before);
    on_drain_phase(line): called as the drain goes. replicas: copies of
    each rank's part kept in fast tiers (its own and replicas - 1 peers'),
    made by saves with a process_group; replica_jump: ranks from a rank to
    its first peer (default: the ranks per host, so copies leave the
    host); replica_strategy: "ring" (rank r's copies go to r + jump,
    r + 2*jump, ...) or "clique" (ranks r, r + jump, ... form a group of
    `replicas` that each keep every member's part). docs/PYTHON.md, "Two
    tiers".
    """
    if fast_tier is not None:
        from .tiers import open_tiers  # noqa: PLC0415

        return open_tiers(url, fast_tier, keep_last=keep_last, on_phase=on_drain_phase, replicas=replicas,
                          replica_jump=replica_jump, replica_strategy=replica_strategy, threads=threads,
                          cache_bytes=cache_bytes, cache_dir=cache_dir, io_threads=io_threads,
                          process_group=process_group, timeout=timeout)

    def open_core(opening_sync: bool = True):
        return _core.Repository.open(url, int(threads), int(cache_bytes), _path_or_empty(cache_dir),
                                     int(io_threads), opening_sync)

    if process_group is None:
        return Repository(open_core())
    from . import collective  # noqa: PLC0415

    return Repository(collective.open_shared(open_core, collective.Group(process_group, timeout, "open")))


def copy(source: Union[str, Repository], destination: Union[str, Repository],
         names: Union[str, Sequence[str], None] = None, *, all: bool = False,  # noqa: A002
         last: Optional[int] = None, on_phase: Optional[Callable[[str], None]] = None,
         progress: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
    """Copies checkpoints from `source` to `destination` (repositories, or
    the URLs or paths to open), as `ckpt copy SRC DST` does: `names`, or
    every committed checkpoint (all=True), or the newest `last`. Only the
    chunks the destination lacks are sent, as they are stored, each checked
    against its hash first; a checkpoint the destination has already is
    skipped, and one an interrupted copy left pending there is finished.

    Returns the report `ckpt copy --json` prints: per checkpoint its
    outcome ("copied" or "present") and the chunks and bytes sent and found
    present, and the totals. on_phase(line) and progress(done, total) (in
    logical bytes) are called as the copy goes.
    """
    if isinstance(names, str):
        names = [names]
    names = list(names or [])
    _check_names("checkpoint", names)
    if (1 if names else 0) + (1 if all else 0) + (1 if last is not None else 0) != 1:
        raise InvalidArgumentError("copy: give names, all=True or last=N (one of them)")
    if last is not None and (isinstance(last, bool) or int(last) < 1):
        raise InvalidArgumentError(f"copy: last must be at least 1, not {last!r}")
    src = source if isinstance(source, Repository) else open(os.fspath(source))
    dst = destination if isinstance(destination, Repository) else open(os.fspath(destination))
    return src._repo.copy_to(dst._repo, names, bool(all), None if last is None else int(last), on_phase, progress)


def _path_or_empty(path: Optional[str]) -> str:
    if path is None:
        return ""
    path = os.fspath(path)
    if not path:
        raise ValueError("cache_dir must not be empty (None: the default)")
    return path


def cuda_available() -> Tuple[bool, str]:
    """(available, reason): whether CUDA tensors can be staged by this
    build on this machine, and why not."""
    return _core.cuda_available()
