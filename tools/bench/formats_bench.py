"""Checkpoints of other formats in and out of a repository, in the same run
on the same bytes:

- importing a DCP checkpoint directory (durable), against copying the same
  directory with `cp -r` followed by `sync`;
- exporting it as a Hugging Face model directory (`--format hf`, durable),
  against writing the same files' bytes with `dd bs=4M conv=fsync`;
- exporting it as one torch.save file (`--format torch`, durable, one
  tensor in memory), against torch.save of the same state dict already in
  memory, then fsync.

The DCP directory holds LLM-like state (bf16 weights, fp32 master weights
and AdamW moments; about --gib GiB) written by stock dcp.save with
FileSystemWriter, one process. Measured, each from a dropped page cache
where that works (root), the median over --runs:

  cp -r DIR COPY && sync
  ckptfs.formats.import_checkpoint (in this process; the commit fsyncs)
  ckpt import NAME DIR (the command, which starts a Python with torch)

cp and the import run in turn, one first in even runs and the other in odd
runs: on a disk mounted with `discard` (cloud VMs), or one still writing
back the previous step's bytes, whichever runs second would otherwise pay
for the first; and each starts --settle seconds after the earlier steps'
writes and deletions were synced. Every run's cp and import come first,
back to back, and the exports after them, so that each follows an operation
of its own size rather than the previous run's exports. Beside each time, the bytes the disk holding --dir read and
wrote meanwhile (/proc/diskstats): the import reads what cp reads and
writes the compressed bytes, so on a disk whose reads and writes share one
bandwidth, the time ratio follows the ratio of bytes moved.

and a second import of the same weights saved at another chunking of the
first dimension (the directory written again with 2 chunks per tensor
instead of 1), which shares its chunks with the first: the bytes it stored.

    build/venv/bin/python tools/bench/formats_bench.py --dir /tmp --gib 1 --runs 3

(with the ckptfs package installed in that venv, or PYTHONPATH=build/python
and CKPT_BIN=build/tools/ckpt).
"""
import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import time

from bench_util import disk_bytes, drop_caches, minor_faults

DIM = 1024


def state(gib, torch):
    """8 layers of bf16 weights with fp32 master weights and AdamW moments,
    about `gib` GiB in all (14 bytes a parameter)."""
    params = int(gib * (1 << 30) / 14)
    rows = max(8, params // DIM // 8)
    gen = torch.Generator().manual_seed(5)
    out = {}
    for i in range(8):
        w = torch.randn(rows, DIM, generator=gen)
        out[f"layers.{i}.weight"] = w.to(torch.bfloat16)
        out[f"optim.layers.{i}.master"] = w
        out[f"optim.layers.{i}.exp_avg"] = torch.randn(w.shape, generator=gen) * 1e-3
        out[f"optim.layers.{i}.exp_avg_sq"] = (torch.randn(w.shape, generator=gen) * 1e-3) ** 2
    return out


def write_dcp(path, sd, pieces):
    """dcp.save of `sd` into `path`; with pieces > 1 every tensor is saved as
    that many row chunks (DCP's layout for Shard(0) over `pieces` ranks)."""
    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata  # noqa: PLC0415
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType, TensorWriteData  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties  # noqa: PLC0415

    class RowChunks(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                if item.type != WriteItemType.TENSOR or pieces == 1:
                    items.append(item)
                    continue
                size = item.tensor_data.size
                step = (size[0] + pieces - 1) // pieces
                for p in range(pieces):
                    start = p * step
                    n = min(step, size[0] - start)
                    if n <= 0:
                        break
                    offsets = torch.Size([start] + [0] * (len(size) - 1))
                    sizes = torch.Size([n] + list(size[1:]))
                    items.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                                       properties=item.tensor_data.properties,
                                                                       size=size)))
            plan = dataclasses.replace(plan, items=items)
            self.plan = plan
            return plan

        def resolve_data(self, write_item):
            if write_item.tensor_data is None or pieces == 1:
                return super().resolve_data(write_item)
            t = self.lookup_object(MetadataIndex(write_item.index.fqn))
            off = write_item.tensor_data.chunk.offsets[0]
            n = write_item.tensor_data.chunk.sizes[0]
            return t[off:off + n]

    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=1), planner=RowChunks(),
             no_dist=True)


