"""ckptfs:// (fsspec) and the torch_checkpointing backend beside the paths
they stand for, in the same run, on the same bytes, in one process:

  dcp.save, durable, of an LLM-like state (bf16 weights, fp32 master
  weights and AdamW moments): through checkpoint_id="ckptfs://..." (stock
  FsspecWriter), through ckptfs.torch.StorageWriter, and with
  FileSystemWriter on the same filesystem;
  dcp.load of it through the URL against FileSystemReader;
  torch_checkpointing's CheckpointManager (synchronous save, then load)
  with the ckptfs backend against its own LocalFileSystemStorage;
  the rename that commits a directory of --rename-mib MiB on S3 (when
  AWS_ENDPOINT_URL is set): ckptfs:// (one manifest) against s3cmd mv of
  the same files as plain objects (a copy and a delete each), milliseconds
  and requests;
  10 saves of a model whose embedding is frozen (the rest changes each
  step): bytes stored against the bytes saved, per path (DCP through the
  URL, torch_checkpointing, a torch.save file written through fsspec).

Medians of --runs, alternating the paths; minor page faults per GiB beside
each save.

    PYTHONPATH=build/python build/venv/bin/python tools/bench/fsspec_bench.py --dir /tmp --mib 256 --runs 5
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import fsspec
import torch
import torch.distributed.checkpoint as dcp

import ckptfs
import ckptfs.filesystem
from bench_util import add_scratch_dir_option, llm_state, minor_faults, state_bytes

ckptfs.filesystem.register()


def timed(fn):
    f0, t0 = minor_faults(), time.monotonic()
    fn()
    return time.monotonic() - t0, minor_faults() - f0


def unique_bytes(repo):
    return repo.du()["total"]["unique_raw_bytes"]


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def fresh_repository(work, label):
    """A new repository (a new path: a process keeps the repositories it
    opened), so that no save deduplicates against an earlier run's."""
    path = tempfile.mkdtemp(prefix=label + "-", dir=work)
    os.rmdir(path)
    ckptfs.init(path)
    return path


def bench_dcp(args, work, state):
    from ckptfs.torch import StorageWriter

    size = state_bytes(state)
    figs = {k: [] for k in ("url", "writer", "fs", "url_load", "fs_load")}
    faults = {k: [] for k in ("url", "writer", "fs")}
    for run in range(args.runs):
        order = ["url", "writer", "fs"] if run % 2 == 0 else ["fs", "writer", "url"]
        for path in order:
            if path == "url":
                repo_path = fresh_repository(work, "url-repo")
                s, f = timed(lambda: dcp.save(state, checkpoint_id=f"ckptfs://{repo_path}/step-1"))
            elif path == "writer":
                writer_repo = fresh_repository(work, "writer-repo")
                s, f = timed(lambda: dcp.save(state, storage_writer=StorageWriter(writer_repo, "step-1")))
            else:
                shutil.rmtree(os.path.join(work, "fs"), ignore_errors=True)
                s, f = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(
                    os.path.join(work, "fs"), sync_files=True)))
            figs[path].append(s)
            faults[path].append(f / (size / (1 << 30)))
        target = {k: torch.empty_like(v) for k, v in state.items()}
        figs["url_load"].append(timed(lambda: dcp.load(target, checkpoint_id=f"ckptfs://{repo_path}/step-1"))[0])
        assert all(torch.equal(target[k], state[k]) for k in state)
        figs["fs_load"].append(timed(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(
            os.path.join(work, "fs"))))[0])
    med = {k: statistics.median(v) for k, v in figs.items()}
    gib = size / (1 << 30)
    print(f"dcp.save of {size / 2**20:.0f} MiB into a new repository or directory, durable, medians of {args.runs}:")
    for k, label in (("url", "checkpoint_id=ckptfs://"), ("writer", "ckptfs.torch.StorageWriter"),
                     ("fs", "FileSystemWriter")):
        print(f"  {label:30s} {med[k]:.3f} s  {gib / med[k]:.2f} GiB/s  faults/GiB {statistics.median(faults[k]):.0f}")
    print(f"  ckptfs:// / StorageWriter (speed): {med['writer'] / med['url']:.3f} (target >= 0.9)")
    print(f"  ckptfs:// / FileSystemWriter (speed): {med['fs'] / med['url']:.3f} (target >= 1.0)")
    print(f"dcp.load: ckptfs:// {med['url_load']:.3f} s, FileSystemReader {med['fs_load']:.3f} s: "
          f"{med['fs_load'] / med['url_load']:.3f} (speed ratio)")


