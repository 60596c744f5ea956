"""Two tiers: saves to this host's fast tier, drained to a shared tier.

A job saves to a fast repository on each host (node-local NVMe, /dev/shm)
at local speed; a thread of this process then drains this host's rank
parts to the shared repository (S3, or any repository URL) in the
background, sending only the chunks it lacks. A checkpoint is "local" once
this host's ranks are in the fast tier, "replicated" once every rank's part
also has its copies in peers' fast tiers (replicas > 1), "drained" once
this host's ranks are in the shared tier too, and "durable" once every
host's are (the shared tier's own commit makes it visible). Loads read each chunk from the nearest tier
that holds it intact. The fast tier keeps the newest `keep_last`
checkpoints and drops older ones once they are durable (a save short of
space also drops drained ones: their bytes are in the shared tier).

Open one with ``ckptfs.open(shared_url, fast_tier=path)``; docs/PYTHON.md,
"Two tiers".
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from ._core import (
    AlreadyExistsError,
    CorruptionError,
    Error,
    InvalidArgumentError,
    NotFoundError,
    StorageError,
    UnsupportedError,
)
from . import memory

# The stages of a save, in order.
STAGES = ("saving", "local", "replicated", "drained", "durable")

# Drain errors that retrying does not mend: the handle raises them.
_LASTING = (AlreadyExistsError, CorruptionError, InvalidArgumentError, NotFoundError, UnsupportedError)


class TierHandle:
    """Where one save stands across the tiers: stage is "saving" (an
    async_save still writing to the fast tier), "local", "replicated"
    (every rank's part has its copies in peers' fast tiers), "drained"
    (this host's ranks are in the shared tier; other hosts' are not yet)
    or "durable" (visible in the shared tier). Each stage counts as having
    passed the ones before it."""

    def __init__(self, name: str, drainer: "_Drainer"):
        self.name = name
        self._drainer = drainer
        # With replicas: what keeping this rank's part in its peers' fast
        # tiers cost (parts_sent, parts_received, chunks_sent,
        # stored_bytes_sent, stored_bytes_received), once it is done.
        self.replicas: Optional[Dict[str, int]] = None

    def __repr__(self) -> str:
        return f"ckptfs.TierHandle({self.name!r}, stage={self.stage!r})"

    @property
    def stage(self) -> str:
        return self._drainer.stage(self.name)

    @property
    def replicated(self) -> bool:
        """Whether every rank's part of this save has its copies in peers'
        fast tiers (a save with replicas > 1 and a process group: the
        copies are made by every rank together, so they all succeeded)."""
        return self.replicas is not None

    def wait(self, stage: str = "durable", timeout: Optional[float] = None) -> str:
        """Waits until the save has reached `stage` ("local", "replicated",
        "drained" or "durable"; a later one counts) and returns the stage it
        is at. Raises TimeoutError
        after `timeout` seconds (naming the drain's last error, if any),
        and the drain's error at once when retrying cannot mend it (the
        shared tier holds another checkpoint of the name, say)."""
        if stage not in STAGES[1:]:
            raise InvalidArgumentError(f"stage must be one of {', '.join(STAGES[1:])}, not {stage!r}")
        return self._drainer.wait_for(self.name, STAGES.index(stage), timeout)


class _Drainer:
    """The background drain of one fast tier to its shared tier: one
    thread, woken by saves, that drains everything not yet durable, trims
    the fast tier, and polls while a checkpoint waits for other hosts."""

    POLL_SECONDS = 0.5
    MAX_POLL_SECONDS = 5.0
    MAX_BACKOFF_SECONDS = 30.0

    def __init__(self, fast, shared, keep_last: int, on_phase: Optional[Callable[[str], None]]):
        self._fast, self._shared = fast, shared
        self._keep_last = keep_last
        self._on_phase = on_phase
        self._cond = threading.Condition()
        self._trimming = threading.Lock()  # one trim of the fast tier at a time
        self._stages: Dict[str, int] = {}
        self._failed: Dict[str, BaseException] = {}  # async saves that failed
        self._waiting_local: List[Any] = []  # (name, wait) of async saves, until their commit is local
        self._poll = self.POLL_SECONDS  # while a checkpoint waits for other hosts: grows to MAX_POLL_SECONDS
        self._wake = True  # drain once at start: what an earlier process left
        self._stopping = False
        self._error: Optional[BaseException] = None
        self._started = 0  # drain passes begun
        self._saved_during: Dict[str, int] = {}  # name: passes begun when it was last saved
        self._passes = 0  # and finished
        self._thread = threading.Thread(target=self._run, name="ckptfs-drain", daemon=True)
        self._thread.start()

    # -- called by the repository's threads --

    def submit(self, name: Optional[str], wait_local: Optional[Callable[[], Any]] = None) -> None:
        """Drains soon; `name` is local now, or once wait_local() returns
        (an async save's commit to the fast tier)."""
        with self._cond:
            if name is not None:
                # A save of a name saved before starts over: what passes
                # begun before it said was of the older version.
                self._stages[name] = 0 if wait_local is not None else 1
                self._saved_during[name] = self._started
            if wait_local is not None:
                self._waiting_local.append((name, wait_local))
            self._wake = True
            self._poll = self.POLL_SECONDS
            self._cond.notify_all()

    def stage(self, name: str) -> str:
        with self._cond:
            return STAGES[self._stages.get(name, 0)]

    def wait_for(self, name: str, want: int, timeout: Optional[float]) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._stages.get(name, 0) < want:
                if name in self._failed:
                    raise self._failed[name]  # the save itself failed: nothing of it drains
                if isinstance(self._error, _LASTING) or (self._error is not None and
                                                         not isinstance(self._error, Error)):
                    raise self._error
                if self._stopping and not self._thread.is_alive():
                    raise StorageError(f"the drain of '{name}' stopped before it was {STAGES[want]} "
                                       "(the fast tier keeps it; opening the tiers again drains it)")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    why = f" (the drain's last error: {self._error})" if self._error else ""
                    raise TimeoutError(f"'{name}' is {STAGES[self._stages.get(name, 0)]}, not {STAGES[want]}, "
                                       f"after {timeout} s{why}")
                self._cond.wait(self.POLL_SECONDS if left is None else min(left, self.POLL_SECONDS))
            return STAGES[self._stages[name]]

    def drain_now(self, timeout: Optional[float]) -> None:
        """Waits for one whole pass that began after this call."""
        with self._cond:
            target = self._started + 1  # a pass running now began before this call
            self._wake = True
            self._cond.notify_all()
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._passes < target and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no drain pass finished within {timeout} s")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error

    def stop(self, finish: bool = True) -> None:
        with self._cond:
            self._stopping = True
            self._wake = finish
            self._cond.notify_all()
        self._thread.join()

    # -- the thread --

    def _run(self) -> None:
        backoff = self.POLL_SECONDS
        while True:
            with self._cond:
                while not self._wake and not self._stopping:
                    # Poll while a checkpoint waits for other hosts' ranks,
                    # less often the longer it waits.
                    polling = any(1 <= s < STAGES.index("durable") for s in self._stages.values())
                    self._cond.wait(self._poll if polling else None)
                    if polling:
                        self._poll = min(self._poll * 1.5, self.MAX_POLL_SECONDS)
                        break
                if self._stopping and not self._wake:
                    return
                self._wake = False
                self._started += 1
                current = self._started
                waiting = list(self._waiting_local)
            for name, wait_local in waiting:
                failed = None
                try:
                    wait_local()
                except BaseException as e:  # noqa: BLE001 - the save's own handle raises it to its caller too
                    failed = e
                with self._cond:
                    self._waiting_local.remove((name, wait_local))
                    if failed is None:
                        self._stages[name] = max(self._stages.get(name, 0), 1)
                    else:
                        self._failed[name] = failed
                    self._cond.notify_all()
            try:
                self._pass(current)
                error, backoff = None, self.POLL_SECONDS
            except Exception as e:  # noqa: BLE001 - kept for the handles waiting, which raise it
                error = e
            with self._cond:
                self._error = error
                self._passes += 1
                self._cond.notify_all()
                if self._stopping:
                    return
                if error is not None:
                    self._cond.wait(backoff)
                    backoff = min(backoff * 2, self.MAX_BACKOFF_SECONDS)
                    self._wake = True

    def _pass(self, current: int) -> None:
        report = self._fast._repo.drain(self._shared._repo, [], self._on_phase)
        # What the drain made durable shows at once; then every checkpoint.
        self._note([{"name": c["name"], "tier_state": "durable" if c["durable"] else "drained"}
                    for c in report["checkpoints"]], current)
        with self._trimming:
            # One listing of the shared tier for the stages and the trim.
            seen = self._fast._repo.tier_status_and_trim(self._shared._repo, self._keep_last)
            self._note(seen["entries"], current)
            self._drop(seen["trim"])

    def _drop(self, names: List[str]) -> None:
        """Removes drained checkpoints from the fast tier and reclaims their
        space (under _trimming)."""
        if names:
            self._fast._repo.rm(names)
            self._fast._repo.gc(None, None, None, [], False, False, 0.5, None, None)

    def drop_drained_until(self, enough: Callable[[], bool]) -> bool:
        """Drops the fast tier's drained checkpoints, oldest first, until
        enough() says so; whether it did."""
        with self._trimming:
            for name in self._fast._repo.plan_fast_trim(self._shared._repo, 0, short_of_space=True):
                if enough():
                    return True
                self._drop([name])
            return enough()

    def mark(self, name: str, stage: str) -> None:
        """`name` has reached `stage` (a later one it reached stays)."""
        self._note([{"name": name, "tier_state": stage}])

    def _note(self, entries: List[Dict[str, Any]], current: Optional[int] = None) -> None:
        """Stages seen by pass `current` (None: now)."""
        with self._cond:
            for e in entries:
                stage = STAGES.index(e["tier_state"])
                name = e.get("target", e["name"])  # a replacing save is listed as "NAME~"
                if current is not None and current <= self._saved_during.get(name, -1):
                    continue  # the pass began before this name's newest save
                if stage > self._stages.get(name, 0):
                    self._stages[name] = stage
                    self._poll = self.POLL_SECONDS
            self._cond.notify_all()


_open_tiers: "weakref.WeakSet[TieredRepository]" = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    # What this host saved leaves it before the interpreter does (one more
    # pass; other hosts' ranks are not waited for).
    for tiers in list(_open_tiers):
        tiers.close()


class TieredRepository:
    """A fast tier on this host in front of a shared tier. Obtain one with
    ckptfs.open(shared_url, fast_tier=path). save, async_save, load,
    resume_point and checkpoints work as Repository's; each save's
    result (or handle) carries a TierHandle ("tiers") to follow or wait
    for its stages. Thread-safe as Repository is."""

    def __init__(self, fast, shared, *, keep_last: int = 2, on_phase: Optional[Callable[[str], None]] = None,
                 full_wait: float = 60.0, replicas: int = 1, replica_jump: Optional[int] = None,
                 replica_strategy: str = "ring"):
        if isinstance(keep_last, bool) or int(keep_last) < 1:
            raise InvalidArgumentError(f"keep_last must be at least 1, not {keep_last!r}")
        if isinstance(replicas, bool) or int(replicas) < 1:
            raise InvalidArgumentError(f"replicas must be at least 1, not {replicas!r}")
        if replica_jump is not None and (isinstance(replica_jump, bool) or int(replica_jump) < 1):
            raise InvalidArgumentError(f"replica_jump must be at least 1, not {replica_jump!r}")
        self.fast, self.shared = fast, shared
        self.keep_last = int(keep_last)
        self.replicas = int(replicas)
        self.replica_jump = None if replica_jump is None else int(replica_jump)
        if replica_strategy not in ("ring", "clique"):
            raise InvalidArgumentError(f"replica_strategy must be 'ring' or 'clique', not {replica_strategy!r}")
        self.replica_strategy = replica_strategy
        # What the last collective load got back from peers ({"error": ...} when that failed).
        self.restored: Optional[Dict[str, Any]] = None
        self.full_wait = float(full_wait)
        self._drainer = _Drainer(fast, shared, self.keep_last, on_phase)
        self._closed = False
        _open_tiers.add(self)

    def __repr__(self) -> str:
        return f"ckptfs.TieredRepository(fast={self.fast.path!r}, shared={self.shared.path!r})"

    @property
    def path(self) -> str:
        """The shared tier's location."""
        return self.shared.path

    # -- save --

    def save(self, name: str, state_dict: Mapping[str, Any], **kwargs) -> Dict[str, Any]:
        """Repository.save to the fast tier: returns once this host's part
        is durable there; the drain to the shared tier follows in the
        background. The result also holds "tiers", a TierHandle."""
        self._make_room(state_dict)
        try:
            result = self.fast.save(name, state_dict, **kwargs)
        except StorageError as e:
            raise self._full(e) from e
        handle = self._saved(name)
        result["tiers"] = handle
        if self.replicas > 1 and kwargs.get("process_group") is not None:
            handle.replicas = self._replicate(name, kwargs["process_group"], kwargs.get("timeout"))
        return result

    def _replicate(self, name: str, process_group, timeout: Optional[float], back: bool = False) -> Dict[str, int]:
        """Every rank of the group keeps copies of its part in its peers'
        fast tiers (the engine's ReplicateRankParts), or, `back`, gets its
        own part back from a peer's copy when its fast tier lacks it
        (RestoreRankParts): a collective call."""
        from . import collective  # noqa: PLC0415

        what = f"{'parts back from peers' if back else 'replicas'} of '{name}'"
        group = collective.Group(process_group, timeout, what)
        if self.replica_jump is None:
            # The ranks of one host share its fast tier: a jump of that
            # many ranks puts each copy on another host.
            here = f"{os.uname().nodename}:{os.path.realpath(self.fast.path)}".encode()
            hosts = group.all_gather(here)
            self.replica_jump = max(hosts.count(h) for h in hosts)
        report = self.fast._repo.replicate(group, name, self.replicas, self.replica_jump, group.what, back,
                                           self.replica_strategy)
        if not back and self.replicas > 1:
            self._drainer.mark(name, "replicated")
        return report

    def _saved(self, name: str) -> TierHandle:
        """This host's part of `name` is committed in the fast tier: drains
        it, and returns its handle."""
        self._drainer.submit(name)
        return TierHandle(name, self._drainer)

    def async_save(self, name: str, state_dict: Mapping[str, Any], **kwargs):
        """Repository.async_save to the fast tier. The handle's result()
        waits for the fast tier's commit; its `tiers` (a TierHandle) follows
        the drain."""
        self._make_room(state_dict)
        handle = self.fast.async_save(name, state_dict, **kwargs)
        self._drainer.submit(name, handle.result)  # the fast tier's commit, never the replicas below
        handle.tiers = TierHandle(name, self._drainer)
        if self.replicas > 1 and kwargs.get("process_group") is not None:
            # The copies to peers are a collective call: made by result(),
            # on the thread every rank calls it from.
            wait_local = handle.result

            def result(timeout: Optional[float] = None) -> Dict[str, Any]:
                out = wait_local(timeout)
                if handle.tiers.replicas is None:
                    handle.tiers.replicas = self._replicate(name, kwargs["process_group"], kwargs.get("timeout"))
                return out
            handle.result = result
        return handle

    def _make_room(self, state_dict: Mapping[str, Any]) -> None:
        """A save that might not fit in the fast tier waits (at most
        full_wait seconds) for the drain, then drops drained checkpoints
        from the fast tier, oldest first, even among the newest keep_last:
        their bytes are in the shared tier, so nothing is lost."""
        need = sum(memory.nbytes(v) for v in state_dict.values())
        if _free_bytes(self.fast.path) >= need:
            return
        deadline = time.monotonic() + self.full_wait
        while time.monotonic() < deadline:
            try:
                self._drainer.drain_now(max(0.0, deadline - time.monotonic()))
            except (TimeoutError, Error):
                break
            if self._drainer.drop_drained_until(lambda: _free_bytes(self.fast.path) >= need):
                return
            time.sleep(_Drainer.POLL_SECONDS)  # a drain in progress may finish meanwhile

    def _full(self, e: StorageError) -> Error:
        text = str(e)
        if "No space left" not in text and "quota" not in text:
            return e
        states = ", ".join(f"{c['name']} {c['tier_state']}" for c in self.status()) or "none"
        return StorageError(f"the fast tier {self.fast.path} is full: {text}. Nothing was lost: the checkpoints "
                            f"before this one are in the fast tier or the shared tier ({states}); the fast tier "
                            f"drops durable ones beyond the newest {self.keep_last}, and a save short of space drops "
                            "drained ones, so a drain to the shared tier makes room (or give the fast tier more space)")

    # -- state --

    def status(self) -> List[Dict[str, Any]]:
        """Every checkpoint of the fast tier with its tier_state ("local",
        "replicated", "drained", "durable"), its copies and ranks (ckpt
        drain --status --json)."""
        return self.fast._repo.tier_status(self.shared._repo)

    def drain(self, *, wait: bool = True, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """Runs a drain pass now (wait=True: and waits for it) and returns
        status()."""
        if wait:
            self._drainer.drain_now(timeout)
        else:
            self._drainer.submit(None)
        return self.status()

    def checkpoints(self, *, include_pending: bool = False, group: Optional[str] = None) -> List[Dict[str, Any]]:
        """Committed checkpoints of both tiers, in step order (commit time
        where some have no step): the shared tier's (tier "shared") and the
        fast tier's not yet there (tier "fast"), each with tier_state."""
        out = {}
        for c in self.shared.checkpoints(include_pending=include_pending, group=group):
            if c["state"] == "committed":
                out[c["name"]] = dict(c, tier="shared", tier_state="durable")
        states = {e["name"]: e["tier_state"] for e in self.status()}
        for c in self.fast.checkpoints(include_pending=include_pending, group=group):
            if c["state"] == "committed" and c["name"] not in out:
                out[c["name"]] = dict(c, tier="fast", tier_state=states.get(c["name"], "local"))
        listed = list(out.values())
        if all(c["step"] is not None for c in listed):
            listed.sort(key=lambda c: (c["step"], c["committed"]))
        else:
            listed.sort(key=lambda c: c["committed"])
        return listed

    def resume_point(self, which: str = "latest", *, process_group: Any = None, timeout: Optional[float] = None,
                     group: Optional[str] = None) -> Optional[Dict[str, Any]]:
        """The newest checkpoint complete in either tier (or the one named),
        as checkpoints() lists it; with `process_group` rank 0 decides for
        every rank, as Repository.resume_point does."""
        from . import collective  # noqa: PLC0415
        from .repository import group_name  # noqa: PLC0415

        g = None
        if process_group is not None:
            g = collective.Group(process_group, timeout, f"resume point '{which}'")
        return collective.resume_point(self, which, g, group_name(group))

    # -- load --

    def _source(self, name: str):
        """(repository, nearer tiers) to read checkpoint `name` from: the
        shared tier, each chunk from the fast tier first, when it is durable
        there; else the fast tier, where it is complete."""
        try:
            self.shared._repo.open_checkpoint(name, False, [])
            return self.shared, [self.fast._repo], "shared"
        except NotFoundError:
            pass
        self.fast._repo.open_checkpoint(name, False, [])  # NotFoundError names it
        return self.fast, [], "fast"

    def load(self, name: str, targets: Mapping[str, Any], *, process_group: Any = None,
             timeout: Optional[float] = None, **kwargs):
        """Repository.load, reading each chunk from this host's fast tier
        when it holds it intact (checked against its hash), else from the
        shared tier. With `process_group`, rank 0 chooses the tier for
        every rank."""
        if process_group is None:
            repo, nearer, _where = self._source(name)
            return repo.load(name, targets, _nearer=nearer, **kwargs)
        from . import collective  # noqa: PLC0415

        g = collective.Group(process_group, timeout, f"collective load of '{name}'")
        answer, failed = b"", None
        if g.rank == 0:
            try:
                answer = self._source(name)[2].encode()
            except Error as e:
                failed = e
        where = g.from_rank_0("choose the tier", answer, failed).decode()
        if self.replicas > 1:
            # A host that lost its fast tier gets its parts back from peers
            # first: its chunks then come from there, not the shared tier.
            # Should that fail (a peer's copy fails its hash, say), every
            # rank hears it and the load reads the shared tier instead.
            try:
                self.restored = self._replicate(name, process_group, timeout, back=True)
            except Error as e:
                self.restored = {"error": str(e)}
        repo, nearer = (self.shared, [self.fast._repo]) if where == "shared" else (self.fast, [])
        return repo.load(name, targets, process_group=process_group, timeout=timeout, _nearer=nearer, **kwargs)

    def store_counters(self) -> Dict[str, Dict[str, int]]:
        """Repository.store_counters of each tier: {"fast": ..., "shared": ...}."""
        return {"fast": self.fast.store_counters(), "shared": self.shared.store_counters()}

    def close(self, wait: bool = True) -> None:
        """Stops the background drain after one more pass (wait=True) or
        at once. What is not durable stays in the fast tier; opening the
        tiers again drains it."""
        if self._closed:
            return
        self._closed = True
        self._drainer.stop(finish=wait)
        _open_tiers.discard(self)


def _free_bytes(path: str) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def open_tiers(shared_url: str, fast_tier: Union[str, "os.PathLike[str]"], *, keep_last: int = 2, on_phase=None, full_wait: float = 60.0,
               replicas: int = 1, replica_jump: Optional[int] = None, replica_strategy: str = "ring",
               fast_options: Optional[Dict[str, Any]] = None, **open_options) -> TieredRepository:
    """ckptfs.open(shared_url, fast_tier=...): the fast tier is made when
    missing (with the shared tier's chunk size and codec settings, so that
    its chunks are the shared tier's) and names its shared tier."""
    from . import _core  # noqa: PLC0415
    from .repository import init, open as open_repository  # noqa: PLC0415

    if "://" in os.fspath(fast_tier):
        raise InvalidArgumentError(f"the fast tier must be a local directory, not {fast_tier}")
    shared = open_repository(shared_url, **open_options)
    fast_tier = os.path.abspath(os.fspath(fast_tier))
    local = {k: v for k, v in open_options.items() if k in ("threads", "cache_bytes") and v is not None}
    local.update(fast_options or {})
    if not os.path.exists(os.path.join(fast_tier, "ckptfs.json")):
        c = shared.config
        try:
            init(fast_tier, chunk_size=c["chunk_size"], pack_size=c["pack_size"], compression=c["compression"],
                 level=c["level"], adaptive=c["adaptive"], **local)
        except AlreadyExistsError:
            pass  # another rank of this host made it meanwhile
    fast = open_repository(fast_tier, **local)
    if fast.config["chunk_size"] != shared.config["chunk_size"]:
        raise InvalidArgumentError(f"the fast tier {fast_tier} has chunks of {fast.config['chunk_size']} bytes and "
                                   f"the shared tier {shared_url} of {shared.config['chunk_size']}: they must agree "
                                   "(the fast tier's chunks are the shared tier's)")
    _core.write_shared_tier(fast_tier, shared.path)
    return TieredRepository(fast, shared, keep_last=keep_last, on_phase=on_phase, full_wait=full_wait,
                            replicas=replicas, replica_jump=replica_jump, replica_strategy=replica_strategy)
