"""Collective saves and restores over a torch.distributed process group.

Given ``process_group=``, ``Repository.save``/``async_save`` and
``Repository.load`` plan together before touching a byte:

- save: rank 0 gathers every rank's list of what it holds (tensor,
  global shape, region, bytes; not the bytes themselves). Each region held
  by several ranks (replicas under DDP, HSDP, or a TP rank's layer norms)
  gets one owner, largest first to the least-loaded holder; only the owner
  hashes, encodes and writes it. The commit protocol and its tiling check
  are unchanged: the owners' parts tile every tensor.
- load: the union of the ranks' load plans is computed once; each distinct
  region is fetched, verified and decoded by one of the ranks needing it,
  balanced by bytes, then sent to the others over the group.

The plan is made once, on rank 0, by the engine (``_core.plan_save``,
``_core.plan_load``): every rank's list is gathered there and each rank is
sent its own part, so no rank receives every rank's list. The collective
steps are
driven here, by the layer that owns the process group, on a gloo group of
ckptfs's own with a bounded timeout (so planning holds no NCCL buffers, and
a dead rank makes every other rank fail within the timeout, naming the
step, instead of hanging).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import _core
from ._core import Error, InvalidArgumentError, UnsupportedError

# Seconds a collective step may wait for the slowest rank.
DEFAULT_TIMEOUT = 300.0

_groups: Dict[Tuple[int, float], Any] = {}


def _dist():
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError:
        raise UnsupportedError("process_group= needs torch.distributed") from None
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError("process_group= needs an initialized torch.distributed process group")
    return dist


class CollectiveError(Error):
    """A collective save or load failed on some rank; raised on every rank."""


class Group:
    """The ranks of the caller's process group, and a gloo group of the same
    ranks (with the timeout) for ckptfs's own exchanges."""

    def __init__(self, process_group, timeout: Optional[float], what: str):
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        dist = _dist()
        self.dist, self.what, self.timeout = dist, what, timeout
        self.user = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.user)
        self.size = dist.get_world_size(self.user)
        if self.rank < 0:
            raise InvalidArgumentError(f"{what}: this process is not a member of the process group")
        key = (id(self.user), float(timeout))
        group = _groups.get(key)
        # Group ranks as global ranks, for point-to-point sends.
        self.globals = dist.get_process_group_ranks(self.user)
        if group is None:
            # Only the members make it (use_local_synchronization), so a
            # subgroup of a larger job works too.
            group = dist.new_group(ranks=self.globals, backend="gloo", timeout=datetime.timedelta(seconds=timeout),
                                   use_local_synchronization=True)
            _groups[key] = group
        self.group = group

    def step(self, name: str, fn):
        """Runs collective step `name`; a failure (a timeout, a rank gone)
        becomes a CollectiveError naming the step."""
        try:
            return fn()
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError and others
            raise CollectiveError(f"{self.what}: the step '{name}' failed on rank {self.rank} of {self.size}: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None

    def user_has_nccl(self) -> bool:
        """Whether the caller's group moves CUDA tensors with NCCL (and
        CKPTFS_COLLECTIVE_NCCL=0 does not keep them off it)."""
        if os.environ.get("CKPTFS_COLLECTIVE_NCCL", "1") == "0":
            return False
        try:
            return "cuda:nccl" in self.dist.get_backend_config(self.user)
        except (ValueError, RuntimeError, KeyError):
            return False

    def wait(self, works: List[Any], on_device: bool) -> None:
        """Waits for point-to-point works. Host works (gloo) carry their
        group's timeout, and a peer gone fails them. A device work's wait
        (NCCL) only orders the current CUDA stream after it, so those are
        polled until done, for at most the timeout: a peer that never
        sends fails this rank instead of hanging it (the caller's group may
        then need to be torn down, as after any failed NCCL operation)."""
        if not on_device:
            for w in works:
                w.wait()
            return
        deadline = time.monotonic() + self.timeout
        while not all(w.is_completed() for w in works):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the device transfers did not complete within {self.timeout:g} s")
            time.sleep(0.001)
        for w in works:
            w.wait()

    def all_gather(self, name: str, obj) -> List[Any]:
        out: List[Any] = [None] * self.size
        self.step(name, lambda: self.dist.all_gather_object(out, obj, group=self.group))
        return out

    def plan_at_rank_0(self, name: str, error: Optional[str], entries: List[tuple], extra,
                       compute: Callable[[List[List[tuple]], List[Any]], List[Any]]):
        """This rank's part of a plan made once: every rank's entries (and
        `extra`) are gathered at rank 0 with each rank's error in describing
        them, rank 0 makes every rank's part with `compute(entries, extras)`
        and sends each its own. If a rank failed, or the plan could not be
        made, every rank raises, naming the first failing rank and its
        error (or the plan's)."""
        src = self.globals[0]
        gathered: Optional[List[Any]] = [None] * self.size if self.rank == 0 else None
        mine = (error, entries if error is None else [], extra if error is None else None)
        self.step(name, lambda: self.dist.gather_object(mine, gathered, dst=src, group=self.group))
        parts: Optional[List[Any]] = None
        if self.rank == 0:
            failed = next((f"rank {r} failed in '{name}': {e}" for r, (e, _en, _x) in enumerate(gathered) if e), None)
            if failed is None:
                try:
                    parts = [(None, part) for part in compute([en for _e, en, _x in gathered],
                                                              [x for _e, _en, x in gathered])]
                except (Error, CollectiveError) as e:
                    failed = f"in '{name}': {e}"
                except Exception as e:  # noqa: BLE001 - a bug must not leave the other ranks waiting
                    failed = f"in '{name}': {type(e).__name__}: {e}"
            if failed is not None:
                parts = [(failed, None)] * self.size
        out: List[Any] = [None]
        self.step(name, lambda: self.dist.scatter_object_list(out, parts, src=src, group=self.group))
        failed, part = out[0]
        if failed is not None:
            raise CollectiveError(f"{self.what}: {failed}")
        return part

    def agree(self, name: str, error: Optional[str]) -> None:
        """Every rank says whether its local work failed; if one did, every
        rank raises, naming the first failing rank and its error. One
        all-reduce of a flag when all went well (an object all-gather,
        which pickles, costs several times its CPU); the errors are
        gathered only when some rank failed."""
        import torch  # noqa: PLC0415

        flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        said = None
        try:
            self.step(name, lambda: self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group))
            if int(flag[0]) != 0:
                said = self.all_gather(name, error)
        except CollectiveError:
            if error is None:
                raise
            # The exchange failed too (a peer gone): this rank's own error
            # is what its caller needs to hear.
            raise CollectiveError(f"{self.what}: rank {self.rank} failed in '{name}': {error}") from None
        for r, e in enumerate(said or []):
            if e is not None:
                raise CollectiveError(f"{self.what}: rank {r} failed in '{name}': {e}")

    def from_rank_0(self, name: str, data: Optional[bytes], error: Optional[Exception]) -> bytes:
        """Rank 0's `data` on every rank (two broadcasts of raw bytes, no
        pickling); when rank 0 gives an `error` instead, every rank raises
        it: rank 0 the exception itself, the others one of the same type
        and message, which says it was rank 0's."""
        import torch  # noqa: PLC0415

        message = b""
        if self.rank == 0:
            message = b"\0" + data if error is None else \
                b"\1" + f"{type(error).__name__}\0{error}".encode("utf-8", "replace")
        size = torch.tensor([len(message)], dtype=torch.int64)
        src = self.globals[0]
        self.step(name, lambda: self.dist.broadcast(size, src=src, group=self.group))
        buf = torch.frombuffer(bytearray(message), dtype=torch.uint8) if self.rank == 0 and message else \
            torch.empty(int(size[0]), dtype=torch.uint8)
        if int(size[0]) > 0:
            self.step(name, lambda: self.dist.broadcast(buf, src=src, group=self.group))
        got = buf.numpy().tobytes()
        if not got:
            raise CollectiveError(f"{self.what}: rank 0 sent nothing in '{name}'")
        if got[:1] == b"\0":
            return got[1:]
        if error is not None:
            raise error
        kind, _, text = got[1:].decode("utf-8", "replace").partition("\0")
        import ckptfs  # noqa: PLC0415

        raise getattr(ckptfs, kind, CollectiveError)(f"{text} (rank 0 of {self.size}, in '{name}')")


