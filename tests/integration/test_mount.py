"""Integration tests of `ckpt mount`: a real FUSE mount of a real repository,
read with NumPy, an independent safetensors parser and plain file I/O."""
import errno
import io
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import numpy as np

import st
from helpers import CKPT

HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


def ckpt(repo, *args, check=True):
    p = subprocess.run([CKPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env={**os.environ, "CKPT_REPO": repo}, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"ckpt {args} failed: {p.stderr.decode()}")
    return p


def wait_for(pred, timeout=10.0, what="condition"):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


rand = st.random_array


def escape(name):
    """The mount's file-name escaping, as documented in docs/CLI.md."""
    out = b""
    for i, ch in enumerate(name.encode()):
        dot_name = i == 0 and name in (".", "..")
        out += (b"%%%02X" % ch) if (ch in (0x25, 0x2F, 0x7E) or ch < 0x20 or ch == 0x7F or dot_name) else bytes([ch])
    return out.decode()


def unmount(path):
    """fusermount3 -u, retried for a few seconds: right after a mount comes
    up, the daemon stats its own mountpoint once (to find the device whose
    readahead it raises), and an unmount during that stat is EBUSY."""
    end = time.time() + 5
    while True:
        p = subprocess.run(["fusermount3", "-u", path], stderr=subprocess.PIPE)
        if p.returncode == 0 or time.time() > end:
            break
        time.sleep(0.1)
    if p.returncode != 0:
        raise AssertionError("fusermount3 -u failed: " + p.stderr.decode())


class Mounted(unittest.TestCase):
    """Mounts a repository once for the class, in the foreground."""

    @classmethod
    def build_repo(cls):
        raise NotImplementedError

    @classmethod
    def setUpClass(cls):
        if not HAVE_FUSE:
            raise unittest.SkipTest("no /dev/fuse or fusermount3: FUSE tests need them")
        cls.tmp = tempfile.mkdtemp(prefix="ckptfs-mount-")
        cls.repo = os.path.join(cls.tmp, "repo")
        cls.mnt = os.path.join(cls.tmp, "mnt")
        os.makedirs(cls.mnt)
        ckpt(cls.repo, "init", "--chunk-size", "64K")
        cls.build_repo()
        cls.log_path = os.path.join(cls.tmp, "mount.log")
        cls.log = open(cls.log_path, "wb")
        cls.proc = subprocess.Popen([CKPT, "mount", "-r", cls.repo, cls.mnt, "--foreground", "--cache-size", "8M"],
                                    stdout=subprocess.DEVNULL, stderr=cls.log)
        wait_for(lambda: os.path.ismount(cls.mnt) or cls.proc.poll() is not None, what="mount")
        if not os.path.ismount(cls.mnt):
            with open(cls.log_path) as f:
                raise AssertionError("mount failed: " + f.read())

    def daemon_stats(self):
        """The daemon's request counters (opens, reads, read_bytes, ...)."""
        words = os.getxattr(self.mnt, "user.ckptfs.stats").decode().split()
        return dict(zip(words[::2], map(int, words[1::2])))

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "proc", None):
            if cls.proc.poll() is None:
                cls.proc.send_signal(signal.SIGTERM)
                cls.proc.wait(timeout=20)
            cls.log.close()
        if os.path.ismount(cls.mnt):
            subprocess.run(["fusermount3", "-u", cls.mnt])
        shutil.rmtree(cls.tmp, ignore_errors=True)