def timed(fn):
    drop_caches()
    faults0 = minor_faults()
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0, minor_faults() - faults0


def timed_io(fn, where, settle):
    """timed(fn) from a quiet disk (`settle` seconds after the last writes
    and deletions were synced), and the bytes the disk holding `where` read
    plus wrote meanwhile (None where they cannot be told)."""
    os.sync()
    time.sleep(settle)
    before = disk_bytes(where)
    t, faults = timed(fn)  # drops the page cache first
    after = disk_bytes(where)
    moved = sum(after) - sum(before) if before and after else None
    return t, faults, moved


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds to let the disk finish earlier writes and discards before cp and the import")
    args = ap.parse_args()
    import torch  # noqa: PLC0415

    import ckptfs  # noqa: PLC0415
    import ckptfs.formats as formats  # noqa: PLC0415

    ckpt = os.environ.get("CKPT_BIN") or shutil.which("ckpt")
    work = os.path.join(args.dir, f"ckptfs-import-bench-{os.getpid()}")
    os.makedirs(work)
    try:
        sd = state(args.gib, torch)
        src = os.path.join(work, "dcp")
        src2 = os.path.join(work, "dcp2")
        write_dcp(src, sd, 1)
        write_dcp(src2, sd, 2)
        size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
        print(f"DCP directory: {size / 2**30:.2f} GiB in {len(os.listdir(src))} files; {os.cpu_count()} CPUs; "
              f"page cache dropped: {drop_caches()}")
        figs = {"cp": [], "api": [], "ratio": [], "moved": [], "cli": [], "second": [], "faults": [], "export": [], "dd": [], "torch": [],
                "torch_save": []}
        # First every cp and import, back to back: each then follows an
        # operation of its own size, not the exports of the run before (4 GiB
        # written and deleted), which a virtual disk may still be paying for.
        pairs = []
        for run in range(args.runs):
            copy = os.path.join(work, f"copy{run}")
            repo_path = os.path.join(work, f"repo{run}")

            def run_cp():
                t, _, moved = timed_io(lambda: subprocess.run(f"cp -r '{src}' '{copy}' && sync", shell=True,
                                                              check=True), work, args.settle)
                shutil.rmtree(copy)
                return t, moved

            def run_import():
                r = ckptfs.init(repo_path)
                t, faults, moved = timed_io(lambda: formats.import_checkpoint(r, "a", src), work, args.settle)
                del r
                shutil.rmtree(repo_path)
                return t, faults, moved

            if run % 2 == 0:
                t_cp, moved_cp = run_cp()
                t_api, faults, moved_api = run_import()
            else:
                t_api, faults, moved_api = run_import()
                t_cp, moved_cp = run_cp()
            pairs.append((t_cp, moved_cp, t_api, faults, moved_api))
        for run in range(args.runs):
            t_cp, moved_cp, t_api, faults, moved_api = pairs[run]
            repo_path = os.path.join(work, f"repo{run}")
            # The timed import's repository was deleted, as cp's copy was, so
            # that both leave the disk as they found it; the exports need one.
            repo = ckptfs.init(repo_path)
            formats.import_checkpoint(repo, "a", src)
            second = formats.import_checkpoint(repo, "b", src2)
            t_cli = None
            if ckpt:
                t_cli, _ = timed(lambda: subprocess.run([ckpt, "-r", repo_path, "import", "c", src, "--quiet"],
                                                        check=True, stdout=subprocess.DEVNULL,
                                                        env=dict(os.environ, CKPT_PYTHON=sys.executable)))
            out = os.path.join(work, f"hf{run}")
            t_export, _ = timed(lambda: formats.export_checkpoint(repo, "a", out, format="hf",
                                                                  max_shard_size="1GB"))
            shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
            ddir = os.path.join(work, f"dd{run}")
            os.makedirs(ddir)

            def dd_all():
                for f in shards:
                    subprocess.run(["dd", f"if={os.path.join(out, f)}", f"of={os.path.join(ddir, f)}", "bs=4M",
                                    "conv=fsync", "status=none"], check=True)

            t_dd, _ = timed(dd_all)
            shutil.rmtree(out)
            shutil.rmtree(ddir)
            tout = os.path.join(work, f"torch{run}")
            t_torch, _ = timed(lambda: formats.export_checkpoint(repo, "a", tout, format="torch"))
            shutil.rmtree(tout)

            def torch_save():
                with open(os.path.join(work, "saved.pt"), "wb") as f:
                    torch.save(sd, f)
                    f.flush()
                    os.fsync(f.fileno())

            t_save, _ = timed(torch_save)
            os.unlink(os.path.join(work, "saved.pt"))
            figs["torch"].append(t_torch)
            figs["torch_save"].append(t_save)
            figs["export"].append(t_export)
            figs["dd"].append(t_dd)
            del repo
            shutil.rmtree(repo_path)
            figs["cp"].append(t_cp)
            figs["api"].append(t_api)
            figs["ratio"].append(t_cp / t_api)
            if moved_cp and moved_api:
                figs["moved"].append(moved_api / moved_cp)
            figs["faults"].append(faults / (size / 2**30))
            figs["second"].append(second["stored_bytes"] / size)
            if t_cli is not None:
                figs["cli"].append(t_cli)
            moved = (f" (disk moved {moved_cp / 2**30:.2f} and {moved_api / 2**30:.2f} GiB)"
                     if moved_cp and moved_api else "")
            print(f"run {run}: cp -r + sync {t_cp:.2f} s; import (API) {t_api:.2f} s = {t_cp / t_api:.2f}x{moved}"
                  + (" (import first)" if run % 2 else "")
                  + (f"; ckpt import {t_cli:.2f} s = {t_cp / t_cli:.2f}x" if t_cli else "")
                  + f"; export hf {t_export:.2f} s, dd conv=fsync {t_dd:.2f} s = {t_dd / t_export:.2f}x"
                  + f"; export torch {t_torch:.2f} s, torch.save from memory {t_save:.2f} s = "
                    f"{t_save / t_torch:.2f}x"
                  + f"; {faults / (size / 2**30):.0f} minor faults/GiB; the same weights in 2 chunks per tensor "
                    f"stored {second['stored_bytes'] / size:.4f} of the bytes")
        med = {k: statistics.median(v) for k, v in figs.items() if v}
        print(f"\nmedians of {args.runs} runs ({size / 2**30:.2f} GiB):")
        print(f"  cp -r + sync             {size / med['cp'] / 1e6:7.0f} MB/s")
        print(f"  import (API, durable)    {size / med['api'] / 1e6:7.0f} MB/s   {med['cp'] / med['api']:.2f}x   "
              f"(target >= 1.0; median of the runs' ratios {med['ratio']:.2f}x)")
        if "moved" in med:
            print(f"  disk bytes moved by the import / by cp + sync   {med['moved']:.2f}")
        if "cli" in med:
            print(f"  ckpt import (command)    {size / med['cli'] / 1e6:7.0f} MB/s   {med['cp'] / med['cli']:.2f}x")
        print(f"  export --format hf       {med['dd'] / med['export']:.2f}x of dd conv=fsync of the same bytes   "
              "(target >= 0.9)")
        print(f"  export --format torch    {med['torch_save'] / med['torch']:.2f}x of torch.save + fsync of the "
              "state in memory")
        print(f"  minor page faults / GiB  {med['faults']:7.0f} (import)")
        print(f"  second import at another chunking stored {med['second']:.4f} of the bytes")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
