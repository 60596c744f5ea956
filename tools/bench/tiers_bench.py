"""Two tiers (ckptfs.open(URL, fast_tier=...)) beside the paths they stand
for, in the same run, on the same bytes, in one process:

  save blocking time: a save to the fast tier (the drain to the shared
  tier runs after it returns) against a save to a local repository alone,
  and against a save straight to the shared tier;
  time until durable in the shared tier, and the drain alone, against
  ckptfs.copy (ckpt copy) of the same checkpoint from a local repository
  into a fresh shared repository;
  a restore from the fast tier (every chunk read there, checked) against a
  raw read of the same bytes from a file on the same disk, and the bytes
  the restore fetched from the shared tier;
  a CPU-bound training step (matrix products) timed alone and while a
  drain of the checkpoint runs (the slowdown);
  with --hosts N (default 4; 0 skips it): a job of N processes over gloo,
  each a host with its own fast tier and cache, saves --mib in all and
  drains it; one host's fast tier is then deleted and a new job restores
  through the group: the bytes each restore fetched from the shared tier
  and its time, with replicas=2 against replicas=1 (the lost host's part
  then comes from the shared tier).

The shared tier is a fresh prefix of the S3 store AWS_ENDPOINT_URL names,
or, without one, a directory (said in the output). Medians of --runs;
minor page faults per GiB beside each save and restore.

    PYTHONPATH=build/python build/venv/bin/python tools/bench/tiers_bench.py --dir /dev/shm --mib 256 --runs 5
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

import ckptfs
from bench_util import add_scratch_dir_option, llm_state, minor_faults, state_bytes


def emptied(repo):
    """Removes every checkpoint of `repo` and collects its packs: the test
    S3 server keeps its objects in memory."""
    names = [c["name"] for c in repo.checkpoints(include_pending=True)]
    if names:
        repo.rm(*names)
    repo.gc()


class Shared:
    """Fresh shared repositories: S3 prefixes, or directories under `root`."""

    def __init__(self, root):
        self.s3 = bool(os.environ.get("AWS_ENDPOINT_URL"))
        self.root = root
        self.caches = os.path.join(root, "caches")

    def fresh(self):
        tag = uuid.uuid4().hex[:10]
        if self.s3:
            url = f"s3://ckptfs-bench/tiers-{tag}"
            ckptfs.init(url, cache_dir=os.path.join(self.caches, tag))
            return url, os.path.join(self.caches, tag)
        path = os.path.join(self.root, f"shared-{tag}")
        ckptfs.init(path)
        return path, None


def timed(fn):
    faults = minor_faults()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, minor_faults() - faults, out


def cpu_step(a, b, n=6):
    for _ in range(n):
        a = torch.tanh(a @ b)
    return a


def host_worker(action, url, hosts, mib, replicas):
    """One host of the --hosts job (RANK, WORLD_SIZE, MASTER_* from the
    environment): "save" saves this rank's tensors (its own names) through
    the group and waits until durable; "restore" restores them through the
    group. Prints {"seconds", "shared_bytes", "restored"} as JSON."""
    import torch.distributed as dist  # noqa: PLC0415

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    here = os.path.join(hosts, f"host-{rank}")
    tiers = ckptfs.open(url, fast_tier=os.path.join(here, "fast"), cache_dir=os.path.join(here, "cache"),
                        process_group=dist.group.WORLD, replicas=replicas)
    mine = {f"r{rank}.{k}": v for k, v in llm_state(torch, max(1, mib // world), 100 + rank).items()}
    out = {"restored": None}
    start = time.perf_counter()
    if action == "save":
        tiers.save("step-1", mine, step=1, process_group=dist.group.WORLD)["tiers"].wait("durable", timeout=600)
    else:
        targets = {k: torch.empty_like(v) for k, v in mine.items()}
        before = tiers.store_counters()["shared"]["stored_bytes_fetched"]
        tiers.load("step-1", targets, process_group=dist.group.WORLD)
        out["shared_bytes"] = tiers.store_counters()["shared"]["stored_bytes_fetched"] - before
        out["restored"] = tiers.restored
        assert all(torch.equal(targets[k], mine[k]) for k in mine)
    out["seconds"] = time.perf_counter() - start
    tiers.close()
    dist.barrier()
    print(json.dumps(out), flush=True)


def host_job(action, url, hosts, mib, replicas, n):
    """Runs host_worker on n processes; their JSON outputs by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", action, url, hosts, str(mib),
                                       str(replicas)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for r, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=1200)
        if p.returncode != 0:
            raise SystemExit(f"host {r} of the {action} job exited {p.returncode}: {stderr.decode()[-2000:]}")
        outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return outs