def _entry(key: str, value, shard, sharded: bool) -> tuple:
    """What the planner needs of one state-dict value or load target."""
    from .memory import region, source_memory  # noqa: PLC0415

    if isinstance(value, (bytes, bytearray, memoryview)):
        return (key, [], "blob", [], [], 0, value.nbytes if isinstance(value, memoryview) else len(value))
    memory = source_memory(value, f"'{key}'")
    global_shape, kind, offsets, start = region(shard if sharded else None, memory, f"'{key}'")
    # The dtype is part of the region's identity: ranks giving one tensor
    # different dtypes are not replicas (the commit refuses them; a load
    # fills each from the store).
    return (f"{key}\0{memory.dtype}", [int(d) for d in global_shape], kind, [int(d) for d in memory.shape],
            [int(o) for o in offsets], int(start), int(memory.nbytes))


def _digest(value) -> str:
    """A digest of a value's bytes in row-major order (the check of
    replicas): the engine's XXH3-128, taken in place where the bytes are
    contiguous host memory, without the GIL."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _core.digest(value)
    if hasattr(value, "detach"):
        import torch  # noqa: PLC0415

        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    else:
        import numpy as np  # noqa: PLC0415

        raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return _core.digest(raw)


def plan_save(state_dict: Mapping[str, Any], shards: Mapping[str, Any], group: Group,
              verify_replicas: bool, name: str = "") -> Tuple[set, Dict[str, Any]]:
    """Which keys of `state_dict` this rank leaves to other ranks (they put
    the same region), and the plan's figures. With verify_replicas, the
    holders of each replicated region compare digests of their bytes first,
    and every rank raises naming the tensor where they differ. Ranks
    naming different checkpoints (`name`) fail every rank, naming both."""
    keys = list(state_dict)
    error = None
    entries: List[tuple] = []
    try:
        entries = [_entry(k, state_dict[k], shards.get(k), k in shards) for k in keys]
    except Error as e:
        error = str(e)
    digests = None
    if verify_replicas and error is None:
        digests = [_digest(state_dict[k]) for k in keys]

    def compute(plans, extras):
        names = [x[0] for x in extras]
        for r, other in enumerate(names):
            if other != names[0]:
                raise CollectiveError(f"rank 0 saves checkpoint '{names[0]}' and rank {r} saves '{other}': every rank "
                                      "of a collective save names the same checkpoint")
        every = [x[1] for x in extras]
        parts, routes = _core.plan_save(plans, routes=verify_replicas)
        # The engine's grouping of equal regions (the owners come from it)
        # says which entries are replicas of each other.
        for _reader, _size, holders in routes or []:
            (r0, i0), digest = holders[0], every[holders[0][0]][holders[0][1]]
            for r, i in holders[1:]:
                if every[r][i] != digest:
                    raise CollectiveError(f"the replicas of '{plans[r][i][0].split(chr(0))[0]}' differ: "
                                          f"rank {r0} and rank {r} hold different bytes for the same region")
        return parts

    mine, unique, held, per_rank = group.plan_at_rank_0("describe the state dict", error, entries, (name, digests),
                                                        compute)
    skip = {k for k, put in zip(keys, mine) if not put}
    return skip, {"unique_bytes": unique, "held_bytes": held, "bytes_per_rank": list(per_rank)}


def begin(core, args: tuple, group: Group, attempt: str = "", overwrite: bool = False):
    """Begins this rank's writer of a collective save (`args`: the core's
    begin arguments) so that the save costs the store one rank's listings
    and lock: rank 0 begins, listing the store under its shared store
    lock, and sends what it listed; the others apply that instead of
    listing, take no store lock, and their commits put their parts without
    looking for the others'. Rank 0's commit waits (up to the group's
    timeout) for every rank's part and completes the checkpoint, so its
    lock (which keeps gc away) covers every rank from before any began
    until the checkpoint is whole; this holds for async saves too, whose
    commits run in the background. Returns (writer, None), or (None, this
    rank's error) for the put step to agree on. Rank 0's error (a name
    already taken, say) is raised on every rank, as its own type (the
    others' message naming rank 0)."""
    writer, listing, failed = None, b"", None
    # Rank 0 stops waiting for the parts a little before the other ranks'
    # wait for it at the commit's agreement runs out, so they hear why.
    await_ranks = 0.9 * group.timeout
    # Rank 0 also gives the save its attempt (begin's `attempt`), unless
    # the caller did: a job restarted after a crash takes over the name.
    if group.rank == 0:
        attempt = attempt or _core.new_save_attempt()
        try:
            writer, listing = core.begin_sharing(*args, await_ranks=await_ranks, attempt=attempt, overwrite=overwrite)
        except Error as e:
            failed = e
    shared = group.from_rank_0("begin and share the store listing", attempt.encode() + b"\n" + listing, failed)
    if group.rank == 0:
        return writer, None
    attempt, _, listing = shared.partition(b"\n")
    try:
        return core.begin(*args, shared_sync=listing, await_ranks=await_ranks, attempt=attempt.decode(),
                          overwrite=overwrite), None
    except Error as e:
        return None, str(e)


def load(repo, name: str, targets: Mapping[str, Any], shards: Mapping[str, Any], group: Group,
         progress=None) -> Dict[str, Any]:
    """Fills `targets` (this rank's) with every distinct region fetched once
    across the group. Returns the plan's figures."""
    return load_items(repo, name, [(k, t, shards.get(k)) for k, t in targets.items()], group, progress)


def load_items(repo, name: str, items: List[Tuple[str, Any, Any]], group: Group, progress=None) -> Dict[str, Any]:
    """As load, for a list of (tensor name, target tensor, shard or None):
    one tensor may come several times (DCP's read items)."""
    from .memory import nbytes, read_value, torch_module, writable_mappings  # noqa: PLC0415

    torch = torch_module()
    error = None
    entries: List[tuple] = []
    reader = None
    try:
        entries = [_entry(key, target, shard, shard is not None) for key, target, shard in items]
        for key, target, _shard in items:
            if not torch.is_tensor(target):
                raise InvalidArgumentError(f"target '{key}': a collective load fills torch tensors")
        # One read lease for the job, not one per rank: rank 0's, taken
        # (and the checkpoint checked against the store) before it makes
        # the plan, and held until every rank has agreed that its fetches
        # are done. No rank fetches before it has its part of the plan.
        reader = repo._repo.open_checkpoint(name, lease=group.rank == 0)
    except Error as e:
        error = str(e)
    # Rank 0's reader lists the chunks of every rank's regions (the
    # manifest is the same on every host); each rank reads its own part.
    # It also decides, for the whole group, whether the fetched regions
    # travel over the caller's NCCL group (see _over_nccl).
    user_nccl = group.user_has_nccl()

    def compute(plans, extras):
        # Every rank must have opened the checkpoint rank 0 leased, not an
        # older one of the same name that its host's catalog still lists.
        for r, (identity, _device) in enumerate(extras):
            if identity != extras[0][0]:
                raise CollectiveError(f"rank {r}'s host knows another checkpoint named '{name}' than rank 0's: its "
                                      "catalog is behind the store (open the repository with process_group= to "
                                      "bring every host's catalog up to date)")
        parts, per_rank = _core.plan_load(plans, reader)
        nccl = user_nccl and _over_nccl([device for _identity, device in extras])
        return [(part, per_rank, nccl) for part in parts]

    extra = None
    if error is None:
        extra = (reader.identity(), _cuda_device_of(torch, [t for _k, t, _s in items]) if user_nccl else None)
    part, per_rank, over_nccl = group.plan_at_rank_0("describe the targets", error, entries, extra, compute)
    try:
        routes, windows, unique, needed = _core.load_plan_part(part, len(entries), group.size)
    except Error as e:  # a part rank 0 made and this rank cannot read (the others fail at their next step)
        raise CollectiveError(f"{group.what}: rank {group.rank} failed in 'describe the targets': {e}") from None
    me = group.rank
    # Fetch what this rank reads, into its own targets, window by window
    # after the chunk hand-offs each needs. A rank whose read fails keeps
    # taking part in the hand-offs, so no peer waits for it.
    error = None
    total = sum(nbytes(t) for _k, t, _s in items) if progress else 0
    done = 0
    # The routes this rank needs: (index, reader, bytes, its entries, and
    # as reader the other ranks needing it).
    mappings = writable_mappings()
    begin = 0
    for routes_end, exchange, hold, handoffs, release in windows:
        if exchange:
            failed = _hand_over_chunks(reader, hold, handoffs, group)
            error = error or failed
        try:
            for k in range(begin, routes_end):
                _index, r, _size, entries_here, _peers = routes[k]
                if r != me or error is not None:
                    continue
                key, target, shard = items[entries_here[0]]
                read_value(reader, key, target, shard, mappings)
                if progress:
                    done += nbytes(target)
                    progress(done, total)
        except Error as e:
            error = str(e)
        reader.release_chunks(release)
        begin = routes_end
    group.agree("fetch from the store", error)

    # Deliver: the reader sends each region to every other rank needing it,
    # over ckptfs's gloo group from host memory, or over the caller's NCCL
    # group from device memory when the plan says so.
    dist = group.dist
    data_group = group.user if over_nccl else group.group
    staged = []  # (target, buffer) filled by a receive into a staging copy

    def wire(t):
        """A contiguous byte view of `t` on the device its transport
        moves (the GPU for NCCL, host memory for gloo), or a staging copy."""
        device = t.device if over_nccl else torch.device("cpu")
        if t.device == device and t.is_contiguous():
            return t.reshape(-1).view(torch.uint8), None
        return t.detach().to(device).contiguous().reshape(-1).view(torch.uint8), t

    def deliver():
        ops = []
        for tag, r, size, entries_here, peers in routes:
            if size == 0:
                continue
            buf, back = wire(items[entries_here[0]][1])
            if r == me:
                ops += [dist.P2POp(dist.isend, buf, group.globals[rank], group=data_group, tag=tag) for rank in peers]
            else:
                ops.append(dist.P2POp(dist.irecv, buf, group.globals[r], group=data_group, tag=tag))
                if back is not None:
                    staged.append((back, buf))
        if over_nccl:
            # Every rank joins one small collective on the caller's group
            # first, so its communicator exists (a batch of point-to-point
            # operations that is the group's first call needs every rank).
            device = next((t.device for _k, t, _s in items), None) or \
                torch.device("cuda", torch.cuda.current_device())
            dist.all_reduce(torch.zeros(1, device=device), group=data_group)
        group.wait(dist.batch_isend_irecv(ops) if ops else [], any(op.tensor.is_cuda for op in ops))
        for target, buf in staged:
            target.copy_(buf.view(target.dtype).reshape(target.shape))
        # A region this rank needs twice was filled once: copy it over.
        for _tag, _r, _size, entries_here, _peers in routes:
            for i in entries_here[1:]:
                items[i][1].copy_(items[entries_here[0]][1])

    group.step("deliver the fetched regions", deliver)
    if progress:
        progress(total, total)
    return {"unique_bytes": unique, "needed_bytes": needed, "bytes_per_rank": list(per_rank)}


def _cuda_device_of(torch, targets: List[Any]) -> Optional[str]:
    """This rank's CUDA device (its UUID) when every target of its load is
    a CUDA tensor on it (a rank with no targets counts too), else None."""
    if not torch.cuda.is_available():
        return None
    here = torch.cuda.current_device()
    if any(t.device.type != "cuda" or t.device.index != here for t in targets):
        return None
    return str(torch.cuda.get_device_properties(here).uuid)


def _over_nccl(devices: List[Optional[str]]) -> bool:
    """Whether the fetched regions travel over the caller's NCCL group:
    only when every rank loads into its own device's memory (NCCL moves
    device memory and refuses two ranks on one GPU). Otherwise they travel
    over ckptfs's gloo group, staged through host memory."""
    return all(d is not None for d in devices) and len(set(devices)) == len(devices)


def _hand_over_chunks(reader, hold: List[tuple], handoffs: List[tuple], group: Group) -> Optional[str]:
    """One window of chunk hand-offs. Chunks that regions of different
    readers share (a restore at another world size cuts stored chunks) are
    fetched once: the rank the plan names fetches, verifies, decodes and
    holds each, and sends the decoded bytes to the other readers, whose
    reads then take them instead of the store. Returns this rank's error in
    sending or checking (agreed on with the reads)."""
    from .memory import torch_module  # noqa: PLC0415

    torch = torch_module()
    me = group.rank
    error = None
    try:
        for chunk in hold:
            reader.hold_chunk(chunk)
    except Error as e:
        error = str(e)
    group.agree("fetch the shared chunks", error)

    # One buffer for this rank's part of the window (about 256 MiB over the
    # group at most), not one per chunk. `handoffs` are this rank's own,
    # each tagged with its place in the plan.
    space = torch.empty(sum(chunk[1] for _tag, _src, _dst, chunk in handoffs), dtype=torch.uint8)

    def exchange():
        failed = None
        works, incoming = [], []
        at = 0
        for tag, src, dst, chunk in handoffs:
            buf = space[at:at + chunk[1]]
            at += chunk[1]
            if src == me:
                try:
                    reader.copy_held_chunk(chunk, buf.data_ptr(), chunk[1])
                except Error as e:  # sent anyway: the receiver's check fails, and nobody waits
                    failed = failed or str(e)
                works.append(group.dist.isend(buf, dst=group.globals[dst], group=group.group, tag=tag))
            else:
                works.append(group.dist.irecv(buf, src=group.globals[src], group=group.group, tag=tag))
                incoming.append((chunk, buf))
        for w in works:
            w.wait()
        return failed, incoming

    failed, incoming = group.step("hand over the shared chunks", exchange)
    try:
        for chunk, buf in incoming:
            reader.lend_chunk(chunk, buf.data_ptr(), chunk[1])
    except Error as e:
        failed = failed or str(e)
    return failed


def open_shared(open_core: Callable[[bool], Any], group: Group):
    """Opens a repository on every rank of `group` with one listing of its
    store: every rank opens it without the opening sync, rank 0 brings its
    catalog up to date with the store and shares what it listed and
    fetched, and the other ranks apply that to their own catalogs. Three
    collective calls, whatever the ranks; an error on any rank is raised on
    every rank."""
    core, error = None, None
    try:
        core = open_core(False)
    except Error as e:
        error = f"{type(e).__name__}: {e}"
    # Also orders every rank's catalog reading before rank 0's listing.
    group.agree("open the repository", error)
    listing, failed = b"", None
    if group.rank == 0:
        try:
            listing = core.share_sync()
        except Error as e:
            failed = e
    try:
        listing = group.from_rank_0("share the store listing", listing, failed)
    except CollectiveError:
        raise
    except Error as e:  # rank 0's, on every rank
        raise CollectiveError(f"{group.what}: rank 0 failed in 'share the store listing': "
                              f"{type(e).__name__}: {e}") from None
    error = None
    if group.rank != 0:
        try:
            core.sync_from(listing)
        except Error as e:
            error = f"{type(e).__name__}: {e}"
    group.agree("apply the store listing", error)
    return core


def resume_point(repo, which: str, group: Optional[Group], in_group: str = "") -> Optional[Dict[str, Any]]:
    """The committed checkpoint to resume from: "latest" (the newest
    committed, None when there is none) or a name (NotFoundError when it is
    not committed). With a group, rank 0 alone asks the repository and
    every rank gets its answer (or its error)."""

    def local():
        done = repo.checkpoints(group=in_group or None)
        if which == "latest":
            return done[-1] if done else None
        for c in done:
            if c["name"] == which:
                return c
        from ._core import NotFoundError  # noqa: PLC0415

        raise NotFoundError(f"no committed checkpoint named '{which}'")

    if group is None:
        return local()
    import json  # noqa: PLC0415

    answer, failed = b"", None
    if group.rank == 0:
        try:
            answer = json.dumps(local()).encode()
        except Error as e:
            failed = e
    return json.loads(group.from_rank_0("share the resume point", answer, failed))
