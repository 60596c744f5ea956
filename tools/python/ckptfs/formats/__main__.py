"""`python -m ckptfs.formats import|export ...`: what `ckpt import` and
`ckpt export` run for the formats that need torch."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Optional, Sequence

import ckptfs
from .export import export_checkpoint
from .importing import import_checkpoint
from .torch_in import Progress


def _in_repository(args, label: str, work) -> Optional[Dict[str, Any]]:
    """Opens args.repo and runs work(repo, progress), drawing progress on
    stderr as the ckpt command does; None after printing the error line."""
    try:
        repo = ckptfs.open(args.repo, cache_dir=args.cache_dir)
        shown = Progress(label, args.progress)
        try:
            return work(repo, shown)
        finally:
            shown.finish()
    except (ckptfs.Error, OSError) as e:
        print(f"ckpt: error: {e}", file=sys.stderr)
        return None
    except RecursionError:
        print(f"ckpt: error: {label}: the input nests objects deeper than Python's limit "
              f"({sys.getrecursionlimit()} levels) allows reading", file=sys.stderr)
        return None


def _main(argv: Sequence[str]) -> int:
    # A mapped input (a torch.save file, a .distcp file, a file beside
    # them) cut short while it is read faults: one line, not "Bus error".
    ckptfs._core.exit_on_bus_error("ckpt: error: an input file was truncated or damaged while it was read (a "
                                   "memory-mapped file faulted); nothing became visible\n")
    parser = argparse.ArgumentParser(prog="ckpt import", description="Import a DCP directory, a torch.save file "
                                     "or a model directory of torch.save weights.")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import")
    imp.add_argument("--repo", required=True)
    imp.add_argument("--cache-dir")
    imp.add_argument("--step", type=int)
    imp.add_argument("--tag", action="append", default=[])
    imp.add_argument("--dry-run", action="store_true")
    imp.add_argument("--trust-pickle", action="store_true")
    imp.add_argument("--follow-symlinks", action="store_true")
    imp.add_argument("--overwrite", action="store_true")
    imp.add_argument("--json", action="store_true")
    imp.add_argument("--progress", choices=("auto", "on", "json", "off"), default="auto")
    imp.add_argument("name")
    imp.add_argument("path")
    exp = sub.add_parser("export")
    exp.add_argument("--repo", required=True)
    exp.add_argument("--cache-dir")
    exp.add_argument("--format", required=True)
    exp.add_argument("--max-shard-size", default="5GB")
    exp.add_argument("--dtype")
    exp.add_argument("--prefix")
    exp.add_argument("--clean", action="store_true")
    exp.add_argument("--json", action="store_true")
    exp.add_argument("--progress", choices=("auto", "on", "json", "off"), default="auto")
    exp.add_argument("name")
    exp.add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "export":
        done = _in_repository(args, f"export {args.name}", lambda repo, progress: export_checkpoint(
            repo, args.name, args.out, format=args.format, max_shard_size=args.max_shard_size, dtype=args.dtype,
            clean=args.clean, progress=progress, prefix=args.prefix))
        if done is None:
            return 1
        for what in done["left_out"]:
            print(f"ckpt export: leaving out {what}", file=sys.stderr)
        for what in done["rewritten_files"]:
            print(f"ckpt export: {what}, finished by the interrupted export, no longer had the bytes written then; "
                  "written again", file=sys.stderr)
        if args.json:
            print(json.dumps(done, indent=2))
        else:
            print(f"{args.name}: exported as {done['format']} to {done['out']}: {len(done['files'])} files, "
                  f"{done['bytes']} bytes" + (f" ({done['resumed_files']} kept from an interrupted export)"
                                              if done["resumed_files"] else ""))
        return 0
    tags = {}
    for t in args.tag:
        key, eq, value = t.partition("=")
        if not eq or not key:
            print(f"ckpt: error: --tag must be KEY=VALUE, not '{t}'", file=sys.stderr)
            return 2
        tags[key] = value
    out = _in_repository(args, f"import {args.name}", lambda repo, progress: import_checkpoint(
        repo, args.name, args.path, step=args.step, tags=tags, dry_run=args.dry_run, progress=progress,
        trust_pickle=args.trust_pickle, follow_symlinks=args.follow_symlinks, overwrite=args.overwrite))
    if out is None:
        return 1
    for what in out.get("left_out", []):
        print(f"ckpt import: leaving out {what}", file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=2))
    elif args.dry_run:
        print(f"{out['name']}: would import from {out['format']} {args.path}:")
        for t in out["tensors"]:
            print(f"  {t['name']}  {t['dtype']} {t['shape']}  {t['bytes']} bytes")
        for b in out["blobs"]:
            print(f"  {b['name']}  (blob)")
        for link in out.get("links", []):
            print(f"  (symbolic link {link['path']} -> {link['target']}, followed)")
        print(f"{len(out['tensors'])} tensors, {out['tensor_bytes']} bytes; {len(out['blobs'])} blobs")
    else:  # as the engine's own import says it
        human = Progress.human
        print(f"{out['name']}: {len(out['tensors'])} tensors and {len(out['blobs'])} blobs from {out['format']} "
              f"{args.path}: {human(out['logical_bytes'])} imported, {human(out['stored_bytes'])} stored "
              f"({out['chunks_written']} new chunks, {out['chunks_deduplicated']} deduplicated); checkpoint committed")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
