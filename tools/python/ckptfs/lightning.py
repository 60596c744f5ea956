"""Lightning checkpoints in a ckptfs repository.

    import lightning as L
    from ckptfs.lightning import CkptfsCheckpointIO

    trainer = L.Trainer(plugins=[CkptfsCheckpointIO("/data/ckpt")],
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath="ckpts", save_top_k=2, ...)])
    trainer.fit(model)                                  # saves into the repository
    trainer.fit(model, ckpt_path="ckpts/epoch=3-step=120.ckpt")   # resumes from it

Lightning keeps choosing the file paths (ModelCheckpoint's dirpath and
filename templates); the plugin stores each checkpoint under a name made
from the path's file name (checkpoint_name), and Lightning's removals of
old top-k checkpoints become `rm`. At the path itself it writes a small
reference file (JSON: the repository, the checkpoint's name and a token of
this save), so that what Lightning learns from the file system works as
with its own files: `ckpt_path="last"` finds the newest `last*.ckpt`, a
name already taken gets `-v1`, top-k removals find their files. Loading a
path whose reference names another save than the repository now holds
under that name (two runs that wrote the same file name) raises, naming
both. Every tensor of Lightning's checkpoint
dict (model weights, optimizer state) is stored as a tensor, deduplicated
against every other checkpoint; the rest of the dict (epoch, loops,
callbacks, hyper-parameters) is pickled with torch.save into the blob
`lightning.pt`, where the tensors stand as ("ckptfs.tensor", NAME) tuples.
Only process 0 of the job writes (Lightning calls the plugin there).

Under Lightning's AsyncCheckpointIO the saves run on a worker thread, one
after another, while ModelCheckpoint asks for removals on the training
thread: a removal can come before the save it removes has landed. The
plugin then remembers the name and removes the checkpoint (and its
reference file) as soon as that save lands, so that what is left matches
what Lightning asked for; the memory ends with teardown.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
import uuid
from typing import Any, Dict, Optional, Set, Tuple, Union

import torch
from lightning.fabric.plugins import CheckpointIO

import ckptfs

__all__ = ["CkptfsCheckpointIO", "checkpoint_name", "file_name"]

_SKELETON_BLOB = "lightning.pt"
_SAVE_TAG = "lightning.save"
_REFERENCE_KIND = "ckptfs checkpoint reference"
_PLACEHOLDER = "ckptfs.tensor"
_PLAIN = re.compile(rb"[A-Za-z0-9.-]")


def checkpoint_name(path: Union[str, os.PathLike]) -> str:
    """The checkpoint name for a Lightning checkpoint path: its file name
    with every byte other than a letter, digit, '.' or '-' written as '_'
    and two hex digits ('_' itself is '_5F', and so is a leading '.'), so
    that `epoch=3-step=120.ckpt` is `epoch_3D3-step_3D120.ckpt`. The mapping
    is reversible (file_name) and never yields two paths' file names the
    same name."""
    base = os.path.basename(os.fspath(path).rstrip("/"))
    if not base:
        raise ckptfs.InvalidArgumentError(f"checkpoint path {os.fspath(path)!r} has no file name")
    out = []
    for i, byte in enumerate(base.encode()):
        ch = bytes([byte])
        if _PLAIN.fullmatch(ch) and not (i == 0 and ch == b"."):
            out.append(ch.decode())
        else:
            out.append(f"_{byte:02X}")
    name = "".join(out)
    if len(name) > 200:
        raise ckptfs.InvalidArgumentError(
            f"checkpoint file name {base!r} makes a name of {len(name)} characters (at most 200)")
    return name


def file_name(name: str) -> str:
    """The Lightning file name a checkpoint name was made from (the inverse of checkpoint_name)."""
    out = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "_":
            out.append(int(name[i + 1:i + 3], 16))
            i += 3
        else:
            out += name[i].encode()
            i += 1
    return out.decode()


def _split(value: Any, path: str, tensors: Dict[str, torch.Tensor]) -> Any:
    """A copy of `value` with every tensor replaced by a placeholder tuple,
    the tensors collected under their path in the dict."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return (_PLACEHOLDER, path)
    if isinstance(value, dict):
        split = {k: _split(v, f"{path}/{k}", tensors) for k, v in value.items()}
        return split if type(value) is dict else type(value)(split)
    if isinstance(value, list):
        return [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_split(v, f"{path}/{i}", tensors) for i, v in enumerate(value))
    return value


def _join(value: Any, load) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _PLACEHOLDER and isinstance(value[1], str):
        return load(value[1])
    if isinstance(value, dict):
        joined = {k: _join(v, load) for k, v in value.items()}
        return joined if type(value) is dict else type(value)(joined)
    if isinstance(value, list):
        return [_join(v, load) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_join(v, load) for v in value)
    return value


