"""``ckptfs://``: a repository as an fsspec filesystem.

Any code that takes an fsspec URL (``dcp.save(checkpoint_id=...)``,
Lightning's ``dirpath``, ``fsspec.open``) reads and writes a ckptfs
repository through it, unchanged::

    ckptfs:///data/ckpt/step-100/__0_0.distcp      a local repository at /data/ckpt
    ckptfs://BUCKET/PREFIX/step-100/model.pt        s3://BUCKET/PREFIX (endpoint and
                                                    credentials as for ckptfs.open)

The repository is the deepest directory above the path that holds one (a
local path), or the shallowest prefix that holds one (S3). Below it, a
directory is a checkpoint (a group of them above: ``run1/step-100``), and a
file is one of the checkpoint's blobs, under its path inside the directory.

Writing: a file becomes visible, whole, when it is closed; until then
nothing of it is. Its bytes stream into the repository as they are
written (copied into the engine's pooled buffers and cut there, never held
whole). It is kept as a checkpoint of its own, staged under
``_fsspec/`` (so other processes and hosts see it). A directory becomes a
checkpoint (``ckpt ls``, the mount, ``load``) in one commit of its manifest,
with no byte copied, when

- a file named ``.metadata`` lands in it (written, or renamed into place as
  DCP's writers do: DCP saves to ``ckptfs://`` are committed when rank 0
  writes its metadata),
- it is renamed (``mv``: a temporary directory renamed into place), or
- ``commit(path)`` is called.

A directory committed again replaces its previous version, as ``ckpt
save --overwrite`` does. Blobs are chunked by their content, so the bytes of
a file that did not change since the last save are not stored again, even
where bytes before them changed length.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import posixpath
import re
import threading
from typing import Any, Dict, List, Optional, Tuple

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from ._core import Error, InvalidArgumentError, NotFoundError
from ._file_tensors import directory_tensors
from ._units import UnitFinder
from .repository import Repository, open as open_repository

STAGING = "_fsspec"
"""The group of checkpoints that hold files written but not yet committed."""

_FILE_TAG = "fsspec.file"
_READ_AHEAD = 256 << 10
_CONFIG_FILE = "ckptfs.json"


def _bare(path: str) -> str:
    """A path or URL without ckptfs:// or ckptfs::, normalized: /ABSOLUTE/PATH
    (local) or BUCKET/KEY (S3), no trailing slash."""
    for prefix in ("ckptfs://", "ckptfs::"):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    if path.startswith("/"):
        return "/" + posixpath.normpath(path).strip("/") if path.strip("/") else "/"
    return path.strip("/")


def _staged_name(directory: str, base: str) -> str:
    digest = hashlib.sha1(base.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{STAGING}/{directory}/f-{digest}" if directory else f"{STAGING}/f-{digest}"


class _View:
    """What one listing of a repository shows: committed checkpoints and staged files."""

    def __init__(self, repo: Repository):
        self.repo = repo
        repo.refresh()  # what other hosts committed since (one listing on S3)
        self.committed: set = set()
        # directory -> {file name: (staged checkpoint, size)}
        self.staged: Dict[str, Dict[str, Tuple[str, int]]] = {}
        self._sizes: Dict[str, Dict[str, int]] = {}
        self._directories: Optional[set] = None
        self.committed_at: Dict[str, str] = {}  # checkpoint -> its commit time, as ckpt ls gives it
        for c in repo.checkpoints():
            name = c["name"]
            self.committed_at[name] = c.get("committed") or ""
            if not name.startswith(STAGING + "/"):
                self.committed.add(name)
                continue
            base = c.get("tags", {}).get(_FILE_TAG)
            if base is None:
                continue  # not one of ours
            directory = posixpath.dirname(name[len(STAGING) + 1:])
            self.staged.setdefault(directory, {})[base] = (name, int(c.get("logical_bytes", 0)))

    def sizes(self, checkpoint: str) -> Dict[str, int]:
        """Blob name -> size of a committed checkpoint (its manifest, read once per view)."""
        got = self._sizes.get(checkpoint)
        if got is None:
            got = self._sizes[checkpoint] = self.repo.blobs(checkpoint, lease=False).sizes
        return got

    def checkpoint_of(self, rel: str) -> Optional[str]:
        """The committed checkpoint that `rel` lies in (or is), if any."""
        probe = rel
        while probe:
            if probe in self.committed:
                return probe
            probe = posixpath.dirname(probe)
        return None

    def directories(self) -> set:
        """Every directory: checkpoints, their groups, staging directories, and their parents."""
        if self._directories is None:
            self._directories = set()
            for d in list(self.committed) + list(self.staged):
                while d:
                    self._directories.add(d)
                    d = posixpath.dirname(d)
        return self._directories


class CkptfsFileSystem(AbstractFileSystem):
    """fsspec filesystem over ckptfs repositories (module docstring)."""

    protocol = "ckptfs"
    root_marker = ""
    cachable = True

    def __init__(self, *args, **storage_options):
        super().__init__(*args, **storage_options)
        self._lock = threading.Lock()
        self._roots: Dict[str, Repository] = {}  # root path -> repository
        self._not_roots: set = set()
        self._made: set = set()  # directories made by makedirs in this process

    # -- paths --

    # Paths are whole URLs, as HTTP's are in fsspec: what ls and find return
    # opens anywhere (Lightning, for one, takes listed names for paths).
    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        return "ckptfs://" + _bare(os.fspath(path))

    def unstrip_protocol(self, name: str) -> str:
        return self._strip_protocol(name)

    def _locate(self, path: str) -> Tuple[str, Repository, str]:
        """(root, repository, path inside it) of a path or URL; root as _bare gives it."""
        path = _bare(os.fspath(path))
        if path.startswith("/"):
            probe = path
            while True:
                if probe in self._roots or os.path.isfile(os.path.join(probe, _CONFIG_FILE)):
                    break
                parent = posixpath.dirname(probe)
                if parent == probe:
                    raise FileNotFoundError(f"{self.unstrip_protocol(path)}: in no ckptfs repository "
                                            f"(no directory above it holds {_CONFIG_FILE}; make one with ckpt init)")
                probe = parent
            candidates = [(probe, probe)]
        else:
            parts = path.split("/")
            candidates = [("/".join(parts[:i]), "s3://" + "/".join(parts[:i])) for i in range(1, len(parts) + 1)]
        for root, url in candidates:
            with self._lock:
                repo = self._roots.get(root)
            if repo is None:
                if root in self._not_roots:
                    continue
                try:
                    repo = open_repository(url)
                except (NotFoundError, InvalidArgumentError):  # not one, or not a name one can have
                    self._not_roots.add(root)
                    continue
                with self._lock:
                    repo = self._roots.setdefault(root, repo)
            rel = path[len(root):].strip("/")
            return root, repo, rel
        raise FileNotFoundError(f"{self.unstrip_protocol(path)}: in no ckptfs repository (no prefix of it holds "
                                f"{_CONFIG_FILE}; make one with ckpt init s3://BUCKET/PREFIX)")

    @staticmethod
    def _join(root: str, rel: str) -> str:
        """The URL of `rel` in the repository at `root`."""
        return "ckptfs://" + (f"{root}/{rel}" if rel else root)

    # -- reading the namespace --

    def _entries(self, root: str, view: _View, rel: str) -> Dict[str, Dict[str, Any]]:
        """The direct children of directory `rel`: name -> info."""
        out: Dict[str, Dict[str, Any]] = {}

        def add(child: str, kind: str, size: int = 0):
            full = self._join(root, posixpath.join(rel, child) if rel else child)
            out[child] = {"name": full, "type": kind, "size": size}

        for d in view.directories():
            if (posixpath.dirname(d) == rel) and d != rel:
                add(posixpath.basename(d), "directory")
        checkpoint = view.checkpoint_of(rel)
        if checkpoint is not None:
            inside = rel[len(checkpoint):].strip("/")
            for blob, size in view.sizes(checkpoint).items():
                sub = blob[len(inside) + 1:] if inside else blob
                if inside and not blob.startswith(inside + "/"):
                    continue
                head, _, tail = sub.partition("/")
                if tail:
                    add(head, "directory")
                else:
                    add(head, "file", size)
        for base, (_, size) in view.staged.get(rel, {}).items():
            add(base, "file", size)  # a staged file shadows the committed one
        return out

    def ls(self, path, detail=True, **kwargs):
        root, repo, rel = self._locate(path)
        view = _View(repo)
        entries = self._entries(root, view, rel)
        if not entries and not self._is_directory(root, view, rel):
            info = self._info(root, view, rel)
            return [info] if detail else [info["name"]]
        listed = sorted(entries.values(), key=lambda e: e["name"])
        return listed if detail else [e["name"] for e in listed]

    def _is_directory(self, root: str, view: _View, rel: str) -> bool:
        if rel == "" or rel in view.directories() or self._join(root, rel) in self._made:
            return True
        checkpoint = view.checkpoint_of(rel)
        if checkpoint is None:
            return False
        inside = rel[len(checkpoint):].strip("/")
        return any(b.startswith(inside + "/") for b in view.sizes(checkpoint))

    def _existing_file(self, path) -> Tuple[str, Repository, _View, Tuple[str, str, int]]:
        """(URL, repository, view, what `_file` finds) of file `path`;
        FileNotFoundError when there is none."""
        root, repo, rel = self._locate(path)
        view = _View(repo)
        found = self._file(view, rel)
        if found is None:
            raise FileNotFoundError(self.unstrip_protocol(self._join(root, rel)))
        return self._join(root, rel), repo, view, found

    def _file(self, view: _View, rel: str) -> Optional[Tuple[str, str, int]]:
        """(checkpoint, blob, size) that file `rel` reads from, or None."""
        directory, base = posixpath.split(rel)
        staged = view.staged.get(directory, {}).get(base)
        if staged is not None:
            return staged[0], base, staged[1]
        checkpoint = view.checkpoint_of(directory)
        if checkpoint is None or checkpoint == rel:
            return None
        blob = rel[len(checkpoint) + 1:]
        size = view.sizes(checkpoint).get(blob)
        return None if size is None else (checkpoint, blob, size)

    def info(self, path, **kwargs):
        root, repo, rel = self._locate(path)
        return self._info(root, _View(repo), rel)

    def _info(self, root: str, view: _View, rel: str) -> Dict[str, Any]:
        found = self._file(view, rel) if rel else None
        if found is not None:
            return {"name": self._join(root, rel), "type": "file", "size": found[2],
                    "checkpoint": found[0], "blob": found[1]}
        if self._is_directory(root, view, rel):
            return {"name": self._join(root, rel), "type": "directory", "size": 0}
        raise FileNotFoundError(self.unstrip_protocol(self._join(root, rel)))

    def cat_file(self, path, start=None, end=None, **kwargs):
        _, repo, _, (checkpoint, blob, size) = self._existing_file(path)
        start, end = _range(start, end, size)
        return repo.blobs(checkpoint).read(blob, start, end - start)

    # -- writing --

    def makedirs(self, path, exist_ok=False):
        root, repo, rel = self._locate(path)
        full = self._join(root, rel)
        if not exist_ok and (full in self._made or self._is_directory(root, _View(repo), rel)) and rel:
            raise FileExistsError(self.unstrip_protocol(full))
        self._made.add(full)

    def mkdir(self, path, create_parents=True, **kwargs):
        self.makedirs(path, exist_ok=True)

    def rmdir(self, path):
        root, repo, rel = self._locate(path)
        if self.ls(path, detail=False):
            raise OSError(f"{self.unstrip_protocol(self._join(root, rel))}: directory not empty")
        self._made.discard(self._join(root, rel))

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if mode == "rb":
            url, repo, _, found = self._existing_file(path)
            return _ReadFile(self, url, repo, found, block_size, cache_options)
        root, repo, rel = self._locate(path)
        if mode not in ("wb", "xb"):
            raise NotImplementedError(f"ckptfs:// files open as 'rb', 'wb' or 'xb', not {mode!r}")
        directory, base = posixpath.split(rel)
        _check_directory(directory, self.unstrip_protocol(self._join(root, rel)))
        if mode == "xb" and self._file(_View(repo), rel) is not None:
            raise FileExistsError(self.unstrip_protocol(self._join(root, rel)))
        return _WriteFile(self, self._join(root, rel), repo, directory, base, block_size)

    def commit(self, path) -> Dict[str, Any]:
        """Makes directory `path` (its files written so far, and those of the
        checkpoint it already is) the checkpoint of that name, in one commit."""
        _, repo, rel = self._locate(path)
        return self._commit(repo, rel)

    def _members(self, view: _View, rel: str) -> Dict[str, Tuple[str, str]]:
        """Blob name in checkpoint `rel` -> (checkpoint, blob) it comes from:
        the committed version's files, then every staged file at or below it."""
        members: Dict[str, Tuple[str, str]] = {}
        if rel in view.committed:
            members = {b: (rel, b) for b in view.sizes(rel)}
        for directory, files in view.staged.items():
            if directory == rel or directory.startswith(rel + "/"):
                prefix = directory[len(rel):].strip("/")
                for base, (staged, _) in files.items():
                    members[posixpath.join(prefix, base) if prefix else base] = (staged, base)
        return members

    def _commit(self, repo: Repository, rel: str, members: Optional[Dict[str, Tuple[str, str]]] = None,
                drop: Tuple[str, ...] = (), view: Optional[_View] = None) -> Dict[str, Any]:
        """Commits `rel` of `members` (by default what `view` shows of it; a
        new view when none is given) and removes the staged files taken."""
        if view is None:
            view = _View(repo)
        if members is None:
            members = self._members(view, rel)
        if not rel or rel.startswith(STAGING + "/") or rel == STAGING:
            raise InvalidArgumentError(f"'{rel}' cannot be a checkpoint of ckptfs://")
        blobs = [(source, blob, name) for name, (source, blob) in sorted(members.items())]
        tensors = directory_tensors(repo, members)
        try:
            result = repo.compose(rel, blobs, overwrite=rel in view.committed, tensors=tensors)
        except Error:
            if not tensors:
                raise
            # Tensors that do not fit (a name a file has too, shards that do
            # not tile): the files alone, as they were written.
            result = repo.compose(rel, blobs, overwrite=rel in view.committed)
        staged = sorted({s for s, _ in members.values() if s.startswith(STAGING + "/")} | set(drop))
        if staged:
            repo.rm(*staged)
        return result

    # -- rename and remove --

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        root1, repo, rel1 = self._locate(path1)
        root2, repo2, rel2 = self._locate(path2)
        if root1 != root2:
            raise InvalidArgumentError("ckptfs:// moves within one repository only; use ckpt copy between "
                                       "repositories")
        view = _View(repo)
        found = self._file(view, rel1)
        if found is not None:
            directory, base = posixpath.split(rel2)
            _check_directory(directory, self.unstrip_protocol(self._join(root2, rel2)))
            if self._is_directory(root2, view, rel2):
                raise IsADirectoryError(f"{self.unstrip_protocol(self._join(root2, rel2))}: a directory")
            source, blob, _ = found
            repo.compose(_staged_name(directory, base), [(source, blob, base)], tags={_FILE_TAG: base},
                         overwrite=True)
            self._remove_file(repo, view, found)
            if base == ".metadata":
                self._commit(repo, directory)  # a new view: it holds the file just staged
            return
        if not self._is_directory(root1, view, rel1) or not rel1:
            raise FileNotFoundError(self.unstrip_protocol(path1))
        if self._file(view, rel2) is not None:
            raise FileExistsError(f"{self.unstrip_protocol(self._join(root2, rel2))}: a file")
        if rel2 in view.directories() and self._entries(root2, view, rel2):
            raise FileExistsError(f"{self.unstrip_protocol(self._join(root2, rel2))}: a directory that is not empty")
        _check_directory(rel2, self.unstrip_protocol(self._join(root2, rel2)))
        if rel1 in view.committed or not any(c.startswith(rel1 + "/") for c in view.committed):
            self._commit(repo, rel2, self._members(view, rel1), drop=(rel1,) if rel1 in view.committed else (),
                         view=view)
        else:
            # A group of checkpoints: each checkpoint below it is renamed, and
            # each staged file below it moves with it.
            for c in sorted(c for c in view.committed if c.startswith(rel1 + "/")):
                self._commit(repo, rel2 + c[len(rel1):], self._members(view, c), drop=(c,), view=view)
            for directory, files in _View(repo).staged.items():
                if directory == rel1 or directory.startswith(rel1 + "/"):
                    for base, (staged, _) in files.items():
                        moved = rel2 + directory[len(rel1):]
                        repo.compose(_staged_name(moved, base), [(staged, base, base)], tags={_FILE_TAG: base},
                                     overwrite=True)
                        repo.rm(staged)
        self._made.discard(self._join(root1, rel1))

    rename = mv

    def rm_file(self, path):
        _, repo, view, found = self._existing_file(path)
        self._remove_file(repo, view, found)

    def _remove_file(self, repo: Repository, view: _View, found: Tuple[str, str, int]) -> None:
        """Removes a file as `_file` found it: its staged checkpoint, or a
        version of its checkpoint without it."""
        source, blob, _ = found
        if source.startswith(STAGING + "/"):
            repo.rm(source)
        else:
            self._commit(repo, source, {b: (source, b) for b in view.sizes(source) if b != blob}, view=view)

    def rm(self, path, recursive=False, maxdepth=None):
        if isinstance(path, list):
            for p in path:
                self.rm(p, recursive=recursive, maxdepth=maxdepth)
            return
        root, repo, rel = self._locate(path)
        view = _View(repo)
        found = self._file(view, rel)
        if found is not None:
            return self._remove_file(repo, view, found)
        if not self._is_directory(root, view, rel):
            raise FileNotFoundError(self.unstrip_protocol(self._join(root, rel)))
        if not recursive and self._entries(root, view, rel):
            raise OSError(f"{self.unstrip_protocol(self._join(root, rel))}: a directory; give recursive=True")
        doomed = {c for c in view.committed if not rel or c == rel or c.startswith(rel + "/")}
        checkpoint = view.checkpoint_of(rel)
        if checkpoint is not None and checkpoint != rel:
            # A directory inside a checkpoint: a version without its files.
            inside = rel[len(checkpoint) + 1:] + "/"
            self._commit(repo, checkpoint, {b: (checkpoint, b) for b in view.sizes(checkpoint)
                                            if not b.startswith(inside)}, view=view)
        for directory, files in view.staged.items():
            if not rel or directory == rel or directory.startswith(rel + "/"):
                doomed.update(s for s, _ in files.values())
        if doomed:
            repo.rm(*sorted(doomed))
        self._made.discard(self._join(root, rel))

    def modified(self, path):
        """When the file was committed (staged or in its checkpoint), to the second."""
        _, _, view, found = self._existing_file(path)
        stamp = view.committed_at.get(found[0], "")
        return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)

    created = modified


