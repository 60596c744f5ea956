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
  plain containers and numbers: tensors are stored under their keys and
  indexes joined with ``.`` (dicts with str or int keys, lists and tuples
  holding tensors are walked), other parts as blobs, and the whole shape
  as the blob ``ckptfs.torch.structure``.
- a Hugging Face model directory whose weights are ``torch.save`` files
  (``pytorch_model.bin``, or the shards ``pytorch_model.bin.index.json``
  names, as transformers wrote them before safetensors), read with
  ``torch.load(weights_only=True)``: each tensor under its name, checked
  against the index, and the directory's other files (config, tokenizer)
  as blobs of the same names, as for safetensors model directories.
- safetensors files and Hugging Face model directories with safetensors
  weights go to the engine's own importer
  (``Repository.import_safetensors``).

``python -m ckptfs.formats import NAME PATH`` is what ``ckpt import`` runs
for the formats that need torch.
"""

from __future__ import annotations

import argparse
import io
import json
import hashlib
import os
import shutil
import stat
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import ckptfs
from ckptfs import InvalidArgumentError, UnsupportedError
from ckptfs.memory import NAME_TO_TORCH, TORCH_TO_NAME, put_value, read_value, torch_module
from ckptfs.pickles import load_dcp_metadata

__all__ = ["detect", "import_checkpoint", "export_checkpoint", "parse_size", "STRUCTURE_BLOB", "DCP_FILES_BLOB",
           "PARTIAL_SUFFIX"]

# An export in progress writes into OUT + PARTIAL_SUFFIX, renamed to OUT
# once complete and durable; a rerun resumes it.
PARTIAL_SUFFIX = ".ckpt-export-partial"
_PROGRESS_FILE = ".ckptfs-export.json"

# The blob holding a torch.save file's dict shape (import_torch).
STRUCTURE_BLOB = "ckptfs.torch.structure"
# The blob naming the blobs that were files beside a DCP directory's data
# (Megatron-Core's common.pt and metadata.json): a DCP export writes them
# back as files.
DCP_FILES_BLOB = "ckptfs.dcp.files"
_INTERNAL_BLOBS = (STRUCTURE_BLOB, DCP_FILES_BLOB)

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
        raise UnsupportedError("this format is read with torch, which is not installed here: it needs "
                               "pip install 'ckptfs[torch]', or the torch build your training uses (CPU or its CUDA "
                               "release) in this environment") from None
    return torch


def _describe(entries: List[Dict[str, Any]], blobs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"tensors": entries, "blobs": blobs,
            "tensor_bytes": sum(e["bytes"] for e in entries), "blob_bytes": sum(b["bytes"] for b in blobs)}


def _dtype_name(dtype) -> str:
    torch_module()  # fills the tables
    name = TORCH_TO_NAME.get(dtype)
    if name is None:
        raise UnsupportedError(f"torch dtype {dtype} has no ckptfs dtype")
    return name


# ---- DCP ---------------------------------------------------------------------------

def _dcp_reader(path: str, trust_pickle: bool):
    torch = _torch()
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


class _Directory:
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


def _dcp_plan(path: str, trust_pickle: bool, inputs: "_Directory"):
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
        if n in metadata.state_dict_metadata or n in _INTERNAL_BLOBS:
            raise InvalidArgumentError(f"{path}: the file {n} has the name of an item of the checkpoint")
        blobs.append({"name": n, "bytes": os.path.getsize(full)})
    for n in _INTERNAL_BLOBS:
        if n in metadata.state_dict_metadata:
            raise InvalidArgumentError(f"{path}: the checkpoint has an item named {n}, which ckptfs keeps for itself")
    # The nested object DCP flattened (its planner_data), so that exports
    # give it back: dcp_to_torch_save of a DCP export, or a torch export.
    structure = structure_of_dcp_metadata(metadata)
    for fqn, m in metadata.state_dict_metadata.items():
        if isinstance(m, bytes_type):
            blobs.append({"name": fqn, "bytes": 0})
            continue
        dtype = _dtype_name(m.properties.dtype)
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
    described = _describe(entries, blobs)
    described["left_out"] = left_out
    described["links"] = inputs.links
    return reader, metadata, described, (beside, structure)


class _FileSlice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a seekable stream
    of their own (one DCP item), read without copying the rest."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._f.fileno(), [memoryview(b)[:n]], self._start + self._pos)
        self._pos += got
        return got


def _raw_tensor_at(torch, f, info, dtype, sizes) -> Optional[int]:
    """Where a DCP tensor item's element bytes lie in its file, or None when
    they cannot be taken as they are. A FileSystemWriter item is a torch.save
    archive of one tensor; torch.load with map_location="meta" reads its
    pickle (torch's reader) but not its data, and gives the record's offset
    in the archive. Only a contiguous tensor filling its storage, with the
    dtype and sizes the metadata states, saved without a transform
    (compression) and in little-endian order, is taken."""
    if getattr(info, "transform_descriptors", None) or sys.byteorder != "little":
        return None
    view = _FileSlice(f, info.offset, info.length)
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


def _import_dcp(writer, path: str, reader, metadata, advance: Callable[[int], None]) -> None:
    """Puts every saved chunk of a DCP directory as a box shard of its
    tensor, and every non-tensor item as a blob. Chunks whose bytes lie raw
    in their file (FileSystemWriter's layout) are put straight from a
    mapping of the file, which the engine's threads hash and encode in
    parallel; anything else is read through FileSystemReader.read_data."""

    torch = _torch()
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
            return _raw_tensor_at(torch, files[rel], info, dtype, chunk.sizes) if numel(chunk) else None

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
                writer.put_file(fqn, _dtype_name(dtype), list(b.global_shape), "box",
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


# ---- torch.save ----------------------------------------------------------------------

class _Progress:
    """Progress lines on stderr, as the ckpt command draws them: on a
    terminal one line redrawn 5 times a second ("label:  42.0% (1.2 GiB of
    2.9 GiB, 610.3 MiB/s, 3 s left)"), elsewhere a line a second; "json"
    gives one object a line; "off" nothing; "auto" is "on" on a terminal."""

    def __init__(self, label: str, mode: str = "auto"):
        import time  # noqa: PLC0415

        self._time = time.monotonic
        self.label, self.terminal = label, sys.stderr.isatty()
        self.mode = ("on" if self.terminal else "off") if mode == "auto" else mode
        self.start = self.last = self._time()
        self.done = self.total = 0
        self.drawn = False
        self._lock = threading.Lock()

    @staticmethod
    def human(n: float) -> str:
        units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
        u = 0
        while n >= 1024 and u < len(units) - 1:
            n /= 1024
            u += 1
        return f"{int(n)} B" if u == 0 else f"{n:.1f} {units[u]}"

    def __call__(self, done: int, total: int) -> None:
        if self.mode == "off":
            return
        with self._lock:  # exports finish files on several threads
            self.done, self.total = done, total
            now = self._time()
            if done < total and now - self.last < (0.2 if self.mode == "on" and self.terminal else 1.0):
                return
            self.last = now
            self._draw(False)

    def _draw(self, final: bool) -> None:
        seconds = self._time() - self.start
        rate = self.done / seconds if seconds > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 and self.total > self.done else 0.0
        if self.mode == "json":
            print(json.dumps({"progress": self.label, "done_bytes": self.done, "total_bytes": self.total,
                              "bytes_per_second": round(rate), "eta_seconds": round(eta, 1),
                              "elapsed_seconds": round(seconds, 1), "finished": final}), file=sys.stderr, flush=True)
            return
        pct = 100.0 * self.done / self.total if self.total else 100.0
        tail = f", {eta:.0f} s left" if not final and rate > 0 and self.done < self.total else ""
        line = (f"{self.label}: {pct:5.1f}% ({self.human(self.done)} of {self.human(self.total)}, "
                f"{self.human(rate)}/s{tail})")
        print(("\r" + line + "\033[K") if self.terminal else line, end="" if self.terminal else "\n",
              file=sys.stderr, flush=True)
        self.drawn = True

    def finish(self) -> None:
        if self.mode == "json" and (self.done or self.total):
            self._draw(True)
        elif self.mode == "on" and self.terminal and self.drawn:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def _holds_tensor(obj, torch) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensor(v, torch) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v, torch) for v in obj)
    return False


def _flatten(obj, prefix: str, tensors: Dict[str, Any], others: Dict[str, Any], torch) -> Any:
    """The structure of `obj` (JSON), its tensors and other leaves by key.
    Dicts (str or int keys: an optimizer's state is keyed by parameter
    index), lists and tuples that hold tensors are walked, their entries
    named by key or index joined with "."; anything else, such as an
    optimizer's param_groups, is one leaf."""
    def leaf(into: Dict[str, Any]) -> None:
        if prefix in tensors or prefix in others or prefix == STRUCTURE_BLOB:
            raise InvalidArgumentError(f"two entries flatten to the name '{prefix}'")
        into[prefix] = obj

    if isinstance(obj, torch.Tensor):
        leaf(tensors)
        return {"tensor": prefix}
    walk = not prefix or _holds_tensor(obj, torch)
    if walk and isinstance(obj, Mapping):
        node = {"dict": []}
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise InvalidArgumentError(f"key {k!r} under '{prefix}' is a {type(k).__name__}; only str and int "
                                           "keys are kept")
            key = f"{prefix}.{k}" if prefix else str(k)
            node["dict"].append([k, _flatten(v, key, tensors, others, torch)])
        return node
    if walk and isinstance(obj, (list, tuple)) and prefix:
        kind = "list" if isinstance(obj, list) else "tuple"
        return {kind: [_flatten(v, f"{prefix}.{i}", tensors, others, torch) for i, v in enumerate(obj)]}
    leaf(others)
    return {"value": prefix}


def _unflatten(node, tensor: Callable[[str], Any], value: Callable[[str], Any]) -> Any:
    """The object _flatten described, its leaves given by `tensor` and `value`."""
    if "dict" in node:
        return {k: _unflatten(child, tensor, value) for k, child in node["dict"]}
    if "list" in node:
        return [_unflatten(child, tensor, value) for child in node["list"]]
    if "tuple" in node:
        return tuple(_unflatten(child, tensor, value) for child in node["tuple"])
    if "tensor" in node:
        return tensor(node["tensor"])
    return value(node["value"])


def structure_of_dcp_metadata(metadata: Any) -> Optional[Dict[str, Any]]:
    """The nested object a DCP save flattened (its Metadata's planner_data),
    as STRUCTURE_BLOB keeps it, or None when the metadata does not say."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # noqa: PLC0415

    paths = getattr(metadata, "planner_data", None)
    items = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(paths, Mapping) or not isinstance(items, Mapping) or set(paths) != set(items):
        return None
    return _structure_of_paths(paths, {k for k, m in items.items() if not isinstance(m, BytesStorageMetadata)})


def _structure_of_paths(paths: Any, tensors: set) -> Optional[Dict[str, Any]]:
    """The structure (as _flatten describes one) of items at these object
    paths: a DCP checkpoint's planner_data, {fqn: (key or index, ...)},
    where an integer indexes a list as DCP's unflatten_state_dict builds
    it. None where the paths are missing or do not form one object."""
    if not isinstance(paths, Mapping) or not paths:
        return None
    root: Dict[Any, Any] = {}
    for fqn, path in paths.items():
        if (not isinstance(path, tuple) or not path or not isinstance(path[0], str)
                or not all(isinstance(c, (str, int)) and not isinstance(c, bool) for c in path)):
            return None
        node = root
        for i, c in enumerate(path):
            last = i == len(path) - 1
            if not isinstance(node, dict) or ("kind" in node and node["kind"] != type(c)):
                return None
            node["kind"] = type(c)
            children = node.setdefault("children", {})
            if last:
                if c in children:
                    return None
                children[c] = {"leaf": fqn}
            else:
                child = children.setdefault(c, {})
                if "leaf" in child:
                    return None
                node = child

    def build(node):
        if "leaf" in node:
            return {"tensor" if node["leaf"] in tensors else "value": node["leaf"]}
        children = node["children"]
        if node["kind"] is int:
            if sorted(children) != list(range(len(children))):
                return None
            items = [build(children[i]) for i in range(len(children))]
            return None if any(x is None for x in items) else {"list": items}
        items = [[k, build(v)] for k, v in children.items()]
        return None if any(x is None for _, x in items) else {"dict": items}

    return build(root)


def _paths_of_structure(structure: Dict[str, Any]) -> Dict[str, tuple]:
    """{name: object path} of the tensors and values a structure holds."""
    out: Dict[str, tuple] = {}

    def walk(node, path):
        if "dict" in node:
            for k, child in node["dict"]:
                walk(child, path + (k,))
        elif "list" in node or "tuple" in node:
            for i, child in enumerate(node.get("list", node.get("tuple"))):
                walk(child, path + (i,))
        else:
            out[node.get("tensor", node.get("value"))] = path

    walk(structure, ())
    return out


def _load_dict(torch, path: str, what: str) -> Mapping:
    """torch.load(weights_only=True) of the file at `path`, mapped where it
    is a zip archive, which must hold a dict (`what` names one)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
    except Exception as e:  # noqa: BLE001 - torch's refusal (weights_only) or a damaged file
        raise ckptfs.CorruptionError(f"{path}: torch.load(weights_only=True) cannot read it: "
                                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(f"{path}: holds a {type(state).__name__}, not {what}")
    return state


def _torch_plan(path: str):
    torch = _torch()
    ckptfs._core.check_input_file(path)
    state = _load_dict(torch, path, "a state dict")
    tensors: Dict[str, Any] = {}
    others: Dict[str, Any] = {}
    try:
        structure = _flatten(state, "", tensors, others, torch)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{path}: {e}") from None
    entries = [{"name": k, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                "bytes": t.numel() * t.element_size()} for k, t in tensors.items()]
    blobs = [{"name": k, "bytes": 0} for k in others] + [{"name": STRUCTURE_BLOB, "bytes": 0}]
    return (tensors, others, structure), _describe(entries, blobs)


# A model directory's weights as torch.save files (transformers before
# safetensors); the engine's IsTorchWeightsFileName names the same files.
_TORCH_WEIGHTS_INDEX = "pytorch_model.bin.index.json"
# Blobs are written out in pieces of this size (export).
_BLOB_PIECE = 64 << 20


def _is_torch_weights_name(name: str) -> bool:
    return name.startswith("pytorch_model") and (name.endswith(".bin") or name == _TORCH_WEIGHTS_INDEX)


def _holds_torch_weights_only(path: str) -> bool:
    """Whether directory `path` holds torch.save weight files and no
    *.safetensors (with safetensors, those are imported and these left out)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return not any(n.endswith(".safetensors") for n in names) and any(_is_torch_weights_name(n) for n in names)


def _load_weights_file(torch, path: str, where: Dict[str, str], tensors: Dict[str, Any]) -> None:
    """The tensors of one torch.save weights file of a model directory."""
    name = os.path.basename(path)
    state = _load_dict(torch, path, "a dict of weights")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; a model's "
                                       "weights file holds tensors only (import other torch.save files alone)")
        if key in where:
            raise InvalidArgumentError(f"{os.path.dirname(path)}: tensor '{key}' is in both {where[key]} and {name}")
        where[key] = name
        tensors[key] = value


def _hf_torch_plan(path: str, inputs: "_Directory"):
    """A model directory whose weights are torch.save files: its tensors,
    checked against pytorch_model.bin.index.json when there is one, and its
    other regular files as blobs (subdirectories and hidden files left out)."""
    torch = _torch()
    weight_map = None
    index_path = os.path.join(path, _TORCH_WEIGHTS_INDEX)
    if os.path.isfile(index_path):
        inputs.file(index_path)
        try:
            with open(index_path, "rb") as f:
                index = json.loads(f.read(64 << 20))
        except (OSError, ValueError) as e:
            raise ckptfs.CorruptionError(f"{index_path}: cannot read the weights index: {e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ckptfs.CorruptionError(f"{index_path}: no \"weight_map\" object of file names")
        for f in sorted(set(weight_map.values())):
            if f != os.path.basename(f) or f.startswith(".") or not os.path.isfile(os.path.join(path, f)):
                raise ckptfs.CorruptionError(f"{index_path} names shard {f}, which is missing")
    files: List[str] = []  # the weights files, in name order

    def weights(n):
        if not _is_torch_weights_name(n):
            return None
        if n.endswith(".bin") and os.path.isfile(os.path.join(path, n)):
            files.append(inputs.file(os.path.join(path, n)))
        return ""  # neither a blob nor left out

    blob_files, left_out = inputs.others(weights)
    if not files:
        raise ckptfs.CorruptionError(f"{path}: holds {_TORCH_WEIGHTS_INDEX} but no pytorch_model*.bin weights file")
    where: Dict[str, str] = {}
    tensors: Dict[str, Any] = {}
    for f in files:
        _load_weights_file(torch, f, where, tensors)
    if weight_map is not None:
        for key, f in weight_map.items():
            if key not in where:
                raise ckptfs.CorruptionError(f"{index_path} names tensor '{key}' (in {f}), which no weights file holds")
            if where[key] != f:
                raise ckptfs.CorruptionError(f"{index_path} places tensor '{key}' in {f}, but it is in {where[key]}")
        for key, f in where.items():
            if key not in weight_map:
                raise ckptfs.CorruptionError(f"{index_path} does not name tensor '{key}' of {f}")
    blobs = [{"name": n, "bytes": os.path.getsize(full)} for n, full in blob_files]
    entries = [{"name": k, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                "bytes": t.numel() * t.element_size()} for k, t in tensors.items()]
    described = _describe(entries, blobs)
    described["left_out"] = left_out
    described["links"] = inputs.links
    return (tensors, blob_files), described


def _put_files(writer, files: List[Tuple[str, str]]) -> None:
    """Puts each (name, path) file whole as a blob of that name, from a
    mapping of the file (a trainer's optimizer.pt may be many GB), which the
    put consumes before it returns."""
    import mmap  # noqa: PLC0415

    for n, full in files:
        with open(full, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                writer.put_blob(n, b"")
                continue
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                m.madvise(mmap.MADV_SEQUENTIAL)
                writer.put_blob(n, m)


def _write_blob(reader, blob: str, size: int, f) -> None:
    """Writes blob `blob` (`size` bytes) to file `f` in pieces, through one
    buffer: a blob may be larger than memory would like."""
    buf = bytearray(min(size, _BLOB_PIECE))
    view = memoryview(buf)
    at = 0
    while at < size:
        n = min(len(buf), size - at)
        reader.read_blob(blob, at, view[:n])
        f.write(view[:n])
        at += n


def _import_hf_torch(writer, loaded, advance: Callable[[int], None]) -> None:
    tensors, blob_files = loaded
    kept: list = []
    for key, t in tensors.items():
        put_value(writer, key, t.detach().contiguous(), None, False, kept)
        advance(t.numel() * t.element_size())
    _put_files(writer, blob_files)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _ZIP_MAGIC


def _import_torch(writer, loaded, advance: Callable[[int], None]) -> None:
    torch = _torch()
    import io  # noqa: PLC0415

    tensors, others, structure = loaded
    kept: list = []
    for key, t in tensors.items():
        put_value(writer, key, t.detach().contiguous(), None, False, kept)
        advance(t.numel() * t.element_size())
    for key, v in others.items():
        buf = io.BytesIO()
        torch.save(v, buf)
        put_value(writer, key, buf.getvalue(), None, False, kept)
    put_value(writer, STRUCTURE_BLOB, json.dumps(structure).encode(), None, False, kept)


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
    torch_weights = fmt == "hf" and os.path.isdir(path) and _holds_torch_weights_only(path)
    if fmt in ("safetensors", "hf") and not torch_weights:
        if dry_run:
            described = repo._repo.describe_import([path], [], follow_symlinks)
            return {"format": fmt, "name": name, **described, "committed": False}
        summary = repo.import_safetensors(name, [path], step=step, tags=tags, follow_symlinks=follow_symlinks,
                                          overwrite=overwrite)
        return {"format": fmt, "name": name, "committed": True, "summary": summary}
    if fmt == "dcp":
        reader, metadata, described, (beside, structure) = _dcp_plan(path, trust_pickle,
                                                                     _Directory(path, follow_symlinks))
    elif torch_weights:
        loaded, described = _hf_torch_plan(path, _Directory(path, follow_symlinks))
    elif fmt == "torch":
        loaded, described = _torch_plan(path)
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
                              compress_every_chunk=fmt == "dcp" and _on_the_repositorys_disk(repo, path),
                              overwrite=overwrite)
    try:
        if fmt == "dcp":
            _import_dcp(writer, path, reader, metadata, advance)
            if beside:
                _put_files(writer, beside)
                writer.put_blob(DCP_FILES_BLOB, json.dumps([n for n, _ in beside]).encode())
            if structure is not None:
                writer.put_blob(STRUCTURE_BLOB, json.dumps(structure).encode())
        elif torch_weights:
            _import_hf_torch(writer, loaded, advance)
        else:
            _import_torch(writer, loaded, advance)
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


def _on_the_repositorys_disk(repo: "ckptfs.Repository", path: PathLike) -> bool:
    """Whether `path` is on the file system of `repo`, a local repository."""
    root = repo.path
    if "://" in root:
        return False
    try:
        return os.stat(path).st_dev == os.stat(root).st_dev
    except OSError:
        return False


# ---- export ------------------------------------------------------------------------

def parse_size(text: Union[str, int]) -> int:
    """"5GB", "500MB", "2GiB", "1000000" -> bytes (HF's units: KB, MB, GB
    are powers of 1000; KiB, MiB, GiB of 1024)."""
    if isinstance(text, int):
        return text
    t = str(text).strip()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, mult in units.items():
        if t.upper().endswith(unit):
            number = t[: -len(unit)].strip()
            break
    else:
        number, mult = t, 1
    try:
        value = float(number) * mult
    except ValueError:
        raise InvalidArgumentError(f"bad size '{text}' (a number with KB, MB, GB, KiB, MiB or GiB)") from None
    if value < 1:
        raise InvalidArgumentError(f"size '{text}' must be at least 1 byte")
    return int(value)


def _write_files(write: Callable[[int], None], count: int, threads: int) -> None:
    """Runs write(i) for i in range(count) on `threads` threads. Once one
    fails no further file is started (those being written finish) and the
    first error is raised: an interrupted export stops where it failed,
    and a rerun resumes from the files it finished."""
    failed = threading.Event()

    def one(i: int) -> None:
        if failed.is_set():
            return
        try:
            write(i)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(max(1, int(threads))) as pool:
        for _ in pool.map(one, range(count)):
            pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Digesting:
    """A file being written, hashed (SHA-256) as it is: the digest of
    what an export wrote, taken while the bytes are in cache."""

    def __init__(self, f):
        self._f = f
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        n = self._f.write(data)  # a buffered file writes everything: n is every byte
        view = memoryview(data).cast("B")
        self.digest.update(view if n is None else view[:n])
        self.size += view.nbytes if n is None else n
        return n

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()


def _write_durable(path: str, write) -> Tuple[int, str]:
    """Writes a file through `write(f)` at path + ".tmp" (never following a
    symbolic link there), fsyncs it and renames it into place; returns its
    size and SHA-256."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with open(fd, "wb") as f:
        out = _Digesting(f)
        write(out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return out.size, out.digest.hexdigest()


def _file_digest(path: str) -> Tuple[int, str]:
    """The size and SHA-256 of the regular file at `path` (no symbolic link
    followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        digest = hashlib.sha256()
        size = 0
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def hf_shards(sizes: Sequence[Tuple[str, int]], max_shard_size: int) -> List[List[str]]:
    """Tensors (name, bytes), in order, split as Hugging Face splits a state
    dict (huggingface_hub's split_torch_state_dict_into_shards): a tensor
    joins the current shard unless that would pass max_shard_size; a tensor
    larger than that is a shard of its own."""
    shards: List[List[str]] = []
    current: List[str] = []
    size = 0
    for name, n in sizes:
        if n > max_shard_size:
            shards.append([name])
            continue
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


class _Export:
    """One export into OUT + PARTIAL_SUFFIX: which files are finished.

    The partial directory is this export's own: made exclusively, owner
    only (0700), and held open, so that every file is written into that
    directory whatever happens to the name meanwhile. One found there
    already is resumed only if this user owns it, nobody else can write
    it, its recorded settings match, and each finished file still has the
    size and SHA-256 recorded when it was finished; a file that does not
    is written again. On commit the directory gets the mode a new one
    would (0777 less the umask) and is renamed to OUT."""

    def __init__(self, out: str, settings: Dict[str, Any], clean: bool):
        self.out = out
        self.partial = out.rstrip("/") + PARTIAL_SUFFIX
        if os.path.lexists(out):
            raise ckptfs.AlreadyExistsError(f"{out} exists; exports never replace anything")
        if clean and os.path.lexists(self.partial):
            if os.path.islink(self.partial) or not os.path.isdir(self.partial):
                os.unlink(self.partial)
            else:
                shutil.rmtree(self.partial)
        created = False
        try:
            os.mkdir(self.partial, 0o700)
            created = True
        except FileExistsError:
            pass
        try:
            self._fd = os.open(self.partial, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ckptfs.AlreadyExistsError(
                f"{self.partial} is not a directory an export made ({e.strerror}); remove it, or rerun with "
                "--clean") from None
        st = os.fstat(self._fd)
        if created:
            os.fchmod(self._fd, 0o700)
        elif st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(self._fd)
            raise ckptfs.AlreadyExistsError(
                f"{self.partial} was not made by an export of this user (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}); it is not resumed: remove it, or rerun with --clean")
        # Paths through the open directory: renaming or replacing the
        # partial's name meanwhile changes nothing written here.
        self._dir = f"/proc/self/fd/{self._fd}"
        self.progress_file = os.path.join(self._dir, _PROGRESS_FILE)
        self.done: List[str] = []
        self.items: Dict[str, Any] = {}  # what a finished file holds, where the format needs it
        self.digests: Dict[str, List[Any]] = {}  # finished file -> [size, sha256]
        self.redone: List[str] = []  # finished files that failed their check on resume
        if not created:
            try:
                fd = os.open(self.progress_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with open(fd) as f:
                    state = json.load(f)
            except (OSError, ValueError):
                state = None
            if not isinstance(state, dict) or state.get("settings") != settings:
                os.close(self._fd)
                raise ckptfs.AlreadyExistsError(
                    f"{self.partial} holds an interrupted export of something else (another checkpoint, format or "
                    "options); rerun with the same ones to resume it, or with --clean to remove it")
            digests = state.get("digests", {})
            items = state.get("items", {})
            for name in state.get("done", []):
                if self._intact(name, digests.get(name)):
                    self.done.append(name)
                    self.digests[name] = digests[name]
                    if name in items:
                        self.items[name] = items[name]
                else:
                    self.redone.append(name)
        self.settings = settings
        self._lock = threading.Lock()
        self._save()

    def _intact(self, name: str, recorded: Any) -> bool:
        if (not isinstance(name, str) or not name or "/" in name or name in (".", "..")
                or not isinstance(recorded, list) or len(recorded) != 2):
            return False
        try:
            return list(_file_digest(self.path(name))) == recorded
        except OSError:
            return False

    def _save(self) -> None:
        data = json.dumps({"settings": self.settings, "done": self.done, "items": self.items,
                           "digests": self.digests}).encode()
        _write_durable(self.progress_file, lambda f: f.write(data))

    def path(self, name: str) -> str:
        return os.path.join(self._dir, name)

    def write(self, name: str, body, items: Any = None) -> None:
        """Writes file `name` through body(f), durably, and records it as
        finished."""
        self.finished(name, items, _write_durable(self.path(name), body))

    def finished(self, name: str, items: Any = None, digest: Optional[Tuple[int, str]] = None) -> None:
        if digest is None:
            digest = _file_digest(self.path(name))
        with self._lock:  # files are finished by several threads
            self.done.append(name)
            self.digests[name] = list(digest)
            if items is not None:
                self.items[name] = items
            self._save()

    def commit(self) -> None:
        here, st = os.lstat(self.partial), os.fstat(self._fd)
        if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
            raise ckptfs.StorageError(f"{self.partial} was replaced by another directory while the export ran; "
                                      "nothing was published")
        os.unlink(self.progress_file)
        os.fchmod(self._fd, 0o777 & ~_umask())
        os.fsync(self._fd)
        os.rename(self.partial, self.out)
        os.close(self._fd)
        _fsync_dir(os.path.dirname(os.path.abspath(self.out)))


# Exports write a tensor this many bytes at a time, through two buffers they
# reuse: one read from the repository while the other is written.
_EXPORT_PIECE = 16 << 20


class _TensorStream:
    """Writes whole tensors of a checkpoint to a file piece by piece, the
    next piece read on a helper thread while this one is written: memory
    stays two pieces (and a third to cast into) whatever the tensor, and no
    buffer is allocated per tensor or piece (a first touch of fresh pages is
    what costs on a busy host)."""

    def __init__(self, reader):
        import concurrent.futures  # noqa: PLC0415

        torch = _torch()
        self.reader = reader
        self.buffers = [torch.empty(_EXPORT_PIECE, dtype=torch.uint8) for _ in range(2)]
        self.cast_buffer = None  # made by the first cast
        self.ahead = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def close(self) -> None:
        self.ahead.shutdown(wait=True)

    def _read(self, name: str, dtype, shape, start: int, count: int, buf):
        read_value(self.reader, name, buf[:count * dtype.itemsize].view(dtype), ckptfs.Flat(shape, start))

    def write(self, f, name: str, stored, out, shape) -> None:
        """Writes tensor `name` (held as dtype `stored`, of `shape`) to `f`
        row-major as dtype `out`."""
        torch = _torch()
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel == 0:
            return
        if out != stored and self.cast_buffer is None:
            self.cast_buffer = torch.empty(_EXPORT_PIECE, dtype=torch.uint8)
        # Elements a piece: the wider of the two element sizes fits a buffer.
        per = max(1, _EXPORT_PIECE // max(stored.itemsize, out.itemsize))
        pieces = [(start, min(per, numel - start)) for start in range(0, numel, per)]
        pending = self.ahead.submit(self._read, name, stored, tuple(shape), *pieces[0], self.buffers[0])
        for k, (_start, count) in enumerate(pieces):
            pending.result()
            data = self.buffers[k % 2][:count * stored.itemsize]
            if k + 1 < len(pieces):
                pending = self.ahead.submit(self._read, name, stored, tuple(shape), *pieces[k + 1],
                                            self.buffers[(k + 1) % 2])
            if out != stored:
                cast = self.cast_buffer[:count * out.itemsize]
                cast.view(out).copy_(data.view(stored))
                data = cast
            f.write(memoryview(data.numpy()))


def _safetensors_header(tensors: Sequence[Tuple[str, Any, Sequence[int]]], metadata: Mapping[str, str]) -> bytes:
    """The header of a safetensors file of `tensors` (name, torch dtype,
    shape), in that order."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, dtype, shape in tensors:
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        header[key] = {"dtype": _dtype_name(dtype), "shape": [int(d) for d in shape],
                       "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _read_tensor(reader, name: str, cast=None):
    torch = _torch()
    torch_module()
    dtype_name, shape = reader.tensor_info(name)
    dtype = NAME_TO_TORCH.get(dtype_name)
    if dtype is None:
        raise UnsupportedError(f"tensor '{name}' is {dtype_name}, which torch {torch.__version__} lacks")
    out = torch.empty(tuple(shape), dtype=dtype)
    read_value(reader, name, out, None)
    if cast is not None and out.is_floating_point() and out.dtype != cast:
        out = out.to(cast)
    return out


def _structure(repo, name: str, shown) -> Optional[Dict[str, Any]]:
    """The dict shape a torch.save file had (its STRUCTURE_BLOB), or None."""
    if STRUCTURE_BLOB not in {b["name"] for b in shown["blobs"]}:
        return None
    return json.loads(repo.blob(name, STRUCTURE_BLOB))


def _tensor_order(structure: Optional[Dict[str, Any]], names: List[str]) -> List[str]:
    """The checkpoint's tensors in the order their source had, where it
    said (a torch.save file's structure), else by name."""
    if structure is not None:
        order: List[str] = []
        _unflatten(structure, order.append, lambda _name: None)
        if sorted(order) == sorted(names):
            return order
    return names


def _model_order(repo, name: str, shown, names: List[str]) -> Optional[List[str]]:
    """The state-dict order of the model that the checkpoint's config.json
    blob describes, when transformers is importable and knows its
    architecture: the model is built on the meta device (no memory, no
    weights) and its state_dict() keys kept where the checkpoint has them.
    save_pretrained splits shards in this order; None when it cannot be
    had or does not cover the checkpoint's tensors."""
    if "config.json" not in {b["name"] for b in shown["blobs"]}:
        return None
    try:
        import logging  # noqa: PLC0415
        import warnings  # noqa: PLC0415

        import transformers  # noqa: PLC0415

        torch = _torch()
        cfg = json.loads(repo.blob(name, "config.json"))
        archs = cfg.get("architectures") or []
        cls = getattr(transformers, archs[0], None) if archs and isinstance(archs[0], str) else None
        if cls is None or not isinstance(cfg.get("model_type"), str):
            return None
        quiet = logging.getLogger("transformers")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = transformers.AutoConfig.for_model(**cfg)
                with torch.device("meta"):
                    keys = list(cls(config).state_dict().keys())
        finally:
            quiet.setLevel(level)
    except Exception:  # noqa: BLE001 - no transformers, an unknown or custom model: the order by name
        return None
    present = set(names)
    order = [k for k in dict.fromkeys(keys) if k in present]
    return order if len(order) == len(present) else None


class _ExportTensors:
    """The checkpoint's tensors as an export writes them: dtype (the cast
    applied to floating ones), shape, elements and bytes."""

    def __init__(self, shown, cast):
        torch_module()  # fills the dtype tables
        self._by_name = {t["name"]: t for t in shown["tensors"]}
        self._cast = cast

    def stored(self, n: str):
        """The torch dtype the checkpoint holds the tensor in."""
        name = self._by_name[n]["dtype"]
        dt = NAME_TO_TORCH.get(name)
        if dt is None:
            raise UnsupportedError(f"tensor '{n}' is {name}, which torch {_torch().__version__} lacks")
        return dt

    def dtype(self, n: str):
        dt = self.stored(n)
        return self._cast if self._cast is not None and dt.is_floating_point else dt

    def shape(self, n: str) -> List[int]:
        return [int(d) for d in self._by_name[n]["shape"]]

    def numel(self, n: str) -> int:
        count = 1
        for d in self.shape(n):
            count *= d
        return count

    def nbytes(self, n: str) -> int:
        return self.numel(n) * self.dtype(n).itemsize


# DCP exports: data files of at most this many bytes, and as many as the
# threads writing them side by side, none under the minimum.
_DCP_FILE_BYTES = 1 << 30
_DCP_MIN_FILE_BYTES = 16 << 20


def _export_dcp(export: "_Export", repo, reader, name: str, order: List[str], shown, sizes: "_ExportTensors", cast,
                threads: int, advance: Callable[[int], None], paths: Dict[str, tuple]) -> List[str]:
    """Writes the checkpoint as a DCP directory in FileSystemWriter's layout:
    `__0_K.distcp` files of torch.save'd items (each tensor whole, each blob
    a bytes item) and `.metadata`, a pickle of torch's own Metadata classes
    naming every item's file, offset and length. Files are written by
    `threads` threads, one tensor in memory per thread; each finished file
    is recorded with its items, so a rerun skips it; `.metadata` comes last.
    Returns the file names."""
    import io  # noqa: PLC0415
    import pickle  # noqa: PLC0415

    torch = _torch()
    try:
        from torch.distributed.checkpoint import filesystem  # noqa: PLC0415
        from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: PLC0415
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,  # noqa: PLC0415
                                                           ChunkStorageMetadata, Metadata, MetadataIndex,
                                                           TensorProperties, TensorStorageMetadata)
    except ImportError as e:
        raise UnsupportedError(f"torch {torch.__version__} lacks the DCP classes this export writes: {e}") from None
    version = getattr(filesystem, "CURRENT_DCP_VERSION", None)

    beside = _files_beside(repo, name, shown)
    blobs = [b["name"] for b in shown["blobs"] if b["name"] not in _INTERNAL_BLOBS and b["name"] not in beside]
    tensor_bytes = sum(sizes.nbytes(n) for n in order)
    per_file = min(_DCP_FILE_BYTES, max(_DCP_MIN_FILE_BYTES, -(-tensor_bytes // max(1, int(threads)))))
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
                        torch.save(_read_tensor(reader, key, cast), f)
                        advance(sizes.nbytes(key))
                    items.append([key, at, f.tell() - at])

        export.write(names[k], body, items)

    _write_files(write_file, len(groups), threads)
    blob_bytes = {b["name"]: b["bytes"] for b in shown["blobs"]}
    for b in beside:  # the files that were beside the data, as they were
        if b not in export.done:
            export.write(b, lambda f, b=b: _write_blob(reader, b, blob_bytes[b], f))
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
    _write_durable(export.path(".metadata"), lambda f: pickle.dump(metadata, f))
    return names + beside + [".metadata"]


def _files_beside(repo, name: str, shown) -> List[str]:
    """The blobs of checkpoint `name` that were files beside a DCP
    directory's data (its DCP_FILES_BLOB), each a plain file name."""
    have = {b["name"] for b in shown["blobs"]}
    if DCP_FILES_BLOB not in have:
        return []
    try:
        names = json.loads(repo.blob(name, DCP_FILES_BLOB))
    except ValueError as e:
        raise ckptfs.CorruptionError(f"checkpoint '{name}': blob {DCP_FILES_BLOB} is not JSON: {e}") from None
    for n in names if isinstance(names, list) else [names]:
        if (not isinstance(n, str) or not n or n != os.path.basename(n) or n.startswith(".")
                or n.endswith(".distcp") or n not in have):
            raise ckptfs.CorruptionError(f"checkpoint '{name}': blob {DCP_FILES_BLOB} names {n!r}, which is not a "
                                         "blob of a plain file name")
    return names


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
    torch = _torch()
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
    export = _Export(out, settings, clean)
    resumed = len(export.done)
    reader = repo._repo.open_checkpoint(name)
    structure = _structure(repo, name, shown)
    paths = _paths_of_structure(structure) if structure is not None else {}  # item -> object path
    order = [n for n in _tensor_order(structure, [t["name"] for t in shown["tensors"]]) if under(n)]
    files: List[str] = []
    sizes = _ExportTensors(shown, cast)
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
        order = [by_key[k] for k in _model_order(repo, name, shown, list(by_key)) or by_key]
        shards = hf_shards([(n, nbytes(n)) for n in order], limit)
        total = len(shards)
        names = ["model.safetensors"] if total == 1 else \
            [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]

        def write_shard(i):
            if names[i] in export.done:
                advance(sum(nbytes(n) for n in shards[i]))
                return
            head = _safetensors_header([(n[cut:], sizes.dtype(n), sizes.shape(n)) for n in shards[i]],
                                       {"format": "pt"})
            stream = _TensorStream(reader)

            def body(f):
                f.write(head)
                for n in shards[i]:
                    stream.write(f, n, sizes.stored(n), sizes.dtype(n), sizes.shape(n))
                    advance(nbytes(n))

            try:
                export.write(names[i], body)
            finally:
                stream.close()

        _write_files(write_shard, total, threads)
        files += names
        if total > 1:
            weight_map = {n[cut:]: names[i] for i, shard in enumerate(shards) for n in shard}
            # As transformers writes it: bytes and parameters of all shards.
            index = {"metadata": {"total_parameters": sum(numel(n) for n in order),
                                  "total_size": sum(nbytes(n) for n in order)},
                     "weight_map": dict(sorted(weight_map.items()))}
            data = (json.dumps(index, indent=2) + "\n").encode()
            _write_durable(export.path("model.safetensors.index.json"), lambda f: f.write(data))
            files.append("model.safetensors.index.json")
        # Blobs named like files (config, tokenizer, a trainer's files) go
        # beside the shards; the state's non-tensor values (a DCP item, a
        # torch.save file's number) are not files of a model directory.
        values = set(paths) - set(order)
        for b in shown["blobs"]:
            bname = b["name"]
            if bname in _INTERNAL_BLOBS or bname in files:
                continue
            if "/" in bname or bname.startswith("."):
                left_out.append(f"blob {bname} (not a plain file name)")
                continue
            if bname in values:
                left_out.append(f"blob {bname} (a non-tensor value of the state; --format dcp or torch keeps it)")
                continue
            _write_durable(export.path(bname), lambda f, b=b: _write_blob(reader, b["name"], b["bytes"], f))
            files.append(bname)
    elif format == "dcp":
        files += _export_dcp(export, repo, reader, name, order, shown, sizes, cast, threads, advance, paths)
    elif "model.pt" in export.done:  # finished before an interruption: kept as it is
        advance(total_bytes)
        files.append("model.pt")
    else:
        _export_torch(export.path("model.pt"), repo, reader, name, order, shown, sizes, cast, structure, advance)
        export.finished("model.pt")
        files.append("model.pt")
    total_bytes = sum(os.path.getsize(export.path(f)) for f in files)
    export.commit()
    return {"out": out, "format": format, "files": files, "bytes": total_bytes, "resumed_files": resumed,
            "rewritten_files": list(export.redone),
            "left_out": left_out}


# mmap's MAP_NORESERVE (Python 3.13 names it; Linux's value on x86-64 and
# arm64 before that).
_MAP_NORESERVE = getattr(__import__("mmap"), "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _export_torch(path: str, repo, reader, name: str, order: List[str], shown, sizes: "_ExportTensors", cast,
                  structure, advance: Callable[[int], None]) -> None:
    """Writes the checkpoint as one torch.save file at `path` with no more
    than one tensor in memory: torch.save writes the file's structure with
    every tensor's bytes left as empty space (torch.serialization.skip_data;
    the tensors it is given are mapped, never touched), torch.load maps
    the file back shared (so a write to a tensor is a write to the file),
    and each tensor is read from the repository straight into its place.
    Then the file is made durable and renamed into place, as every export
    file is."""
    import io  # noqa: PLC0415
    import mmap  # noqa: PLC0415

    torch = _torch()
    skip_data = getattr(torch.serialization, "skip_data", None)
    if skip_data is None:
        raise UnsupportedError(f"--format torch needs torch.serialization.skip_data (torch >= 2.5), not torch "
                               f"{torch.__version__}")
    # Every tensor a view of one anonymous mapping, 64-byte aligned: address
    # space only, not counted against the machine's memory (MAP_NORESERVE),
    # so tensors larger than the memory are no problem; one mmap call however
    # many tensors.
    places, end = {}, 0
    for n in order:
        places[n] = end
        end += -(-sizes.nbytes(n) // 64) * 64
    space = mmap.mmap(-1, max(end, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)

    def untouched(n: str):
        if sizes.nbytes(n) == 0:
            return torch.empty(sizes.shape(n), dtype=sizes.dtype(n))
        return torch.frombuffer(space, dtype=sizes.dtype(n), count=sizes.numel(n),
                                offset=places[n]).reshape(sizes.shape(n))

    empty = {n: untouched(n) for n in order}
    if structure is not None:
        state = _unflatten(structure, empty.__getitem__,
                           lambda b: torch.load(io.BytesIO(repo.blob(name, b)), weights_only=True))
    else:
        state = dict(empty)
        for b in sorted({b["name"] for b in shown["blobs"]} - set(_INTERNAL_BLOBS)):
            state[b] = repo.blob(name, b)
    tmp = path + ".tmp"
    with skip_data():
        torch.save(state, tmp)
    del state, empty, space
    # The file was written a moment ago, by torch.save of tensors, raw blob
    # bytes and objects that torch.load(weights_only=True) gave; loaded
    # whole, since weights_only refuses some of what pickle writes for
    # them (an empty bytes value is a call of the global `bytes`).
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        mapped = torch.load(tmp, mmap=True, weights_only=False)
    targets: Dict[str, Any] = {}
    if structure is not None:
        _tensors_at(structure, mapped, targets)
    else:
        targets = {n: mapped[n] for n in order}
    for n in order:
        target = targets.pop(n)
        if target.dtype == sizes.stored(n):
            read_value(reader, n, target, None)
        else:
            target.copy_(_read_tensor(reader, n))
        _let_go(target.data_ptr(), target.numel() * target.element_size())
        advance(sizes.nbytes(n))
        del target
    del mapped
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _let_go(address: int, nbytes: int) -> None:
    """Drops this process's pages of a shared file mapping's range once
    written: the data stays in the page cache (dirty, written back by the
    kernel or the fsync), so the export's memory stays one tensor's."""
    if nbytes <= 0:
        return
    import ctypes  # noqa: PLC0415

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED; advice only


_libc = None  # the C library, for madvise (_let_go)


def _tensors_at(node, obj, out: Dict[str, Any]) -> None:
    """The tensors of `obj`, an object _unflatten(node, ...) built (or a
    copy of one), by name."""
    if "dict" in node:
        for k, child in node["dict"]:
            _tensors_at(child, obj[k], out)
    elif "list" in node or "tuple" in node:
        for i, child in enumerate(node.get("list", node.get("tuple"))):
            _tensors_at(child, obj[i], out)
    elif "tensor" in node:
        out[node["tensor"]] = obj


def _in_repository(args, label: str, work) -> Optional[Dict[str, Any]]:
    """Opens args.repo and runs work(repo, progress), drawing progress on
    stderr as the ckpt command does; None after printing the error line."""
    try:
        repo = ckptfs.open(args.repo, cache_dir=args.cache_dir)
        shown = _Progress(label, args.progress)
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
        human = _Progress.human
        print(f"{out['name']}: {len(out['tensors'])} tensors and {len(out['blobs'])} blobs from {out['format']} "
              f"{args.path}: {human(out['logical_bytes'])} imported, {human(out['stored_bytes'])} stored "
              f"({out['chunks_written']} new chunks, {out['chunks_deduplicated']} deduplicated); checkpoint committed")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