def bench_torch_checkpointing(args, work, state):
    try:
        from torch_checkpointing.checkpoint_manager import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    except ImportError as e:
        print(f"torch_checkpointing: skipped ({e})")
        return
    from ckptfs.torch_checkpointing import CkptfsStorageConfig

    size = state_bytes(state)
    figs = {k: [] for k in ("ckptfs_save", "fs_save", "ckptfs_load", "fs_load")}
    def manager(storage):
        config = CheckpointManager.Config.with_sync_save()
        config.storage_config = storage
        return config.build()

    managers = {"fs": manager(LocalFileSystemStorageConfig(use_direct_io=False))}
    for run in range(args.runs):
        repo_path = fresh_repository(work, "tc-repo")
        managers["ckptfs"] = manager(CkptfsStorageConfig(repo_path))
        for which in (("ckptfs", "fs") if run % 2 == 0 else ("fs", "ckptfs")):
            path = os.path.join(repo_path, "step-1") if which == "ckptfs" else os.path.join(work, f"tc-{run}")
            figs[f"{which}_save"].append(timed(lambda: managers[which].save(path, {"state": state}))[0])
            into = {"state": {k: torch.empty_like(v) for k, v in state.items()}}
            figs[f"{which}_load"].append(timed(lambda: managers[which].load(path, into=into))[0])
            assert all(torch.equal(into["state"][k], state[k]) for k in state)
        shutil.rmtree(os.path.join(work, f"tc-{run}"), ignore_errors=True)
        managers.pop("ckptfs").close()
    managers["fs"].close()
    med = {k: statistics.median(v) for k, v in figs.items()}
    print(f"torch_checkpointing CheckpointManager (sync save, into a new repository or directory) of "
          f"{size / 2**20:.0f} MiB, medians of {args.runs}:")
    print(f"  save: ckptfs backend {med['ckptfs_save']:.3f} s, LocalFileSystemStorage {med['fs_save']:.3f} s: "
          f"{med['fs_save'] / med['ckptfs_save']:.3f} (speed ratio, target >= 1.0)")
    print(f"  load: ckptfs backend {med['ckptfs_load']:.3f} s, LocalFileSystemStorage {med['fs_load']:.3f} s: "
          f"{med['fs_load'] / med['ckptfs_load']:.3f} (speed ratio, target >= 1.0)")


def bench_rename_on_s3(args, work):
    if not os.environ.get("AWS_ENDPOINT_URL"):
        print("rename on S3: skipped (no AWS_ENDPOINT_URL)")
        return
    prefix = f"fsspec-bench-{os.getpid()}"
    url = f"s3://ckptfs-test/{prefix}"
    repo = ckptfs.init(url)
    fs = fsspec.filesystem("ckptfs", skip_instance_cache=True)
    files = 8
    per = (args.rename_mib << 20) // files
    blob = os.urandom(per)
    local = os.path.join(work, "rename-files")
    os.makedirs(local, exist_ok=True)
    for i in range(files):
        fs.pipe(f"ckptfs://ckptfs-test/{prefix}/tmp_step-1/part-{i}", blob[:per - i] + bytes([i]) * i)
        with open(os.path.join(local, f"part-{i}"), "wb") as f:
            f.write(blob[:per - i] + bytes([i]) * i)
    before = repo.store_counters()
    t0 = time.monotonic()
    fs.mv(f"ckptfs://ckptfs-test/{prefix}/tmp_step-1", f"ckptfs://ckptfs-test/{prefix}/step-1", recursive=True)
    ms = (time.monotonic() - t0) * 1e3
    after = repo.store_counters()
    requests = after["requests"] - before["requests"]
    print(f"rename of a {args.rename_mib} MiB directory ({files} files) on S3:")
    print(f"  ckptfs:// mv (one manifest, staged files removed): {ms:.0f} ms, {requests} requests "
          f"(this process's repository object)")
    plain = f"s3://ckptfs-test/{prefix}-plain"
    host = os.environ["AWS_ENDPOINT_URL"].split("://", 1)[1]
    s3cmd = ["s3cmd", "-q", "--no-ssl", f"--host={host}", f"--host-bucket={host}",
             f"--access_key={os.environ['AWS_ACCESS_KEY_ID']}", f"--secret_key={os.environ['AWS_SECRET_ACCESS_KEY']}",
             f"--region={os.environ.get('AWS_REGION', 'us-east-1')}", "--no-check-md5"]
    subprocess.run(s3cmd + ["put", "--recursive", local + "/", plain + "/tmp_step-1/"], check=True)
    t0 = time.monotonic()
    subprocess.run(s3cmd + ["mv", "--recursive", plain + "/tmp_step-1/", plain + "/step-1/"], check=True)
    plain_ms = (time.monotonic() - t0) * 1e3
    print(f"  s3cmd mv of the same files as objects (a copy and a delete each): {plain_ms:.0f} ms, "
          f"at least {2 * files} requests; ckptfs:// / s3cmd time {ms / plain_ms:.3f}")
    subprocess.run(s3cmd + ["del", "--recursive", plain + "/"], check=False)
    repo.rm(*[c["name"] for c in repo.checkpoints()])


