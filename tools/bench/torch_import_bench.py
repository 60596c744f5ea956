"""Importing torch.save files, in the same run on the same bytes:

- a state of many tiny tensors (--tensors, 4 float32 elements each, named as
  a model's): `ckpt import` (the whole command: its Python, the archive
  read without torch.load, the puts, the durable commit), against
  torch.load(weights_only=True, mmap=True) of the same file (the load
  alone, in a Python that imported torch before the clock started), in
  tensors per second;
- a file of large tensors (--mib): the import in a Python with the SIGBUS
  handler that turns a file cut short during the import into one error
  line (what `ckpt import` runs), against the same import without it,
  taking turns after an untimed import that brings the file into the page
  cache (whichever ran first would otherwise read it from the disk).

Each import goes into a fresh repository (under --dir; the A/B's under
--ab-dir, /dev/shm by default, since the handler can only touch the
reading side and the disk's noise would hide it); medians of --runs and
--ab-runs, with the minor page faults of each import beside its time.

    build/venv/bin/python tools/bench/torch_import_bench.py --dir /tmp --tensors 200000 --runs 3

(with the ckptfs package installed in that venv, or PYTHONPATH=build/python
and CKPT_BIN=build/tools/ckpt).
"""
import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

MAKE_TINY = """
import sys, torch
n = int(sys.argv[2])
torch.save({f"model.layers.{i // 100}.block.{i % 100}.weight": torch.full((4,), float(i)) for i in range(n)},
           sys.argv[1])
"""
MAKE_BIG = """
import sys, torch
g = torch.Generator().manual_seed(1)
torch.save({f"w{i}": torch.randn(1 << 20, generator=g) for i in range(int(sys.argv[2]) // 4)}, sys.argv[1])
"""
TORCH_LOAD = """
import sys, time, torch
start = time.perf_counter()
state = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=True)
print(time.perf_counter() - start, len(state))
"""
API_IMPORT = """
import sys, time, ckptfs, ckptfs.formats as formats
if sys.argv[3] == "1":
    ckptfs._core.exit_on_bus_error("truncated\\n")
repo = ckptfs.init(sys.argv[1])
start = time.perf_counter()
formats.import_checkpoint(repo, "big", sys.argv[2])
print(time.perf_counter() - start)
"""


def child(args, env=None):
    """(seconds of wall time, minor faults, stdout) of a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    start = time.perf_counter()
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, check=False)
    seconds = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit(f"{args[0]} failed ({p.returncode}): {p.stderr.decode()[-2000:]}")
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before, p.stdout.decode()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--tensors", type=int, default=200000)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ab-runs", type=int, default=10)
    ap.add_argument("--ab-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the A/B's repositories go (default /dev/shm: the disk's noise left out)")
    args = ap.parse_args()
    ckpt = os.environ.get("CKPT_BIN") or shutil.which("ckpt")
    if not ckpt:
        sys.exit("set CKPT_BIN to the ckpt command")
    work = os.path.join(args.dir, f"ckptfs-torch-import-bench-{os.getpid()}")
    os.makedirs(work)
    ab_dir = os.path.join(args.ab_dir, os.path.basename(work)) if args.ab_dir else work
    os.makedirs(ab_dir, exist_ok=True)
    env = dict(os.environ, CKPT_PYTHON=sys.executable)
    try:
        tiny, big = os.path.join(work, "tiny.pt"), os.path.join(work, "big.pt")
        child([sys.executable, "-c", MAKE_TINY, tiny, str(args.tensors)])
        child([sys.executable, "-c", MAKE_BIG, big, str(args.mib)])
        print(f"{args.tensors} tiny tensors in {os.path.getsize(tiny) / 2**20:.1f} MiB; {args.mib} MiB of "
              f"large tensors; {os.cpu_count()} CPUs; repositories in {args.dir}")
        rows = {k: [] for k in ("load", "import", "import_faults", "with", "without", "with_faults",
                                "without_faults", "pair")}
        for run in range(args.runs):
            t_load, _, out = child([sys.executable, "-c", TORCH_LOAD, tiny])
            t_load = float(out.split()[0])
            repo = os.path.join(work, f"repo-{run}")
            subprocess.run([ckpt, "-r", repo, "init"], check=True, stdout=subprocess.DEVNULL)
            t_import, faults, _ = child([ckpt, "-r", repo, "--quiet", "import", "tiny", tiny], env)
            shutil.rmtree(repo)
            rows["load"].append(t_load)
            rows["import"].append(t_import)
            rows["import_faults"].append(faults)
            print(f"run {run}: tiny: torch.load {t_load:.2f} s, ckpt import {t_import:.2f} s "
                  f"({args.tensors / t_import:.0f} tensors/s)")
        for run in range(args.ab_runs):
            order = ("with", "without") if run % 2 == 0 else ("without", "with")
            times = {}
            for which in ("warm-up",) + order:
                repo = os.path.join(ab_dir, f"repo-{which}-{run}")
                _, faults, out = child([sys.executable, "-c", API_IMPORT, repo, big, "1" if which == "with" else "0"])
                shutil.rmtree(repo)
                if which == "warm-up":  # the file into the page cache, the disk past the last run's writes
                    continue
                times[which] = float(out.split()[0])
                rows[which].append(times[which])
                rows[which + "_faults"].append(faults)
            rows["pair"].append(times["without"] / times["with"])
            print(f"pair {run}: large: import with the SIGBUS handler {times['with']:.3f} s, without "
                  f"{times['without']:.3f} s")
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"\nmedians of {args.runs} runs (tiny) and {args.ab_runs} pairs (large):")
        print(f"  tiny tensors: ckpt import {args.tensors / med['import']:8.0f} tensors/s, "
              f"torch.load(weights_only) alone {args.tensors / med['load']:8.0f} tensors/s, "
              f"ratio {med['load'] / med['import']:.2f}x; {med['import_faults'] / args.tensors:.1f} minor faults "
              f"a tensor")
        print(f"  large tensors: import with the SIGBUS handler {args.mib / med['with']:7.0f} MiB/s, without "
              f"{args.mib / med['without']:7.0f} MiB/s, ratio {med['without'] / med['with']:.3f}; minor faults "
              f"{med['with_faults']:.0f} and {med['without_faults']:.0f}; median of the runs' own ratios {med['pair']:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ab_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
