"""One host of a job on two tiers (ckptfs.open(URL, fast_tier=...)), run by
test_tiers.py: one process per host over gloo (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT from the environment), each with its own fast tier
HOSTS/host-RANK/fast and its own cache directory HOSTS/host-RANK/cache;
CKPT_TEST_REPLICAS, CKPT_TEST_REPLICA_STRATEGY and CKPT_TEST_KEEP_LAST in
the environment give ckptfs.open's replicas, replica_strategy and keep_last.

    tier_worker.py save URL HOSTS NAME STEP [die-mid-drain|hold-drain|no-wait]
        saves this rank's rows of state(STEP) through the group and waits
        until the checkpoint is durable in the shared tier; prints
        {"stage", "blocking", "replicas"} as JSON. "die-mid-drain": rank 1
        is killed once its drain has put its first object in the shared
        tier (the rest of its part stays in its fast tier only); the others
        wait until their own ranks are in the shared tier and print their
        stage. "hold-drain": no rank's drain gets past its start; each
        prints its stage and exits. "no-wait": every rank prints its stage
        without waiting.
    tier_worker.py resume URL HOSTS - -
        opens the tiers (each host's drain finishes what an earlier process
        left), takes the resume point through the group, waits until it is
        durable, loads it through the group, checks every element and
        prints {"name", "fast", "shared"}: what this rank's load read from
        each tier (chunks and bytes, requests), and "restored": what the
        load got back from peers' replicas first.
    tier_worker.py dcp-save URL HOSTS NAME STEP
        dcp.save of this rank's rows of "w" (item "w.RANK") through
        ckptfs.torch.StorageWriter with the fast tier, then the writer's
        replicate(), and waits until durable; prints {"stage",
        "replicated_stage", "replicas"}.
    tier_worker.py dcp-load URL HOSTS NAME STEP
        dcp.load of the same through StorageReader with the group; checks
        every element and prints {"restored", "fast", "shared"}.
"""
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import ckptfs
from worker_exit import leave

ROWS, COLS = 64, 1024  # 256 KiB of f32 per rank's part of "w"


def state(step, world):
    """The whole tensors of step `step`: "frozen" never changes, "w" does."""
    gen = torch.Generator().manual_seed(1000 + step)
    frozen = torch.randn(world * ROWS, COLS, generator=torch.Generator().manual_seed(5))
    return {"frozen": frozen, "w": torch.randn(world * ROWS, COLS, generator=gen)}


def mine(step, rank, world, saving=True):
    """This rank's values and shards: its rows of "frozen" and "w", and
    "bias" whole, which the last rank alone saves and every rank loads (a
    region read by one rank for all: the one whose host holds it)."""
    values, shards = {}, {}
    for key, t in state(step, world).items():
        values[key] = t[rank * ROWS:(rank + 1) * ROWS].clone()
        shards[key] = ckptfs.Box(tuple(t.shape), (rank * ROWS, 0))
    if rank == world - 1 or not saving:
        values["bias"] = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(2000 + step))
        shards["bias"] = ckptfs.Box((ROWS, COLS), (0, 0))
    values["rng"] = f"rng of step {step}, rank {rank}".encode()
    return values, shards


def open_tiers(url, hosts, rank, on_phase=None):
    here = os.path.join(hosts, f"host-{rank}")
    return ckptfs.open(url, fast_tier=os.path.join(here, "fast"), cache_dir=os.path.join(here, "cache"),
                       process_group=dist.group.WORLD, on_drain_phase=on_phase,
                       replicas=int(os.environ.get("CKPT_TEST_REPLICAS", "1")),
                       replica_strategy=os.environ.get("CKPT_TEST_REPLICA_STRATEGY", "ring"),
                       keep_last=int(os.environ.get("CKPT_TEST_KEEP_LAST", "2")))


