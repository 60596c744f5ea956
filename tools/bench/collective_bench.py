"""Collective save and restart (process_group=) against the every-rank path,
in the same run on the same bytes: 8 ranks (processes, gloo), R = 4
replicas x 2 row shards (HSDP), each rank holding half the rows of every
layer.

The ranks run on simulated hosts (--hosts, default 4): each host has its
own catalog and chunk cache, as separate machines do, and holds one
replica's two ranks, so the replicas are on different hosts as HSDP places
them. With --hosts 1 all ranks share one host's catalog and chunk cache.

- save into a fresh repository: every rank puts what it holds (today's
  path, rank=/world_size=) against the collective save; bytes hashed (the
  ranks' logical_bytes), bytes written to packs (stored_bytes: the
  adaptive codec compresses a chunk only while the store keeps up, so
  this says how much of the CPU went to zstd), the ranks' CPU seconds, wall time (first rank in to
  last commit), and on S3 the store requests the ranks sent (LISTs
  apart). Each job first saves a small checkpoint the same way, so
  what a training job pays once (ckptfs's gloo group, the engine's
  threads, lazy imports) is not counted in the save measured: a job saves
  many times;
- restart from the repository on the loopback Ceph RGW (S3; a local
  directory where no endpoint is configured): every rank loads its part
  itself against the collective load; stored bytes fetched from the store
  (the engine's counters, summed over ranks) and wall time;
- dcp.load with FileSystemReader of the same state saved by dcp.save with
  FileSystemWriter into a local directory (DTensors, Replicate x Shard(0));
  and DCP's CooperativeLoadPlanner where the installed torch has one.

    build/venv/bin/python tools/bench/collective_bench.py --mib 256 --runs 5 [--hosts 1]

(with ckptfs importable: the package installed in the venv, or
PYTHONPATH=build/python). Each rank process is started with this file and
--worker.
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
import tempfile
import time
import zlib

WORLD, SHARDS = 8, 2
COLS = 4096


def layers(mib):
    """(name, rows) of fp32 layers adding up to about `mib` MiB."""
    per = 8 << 20  # 8 MiB a layer: 512 rows of 4096 fp32
    return [(f"layers.{i}.w", per // (COLS * 4)) for i in range(max(1, int(mib * (1 << 20)) // per))]


def full(name, rows, torch):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(rows, COLS, generator=gen) * 0.02


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one rank -----------------------------------------------------------------------


def worker(args):
    import torch
    import torch.distributed as dist

    import ckptfs

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shard = rank % SHARDS
    table = layers(args.mib)
    values, shards = {}, {}
    for name, rows in table:
        n = rows // SHARDS
        values[name] = full(name, rows, torch)[shard * n:(shard + 1) * n].contiguous()
        shards[name] = ckptfs.Box((rows, COLS), (shard * n, 0))
    out, repo = {}, None
    if args.action == "save":
        repo = ckptfs.open(args.url)
        warm = {"warm-up": torch.ones(16)}
        verify = args.mode == "collective-verify"
        if args.mode.startswith("collective"):
            repo.save("warm-up", warm, process_group=dist.group.WORLD, verify_replicas=verify)
        else:
            repo.save("warm-up", warm, rank=rank, world_size=WORLD)
        dist.barrier()
        c0 = repo.store_counters()
        t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
        if args.mode.startswith("collective"):
            res = repo.save(args.name, values, shards=shards, process_group=dist.group.WORLD, verify_replicas=verify)
        else:
            res = repo.save(args.name, values, shards=shards, rank=rank, world_size=WORLD)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = repo.store_counters()
        out = {"start": t0, "end": time.monotonic(), "hashed": res["logical_bytes"], "stored": res["stored_bytes"],
               "cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime,
               "lists": c1["list_requests"] - c0["list_requests"], "requests": c1["requests"] - c0["requests"]}
    elif args.action == "load":
        # The collective restart opens with the group: one listing of the store.
        repo = ckptfs.open(args.url, process_group=dist.group.WORLD if args.mode == "collective" else None)
        targets = {k: torch.empty_like(v) for k, v in values.items()}
        dist.barrier()
        t0 = time.monotonic()
        if args.mode == "collective":
            repo.load(args.name, targets, shards=shards, process_group=dist.group.WORLD)
        else:
            repo.load(args.name, targets, shards=shards)
        end = time.monotonic()
        for k, v in values.items():
            assert torch.equal(targets[k], v), k
        c = repo.store_counters()
        out = {"start": t0, "end": end, "fetched": c["stored_bytes_fetched"], "gets": c["get_requests"],
               "lists": c["list_requests"]}
    else:  # dcp-save / dcp-load / dcp-coop: DTensors on a (replicas, shards) mesh
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (WORLD // SHARDS, SHARDS))
        sd = {name: distribute_tensor(full(name, rows, torch), mesh, [Replicate(), Shard(0)]) for name, rows in table}
        if args.action == "dcp-save":
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(args.url))
        else:
            target = {k: torch.zeros_like(v) for k, v in sd.items()}
            planner = None
            if args.action == "dcp-coop":
                planner = dcp.default_planner.CooperativeLoadPlanner()
            dist.barrier()
            t0 = time.monotonic()
            dcp.load(target, storage_reader=dcp.FileSystemReader(args.url), planner=planner)
            out = {"start": t0, "end": time.monotonic()}
            for k in sd:
                assert torch.equal(target[k].to_local(), sd[k].to_local()), k
    # Closed before os._exit: an open repository's read leases would stay
    # on the store until taken for stale and keep the runs' data from gc.
    del repo
    print(json.dumps(out))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# ---- the run ------------------------------------------------------------------------


def job(action, url, name, mode, mib, env_extra, hosts=1):
    """Runs the WORLD ranks of one job. With `hosts` > 1 the ranks are
    spread over that many simulated hosts, consecutive ranks together, each
    host with its own cache directory under env_extra's CKPT_CACHE_DIR
    (its own catalog and chunk cache, as separate machines have)."""
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   **env_extra)
        if hosts > 1 and "CKPT_CACHE_DIR" in env_extra:
            env["CKPT_CACHE_DIR"] = os.path.join(env_extra["CKPT_CACHE_DIR"], f"host{r // (WORLD // hosts)}")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", action, url, name, mode, "--mib",
                                       str(mib)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=1200)
        if p.returncode != 0:
            raise SystemExit(f"{action} rank failed: {err.decode()[-2000:]}")
        outs.append(json.loads(out.decode().strip().splitlines()[-1]))
    return outs


def ckpt_command():
    ckpt = os.environ.get("CKPT_BIN") or shutil.which("ckpt")
    if not ckpt:
        raise SystemExit("collective_bench: the ckpt command is needed (on PATH, or CKPT_BIN=build/tools/ckpt)")
    return ckpt


def referenced(url, env_extra):
    """Stored bytes of the chunks checkpoint "s" references (ckpt du)."""
    ckpt = ckpt_command()
    du = json.loads(subprocess.run([ckpt, "-r", url, "du", "--json"], check=True, stdout=subprocess.PIPE,
                                   env=dict(os.environ, **env_extra)).stdout)
    return next(c["referenced_bytes"] for c in du["checkpoints"] if c["name"] == "s")


def drop(url, cache_dir):
    """Removes a run's checkpoints and reclaims their packs, so that the
    store (in RAM for the loopback gateway) does not grow run after run."""
    ckpt = ckpt_command()
    env = dict(os.environ, CKPT_CACHE_DIR=cache_dir)
    for name in ("s", "warm-up"):  # either may be missing after a failed run
        subprocess.run([ckpt, "-r", url, "--quiet", "rm", name], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    subprocess.run([ckpt, "-r", url, "--quiet", "gc"], check=True, env=env, stdout=subprocess.DEVNULL)


def span(outs):
    return max(o["end"] for o in outs) - min(o["start"] for o in outs)


def main():
    if "--worker" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--worker", action="store_true")
        ap.add_argument("action")
        ap.add_argument("url")
        ap.add_argument("name")
        ap.add_argument("mode")
        ap.add_argument("--mib", type=float)
        worker(ap.parse_args())
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=256, help="unique bytes of the state, MiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--hosts", type=int, default=4, choices=(1, 2, 4, 8),
                    help="simulated hosts, each with its own catalog and chunk cache; the default 4 puts each "
                         "replica's 2 ranks on one host and the replicas on different hosts, as HSDP places them "
                         "(1: all ranks share one host's catalog)")
    args = ap.parse_args()
    ckpt_command()  # before any run, not after the first
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptfs

    work = tempfile.mkdtemp(prefix="ckptfs-collective-bench-", dir=args.dir)
    env_extra = {}  # each repository gets its own host cache directory below
    s3 = bool(os.environ.get("AWS_ENDPOINT_URL"))
    coop = hasattr(dcp, "default_planner") and hasattr(dcp.default_planner, "CooperativeLoadPlanner")
    unique = sum(rows * COLS * 4 for _, rows in layers(args.mib))
    print(f"{WORLD} ranks on {args.hosts} simulated host{'s' if args.hosts > 1 else ''} (a catalog and chunk cache "
          f"each), {WORLD // SHARDS} replicas x {SHARDS} shards; {unique / 2**20:.0f} MiB unique "
          f"({len(layers(args.mib))} fp32 layers); {os.cpu_count()} CPUs; restart from "
          f"{'the S3 store ' + os.environ['AWS_ENDPOINT_URL'] if s3 else 'a local directory'}; torch "
          f"{torch.__version__}, CooperativeLoadPlanner {'present' if coop else 'absent'}")
    figs = {k: [] for k in ("save_wall", "save_cpu", "save_hashed", "save_stored", "csave_wall", "csave_cpu",
                            "csave_hashed", "csave_stored", "vsave_wall", "vsave_cpu", "vsave_hashed", "vsave_stored",
                            "load_wall", "load_fetched", "cload_wall", "cload_fetched", "dcp_wall", "coop_wall")}
    undropped = {}  # the S3 repositories not yet emptied: url -> cache directory
    try:
        dcp_dir = os.path.join(work, "dcp")
        job("dcp-save", dcp_dir, "-", "-", args.mib, env_extra)
        for run in range(args.runs):
            urls = {}
            for mode in ("plain", "collective", "collective-verify"):
                url = (f"s3://ckptfs-test/collective-bench-{os.getpid()}-{run}-{mode}" if s3
                       else os.path.join(work, f"repo-{run}-{mode}"))
                env_extra = {"CKPT_CACHE_DIR": os.path.join(work, f"cache-{run}-{mode}")}
                os.environ.update(env_extra)
                ckptfs.init(url)
                urls[mode] = url
                if s3:
                    undropped[url] = os.path.join(work, f"cache-{run}-drop-{mode}")
                saved = job("save", url, "s", mode, args.mib, env_extra, args.hosts)
                pre = {"plain": "", "collective": "c", "collective-verify": "v"}[mode]
                figs[pre + "save_wall"].append(span(saved))
                figs[pre + "save_cpu"].append(sum(o["cpu"] for o in saved))
                figs[pre + "save_hashed"].append(sum(o["hashed"] for o in saved))
                figs[pre + "save_stored"].append(sum(o["stored"] for o in saved))
                figs.setdefault(pre + "save_lists", []).append(sum(o["lists"] for o in saved))
                figs.setdefault(pre + "save_requests", []).append(sum(o["requests"] for o in saved))
            # Restarts from the collective save's repository, each with a
            # fresh host cache (a restarted job's hosts start cold).
            url = urls["collective"]
            env_extra = {"CKPT_CACHE_DIR": os.path.join(work, f"cache-{run}-restart-plain")}
            plain = job("load", url, "s", "plain", args.mib, env_extra, args.hosts)
            env_extra = {"CKPT_CACHE_DIR": os.path.join(work, f"cache-{run}-restart-collective")}
            coll = job("load", url, "s", "collective", args.mib, env_extra, args.hosts)
            figs["load_wall"].append(span(plain))
            figs["load_fetched"].append(sum(o["fetched"] for o in plain))
            figs["cload_wall"].append(span(coll))
            figs["cload_fetched"].append(sum(o["fetched"] for o in coll))
            figs.setdefault("load_lists", []).append(sum(o["lists"] for o in plain))
            figs.setdefault("cload_lists", []).append(sum(o["lists"] for o in coll))
            figs["dcp_wall"].append(span(job("dcp-load", dcp_dir, "-", "-", args.mib, env_extra)))
            if coop:
                figs["coop_wall"].append(span(job("dcp-coop", dcp_dir, "-", "-", args.mib, env_extra)))
            figs.setdefault("stored", []).append(referenced(url, env_extra))
            for u in urls.values():
                if u in undropped:
                    drop(u, undropped.pop(u))
            print(f"run {run}: save {figs['save_wall'][-1]:.2f} s / {figs['save_cpu'][-1]:.2f} CPU s, collective "
                  f"{figs['csave_wall'][-1]:.2f} s / {figs['csave_cpu'][-1]:.2f} CPU s; hashed "
                  f"{figs['save_hashed'][-1] / 2**20:.0f} vs {figs['csave_hashed'][-1] / 2**20:.0f} MiB, written to packs "
                  f"{figs['save_stored'][-1] / 2**20:.0f} vs {figs['csave_stored'][-1] / 2**20:.0f} MiB; restart "
                  f"{figs['load_wall'][-1]:.2f} s fetching {figs['load_fetched'][-1] / 2**20:.0f} MiB, collective "
                  f"{figs['cload_wall'][-1]:.2f} s fetching {figs['cload_fetched'][-1] / 2**20:.0f} MiB; "
                  f"dcp.load {figs['dcp_wall'][-1]:.2f} s" + (f", cooperative {figs['coop_wall'][-1]:.2f} s"
                                                               if coop else ""))
        med = {k: statistics.median(v) for k, v in figs.items() if v}
        print(f"\nmedians of {args.runs} runs:")
        print(f"  bytes hashed per save: {med['csave_hashed'] / 2**20:.0f} MiB collective, "
              f"{med['save_hashed'] / 2**20:.0f} MiB every rank: {med['csave_hashed'] / med['save_hashed']:.3f}x "
              "(target <= 0.3)")
        print(f"  save CPU seconds: {med['csave_cpu']:.2f} collective, {med['save_cpu']:.2f} every rank: "
              f"{med['csave_cpu'] / med['save_cpu']:.2f}x (target <= 0.35); wall {med['csave_wall']:.2f} s vs "
              f"{med['save_wall']:.2f} s")
        print(f"  collective save with verify_replicas (every replica's bytes hashed and compared): wall "
              f"{med['vsave_wall']:.2f} s vs {med['csave_wall']:.2f} s without: {med['vsave_wall'] / med['csave_wall']:.3f}x; "
              f"CPU {med['vsave_cpu']:.2f} vs {med['csave_cpu']:.2f} s: {med['vsave_cpu'] / med['csave_cpu']:.3f}x "
              "(on by default where <= 1.05)")
        if s3:
            print(f"  store requests per save (all ranks): {med['csave_requests']:.0f} collective, "
                  f"{med['save_requests']:.0f} every rank; of them LISTs {med['csave_lists']:.0f} and "
                  f"{med['save_lists']:.0f}")
        print(f"  bytes fetched per restart: {med['cload_fetched'] / 2**20:.0f} MiB collective, "
              f"{med['load_fetched'] / 2**20:.0f} MiB every rank; stored {med['stored'] / 2**20:.0f} MiB: "
              f"{med['cload_fetched'] / med['stored']:.3f}x and {med['load_fetched'] / med['stored']:.3f}x "
              "of the stored bytes (target <= 1.05)")
        print(f"  LIST requests per restart (open and load, all ranks): {med['cload_lists']:.0f} collective, "
              f"{med['load_lists']:.0f} every rank")
        print(f"  restart wall: {med['cload_wall']:.2f} s collective, {med['load_wall']:.2f} s every rank: "
              f"{med['load_wall'] / med['cload_wall']:.2f}x faster (target >= 2); dcp.load (FileSystemReader, local) "
              f"{med['dcp_wall']:.2f} s" + (f"; CooperativeLoadPlanner {med['coop_wall']:.2f} s" if coop else ""))
    finally:
        # A failed run's checkpoints would stay on the gateway (in its RAM)
        # and fill it for the next.
        for u, cache in undropped.items():
            try:
                drop(u, cache)
            except (subprocess.CalledProcessError, OSError) as e:
                print(f"collective_bench: could not empty {u}: {e}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
