"""One rank of a collective save or restore (Repository.save/load with
process_group=), run by test_collective.py, one process per rank over gloo
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment):

    collective_worker.py save REPO NAME LAYOUT [plain|verify|differ|async]
        saves this rank's part of LAYOUT; prints {"logical": bytes this rank
        put, "plan": the plan's figures, "lists": the LIST requests the save
        sent} as JSON. "plain" saves without a
        process group (every rank puts everything it holds), "verify" with
        verify_replicas, "differ" with verify_replicas and rank 1's replica
        of the norm changed (every rank must raise); "async" with
        async_save.
    collective_worker.py load REPO NAME LAYOUT [as-nccl|stale]
        loads this rank's part of LAYOUT (any world size) through the group,
        checks every element, prints {"fetched": stored bytes this rank read
        from the store, "chunks": chunks read, "delivered": how regions
        went between ranks} as JSON; "delivered" lists "GROUP:DEVICE" for
        the point-to-point batches sent: GROUP "ckptfs" (ckptfs's own gloo
        group) or "caller" (the job's group), DEVICE "cpu" or "cuda".
        "as-nccl" takes the path of ranks loading into GPUs of their own
        under a job's NCCL group, the job's gloo group standing in for
        NCCL and host memory for the GPUs'. "stale": rank 2's reader
        says it opened another checkpoint of that name (every rank must
        raise).
    collective_worker.py dcp-load REPO NAME - [alone]
        dcp.load of full() into DTensors (Replicate x Shard(0) on a 2 x N/2
        mesh) through ckptfs.torch.StorageReader with the process group
        ("alone": without it), each rank with a catalog of its own on S3; prints
        the stored bytes it fetched and its PUT requests (read leases).
    collective_worker.py resume REPO - -
        resume_point("latest") and resume_point("no-such") through the group,
        with only rank 0 allowed to ask the repository; prints the answers.
    collective_worker.py die-save|die-load REPO NAME LAYOUT
        rank 1 exits in the middle (once it has its part of the plan); the
        other ranks print "raised: MESSAGE".
    collective_worker.py die-deliver REPO NAME LAYOUT [as-nccl]
        rank 1 exits as it begins sending fetched regions; the other ranks
        print "raised: MESSAGE".
    collective_worker.py die-commit REPO NAME LAYOUT
        rank 1 exits after the puts, before it commits its part; the other
        ranks print "raised: MESSAGE" (the timeout is 8 s).

With CKPT_TEST_CUDA=1 in the environment, save and load hold their tensors
in CUDA memory (rank r on GPU r modulo the GPUs there are) and the job's
default process group is NCCL for CUDA tensors and gloo for CPU ones, as
a GPU job's is. NCCL refuses two ranks on one GPU at its first
collective, so a run with several ranks on one GPU also proves that
ckptfs then keeps off the job's NCCL group.

LAYOUT: "hsdp" (2 replica groups, the rows of every layer split over the
ranks of a group, a norm on every rank), "dp" (everything whole on every
rank) or "mixed" (small tensors whole on every rank, a large one split by
rows over all ranks).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import ckptfs
import ckptfs.collective
from worker_exit import leave

# Rows of 2000 (f32) and 1000 (bf16) bytes: a restore at another world size
# cuts stored 64 KiB chunks, which two ranks then need.
ROWS, COLS = 96, 500


def full():
    """The whole tensors every run agrees on."""
    gen = torch.Generator().manual_seed(11)
    out = {f"layers.{i}.w": torch.randn(ROWS, COLS, generator=gen) for i in range(4)}
    out["embed"] = torch.randn(4 * ROWS, COLS, generator=gen).to(torch.bfloat16)
    out["norm"] = torch.randn(COLS, generator=gen)
    out["bias"] = torch.randn(7, generator=gen, dtype=torch.float64)
    return out


def part(layout, rank, world):
    """(values, shards) of this rank: views of full()."""
    want = full()
    values, shards = {}, {}

    def rows(name, pieces, index):
        t = want[name]
        step = t.shape[0] // pieces
        values[name] = t[index * step:(index + 1) * step].clone()
        shards[name] = ckptfs.Box(tuple(t.shape), (index * step, 0))

    if layout == "dp":
        return {k: v.clone() for k, v in want.items()}, {}
    if layout == "hsdp":
        group = world // 2  # ranks per replica group
        for i in range(4):
            rows(f"layers.{i}.w", group, rank % group)
        rows("embed", group, rank % group)
        values["norm"], values["bias"] = want["norm"].clone(), want["bias"].clone()
        return values, shards
    if layout == "mixed":
        for i in range(4):
            values[f"layers.{i}.w"] = want[f"layers.{i}.w"].clone()
        rows("embed", world, rank)
        values["norm"], values["bias"] = want["norm"].clone(), want["bias"].clone()
        return values, shards
    raise SystemExit(f"unknown layout {layout}")


def main():
    action, repo_path, name, layout = sys.argv[1:5]
    mode = sys.argv[5] if len(sys.argv) > 5 else ""
    cuda = os.environ.get("CKPT_TEST_CUDA") == "1"
    if cuda:
        # A GPU per rank where there are enough, else several on one.
        torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Which transport carried the fetched regions to the ranks needing them.
    delivered = set()
    batch = dist.batch_isend_irecv

    def watched(ops):
        group = "caller" if ops[0].group in (None, dist.group.WORLD) else "ckptfs"
        delivered.add(f"{group}:{ops[0].tensor.device.type}")
        if action == "die-deliver" and rank == 1:
            gone()
        return batch(ops)
    dist.batch_isend_irecv = watched
    if mode == "stale":
        # Rank 2's host lists another checkpoint of the same name: it reads
        # a copy of the repository in which the name was removed and saved
        # again (made before any rank begins to load).
        if rank == 2:
            import shutil  # noqa: PLC0415

            stale = repo_path.rstrip("/") + "-stale"
            shutil.copytree(repo_path, stale)
            other = ckptfs.open(stale)
            other.rm(name)
            other.save(name, full(), step=5)
            del other
            repo_path = stale
        dist.barrier()
    if mode == "as-nccl":
        # The caller's NCCL path, with the job's gloo group standing in for
        # NCCL and host memory for the GPU's: ranks "on GPUs of their own".
        ckptfs.collective.Group.user_has_nccl = lambda self: True
        ckptfs.collective._cuda_device_of = lambda torch, targets: f"GPU-{rank}"

    def gone(*_args, **_kwargs):
        os._exit(3)
    if action == "open-fail":
        # Rank 2 names a repository that is not there.
        url = repo_path + "-missing" if rank == 2 else repo_path
        try:
            ckptfs.open(url, process_group=dist.group.WORLD, timeout=20)
            print("opened")
        except ckptfs.Error as e:
            print(f"raised: {type(e).__name__}: {e}")
        leave()
    if action == "restart":
        # A restart on `world` hosts (a catalog each): open, resume point and
        # load, with the job's process group or each rank alone.
        os.environ["CKPT_CACHE_DIR"] = os.path.join(os.environ["CKPT_CACHE_DIR"], mode, f"rank{rank}")
        group = dist.group.WORLD if mode == "together" else None
        repo = ckptfs.open(repo_path, process_group=group, timeout=20)
        point = repo.resume_point("latest", process_group=group, timeout=20)
        values, shards = part(layout, rank, world)
        targets = {k: torch.zeros_like(v) for k, v in values.items()}
        repo.load(point["name"], targets, shards=shards, process_group=group, timeout=20)
        for k, v in values.items():
            assert torch.equal(targets[k], v), k
        c = repo.store_counters()
        print(json.dumps({"name": point["name"], "lists": c["list_requests"], "gets": c["get_requests"],
                          "puts": c["put_requests"], "requests": c["requests"]}))
        leave()
    repo = ckptfs.open(repo_path)
    if action.startswith("die-") and rank == 1:
        if action == "die-commit":
            ckptfs._core.Writer.commit = gone
        elif action == "die-deliver":
            pass  # in watched(), as it sends
        else:
            # Once it has its part of the plan (the plan's scatter).
            scattered = ckptfs.collective.Group.scatter

            def dies_after(*args, **kwargs):
                scattered(*args, **kwargs)
                gone()
            ckptfs.collective.Group.scatter = dies_after
    if action == "resume":
        if rank != 0:
            def asks(*_args, **_kwargs):
                raise AssertionError("only rank 0 asks the repository")
            repo.checkpoints = asks
        latest = repo.resume_point("latest", process_group=dist.group.WORLD, timeout=20)
        try:
            repo.resume_point("no-such", process_group=dist.group.WORLD, timeout=20)
            missing = "found"
        except ckptfs.NotFoundError as e:
            missing = f"NotFoundError: {e}"
        print(json.dumps({"latest": latest and latest["name"], "step": latest and latest["step"],
                          "missing": missing}))
        leave()
    if action == "dcp-load":
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: PLC0415

        from ckptfs.torch import StorageReader  # noqa: PLC0415

        if repo_path.startswith("s3://"):  # each rank a host of its own (a catalog each), as on a cluster
            os.environ["CKPT_CACHE_DIR"] = os.path.join(os.environ["CKPT_CACHE_DIR"], "dcp-" + mode, f"rank{rank}")
        mesh = init_device_mesh("cpu", (2, world // 2))
        want = full()
        target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate(), Shard(0)]) for k, v in want.items()}
        together = mode != "alone"
        reader = StorageReader(repo_path, name, process_group=dist.group.WORLD if together else None, timeout=20)
        dcp.load(target, storage_reader=reader)
        for k, v in want.items():
            assert torch.equal(target[k].full_tensor(), v), k
        c = reader._repo.store_counters()
        print(json.dumps({"fetched": c["stored_bytes_fetched"], "chunks": c["chunks_fetched"], "puts": c["put_requests"]}))
        leave()
    if action in ("save", "die-save", "die-commit"):
        values, shards = part(layout, rank, world)
        if cuda:
            values = {k: v.cuda() for k, v in values.items()}
        if mode == "differ" and rank == 1:
            values["norm"][3] += 1
        if mode == "other-name" and rank == 1:
            name += "-other"
        if mode == "bad-shard" and rank == 1:  # a box that runs past the tensor's end
            shards["layers.0.w"] = ckptfs.Box(shards["layers.0.w"].global_shape, (ROWS, 0))
        lists = repo.store_counters()["list_requests"]
        try:
            if mode == "plain":
                res = repo.save(name, values, shards=shards, rank=rank, world_size=world, step=5)
            elif mode == "async":
                res = repo.async_save(name, values, shards=shards, step=5, process_group=dist.group.WORLD,
                                      timeout=20).result()
            else:
                res = repo.save(name, values, shards=shards, step=5, process_group=dist.group.WORLD,
                                verify_replicas=mode in ("verify", "differ"), overwrite=mode == "overwrite",
                                timeout=8 if action == "die-commit" else 20)
        except ckptfs.Error as e:
            print(f"raised: {type(e).__name__}: {e}")
            leave()
        print(json.dumps({"logical": res["logical_bytes"], "plan": res.get("collective"),
                          "lists": repo.store_counters()["list_requests"] - lists}))
    else:
        want = full()
        values, shards = part(layout, rank, world)
        if cuda:
            values = {k: v.cuda() for k, v in values.items()}
        targets = {k: torch.zeros_like(v) for k, v in values.items()}
        try:
            repo.load(name, targets, shards=shards, process_group=dist.group.WORLD, timeout=20)
        except ckptfs.Error as e:
            print(f"raised: {type(e).__name__}: {e}")
            leave()
        for k, v in values.items():
            assert torch.equal(targets[k], v), k
        del want
        c = repo.store_counters()
        print(json.dumps({"fetched": c["stored_bytes_fetched"], "chunks": c["chunks_fetched"],
                          "delivered": sorted(delivered)}))
    leave()


if __name__ == "__main__":
    main()
