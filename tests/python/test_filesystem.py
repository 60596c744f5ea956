"""ckptfs:// as an fsspec filesystem: files written and read back byte-exact,
directories committed as checkpoints (DCP's metadata, a rename), fsspec's
usual calls and errors, and DCP saving and loading through a URL, on a
local repository and, where an S3 endpoint is configured, on S3."""
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

import fsspec
import numpy as np
import torch
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import ckptfs.filesystem  # noqa: E402
from helpers import CkptTestCase  # noqa: E402
from test_dcp import HAVE_FUSE, DcpTestCase, bits  # noqa: E402
import dcp_worker  # noqa: E402

ckptfs.filesystem.register()


def random_bytes(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class Filesystem(CkptTestCase):
    """On a local repository; the S3 case below runs the same tests."""

    def setUp(self):
        super().setUp()
        self.repository = ckptfs.init(self.make_repository(), chunk_size=64 << 10)
        self.fs = fsspec.filesystem("ckptfs", skip_instance_cache=True)

    def make_repository(self):
        self.base = "ckptfs://" + self.repo
        return self.repo

    def url(self, rel):
        return f"{self.base}/{rel}"

    def names(self):
        return sorted(c["name"] for c in self.repository.checkpoints())

    def test_files_read_back_byte_exact_whole_and_by_range(self):
        data = random_bytes(300_000, 1)
        with self.fs.open(self.url("run1/step-1/model.bin"), "wb") as f:
            f.write(data[:100_000])
            f.write(data[100_000:])
        self.fs.pipe(self.url("run1/step-1/sub/config.json"), b'{"a": 1}')
        self.fs.pipe(self.url("run1/step-1/empty"), b"")
        self.assertEqual(self.fs.cat_file(self.url("run1/step-1/model.bin")), data)
        self.assertEqual(self.fs.cat_file(self.url("run1/step-1/model.bin"), start=12345, end=200_000),
                         data[12345:200_000])
        self.assertEqual(self.fs.cat_file(self.url("run1/step-1/model.bin"), start=-10), data[-10:])
        self.assertEqual(self.fs.cat_file(self.url("run1/step-1/empty")), b"")
        with self.fs.open(self.url("run1/step-1/model.bin"), "rb") as f:
            f.seek(250_000)
            self.assertEqual(f.read(1000), data[250_000:251_000])
            self.assertEqual(f.size, len(data))
        info = self.fs.info(self.url("run1/step-1/model.bin"))
        self.assertEqual((info["type"], info["size"]), ("file", len(data)))
        self.assertEqual(self.fs.info(self.url("run1/step-1"))["type"], "directory")
        # Listed names are whole URLs, which open anywhere.
        self.assertEqual(self.fs.ls(self.url("run1/step-1"), detail=False),
                         [self.url("run1/step-1/empty"), self.url("run1/step-1/model.bin"),
                          self.url("run1/step-1/sub")])
        self.assertEqual(sorted(self.fs.find(self.url("run1"))),
                         [self.url("run1/step-1/empty"), self.url("run1/step-1/model.bin"),
                          self.url("run1/step-1/sub/config.json")])
        self.assertEqual(self.fs.glob(self.url("run1/step-1/*.bin")), [self.url("run1/step-1/model.bin")])
        self.assertLess(abs(self.fs.modified(self.url("run1/step-1/empty")).timestamp() - time.time()), 600)
        self.assertTrue(self.fs.isdir(self.url("run1")))
        self.assertTrue(self.fs.exists(self.url("run1/step-1/sub/config.json")))
        self.assertFalse(self.fs.exists(self.url("run1/step-1/nothing")))
        # Until the directory is committed its files are staged, each a
        # checkpoint of its own, and another filesystem object sees them.
        other = fsspec.filesystem("ckptfs", skip_instance_cache=True)
        self.assertEqual(other.cat_file(self.url("run1/step-1/sub/config.json")), b'{"a": 1}')
        self.assertTrue(all(n.startswith("_fsspec/") for n in self.names()))
        self.fs.commit(self.url("run1/step-1"))
        self.assertEqual(self.names(), ["run1/step-1"])
        self.assertEqual(sorted(self.repository.blobs("run1/step-1").sizes),
                         ["empty", "model.bin", "sub/config.json"])
        self.assertEqual(self.fs.cat_file(self.url("run1/step-1/model.bin")), data)
        self.assertEqual(self.fs.cat_file(self.url("run1/step-1/sub/config.json")), b'{"a": 1}')
        blobs = self.repository.blobs("run1/step-1")
        self.assertEqual(bytes(blobs.read("model.bin", 1000, 10)), data[1000:1010])
        for bad in ((len(data) - 5, 10), (-1, 4), (0, -1), (len(data) + 1, None)):
            with self.assertRaises(ckptfs.InvalidArgumentError, msg=str(bad)):
                blobs.read("model.bin", *bad)
        with self.assertRaises(ckptfs.NotFoundError):
            blobs.read("nothing")
        self.run_ckpt("verify", env={"CKPT_REPO": self.repository.path})

    def test_a_file_written_in_pieces_of_any_size_stores_the_chunks_of_the_whole(self):
        data = random_bytes(3 << 20, 9)
        sizes = [1, 7, 4096, 65537, 1 << 20, 3]
        with self.fs.open(self.url("a/state.bin"), "wb") as f:
            at, i = 0, 0
            while at < len(data):
                n = sizes[i % len(sizes)]
                self.assertEqual(f.write(memoryview(data)[at:at + n]), min(n, len(data) - at))
                at, i = at + n, i + 1
            self.assertEqual(f.tell(), len(data))
            self.assertEqual(self.names(), [])  # nothing of it before it is closed
            f.write(memoryview(b"0123456789")[::3])  # not contiguous: written as its bytes
        with self.assertRaises(ValueError):
            f.write(b"closed")
        self.fs.commit(self.url("a"))
        self.assertEqual(self.fs.cat_file(self.url("a/state.bin")), data + b"0369")
        first = self.repository.du()["total"]["unique_raw_bytes"]
        self.fs.pipe(self.url("b/state.bin"), data)  # one write: the same chunks, but the last
        self.fs.commit(self.url("b"))
        self.assertLessEqual(self.repository.du()["total"]["unique_raw_bytes"] - first, 16 << 10)
        self.assertEqual(self.fs.cat_file(self.url("b/state.bin")), data)
        # A file discarded before it is closed leaves nothing.
        f = self.fs.open(self.url("c/gone.bin"), "wb")
        f.write(data[:100_000])
        f.discard()
        with self.assertRaises(ValueError):
            f.write(b"after")
        f.close()
        self.assertFalse(self.fs.exists(self.url("c/gone.bin")))
        self.assertEqual(self.names(), ["a", "b"])

    def test_usual_errors(self):
        with self.assertRaises(FileNotFoundError):
            self.fs.cat_file(self.url("step-1/missing"))
        with self.assertRaises(FileNotFoundError):
            self.fs.open(self.url("step-1/missing"), "rb")
        with self.assertRaises(FileNotFoundError):
            self.fs.info(self.url("nothing/here"))
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.fs.pipe(self.url("at-the-root"), b"x")  # a file needs a directory: the checkpoint
        with self.assertRaises(NotImplementedError):
            self.fs.open(self.url("step-1/a"), "ab")
        self.fs.pipe(self.url("step-1/a"), b"x")
        with self.assertRaises(FileExistsError):
            self.fs.open(self.url("step-1/a"), "xb")
        with self.assertRaises(OSError):
            self.fs.rm(self.url("step-1"))  # a directory, without recursive
        if self.base.startswith("ckptfs:///"):
            with self.assertRaises(FileNotFoundError):
                fsspec.filesystem("ckptfs").ls("ckptfs://" + self.tmp)  # no repository above it

    def test_a_directory_is_committed_when_dcp_metadata_lands_and_when_it_is_renamed(self):
        state = random_bytes(200_000, 2)
        self.fs.pipe(self.url("step-1/__0_0.distcp"), state)
        self.fs.pipe(self.url("step-1/.metadata.tmp"), b"meta")
        self.assertNotIn("step-1", self.names())
        self.fs.mv(self.url("step-1/.metadata.tmp"), self.url("step-1/.metadata"))
        self.assertEqual(self.names(), ["step-1"])
        self.assertEqual(sorted(self.repository.blobs("step-1").sizes), [".metadata", "__0_0.distcp"])

        # A temporary directory renamed into place: one commit, no byte stored again.
        self.fs.pipe(self.url("tmp-2/a.bin"), state)
        self.fs.pipe(self.url("tmp-2/b.bin"), random_bytes(50_000, 3))
        self.fs.commit(self.url("tmp-2"))
        before = self.repository.du()["total"]
        started = time.monotonic()
        self.fs.mv(self.url("tmp-2"), self.url("step-2"), recursive=True)
        took = time.monotonic() - started
        after = self.repository.du()["total"]
        self.assertEqual(self.names(), ["step-1", "step-2"])
        self.assertEqual(after["unique_raw_bytes"], before["unique_raw_bytes"])
        self.assertEqual(self.fs.cat_file(self.url("step-2/a.bin")), state)
        self.assertLess(took, 30)
        # Renamed again onto a checkpoint that exists: refused while it has files.
        self.fs.pipe(self.url("tmp-3/a.bin"), b"new")
        with self.assertRaises(FileExistsError):
            self.fs.mv(self.url("tmp-3"), self.url("step-2"), recursive=True)

    def test_rm_of_a_file_and_of_a_directory(self):
        self.fs.pipe(self.url("step-1/a"), b"a")
        self.fs.pipe(self.url("step-1/b"), b"b")
        self.fs.commit(self.url("step-1"))
        self.fs.pipe(self.url("step-1/sub/c"), b"c")
        self.fs.pipe(self.url("step-1/sub/d"), b"d")
        self.fs.commit(self.url("step-1"))
        self.fs.rm(self.url("step-1/a"))
        self.assertEqual(sorted(self.repository.blobs("step-1").sizes), ["b", "sub/c", "sub/d"])
        self.fs.rm(self.url("step-1/sub"), recursive=True)
        self.assertEqual(sorted(self.repository.blobs("step-1").sizes), ["b"])
        self.assertFalse(self.fs.exists(self.url("step-1/sub")))
        self.fs.pipe(self.url("step-2/c"), b"c")  # staged only
        self.fs.rm(self.url("step-2/c"))
        self.assertFalse(self.fs.exists(self.url("step-2/c")))
        self.fs.rm(self.url("step-1"), recursive=True)
        self.assertEqual(self.names(), [])
        with self.assertRaises(FileNotFoundError):
            self.fs.rm(self.url("step-1"), recursive=True)

    def test_a_second_save_with_an_unchanged_half_stores_about_half(self):
        """A file whose first half changed (and grew) stores its second half once."""
        frozen = random_bytes(1 << 20, 4)
        self.fs.pipe(self.url("step-1/state.bin"), random_bytes(1 << 20, 5) + frozen)
        self.fs.commit(self.url("step-1"))
        first = self.repository.du()["total"]["unique_raw_bytes"]
        self.fs.pipe(self.url("step-2/state.bin"), random_bytes((1 << 20) + 333, 6) + frozen)
        self.fs.commit(self.url("step-2"))
        added = self.repository.du()["total"]["unique_raw_bytes"] - first
        self.assertLessEqual(added, 0.55 * first, f"{added} bytes added to {first}")

    def added_by(self, write):
        """Unique raw bytes the repository gained while `write` ran."""
        before = self.repository.du()["total"]["unique_raw_bytes"]
        write()
        return self.repository.du()["total"]["unique_raw_bytes"] - before

    def test_tensors_in_files_of_known_formats_keep_the_chunks_of_the_tensors(self):
        """A tensor's bytes in a torch.save archive (streamed, or written in
        one piece), a safetensors file or a DCP .distcp file are cut as a
        tensor's are: the tensor saved before costs no byte again, whatever
        the bytes around it."""
        import io

        from safetensors.torch import save as safetensors_save

        gen = torch.Generator().manual_seed(11)
        t = torch.randn(300, 256, generator=gen)  # 300 KiB: chunks of 64 KiB, and a short one
        self.repository.save("plain", {"t": t})

        def streamed():
            with self.fs.open(self.url("a/model.pt"), "wb") as f:
                torch.save({"step": 3, "t": t}, f)

        def in_one_write():
            buf = io.BytesIO()
            torch.save({"other": torch.arange(10), "t": t}, buf)
            self.fs.pipe(self.url("a/whole.pt"), buf.getvalue())

        def safetensors_file():
            self.fs.pipe(self.url("a/model.safetensors"),
                         safetensors_save({"a": torch.ones(7), "t": t, "empty": torch.zeros(0, 3)}))

        def distcp():
            dcp.save({"t": t, "n": torch.tensor(5)}, checkpoint_id=self.url("d/step-1"))

        for write in (streamed, in_one_write, safetensors_file, distcp):
            self.assertLessEqual(self.added_by(write), 8 << 10, write.__name__)
        self.fs.commit(self.url("a"))
        got = torch.load(io.BytesIO(self.fs.cat_file(self.url("a/model.pt"))), weights_only=True)
        self.assertTrue(torch.equal(got["t"], t))
        got = torch.load(io.BytesIO(self.fs.cat_file(self.url("a/whole.pt"))), weights_only=True)
        self.assertTrue(torch.equal(got["t"], t))
        from safetensors.torch import load as safetensors_load

        self.assertTrue(torch.equal(safetensors_load(self.fs.cat_file(self.url("a/model.safetensors")))["t"], t))
        # The tensors of its safetensors and torch.save files are the
        # checkpoint's too, named as in the files; "t", in all three, stays
        # in the files.
        self.assertEqual(sorted(x["name"] for x in self.repository.show("a")["tensors"]), ["a", "empty", "other"])
        self.assertTrue(torch.equal(torch.as_tensor(self.repository.tensor("a", "other")), torch.arange(10)))
        back = {"t": torch.zeros_like(t), "n": torch.tensor(0)}
        dcp.load(back, checkpoint_id=self.url("d/step-1"))
        self.assertTrue(torch.equal(back["t"], t))
        # Files that only look like these formats are stored byte for byte.
        odd = [b"PK\x03\x04" + random_bytes(200_000, 12), (2).to_bytes(8, "little") + b"{}" + random_bytes(99, 1),
               (40).to_bytes(8, "little") + b'{"t": {"data_offsets": [90, 10]}}' + random_bytes(70_000, 13)]
        for i, data in enumerate(odd):
            self.fs.pipe(self.url(f"odd/{i}.bin"), data)
            self.assertEqual(self.fs.cat_file(self.url(f"odd/{i}.bin")), data)
        self.run_ckpt("verify", env={"CKPT_REPO": self.repository.path})

    def test_a_torch_save_file_gives_the_checkpoint_its_tensors(self):
        w = torch.randn(100, 64)
        state = {"model": {"w": w, "tied": w, "b": torch.arange(5, dtype=torch.int32)}, "step": 5,
                 "view": torch.randn(50, 8)[::2]}
        with self.fs.open(self.url("b/last.ckpt"), "wb") as f:
            torch.save(state, f)
        self.fs.commit(self.url("b"))
        # Named as ckpt import names them; the strided view's storage is
        # larger than it, so it stays in the file.
        self.assertEqual(sorted(x["name"] for x in self.repository.show("b")["tensors"]),
                         ["model.b", "model.tied", "model.w"])
        for name, want in (("model.w", w), ("model.tied", w), ("model.b", state["model"]["b"])):
            self.assertTrue(torch.equal(torch.as_tensor(self.repository.tensor("b", name)), want), name)
        import io

        got = torch.load(io.BytesIO(self.fs.cat_file(self.url("b/last.ckpt"))), weights_only=True)
        self.assertTrue(torch.equal(got["view"], state["view"]))
        self.run_ckpt("verify", env={"CKPT_REPO": self.repository.path})

    def test_a_hostile_dcp_metadata_landing_runs_nothing(self):
        """The commit a .metadata file sets off reads it with the restricted
        unpickler: a pickle that would run code is left a file."""
        import pickle

        marker = os.path.join(self.tmp, "ran")

        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        self.fs.pipe(self.url("h/step-1/__0_0.distcp"), b"x" * 100)
        self.fs.pipe(self.url("h/step-1/.metadata"), pickle.dumps(Payload()))
        self.assertIn("h/step-1", self.names())
        self.assertFalse(os.path.exists(marker))
        self.assertEqual(self.repository.show("h/step-1")["tensors"], [])
        self.assertEqual(sorted(self.repository.blobs("h/step-1").sizes), [".metadata", "__0_0.distcp"])
        # An archive whose data.pkl would run code, written whole and
        # streamed: its storages' types are looked for, and nothing runs.
        import io
        import zipfile

        whole = io.BytesIO()
        with zipfile.ZipFile(whole, "w") as z:
            z.writestr("archive/data.pkl", pickle.dumps(Payload()))
            z.writestr("archive/data/0", random_bytes(100_000, 3))
        self.fs.pipe(self.url("h/z/whole.pt"), whole.getvalue())
        with self.fs.open(self.url("h/z/streamed.pt"), "wb") as f:
            with zipfile.ZipFile(f, "w") as z:
                z.writestr("archive/data.pkl", pickle.dumps(Payload()))
                z.writestr("archive/data/0", random_bytes(100_000, 3))
        self.assertFalse(os.path.exists(marker))
        self.assertEqual(self.fs.cat_file(self.url("h/z/whole.pt")), whole.getvalue())
        with zipfile.ZipFile(io.BytesIO(self.fs.cat_file(self.url("h/z/streamed.pt")))) as z:
            self.assertEqual(z.read("archive/data/0"), random_bytes(100_000, 3))

    def test_a_second_dcp_save_with_a_frozen_half_stores_about_half(self):
        gen = torch.Generator().manual_seed(8)
        state = {"embedding": torch.randn(512, 512, generator=gen), "layer": torch.randn(512, 512, generator=gen)}
        first = self.added_by(lambda: dcp.save(state, checkpoint_id=self.url("run/step-1")))
        state["layer"] = torch.randn(512, 512, generator=gen)
        added = self.added_by(lambda: dcp.save(state, checkpoint_id=self.url("run/step-2")))
        self.assertLessEqual(added, 0.55 * first, f"{added} bytes added to {first}")

    def test_dcp_saves_and_loads_through_a_url(self):
        gen = torch.Generator().manual_seed(7)
        state = {"w": torch.randn(256, 512, generator=gen), "b": torch.randn(512, generator=gen),
                 "step": torch.tensor(3), "extra": {"lr": 0.1, "name": "run"}}
        dcp.save(state, checkpoint_id=self.url("dcp/step-3"))
        self.assertIn("dcp/step-3", self.names())
        # Its tensors are the checkpoint's too (the files stay as they are).
        self.assertTrue(torch.equal(torch.as_tensor(self.repository.tensor("dcp/step-3", "w")), state["w"]))
        self.assertEqual(sorted(t["name"] for t in self.repository.show("dcp/step-3")["tensors"]), ["b", "step", "w"])
        got = {"w": torch.zeros(256, 512), "b": torch.zeros(512), "step": torch.tensor(0),
               "extra": {"lr": 0.0, "name": ""}}
        dcp.load(got, checkpoint_id=self.url("dcp/step-3"))
        self.assertTrue(torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]))
        self.assertEqual(int(got["step"]), 3)
        self.assertEqual(got["extra"], {"lr": 0.1, "name": "run"})
        # Saved again over itself: a new version replaces the old.
        state["b"] += 1
        dcp.save(state, checkpoint_id=self.url("dcp/step-3"))
        dcp.load(got, checkpoint_id=self.url("dcp/step-3"))
        self.assertTrue(torch.equal(got["b"], state["b"]))
        self.assertEqual(self.names(), ["dcp/step-3"])