_NAME_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
# A staged file's checkpoint name adds "_fsspec/" and "/f-" and 16 digits to
# its directory's; checkpoint names are at most 200 characters.
_MAX_DIRECTORY = 200 - len(STAGING) - 20


def _check_directory(directory: str, url: str) -> None:
    """InvalidArgumentError unless `directory` can be a checkpoint's name."""
    if not directory:
        raise InvalidArgumentError(f"{url}: a file must be inside a directory below the repository "
                                   "(the directory becomes the checkpoint)")
    bad = [p for p in directory.split("/") if not _NAME_PART.fullmatch(p)]
    if bad or len(directory) > _MAX_DIRECTORY or directory.split("/")[0] == STAGING:
        why = (f"'{bad[0]}' has a character outside A-Z a-z 0-9 . _ - or starts with '.'" if bad else
               f"longer than {_MAX_DIRECTORY} characters" if len(directory) > _MAX_DIRECTORY else
               f"'{STAGING}' is where files wait for their commit")
        raise InvalidArgumentError(f"{url}: directory '{directory}' cannot be a checkpoint's name: {why}")


def _range(start: Optional[int], end: Optional[int], size: int) -> Tuple[int, int]:
    start = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
    end = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
    return start, max(start, end)


class _ReadFile(AbstractBufferedFile):
    def __init__(self, fs, path, repo: Repository, found: Tuple[str, str, int], block_size, cache_options):
        checkpoint, self._blob, size = found
        self._blobs = repo.blobs(checkpoint)  # a read lease for as long as the file is open
        # A small read-ahead: readers of archives (torch.load, DCP) read
        # headers in small pieces and data in large ones, which go straight
        # to the engine (read below); fsspec's 5 MiB blocks would decode data
        # only to drop it.
        super().__init__(fs, path, mode="rb", block_size=block_size or _READ_AHEAD,
                         cache_options=cache_options, size=size)

    def _fetch_range(self, start, end):
        start, end = _range(start, end, self.size)
        return self._blobs.read(self._blob, start, end - start)

    def read(self, length=-1):
        # A read of at least a block goes straight from the engine to the
        # caller (DCP reads each tensor whole); smaller ones use the
        # read-ahead cache.
        if self.closed or length is None or length < self.blocksize:
            return super().read(length)
        data = self._blobs.read(self._blob, self.loc, max(0, min(length, self.size - self.loc)))
        self.loc += len(data)
        return data

    def readinto(self, b):
        view = memoryview(b).cast("B")
        if self.closed or len(view) < self.blocksize:
            return super().readinto(b)
        n = max(0, min(len(view), self.size - self.loc))
        self._blobs.read_into(self._blob, self.loc, view[:n])
        self.loc += n
        return n


