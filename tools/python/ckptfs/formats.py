"""Checkpoints of other formats into a ckptfs repository, read with torch's
own readers (ckptfs parses no pickle):

- a torch.distributed.checkpoint (DCP) directory (``.metadata`` and
  ``__R_K.distcp`` files; also what Megatron-Core's ``torch_dist`` format
  writes): each saved chunk becomes a box shard of its tensor, as it was
  saved, so checkpoints DCP wrote at different world sizes share their
  chunks; non-tensor items (pickled by DCP) become blobs of the same name.
  The ``.metadata`` file is a pickle, read by
  ``FileSystemReader.read_metadata()``: importing a DCP directory trusts it
  as ``dcp.load`` does. Look first with ``dry_run=True``.
- a ``torch.save`` file of a (possibly nested) state dict, read with
  ``torch.load(weights_only=True)``, which refuses anything but tensors and
  plain containers and numbers: tensors are stored under their keys joined
  with ``.``, other leaves as blobs, and the dict's shape as the blob
  ``ckptfs.torch.structure``.
- safetensors files and Hugging Face model directories go to the engine's
  own importer (``Repository.import_safetensors``).

``python -m ckptfs.formats import NAME PATH`` is what ``ckpt import`` runs
for the formats that need torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import ckptfs
from ckptfs import InvalidArgumentError, UnsupportedError, _put_value

__all__ = ["detect", "import_checkpoint", "STRUCTURE_BLOB"]

# The blob holding a torch.save file's dict shape (import_torch).
STRUCTURE_BLOB = "ckptfs.torch.structure"

_PICKLE_MAGIC = b"\x80"
_ZIP_MAGIC = b"PK\x03\x04"

PathLike = Union[str, "os.PathLike[str]"]


def detect(path: PathLike) -> str:
    """The format of `path`: "dcp" (a directory with a .metadata file),
    "hf" (another directory: a model directory), "safetensors" or "torch"
    (a torch.save file: a zip archive or a legacy pickle). Raises
    InvalidArgumentError naming the path when it is none of them."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return "dcp" if os.path.isfile(os.path.join(path, ".metadata")) else "hf"
    if not os.path.isfile(path):
        raise ckptfs.NotFoundError(f"{path}: no such file or directory")
    if path.endswith(".safetensors"):
        return "safetensors"
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_MAGIC):
        return "torch"
    if len(head) == 8 and 2 <= int.from_bytes(head, "little") < 100 << 20:
        return "safetensors"  # an 8-byte header length, whatever the file is called
    raise InvalidArgumentError(f"{path}: not a safetensors file, torch.save file, DCP directory or model directory")


def _torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise UnsupportedError("this format is read with torch, which is not installed here: "
                               "pip install 'ckptfs[torch]'") from None
    return torch


def _describe(entries: List[Dict[str, Any]], blobs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"tensors": entries, "blobs": blobs,
            "tensor_bytes": sum(e["bytes"] for e in entries), "blob_bytes": sum(b["bytes"] for b in blobs)}


def _dtype_name(dtype) -> str:
    ckptfs._torch()  # fills the tables
    name = ckptfs._torch_to_name.get(dtype)
    if name is None:
        raise UnsupportedError(f"torch dtype {dtype} has no ckptfs dtype")
    return name


# ---- DCP ---------------------------------------------------------------------------

def _dcp_reader(path: str):
    torch = _torch()
    try:
        from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # noqa: PLC0415
    except ImportError as e:
        raise UnsupportedError(f"torch {torch.__version__} lacks torch.distributed.checkpoint: {e}") from None
    reader = FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - torch raises what the pickle or the file gives
        raise ckptfs.CorruptionError(f"{path}: cannot read the DCP metadata (.metadata): {e}") from None
    return reader, metadata, BytesStorageMetadata


def _dcp_plan(path: str):
    """What a DCP directory holds, checked against its files: the entries
    of a dry run and the reader."""
    reader, metadata, bytes_type = _dcp_reader(path)
    entries, blobs = [], []
    storage = getattr(metadata, "storage_data", None) or {}
    files = {getattr(v, "relative_path", None) for v in storage.values()}
    for f in sorted(x for x in files if x):
        if not os.path.isfile(os.path.join(path, f)):
            raise ckptfs.CorruptionError(f"{path}: the DCP metadata names {f}, which is missing")
    for fqn, m in metadata.state_dict_metadata.items():
        if isinstance(m, bytes_type):
            blobs.append({"name": fqn, "bytes": 0})
            continue
        dtype = _dtype_name(m.properties.dtype)
        item = _torch().empty((), dtype=m.properties.dtype).element_size()
        total = 1
        for s in m.size:
            total *= int(s)
        entries.append({"name": fqn, "dtype": dtype, "shape": [int(s) for s in m.size], "bytes": total * item,
                        "shards": len(m.chunks)})
    return reader, metadata, _describe(entries, blobs)