def main():
    action, url, hosts, name, step = sys.argv[1:6]
    mode = sys.argv[6] if len(sys.argv) > 6 else ""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    if action == "save":
        tiers = None

        def kill_at_first_put():
            shared = tiers.shared
            before = shared.store_counters()["put_requests"]
            while shared.store_counters()["put_requests"] == before:
                time.sleep(0.0002)
            os._exit(9)  # killed mid-drain: the rest of the part stays in this host's fast tier

        def on_phase(line):
            if not line.startswith("draining"):
                return
            if mode == "die-mid-drain" and rank == 1:
                threading.Thread(target=kill_at_first_put, daemon=True).start()
            elif mode == "hold-drain":
                threading.Event().wait()  # the drain thread stops here for good
        tiers = open_tiers(url, hosts, rank, on_phase)
        values, shards = mine(int(step), rank, world)
        # Blobs are rank 0's alone in a checkpoint: one per rank, by name.
        values[f"rng.{rank}"] = values.pop("rng")
        start = time.perf_counter()
        result = tiers.save(name, values, step=int(step), shards=shards, process_group=dist.group.WORLD)
        blocking = time.perf_counter() - start
        handle = result["tiers"]
        if mode == "die-mid-drain":
            stage = handle.wait("drained" if rank != 1 else "durable", timeout=60)
        elif mode in ("no-wait", "hold-drain"):
            stage = handle.stage
        else:
            stage = handle.wait("durable", timeout=120)
        print(json.dumps({"stage": stage, "blocking": blocking, "replicas": handle.replicas}), flush=True)
        if mode == "hold-drain":
            dist.barrier()
            os._exit(0)  # the drain thread is held: no close
        tiers.close()
        if mode == "die-mid-drain":
            os._exit(0)  # rank 1 is gone: no barrier
        dist.barrier()
    elif action == "resume":
        tiers = open_tiers(url, hosts, rank)
        point = tiers.resume_point(process_group=dist.group.WORLD)
        name = point["name"]
        # Only what this host drains is waited for here: the resume point
        # is already complete in one tier.
        values, shards = mine(point["step"], rank, world, saving=False)
        targets = {k: torch.empty_like(v) for k, v in values.items() if k != "rng"}
        before = tiers.store_counters()
        tiers.load(name, targets, shards={k: shards[k] for k in targets}, process_group=dist.group.WORLD)
        after = tiers.store_counters()
        for key, t in targets.items():
            if not torch.equal(t, values[key]):
                raise SystemExit(f"rank {rank}: {key} of {name} differs")
        delta = {tier: {k: after[tier][k] - before[tier][k] for k in after[tier]} for tier in after}
        print(json.dumps({"name": name, "where": point["tier"], "restored": tiers.restored, **delta}), flush=True)
        tiers.close()
        dist.barrier()
    elif action in ("dcp-save", "dcp-load"):
        import torch.distributed.checkpoint as dcp
        from ckptfs.torch import StorageReader, StorageWriter

        here = os.path.join(hosts, f"host-{rank}")
        options = dict(fast_tier=os.path.join(here, "fast"), cache_dir=os.path.join(here, "cache"),
                       replicas=int(os.environ.get("CKPT_TEST_REPLICAS", "1")))
        want = mine(int(step), rank, world)[0]["w"]
        if action == "dcp-save":
            writer = StorageWriter(url, name, **options)
            dcp.save({f"w.{rank}": want}, storage_writer=writer)
            cost = writer.replicate()
            replicated_stage = writer.tiers.stage
            stage = writer.tiers.wait("durable", timeout=120)
            print(json.dumps({"stage": stage, "replicated_stage": replicated_stage, "replicas": cost}), flush=True)
            writer._tiers.close()
        else:
            reader = StorageReader(url, name, process_group=dist.group.WORLD, **options)
            targets = {f"w.{rank}": torch.empty_like(want)}
            before = reader._tiers.store_counters()
            dcp.load(targets, storage_reader=reader)
            after = reader._tiers.store_counters()
            if not torch.equal(targets[f"w.{rank}"], want):
                raise SystemExit(f"rank {rank}: w.{rank} of {name} differs")
            delta = {tier: {k: after[tier][k] - before[tier][k] for k in after[tier]} for tier in after}
            print(json.dumps({"restored": reader.restored, **delta}), flush=True)
            reader._tiers.close()
        dist.barrier()
    else:
        raise SystemExit(f"unknown action {action}")
    leave()


if __name__ == "__main__":
    main()
