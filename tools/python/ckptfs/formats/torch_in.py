"""Importing torch.save files and model directories of them (read by
torch_zip, or by `torch.load(weights_only=True)` where it cannot), and the
progress lines of the command."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple

import ckptfs
from ckptfs import InvalidArgumentError
from ckptfs.memory import put_value
from . import torch_zip
from .common import STRUCTURE_BLOB, ZIP_MAGIC, ckptfs_dtype, describe, torch_or_raise

if TYPE_CHECKING:
    from .dcp_in import Directory


# ---- torch.save ----------------------------------------------------------------------

class Progress:
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


def _tensor_types() -> tuple:
    """The classes of a loaded file's tensors: torch_zip's, and torch's
    once torch is imported (torch.load read the file)."""
    torch = sys.modules.get("torch")
    return (torch_zip.StoredTensor, torch.Tensor) if torch is not None else (torch_zip.StoredTensor,)


def _holds_tensor(obj, types: tuple) -> bool:
    if isinstance(obj, types):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensor(v, types) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v, types) for v in obj)
    return False


def _dtype_name(t) -> str:
    return t.dtype if isinstance(t, torch_zip.StoredTensor) else ckptfs_dtype(t.dtype)


def _nbytes(t) -> int:
    return t.nbytes if isinstance(t, torch_zip.StoredTensor) else t.numel() * t.element_size()


def _put_tensor(writer, key: str, t, kept: list) -> None:
    """Puts a loaded tensor whole: a torch_zip tensor from the mapped file."""
    if isinstance(t, torch_zip.StoredTensor):
        address, _copy = t.host()  # _copy holds a non-contiguous tensor's bytes until the put returns
        writer.put(key, t.dtype, list(t.shape), "whole", list(t.shape), [], 0, address, t.nbytes, -1)
        return
    put_value(writer, key, t.detach().contiguous(), None, False, kept)


def _flatten(obj, prefix: str, tensors: Dict[str, Any], others: Dict[str, Any], types: tuple) -> Any:
    """The structure of `obj` (JSON), its tensors and other leaves by key.
    Dicts (str or int keys: an optimizer's state is keyed by parameter
    index), lists and tuples that hold tensors are walked, their entries
    named by key or index joined with "."; anything else, such as an
    optimizer's param_groups, is one leaf."""
    def leaf(into: Dict[str, Any]) -> None:
        if prefix in tensors or prefix in others or prefix == STRUCTURE_BLOB:
            raise InvalidArgumentError(f"two entries flatten to the name '{prefix}'")
        into[prefix] = obj

    if isinstance(obj, types):
        leaf(tensors)
        return {"tensor": prefix}
    walk = not prefix or _holds_tensor(obj, types)
    if walk and isinstance(obj, Mapping):
        node = {"dict": []}
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise InvalidArgumentError(f"key {k!r} under '{prefix}' is a {type(k).__name__}; only str and int "
                                           "keys are kept")
            key = f"{prefix}.{k}" if prefix else str(k)
            node["dict"].append([k, _flatten(v, key, tensors, others, types)])
        return node
    if walk and isinstance(obj, (list, tuple)) and prefix:
        kind = "list" if isinstance(obj, list) else "tuple"
        return {kind: [_flatten(v, f"{prefix}.{i}", tensors, others, types) for i, v in enumerate(obj)]}
    leaf(others)
    return {"value": prefix}


def unflatten(node, tensor: Callable[[str], Any], value: Callable[[str], Any]) -> Any:
    """The object _flatten described, its leaves given by `tensor` and `value`."""
    if "dict" in node:
        return {k: unflatten(child, tensor, value) for k, child in node["dict"]}
    if "list" in node:
        return [unflatten(child, tensor, value) for child in node["list"]]
    if "tuple" in node:
        return tuple(unflatten(child, tensor, value) for child in node["tuple"])
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


def paths_of_structure(structure: Dict[str, Any]) -> Dict[str, tuple]:
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


def tensors_of(state: Any, what: str) -> Dict[str, Any]:
    """The tensors of a loaded torch.save object by the names an import
    gives them (keys and indices joined with "."); InvalidArgumentError
    naming `what` where two entries take one name."""
    tensors: Dict[str, Any] = {}
    try:
        _flatten(state, "", tensors, {}, _tensor_types())
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{what}: {e}") from None
    return tensors


