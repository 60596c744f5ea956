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

The protocol is the engine's (``ckpt/collective.h``: its steps, messages,
plans and agreements), the one C++ callers use. This module is its
adapter to torch.distributed: ``Group`` is the engine's communicator
(its calls come from the engine on the caller's thread) on a gloo group of
ckptfs's own with a bounded timeout (so planning holds no NCCL buffers,
and a dead rank makes every other rank fail within the timeout, naming the
step, instead of hanging), and it moves a load's fetched regions, over
the caller's NCCL group where every rank loads into a GPU of its own. The
save's puts are the package's own (any memory), between the engine's
steps.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from . import _core
from ._core import CollectiveError, Error, InvalidArgumentError, UnsupportedError  # noqa: F401 - CollectiveError: re-exported

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


def _bytes_tensor(view):
    """A uint8 tensor over a writable buffer the engine lends (no copy)."""
    import torch  # noqa: PLC0415

    return torch.frombuffer(view, dtype=torch.uint8)


class Group:
    """The ranks of the caller's process group, and a gloo group of the same
    ranks (with the timeout) for ckptfs's own exchanges: the engine's
    communicator (rank, size, and the calls below, which raise on a
    failure: the engine names the step) and, during a load, the memory of
    its targets (deliver, copy, progress)."""

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
        # A load's targets by address (contiguous tensors), and its progress.
        self.targets: Dict[int, Any] = {}
        self.on_progress = None
        self.done = self.total = 0

    # -- the engine's communicator (Communicator in ckpt/communicator.h) --

    def all_reduce_min(self, values: List[int]) -> List[int]:
        import torch  # noqa: PLC0415

        t = torch.tensor(values, dtype=torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]

    def all_gather(self, data: bytes) -> List[bytes]:
        out: List[Any] = [None] * self.size
        self.dist.all_gather_object(out, data, group=self.group)
        return out

    def gather(self, data: bytes, root: int) -> List[bytes]:
        out: Optional[List[Any]] = [None] * self.size if self.rank == root else None
        self.dist.gather_object(data, out, dst=self.globals[root], group=self.group)
        return out or []

    def scatter(self, parts: Optional[List[bytes]], root: int) -> bytes:
        out: List[Any] = [None]
        self.dist.scatter_object_list(out, parts, src=self.globals[root], group=self.group)
        return out[0]

    def broadcast_message(self, data: bytes, root: int) -> bytes:
        """Root's bytes on every rank: two broadcasts of raw bytes (its
        size, then the bytes), no pickling."""
        import torch  # noqa: PLC0415

        size = torch.tensor([len(data) if self.rank == root else 0], dtype=torch.int64)
        self.dist.broadcast(size, src=self.globals[root], group=self.group)
        n = int(size[0])
        if n == 0:
            return b""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == root else \
            torch.empty(n, dtype=torch.uint8)
        self.dist.broadcast(buf, src=self.globals[root], group=self.group)
        return data if self.rank == root else buf.numpy().tobytes()

    def broadcast(self, view, root: int) -> None:
        self.dist.broadcast(_bytes_tensor(view), src=self.globals[root], group=self.group)

    def send(self, view, peer: int) -> None:
        self.dist.send(_bytes_tensor(view), dst=self.globals[peer], group=self.group)

    def recv(self, view, peer: int) -> None:
        self.dist.recv(_bytes_tensor(view), src=self.globals[peer], group=self.group)

    def exchange(self, transfers: List[Tuple[bool, int, Any, int]]) -> None:
        """One round of point-to-point transfers (send, peer, writable
        buffer, tag) over ckptfs's gloo group, posted together."""
        dist = self.dist
        ops = [dist.P2POp(dist.isend if send else dist.irecv, _bytes_tensor(view), self.globals[peer],
                          group=self.group, tag=tag) for send, peer, view, tag in transfers]
        if ops:
            self.wait(dist.batch_isend_irecv(ops), False)

    # -- a load's targets (CollectiveMemory in ckpt/collective.h) --

    def deliver(self, transfers: List[Tuple[bool, int, int, int, int]], on_device: bool) -> None:
        """The fetched regions (send, peer, target address, bytes, tag) in
        one batch_isend_irecv: over ckptfs's gloo group from host memory,
        or, when the ranks agreed `on_device`, over the caller's NCCL group
        from device memory."""
        import torch  # noqa: PLC0415

        dist = self.dist
        data_group = self.user if on_device else self.group
        device = torch.device("cpu")
        wires: Dict[int, Any] = {}
        staged = []  # (target, buffer) filled by a receive into a staging copy

        def wire(address: int, receive: bool):
            """A contiguous byte view of the target on the device its
            transport moves, or a staging copy."""
            if address in wires:
                return wires[address]
            t = self.targets[address]
            want = t.device if on_device else device
            if t.device == want:
                buf = t.reshape(-1).view(torch.uint8)
            else:
                buf = t.detach().to(want).contiguous().reshape(-1).view(torch.uint8)
                if receive:
                    staged.append((t, buf))
            wires[address] = buf
            return buf

        ops = [dist.P2POp(dist.isend if send else dist.irecv, wire(address, not send), self.globals[peer],
                          group=data_group, tag=tag) for send, peer, address, _size, tag in transfers]
        if on_device:
            # Every rank joins one small collective on the caller's group
            # first, so its communicator exists (a batch of point-to-point
            # operations that is the group's first call needs every rank).
            first = next(iter(self.targets.values()), None)
            here = first.device if first is not None else torch.device("cuda", torch.cuda.current_device())
            dist.all_reduce(torch.zeros(1, device=here), group=data_group)
        self.wait(dist.batch_isend_irecv(ops) if ops else [], any(op.tensor.is_cuda for op in ops))
        for target, buf in staged:
            target.copy_(buf.view(target.dtype).reshape(target.shape))

    def copy(self, dst: int, src: int) -> None:
        """A region this rank needs twice was filled once: copy it over."""
        self.targets[dst].copy_(self.targets[src])

    def progress(self, nbytes: int) -> None:
        self.done += nbytes
        if self.on_progress is not None:
            self.on_progress(self.done, self.total)

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

    # -- steps the package takes itself, agreed through the engine --

    def user_has_nccl(self) -> bool:
        """Whether the caller's group moves CUDA tensors with NCCL (and
        CKPTFS_COLLECTIVE_NCCL=0 does not keep them off it)."""
        if os.environ.get("CKPTFS_COLLECTIVE_NCCL", "1") == "0":
            return False
        try:
            return "cuda:nccl" in self.dist.get_backend_config(self.user)
        except (ValueError, RuntimeError, KeyError):
            return False

    def agree(self, step: str, error: Optional[str]) -> None:
        """Every rank says whether its part of `step` failed; if one did,
        every rank raises CollectiveError naming the first failing rank."""
        _core.collective_agree(self, step, error, self.what)

    def from_rank_0(self, step: str, data: Optional[bytes], error: Optional[Exception]) -> bytes:
        """Rank 0's `data` on every rank; when rank 0 gives an `error`
        instead, every rank raises it: rank 0 the exception itself, the
        others one of the same class and message, which says it was rank
        0's."""
        try:
            return _core.collective_from_rank_0(self, step, data or b"", error, self.what)
        except Error:
            if error is not None:
                raise error from None
            raise