def _import_dcp(repo: "ckptfs.Repository", writer, path: str, reader, metadata) -> None:
    torch = _torch()
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex  # noqa: PLC0415
    from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner,  # noqa: PLC0415
                                                      ReadItem)

    kept: list = []

    class ChunkPlanner(LoadPlanner):
        """Reads every saved chunk whole, as it was saved, and puts it."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.metadata = metadata

        def create_local_plan(self):
            items = []
            for fqn, m in self.metadata.state_dict_metadata.items():
                if isinstance(m, BytesStorageMetadata):
                    idx = MetadataIndex(fqn)
                    items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=idx, dest_offsets=torch.Size([]),
                                          storage_index=idx, storage_offsets=torch.Size([]),
                                          lengths=torch.Size([])))
                    continue
                for i, chunk in enumerate(m.chunks):
                    idx = MetadataIndex(fqn, chunk.offsets, i)
                    zeros = torch.Size([0] * len(chunk.sizes))
                    items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=idx, dest_offsets=zeros,
                                          storage_index=idx, storage_offsets=zeros, lengths=chunk.sizes))
            return LoadPlan(items)

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value):
            _put_value(writer, read_item.dest_index.fqn, value.read(), None, False, kept)

        def resolve_tensor(self, read_item):
            m = self.metadata.state_dict_metadata[read_item.dest_index.fqn]
            return torch.empty(tuple(read_item.lengths), dtype=m.properties.dtype)

        def commit_tensor(self, read_item, tensor):
            fqn = read_item.dest_index.fqn
            m = self.metadata.state_dict_metadata[fqn]
            shard = ckptfs.Box(tuple(int(s) for s in m.size), tuple(int(o) for o in read_item.dest_index.offset))
            _put_value(writer, fqn, tensor.contiguous(), shard, True, kept)

    planner = ChunkPlanner()
    planner.set_up_planner({}, metadata, True)
    plan = planner.create_local_plan()
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(plan)
    try:
        reader.read_data(plan, planner).wait()
    except ckptfs.Error:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or damaged .distcp file, as torch reports it
        raise ckptfs.CorruptionError(f"{path}: cannot read the DCP data: {type(e).__name__}: {e}") from None


# ---- torch.save ----------------------------------------------------------------------

def _flatten(obj, prefix: str, tensors: Dict[str, Any], others: Dict[str, Any], torch) -> Any:
    """The structure of `obj` (JSON), its tensors and other leaves by key."""
    if isinstance(obj, Mapping):
        node = {"dict": []}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise InvalidArgumentError(f"key {k!r} under '{prefix}' is not a string; only string keys are kept")
            key = f"{prefix}.{k}" if prefix else k
            node["dict"].append([k, _flatten(v, key, tensors, others, torch)])
        return node
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"tensor": prefix}
    others[prefix] = obj
    return {"value": prefix}


def _torch_plan(path: str):
    torch = _torch()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
    except Exception as e:  # noqa: BLE001 - torch's refusal (weights_only) or a damaged file
        raise ckptfs.CorruptionError(f"{path}: torch.load(weights_only=True) cannot read it: "
                                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(f"{path}: holds a {type(state).__name__}, not a state dict")
    tensors: Dict[str, Any] = {}
    others: Dict[str, Any] = {}
    structure = _flatten(state, "", tensors, others, torch)
    seen = set()
    for key in list(tensors) + list(others):
        if key in seen or key == STRUCTURE_BLOB:
            raise InvalidArgumentError(f"{path}: two entries flatten to the name '{key}'")
        seen.add(key)
    entries = [{"name": k, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                "bytes": t.numel() * t.element_size()} for k, t in tensors.items()]
    blobs = [{"name": k, "bytes": 0} for k in others] + [{"name": STRUCTURE_BLOB, "bytes": 0}]
    return (state, tensors, others, structure), _describe(entries, blobs)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _ZIP_MAGIC


def _import_torch(writer, loaded) -> None:
    torch = _torch()
    import io  # noqa: PLC0415

    _state, tensors, others, structure = loaded
    kept: list = []
    for key, t in tensors.items():
        _put_value(writer, key, t.detach().contiguous(), None, False, kept)
    for key, v in others.items():
        buf = io.BytesIO()
        torch.save(v, buf)
        _put_value(writer, key, buf.getvalue(), None, False, kept)
    _put_value(writer, STRUCTURE_BLOB, json.dumps(structure).encode(), None, False, kept)


# ---- entry points ---------------------------------------------------------------------

def import_checkpoint(repo: "ckptfs.Repository", name: str, path: PathLike, *, step: Optional[int] = None,
                      tags: Optional[Mapping[str, str]] = None, dry_run: bool = False,
                      format: Optional[str] = None) -> Dict[str, Any]:  # noqa: A002
    """Imports the checkpoint at `path` (a DCP directory, a torch.save
    file, a safetensors file or a model directory; `format` to say which
    instead of detecting it) as checkpoint `name` of `repo`.

    Returns {"format", "name", "tensors": [{name, dtype, shape, bytes}],
    "blobs", "tensor_bytes", "blob_bytes", "committed"}; with dry_run,
    what would be imported, and nothing is written. Every input is read and
    checked before the checkpoint becomes visible; on an error nothing is.
    """
    path = os.fspath(path)
    fmt = format or detect(path)
    tags = {str(k): str(v) for k, v in (tags or {}).items()}
    if fmt in ("safetensors", "hf"):
        if dry_run:
            raise UnsupportedError("--dry-run of safetensors files and model directories: use 'ckpt import' itself, "
                                   "which checks every input before writing")
        summary = repo.import_safetensors(name, [path], step=step, tags=tags)
        return {"format": fmt, "name": name, "committed": True, "summary": summary}
    if fmt == "dcp":
        reader, metadata, described = _dcp_plan(path)
    elif fmt == "torch":
        loaded, described = _torch_plan(path)
    else:
        raise InvalidArgumentError(f"unknown format '{fmt}' (dcp, torch, safetensors or hf)")
    out = {"format": fmt, "name": name, **described, "committed": False}
    if dry_run:
        return out
    writer = repo._repo.begin(name, 0, 1, step, sorted(tags.items()))
    try:
        if fmt == "dcp":
            _import_dcp(repo, writer, path, reader, metadata)
        else:
            _import_torch(writer, loaded)
        handle = writer.commit(snapshot=False)
    except BaseException:
        writer.abort()
        raise
    handle.wait(None)
    result = handle.result()
    out["committed"] = True
    out["stored_bytes"] = result["stored_bytes"]
    return out


def _main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="ckpt import", description="Import a DCP directory or a torch.save file.")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import")
    imp.add_argument("--repo", required=True)
    imp.add_argument("--cache-dir")
    imp.add_argument("--step", type=int)
    imp.add_argument("--tag", action="append", default=[])
    imp.add_argument("--dry-run", action="store_true")
    imp.add_argument("--json", action="store_true")
    imp.add_argument("name")
    imp.add_argument("path")
    args = parser.parse_args(argv)
    tags = {}
    for t in args.tag:
        key, eq, value = t.partition("=")
        if not eq or not key:
            print(f"ckpt: error: --tag must be KEY=VALUE, not '{t}'", file=sys.stderr)
            return 2
        tags[key] = value
    try:
        repo = ckptfs.open(args.repo, cache_dir=args.cache_dir)
        out = import_checkpoint(repo, args.name, args.path, step=args.step, tags=tags, dry_run=args.dry_run)
    except ckptfs.Error as e:
        print(f"ckpt: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=2))
    elif args.dry_run:
        print(f"{out['name']}: would import from {out['format']} {args.path}:")
        for t in out["tensors"]:
            print(f"  {t['name']}  {t['dtype']} {t['shape']}  {t['bytes']} bytes")
        for b in out["blobs"]:
            print(f"  {b['name']}  (blob)")
        print(f"{len(out['tensors'])} tensors, {out['tensor_bytes']} bytes; {len(out['blobs'])} blobs")
    else:
        print(f"{out['name']}: imported {len(out['tensors'])} tensors ({out['tensor_bytes']} bytes) and "
              f"{len(out['blobs'])} blobs from {out['format']} {args.path}; checkpoint committed")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