class MountContent(Mounted):
    @classmethod
    def build_repo(cls):
        rng = np.random.default_rng(7)
        cls.want = {}  # name -> (dtype, array)
        world = 3
        ranks = [([], {}) for _ in range(world)]
        shapes = [(7, 13), (3, 5, 11), (), (0, 4), (129,), (2, 1, 3, 4)]
        for i, dt in enumerate(st.DTYPES):
            shape = shapes[i % len(shapes)]
            arr = rand(rng, dt, shape)
            name = f"model/layers.{i}/{dt.lower()}"
            cls.want[name] = (dt, arr)
            n = arr.size
            if len(shape) >= 2 and shape[0] >= world and i % 2 == 0:
                # box shards: split along the first dimension, unevenly
                cuts = [0, 1, shape[0] // 2 + 1, shape[0]]
                for r in range(world):
                    ranks[r][0].append((name, dt, arr[cuts[r]:cuts[r + 1]]))
                    ranks[r][1][name] = {"global_shape": list(shape), "offsets": [cuts[r]] + [0] * (len(shape) - 1)}
            elif n >= world:
                flat = arr.reshape(-1)
                cuts = [0, n // 3, n // 3 + 1, n]
                for r in range(world):
                    ranks[r][0].append((name, dt, flat[cuts[r]:cuts[r + 1]]))
                    ranks[r][1][name] = {"global_shape": list(shape), "flat_start": cuts[r]}
            else:  # 0-d and zero-size: replicated whole tensors
                for r in range(world):
                    ranks[r][0].append((name, dt, arr))
        # A big tensor spanning many chunks, and names that need escaping.
        big = rng.standard_normal((512, 300)).astype(np.float32)
        cls.want["big"] = ("F32", big)
        for r in range(world):
            cut = [0, 50000, 100001, big.size]
            ranks[r][0].append(("big", "F32", big.reshape(-1)[cut[r]:cut[r + 1]]))
            ranks[r][1]["big"] = {"global_shape": [512, 300], "flat_start": cut[r]}
        odd = {"weird%name": rand(rng, "I32", (3,)), "..": rand(rng, "U8", (2,)),
               "x" * 300: rand(rng, "F16", (4,)), "unicodé tensor": rand(rng, "F32", (2, 2))}
        for name, arr in odd.items():
            dt = {np.int32: "I32", np.uint8: "U8", np.float16: "F16", np.float32: "F32"}[arr.dtype.type]
            cls.want[name] = (dt, arr)
            ranks[0][0].append((name, dt, arr))
        for r, (tensors, shards) in enumerate(ranks):
            p = os.path.join(cls.tmp, f"rank{r}.safetensors")
            st.write(p, tensors, {"ckptfs.shards": json.dumps(shards)})
        cls.blobs = {"rng/rank0": os.urandom(70000), "config.json": b'{"lr": 0.001}'}
        blob_args = []
        for name, data in cls.blobs.items():
            bp = os.path.join(cls.tmp, name.replace("/", "_"))
            pathlib.Path(bp).write_bytes(data)
            blob_args += ["--blob", f"{name}={bp}"]
        for r in range(world):
            ckpt(cls.repo, "import", "step-1", os.path.join(cls.tmp, f"rank{r}.safetensors"), "--rank", str(r),
                 "--world-size", str(world), "--step", "1", *(blob_args if r == 0 else []))

    def tensor_path(self, name):
        e = escape(name)
        if len(e) + 4 > 255:
            matches = [f for f in os.listdir(os.path.join(self.mnt, "step-1")) if f.startswith(e[:200] + "~")]
            self.assertEqual(len(matches), 1)
            return os.path.join(self.mnt, "step-1", matches[0])
        return os.path.join(self.mnt, "step-1", e + ".npy")

    def test_listing_and_latest(self):
        self.assertEqual(sorted(os.listdir(self.mnt)), ["latest", "step-1"])
        self.assertEqual(os.readlink(os.path.join(self.mnt, "latest")), "step-1")
        files = set(os.listdir(os.path.join(self.mnt, "step-1")))
        self.assertTrue({"model.safetensors", "metadata.json", "blobs"} <= files)
        self.assertIn("model%2Flayers.0%2Fbool.npy", files)
        self.assertIn("weird%25name.npy", files)
        self.assertIn("%2E..npy", files)
        # The tensors, model.safetensors, metadata.json, blobs/, and config.json: a
        # blob with a plain file name stands beside the tensors too; rng/rank0 does not.
        self.assertEqual(len(files), len(self.want) + 4)
        self.assertIn("config.json", files)
        with open(os.path.join(self.mnt, "step-1", "config.json"), "rb") as f:
            self.assertEqual(f.read(), self.blobs["config.json"])
        self.assertFalse(os.path.islink(os.path.join(self.mnt, "step-1", "config.json")))
        self.assertEqual(sorted(os.listdir(os.path.join(self.mnt, "step-1", "blobs"))), ["config.json", "rng%2Frank0"])

    def test_every_npy_matches_with_numpy(self):
        for name, (dt, arr) in self.want.items():
            path = self.tensor_path(name)
            for mmap in (None, "r"):
                got = np.load(path, mmap_mode=mmap)
                self.assertEqual(got.shape, arr.shape, name)
                self.assertEqual(got.dtype, np.dtype(st.DTYPES[dt]), name)
                self.assertEqual(np.ascontiguousarray(got).tobytes(), np.ascontiguousarray(arr).astype(st.DTYPES[dt]).tobytes(), name)
            # stat size is exact before anything is read
            self.assertEqual(os.stat(path).st_size, len(pathlib.Path(path).read_bytes()))

    def test_xattrs_give_true_dtype_shape_and_name(self):
        for name, (dt, arr) in self.want.items():
            path = self.tensor_path(name)
            self.assertEqual(os.getxattr(path, "user.ckptfs.dtype").decode(), dt)
            self.assertEqual(json.loads(os.getxattr(path, "user.ckptfs.shape")), list(arr.shape))
            self.assertEqual(os.getxattr(path, "user.ckptfs.name").decode(), name)
            self.assertIn("user.ckptfs.dtype", os.listxattr(path))

    def test_safetensors_file_parses_independently(self):
        path = os.path.join(self.mnt, "step-1", "model.safetensors")
        got, meta = st.read(path)
        self.assertEqual(meta["ckptfs.step"], "1")
        self.assertEqual(set(got), set(self.want))
        for name, (dt, arr) in self.want.items():
            self.assertEqual(got[name][0], dt)
            self.assertEqual(got[name][1].tobytes(), np.ascontiguousarray(arr).astype(st.DTYPES[dt]).tobytes(), name)

    def test_blobs_and_metadata(self):
        for name, data in self.blobs.items():
            with open(os.path.join(self.mnt, "step-1", "blobs", escape(name)), "rb") as f:
                self.assertEqual(f.read(), data)
        with open(os.path.join(self.mnt, "step-1", "metadata.json")) as f:
            meta = json.load(f)
        self.assertEqual(meta["step"], 1)
        tensors = {t["name"]: t for t in meta["tensors"]}
        t = tensors["big"]
        self.assertEqual((t["dtype"], t["shape"], t["logical_bytes"]), ("F32", [512, 300], 512 * 300 * 4))
        self.assertEqual(len(t["shards"]), 3)
        self.assertGreater(t["stored_bytes"], 0)
        self.assertEqual(t["file"], "big.npy")
        self.assertEqual(tensors["model/layers.0/bool"]["file"], "model%2Flayers.0%2Fbool.npy")
        blobs = {b["name"]: b for b in meta["blobs"]}
        self.assertEqual(blobs["rng/rank0"]["bytes"], 70000)
        self.assertEqual(blobs["rng/rank0"]["file"], "blobs/rng%2Frank0")
        # the same description `ckpt show --json` gives, plus the file names
        show = json.loads(ckpt(self.repo, "show", "step-1", "--json").stdout)
        for entry in meta["tensors"] + meta["blobs"]:
            del entry["file"]
        self.assertEqual(meta, show)

    def test_a_second_read_is_served_by_the_page_cache(self):
        stats = self.daemon_stats
        path = self.tensor_path("model/layers.11/f32")
        size = os.stat(path).st_size
        before = stats()
        first = pathlib.Path(path).read_bytes()
        after_first = stats()
        self.assertGreater(after_first["reads"], before["reads"])
        self.assertGreaterEqual(after_first["read_bytes"] - before["read_bytes"], size)
        for _ in range(3):
            self.assertEqual(pathlib.Path(path).read_bytes(), first)
        after = stats()
        # The file is opened again, but no byte of it is asked of the daemon.
        self.assertEqual(after["reads"], after_first["reads"])
        self.assertEqual(after["read_bytes"], after_first["read_bytes"])
        self.assertEqual(after["opens"], after_first["opens"] + 3)

    def test_random_preads_match(self):
        rnd = random.Random(3)
        for name in ["big", "model/layers.11/f32"]:
            path = self.tensor_path(name)
            with open(path, "rb") as f:
                whole = f.read()
            dt, arr = self.want[name]
            self.assertEqual(whole[-arr.nbytes:], np.ascontiguousarray(arr).astype(st.DTYPES[dt]).tobytes())
            fd = os.open(path, os.O_RDONLY)
            try:
                for _ in range(300):
                    size = rnd.choice([1, 3, 7, 100, 4096, 65535, 65536, 65537, 200000, 1 << 20])
                    off = rnd.randrange(0, len(whole) + 10)
                    self.assertEqual(os.pread(fd, size, off), whole[off:off + size], (name, off, size))
            finally:
                os.close(fd)

    def test_every_byte_range_equals_export_and_cat_output(self):
        """Random byte ranges of every file, each read by the daemon (the
        file's page cache dropped first), against what `ckpt export` and
        `ckpt cat` write for the same checkpoint."""
        out = os.path.join(self.tmp, "export.safetensors")
        ckpt(self.repo, "export", "step-1", out, "--force")
        expected = {os.path.join(self.mnt, "step-1", "model.safetensors"): pathlib.Path(out).read_bytes()}
        for name in self.want:
            expected[self.tensor_path(name)] = ckpt(self.repo, "cat", "--format", "npy", "step-1", name).stdout
        for name in self.blobs:
            expected[os.path.join(self.mnt, "step-1", "blobs", escape(name))] = ckpt(
                self.repo, "cat", "--blob", "step-1", name).stdout
        rnd = random.Random(11)
        before = self.daemon_stats()["reads"]
        for path, want in expected.items():
            self.assertEqual(os.stat(path).st_size, len(want), path)
            fd = os.open(path, os.O_RDONLY)
            try:
                for _ in range(20):
                    size = rnd.choice([1, 2, 3, 8, 100, 4095, 4097, 65536, 300000])
                    off = rnd.randrange(0, len(want) + 2)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    self.assertEqual(os.pread(fd, size, off), want[off:off + size], (path, off, size))
            finally:
                os.close(fd)
        # The ranges came from the daemon, not from pages cached earlier.
        self.assertGreater(self.daemon_stats()["reads"] - before, len(expected) * 10)

    def test_standard_tools_read_the_files(self):
        path = self.tensor_path("big")
        with open(path, "rb") as f:
            whole = f.read()
        copy = os.path.join(self.tmp, "big.copy")
        with open(copy, "wb") as f:
            f.write(whole)
        cat = subprocess.run(["cat", path], stdout=subprocess.PIPE, check=True).stdout
        self.assertEqual(cat, whole)
        dd = subprocess.run(["dd", f"if={path}", "bs=4096", "skip=3", "count=5", "status=none"],
                            stdout=subprocess.PIPE, check=True).stdout
        self.assertEqual(dd, whole[3 * 4096:8 * 4096])
        self.assertEqual(subprocess.run(["cmp", path, copy]).returncode, 0)
        sums = subprocess.run(["sha256sum", path, copy], stdout=subprocess.PIPE, check=True).stdout.decode().split()
        self.assertEqual(sums[0], sums[2])
        safetensors = os.path.join(self.mnt, "step-1", "model.safetensors")
        self.assertEqual(subprocess.run(["cmp", "-s", safetensors, safetensors]).returncode, 0)

    def test_writes_are_refused_with_erofs(self):
        d = os.path.join(self.mnt, "step-1")
        for fn in [lambda: open(os.path.join(d, "new"), "wb"),
                   lambda: open(self.tensor_path("big"), "r+b"),
                   lambda: os.mkdir(os.path.join(d, "dir")),
                   lambda: os.unlink(self.tensor_path("big")),
                   lambda: os.rename(self.tensor_path("big"), os.path.join(d, "x"))]:
            with self.assertRaises(OSError) as cm:
                fn()
            self.assertEqual(cm.exception.errno, errno.EROFS)


class MountLiveAndFailures(Mounted):
    @classmethod
    def build_repo(cls):
        cls.rng = np.random.default_rng(11)
        cls.a = cls.rng.integers(0, 1 << 31, size=(256, 256), dtype=np.int32)  # random: stored raw
        st.write(os.path.join(cls.tmp, "a.safetensors"), [("t", "I32", cls.a)])
        ckpt(cls.repo, "import", "one", os.path.join(cls.tmp, "a.safetensors"), "--step", "1")

    def test_new_checkpoints_appear_and_removed_ones_disappear(self):
        b = self.rng.standard_normal((10,)).astype(np.float32)
        st.write(os.path.join(self.tmp, "b.safetensors"), [("t", "F32", b)])
        ckpt(self.repo, "import", "two", os.path.join(self.tmp, "b.safetensors"), "--step", "2")
        wait_for(lambda: "two" in os.listdir(self.mnt), what="new checkpoint to appear")
        wait_for(lambda: os.readlink(os.path.join(self.mnt, "latest")) == "two", what="latest to move")
        self.assertTrue((np.load(os.path.join(self.mnt, "latest", "t.npy")) == b).all())
        ckpt(self.repo, "rm", "two")
        wait_for(lambda: "two" not in os.listdir(self.mnt), what="removed checkpoint to disappear")
        wait_for(lambda: not os.path.exists(os.path.join(self.mnt, "two")), what="removed checkpoint lookup to fail")
        wait_for(lambda: os.readlink(os.path.join(self.mnt, "latest")) == "one", what="latest to move back")

    def test_groups_are_directories_and_an_overwritten_name_shows_its_new_version(self):
        x = self.rng.standard_normal((16,)).astype(np.float32)
        y = self.rng.standard_normal((16,)).astype(np.float32)
        st.write(os.path.join(self.tmp, "x.safetensors"), [("t", "F32", x)])
        st.write(os.path.join(self.tmp, "y.safetensors"), [("t", "F32", y)])
        ckpt(self.repo, "import", "runA/step-1", os.path.join(self.tmp, "x.safetensors"), "--step", "1")
        ckpt(self.repo, "import", "runA/eval/step-1", os.path.join(self.tmp, "y.safetensors"))
        wait_for(lambda: "runA" in os.listdir(self.mnt), what="the group to appear")
        group = os.path.join(self.mnt, "runA")
        self.assertTrue(os.path.isdir(group))
        self.assertEqual(sorted(os.listdir(group)), ["eval", "step-1"])
        self.assertEqual(os.listdir(os.path.join(group, "eval")), ["step-1"])
        self.assertTrue((np.load(os.path.join(group, "step-1", "t.npy")) == x).all())
        self.assertTrue((np.load(os.path.join(group, "eval", "step-1", "t.npy")) == y).all())
        self.assertFalse(os.path.exists(os.path.join(group, "nope")))
        # A name saved again with --overwrite: the directory shows the new version.
        ckpt(self.repo, "import", "runA/step-1", os.path.join(self.tmp, "y.safetensors"), "--overwrite")
        wait_for(lambda: (np.load(os.path.join(group, "step-1", "t.npy")) == y).all(),
                 what="the overwritten checkpoint to show its new version")
        ckpt(self.repo, "rm", "runA/step-1", "runA/eval/step-1")
        wait_for(lambda: "runA" not in os.listdir(self.mnt), what="the emptied group to disappear")
        wait_for(lambda: not os.path.exists(group), what="the emptied group's lookup to fail")

    def test_an_mmap_and_an_open_file_outlive_rm_and_gc_whose_space_the_next_gc_reclaims(self):
        v = self.rng.integers(0, 1 << 31, size=(512, 512), dtype=np.int32)  # 1 MiB, 16 chunks
        st.write(os.path.join(self.tmp, "v.safetensors"), [("t", "I32", v)])
        ckpt(self.repo, "import", "victim", os.path.join(self.tmp, "v.safetensors"), "--step", "0")
        path = os.path.join(self.mnt, "victim", "t.npy")
        wait_for(lambda: os.path.exists(path), what="victim to appear")
        arr = np.load(path, mmap_mode="r")  # maps the file; its descriptor is closed
        f = open(path, "rb")
        ckpt(self.repo, "rm", "victim")
        wait_for(lambda: "victim" not in os.listdir(self.mnt), what="victim to disappear")
        report = json.loads(ckpt(self.repo, "gc", "--json").stdout)
        self.assertEqual(report["removed_kept_for_readers"], 1)
        du = json.loads(ckpt(self.repo, "du", "--json").stdout)["total"]
        self.assertGreaterEqual(du["removed_bytes"], v.nbytes)
        # Nothing the kernel cached answers: every page comes from the daemon.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self.assertTrue(np.array_equal(arr, v))  # page faults through the mapping: no SIGBUS
        f.seek(0)
        self.assertTrue(np.array_equal(np.load(io.BytesIO(f.read())), v))  # and through the open file
        f.close()
        del arr
        # The kernel releases the file once it is unmapped and closed; the
        # first gc after that reclaims the space.
        reclaimed = {}

        def collected():
            reclaimed.update(json.loads(ckpt(self.repo, "gc", "--json").stdout))
            return reclaimed["removed_collected"] == 1

        wait_for(collected, what="gc to reclaim the released checkpoint")
        self.assertGreaterEqual(reclaimed["bytes_reclaimed"], v.nbytes)
        self.assertEqual(json.loads(ckpt(self.repo, "du", "--json").stdout)["total"]["removed_bytes"], 0)

    def test_corrupt_chunk_gives_eio_and_listing_reads_no_data(self):
        c = self.rng.integers(0, 1 << 31, size=(256, 256), dtype=np.int32)
        st.write(os.path.join(self.tmp, "c.safetensors"), [("t", "I32", c)])
        ckpt(self.repo, "import", "corrupt", os.path.join(self.tmp, "c.safetensors"))
        # Random int32 data is stored raw: find the chunk holding bytes
        # [65536*3, 65536*4) of the tensor in its pack and flip one byte.
        raw = c.tobytes()
        needle = raw[65536 * 3:65536 * 3 + 64]
        packs = os.path.join(self.repo, "objects", "packs")
        hit = None
        for p in os.listdir(packs):
            data = pathlib.Path(packs, p).read_bytes()
            if needle in data:
                hit = (os.path.join(packs, p), data.index(needle))
        self.assertIsNotNone(hit)
        with open(hit[0], "r+b") as f:
            f.seek(hit[1] + 10)
            b = f.read(1)
            f.seek(hit[1] + 10)
            f.write(bytes([b[0] ^ 1]))
        wait_for(lambda: "corrupt" in os.listdir(self.mnt), what="checkpoint to appear")
        path = os.path.join(self.mnt, "corrupt", "t.npy")
        # Listing, stat and open never touch tensor data.
        self.assertEqual(os.stat(path).st_size, 128 + c.nbytes)
        fd = os.open(path, os.O_RDONLY)
        try:
            header = 128
            # A range that does not need the damaged chunk reads fine ...
            self.assertEqual(os.pread(fd, 65536, header), raw[:65536])
            self.assertEqual(os.pread(fd, 1000, header + 65536 * 5), raw[65536 * 5:65536 * 5 + 1000])
            # ... the damaged chunk's range fails with EIO, never wrong bytes.
            with self.assertRaises(OSError) as cm:
                os.pread(fd, 100, header + 65536 * 3 + 5)
            self.assertEqual(cm.exception.errno, errno.EIO)
        finally:
            os.close(fd)
        # the daemon logged which chunk of which pack failed
        pack_id = os.path.basename(hit[0])[: -len(".pack")]
        with open(self.log_path) as f:
            log = f.read()
        self.assertRegex(log, r"chunk [0-9a-f]{32} in pack " + pack_id)
        # Sequential reads return correct bytes up to the damaged chunk (the
        # kernel may end a read short there), then EIO.
        got = b""
        with self.assertRaises(OSError) as cm:
            with open(path, "rb", buffering=0) as f:
                while True:
                    piece = f.read(1 << 20)
                    if not piece:
                        break
                    got += piece
        self.assertEqual(cm.exception.errno, errno.EIO)
        self.assertLessEqual(len(got), header + 65536 * 3 + 10)
        self.assertEqual(got[header:], raw[:len(got) - header])
        with self.assertRaises(Exception):
            np.load(path)
        ckpt(self.repo, "rm", "corrupt")


    def test_damaged_catalog_record_gives_eio_and_the_daemon_survives(self):
        d = self.rng.integers(0, 1 << 31, size=(256, 256), dtype=np.int32)
        st.write(os.path.join(self.tmp, "d.safetensors"), [("t", "I32", d)])
        ckpt(self.repo, "import", "damaged", os.path.join(self.tmp, "d.safetensors"))
        # Before the mount first looks at it, its tensor record is replaced by
        # one whose first shard lacks a chunk (the checksum-valid record that
        # once crashed the daemon in the merge planner).
        craft = os.environ.get("CRAFT_RECORD_BIN") or os.path.join(os.path.dirname(__file__), "../../build/tests/craft_record")
        subprocess.run([craft, "catalog", self.repo, "damaged", "short-shard"], check=True, stdout=subprocess.PIPE)
        with self.assertRaises(OSError) as cm:
            os.stat(os.path.join(self.mnt, "damaged", "t.npy"))
        self.assertEqual(cm.exception.errno, errno.EIO)
        self.assertNotIn("damaged", os.listdir(self.mnt))
        with open(self.log_path) as f:
            self.assertIn("its region needs", f.read())
        # The daemon is alive and serves the intact checkpoint.
        self.assertTrue((np.load(os.path.join(self.mnt, "one", "t.npy")) == self.a).all())
        # Removing it needs no decoding of its records.
        ckpt(self.repo, "rm", "damaged")
        wait_for(lambda: not os.path.exists(os.path.join(self.mnt, "damaged")), what="removed checkpoint to go")


@unittest.skipUnless(HAVE_FUSE, "no /dev/fuse or fusermount3: FUSE tests need them")
class MountScale(Mounted):
    """A checkpoint of 100,000 tensors: the daemon holds at most about a
    kilobyte per tensor once the directory is listed, and lookups stay fast."""

    TENSORS = 100_000

    @classmethod
    def build_repo(cls):
        path = os.path.join(cls.tmp, "many.safetensors")
        st.write(path, [(f"layers.{i // 100}.block.{i % 100}.w", "F32", np.full(2, i, np.float32))
                        for i in range(cls.TENSORS)])
        ckpt(cls.repo, "import", "many", path)
        os.unlink(path)

    def rss(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def test_a_listed_checkpoint_costs_at_most_about_a_kilobyte_per_tensor(self):
        before = self.rss()
        names = os.listdir(os.path.join(self.mnt, "many"))
        self.assertEqual(len(names), self.TENSORS + 3)  # model.safetensors, metadata.json, blobs
        listed = (self.rss() - before) / self.TENSORS
        t0 = time.monotonic()
        for i in (0, self.TENSORS // 2, self.TENSORS - 1):
            path = os.path.join(self.mnt, "many", f"layers.{i // 100}.block.{i % 100}.w.npy")
            self.assertEqual(np.load(path).tolist(), [i, i])
        self.assertLess(time.monotonic() - t0, 5.0)
        with open(os.path.join(self.mnt, "many", "metadata.json")) as f:
            meta = json.load(f)
        self.assertEqual(len(meta["tensors"]), self.TENSORS)
        # The kernel sends the release of a closed file after close returns:
        # the text goes (and its memory back) shortly after.
        deadline = time.monotonic() + 10
        while True:
            per_tensor = (self.rss() - before) / self.TENSORS
            if per_tensor < 1200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.assertLess(listed, 1200, f"{listed:.0f} B per tensor once listed")
        self.assertLess(per_tensor, 1200, f"{per_tensor:.0f} B per tensor after reading metadata.json")


class MountLifecycle(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-mount-")
        self.repo = os.path.join(self.tmp, "repo")
        self.mnt = os.path.join(self.tmp, "mnt")
        os.makedirs(self.mnt)
        ckpt(self.repo, "init")

    def tearDown(self):
        if os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", self.mnt])
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_mount(self, *args):
        return subprocess.run([CKPT, "mount", "-r", self.repo, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=60)

    def test_refuses_missing_or_non_empty_mountpoint(self):
        p = self.run_mount(os.path.join(self.tmp, "nope"))
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("does not exist", p.stderr.decode())
        open(os.path.join(self.mnt, "file"), "w").close()
        p = self.run_mount(self.mnt)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("not empty", p.stderr.decode())
        p = subprocess.run([CKPT, "mount", "-r", os.path.join(self.tmp, "norepo"), os.path.join(self.tmp)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.assertNotEqual(p.returncode, 0)

    def test_allow_other_only_when_asked(self):
        def options():
            with open("/proc/mounts") as m:
                return [line.split()[3] for line in m if line.split()[1] == self.mnt]
        for extra, expected in (([], False), (["--allow-other"], True)):
            p = self.run_mount(self.mnt, *extra)
            self.assertEqual(p.returncode, 0, p.stderr.decode())
            opts = options()
            self.assertEqual(len(opts), 1)
            self.assertEqual("allow_other" in opts[0], expected, opts[0])
            self.assertIn("ro", opts[0].split(","))
            unmount(self.mnt)
            wait_for(lambda: not os.path.ismount(self.mnt), what="unmount")

    def test_daemon_mode_and_fusermount_unmount(self):
        p = self.run_mount(self.mnt)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        self.assertTrue(os.path.ismount(self.mnt))
        self.assertEqual(os.listdir(self.mnt), [])  # empty repository: no latest
        unmount(self.mnt)
        wait_for(lambda: not os.path.ismount(self.mnt), what="unmount")

    def test_daemon_with_paths_relative_to_the_callers_directory(self):
        # The daemon works in "/", so the repository and the mountpoint given
        # relative to the caller's directory must still be the ones the caller
        # meant. (A relative --cache-dir, used by S3 repositories only, is
        # tested in test_s3.)
        a = np.arange(1000, dtype=np.float32).reshape(10, 100)
        st.write(os.path.join(self.tmp, "a.safetensors"), [("w", "F32", a)])
        ckpt(self.repo, "import", "one", os.path.join(self.tmp, "a.safetensors"))
        p = subprocess.run([CKPT, "mount", "-r", "repo", "mnt"], cwd=self.tmp,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        self.assertTrue(os.path.ismount(self.mnt))
        self.assertEqual(sorted(os.listdir(self.mnt)), ["latest", "one"])
        self.assertTrue((np.load(os.path.join(self.mnt, "one", "w.npy")) == a).all())
        unmount(self.mnt)
        wait_for(lambda: not os.path.ismount(self.mnt), what="unmount")

    def test_sigint_and_sigterm_unmount_cleanly(self):
        # Signalled the moment the mount appears: nothing the daemon does
        # while starting may wait for its own mount to answer.
        for sig in (signal.SIGINT, signal.SIGTERM) * 4:
            proc = subprocess.Popen([CKPT, "mount", "-r", self.repo, self.mnt, "-f"], stderr=subprocess.PIPE)
            wait_for(lambda: os.path.ismount(self.mnt), what="mount")
            proc.send_signal(sig)
            try:
                self.assertEqual(proc.wait(timeout=20), 0)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    subprocess.run(["umount", "-l", self.mnt], check=False)
            proc.stderr.close()
            self.assertFalse(os.path.ismount(self.mnt))
            with open("/proc/mounts") as m:
                self.assertNotIn(self.mnt, m.read())

    @unittest.skipUnless(os.geteuid() == 0, "setting a mount's readahead needs root")
    def test_readahead_is_raised_on_the_mounts_device(self):
        for size, kb in (("16M", 16384), ("3M", 3072)):
            proc = subprocess.Popen([CKPT, "mount", "-r", self.repo, self.mnt, "-f", "--readahead", size],
                                    stderr=subprocess.PIPE)
            try:
                wait_for(lambda: os.path.ismount(self.mnt), what="mount")
                dev = os.stat(self.mnt).st_dev
                with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
                    self.assertEqual(int(f.read()), kb)
            finally:
                proc.send_signal(signal.SIGTERM)
                self.assertEqual(proc.wait(timeout=20), 0)
                proc.stderr.close()


if __name__ == "__main__":
    unittest.main()