def _entry(key: str, value, shard, sharded: bool) -> tuple:
    """What the planner needs of one state-dict value."""
    from .memory import region, source_memory  # noqa: PLC0415

    if isinstance(value, (bytes, bytearray, memoryview)):
        return (key, [], "blob", [], [], 0, value.nbytes if isinstance(value, memoryview) else len(value))
    memory = source_memory(value, f"'{key}'")
    global_shape, kind, offsets, start = region(shard if sharded else None, memory, f"'{key}'")
    # The dtype is part of the region's identity: ranks giving one tensor
    # different dtypes are not replicas (the commit refuses them).
    return (f"{key}\0{memory.dtype}", [int(d) for d in global_shape], kind, [int(d) for d in memory.shape],
            [int(o) for o in offsets], int(start), int(memory.nbytes))


def _digest(value) -> bytes:
    """The engine's XXH3-128 of a value's bytes in row-major order (the
    check of replicas), taken in place where the bytes are contiguous host
    memory, without the GIL."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes.fromhex(_core.digest(value))
    if hasattr(value, "detach"):
        import torch  # noqa: PLC0415

        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    else:
        import numpy as np  # noqa: PLC0415

        raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return bytes.fromhex(_core.digest(raw))


def plan_save(state_dict: Mapping[str, Any], shards: Mapping[str, Any], group: Group,
              verify_replicas: bool, name: str = "") -> Tuple[set, Dict[str, Any]]:
    """Which keys of `state_dict` this rank leaves to other ranks (they put
    the same region), and the plan's figures (the engine's
    PlanCollectiveSave)."""
    keys = list(state_dict)
    error = None
    entries: List[tuple] = []
    digests: List[bytes] = []
    try:
        entries = [_entry(k, state_dict[k], shards.get(k), k in shards) for k in keys]
        if verify_replicas:
            digests = [_digest(state_dict[k]) for k in keys]
    except Error as e:
        error, entries, digests = str(e), [], []
    puts, unique, held, per_rank = _core.collective_plan_save(group, name, entries, error, digests, verify_replicas,
                                                              group.what)
    skip = {k for k, put in zip(keys, puts) if not put}
    return skip, {"unique_bytes": unique, "held_bytes": held, "bytes_per_rank": list(per_rank)}


def begin(core, args: tuple, group: Group, attempt: str = "", overwrite: bool = False):
    """This rank's writer of a collective save (`args`: the core's begin
    arguments; the engine's BeginCollectiveSave): rank 0 lists the store
    and shares the listing and the save's attempt; the others apply it.
    Rank 0's commit waits for every part, a little less long than the
    other ranks wait for it at the commit's agreement, so they hear why.
    Returns (writer, None), or (None, this rank's error) for the put
    step to agree on. Rank 0's error (a name already taken, say) is raised
    on every rank, as its own class."""
    name, _rank, _world, step, tags = args
    return core.begin_collective(group, name, step, tags, 0.9 * group.timeout, attempt, overwrite, group.what)


def load(repo, name: str, targets: Mapping[str, Any], shards: Mapping[str, Any], group: Group,
         progress=None, nearer=()) -> Dict[str, Any]:
    """Fills `targets` (this rank's) with every distinct region fetched once
    across the group. Returns the engine's figures."""
    return load_items(repo, name, [(k, t, shards.get(k)) for k, t in targets.items()], group, progress, nearer)


def load_items(repo, name: str, items: List[Tuple[str, Any, Any]], group: Group, progress=None,
               nearer=()) -> Dict[str, Any]:
    """As load, for a list of (tensor name, target tensor, shard or None):
    one tensor may come several times (DCP's read items). The engine's
    LoadCollective, with this rank's targets in `group`; `nearer`: core
    repositories whose chunks this rank reads first (a fast tier)."""
    from .memory import Target, nbytes, region, torch_module, writable_mappings  # noqa: PLC0415

    torch = torch_module()
    error = None
    described: List[tuple] = []
    scratch: List[Target] = []
    group.targets = {}
    try:
        mappings = writable_mappings()
        for key, target, shard in items:
            if torch is None or not torch.is_tensor(target):
                raise InvalidArgumentError(f"target '{key}': a collective load fills torch tensors")
            t = Target(target, f"target '{key}'", mappings)
            m = t.memory
            global_shape, kind, offsets, start = region(shard, m, f"target '{key}'")
            described.append((key, m.dtype, [int(d) for d in global_shape], kind, [int(d) for d in m.shape],
                              [int(o) for o in offsets], int(start), m.address, m.nbytes, m.device))
            group.targets.setdefault(m.address, m.keep)
            scratch.append(t)
    except Error as e:
        error, described = str(e), []
    # The caller's NCCL group carries the regions only where every rank
    # loads into a GPU of its own (the engine decides from every rank's
    # token).
    token = _cuda_device_of(torch, [t for _k, t, _s in items]) if error is None and group.user_has_nccl() else None
    if progress:
        group.on_progress, group.done = progress, 0
        group.total = sum(nbytes(t) for _k, t, _s in items)
    try:
        figures = repo._repo.load_collective(group, name, described, error, token or "", progress is not None,
                                             group.what, list(nearer))
    finally:
        group.targets, group.on_progress = {}, None
    for t in scratch:
        t.finish()
    if progress:
        progress(group.total, group.total)
    return figures


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
    over ckptfs's gloo group, staged through host memory. The engine's
    rule (DeliverOnDevice)."""
    return _core.deliver_on_device(devices)


def open_shared(open_core, group: Group):
    """Opens a repository on every rank of `group` with one listing of its
    store (the engine's ShareOpeningSync): every rank opens it without the
    opening sync, rank 0 brings its catalog up to date with the store and
    shares what it listed and fetched, and the other ranks apply that to
    their own catalogs. An error on any rank is raised on every rank."""
    core, error = None, None
    try:
        core = open_core(False)
    except Error as e:
        error = f"{type(e).__name__}: {e}"
    _core.collective_open_sync(group, core, error, group.what)
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
