"""ckptfs beside torch.distributed.checkpoint (DCP) on the same machine, in
the same run, on the same bytes.

The state is LLM-like: bf16 parameters with fp32 master weights and AdamW
moments (exp_avg, exp_avg_sq), about --gib GiB in all, held as Shard(0)
DTensors by 4 gloo ranks on the CPU (each rank a process). Measured:

  save, durable (every file fsync'd):
    dcp.save with FileSystemWriter (thread_count 1 and 4), dcp.save with
    ckptfs.torch.StorageWriter, repo.save of each rank's shards, and
    torch.save + fsync of each rank's state;
  blocking time of dcp.async_save with FileSystemWriter and with the ckptfs
    writer, and of repo.async_save: the median of --async-saves of each in
    a run, each into a directory or repository of its own;
  a second save after 10 % of the parameters and their optimizer state
    changed (the rest bit-identical): wall time and bytes it added, ckptfs
    against DCP, and the bytes on disk after both saves;
  load resharded 4 -> 2 ranks: dcp.load with FileSystemReader against
    ckptfs.torch.StorageReader, from a cold page cache where it can be
    dropped (root).

Every figure is the slowest rank's, the median over --runs. Minor page
faults of the ranks are reported per GiB beside each save and load, and the
ranks' CPU seconds in all. With orbax-checkpoint installed
(tools/bench/requirements.txt), Orbax saves and restores the same bytes as
whole JAX arrays in one process, as a second peer.

    build/venv/bin/python tools/bench/dcp_bench.py --dir /tmp --gib 2 --runs 3

(with the ckptfs package installed in that venv, or PYTHONPATH=build/python).
"""
import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time

from bench_util import drop_caches, minor_faults

RANKS_SAVE = 4
RANKS_LOAD = 2
DIM = 1024
VOCAB = 32768


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