class CkptfsCheckpointIO(CheckpointIO):
    """A Lightning CheckpointIO plugin that saves into the ckptfs repository
    at `url` (a path, or s3://). `url` must name an existing repository
    (ckptfs.init or `ckpt init`); `cache_dir` is as for ckptfs.open."""

    def __init__(self, url: Union[str, os.PathLike], *, cache_dir: Optional[Union[str, os.PathLike]] = None):
        super().__init__()
        self.url = os.fspath(url)
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self._repo: Optional[ckptfs.Repository] = None
        # Names whose removal was asked for before their save landed; the
        # lock orders "is it committed?" against "a save just landed".
        self._lock = threading.Lock()
        self._remove_on_landing: Set[str] = set()

    @property
    def repo(self) -> "ckptfs.Repository":
        if self._repo is None:
            self._repo = ckptfs.open(self.url, cache_dir=self.cache_dir)
        return self._repo

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"CkptfsCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r})")
        name = checkpoint_name(path)
        tensors: Dict[str, torch.Tensor] = {}
        skeleton = _split(checkpoint, "", tensors)
        buffer = io.BytesIO()
        torch.save(skeleton, buffer)
        state: Dict[str, Any] = {k.lstrip("/"): t.detach() for k, t in tensors.items()}
        state[_SKELETON_BLOB] = buffer.getvalue()
        step = checkpoint.get("global_step")
        # Lightning saves under a path again when it saves "last" again: the
        # new checkpoint replaces the old one when it commits, in one step
        # (a crash in between leaves the old one, as a file's rename would).
        token = uuid.uuid4().hex
        self.repo.save(name, state, step=int(step) if isinstance(step, int) else None,
                       tags={"lightning.path": os.fspath(path), _SAVE_TAG: token}, overwrite=True)
        self._write_reference(path, name, token)
        with self._lock:
            if name in self._remove_on_landing:
                self._remove_on_landing.discard(name)
                self._remove(name, path)

    def _write_reference(self, path: Union[str, os.PathLike], name: str, token: str) -> None:
        """The reference file at `path`, written whole or not at all."""
        from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: PLC0415

        path = os.fspath(path)
        fs = get_filesystem(path)
        parent = os.path.dirname(path)
        if parent:
            fs.makedirs(parent, exist_ok=True)
        body = json.dumps({"kind": _REFERENCE_KIND, "repository": self.url, "checkpoint": name, "save": token},
                          indent=1) + "\n"
        temporary = f"{path}.{token}.tmp"
        with fs.open(temporary, "w") as f:
            f.write(body)
        fs.mv(temporary, path)

    def _check_reference(self, path: Union[str, os.PathLike], name: str) -> None:
        """Raises when the reference file at `path` names another save than
        the repository holds under `name`; nothing to check without one."""
        from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: PLC0415

        path = os.fspath(path)
        fs = get_filesystem(path)
        if not fs.exists(path):
            return
        with fs.open(path, "rb") as f:
            head = f.read(1 << 16)
        try:
            ref = json.loads(head)
        except ValueError:
            ref = None
        if not isinstance(ref, dict) or ref.get("kind") != _REFERENCE_KIND:
            raise ckptfs.InvalidArgumentError(
                f"{path} is not a ckptfs checkpoint reference (CkptfsCheckpointIO writes one there for every save); "
                "load a Lightning file that was not saved through ckptfs without this plugin")
        held = [c for c in self.repo.checkpoints() if c["name"] == name]
        token = held[0]["tags"].get(_SAVE_TAG) if held else None
        if ref.get("checkpoint") != name or (token is not None and ref.get("save") != token):
            raise ckptfs.NotFoundError(
                f"{path} refers to save {ref.get('save')} of checkpoint '{ref.get('checkpoint')}', but the "
                f"repository's '{name}' is now save {token} (another run saved a file of the same name); "
                "that save was replaced")

    def load_checkpoint(self, path: Union[str, os.PathLike], map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        name = checkpoint_name(path)
        self._check_reference(path, name)
        raw = self.repo.blob(name, _SKELETON_BLOB)
        skeleton = torch.load(io.BytesIO(raw), map_location="cpu",
                              weights_only=bool(weights_only) if weights_only is not None else False)
        device = map_location if isinstance(map_location, (str, torch.device)) else None

        def load(tensor_path: str) -> torch.Tensor:
            t = self.repo.tensor(name, tensor_path.lstrip("/"))
            return t.to(device) if device is not None else t

        return _join(skeleton, load)

    def remove_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        name = checkpoint_name(path)
        with self._lock:
            if any(c["name"] == name for c in self.repo.checkpoints()):
                self._remove(name, path)
            else:
                # Its save is still queued or running (AsyncCheckpointIO):
                # the removal happens when it lands.
                self._remove_on_landing.add(name)
                self._remove_reference(path)

    def _remove(self, name: str, path: Union[str, os.PathLike]) -> None:
        self.repo.rm(name)
        self._remove_reference(path)

    @staticmethod
    def _remove_reference(path: Union[str, os.PathLike]) -> None:
        from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: PLC0415

        fs = get_filesystem(os.fspath(path))
        if fs.exists(os.fspath(path)):
            fs.rm(os.fspath(path))

    def teardown(self) -> None:
        with self._lock:
            self._remove_on_landing.clear()
        self._repo = None


def _tensor_paths(checkpoint: Dict[str, Any]) -> Tuple[str, ...]:
    """The tensor names a Lightning checkpoint dict is stored under (for tests and tools)."""
    tensors: Dict[str, torch.Tensor] = {}
    _split(checkpoint, "", tensors)
    return tuple(k.lstrip("/") for k in tensors)
