"""import_checkpoint: any supported format into a repository."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Mapping, Optional

import ckptfs
from ckptfs import InvalidArgumentError, UnsupportedError
from .common import DCP_FILES_BLOB, PathLike, STRUCTURE_BLOB, detect
from .dcp_in import Directory, dcp_plan, import_dcp
from .torch_in import hf_torch_plan, holds_torch_weights_only, import_hf_torch, import_torch, put_files, torch_plan


# ---- entry points ---------------------------------------------------------------------

def import_checkpoint(repo: "ckptfs.Repository", name: str, path: PathLike, *, step: Optional[int] = None,
                      tags: Optional[Mapping[str, str]] = None, dry_run: bool = False,
                      format: Optional[str] = None,  # noqa: A002
                      progress: Optional[Callable[[int, int], None]] = None,
                      trust_pickle: bool = False, follow_symlinks: bool = False,
                      overwrite: bool = False) -> Dict[str, Any]:
    """Imports the checkpoint at `path` (a DCP directory, a torch.save
    file, a safetensors file or a model directory; `format` to say which
    instead of detecting it) as checkpoint `name` of `repo`.

    Returns {"format", "name", "tensors": [{name, dtype, shape, bytes}],
    "blobs", "tensor_bytes", "blob_bytes", "committed"}; with dry_run,
    what would be imported, and nothing is written. Every input is read and
    checked before the checkpoint becomes visible; on an error nothing is.
    `progress(done, total)` is called with tensor bytes as they are put.
    `overwrite` replaces a checkpoint `name` already holds, as for save.

    A DCP ``.metadata`` file is a pickle. It is read admitting only DCP's
    own metadata classes and plain values, so that a file from elsewhere
    runs no code, not even with dry_run; anything else it names raises
    UnsupportedError naming it. ``trust_pickle=True`` reads it as
    ``dcp.load`` does, for files you wrote yourself.
    """
    path = os.fspath(path)
    fmt = format or detect(path)
    tags = {str(k): str(v) for k, v in (tags or {}).items()}
    torch_weights = fmt == "hf" and os.path.isdir(path) and holds_torch_weights_only(path)
    if fmt in ("safetensors", "hf") and not torch_weights:
        if dry_run:
            described = repo._repo.describe_import([path], [], follow_symlinks)
            return {"format": fmt, "name": name, **described, "committed": False}
        summary = repo.import_safetensors(name, [path], step=step, tags=tags, follow_symlinks=follow_symlinks,
                                          overwrite=overwrite)
        return {"format": fmt, "name": name, "committed": True, "summary": summary}
    if fmt == "dcp":
        reader, metadata, described, (beside, structure) = dcp_plan(path, trust_pickle,
                                                                     Directory(path, follow_symlinks))
    elif torch_weights:
        loaded, described = hf_torch_plan(path, Directory(path, follow_symlinks))
    elif fmt == "torch":
        loaded, described = torch_plan(path)
    else:
        raise InvalidArgumentError(f"unknown format '{fmt}' (dcp, torch, safetensors or hf)")
    out = {"format": fmt, "name": name, **described, "committed": False}
    if dry_run:
        return out
    total, done = out["tensor_bytes"], [0]

    def advance(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(min(done[0], total), total)

    # A DCP directory is read while the chunks are written: on the
    # repository's own disk every chunk is compressed (WriterOptions).
    writer = repo._repo.begin(name, 0, 1, step, sorted(tags.items()),
                              compress_every_chunk=fmt == "dcp" and on_the_repositorys_disk(repo, path),
                              overwrite=overwrite)
    try:
        if fmt == "dcp":
            import_dcp(writer, path, reader, metadata, advance)
            if beside:
                put_files(writer, beside)
                writer.put_blob(DCP_FILES_BLOB, json.dumps([n for n, _ in beside]).encode())
            if structure is not None:
                writer.put_blob(STRUCTURE_BLOB, json.dumps(structure).encode())
        elif torch_weights:
            import_hf_torch(writer, loaded, advance)
        else:
            import_torch(writer, loaded, advance)
        handle = writer.commit(snapshot=False)
    except BaseException:
        writer.abort()
        raise
    handle.wait(None)
    result = handle.result()
    out["committed"] = True
    for k in ("logical_bytes", "stored_bytes", "chunks_written", "chunks_deduplicated"):
        out[k] = result[k]
    return out


def on_the_repositorys_disk(repo: "ckptfs.Repository", path: PathLike) -> bool:
    """Whether `path` is on the file system of `repo`, a local repository."""
    root = repo.path
    if "://" in root:
        return False
    try:
        return os.stat(path).st_dev == os.stat(root).st_dev
    except OSError:
        return False
