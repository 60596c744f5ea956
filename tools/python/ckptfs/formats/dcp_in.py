"""Importing a torch.distributed.checkpoint (DCP) directory: each saved
chunk a box shard of its tensor, read through DCP's own reader."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import ckptfs
from ckptfs import InvalidArgumentError, UnsupportedError
from ckptfs.memory import put_value
from ckptfs.pickles import load_dcp_metadata
from ckptfs._streams import RangeReader
from .common import DCP_FILES_BLOB, INTERNAL_BLOBS, STRUCTURE_BLOB, ckptfs_dtype, describe, torch_or_raise
from .torch_in import structure_of_dcp_metadata


# ---- DCP ---------------------------------------------------------------------------

def _dcp_reader(path: str, trust_pickle: bool):
    torch = torch_or_raise()
    try:
        from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # noqa: PLC0415
    except ImportError as e:
        raise UnsupportedError(f"torch {torch.__version__} lacks torch.distributed.checkpoint: {e}") from None
    reader = FileSystemReader(path)
    where = os.path.join(path, ".metadata")
    # Read here rather than by reader.read_metadata(), whose plain
    # pickle.load would run whatever the file names.
    try:
        with open(where, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ckptfs.NotFoundError(f"{where}: {e.strerror}") from None
    try:
        metadata = load_dcp_metadata(data, where, trust=trust_pickle)
    except ckptfs.Error:
        raise
    except Exception as e:  # noqa: BLE001 - what a damaged pickle gives
        raise ckptfs.CorruptionError(f"{where}: cannot read the DCP metadata: {type(e).__name__}: {e}") from None
    if not hasattr(metadata, "state_dict_metadata") or not isinstance(metadata.state_dict_metadata, Mapping):
        raise ckptfs.CorruptionError(f"{where}: not DCP metadata (it holds a {type(metadata).__name__})")
    storage_meta = getattr(torch.distributed.checkpoint.metadata, "StorageMeta", None)
    if storage_meta is not None and hasattr(reader, "load_id"):  # as read_metadata() does
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = storage_meta()
        metadata.storage_meta.load_id = reader.load_id
    return reader, metadata, BytesStorageMetadata


class Directory:
    """The files an import reads from directory `path`. A symbolic link is
    followed only if it resolves inside the directory, or with `follow`;
    each one followed is recorded in `links` (what a dry run lists). A file
    of a kernel filesystem (/proc, /sys), whose size is not what reading it
    gives, is refused."""

    def __init__(self, path: str, follow: bool):
        self.path = path
        self.follow = follow
        self.links: List[Dict[str, str]] = []
        self._linked: set = set()
        self._root = os.path.realpath(path)

    def file(self, full: str) -> str:
        """`full`, a file in the directory, checked; returns it."""
        if os.path.islink(full):
            target = os.path.realpath(full)
            inside = target.startswith(self._root.rstrip(os.sep) + os.sep)
            if not inside and not self.follow:
                raise InvalidArgumentError(
                    f"{full} -> {target}: a symbolic link in {self.path} to a file outside it, refused; import with "
                    "--follow-symlinks (Python: follow_symlinks=True) to take what links point to wherever it is "
                    "(a Hugging Face cache snapshot links to ../../blobs)")
            if full not in self._linked:
                self._linked.add(full)
                self.links.append({"path": full, "target": target})
        if os.path.isfile(full):
            ckptfs._core.check_input_file(full)
        return full

    def others(self, taken) -> Tuple[List[Tuple[str, str]], List[str]]:
        """The regular files of the directory other than the names in
        `taken`, as (name, path); and what is left out: subdirectories,
        hidden files, dangling links, and the files `taken(name)` claims
        (returning why, or None to keep the file)."""
        files, left_out = [], []
        for n in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, n)
            why = taken(n)
            if why == "":
                continue
            if why is None:
                why = ("a hidden file" if n.startswith(".")
                       else "a symbolic link to nothing" if os.path.islink(full) and not os.path.exists(full)
                       else "a directory" if os.path.isdir(full)
                       else "not a regular file" if not os.path.isfile(full) else None)
            if why is not None:
                left_out.append(f"{full} ({why})")
                continue
            files.append((n, self.file(full)))
        return files, left_out


def dcp_plan(path: str, trust_pickle: bool, inputs: "Directory"):
    """What a DCP directory holds, checked against its files: the entries
    of a dry run, the reader, and the other files beside the data (as
    Megatron-Core's common.pt and metadata.json), which become blobs of the
    same names."""
    inputs.file(os.path.join(path, ".metadata"))
    reader, metadata, bytes_type = _dcp_reader(path, trust_pickle)
    entries, blobs = [], []
    storage = getattr(metadata, "storage_data", None) or {}
    files = {getattr(v, "relative_path", None) for v in storage.values()}
    for f in sorted(x for x in files if x):
        norm = os.path.normpath(f)
        if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep):
            raise ckptfs.CorruptionError(f"{path}: the DCP metadata names {f!r}, which is outside the directory")
        if not os.path.isfile(os.path.join(path, f)):
            raise ckptfs.CorruptionError(f"{path}: the DCP metadata names {f}, which is missing")
        inputs.file(os.path.join(path, f))

    def taken(n):
        if n == ".metadata" or n in files:
            return ""  # the checkpoint itself, silently
        if n.endswith(".distcp"):
            return "a .distcp file the .metadata does not name"
        return None

    beside, left_out = inputs.others(taken)
    for n, full in beside:
        if n in metadata.state_dict_metadata or n in INTERNAL_BLOBS:
            raise InvalidArgumentError(f"{path}: the file {n} has the name of an item of the checkpoint")
        blobs.append({"name": n, "bytes": os.path.getsize(full)})
    for n in INTERNAL_BLOBS:
        if n in metadata.state_dict_metadata:
            raise InvalidArgumentError(f"{path}: the checkpoint has an item named {n}, which ckptfs keeps for itself")
    # The nested object DCP flattened (its planner_data), so that exports
    # give it back: dcp_to_torch_save of a DCP export, or a torch export.
    structure = structure_of_dcp_metadata(metadata)
    for fqn, m in metadata.state_dict_metadata.items():
        if isinstance(m, bytes_type):
            blobs.append({"name": fqn, "bytes": 0})
            continue
        dtype = ckptfs_dtype(m.properties.dtype)
        item = m.properties.dtype.itemsize
        total = 1
        for s in m.size:
            total *= int(s)
        entries.append({"name": fqn, "dtype": dtype, "shape": [int(s) for s in m.size], "bytes": total * item,
                        "shards": len(m.chunks)})
    if beside:
        blobs.append({"name": DCP_FILES_BLOB, "bytes": 0})
    if structure is not None:
        blobs.append({"name": STRUCTURE_BLOB, "bytes": 0})
    described = describe(entries, blobs)
    described["left_out"] = left_out
    described["links"] = inputs.links
    return reader, metadata, described, (beside, structure)


class _FileSlice(RangeReader):
    """Bytes [offset, offset + length) of an open file as a seekable stream
    of their own (one DCP item), read without copying the rest."""

    def __init__(self, f, offset: int, length: int):
        super().__init__(length)
        self._f, self._start = f, offset

    def _fill(self, pos: int, out: memoryview) -> int:
        return os.preadv(self._f.fileno(), [out], self._start + pos)


def raw_tensor_at(torch, f, info, dtype, sizes) -> Optional[int]:
    """Where a DCP tensor item's element bytes lie in its open file `f`
    (raw_tensor_in)."""
    return raw_tensor_in(torch, _FileSlice(f, info.offset, info.length), info, dtype, sizes)


def raw_tensor_in(torch, view, info, dtype, sizes) -> Optional[int]:
    """Where a DCP tensor item's element bytes lie in its file, given the
    item's bytes as a seekable stream `view`, or None when they cannot be
    taken as they are. A FileSystemWriter item is a torch.save archive of
    one tensor; torch.load with map_location="meta" reads its pickle
    (torch's reader) but not its data, and gives the record's offset in the
    archive. Only a contiguous tensor filling its storage, with the dtype
    and sizes the metadata states, saved without a transform (compression)
    and in little-endian order, is taken."""
    if getattr(info, "transform_descriptors", None) or sys.byteorder != "little":
        return None
    try:
        archive = torch._C.PyTorchFileReader(view)
        for record in archive.get_all_records():
            if record.endswith("byteorder") and archive.get_record(record) != b"little":
                return None
        view.seek(0)
        t = torch.load(view, map_location="meta", weights_only=True)
    except Exception:  # noqa: BLE001 - not the layout expected: torch's own path reads (and reports) it
        return None
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(sizes):
        return None
    storage = t.untyped_storage()
    at = getattr(storage, "_checkpoint_offset", None)
    nbytes = t.numel() * t.element_size()
    if (not isinstance(at, int) or not t.is_contiguous() or t.storage_offset() != 0 or storage.nbytes() != nbytes
            or at < 0 or at + nbytes > info.length):
        return None
    return info.offset + at


def import_dcp(writer, path: str, reader, metadata, advance: Callable[[int], None]) -> None:
    """Puts every saved chunk of a DCP directory as a box shard of its
    tensor, and every non-tensor item as a blob. Chunks whose bytes lie raw
    in their file (FileSystemWriter's layout) are put straight from a
    mapping of the file, which the engine's threads hash and encode in
    parallel; anything else is read through FileSystemReader.read_data."""

    torch = torch_or_raise()
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex  # noqa: PLC0415
    from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner,  # noqa: PLC0415
                                                      ReadItem)

    kept: list = []
    storage_data = getattr(metadata, "storage_data", None) or {}

    def box(fqn, offsets):
        m = metadata.state_dict_metadata[fqn]
        return ckptfs.Box(tuple(int(s) for s in m.size), tuple(int(o) for o in offsets))

    # Chunks put straight from their files, in file order; the rest below.
    direct, rest = [], []
    for fqn, m in metadata.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            rest.append((fqn, None, None))
            continue
        for i, chunk in enumerate(m.chunks):
            idx = MetadataIndex(fqn, chunk.offsets, i)
            info = storage_data.get(idx)
            if info is None:
                rest.append((fqn, i, chunk))
            else:
                direct.append((info.relative_path, info.offset, fqn, i, chunk, info))
    direct.sort(key=lambda d: (d[0], d[1]))
    files: Dict[str, Any] = {}
    sizes: Dict[str, int] = {}
    try:
        for rel, _off, fqn, _i, _chunk, info in direct:
            if rel not in files:
                files[rel] = open(os.path.join(path, rel), "rb")  # noqa: SIM115 - closed below
                sizes[rel] = os.fstat(files[rel].fileno()).st_size
            if info.offset + info.length > sizes[rel]:
                raise ckptfs.CorruptionError(f"{path}: cannot read the DCP data: {rel} ends before the item of "
                                             f"'{fqn}' at offset {info.offset} ({info.length} bytes); "
                                             "the file is truncated")

        def numel(chunk):
            n = 1
            for s in chunk.sizes:
                n *= int(s)
            return n

        def probe(d):
            rel, _off, fqn, _i, chunk, info = d
            dtype = metadata.state_dict_metadata[fqn].properties.dtype
            return raw_tensor_at(torch, files[rel], info, dtype, chunk.sizes) if numel(chunk) else None

        # Each item's layout is found (torch.load of its pickle, small reads)
        # one item ahead. The engine maps each file once and its threads
        # hash and encode the bytes in place, keeping the mapping while they
        # work: a put returns at once and the next one keeps them busy.
        ahead = ThreadPoolExecutor(max_workers=1)
        try:
            for d, at in zip(direct, ahead.map(probe, direct)):
                rel, _off, fqn, i, chunk, _info = d
                if at is None:
                    rest.append((fqn, i, chunk))
                    continue
                dtype = metadata.state_dict_metadata[fqn].properties.dtype
                nbytes = numel(chunk) * dtype.itemsize
                b = box(fqn, chunk.offsets)
                writer.put_file(fqn, ckptfs_dtype(dtype), list(b.global_shape), "box",
                                [int(s) for s in chunk.sizes], list(b.offsets), 0, os.path.join(path, rel), at,
                                nbytes)
                advance(nbytes)
        finally:
            ahead.shutdown(wait=True, cancel_futures=True)
    finally:
        for f in files.values():
            f.close()
    if not rest:
        return

    class ChunkPlanner(LoadPlanner):
        """Reads the remaining items whole, as they were saved, and puts
        them: tensor chunks as box shards, bytes as blobs."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            pass

        def create_local_plan(self):
            items = []
            for fqn, i, chunk in rest:
                if chunk is None:
                    idx = MetadataIndex(fqn)
                    items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=idx, dest_offsets=torch.Size([]),
                                          storage_index=idx, storage_offsets=torch.Size([]),
                                          lengths=torch.Size([])))
                    continue
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
            put_value(writer, read_item.dest_index.fqn, value.read(), None, False, kept)

        def resolve_tensor(self, read_item):
            m = metadata.state_dict_metadata[read_item.dest_index.fqn]
            return torch.empty(tuple(read_item.lengths), dtype=m.properties.dtype)

        def commit_tensor(self, read_item, tensor):
            fqn = read_item.dest_index.fqn
            put_value(writer, fqn, tensor.contiguous(), box(fqn, read_item.dest_index.offset), True, kept)
            advance(tensor.nbytes)

    planner = ChunkPlanner()
    plan = planner.create_local_plan()
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(plan)
    try:
        reader.read_data(plan, planner).wait()
    except ckptfs.Error:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or damaged .distcp file, as torch reports it
        raise ckptfs.CorruptionError(f"{path}: cannot read the DCP data: {type(e).__name__}: {e}") from None
