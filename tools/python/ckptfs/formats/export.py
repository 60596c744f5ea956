"""export_checkpoint: a checkpoint out as a model directory (safetensors),
a DCP directory or a torch.save file."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Union

import ckptfs
from ckptfs import InvalidArgumentError
from . import writing
from .common import INTERNAL_BLOBS, PathLike, torch_or_raise
from .export_dcp import write_dcp_export
from .export_torch import write_torch_export
from .torch_in import paths_of_structure
from .writing import (
    Export,
    ExportTensors,
    TensorStream,
    hf_shards,
    model_order,
    parse_size,
    safetensors_header,
    stored_structure,
    tensor_order,
    write_blob,
    write_files,
)


def export_checkpoint(repo: "ckptfs.Repository", name: str, out: PathLike, *, format: str = "hf",  # noqa: A002
                      max_shard_size: Union[str, int] = "5GB", dtype: Optional[str] = None, clean: bool = False,
                      threads: int = 4, progress: Optional[Callable[[int, int], None]] = None,
                      prefix: Optional[str] = None) -> Dict[str, Any]:
    """Writes checkpoint `name` to `out` as `format`:

    - "hf": model-0000K-of-0000N.safetensors split at max_shard_size as
      Hugging Face splits, model.safetensors.index.json (a single file is
      model.safetensors, without an index), and the checkpoint's blobs
      whose names are plain file names (config.json, tokenizer files) as
      files; every safetensors file carries "format": "pt".
    - "dcp": a directory stock dcp.load with FileSystemReader loads at any
      world size (every tensor one chunk; blobs that hold DCP's pickles
      become its non-tensor items again).
    - "torch": one torch.save file of the state dict (nested again when the
      checkpoint came from a torch.save file).

    `dtype` ("bfloat16", "float16", "float32") casts floating tensors.
    `prefix` (hf): only the tensors whose names start with it, written
    without it: "model." takes the model out of a training state saved as
    {"model": ..., "optim": ...}.
    Files are written into out + ".ckpt-export-partial" (hf: `threads` at a
    time), each made durable, and the directory is renamed to `out` only
    when complete; an interrupted export is resumed by the same call
    (finished files are kept once their content is checked), or removed
    first with clean=True. The partial directory is the export's own
    (owner only); one another user made, or one whose settings differ, is
    refused. `progress(done, total)` is called with tensor bytes as they
    are written. Returns {"out", "format", "files", "bytes", "resumed_files",
    "rewritten_files", "left_out"} (rewritten: finished files whose bytes
    had changed since, written again; hf left_out: the blobs not written,
    and why).
    """
    torch = torch_or_raise()
    out = os.path.normpath(os.fspath(out))  # "release/" is the directory "release"
    if format not in ("hf", "dcp", "torch"):
        raise InvalidArgumentError(f"unknown export format '{format}' (hf, dcp or torch; ckpt export writes safetensors)")
    cast = None
    if dtype is not None:
        cast = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                "float32": torch.float32, "fp32": torch.float32}.get(str(dtype).lower())
        if cast is None:
            raise InvalidArgumentError(f"dtype '{dtype}': use bfloat16, float16 or float32")
    if prefix is not None and format != "hf":
        raise InvalidArgumentError("a prefix is for --format hf")
    if prefix is not None and not prefix:
        raise InvalidArgumentError("the prefix is empty")

    def under(n: str) -> bool:
        return not prefix or (n.startswith(prefix) and len(n) > len(prefix))

    limit = parse_size(max_shard_size)
    shown = repo.show(name)  # NotFoundError for an unknown checkpoint
    settings = {"checkpoint": name, "committed": shown.get("committed"), "format": format, "max_shard_size": limit,
                "dtype": None if cast is None else str(cast)}
    if prefix:
        settings["prefix"] = prefix
    left_out: List[str] = []
    if prefix:
        # Checked before anything is written.
        names = [t["name"] for t in shown["tensors"]]
        chosen = [n for n in names if under(n)]
        if not chosen:
            heads = sorted({n.split(".")[0] + ("." if "." in n else "") for n in names})
            raise InvalidArgumentError(f"no tensor of '{name}' is named under '{prefix}'; its tensors' names begin "
                                       f"with {', '.join(heads[:10]) or 'nothing (it has none)'}")
        if len(chosen) < len(names):
            left_out.append(f"{len(names) - len(chosen)} tensors not named under '{prefix}'")
    export = Export(out, settings, clean)
    resumed = len(export.done)
    reader = repo._repo.open_checkpoint(name)
    structure = stored_structure(repo, name, shown)
    paths = paths_of_structure(structure) if structure is not None else {}  # item -> object path
    order = [n for n in tensor_order(structure, [t["name"] for t in shown["tensors"]]) if under(n)]
    files: List[str] = []
    sizes = ExportTensors(shown, cast)
    total_bytes, done_bytes, lock = sum(sizes.nbytes(n) for n in order), [0], threading.Lock()

    def advance(n: int) -> None:
        with lock:  # files are written on several threads
            done_bytes[0] += n
            if progress is not None:
                progress(min(done_bytes[0], total_bytes), total_bytes)

    if format == "hf":
        numel, nbytes = sizes.numel, sizes.nbytes
        cut = len(prefix) if prefix else 0  # tensors are written under their names without the prefix
        by_key = {n[cut:]: n for n in order}
        order = [by_key[k] for k in model_order(repo, name, shown, list(by_key)) or by_key]
        shards = hf_shards([(n, nbytes(n)) for n in order], limit)
        total = len(shards)
        names = ["model.safetensors"] if total == 1 else \
            [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]

        def write_shard(i):
            if names[i] in export.done:
                advance(sum(nbytes(n) for n in shards[i]))
                return
            head = safetensors_header([(n[cut:], sizes.dtype(n), sizes.shape(n)) for n in shards[i]],
                                       {"format": "pt"})
            stream = TensorStream(reader)

            def body(f):
                f.write(head)
                for n in shards[i]:
                    stream.write(f, n, sizes.stored(n), sizes.dtype(n), sizes.shape(n))
                    advance(nbytes(n))

            try:
                export.write(names[i], body)
            finally:
                stream.close()

        write_files(write_shard, total, threads)
        files += names
        if total > 1:
            weight_map = {n[cut:]: names[i] for i, shard in enumerate(shards) for n in shard}
            # As transformers writes it: bytes and parameters of all shards.
            index = {"metadata": {"total_parameters": sum(numel(n) for n in order),
                                  "total_size": sum(nbytes(n) for n in order)},
                     "weight_map": dict(sorted(weight_map.items()))}
            data = (json.dumps(index, indent=2) + "\n").encode()
            writing.write_durable(export.path("model.safetensors.index.json"), lambda f: f.write(data))
            files.append("model.safetensors.index.json")
        # Blobs named like files (config, tokenizer, a trainer's files) go
        # beside the shards; the state's non-tensor values (a DCP item, a
        # torch.save file's number) are not files of a model directory.
        values = set(paths) - set(order)
        for b in shown["blobs"]:
            bname = b["name"]
            if bname in INTERNAL_BLOBS or bname in files:
                continue
            if "/" in bname or bname.startswith("."):
                left_out.append(f"blob {bname} (not a plain file name)")
                continue
            if bname in values:
                left_out.append(f"blob {bname} (a non-tensor value of the state; --format dcp or torch keeps it)")
                continue
            writing.write_durable(export.path(bname), lambda f, b=b: write_blob(reader, b["name"], b["bytes"], f))
            files.append(bname)
    elif format == "dcp":
        files += write_dcp_export(export, repo, reader, name, order, shown, sizes, cast, threads, advance, paths)
    elif "model.pt" in export.done:  # finished before an interruption: kept as it is
        advance(total_bytes)
        files.append("model.pt")
    else:
        write_torch_export(export.path("model.pt"), repo, reader, name, order, shown, sizes, cast, structure, advance)
        export.finished("model.pt")
        files.append("model.pt")
    total_bytes = sum(os.path.getsize(export.path(f)) for f in files)
    export.commit()
    return {"out": out, "format": format, "files": files, "bytes": total_bytes, "resumed_files": resumed,
            "rewritten_files": list(export.redone),
            "left_out": left_out}


# mmap's MAP_NORESERVE (Python 3.13 names it; Linux's value on x86-64 and
# arm64 before that).