class DcpRanks(DcpTestCase):
    """DTensors of every placement saved by 4 gloo ranks through a
    ckptfs:// URL (stock dcp.save: FsspecWriter), loaded at 2 with other
    placements, element by element (dcp_worker.py)."""

    def test_four_ranks_save_and_two_load_through_a_url(self):
        url = "ckptfs://" + self.repo + "/run1/step-5"
        self.assertEqual(self.run_job(4, "url-save", url), ["ok"] * 4)
        names = [c["name"] for c in self.r.checkpoints()]
        self.assertEqual(names, ["run1/step-5"])  # every rank's file in one commit, nothing staged
        self.assertEqual(sorted(self.r.blobs("run1/step-5").sizes),
                         [".metadata"] + [f"__{r}_0.distcp" for r in range(4)])
        # The files' tensors are the checkpoint's too, whole, referencing the
        # chunks the files hold: the API, the mount and ckpt export read them.
        want = dcp_worker.full()
        for name, tensor in want.items():
            self.assertEqual(bits(self.r.tensor("run1/step-5", name)), bits(tensor), name)
        self.assertEqual(sorted(t["name"] for t in self.r.show("run1/step-5")["tensors"]), sorted(want))
        if HAVE_FUSE:
            mnt = tempfile.mkdtemp(prefix="ckptfs-url-mnt-")
            self.run_ckpt("mount", mnt)
            try:
                got = np.load(os.path.join(mnt, "run1", "step-5", "rows.npy"))
                np.testing.assert_array_equal(got, want["rows"].numpy())
                with open(os.path.join(mnt, "run1", "step-5", "__2_0.distcp"), "rb") as f:
                    self.assertEqual(f.read(), self.r.blobs("run1/step-5").read("__2_0.distcp"))
            finally:
                subprocess.run(["fusermount3", "-u", mnt])
                os.rmdir(mnt)
        self.assertEqual(self.run_job(2, "url-load", url), ["ok"] * 2)
        # dcp.async_save to the same URL replaces it.
        self.assertEqual(self.run_job(2, "url-async-save", url), ["ok"] * 2)
        self.assertEqual(self.run_job(2, "url-load", url), ["ok"] * 2)
        self.assertEqual([c["name"] for c in self.r.checkpoints()], ["run1/step-5"])
        for name, tensor in want.items():
            self.assertEqual(bits(self.r.tensor("run1/step-5", name)), bits(tensor), name)
        self.run_ckpt("verify")