def _load_dict(path: str, what: str) -> Mapping:
    """The object of the torch.save file at `path`, which must be a dict
    (`what` names one): read by torch_zip where it can (its tensors are
    torch_zip.StoredTensors), else by torch.load(weights_only=True), mapped
    where the file is a zip archive."""
    zipped = _is_zip(path)
    state: Any = None
    if zipped:
        try:
            state = torch_zip.load(path)
        except torch_zip.Fallback:
            state = None
    if state is None:
        torch = torch_or_raise()
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
        except Exception as e:  # noqa: BLE001 - torch's refusal (weights_only) or a damaged file
            raise ckptfs.CorruptionError(f"{path}: torch.load(weights_only=True) cannot read it: "
                                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(f"{path}: holds a {type(state).__name__}, not {what}")
    return state


def torch_plan(path: str):
    ckptfs._core.check_input_file(path)
    state = _load_dict(path, "a state dict")
    tensors: Dict[str, Any] = {}
    others: Dict[str, Any] = {}
    try:
        structure = _flatten(state, "", tensors, others, _tensor_types())
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{path}: {e}") from None
    entries = [{"name": k, "dtype": _dtype_name(t), "shape": list(t.shape), "bytes": _nbytes(t)}
               for k, t in tensors.items()]
    blobs = [{"name": k, "bytes": 0} for k in others] + [{"name": STRUCTURE_BLOB, "bytes": 0}]
    return (tensors, others, structure), describe(entries, blobs)


# A model directory's weights as torch.save files (transformers before
# safetensors); the engine's IsTorchWeightsFileName names the same files.
_TORCH_WEIGHTS_INDEX = "pytorch_model.bin.index.json"


def _is_torch_weights_name(name: str) -> bool:
    return name.startswith("pytorch_model") and (name.endswith(".bin") or name == _TORCH_WEIGHTS_INDEX)


def holds_torch_weights_only(path: str) -> bool:
    """Whether directory `path` holds torch.save weight files and no
    *.safetensors (with safetensors, those are imported and these left out)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return not any(n.endswith(".safetensors") for n in names) and any(_is_torch_weights_name(n) for n in names)


def _load_weights_file(path: str, where: Dict[str, str], tensors: Dict[str, Any]) -> None:
    """The tensors of one torch.save weights file of a model directory."""
    name = os.path.basename(path)
    state = _load_dict(path, "a dict of weights")
    types = _tensor_types()
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, types):
            raise InvalidArgumentError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; a model's "
                                       "weights file holds tensors only (import other torch.save files alone)")
        if key in where:
            raise InvalidArgumentError(f"{os.path.dirname(path)}: tensor '{key}' is in both {where[key]} and {name}")
        where[key] = name
        tensors[key] = value


def hf_torch_plan(path: str, inputs: "Directory"):
    """A model directory whose weights are torch.save files: its tensors,
    checked against pytorch_model.bin.index.json when there is one, and its
    other regular files as blobs (subdirectories and hidden files left out)."""
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
        _load_weights_file(f, where, tensors)
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
    entries = [{"name": k, "dtype": _dtype_name(t), "shape": list(t.shape), "bytes": _nbytes(t)}
               for k, t in tensors.items()]
    described = describe(entries, blobs)
    described["left_out"] = left_out
    described["links"] = inputs.links
    return (tensors, blob_files), described


def put_files(writer, files: List[Tuple[str, str]]) -> None:
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


def import_hf_torch(writer, loaded, advance: Callable[[int], None]) -> None:
    tensors, blob_files = loaded
    kept: list = []
    for key, t in tensors.items():
        _put_tensor(writer, key, t, kept)
        advance(_nbytes(t))
    put_files(writer, blob_files)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == ZIP_MAGIC


def import_torch(writer, loaded, advance: Callable[[int], None]) -> None:
    tensors, others, structure = loaded
    kept: list = []
    for key, t in tensors.items():
        _put_tensor(writer, key, t, kept)
        advance(_nbytes(t))
    if others:
        torch = torch_or_raise()
        for key, v in others.items():
            buf = io.BytesIO()
            torch.save(v, buf)
            put_value(writer, key, buf.getvalue(), None, False, kept)
    put_value(writer, STRUCTURE_BLOB, json.dumps(structure).encode(), None, False, kept)