class _WriteFile(AbstractBufferedFile):
    """Streams a file's bytes into the repository as they are written: each
    write is copied into the engine's pooled buffers and cut there, by
    content, or as a tensor's bytes where a format ckptfs knows puts one
    (ckptfs._units), so no file is held whole. Closing commits the file as a staged
    checkpoint of its own; a directory's `.metadata` landing then commits
    the directory. A file discarded, or whose writing failed, leaves
    nothing."""

    def __init__(self, fs, path, repo: Repository, directory: str, base: str, block_size):
        self._repo, self._directory, self._base = repo, directory, base
        self._writer = None
        self._units = UnitFinder()
        super().__init__(fs, path, mode="wb", block_size=block_size or "default")
        writer = repo._repo.begin(_staged_name(directory, base), 0, 1, None, [(_FILE_TAG, base)], attempt="",
                                  overwrite=True)
        try:
            writer.begin_blob(base)
        except BaseException:
            writer.abort()
            raise
        self._writer = writer

    def write(self, data):
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        if self.forced:
            raise ValueError("This file has been force-flushed, can only close")
        if self._writer is None:
            raise ValueError("this file was discarded (or a write to it failed): nothing more can be written")
        view = memoryview(data)
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
        try:
            for piece, dtype in self._units.split(view):
                if dtype is None:
                    self._writer.append_blob(piece)
                else:
                    self._writer.append_blob(piece, True, dtype)
        except BaseException:
            self.discard()
            raise
        self.loc += view.nbytes
        return view.nbytes

    def _upload_chunk(self, final=False):
        if not final:
            return True  # write() streams: fsspec's buffer stays empty
        writer, self._writer = self._writer, None
        if writer is None:
            return True  # discarded, or a write failed (and raised): nothing to commit
        try:
            writer.end_blob()
            handle = writer.commit(snapshot=False)
        except BaseException:
            writer.abort()
            raise
        handle.wait(None)
        handle.result()
        if self._base == ".metadata":
            self.fs._commit(self._repo, self._directory)
        return True

    def discard(self):
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        super().discard()


def register() -> None:
    """Registers ``ckptfs://`` with fsspec for this process (an installed
    package registers it through its ``fsspec.specs`` entry point)."""
    import fsspec  # noqa: PLC0415

    fsspec.register_implementation("ckptfs", CkptfsFileSystem, clobber=True)


__all__: List[str] = ["CkptfsFileSystem", "STAGING", "register"]
