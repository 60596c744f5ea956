"""What every export writes with: durable files written in parallel and
resumed, the export's progress file, tensors streamed in pieces, and the
order tensors are written in."""

from __future__ import annotations

import json
import hashlib
import os
import shutil
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import ckptfs
from ckptfs import InvalidArgumentError, UnsupportedError
from ckptfs.memory import NAME_TO_TORCH, read_value, torch_module
from .common import DCP_FILES_BLOB, PARTIAL_SUFFIX, PROGRESS_FILE, STRUCTURE_BLOB, ckptfs_dtype, torch_or_raise
from .torch_in import unflatten


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


def write_files(write: Callable[[int], None], count: int, threads: int) -> None:
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


def write_durable(path: str, write) -> Tuple[int, str]:
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


def umask() -> int:
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


class Export:
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
        self.progress_file = os.path.join(self._dir, PROGRESS_FILE)
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
        write_durable(self.progress_file, lambda f: f.write(data))

    def path(self, name: str) -> str:
        return os.path.join(self._dir, name)

    def write(self, name: str, body, items: Any = None) -> None:
        """Writes file `name` through body(f), durably, and records it as
        finished."""
        self.finished(name, items, write_durable(self.path(name), body))

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
        os.fchmod(self._fd, 0o777 & ~umask())
        os.fsync(self._fd)
        os.rename(self.partial, self.out)
        os.close(self._fd)
        _fsync_dir(os.path.dirname(os.path.abspath(self.out)))


# Exports write a tensor this many bytes at a time, through two buffers they
# reuse: one read from the repository while the other is written.
EXPORT_PIECE = 16 << 20


class TensorStream:
    """Writes whole tensors of a checkpoint to a file piece by piece, the
    next piece read on a helper thread while this one is written: memory
    stays two pieces (and a third to cast into) whatever the tensor, and no
    buffer is allocated per tensor or piece (a first touch of fresh pages is
    what costs on a busy host)."""

    def __init__(self, reader):
        import concurrent.futures  # noqa: PLC0415

        torch = torch_or_raise()
        self.reader = reader
        self.buffers = [torch.empty(EXPORT_PIECE, dtype=torch.uint8) for _ in range(2)]
        self.cast_buffer = None  # made by the first cast
        self.ahead = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def close(self) -> None:
        self.ahead.shutdown(wait=True)

    def _read(self, name: str, dtype, shape, start: int, count: int, buf):
        read_value(self.reader, name, buf[:count * dtype.itemsize].view(dtype), ckptfs.Flat(shape, start))

    def write(self, f, name: str, stored, out, shape) -> None:
        """Writes tensor `name` (held as dtype `stored`, of `shape`) to `f`
        row-major as dtype `out`."""
        torch = torch_or_raise()
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel == 0:
            return
        if out != stored and self.cast_buffer is None:
            self.cast_buffer = torch.empty(EXPORT_PIECE, dtype=torch.uint8)
        # Elements a piece: the wider of the two element sizes fits a buffer.
        per = max(1, EXPORT_PIECE // max(stored.itemsize, out.itemsize))
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


def safetensors_header(tensors: Sequence[Tuple[str, Any, Sequence[int]]], metadata: Mapping[str, str]) -> bytes:
    """The header of a safetensors file of `tensors` (name, torch dtype,
    shape), in that order."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, dtype, shape in tensors:
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        header[key] = {"dtype": ckptfs_dtype(dtype), "shape": [int(d) for d in shape],
                       "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def read_tensor(reader, name: str, cast=None):
    torch = torch_or_raise()
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


def stored_structure(repo, name: str, shown) -> Optional[Dict[str, Any]]:
    """The dict shape a torch.save file had (its STRUCTURE_BLOB), or None."""
    if STRUCTURE_BLOB not in {b["name"] for b in shown["blobs"]}:
        return None
    return json.loads(repo.blob(name, STRUCTURE_BLOB))


def tensor_order(structure: Optional[Dict[str, Any]], names: List[str]) -> List[str]:
    """The checkpoint's tensors in the order their source had, where it
    said (a torch.save file's structure), else by name."""
    if structure is not None:
        order: List[str] = []
        unflatten(structure, order.append, lambda _name: None)
        if sorted(order) == sorted(names):
            return order
    return names


def model_order(repo, name: str, shown, names: List[str]) -> Optional[List[str]]:
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

        torch = torch_or_raise()
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


class ExportTensors:
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
            raise UnsupportedError(f"tensor '{n}' is {name}, which torch {torch_or_raise().__version__} lacks")
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


# Blobs are written out in pieces of this size.
_BLOB_PIECE = 64 << 20


def write_blob(reader, blob: str, size: int, f) -> None:
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


def files_beside(repo, name: str, shown) -> List[str]:
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
