#!/usr/bin/env python3
"""Python binding benchmark: a torch state dict saved to and loaded from a
ckptfs repository through the Python package, against, in the same run and
on the same bytes:

  - the C++ engine (save_load_bench with one saving and one loading rank:
    whole tensors from and into host memory), for the binding's overhead;
  - torch.save followed by fsync, and torch.load.

The state is save_load_bench's LLM-like state (bf16 weights, fp32 Adam
moments), written by it as a safetensors file and read here into torch
tensors, so both sides see identical bytes. Reads start from a cold page
cache when the caches can be dropped (root). Minor page faults of this
process are reported per GiB beside the throughput.

    build/venv/bin/python tools/bench/python_bench.py --gib 2 --runs 3
"""
import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import time

import numpy as np
import torch

import ckptfs

from bench_util import drop_caches, minor_faults

ST_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "F64": torch.float64,
            "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def read_state(path):
    """The tensors of a safetensors file, each in its own memory."""
    raw = np.fromfile(path, dtype=np.uint8)
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    header = json.loads(raw[8:8 + n].tobytes())
    header.pop("__metadata__", None)
    state = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        u8 = torch.from_numpy(raw[8 + n + b:8 + n + end].copy())
        state[name] = u8.view(ST_TORCH[e["dtype"]]).reshape(e["shape"])
    return state


def same_bits(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def cpp_run(bench_bin, gib, work):
    """Save and load GB/s of one run of the C++ engine, one rank each way."""
    out = subprocess.run([bench_bin, "--gib", str(gib), "--runs", "1", "--save-ranks", "1", "--load-ranks", "1",
                          "--dir", work], check=True, capture_output=True, text=True).stdout
    save = float(re.search(r"^\s+save\s+([\d.]+) GB/s", out, re.M).group(1))
    load = float(re.search(r"^\s+resharded load\s+([\d.]+) GB/s", out, re.M).group(1))
    return save, load


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="state size (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    ap.add_argument("--dir", default=".", help="where the repositories and files go (default .)")
    ap.add_argument("--bench-bin", default=os.path.join(os.path.dirname(__file__), "../../build/tools/save_load_bench"),
                    help="the C++ save_load_bench binary")
    a = ap.parse_args()

    work = os.path.join(a.dir, f"ckptfs-pybench-{os.getpid()}")
    os.makedirs(work)
    try:
        state_file = os.path.join(work, "state.safetensors")
        subprocess.run([a.bench_bin, "--gib", str(a.gib), "--dump-state", state_file], check=True,
                       capture_output=True)
        state = read_state(state_file)
        os.remove(state_file)
        total = sum(t.numel() * t.element_size() for t in state.values())
        gb, gib = total / 1e9, total / 2**30
        print(f"state: {len(state)} tensors, {gib:.2f} GiB (bf16 weights, fp32 Adam moments); torch {torch.__version__}")

        rows = {k: [] for k in ("cpp_save", "cpp_load", "py_save", "py_load", "torch_save", "torch_load",
                                "save_ratio", "load_ratio", "save_fpg", "load_fpg")}
        cold = True
        for run in range(a.runs):
            # Runs alternate between the C++ engine and Python, so a disk
            # whose speed drifts affects both alike.
            cpp_save, cpp_load = cpp_run(a.bench_bin, a.gib, work)
            repo_dir = os.path.join(work, "repo")
            shutil.rmtree(repo_dir, ignore_errors=True)
            repo = ckptfs.init(repo_dir)
            os.sync()
            f0, t0 = minor_faults(), time.perf_counter()
            repo.save("step-1", state, step=1)
            ts = time.perf_counter() - t0
            save_faults = minor_faults() - f0
            # Like load_state_dict: the parameters already exist. The
            # repository is reopened, as by a resuming job (and as the C++
            # benchmark does), so no chunk is still cached from the save.
            targets = {k: torch.ones_like(v) for k, v in state.items()}
            del repo
            cold &= drop_caches()
            repo = ckptfs.open(repo_dir)
            f0, t0 = minor_faults(), time.perf_counter()
            repo.load("step-1", targets)
            tl = time.perf_counter() - t0
            load_faults = minor_faults() - f0
            assert all(same_bits(targets[k], v) for k, v in state.items()), "loaded bytes differ"
            del targets, repo

            path = os.path.join(work, "state.pt")
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            tts = time.perf_counter() - t0
            cold &= drop_caches()
            t0 = time.perf_counter()
            loaded = torch.load(path)
            ttl = time.perf_counter() - t0
            assert all(same_bits(loaded[k], v) for k, v in state.items())
            del loaded
            os.remove(path)

            print(f"run {run + 1}: C++ save {cpp_save:.2f} GB/s, load {cpp_load:.2f} GB/s; "
                  f"Python save {gb / ts:.2f} GB/s, load {gb / tl:.2f} GB/s; torch.save+fsync "
                  f"{gb / tts:.2f} GB/s, torch.load {gb / ttl:.2f} GB/s; minor faults per GiB: save "
                  f"{save_faults / gib:.0f}, load {load_faults / gib:.0f}; all bytes checked", flush=True)
            rows["cpp_save"].append(cpp_save)
            rows["cpp_load"].append(cpp_load)
            rows["save_ratio"].append(gb / ts / cpp_save)
            rows["load_ratio"].append(gb / tl / cpp_load)
            rows["py_save"].append(gb / ts)
            rows["py_load"].append(gb / tl)
            rows["torch_save"].append(gb / tts)
            rows["torch_load"].append(gb / ttl)
            rows["save_fpg"].append(save_faults / gib)
            rows["load_fpg"].append(load_faults / gib)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    m = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nmedian of {a.runs} runs ({'cold' if cold else 'WARM (could not drop)'} page cache for loads):")
    print(f"  C++ engine save        {m['cpp_save']:6.2f} GB/s   (save_load_bench, 1 rank, same bytes)")
    print(f"  Python save            {m['py_save']:6.2f} GB/s   ratio to C++ {m['save_ratio']:.2f} (median of per-run ratios)")
    print(f"  torch.save + fsync     {m['torch_save']:6.2f} GB/s   Python save / torch.save {m['py_save'] / m['torch_save']:.2f}")
    print(f"  C++ engine load        {m['cpp_load']:6.2f} GB/s")
    print(f"  Python load            {m['py_load']:6.2f} GB/s   ratio to C++ {m['load_ratio']:.2f} (median of per-run ratios)")
    print(f"  torch.load             {m['torch_load']:6.2f} GB/s   Python load / torch.load {m['py_load'] / m['torch_load']:.2f}")
    print(f"  minor page faults per GiB (Python): save {m['save_fpg']:.0f}, load {m['load_fpg']:.0f}")


if __name__ == "__main__":
    sys.exit(main())
