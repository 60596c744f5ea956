#!/usr/bin/env python3
"""What an overwriting save costs beside a plain one, in the same run, on
the same bytes.

An overwriting save (StorageWriter's default, repo.save(overwrite=True))
runs as NAME~ and is renamed over NAME once committed: one more manifest
write, a delete and a catalog transaction per save. This measures that
fixed cost against a save of a new name, for a small state (where it shows
most) and a larger one:

  - new name:            repo.save("s-K", state)                (overwrite=False)
  - new name, overwrite: repo.save("o-K", state, overwrite=True)
  - the same name again: repo.save("last", state, overwrite=True)

The three alternate, step after step; every save writes the same bytes
but a small fresh tensor (a step counter), so chunks deduplicate as in
training saves of frozen parts and the commit is what is timed. Each
figure is the median seconds per save over --saves saves, with minor
page faults per save beside it.

    build/venv/bin/python tools/bench/overwrite_bench.py --dir /tmp --saves 30
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import ckptfs

from bench_util import minor_faults


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the repository goes (default: %(default)s)")
    p.add_argument("--saves", type=int, default=30, help="saves of each kind per size (default: %(default)s)")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="overwrite-bench-", dir=a.dir)
    try:
        rng = np.random.default_rng(0)
        for label, nbytes in (("1 MiB", 1 << 20), ("64 MiB", 64 << 20)):
            repo = ckptfs.init(os.path.join(work, label.replace(" ", "")))
            state = {f"w{i}": rng.standard_normal(nbytes // 4 // 8, dtype=np.float32) for i in range(8)}
            kinds = {"new name": [], "new name, overwrite": [], "same name again": []}
            faults = {k: [] for k in kinds}
            for k in range(a.saves):
                state["step"] = np.array([k], dtype=np.int64)
                for kind, (name, overwrite) in {"new name": (f"s-{k}", False),
                                                "new name, overwrite": (f"o-{k}", True),
                                                "same name again": ("last", True)}.items():
                    f0, t0 = minor_faults(), time.perf_counter()
                    repo.save(name, state, step=k, overwrite=overwrite)
                    kinds[kind].append(time.perf_counter() - t0)
                    faults[kind].append(minor_faults() - f0)
            base = statistics.median(kinds["new name"])
            print(f"{label} state, median of {a.saves} saves each:")
            for kind, times in kinds.items():
                t = statistics.median(times)
                print(f"  {kind:22s} {t * 1000:8.2f} ms/save  ratio to a new name {t / base:5.2f}"
                      f"  minor faults/save {statistics.median(faults[kind]):8.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