def lost_host(shared, root, mib, n, runs):
    """The --hosts figures: bytes from the shared tier and restore time
    after one host lost its fast tier, replicas=2 against replicas=1."""
    found = {}
    for replicas in (1, 2):
        seconds, shared_bytes, back = [], [], []
        for run in range(runs):
            url, _cache = shared.fresh()
            hosts = os.path.join(root, f"hosts-{replicas}-{run}")
            host_job("save", url, hosts, mib, replicas, n)
            shutil.rmtree(os.path.join(hosts, f"host-{n // 2}", "fast"))
            outs = host_job("restore", url, hosts, mib, replicas, n)
            seconds.append(max(o["seconds"] for o in outs))
            shared_bytes.append(sum(o["shared_bytes"] for o in outs))
            back.append(sum((o["restored"] or {}).get("stored_bytes_received", 0) for o in outs))
            emptied(ckptfs.open(url, cache_dir=os.path.join(root, "caches", f"look-{replicas}-{run}")))
            shutil.rmtree(hosts)
        found[replicas] = (statistics.median(seconds), max(shared_bytes), statistics.median(back))
    (t1, b1, _), (t2, b2, p2) = found[1], found[2]
    print(f"one of {n} hosts lost its fast tier, {mib} MiB in all, medians of {runs}:")
    print(f"  replicas=1: restore {t1:.3f} s, {b1} bytes from the shared tier")
    print(f"  replicas=2: restore {t2:.3f} s, {b2} bytes from the shared tier (target 0), "
          f"{p2 / (1 << 20):.1f} MiB back from a peer   restore time replicas=2 / replicas=1 {t2 / t1:.2f}x")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        action, url, hosts, mib, replicas = sys.argv[2:7]
        host_worker(action, url, hosts, int(mib), int(replicas))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scratch_dir_option(parser)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hosts", type=int, default=4, help="hosts of the lost-host job (0: skip it)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tiers-bench-", dir=args.dir)
    shared = Shared(root)
    state = llm_state(torch, args.mib, 1)
    size = state_bytes(state)
    gib = size / (1 << 30)
    print(f"state: {size / (1 << 20):.0f} MiB; scratch {args.dir}; shared tier: "
          f"{'S3 at ' + os.environ['AWS_ENDPOINT_URL'] if shared.s3 else 'a directory (no AWS_ENDPOINT_URL)'}")
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512) * 0.05
    figures = {k: [] for k in ("tiered", "local", "direct", "durable", "drain", "copy", "restore", "raw",
                               "step", "step_draining")}
    faults = {"tiered": [], "local": [], "restore": [], "raw": []}
    fetched_shared = []
    other = llm_state(torch, args.mib, 2)  # the same size, other bytes: a drain of it sends everything

    def settle():
        """Waits until the machine is quiet (the store server's own work
        from the last step done, up to 30 s): on 2 cores it would
        otherwise weigh on whichever path comes next."""
        def busy():
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            return sum(v), v[3] + v[4]
        deadline = time.time() + 30
        while time.time() < deadline:
            t0, i0 = busy()
            time.sleep(0.5)
            t1, i1 = busy()
            if t1 > t0 and (i1 - i0) / (t1 - t0) >= 0.85:
                return

    def local_save(run):
        local = os.path.join(root, f"local-{run}")
        repo = ckptfs.init(local)
        settle()
        t, f, _ = timed(lambda: repo.save("step-1", state, step=1))
        figures["local"].append(t)
        faults["local"].append(f / gib)
        # the same checkpoint copied into a fresh shared repository
        url, cache = shared.fresh()
        target = ckptfs.open(url, cache_dir=cache)
        settle()
        t, _, _ = timed(lambda: ckptfs.copy(repo, target, "step-1"))
        figures["copy"].append(t)
        emptied(target)
        del repo, target
        shutil.rmtree(local)

    def direct_save(run):
        url, cache = shared.fresh()
        direct = ckptfs.open(url, cache_dir=cache)
        settle()
        t, _, _ = timed(lambda: direct.save("step-1", state, step=1))
        figures["direct"].append(t)
        emptied(direct)

    def tiered(run):
        url, cache = shared.fresh()
        fast = os.path.join(root, f"fast-{run}")
        tiers = ckptfs.open(url, fast_tier=fast, cache_dir=cache)
        tiers.drain(timeout=60)  # its first pass (what an earlier process left) is over
        settle()
        start = time.perf_counter()
        t, f, result = timed(lambda: tiers.save("step-1", state, step=1))
        figures["tiered"].append(t)
        faults["tiered"].append(f / gib)
        result["tiers"].wait("durable", timeout=600)
        durable = time.perf_counter() - start
        figures["durable"].append(durable)
        figures["drain"].append(durable - t)
        # a restore from the fast tier, against a raw read of the bytes
        targets = {k: torch.empty_like(v) for k, v in state.items()}
        before = tiers.store_counters()["shared"]["stored_bytes_fetched"]
        t, f, _ = timed(lambda: tiers.load("step-1", targets))
        figures["restore"].append(t)
        faults["restore"].append(f / gib)
        fetched_shared.append(tiers.store_counters()["shared"]["stored_bytes_fetched"] - before)
        assert all(torch.equal(targets[k], state[k]) for k in state)
        raw = os.path.join(root, f"raw-{run}")
        with open(raw, "wb") as out:
            for v in state.values():
                out.write(memoryview(v.contiguous().view(torch.uint8).numpy()))
        buffers = {k: torch.empty_like(v) for k, v in state.items()}

        def read_raw():
            with open(raw, "rb", buffering=0) as src:
                for v in buffers.values():
                    src.readinto(memoryview(v.view(torch.uint8).numpy()))
        t, f, _ = timed(read_raw)
        figures["raw"].append(t)
        faults["raw"].append(f / gib)
        os.unlink(raw)
        # the training step alone, then while a drain of other bytes runs
        alone = []
        for _ in range(10):
            s = time.perf_counter()
            cpu_step(a, b)
            alone.append(time.perf_counter() - s)
        figures["step"].append(statistics.median(alone))
        result = tiers.save("step-2", other, step=2)
        during = []
        while result["tiers"].stage != "durable":
            s = time.perf_counter()
            cpu_step(a, b)
            during.append(time.perf_counter() - s)
        if during:
            figures["step_draining"].append(statistics.median(during))
        tiers.close()
        emptied(tiers.shared)
        shutil.rmtree(fast)

    if args.hosts:
        try:
            lost_host(shared, root, args.mib, args.hosts, args.runs)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
    try:
        paths = [local_save, direct_save, tiered]
        for run in range(args.runs):
            # each path first in turn: what one leaves behind (the store's
            # background work, the page cache) weighs on all alike
            for path in paths[run % 3:] + paths[:run % 3]:
                path(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) if v else float("nan") for k, v in figures.items()}
    mf = {k: statistics.median(v) for k, v in faults.items()}
    mib = size / (1 << 20)
    print(f"medians of {args.runs} runs, {mib:.0f} MiB each")
    print(f"save blocking, two tiers        {med['tiered']:.3f} s ({mib / med['tiered']:.0f} MiB/s, "
          f"{mf['tiered']:.0f} minor faults/GiB)")
    print(f"save, a local repository alone  {med['local']:.3f} s ({mib / med['local']:.0f} MiB/s, "
          f"{mf['local']:.0f} minor faults/GiB)   ratio {med['tiered'] / med['local']:.2f}x (target <= 1.1)")
    print(f"save straight to the shared tier {med['direct']:.3f} s   two tiers / direct "
          f"{med['tiered'] / med['direct']:.2f}x")
    print(f"until durable in the shared tier {med['durable']:.3f} s; the drain alone {med['drain']:.3f} s")
    print(f"ckptfs.copy of the checkpoint    {med['copy']:.3f} s   durable / copy {med['durable'] / med['copy']:.2f}x, "
          f"drain / copy {med['drain'] / med['copy']:.2f}x, durable / (local save + copy) "
          f"{med['durable'] / (med['local'] + med['copy']):.2f}x (target <= 1.1)")
    print(f"restore from the fast tier       {med['restore']:.3f} s ({mib / med['restore']:.0f} MiB/s, "
          f"{mf['restore']:.0f} minor faults/GiB)")
    print(f"raw read of the same bytes       {med['raw']:.3f} s ({mib / med['raw']:.0f} MiB/s, "
          f"{mf['raw']:.0f} minor faults/GiB; both into new buffers)   "
          f"restore / raw throughput {med['raw'] / med['restore']:.2f}x (target >= 0.9)")
    print(f"bytes fetched from the shared tier by the restores: {max(fetched_shared)} (target 0)")
    print(f"training step {med['step'] * 1000:.1f} ms alone, {med['step_draining'] * 1000:.1f} ms while a drain runs "
          f"({med['step_draining'] / med['step']:.2f}x)")


if __name__ == "__main__":
    main()