def frozen_model(step):
    """An embedding that never changes and layers that change every step."""
    gen = torch.Generator().manual_seed(1)
    emb = torch.randn(8192, 1024, generator=gen)                    # 32 MiB, frozen
    gen = torch.Generator().manual_seed(100 + step)
    layers = torch.randn(8192, 1024, generator=gen)                 # 32 MiB, trained
    return {"embed.weight": emb, "layers.weight": layers}


def bench_dedup(args, work):
    paths = {}
    for which in ("dcp", "torch_checkpointing", "torch.save"):
        repo_path = os.path.join(work, f"dedup-{which.replace('.', '-')}")
        repo = ckptfs.init(repo_path)
        saved = 0
        manager = None
        if which == "torch_checkpointing":
            try:
                from torch_checkpointing.checkpoint_manager import CheckpointManager
            except ImportError:
                continue
            from ckptfs.torch_checkpointing import CkptfsStorageConfig
            config = CheckpointManager.Config.with_sync_save()
            config.storage_config = CkptfsStorageConfig(repo_path)
            manager = config.build()
        fs = fsspec.filesystem("ckptfs", skip_instance_cache=True)
        for step in range(10):
            state = frozen_model(step)
            saved += state_bytes(state)
            if which == "dcp":
                dcp.save(state, checkpoint_id=f"ckptfs://{repo_path}/run/step-{step}")
            elif which == "torch_checkpointing":
                manager.save(os.path.join(repo_path, f"run/step-{step}"), {"model": state})
            else:
                with fs.open(f"ckptfs://{repo_path}/run/step-{step}/model.pt", "wb") as f:
                    torch.save(state, f)
                fs.commit(f"ckptfs://{repo_path}/run/step-{step}")
        if manager is not None:
            manager.close()
        paths[which] = (unique_bytes(repo), saved)
        shutil.rmtree(repo_path)
    print("10 saves of a model whose embedding (half the bytes) is frozen: stored / saved")
    for which, (stored, saved) in paths.items():
        print(f"  {which:22s} {stored / 2**20:7.1f} MiB of {saved / 2**20:7.1f} MiB: {stored / saved:.3f} "
              f"(without dedup 1.000; the floor, frozen half once: {0.5 / 10 + 0.5:.3f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scratch_dir_option(ap)
    ap.add_argument("--mib", type=int, default=256, help="size of the DCP and torch_checkpointing state")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rename-mib", type=int, default=1024, help="size of the directory renamed on S3")
    ap.add_argument("--only", choices=("dcp", "torch_checkpointing", "rename", "dedup"), action="append")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ckptfs-fsspec-bench-", dir=args.dir)
    try:
        state = llm_state(torch, args.mib, 1)
        only = set(args.only or ("dcp", "torch_checkpointing", "rename", "dedup"))
        print(f"torch {torch.__version__}, fsspec {fsspec.__version__}, {os.cpu_count()} CPUs, in {args.dir}")
        if "dcp" in only:
            bench_dcp(args, work, state)
        if "torch_checkpointing" in only:
            bench_torch_checkpointing(args, work, state)
        if "rename" in only:
            bench_rename_on_s3(args, work)
        if "dedup" in only:
            bench_dedup(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
