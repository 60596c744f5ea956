"""Saving a state of many small tensors through the Python package:
`repo.save` of --count float32 arrays of each size in --kib (whole tensors,
one chunk each), against, in the same run on the same arrays, writing the
same bytes to one file with a write() per array and fsync (the least any
save of them must do). Each save goes to a fresh repository under --dir;
medians of --runs, in tensors per second, with the minor page faults of
each save per tensor.

    build/venv/bin/python tools/bench/small_tensors_bench.py --dir /dev/shm --runs 5

(PYTHONPATH=build/python for the tree's package). Saving into /dev/shm
leaves the disk out: what is measured is the per-tensor cost.
"""
import argparse
import os
import shutil
import statistics
import time

import numpy as np

import ckptfs

from bench_util import minor_faults


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--kib", default="4,64,1024")
    ap.add_argument("--count", type=int, default=4000, help="arrays of each size (fewer where 64 MiB is reached)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    work = os.path.join(args.dir, f"ckptfs-small-bench-{os.getpid()}")
    os.makedirs(work)
    print(f"{os.cpu_count()} CPUs; repositories and files in {args.dir}")
    try:
        for kib in (int(k) for k in args.kib.split(",")):
            n = max(1, min(args.count, (64 << 10) // kib))
            elems = kib * 256
            state = {f"model.layers.{i}.weight": (rng.standard_normal(elems, dtype=np.float32) * 0.02)
                     for i in range(n)}
            rows = {"save": [], "write": [], "faults": []}
            for run in range(args.runs):
                path = os.path.join(work, f"repo-{run}")
                repo = ckptfs.init(path)
                faults = minor_faults()
                start = time.perf_counter()
                repo.save("s", state)
                rows["save"].append(time.perf_counter() - start)
                rows["faults"].append(minor_faults() - faults)
                del repo
                shutil.rmtree(path)
                flat = os.path.join(work, "flat")
                start = time.perf_counter()
                fd = os.open(flat, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                for a in state.values():
                    os.write(fd, a)
                os.fsync(fd)
                os.close(fd)
                rows["write"].append(time.perf_counter() - start)
                os.unlink(flat)
            med = {k: statistics.median(v) for k, v in rows.items()}
            print(f"{n} x {kib} KiB: repo.save {n / med['save']:8.0f} tensors/s ({n * kib / 1024 / med['save']:6.0f} "
                  f"MiB/s), write() each + fsync {n / med['write']:8.0f} tensors/s, ratio "
                  f"{med['write'] / med['save']:.2f}; {med['faults'] / n:.1f} minor faults a tensor")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