def shapes(gib):
    """Parameter shapes whose state (14 bytes a parameter) is about `gib` GiB;
    every first dimension divides by 4."""
    params = int(gib * (1 << 30) / 14)
    out = {"embed.weight": (VOCAB, DIM)}
    per_layer = 12 * DIM * DIM
    layers = max(1, (params - VOCAB * DIM) // per_layer)
    for i in range(layers):
        out[f"layers.{i}.attn.qkv.weight"] = (3 * DIM, DIM)
        out[f"layers.{i}.attn.out.weight"] = (DIM, DIM)
        out[f"layers.{i}.mlp.up.weight"] = (4 * DIM, DIM)
        out[f"layers.{i}.mlp.down.weight"] = (DIM, 4 * DIM)
    return out


def rank_part(table, rank, world):
    """{name: (first row, param, master, exp_avg, exp_avg_sq)}: rank `rank`'s
    rows of every tensor, the same bytes in every process that asks."""
    import torch
    gen = torch.Generator().manual_seed(1000 + rank)
    out = {}
    for name, (rows, cols) in table.items():
        n = rows // world
        master = torch.randn(n, cols, generator=gen) * 0.02
        m = torch.randn(n, cols, generator=gen) * 1e-3
        v = (torch.randn(n, cols, generator=gen) * 1e-3) ** 2
        out[name] = (rank * n, master.to(torch.bfloat16), master, m, v)
    return out


# ---- one rank ----------------------------------------------------------------------


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptfs
    from ckptfs.torch import StorageReader, StorageWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    table = shapes(args.gib)

    def make_state(zero):
        """This rank's Shard(0) part of every tensor, as DTensors, and the same as (local, Box) pairs."""
        model, optim, parts = {}, {}, {}
        generated = None if zero else rank_part(table, rank, world)
        for name, (rows, cols) in table.items():
            n = rows // world

            def dt(local, shape=(rows, cols)):
                return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                          stride=(shape[1], 1))
            if zero:
                r0 = rank * n
                master = torch.zeros(n, cols)
                param = torch.zeros(n, cols, dtype=torch.bfloat16)
                m = torch.zeros(n, cols)
                v = torch.zeros(n, cols)
            else:
                r0, param, master, m, v = generated[name]
            model[name] = dt(param)
            optim[name] = {"master": dt(master), "exp_avg": dt(m), "exp_avg_sq": dt(v)}
            offsets = (r0, 0)
            parts[f"model.{name}"] = (param, ckptfs.Box((rows, cols), offsets))
            for k, t in (("master", master), ("exp_avg", m), ("exp_avg_sq", v)):
                parts[f"optim.{name}.{k}"] = (t, ckptfs.Box((rows, cols), offsets))
        return {"model": model, "optim": optim}, parts

    def change_tenth(state, parts):
        """Every 10th parameter tensor (the 6th, 16th, ...: never the embedding)
        and its optimizer state get new values; returns the share of the
        state's bytes that changed."""
        changed = 0
        for i, name in enumerate(table):
            if i % 10 != 5:
                continue
            rows, cols = table[name]
            changed += rows * cols * 14
            for key in (f"model.{name}", f"optim.{name}.master", f"optim.{name}.exp_avg",
                        f"optim.{name}.exp_avg_sq"):
                t = parts[key][0]
                t.add_(torch.ones((), dtype=t.dtype) * 1e-4)
        return changed / sum(r * c * 14 for r, c in table.values())

    def cpu_seconds():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def timed(fn):
        """Runs fn on every rank; returns the slowest rank's seconds, the
        ranks' minor faults and their CPU seconds (user + system) in all."""
        dist.barrier()
        faults0, cpu0 = minor_faults(), cpu_seconds()
        t0 = time.perf_counter()
        result = fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        totals = torch.tensor([minor_faults() - faults0, cpu_seconds() - cpu0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(totals)
        timed.cpu = totals[1].item()
        return elapsed.item(), totals[0].item(), result

    out = {}
    base = args.dir
    if args.action == "save":
        state, parts = make_state(False)
        nbytes = torch.tensor([sum(t.numel() * t.element_size() for t, _ in parts.values())], dtype=torch.float64)
        dist.all_reduce(nbytes)
        out["bytes"] = nbytes.item()
        # A repository per kind of save, so that no save deduplicates against
        # another's bytes: repo_url holds the saves through DCP (the first,
        # then the second after 10 % changed).
        repo_url = os.path.join(base, "ckptfs-repo")
        api_url = os.path.join(base, "ckptfs-api")
        # Asynchronous saves: --async-saves of each kind, each into a
        # repository or directory of its own (no save dedups against another).
        async_dcp_urls = [os.path.join(base, f"ckptfs-async-dcp-{k}") for k in range(args.async_saves)]
        async_api_urls = [os.path.join(base, f"ckptfs-async-api-{k}") for k in range(args.async_saves)]
        if rank == 0:
            for url in (repo_url, api_url, *async_dcp_urls, *async_api_urls):
                ckptfs.init(url)
        dist.barrier()
        repo = ckptfs.open(api_url)
        async_repos = [ckptfs.open(url) for url in async_api_urls]
        local = {k: t for k, (t, _) in parts.items()}
        shards = {k: s for k, (_, s) in parts.items()}

        def torch_save():
            path = os.path.join(base, "torch-save", f"rank{rank}.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                torch.save(local, f)
                f.flush()
                os.fsync(f.fileno())

        runs = [
            ("dcp FileSystemWriter, 1 thread", lambda: dcp.save(
                state, storage_writer=FileSystemWriter(os.path.join(base, "dcp-t1"), thread_count=1))),
            ("dcp FileSystemWriter, 4 threads", lambda: dcp.save(
                state, storage_writer=FileSystemWriter(os.path.join(base, "dcp-t4"), thread_count=4))),
            ("dcp ckptfs StorageWriter", lambda: dcp.save(state, storage_writer=StorageWriter(repo_url, "dcp-1"))),
            ("repo.save", lambda: repo.save("api-1", local, rank=rank, world_size=world, shards=shards)),
            ("torch.save + fsync", torch_save),
        ]
        for label, fn in runs:
            seconds, faults, _ = timed(fn)
            out[f"save: {label}"] = {"seconds": seconds, "faults": faults, "cpu": timed.cpu}

        # Blocking time of asynchronous saves (the wait for durability is not
        # counted). The save's collectives run on a group of their own, as
        # training code does, so they never interleave with the main thread's.
        async_group = dist.new_group(backend="gloo")

        def blocking(start):
            futures = []
            seconds, _, _ = timed(lambda: futures.append(start()))
            t0 = time.perf_counter()
            f = futures[0]
            (f.result() if hasattr(f, "result") else f.upload_completion.result())
            return seconds, time.perf_counter() - t0
        # The first asynchronous save of a process also pays for DCP's
        # executor and the first touch of its staging memory; a training
        # job pays that once and then saves every N steps, so each figure is
        # the median of the saves.
        for label, start in [
            ("dcp.async_save FileSystemWriter", lambda k: dcp.async_save(
                state, storage_writer=FileSystemWriter(os.path.join(base, f"dcp-async-{k}"), thread_count=1),
                process_group=async_group)),
            ("dcp.async_save ckptfs StorageWriter", lambda k: dcp.async_save(
                state, storage_writer=StorageWriter(async_dcp_urls[k], "dcp-async"), process_group=async_group)),
            ("repo.async_save", lambda k: async_repos[k].async_save("api-async", local, rank=rank, world_size=world,
                                                                    shards=shards)),
        ]:
            samples = [blocking(lambda: start(k)) for k in range(args.async_saves)]
            out[f"blocking: {label}"] = {"seconds": statistics.median(s for s, _ in samples),
                                         "after": statistics.median(r for _, r in samples)}
        dist.barrier()

        # The second save after 10 % changed: ckptfs (through DCP) against DCP.
        if rank == 0:
            out["repo_bytes_before"] = dir_bytes(repo_url)
            out["dcp_bytes_before"] = dir_bytes(os.path.join(base, "dcp-t1"))
        out["changed_share"] = change_tenth(state, parts)
        seconds, faults, _ = timed(lambda: dcp.save(
            state, storage_writer=FileSystemWriter(os.path.join(base, "dcp-t1-second"), thread_count=1)))
        out["second: dcp FileSystemWriter, 1 thread"] = {"seconds": seconds, "faults": faults}
        seconds, faults, _ = timed(lambda: dcp.save(state, storage_writer=StorageWriter(repo_url, "dcp-2")))
        out["second: dcp ckptfs StorageWriter"] = {"seconds": seconds, "faults": faults}
        dist.barrier()
        if rank == 0:
            out["repo_bytes_after"] = dir_bytes(repo_url)
            out["dcp_second_bytes"] = dir_bytes(os.path.join(base, "dcp-t1-second"))
    else:  # load, resharded to this world size
        repo_url = os.path.join(base, "ckptfs-repo")
        for label, reader in [("dcp FileSystemReader", lambda: FileSystemReader(os.path.join(base, "dcp-t1"))),
                              ("dcp ckptfs StorageReader", lambda: StorageReader(repo_url, "dcp-1"))]:
            state, parts = make_state(True)
            dist.barrier()
            if rank == 0:
                out["cold"] = drop_caches()
            seconds, faults, _ = timed(lambda: dcp.load(state, storage_reader=reader()))
            out[f"load 4->{world}: {label}"] = {"seconds": seconds, "faults": faults, "cpu": timed.cpu}
            # spot check: the first tensor's rows are what rank r of the save generated
            del state, parts
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


def orbax_worker(args):
    """Orbax saving and restoring the same bytes as whole arrays, in one
    process (JAX on the CPU); prints the seconds as JSON."""
    import jax
    import ml_dtypes
    import orbax.checkpoint as ocp
    import torch

    table = shapes(args.gib)
    parts = [rank_part(table, r, RANKS_SAVE) for r in range(RANKS_SAVE)]
    tree = {"model": {}, "optim": {}}
    for name in table:
        pieces = [p[name] for p in parts]
        param = torch.cat([x[1] for x in pieces]).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        tree["model"][name] = jax.numpy.asarray(param)
        tree["optim"][name] = {k: jax.numpy.asarray(torch.cat([x[i] for x in pieces]).numpy())
                               for i, k in ((2, "master"), (3, "exp_avg"), (4, "exp_avg_sq"))}
    del parts
    path = os.path.join(args.dir, "orbax")
    out = {}
    checkpointer = ocp.StandardCheckpointer()
    faults0 = minor_faults()
    t0 = time.perf_counter()
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    # Durable like the others: every file fsync'd.
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    out["orbax save"] = {"seconds": time.perf_counter() - t0, "faults": minor_faults() - faults0}
    out["orbax_bytes"] = dir_bytes(path)
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
    del tree
    out["orbax_cold"] = drop_caches()
    faults0 = minor_faults()
    t0 = time.perf_counter()
    restored = checkpointer.restore(path, abstract)
    jax.block_until_ready(restored)
    out["orbax restore"] = {"seconds": time.perf_counter() - t0, "faults": minor_faults() - faults0}
    print(json.dumps(out))


# ---- the driver ----------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world, argv):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", *argv],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, results):
        if p.returncode != 0:
            sys.exit(f"dcp_bench: a rank failed:\n{err[-4000:]}")
    return json.loads([line for line in results[0][0].splitlines() if line.startswith("{")][-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp", help="where the checkpoints are written (default /tmp)")
    ap.add_argument("--gib", type=float, default=2.0, help="size of the whole training state (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    ap.add_argument("--json", action="store_true", help="print the medians as JSON")
    ap.add_argument("--async-saves", type=int, default=3,
                    help="asynchronous saves of each kind per run; their median is the run's figure (default 3)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("action", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        orbax_worker(args) if args.action == "orbax" else worker(args)
        return
    import torch
    print(f"dcp_bench: {args.gib} GiB of state, {RANKS_SAVE} ranks saving, {RANKS_LOAD} loading; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.runs} runs, in {args.dir}", flush=True)
    try:
        import orbax.checkpoint  # noqa: F401
        have_orbax = True
    except ImportError:
        have_orbax = False
        print("dcp_bench: orbax-checkpoint is not installed (pip install -r tools/bench/requirements.txt): "
              "no Orbax figures", flush=True)
    runs = []
    for i in range(args.runs):
        work = os.path.join(args.dir, f"ckptfs-dcp-bench-{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        try:
            child = ["--dir", work, "--gib", str(args.gib), "--async-saves", str(args.async_saves)]
            saved = run_job(RANKS_SAVE, [*child, "save"])
            loaded = run_job(RANKS_LOAD, [*child, "load"])
            peer = run_job(1, [*child, "orbax"]) if have_orbax else {}
            runs.append({**saved, **loaded, **peer})
            print(f"  run {i + 1}: done", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report(runs, args)


def report(runs, args):
    gib = runs[0]["bytes"] / (1 << 30)
    med = lambda key, field="seconds": statistics.median(r[key][field] for r in runs)  # noqa: E731
    rows = []

    def line(label, key, base_key=None, per=True):
        s = med(key)
        faults = med(key, "faults") / gib if per and "faults" in runs[0][key] else None
        cpu = med(key, "cpu") if "cpu" in runs[0][key] else None
        ratio = f"{med(base_key) / s:5.2f}x" if base_key else "      "
        rows.append((label, s, gib / s, faults, cpu, ratio))

    base = "save: dcp FileSystemWriter, 1 thread"
    for key in [k for k in runs[0] if k.startswith("save: ")]:
        line(key, key, base)
    for key in [k for k in runs[0] if k.startswith("second: ")]:
        line(key, key, "second: dcp FileSystemWriter, 1 thread")
    for key in [k for k in runs[0] if k.startswith("load ")]:
        line(key, key, next(k for k in runs[0] if k.startswith("load ") and "FileSystemReader" in k))
    print(f"\nmedians of {len(runs)} runs, {gib:.2f} GiB of state (ratio: the baseline's time / this one's; "
          "> 1 is faster)")
    print(f"{'':46} {'seconds':>8} {'GiB/s':>7} {'faults/GiB':>11} {'CPU s':>6} {'vs DCP':>7}")
    for label, s, rate, faults, cpu, ratio in rows:
        f = f"{faults:11.0f}" if faults is not None else f"{'':11}"
        c = f"{cpu:6.1f}" if cpu is not None else f"{'':6}"
        print(f"{label:46} {s:8.2f} {rate:7.2f} {f} {c} {ratio}")
    fs4 = med("save: dcp FileSystemWriter, 4 threads")
    ours = med("save: dcp ckptfs StorageWriter")
    print(f"{'  ckptfs through DCP vs FileSystemWriter, 4 threads':46} {'':8} {'':7} {'':11} {'':6} {fs4 / ours:5.2f}x")
    print("(CPU s: user + system seconds of the 4 ranks together, threads included)")
    print("\nblocking time of asynchronous saves (median seconds until the call returned; the wait after it)")
    blocking = {}
    for key in [k for k in runs[0] if k.startswith("blocking: ")]:
        blocking[key] = med(key)
        print(f"  {key[10:]:44} {blocking[key]:8.3f}   then {med(key, 'after'):.2f} s")
    fsb = blocking["blocking: dcp.async_save FileSystemWriter"]
    ckb = blocking["blocking: dcp.async_save ckptfs StorageWriter"]
    print(f"  {'ckptfs writer / FileSystemWriter':44} {ckb / fsb:8.2f}x (target <= 1.1)")
    added = statistics.median(r["repo_bytes_after"] - r["repo_bytes_before"] for r in runs)
    dcp_second = statistics.median(r["dcp_second_bytes"] for r in runs)
    repo_total = statistics.median(r["repo_bytes_after"] for r in runs)
    dcp_total = statistics.median(r["dcp_bytes_before"] + r["dcp_second_bytes"] for r in runs)
    print(f"\nthe second save, every 10th tensor and its optimizer state changed "
          f"({100 * runs[0]['changed_share']:.1f} % of the bytes)")
    print(f"  bytes it added: ckptfs {added / 2**20:.0f} MiB, DCP {dcp_second / 2**20:.0f} MiB: "
          f"{added / dcp_second:.3f}x (target <= 0.25)")
    print("  bytes on disk after both saves (a repository holding only the two saves through DCP)")
    print(f"    ckptfs {repo_total / 2**20:.0f} MiB, DCP {dcp_total / 2**20:.0f} MiB: {repo_total / dcp_total:.3f}x "
          "(target <= 0.6)")
    if "orbax save" in runs[0]:
        print("\nOrbax (orbax-checkpoint, JAX on the CPU), the same bytes as whole arrays, one process")
        dcp1 = med("save: dcp FileSystemWriter, 1 thread")
        ours = med("save: dcp ckptfs StorageWriter")
        o_save, o_load = med("orbax save"), med("orbax restore")
        print(f"  save + fsync {o_save:8.2f} s {gib / o_save:6.2f} GiB/s   ckptfs through DCP / Orbax: "
              f"{o_save / ours:5.2f}x  (DCP FileSystemWriter / Orbax: {o_save / dcp1:5.2f}x)")
        print(f"  restore      {o_load:8.2f} s {gib / o_load:6.2f} GiB/s   ckptfs StorageReader 4->2 / Orbax: "
              f"{o_load / med(next(k for k in runs[0] if 'StorageReader' in k)):5.2f}x"
              f"  ({'cold' if all(r.get('orbax_cold') for r in runs) else 'warm'} cache)")
        print(f"  bytes on disk: {statistics.median(r['orbax_bytes'] for r in runs) / 2**20:.0f} MiB")
    cold = all(r.get("cold") for r in runs)
    print(f"\nloads from a {'cold' if cold else 'warm (caches could not be dropped)'} page cache")
    if args.json:
        print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
