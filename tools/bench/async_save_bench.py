"""Blocking time of repo.async_save: how long the training loop waits
before it may change its tensors again, beside a copy of the same state
(tensor.clone() of every value, what a staging copy such as DCP's costs at
the least), measured in the same run.

The state is LLM-like values: bf16 weights, fp32 master weights and fp32
Adam moments (normal values at their usual scales), 1.5 x --mib MiB in
all. Each save goes into a fresh repository in --dir (every chunk new, as
a job's first save, the case where the private copies cost most); the
wait for durability after the call is not counted. Prints the median of
--saves saves and the ratio to the copy; --json prints every figure.

    PYTHONPATH=build/python build/venv/bin/python tools/bench/async_save_bench.py --mib 256 --saves 5

Run under two builds' PYTHONPATHs alternately for a same-run A/B.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time


def state_dict(mib, torch):
    torch.manual_seed(0)
    n = (mib << 20) // 16
    state = {}
    for i in range(4):
        state[f"model.layers.{i}.w"] = (torch.randn(n) * 0.02).to(torch.bfloat16)
        state[f"master.layers.{i}.w"] = torch.randn(n // 2) * 0.02
        state[f"optim.state.{i}.exp_avg"] = torch.randn(n // 2) * 1e-3
    return state


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size unit: the state is 1.5 x MIB MiB (default 256)")
    ap.add_argument("--saves", type=int, default=5, help="saves measured; the median is reported (default 5)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp",
                    help="where the repositories go (default /dev/shm: the CPU's cost, not the disk's)")
    ap.add_argument("--json", action="store_true", help="print every figure as JSON")
    args = ap.parse_args()
    import torch

    import ckptfs

    state = state_dict(args.mib, torch)
    logical = sum(v.numel() * v.element_size() for v in state.values())
    blocking, copies, durable = [], [], []
    for _ in range(args.saves):
        t = time.perf_counter()
        copy = {k: v.clone() for k, v in state.items()}
        copies.append(time.perf_counter() - t)
        del copy
        where = tempfile.mkdtemp(prefix="ckptfs-async-bench-", dir=args.dir)
        try:
            repo = ckptfs.init(os.path.join(where, "repo"))
            t = time.perf_counter()
            handle = repo.async_save("s", state)
            blocking.append(time.perf_counter() - t)
            handle.result()
            durable.append(time.perf_counter() - t)
            del repo
        finally:
            shutil.rmtree(where, ignore_errors=True)
    m = statistics.median
    if args.json:
        print(json.dumps({"bytes": logical, "blocking": blocking, "copy": copies, "durable": durable}))
        return
    print(f"{logical / 2**20:.0f} MiB of state, {args.saves} saves into fresh repositories in {args.dir}, "
          f"{os.cpu_count()} CPUs")
    print(f"  repo.async_save blocking  {m(blocking):.3f} s ({logical / m(blocking) / 1e9:.2f} GB/s); "
          f"durable after {m(durable):.3f} s")
    print(f"  copy of the state         {m(copies):.3f} s ({logical / m(copies) / 1e9:.2f} GB/s)")
    print(f"  blocking / copy           {m(blocking) / m(copies):.2f}")


if __name__ == "__main__":
    main()