class TorchCheckpointingRanks(DcpTestCase):
    """torch_checkpointing's CheckpointManager with the ckptfs backend, run
    by 4 gloo ranks saving DTensors of every placement, and by 2 loading
    them at other placements (its DefaultResharder), element by element."""

    def test_four_ranks_save_and_two_load(self):
        try:
            import torch_checkpointing  # noqa: F401
        except ImportError as e:
            self.skipTest(f"torch_checkpointing is not installed: {e}")
        self.assertEqual(self.run_job(4, "tc-save", self.repo, "run/step-7"), ["ok"] * 4)
        names = [c["name"] for c in self.r.checkpoints()]
        self.assertEqual(names, ["run/step-7"])  # its rename: one commit, nothing staged
        self.assertEqual(self.run_job(2, "tc-load", self.repo, "run/step-7"), ["ok"] * 2)
        self.run_ckpt("verify")


class TorchCheckpointing(CkptTestCase):
    """torch_checkpointing's own CheckpointManager with the ckptfs backend:
    a model and its optimizer saved (synchronously and in the background)
    and loaded back bit-exact; the commit is its rename, one manifest."""

    def setUp(self):
        super().setUp()
        try:
            from torch_checkpointing.checkpoint_manager import CheckpointManager
        except ImportError as e:
            self.skipTest(f"torch_checkpointing is not installed: {e}")
        from ckptfs.torch_checkpointing import CkptfsStorageConfig

        self.repository = ckptfs.init(self.repo, chunk_size=64 << 10)
        self.config = CkptfsStorageConfig(self.repo)
        self.Manager = CheckpointManager

    def model_and_optimizer(self, seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        return model, opt

    def test_save_and_load_with_its_checkpoint_manager(self):
        model, opt = self.model_and_optimizer(1)
        for name, config in (("sync", self.Manager.Config.with_sync_save()),
                             ("async", self.Manager.Config.with_async_save())):
            config.storage_config = self.config
            manager = config.build()
            future = manager.save(os.path.join(self.repo, "run", name),
                                  {"model": model.state_dict(), "optim": opt.state_dict()})
            if future is not None:
                future.result()
            other, other_opt = self.model_and_optimizer(2)
            got = manager.load(os.path.join(self.repo, "run", name),
                               into={"model": other.state_dict(), "optim": other_opt.state_dict()})
            for k, v in model.state_dict().items():
                self.assertTrue(torch.equal(got["model"][k], v), k)
            saved_state = opt.state_dict()["state"]
            for i, st in got["optim"]["state"].items():
                self.assertTrue(torch.equal(st["exp_avg"], saved_state[i]["exp_avg"]))
            manager.close()
        names = [c["name"] for c in self.repository.checkpoints()]
        self.assertIn("run/sync", names)
        self.assertIn("run/async", names)
        self.assertFalse([n for n in names if n.startswith("_fsspec/")], names)
        self.run_ckpt("verify")


    def test_a_second_save_with_a_frozen_half_stores_about_half(self):
        gen = torch.Generator().manual_seed(9)
        model = {"embedding": torch.randn(512, 512, generator=gen), "layer": torch.randn(512, 512, generator=gen)}
        manager = self.Manager.Config.with_sync_save()
        manager.storage_config = self.config
        manager = manager.build()

        def save(name):
            before = self.repository.du()["total"]["unique_raw_bytes"]
            manager.save(os.path.join(self.repo, "run", name), {"model": model})
            return self.repository.du()["total"]["unique_raw_bytes"] - before

        first = save("step-1")
        model["layer"] = torch.randn(512, 512, generator=gen)
        added = save("step-2")
        manager.close()
        self.assertLessEqual(added, 0.55 * first, f"{added} bytes added to {first}")


class Torchtitan(CkptTestCase):
    """torchtitan's own checkpoint manager (DCP through fsspec), its folder a
    ckptfs:// URL: a job killed after step 5 resumes from step 4 and trains
    on with the losses of a job never killed (titan_worker.py)."""

    def run_steps(self, folder, *args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        done = subprocess.run([sys.executable, os.path.join(HERE, "titan_worker.py"), folder, *map(str, args)],
                              env=env, capture_output=True, text=True, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        self.assertTrue(lines, f"rc {done.returncode}: {done.stderr[-3000:]}")
        return done.returncode, json.loads(lines[-1])

    def test_a_killed_job_resumes_with_the_losses_of_one_never_killed(self):
        try:
            import torchtitan  # noqa: F401
        except ImportError as e:
            self.skipTest(f"torchtitan is not installed: {e}")
        repository = ckptfs.init(self.repo, chunk_size=64 << 10)
        folder = f"ckptfs://{self.repo}/run/checkpoint"
        rc, killed = self.run_steps(folder, 8, 5)
        self.assertEqual((rc, killed["resumed_from"]), (3, 0))
        rc, resumed = self.run_steps(folder, 8)
        self.assertEqual((rc, resumed["resumed_from"]), (0, 4))
        ckptfs.init(self.path("other"), chunk_size=64 << 10)
        rc, whole = self.run_steps(f"ckptfs://{self.path('other')}/run/checkpoint", 8)
        self.assertEqual(rc, 0)
        self.assertEqual(resumed["losses"], {k: v for k, v in whole["losses"].items() if int(k) > 4})
        self.assertEqual(killed["losses"], {k: v for k, v in whole["losses"].items() if int(k) <= 5})
        names = [c["name"] for c in repository.checkpoints()]
        self.assertIn("run/checkpoint/step-8", names)
        self.assertFalse([n for n in names if n.startswith("_fsspec/")], names)
        # Each is a DCP directory, so its tensors are the checkpoint's too.
        self.assertTrue(repository.show("run/checkpoint/step-8")["tensors"])
        self.run_ckpt("verify", env={"CKPT_REPO": self.repo})


class FilesystemOnS3(Filesystem):
    def make_repository(self):
        self.require_s3()
        prefix = f"py-fs-{os.getpid()}-{time.time_ns()}"
        self.base = f"ckptfs://ckptfs-test/{prefix}"
        return f"s3://ckptfs-test/{prefix}"


if __name__ == "__main__":
    unittest.main()
