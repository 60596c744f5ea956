"""Exporting a checkpoint as a DCP directory that dcp.load reads."""

from __future__ import annotations

import io
from typing import Any, Callable, Dict, List

from ckptfs import UnsupportedError
from . import writing
from .common import INTERNAL_BLOBS, torch_or_raise
from .writing import (
    Export,
    ExportTensors,
    files_beside,
    hf_shards,
    read_tensor,
    write_blob,
    write_files,
)


DCP_FILE_BYTES = 1 << 30
DCP_MIN_FILE_BYTES = 16 << 20


def write_dcp_export(export: "Export", repo, reader, name: str, order: List[str], shown, sizes: "ExportTensors",
                     cast, threads: int, advance: Callable[[int], None], paths: Dict[str, tuple]) -> List[str]:
    """Writes the checkpoint as a DCP directory in FileSystemWriter's layout:
    `__0_K.distcp` files of torch.save'd items (each tensor whole, each blob
    a bytes item) and `.metadata`, a pickle of torch's own Metadata classes
    naming every item's file, offset and length. Files are written by
    `threads` threads, one tensor in memory per thread; each finished file
    is recorded with its items, so a rerun skips it; `.metadata` comes last.
    Returns the file names."""
    import io  # noqa: PLC0415
    import pickle  # noqa: PLC0415

    torch = torch_or_raise()
    try:
        from torch.distributed.checkpoint import filesystem  # noqa: PLC0415
        from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: PLC0415
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,  # noqa: PLC0415
                                                           ChunkStorageMetadata, Metadata, MetadataIndex,
                                                           TensorProperties, TensorStorageMetadata)
    except ImportError as e:
        raise UnsupportedError(f"torch {torch.__version__} lacks the DCP classes this export writes: {e}") from None
    version = getattr(filesystem, "CURRENT_DCP_VERSION", None)

    beside = files_beside(repo, name, shown)
    blobs = [b["name"] for b in shown["blobs"] if b["name"] not in INTERNAL_BLOBS and b["name"] not in beside]
    tensor_bytes = sum(sizes.nbytes(n) for n in order)
    per_file = min(DCP_FILE_BYTES, max(DCP_MIN_FILE_BYTES, -(-tensor_bytes // max(1, int(threads)))))
    groups = hf_shards([(n, sizes.nbytes(n)) for n in order], per_file) if order else []
    if blobs:
        groups.append([None])  # the blobs: one file after the tensors
    names = [f"__0_{k}.distcp" for k in range(len(groups))]

    def blob_item(b):
        # DCP's bytes items are torch.save'd objects: a blob that is one
        # (DCP's own non-tensor items, a torch.save file's values) is kept
        # as it is; other bytes are saved as a bytes object.
        data = repo.blob(name, b)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
            return data
        except Exception:  # noqa: BLE001 - not a pickle torch reads: saved as bytes
            buf = io.BytesIO()
            torch.save(data, buf)
            return buf.getvalue()

    def write_file(k):
        if names[k] in export.done:
            advance(sum(sizes.nbytes(n) for n in groups[k] if n is not None))
            return
        items = []

        def body(f):
            for n in groups[k]:
                for key in (blobs if n is None else [n]):
                    at = f.tell()
                    if n is None:
                        f.write(blob_item(key))
                    else:
                        torch.save(read_tensor(reader, key, cast), f)
                        advance(sizes.nbytes(key))
                    items.append([key, at, f.tell() - at])

        export.write(names[k], body, items)

    write_files(write_file, len(groups), threads)
    blob_bytes = {b["name"]: b["bytes"] for b in shown["blobs"]}
    for b in beside:  # the files that were beside the data, as they were
        if b not in export.done:
            export.write(b, lambda f, b=b: write_blob(reader, b, blob_bytes[b], f))
    state_md: Dict[str, Any] = {}
    storage: Dict[Any, Any] = {}
    tensors = set(order)
    for fname in names:
        for key, at, length in export.items[fname]:
            if key in tensors:
                shape = torch.Size(sizes.shape(key))
                zeros = torch.Size([0] * len(shape))
                state_md[key] = TensorStorageMetadata(properties=TensorProperties(dtype=sizes.dtype(key)), size=shape,
                                                      chunks=[ChunkStorageMetadata(offsets=zeros, sizes=shape)])
                index = MetadataIndex(key, zeros)
            else:
                state_md[key] = BytesStorageMetadata()
                index = MetadataIndex(key)
            storage[index] = _StorageInfo(relative_path=fname, offset=int(at), length=int(length))
    # Each item's object path (`paths`), as dcp.save's planner records it:
    # from the checkpoint's structure where it has one (a DCP or torch.save
    # import).
    if paths:  # and in its order, which is the order of each dict's keys when unflattened
        at = {k: i for i, k in enumerate(paths)}
        state_md = {k: state_md[k] for k in sorted(state_md, key=lambda k: at.get(k, len(at)))}
    metadata = Metadata(state_dict_metadata=state_md, planner_data={k: paths.get(k, (k,)) for k in state_md},
                        storage_data=storage, version=version)
    writing.write_durable(export.path(".metadata"), lambda f: pickle.dump(metadata, f))
    return names + beside + [".metadata"]
