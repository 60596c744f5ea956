"""Tests of the Python package on the CPU (torch from
tests/python/requirements.txt, in the venv tools/dev.sh test makes): round
trips, sharded saves by rank processes, async isolation, errors, interop
with the CLI, memory, and the package as pip installs it."""
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import st  # noqa: E402
from helpers import CkptTestCase  # noqa: E402

import shard_worker  # noqa: E402
import zygote  # noqa: E402


def bits(t):
    """A tensor's bytes, for bit-exact comparison (NaN payloads included)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_tensor(gen, dtype, shape):
    """Random bits of every pattern (NaNs, infinities, subnormals) for floats."""
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).to(torch.bool).reshape(shape)
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


TORCH_DTYPES = [getattr(torch, n) for n in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


class PythonTestCase(CkptTestCase):
    def setUp(self):
        super().setUp()
        self.r = ckptfs.init(self.repo, chunk_size=64 << 10)


def run_ranks(test, argv_of_rank, world, env_of_rank=None, fresh=False):
    """Runs one process per rank at once; asserts each exits 0 (showing its
    stderr otherwise) and returns their stdouts. The processes come from
    the test zygote (torch imported once, zygote.py) unless `fresh`."""
    start = (lambda argv, env: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)) \
        if fresh else zygote.spawn
    procs = [start(argv_of_rank(r), env_of_rank(r) if env_of_rank else None) for r in range(world)]
    # Every rank is waited for before any is judged: a failing rank must not
    # leave the others running with their pipes open.
    results = [p.communicate(timeout=300) for p in procs]
    # A rank that fails because another died (a reset connection) says
    # little: every failing rank's stderr is shown.
    failed = [f"rank {r} exited {p.returncode}:\n{err.decode(errors='replace')}"
              for r, (p, (_, err)) in enumerate(zip(procs, results)) if p.returncode != 0]
    test.assertEqual(failed, [], "\n".join(failed))
    return [out.decode() for out, _ in results]


class RoundTrips(PythonTestCase):
    def test_every_torch_dtype_round_trips_bit_exact_including_0d_and_zero_size(self):
        gen = torch.Generator().manual_seed(7)
        state = {}
        for dt in TORCH_DTYPES:
            name = str(dt).replace("torch.", "")
            state[f"{name}/matrix"] = random_tensor(gen, dt, (37, 129))
            state[f"{name}/scalar"] = random_tensor(gen, dt, ())
            state[f"{name}/empty"] = random_tensor(gen, dt, (0, 5))
        self.r.save("s", state, step=3)
        shown = {t["name"]: t for t in self.r.show("s")["tensors"]}
        self.assertEqual(shown["bfloat16/matrix"]["dtype"], "BF16")
        self.assertEqual(shown["bool/scalar"]["shape"], [])
        for key, value in state.items():
            back = self.r.tensor("s", key)
            self.assertEqual(back.dtype, value.dtype, key)
            self.assertEqual(back.shape, value.shape, key)
            self.assertEqual(bits(back), bits(value), key)
            target = torch.full_like(value, 0) if value.numel() else torch.empty_like(value)
            self.r.load("s", {key: target})
            self.assertEqual(bits(target), bits(value), key)

    def test_numpy_arrays_round_trip_whatever_their_layout_and_byte_order(self):
        rng = np.random.default_rng(3)
        arrays = {
            "f32": rng.standard_normal((33, 17)).astype(np.float32),
            "f16": rng.standard_normal(1000).astype(np.float16),
            "i64": rng.integers(-2**62, 2**62, size=(4, 5, 6)),
            "u8": rng.integers(0, 255, size=77, dtype=np.uint8),
            "bool": rng.integers(0, 2, size=(9, 9)).astype(bool),
            "big_endian": rng.standard_normal(50).astype(">f8"),
            "strided": rng.standard_normal((20, 30)).astype(np.float32)[::2, ::3],
            "scalar": np.float64(2.5),
        }
        self.r.save("s", arrays)
        for key, value in arrays.items():
            value = np.asarray(value)
            out = np.zeros(value.shape, dtype=value.dtype.newbyteorder("="))
            self.r.load("s", {key: out})
            np.testing.assert_array_equal(out, value, err_msg=key)
        # non-contiguous targets are filled too
        out = np.zeros((33, 34), np.float32)[:, ::2]
        self.r.load("s", {"f32": out})
        np.testing.assert_array_equal(out, arrays["f32"])
        t = torch.zeros(17, 33).t()
        self.r.load("s", {"f32": t})
        self.assertTrue(torch.equal(t, torch.from_numpy(arrays["f32"])))

    def test_blobs_round_trip(self):
        payload = bytes(range(256)) * 1000
        self.r.save("s", {"rng": payload, "empty": b"", "ba": bytearray(b"xyz"), "mv": memoryview(b"abc"),
                          "w": torch.ones(3)})
        self.assertEqual(self.r.blob("s", "rng"), payload)
        self.assertEqual(self.r.blob("s", "empty"), b"")
        self.assertEqual(self.r.blob("s", "ba"), b"xyz")
        self.assertEqual(self.r.blob("s", "mv"), b"abc")
        self.assertEqual(sorted(b["name"] for b in self.r.show("s")["blobs"]), ["ba", "empty", "mv", "rng"])

    def test_opening_a_repository_twice_in_one_process_shares_it(self):
        other = ckptfs.open(self.repo)
        self.r.save("a", {"x": torch.arange(5)})
        self.assertEqual([c["name"] for c in other.checkpoints()], ["a"])
        self.assertEqual(other.config["chunk_size"], 64 << 10)

    def test_a_repository_made_again_where_one_this_process_has_open_was_deleted_is_the_new_one(self):
        import shutil  # noqa: PLC0415

        self.r.save("old", {"x": torch.arange(5)})
        shutil.rmtree(self.repo)
        new = ckptfs.init(self.repo, chunk_size=128 << 10)
        self.assertEqual(new.checkpoints(), [])
        self.assertEqual(new.config["chunk_size"], 128 << 10)
        new.save("new", {"x": torch.arange(3)})
        # The old object keeps its own (deleted) repository; the new
        # checkpoint is in the new one's catalog, for any process.
        self.assertEqual([c["name"] for c in self.r.checkpoints()], ["old"])
        listed = subprocess.run([sys.executable, "-c", "import sys, ckptfs; "
                                 "print([c['name'] for c in ckptfs.open(sys.argv[1]).checkpoints()])", self.repo],
                                check=True, stdout=subprocess.PIPE).stdout.decode().strip()
        self.assertEqual(listed, "['new']")


class ShardedAcrossProcesses(PythonTestCase):
    def run_ranks(self, action, world):
        return run_ranks(self, lambda r: [sys.executable, shard_worker.__file__, action, self.repo, str(r), str(world)],
                         world)

    def test_box_and_flat_shards_saved_by_4_ranks_load_bit_exact_on_3(self):
        self.run_ranks("save", 4)
        [ckpt] = self.r.checkpoints()
        self.assertEqual((ckpt["name"], ckpt["world_size"], ckpt["committed_ranks"]), ("sharded", 4, 4))
        outs = self.run_ranks("load", 3)
        self.assertEqual([o.strip() for o in outs], ["ok"] * 3)
        # and whole, in this process
        expected = shard_worker.full_state()
        for key, value in expected.items():
            self.assertEqual(bits(self.r.tensor("sharded", key)), bits(value), key)

    def test_a_checkpoint_is_invisible_until_the_last_rank_commits(self):
        gen = torch.Generator().manual_seed(1)
        full = random_tensor(gen, torch.float32, (8, 4))
        for rank in range(3):
            self.r.save("part", {"w": full[2 * rank:2 * rank + 2]}, rank=rank, world_size=4,
                        shards={"w": ckptfs.Box((8, 4), (2 * rank, 0))})
            self.assertEqual(self.r.checkpoints(), [])
            self.assertEqual(self.r.checkpoints(include_pending=True)[0]["state"], "pending")
        with self.assertRaises(ckptfs.NotFoundError):
            self.r.tensor("part", "w")
        result = self.r.save("part", {"w": full[6:]}, rank=3, world_size=4,
                             shards={"w": ckptfs.Box((8, 4), (6, 0))})
        self.assertTrue(result["checkpoint_visible"])
        self.assertEqual(bits(self.r.tensor("part", "w")), bits(full))


class AsyncSave(PythonTestCase):
    def test_tensors_modified_right_after_async_save_returns_do_not_change_what_is_saved(self):
        weights = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB
        arr = np.arange(1 << 20, dtype=np.int64)
        expected_w, expected_a = weights.clone(), arr.copy()
        handle = self.r.async_save("a", {"w": weights, "a": arr}, step=1)
        weights.fill_(-1.0)
        arr[:] = 7
        self.assertGreater(handle.blocking_seconds, 0)
        result = handle.result(timeout=120)
        self.assertTrue(handle.done())
        self.assertTrue(result["checkpoint_visible"])
        self.assertTrue(torch.equal(self.r.tensor("a", "w"), expected_w))
        out = np.empty_like(arr)
        self.r.load("a", {"a": out})
        np.testing.assert_array_equal(out, expected_a)

    def test_the_staging_memory_is_kept_for_the_next_save_until_released(self):
        weights = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: staged
        for i in range(2):
            self.r.async_save(f"kept-{i}", {"w": weights}).result(timeout=120)
            self.assertTrue(torch.equal(self.r.tensor(f"kept-{i}", "w"), weights))
        self.assertGreaterEqual(ckptfs.release_staging_memory(), 4 << 20)
        self.assertEqual(ckptfs.release_staging_memory(), 0)

    def test_the_handle_raises_the_saves_error(self):
        self.r.save("taken", {"x": torch.zeros(2)})
        with self.assertRaises(ckptfs.AlreadyExistsError):
            self.r.async_save("taken", {"x": torch.zeros(2)}).result()
        # two ranks whose shards disagree in shape: the last commit fails
        self.r.save("bad", {"x": torch.zeros(2)}, rank=0, world_size=2,
                    shards={"x": ckptfs.Flat((4,), 0)})
        h = self.r.async_save("bad", {"x": torch.zeros(2)}, rank=1, world_size=2,
                              shards={"x": ckptfs.Flat((5,), 2)})
        with self.assertRaises(ckptfs.Error) as e:
            h.result(timeout=60)
        self.assertIn("'x'", str(e.exception))
        self.assertEqual([c["name"] for c in self.r.checkpoints()], ["taken"])

    def test_a_saver_does_not_hold_the_gil(self):
        ticks = [0]
        stop = threading.Event()

        def count():
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.001)
        counter = threading.Thread(target=count)
        counter.start()
        try:
            gen = torch.Generator().manual_seed(2)
            state = {f"t{i}": random_tensor(gen, torch.float32, (4 << 20,)) for i in range(8)}  # 128 MiB
            before = ticks[0]
            t0 = time.perf_counter()
            self.r.save("g", state)
            elapsed = time.perf_counter() - t0
            during = ticks[0] - before
        finally:
            stop.set()
            counter.join()
        # A thread sleeping 1 ms per tick manages well over a tick per 10 ms
        # unless the save holds the GIL throughout.
        self.assertGreater(during, elapsed * 100 * 0.5, (during, elapsed))


NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
                np.float16, np.float32, np.float64]


def random_layout(rng, base):
    """A random view of `base` (1-D): steps (negative too), an offset, a
    reshape and maybe a transpose."""
    n = base.shape[0]
    start = int(rng.integers(0, 8))
    step = int(rng.choice([1, 2, 3, -1, -2]))
    v = base[start::step] if step > 0 else base[n - 1 - start::step]
    m = (v.shape[0] // 6) * 6
    v = v[:m].reshape(2, 3, -1) if m else v[:0]
    if v.ndim == 3 and rng.random() < 0.5:
        v = v.transpose(2, 0, 1)
    return v


class SourceChangedDuringSaves(PythonTestCase):
    """Training code that writes its tensors while a save reads them (an
    optimizer step on another thread during save or async_save): each
    checkpoint may hold a mix of old and new values, the store never a chunk
    that fails its id, and a later save of the original values (which
    deduplicates against what the racing saves stored) loads bit-exact."""

    def test_100_saves_and_100_async_saves_of_changing_tensors_leave_every_chunk_verified(self):
        rng = np.random.default_rng(5)
        original = rng.standard_normal(1 << 18).astype(np.float32)  # 1 MiB: 16 chunks
        live = original.copy()
        weights = torch.from_numpy(live)  # the same memory
        stop = threading.Event()

        def optimizer_steps():
            g = np.random.default_rng(6)
            while not stop.is_set():
                at = int(g.integers(0, live.size - 4096))
                live[at:at + 4096] += np.float32(0.5)

        t = threading.Thread(target=optimizer_steps)
        t.start()
        try:
            for i in range(100):
                self.r.save(f"sync-{i}", {"w": weights, "a": live})
            handles = [self.r.async_save(f"async-{i}", {"w": weights}) for i in range(100)]
            for h in handles:
                h.result(timeout=120)
        finally:
            stop.set()
            t.join()
        self.run_ckpt("verify")
        self.r.save("clean", {"w": torch.from_numpy(original.copy())})
        self.assertEqual(bits(self.r.tensor("clean", "w")), original.tobytes())
        self.run_ckpt("verify")


class LongLivedProcessOnS3(PythonTestCase):
    """A process that only reads (a training job's evaluation loop, a
    notebook) keeps a repository on S3 open while another host removes a
    checkpoint, collects it and saves the name again: tensor, load and a
    second open give the checkpoint the store holds now, never the removed
    one's bytes."""

    def test_tensor_load_and_open_read_the_checkpoint_the_store_holds_now(self):
        self.require_s3()
        url = f"s3://ckptfs-test/py-stale-{os.getpid()}-{time.time_ns()}"
        here, there = self.path("cache-here"), self.path("cache-there")
        repo = ckptfs.init(url, cache_dir=here, chunk_size=64 << 10)
        old = torch.arange(40000, dtype=torch.float32)
        new = -torch.arange(40000, dtype=torch.float32)
        repo.save("x", {"w": old})
        self.assertTrue(torch.equal(repo.tensor("x", "w"), old))
        other = {"CKPT_CACHE_DIR": there}  # another host: a catalog of its own
        self.run_ckpt("-r", url, "rm", "x", env=other, use_repo=False)
        with self.assertRaises(ckptfs.NotFoundError):
            repo.tensor("x", "w")
        st.write(self.path("new.safetensors"), [("w", "F32", new.numpy())])
        self.run_ckpt("-r", url, "import", "x", self.path("new.safetensors"), env=other, use_repo=False)
        self.run_ckpt("-r", url, "gc", env=other, use_repo=False)
        self.assertTrue(torch.equal(repo.tensor("x", "w"), new))
        out = torch.empty(40000)
        repo.load("x", {"w": out})
        self.assertTrue(torch.equal(out, new))
        again = ckptfs.open(url, cache_dir=here)
        self.assertTrue(torch.equal(again.tensor("x", "w"), new))


class Layouts(PythonTestCase):
    """Random strides, dtypes and offsets through save and load: every layout
    is stored as its logical elements or refused, never read out of bounds
    (the sanitizer stage runs this with the module under ASan+UBSan)."""

    def test_random_layouts_round_trip_through_numpy_and_torch(self):
        rng = np.random.default_rng(11)
        for i in range(60):
            dtype = NUMPY_DTYPES[i % len(NUMPY_DTYPES)]
            base = (rng.integers(0, 255, size=4096 * 8, dtype=np.uint8)).view(dtype)[:4096].copy()
            if dtype == np.bool_:
                base = rng.integers(0, 2, size=4096).astype(np.bool_)  # copies of other bytes become 1
            src = random_layout(rng, base)
            expected = np.ascontiguousarray(src)
            value = torch.from_numpy(src.copy()) if i % 3 == 0 and dtype != np.uint16 and dtype != np.uint32 \
                and dtype != np.uint64 else src
            if isinstance(value, torch.Tensor) and src.ndim == 3:
                value = value.permute(2, 1, 0).contiguous().permute(2, 1, 0)  # strided again, same elements
            name = f"l{i}"
            blob = memoryview(base.view(np.uint8)[int(rng.integers(0, 16))::int(rng.choice([2, 3, -1, -3]))])
            self.r.save(name, {"x": value, "blob": blob})
            self.assertEqual(self.r.blob(name, "blob"), blob.tobytes(), i)
            out = np.zeros_like(expected)
            self.r.load(name, {"x": out})
            np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8), err_msg=str(i))
            # A strided target: every other element of a larger array.
            if expected.size:
                holder = np.zeros((2,) + expected.shape, dtype=expected.dtype)
                strided = holder[1]
                if strided.ndim == 3:
                    strided = holder.transpose(0, 3, 1, 2)[1].transpose(1, 2, 0)
                self.r.load(name, {"x": strided})
                np.testing.assert_array_equal(strided.view(np.uint8), expected.view(np.uint8), err_msg=str(i))
                self.assertFalse(holder[0].any())  # nothing written beside the target

    def test_read_only_and_overlapping_targets_are_refused(self):
        x = np.arange(4096, dtype=np.float32)
        self.r.save("s", {"x": x})
        ro = x.copy()
        ro.flags.writeable = False
        path = self.path("mapped.bin")
        x.tofile(path)
        mapped = np.memmap(path, dtype=np.float32, mode="r")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the array is not writable
            over_mapping = torch.from_numpy(mapped)
        expanded = torch.zeros(1).expand(4096)
        broadcast = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(4096,), strides=(0,))
        for target, says in ((ro, "read-only"), (mapped, "read-only"), (over_mapping, "read-only memory"),
                             (expanded, "share memory"), (broadcast, "share memory")):
            with self.assertRaisesRegex(ckptfs.InvalidArgumentError, says):
                self.r.load("s", {"x": target})
        self.assertEqual(np.fromfile(path, dtype=np.float32).tobytes(), x.tobytes())


class ForkSafety(PythonTestCase):
    def test_children_of_every_start_method_work_and_inherited_handles_refuse(self):
        p = subprocess.run([sys.executable, os.path.join(HERE, "fork_worker.py"), self.repo],
                           capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split(), ["child-fork", "child-forkserver", "child-spawn", "parent", "parent-async"])


class Errors(PythonTestCase):
    def test_a_state_or_targets_not_a_mapping_and_shards_of_missing_names_are_refused(self):
        self.r.save("s", {"a": np.zeros(2)})
        for call, message in ((lambda: self.r.save("x", [1]), "state_dict must be a mapping of names to values, not list"),
                              (lambda: self.r.save("x", {"a": np.zeros(2)}, shards={"b": ckptfs.Flat((4,), 0)}),
                               "shards names ['b'] that are not in the state dict"),
                              (lambda: self.r.load("s", [1]), "targets must be a mapping of names to tensors, not list"),
                              (lambda: self.r.load("s", {"a": np.zeros(2)}, shards={"b": ckptfs.Flat((4,), 0)}),
                               "shards names ['b'] that are not in targets")):
            with self.assertRaises(ckptfs.InvalidArgumentError) as e:
                call()
            self.assertEqual(str(e.exception), message)
        self.assertEqual([c["name"] for c in self.r.checkpoints()], ["s"])

    def test_wrong_dtype_or_shape_on_load_names_the_tensor_and_both_values(self):
        self.r.save("s", {"w": torch.zeros(4, 3, dtype=torch.bfloat16)})
        with self.assertRaises(ckptfs.InvalidArgumentError) as e:
            self.r.load("s", {"w": torch.zeros(4, 3)})
        self.assertEqual(str(e.exception), "tensor 'w' of checkpoint 's' is BF16, the target is F32")
        self.assertIsInstance(e.exception, ValueError)
        with self.assertRaises(ckptfs.InvalidArgumentError) as e:
            self.r.load("s", {"w": torch.zeros(3, 4, dtype=torch.bfloat16)})
        self.assertIn("[4, 3]", str(e.exception))
        with self.assertRaises(ckptfs.NotFoundError) as e:
            self.r.load("s", {"nope": torch.zeros(1)})
        self.assertEqual(str(e.exception), "checkpoint 's' has no tensor 'nope'")

    def test_unknown_checkpoint_raises_the_clis_message(self):
        with self.assertRaises(ckptfs.NotFoundError) as e:
            self.r.tensor("missing", "w")
        self.assertIsInstance(e.exception, LookupError)
        cli = self.error_of("show", "missing")
        self.assertEqual(cli.strip(), f"ckpt: error: {e.exception}")
        with self.assertRaises(ckptfs.NotFoundError):
            ckptfs.open(self.path("no-such-repo"))
        # an S3 repository in a bucket that does not exist (or, without an
        # S3 endpoint configured, the missing setting)
        expected = ckptfs.NotFoundError if os.environ.get("AWS_ENDPOINT_URL") else ckptfs.InvalidArgumentError
        with self.assertRaises(expected):
            ckptfs.open("s3://no-such-bucket-ckptfs/prefix")

    def test_a_shard_outside_its_tensor_is_refused_and_nothing_is_saved(self):
        with self.assertRaises(ckptfs.InvalidArgumentError) as e:
            self.r.save("s", {"w": torch.zeros(2, 4)}, shards={"w": ckptfs.Box((4, 4), (3, 0))})
        self.assertIn("'w'", str(e.exception))
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.save("s", {"w": torch.zeros(10)}, shards={"w": ckptfs.Flat((3, 3), 0)})
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.save("s", {"w": torch.zeros(2, 4)}, shards={"w": ckptfs.Box((4, 4, 1), (0, 0, 0))})
        # a region outside the tensor on load, too
        self.r.save("t", {"w": torch.zeros(4, 4)})
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.load("t", {"w": torch.zeros(2, 4)}, shards={"w": ckptfs.Box((4, 4), (3, 0))})
        self.assertEqual([c["name"] for c in self.r.checkpoints(include_pending=True)], ["t"])

    def test_values_that_are_not_tensors_are_named(self):
        with self.assertRaises(ckptfs.InvalidArgumentError) as e:
            self.r.save("s", {"step": 5})
        self.assertIn("'step' is a int", str(e.exception))
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.save("s", {"c": torch.zeros(2, dtype=torch.complex64)})
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.save("s", {"w": torch.zeros(2)}, shards={"v": ckptfs.Flat((2,), 0)})
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.save("bad name!", {"w": torch.zeros(2)})
        with self.assertRaises(ckptfs.AlreadyExistsError):
            ckptfs.init(self.repo)
        self.assertEqual(self.r.checkpoints(include_pending=True), [])

    def test_rm_of_an_unknown_name_removes_nothing(self):
        self.r.save("a", {"x": torch.zeros(2)})
        with self.assertRaises(ckptfs.NotFoundError):
            self.r.rm("a", "nope")
        self.assertEqual([c["name"] for c in self.r.checkpoints()], ["a"])


class GroupsAndOverwrite(PythonTestCase):
    def test_runs_as_groups_list_resume_and_retain_apart_and_a_name_is_saved_again_on_request(self):
        for run in ("run1", "run2"):
            for step in (1, 2, 3):
                self.r.save(f"{run}/step-{step}", {"w": torch.full((4,), float(step))}, step=step)
        self.r.save("run1/eval/step-2", {"w": torch.zeros(4)})
        names = lambda cs: [c["name"] for c in cs]  # noqa: E731
        self.assertEqual(names(self.r.checkpoints(group="run2/")), ["run2/step-1", "run2/step-2", "run2/step-3"])
        self.assertEqual(names(self.r.checkpoints(group="run1/eval")), ["run1/eval/step-2"])
        self.assertEqual(self.r.resume_point(group="run1")["name"], "run1/eval/step-2")
        self.assertEqual(self.r.resume_point(group="run2")["name"], "run2/step-3")
        self.assertIsNone(self.r.resume_point(group="run3"))
        # Retention of one run leaves the other alone, and "newest" is the run's.
        report = self.r.gc(keep_last=1, group="run2", dry_run=True)
        self.assertEqual([d["name"] for d in report["retention"] if not d["keep"]], ["run2/step-1", "run2/step-2"])
        self.r.gc(keep_last=1, group="run2")
        self.assertEqual(names(self.r.checkpoints(group="run2")), ["run2/step-3"])
        self.assertEqual(len(self.r.checkpoints(group="run1")), 4)
        # Saving a name again: refused, unless with overwrite.
        with self.assertRaises(ckptfs.AlreadyExistsError):
            self.r.save("run1/step-3", {"w": torch.ones(4)})
        self.r.save("run1/step-3", {"w": torch.ones(4)}, step=3, overwrite=True)
        self.assertTrue(torch.equal(self.r.tensor("run1/step-3", "w"), torch.ones(4)))
        self.assertEqual(len(self.r.checkpoints(include_pending=True)), 5)
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.save("run1", {"w": torch.ones(4)})  # a group, not a checkpoint
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.save("run1/100", {"w": torch.ones(4)})  # a grouped name's last part is not digits only
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.save("x", {"w": torch.ones(4)}, overwrite="yes")
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())


class Maintenance(PythonTestCase):
    def test_show_summarises_placements_and_fits_long_names_and_gc_and_du_agree_on_what_goes(self):
        gen = torch.Generator().manual_seed(8)
        long = "model.layers.0.self_attn.q_proj.weight_with_a_name_far_longer_than_the_column"
        full = {long: random_tensor(gen, torch.float32, (8, 16)), "cols": random_tensor(gen, torch.float32, (16, 8)),
                "flat": random_tensor(gen, torch.float32, (6, 5)), "norm": random_tensor(gen, torch.float32, (8,))}
        for rank in range(4):
            self.r.save("placed", {long: full[long][2 * rank:2 * rank + 2], "cols": full["cols"][:, 2 * rank:2 * rank + 2],
                                   "flat": full["flat"].reshape(-1)[7 * rank:min(30, 7 * rank + 7 + (2 if rank == 3 else 0))],
                                   "norm": full["norm"]},
                        rank=rank, world_size=4,
                        shards={long: ckptfs.Box((8, 16), (2 * rank, 0)), "cols": ckptfs.Box((16, 8), (0, 2 * rank)),
                                "flat": ckptfs.Flat((6, 5), 7 * rank)})
        lines = {line.split()[0]: line for line in self.run_ckpt("show", "placed").stdout.decode().splitlines()[6:]
                 if line.strip() and not line.startswith("TENSOR")}
        self.assertIn("4 column blocks", lines["cols"])
        self.assertIn("4 flat ranges", lines["flat"])
        self.assertIn("whole, replicated x4", lines["norm"])
        [cut] = [k for k in lines if "..." in k]
        self.assertEqual(len(cut), 60)
        self.assertTrue(long.startswith(cut.split("...")[0]) and long.endswith(cut.split("...")[1]))
        self.assertIn("4 row blocks", lines[cut])
        self.assertEqual(len({line.index("F32") for line in lines.values()}), 1)  # the columns stay aligned
        wide = self.run_ckpt("show", "placed", "--wide", "--shards").stdout.decode()
        self.assertIn(long + " ", wide)
        self.assertIn("box [0:16, 2:4]", wide)
        shown = json.loads(self.run_ckpt("show", "placed", "--json").stdout)
        self.assertEqual({t["name"]: t["placement"] for t in shown["tensors"]}["cols"], "4 column blocks")
        # du's "gc would reclaim" is what gc then reclaims, and gc says from where.
        self.r.save("other", {"x": random_tensor(gen, torch.float32, (256 << 10,))})
        self.r.rm("other")
        du = json.loads(self.run_ckpt("du", "--json").stdout)["total"]
        gc = json.loads(self.run_ckpt("gc", "--json").stdout)
        self.assertGreater(gc["bytes_reclaimed"], 1 << 20)
        self.assertEqual(du["reclaimable_bytes"], gc["bytes_reclaimed"])
        self.assertEqual(gc["bytes_reclaimed"], gc["dead_pack_bytes"] + gc["orphan_pack_bytes"] + gc["temporary_bytes"]
                         + gc["rewritten_pack_bytes"] - gc["rewritten_live_bytes"])
        self.r.save("again", {"x": random_tensor(gen, torch.float32, (256 << 10,))})
        self.r.rm("again")
        self.assertIn("in 1 pack with no live chunk", self.run_ckpt("gc").stdout.decode())

    def test_verify_diff_and_du_report_in_python_what_the_command_prints_as_json(self):
        # Each report has one description in the engine (ckpt/describe.h),
        # which the CLI's --json prints and the package returns.
        gen = torch.Generator().manual_seed(12)
        a = {"w": torch.randn(64, 32, generator=gen), "same": random_tensor(gen, torch.float32, (16,)),
             "gone": random_tensor(gen, torch.float32, (4,)), "meta": b"one"}
        b = dict(a, w=a["w"] + 1.0, meta=b"two", zero=torch.zeros(3))
        b.pop("gone")
        self.r.save("a", a)
        self.r.save("b", b)
        self.r.save("c", {"x": random_tensor(gen, torch.float32, (128 << 10,))})
        self.r.rm("c")

        def close(x, y):
            if isinstance(x, float) or isinstance(y, float):
                return isinstance(x, (int, float)) and isinstance(y, (int, float)) and abs(x - y) <= 1e-9 * max(1, abs(x))
            if isinstance(x, dict):
                return isinstance(y, dict) and x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
            if isinstance(x, list):
                return isinstance(y, list) and len(x) == len(y) and all(close(p, q) for p, q in zip(x, y))
            return x == y

        cli = json.loads(self.run_ckpt("diff", "--json", "--all", "a", "b").stdout)
        py = self.r.diff("a", "b", all=True)
        self.assertTrue(close(cli, py), (cli, py))
        self.assertEqual({d["name"]: d["status"] for d in py},
                         {"w": "changed", "same": "unchanged", "gone": "removed", "zero": "added", "meta": "changed"})
        self.assertEqual([d["name"] for d in self.r.diff("a", "b")], [d["name"] for d in py if d["changed"]])
        self.assertAlmostEqual(next(d for d in py if d["name"] == "w")["max_abs_diff"], 1.0, places=5)
        cli = json.loads(self.run_ckpt("du", "--json").stdout)
        self.assertTrue(close(cli, self.r.du()), (cli, self.r.du()))
        self.assertGreater(cli["total"]["reclaimable_bytes"], 0)
        self.assertEqual([c["name"] for c in self.r.du("a")["checkpoints"]], ["a"])
        self.assertNotIn("kinds", cli)
        cli = json.loads(self.run_ckpt("du", "--json", "--by-kind", "b").stdout)
        py = self.r.du("b", by_kind=True)
        self.assertTrue(close(cli, py), (cli, py))
        kinds = {k["kind"]: k for k in py["kinds"]}
        self.assertEqual(list(kinds), ["weights_16bit", "weights_fp32", "adam_exp_avg", "adam_exp_avg_sq", "other"])
        # w, same, zero are fp32 tensors; meta a blob.
        self.assertEqual((kinds["weights_fp32"]["tensors"], kinds["other"]["tensors"]), (3, 1))
        self.assertEqual(kinds["weights_fp32"]["logical_bytes"], (64 * 32 + 16 + 3) * 4)
        text = self.run_ckpt("du", "--by-kind").stdout.decode()
        self.assertIn("weights_fp32", text)
        self.assertNotIn("adam_exp_avg", text)  # no such tensors: not listed
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.du(by_kind="yes")
        cli = json.loads(self.run_ckpt("verify", "--json").stdout)
        self.assertTrue(close(cli, self.r.verify()), (cli, self.r.verify()))
        self.assertTrue(cli["ok"])
        self.assertEqual(cli["bad_chunks"], [])

    def test_a_load_in_progress_survives_rm_and_gc_from_another_process(self):
        gen = torch.Generator().manual_seed(6)
        old = {k: random_tensor(gen, torch.float32, (64 << 10,)) for k in ("a", "b")}
        self.r.save("old", old, step=1)
        self.r.save("new", {"a": torch.zeros(4)}, step=2)
        reports = []

        def meanwhile(done, total):
            if not reports:  # "a" is in; "b" is still to read
                self.run_ckpt("rm", "old")
                reports.append(json.loads(self.run_ckpt("gc", "--json").stdout))

        targets = {k: torch.empty_like(v) for k, v in old.items()}
        self.r.load("old", targets, progress=meanwhile)
        self.assertEqual(reports[0]["removed_kept_for_readers"], 1)
        for k in old:
            self.assertTrue(torch.equal(targets[k].view(torch.uint8), old[k].view(torch.uint8)), k)
        self.assertEqual([c["name"] for c in self.r.checkpoints()], ["new"])
        after = json.loads(self.run_ckpt("gc", "--json").stdout)  # the load is over: its lease went
        self.assertEqual(after["removed_collected"], 1)
        self.assertGreaterEqual(after["bytes_reclaimed"], 2 * (256 << 10))

    def test_pending_ranks_say_where_the_ranks_that_began_run(self):
        shards = {"x": ckptfs.Box((4,), (0,))}
        self.r.save("p", {"x": torch.zeros(2)}, rank=0, world_size=2, shards=shards)
        self.assertEqual(self.r.pending_ranks("p"), [])  # a local repository: every rank is on this host
        with self.assertRaises(ckptfs.NotFoundError):
            self.r.pending_ranks("nope")
        if not self.have_s3():
            return
        os.environ["CKPT_CACHE_DIR"] = os.path.join(self.tmp, "cache")
        try:
            s3 = ckptfs.init(f"s3://ckptfs-test/py-pending-{os.getpid()}-{time.time_ns()}")
            s3.save("p", {"x": torch.zeros(2)}, rank=1, world_size=3, shards={"x": ckptfs.Box((6,), (2,))})
            [rank] = s3.pending_ranks("p")
            self.assertEqual((rank["rank"], rank["committed"], rank["pid"]), (1, True, os.getpid()))
            self.assertTrue(rank["host"])
            self.assertGreater(rank["started_unix_ms"], 0)
        finally:
            del os.environ["CKPT_CACHE_DIR"]

    def test_open_and_init_take_the_cache_directory_as_the_cli_does(self):
        with self.assertRaises(ValueError):
            ckptfs.open(self.tmp, cache_dir="")
        if not self.have_s3():
            return
        url = f"s3://ckptfs-test/py-cache-{os.getpid()}-{time.time_ns()}"
        by_init, by_open, by_variable = (os.path.join(self.tmp, d) for d in ("init", "open", "variable"))
        os.environ["CKPT_CACHE_DIR"] = by_variable
        try:
            first = ckptfs.init(url, cache_dir=by_init)
            first.save("a", {"x": torch.arange(3.0)})
            self.assertTrue(os.path.exists(os.path.join(by_init, "repository")))
            # Another host's catalog (the store is the truth), read with one
            # request at a time.
            again = ckptfs.open(url, cache_dir=by_open, io_threads=1)
            self.assertTrue(torch.equal(again.tensor("a", "x"), torch.arange(3.0)))
            self.assertTrue(os.path.exists(os.path.join(by_open, "repository")))
            self.assertFalse(os.path.exists(by_variable), "the argument wins over CKPT_CACHE_DIR")
        finally:
            del os.environ["CKPT_CACHE_DIR"]

    def test_gc_keep_last_mirrors_the_cli(self):
        gen = torch.Generator().manual_seed(5)
        for step in range(4):
            self.r.save(f"step-{step}", {"w": random_tensor(gen, torch.float32, (64 << 10,))}, step=step)
        phases, done = [], []
        dry = self.r.gc(keep_last=2, dry_run=True, on_phase=phases.append)
        self.assertEqual(phases, ["finding live chunks"])
        self.assertEqual(dry["removed"], ["step-0", "step-1"])
        self.assertEqual(dry["retention"][3], {"name": "step-3", "step": 3, "keep": True,
                                               "why": "keep-last 2: the newest by step", "thin": False,
                                               "thin_why": "", "thin_tensors": 0, "thin_blobs": 0, "thin_bytes": 0})
        self.assertEqual(dry["retention"][0]["why"], "keep-last 2: the 4th newest by step")
        self.assertEqual(len(self.r.checkpoints()), 4)
        report = self.r.gc(keep_last=2, on_phase=phases.append, progress=lambda d, t: done.append((d, t)),
                           rewrite_below=0.99)
        self.assertEqual(report["removed"], ["step-0", "step-1"])
        self.assertEqual(phases[1:4], ["removing 2 checkpoints", "waiting for any other gc of this host",
                                       "finding live chunks"])
        self.assertIn("waiting for saves in progress", phases)
        self.assertTrue(phases[-1].startswith("deleting "), phases)
        with self.assertRaises(ZeroDivisionError):  # a callback's exception comes out of gc
            self.r.gc(on_phase=lambda line: 1 / 0)
        self.assertGreater(report["bytes_reclaimed"], 0)
        self.assertEqual([c["name"] for c in self.r.checkpoints()], ["step-2", "step-3"])
        self.r.rm("step-2")
        self.assertEqual([c["name"] for c in self.r.checkpoints()], ["step-3"])
        self.assertTrue(self.r.verify()["ok"])
        # A policy that would remove the newest (here: everything) is refused.
        with self.assertRaisesRegex(ckptfs.Error, r"every checkpoint \(1\); nothing was removed"):
            self.r.gc(keep_last=0)
        self.assertEqual(self.r.gc(keep_within="1h")["removed"], [])
        self.assertEqual(self.r.gc(keep_within=3600)["removed"], [])
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.gc(keep_within="soon")
        self.assertEqual(self.r.gc(keep_last=0, allow_removing_newest=True)["removed"], ["step-3"])
        self.assertEqual(self.r.checkpoints(), [])

    def test_gc_thins_old_checkpoints_of_a_trained_model_to_weights_that_load(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        weights = []
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(16, 64)).square().mean().backward()
            opt.step()
            state = {f"model.{k}": v for k, v in model.state_dict().items()}
            for param, moments in opt.state_dict()["state"].items():
                state.update({f"optim.state.{param}.{k}": v for k, v in moments.items()})
            state["optim.param_groups"] = json.dumps(opt.state_dict()["param_groups"]).encode()
            state["rng"] = torch.get_rng_state()
            self.r.save(f"step-{step}", state, step=step)
            weights.append({k: v.clone() for k, v in model.state_dict().items()})
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.gc(thin_older_than=0)
        with self.assertRaises(ckptfs.InvalidArgumentError):
            self.r.gc(thin_keep="model.*")
        before = self.r.du()["total"]["referenced_bytes"]
        report = self.r.gc(thin_older_than=1)
        self.assertEqual(report["thinned"], ["step-0", "step-1", "step-2"])
        self.assertTrue(all(d["thin_tensors"] > 0 for d in report["retention"][:3]))
        self.assertLess(self.r.du()["total"]["referenced_bytes"], before * 0.6)
        listed = self.r.checkpoints()
        self.assertEqual([c["name"] for c in listed], [f"step-{i}" for i in range(4)])
        self.assertIsNone(listed[-1]["thinned"])
        for step in range(3):
            shown = self.r.show(f"step-{step}")
            self.assertRegex(shown["thinned"], r"dropped \d+ tensors .* of optimizer, scheduler and RNG state")
            names = [t["name"] for t in shown["tensors"]]
            self.assertTrue(names and all(n.startswith("model.") for n in names), names)
            fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
            target = fresh.state_dict()
            self.r.load(f"step-{step}", {f"model.{k}": v for k, v in target.items()})
            for k, v in weights[step].items():
                self.assertTrue(torch.equal(target[k], v), k)
        # the newest keeps everything; a second run has nothing to do
        self.assertIn("rng", {t["name"] for t in self.r.show("step-3")["tensors"]})
        self.assertEqual(self.r.gc(thin_older_than=1)["thinned"], [])
        self.assertTrue(self.r.verify()["ok"])

    def test_checkpoints_and_show_have_the_fields_of_the_clis_json(self):
        import json
        self.r.save("a", {"w": torch.zeros(3, 2), "b": b"blob"}, step=9, tags={"run": "x"})
        cli_ls = json.loads(self.run_ckpt("ls", "--json").stdout)
        self.assertEqual(self.r.checkpoints(), cli_ls)
        cli_show = json.loads(self.run_ckpt("show", "a", "--json").stdout)
        self.assertEqual(self.r.show("a"), cli_show)
        self.assertEqual(cli_show["tags"], {"run": "x"})


class Copy(PythonTestCase):
    def test_copy_sends_only_what_the_destination_lacks_and_says_so(self):
        gen = torch.Generator().manual_seed(11)
        base = torch.randn(256 << 10, generator=gen)  # 1 MiB: 16 chunks
        self.r.save("a", {"w": base}, step=1)
        changed = base.clone()
        changed[:1000] += 1  # one chunk differs
        self.r.save("b", {"w": changed, "x": torch.arange(5)}, step=2)
        dst_path = os.path.join(self.tmp, "dst")
        dst = ckptfs.init(dst_path, chunk_size=64 << 10)
        phases, progress = [], []
        first = ckptfs.copy(self.r, dst_path, "a", on_phase=phases.append,
                            progress=lambda done, total: progress.append((done, total)))
        self.assertEqual([(c["name"], c["outcome"]) for c in first["checkpoints"]], [("a", "copied")])
        self.assertEqual(first["chunks_present"], 0)
        self.assertGreaterEqual(first["raw_bytes_sent"], base.numel() * 4)
        self.assertTrue(phases)
        self.assertEqual(progress[-1][0], progress[-1][1])
        self.assertTrue(torch.equal(dst.tensor("a", "w"), base))
        # The newest one, given by count: only its changed chunk and its
        # small tensor are sent; the rest is at the destination already.
        second = ckptfs.copy(self.repo, dst, last=1)
        [b] = second["checkpoints"]
        self.assertEqual((b["name"], b["outcome"]), ("b", "copied"))
        self.assertEqual(b["chunks_present"], 15)
        self.assertLessEqual(b["raw_bytes_sent"], (64 << 10) + 5 * 8)
        self.assertTrue(torch.equal(dst.tensor("b", "w"), changed))
        self.assertEqual(dst.show("b")["step"], 2)
        again = ckptfs.copy(self.r, dst, all=True)
        self.assertEqual([c["outcome"] for c in again["checkpoints"]], ["present", "present"])
        self.assertEqual((again["chunks_sent"], again["stored_bytes_sent"]), (0, 0))
        for bad in ({}, {"names": "a", "all": True}, {"last": 0}):
            with self.assertRaises(ckptfs.InvalidArgumentError):
                ckptfs.copy(self.r, dst, **bad)
        with self.assertRaises(ckptfs.NotFoundError):
            ckptfs.copy(self.r, dst, "nope")


class Progress(PythonTestCase):
    def test_save_and_load_report_progress_in_bytes(self):
        state = {"a": torch.zeros(1000), "b": np.zeros(500, np.int16), "blob": b"x" * 7}
        seen = []
        self.r.save("p", state, progress=lambda d, t: seen.append((d, t)))
        self.assertEqual(seen, [(4000, 5007), (5000, 5007), (5007, 5007)])
        seen.clear()
        self.r.async_save("q", {"a": torch.zeros(10)}, progress=lambda d, t: seen.append((d, t))).result()
        self.assertEqual(seen, [(40, 40)])
        seen.clear()
        self.r.load("p", {"a": torch.empty(1000), "b": np.empty(500, np.int16)},
                    progress=lambda d, t: seen.append((d, t)))
        self.assertEqual(seen, [(4000, 5000), (5000, 5000)])


class Statistics(PythonTestCase):
    def test_stats_match_torchs_nan_aware_figures(self):
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(50_000, generator=gen).to(torch.bfloat16)
        x[5] = float("nan")
        x[6] = float("-inf")
        self.r.save("s", {"x": x, "z": torch.zeros(4)})
        s = {t["name"]: t for t in self.r.stats("s")}
        f = x.float()[torch.isfinite(x.float())].double()
        self.assertEqual((s["x"]["nan_count"], s["x"]["inf_count"]), (1, 1))
        self.assertAlmostEqual(s["x"]["mean"], f.mean().item(), places=9)
        self.assertAlmostEqual(s["x"]["std"], f.std(unbiased=False).item(), places=9)
        self.assertAlmostEqual(s["x"]["l2_norm"], f.norm().item(), places=6)
        self.assertEqual(s["z"]["zero_count"], 4)
        self.assertEqual([t["name"] for t in self.r.stats("s", ["z"])], ["z"])
        with self.assertRaises(ckptfs.NotFoundError):
            self.r.stats("s", ["nope"])


class Interop(PythonTestCase):
    def test_import_safetensors_does_what_ckpt_import_does(self):
        gen = torch.Generator().manual_seed(3)
        a = torch.randn(64, 32, generator=gen)
        b = torch.arange(100, dtype=torch.int64)
        model = self.path("model")
        os.makedirs(os.path.join(model, "subdir"))
        st.write(os.path.join(model, "model-1.safetensors"), [("a", "F32", a.numpy())])
        st.write(os.path.join(model, "model-2.safetensors"), [("b", "I64", b.numpy())])
        with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}, f)
        with open(os.path.join(model, "config.json"), "w") as f:
            f.write('{"model_type": "test"}')
        with open(self.path("extra.bin"), "wb") as f:
            f.write(b"\x01\x02")
        got = self.r.import_safetensors("hf", model, step=7, tags={"src": "hf"}, blobs={"extra": self.path("extra.bin")})
        self.assertTrue(got["checkpoint_visible"])
        self.assertEqual(got["left_out"], [os.path.join(model, "subdir") + " (a directory)"])
        self.assertTrue(torch.equal(self.r.tensor("hf", "a"), a))
        self.assertTrue(torch.equal(self.r.tensor("hf", "b"), b))
        shown = json.loads(self.run_ckpt("show", "hf", "--json").stdout)
        self.assertEqual(sorted(x["name"] for x in shown["blobs"]), ["config.json", "extra"])
        self.assertEqual(shown["step"], 7)
        # the same checks as the CLI's, before anything is written
        st.write(self.path("part.safetensors"), [("c", "F32", np.zeros(4, np.float32))],
                 metadata={"ckptfs.shards": json.dumps({"c": {"global_shape": [8], "offsets": [0]}})})
        with self.assertRaisesRegex(ckptfs.InvalidArgumentError, "hold 4 of its 8 elements.*world_size="):
            self.r.import_safetensors("part", self.path("part.safetensors"))
        with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {"a": "model-2.safetensors", "b": "model-2.safetensors"}}, f)
        with self.assertRaisesRegex(ckptfs.InvalidArgumentError, "places tensor 'a'"):
            self.r.import_safetensors("bad-index", model)
        self.assertEqual([c["name"] for c in self.r.checkpoints(include_pending=True)], ["hf"])
        half = self.r.import_safetensors("part", self.path("part.safetensors"), rank=0, world_size=2)
        self.assertFalse(half["checkpoint_visible"])

    def test_the_cli_reads_what_python_saved(self):
        gen = torch.Generator().manual_seed(11)
        w = random_tensor(gen, torch.bfloat16, (16, 8))
        x = torch.randn(5, 7, generator=gen)
        self.r.save("py", {"w": w, "x": x, "meta": b"{}"})
        with open(self.path("x.npy"), "wb") as f:
            self.run_ckpt("cat", "py", "x", "--format", "npy", stdout=f)
        np.testing.assert_array_equal(np.load(self.path("x.npy")), x.numpy())
        with open(self.path("w.npy"), "wb") as f:
            self.run_ckpt("cat", "py", "w", "--format", "npy", stdout=f)
        self.assertEqual(np.load(self.path("w.npy")).tobytes(), bits(w))  # bf16 bits as <u2
        self.run_ckpt("export", "py", self.path("py.safetensors"))
        tensors, _ = st.read(self.path("py.safetensors"))
        np.testing.assert_array_equal(tensors["x"][1], x.numpy())
        self.assertEqual(tensors["w"][0], "BF16")
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())

    def test_exported_safetensors_load_with_the_safetensors_package_as_torch_weights(self):
        try:
            from safetensors import safe_open
            from safetensors.torch import load_file
        except ImportError:
            self.skipTest("the safetensors package is not installed")
        state = {"w": torch.randn(4, 6).to(torch.bfloat16), "b": torch.arange(5, dtype=torch.int32)}
        self.r.save("st", state, step=9)
        out = self.path("out.safetensors")
        self.run_ckpt("export", "st", out)
        with safe_open(out, framework="pt") as f:
            self.assertEqual(f.metadata(), {"format": "pt", "ckptfs.checkpoint": "st", "ckptfs.step": "9"})
        got = load_file(out)
        self.assertEqual(sorted(got), ["b", "w"])
        for k in state:
            self.assertEqual(bits(got[k]), bits(state[k]), k)

    def test_python_reads_what_the_cli_imported(self):
        rng = np.random.default_rng(4)
        a = rng.standard_normal((6, 10)).astype(np.float32)
        b = rng.integers(0, 1000, size=33).astype(np.int32)
        for rank in range(2):
            st.write(self.path(f"r{rank}.safetensors"), [("a", "F32", a[3 * rank:3 * rank + 3])],
                     metadata={"ckptfs.shards": '{"a": {"global_shape": [6, 10], "offsets": [%d, 0]}}' % (3 * rank)})
        for rank in range(2):
            self.run_ckpt("import", "cli", self.path(f"r{rank}.safetensors"), "--rank", str(rank),
                          "--world-size", "2", "--step", "4")
        st.write(self.path("b.safetensors"), [("b", "I32", b)])
        self.run_ckpt("import", "cli2", self.path("b.safetensors"))
        np.testing.assert_array_equal(self.r.tensor("cli", "a").numpy(), a)
        out = np.zeros((6, 5), np.float32)
        self.r.load("cli", {"a": out}, shards={"a": ckptfs.Box((6, 10), (0, 5))})
        np.testing.assert_array_equal(out, a[:, 5:])
        np.testing.assert_array_equal(self.r.tensor("cli2", "b").numpy(), b)
        self.assertEqual(self.r.checkpoints()[0]["step"], 4)


class Memory(PythonTestCase):
    def test_saving_1_gib_of_cpu_tensors_holds_no_second_host_copy(self):
        # In a fresh process, so the peak belongs to this save alone.
        code = (
            "import resource, sys, torch, ckptfs\n"
            "state = {f't{i}': torch.empty(64 << 20, dtype=torch.float32) for i in range(4)}\n"
            "for t in state.values(): t.uniform_()\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "ckptfs.open(sys.argv[1]).save('big', state)\n"
            "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "print(before, after)\n")
        p = subprocess.run([sys.executable, "-c", code, self.repo], capture_output=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        before, after = (int(v) * 1024 for v in p.stdout.split())
        grown = after - before
        print(f"\npeak RSS {after / 2**30:.2f} GiB, {grown / 2**20:.0f} MiB above the 1 GiB of tensors", file=sys.stderr)
        self.assertLess(grown, 256 << 20)  # a second copy would be 1 GiB


class Install(unittest.TestCase):
    @unittest.skipUnless(os.environ.get("CKPTFS_BUILD_DIR"), "CKPTFS_BUILD_DIR (set by ctest) names the build")
    def test_cmake_install_puts_an_importable_package_beside_the_cli(self):
        import shutil
        import tempfile
        prefix = tempfile.mkdtemp(prefix="ckptfs-install-")
        try:
            subprocess.run(["cmake", "--install", os.environ["CKPTFS_BUILD_DIR"], "--prefix", prefix],
                           check=True, capture_output=True, timeout=300)
            self.assertTrue(os.access(os.path.join(prefix, "bin", "ckpt"), os.X_OK))
            # (include/ckptfs holds the engine's headers: not a package)
            [site] = [root for root, dirs, _ in os.walk(prefix)
                      if "ckptfs" in dirs and os.path.exists(os.path.join(root, "ckptfs", "__init__.py"))]
            env = dict(os.environ, PYTHONPATH=site)
            p = subprocess.run([sys.executable, "-c", "import ckptfs, ckptfs.torch; print(ckptfs.__file__)"],
                               env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertTrue(p.stdout.startswith(prefix), p.stdout)
            self.assertTrue(site.endswith(os.path.join("python3", "dist-packages")), site)
        finally:
            shutil.rmtree(prefix, ignore_errors=True)


def without_pythonpath():
    """The environment of a process that sees only what is installed in
    this interpreter's environment (ctest points PYTHONPATH at the build)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


class NumpyOnly(unittest.TestCase):
    def test_numpy_only_use_never_imports_torch(self):
        code = (
            "import sys, tempfile, numpy as np, ckptfs\n"
            "repo = ckptfs.init(tempfile.mkdtemp() + '/r')\n"
            "a = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
            "repo.save('s', {'a': a, 'blob': b'xyz'})\n"
            "repo.async_save('t', {'a': a}).result()\n"
            "out = np.zeros_like(a)\n"
            "repo.load('s', {'a': out})\n"
            "assert (out == a).all() and repo.blob('s', 'blob') == b'xyz'\n"
            "print('torch' in sys.modules)\n")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.strip(), "False", "a NumPy-only save and load imported torch")


@unittest.skipUnless(sys.prefix != sys.base_prefix or os.environ.get("CKPTFS_REQUIRE_WHEEL"),
                     "not run in a venv (tools/dev.sh test installs the wheel into build/venv)")
@unittest.skipIf(os.environ.get("CKPTFS_QUICK_CHECK") and not os.environ.get("CKPTFS_REQUIRE_WHEEL"),
                 "tools/dev.sh check builds no wheel (tools/dev.sh test does, and runs these)")
class Wheel(unittest.TestCase):
    """The package as `pip install .` leaves it in a venv: tools/dev.sh test
    builds the wheel from its build tree and installs it into build/venv."""

    def setUp(self):
        p = subprocess.run([sys.executable, "-c", "import ckptfs; print(ckptfs.__file__)"],
                           env=without_pythonpath(), capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            self.fail(f"ckptfs is not installed in {sys.prefix} (pip install .): {p.stderr.strip()}")
        self.package = os.path.dirname(p.stdout.strip())
        self.assertTrue(self.package.startswith(sys.prefix), self.package)

    def test_pip_install_gives_the_package_and_the_ckpt_cli_on_path(self):
        ckpt = os.path.join(os.path.dirname(sys.executable), "ckpt")
        self.assertTrue(os.access(ckpt, os.X_OK), f"{ckpt} is not an installed program")
        p = subprocess.run([ckpt, "--version"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        code = "import ckptfs; print(ckptfs.__version__)"
        version = subprocess.run([sys.executable, "-c", code], env=without_pythonpath(), capture_output=True,
                                 text=True, timeout=60, check=True).stdout.strip()
        self.assertIn(version, p.stdout)
        # The installed CLI and package work on one repository.
        import tempfile
        repo = tempfile.mkdtemp(prefix="ckptfs-wheel-") + "/r"
        subprocess.run([ckpt, "-r", repo, "init"], check=True, capture_output=True, timeout=60)
        code = ("import sys, numpy as np, ckptfs\n"
                "ckptfs.open(sys.argv[1]).save('s', {'w': np.ones(5, np.float32)})\n")
        subprocess.run([sys.executable, "-c", code, repo], env=without_pythonpath(), check=True, timeout=60)
        ls = subprocess.run([ckpt, "-r", repo, "ls", "--json"], capture_output=True, text=True, timeout=60,
                            check=True).stdout
        self.assertIn('"s"', ls)
        # fsspec finds ckptfs:// through the package's entry point, with
        # nothing imported or registered first.
        code = ("import sys, fsspec\n"
                "fs = fsspec.filesystem('ckptfs')\n"
                "fs.pipe('ckptfs://' + sys.argv[1] + '/d/f.txt', b'hello')\n"
                "print(type(fs).__module__, fsspec.open('ckptfs://' + sys.argv[1] + '/d/f.txt').open().read())\n")
        p = subprocess.run([sys.executable, "-c", code, repo], env=without_pythonpath(), capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.strip(), "ckptfs.filesystem b'hello'")

    def test_torch_is_an_extra_and_never_a_plain_dependency(self):
        code = ("import json, importlib.metadata as m\n"
                "d = m.metadata('ckptfs')\n"
                "print(json.dumps({'extras': d.get_all('Provides-Extra') or [], "
                "'requires': d.get_all('Requires-Dist') or []}))\n")
        got = json.loads(subprocess.run([sys.executable, "-c", code], env=without_pythonpath(), capture_output=True,
                                        text=True, timeout=60, check=True).stdout)
        self.assertIn("torch", got["extras"])
        torch_reqs = [r for r in got["requires"] if r.split(";")[0].strip().startswith("torch")]
        self.assertTrue(torch_reqs, got)
        for r in torch_reqs:
            self.assertIn('extra == "torch"', r)
            # Pinned to the tested release: an unpinned torch pulls a CUDA build of several GB.
            self.assertEqual(r.split(";")[0].replace(" ", ""), "torch==2.13.0", r)

    def test_type_checkers_see_the_public_api(self):
        for f in ("py.typed", "_core.pyi"):
            self.assertTrue(os.path.exists(os.path.join(self.package, f)), f)
        try:
            import mypy.api
        except ImportError:
            self.skipTest("mypy is not installed")
        import tempfile
        d = tempfile.mkdtemp(prefix="ckptfs-types-")
        user = os.path.join(d, "user.py")
        with open(user, "w") as f:
            f.write("import ckptfs\n"
                    "repo = ckptfs.open('/tmp/r')\n"
                    "names: list[str] = [c['name'] for c in repo.checkpoints()]\n"
                    "repo.gc(keep_last='three')\n")
        out, err, code = mypy.api.run([user, "--no-incremental", "--cache-dir", os.path.join(d, "cache")])
        # The package's types are found (no missing stubs or py.typed), and
        # the one wrong argument is reported.
        self.assertNotIn("missing library stubs or py.typed", out)
        self.assertIn('Argument "keep_last" to "gc" of "Repository" has incompatible type "str"', out)
        self.assertEqual(out.count("error:"), 1, out)


def _binding_parameters(doc):
    """[(name, has_default)] from a pybind11 signature line
    ("f(self: T, a: list[int], b: bool = False) -> R"), self left out."""
    line = doc.splitlines()[0]
    inner = line[line.index("(") + 1:line.rindex(") ->")]
    params, depth, cur = [], 0, ""
    for ch in inner:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            params.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        params.append(cur)
    got = [(p.split(":")[0].strip(), "=" in p) for p in params]
    return [g for g in got if g[0] != "self"]


class Stubs(unittest.TestCase):
    """The type stub of the binding (ckptfs/_core.pyi) against the module
    built: every name there is in the stub, and every function and method
    takes the parameters (names, order, which have defaults) the stub says."""

    def stub(self):
        import ast  # noqa: PLC0415

        path = os.path.join(os.path.dirname(ckptfs.__file__), "_core.pyi")
        with open(path) as f:
            return ast.parse(f.read()), path

    def test_every_function_and_method_takes_the_parameters_its_stub_names(self):
        import ast  # noqa: PLC0415

        from ckptfs import _core  # noqa: PLC0415

        tree, path = self.stub()

        def stub_parameters(fn):
            args = fn.args
            positional = args.posonlyargs + args.args
            defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
            got = [(a.arg, d) for a, d in zip(positional, defaults)]
            got += [(a.arg, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
            return [g for g in got if g[0] != "self"]

        checked = 0
        scopes = [(None, tree.body)] + [(n.name, n.body) for n in tree.body if isinstance(n, ast.ClassDef)]
        for cls, body in scopes:
            owner = _core if cls is None else getattr(_core, cls)
            for fn in body:
                if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("__"):
                    continue
                if any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
                    continue
                where = f"{cls + '.' if cls else ''}{fn.name} ({path}:{fn.lineno})"
                runtime = getattr(owner, fn.name, None)
                self.assertIsNotNone(runtime, f"{where} is in the stub but not in the module")
                self.assertEqual(stub_parameters(fn), _binding_parameters(runtime.__doc__), where)
                checked += 1
        self.assertGreater(checked, 40)

    def test_stubtest_finds_the_module_and_its_stub_agree(self):
        try:
            import mypy.stubtest  # noqa: F401, PLC0415
        except ImportError:
            if os.environ.get("CKPTFS_REQUIRE_WHEEL"):
                raise
            self.skipTest("mypy is not installed")
        # pybind11's classes have their own metaclass, and those made only
        # by the module an __init__ of (*args, **kwargs) that raises:
        # stubtest reports both, and nothing else is allowed.
        allow = os.path.join(tempfile.mkdtemp(prefix="ckptfs-stubtest-"), "allow.txt")
        with open(allow, "w") as f:
            f.write("ckptfs._core.(Reader|Repository|SaveHandle|StagingBuffer|Writer)\n"
                    "ckptfs._core.(Reader|Repository|SaveHandle|Writer).__init__\n")
        p = subprocess.run([sys.executable, "-m", "mypy.stubtest", "ckptfs._core", "--allowlist", allow,
                            "--mypy-config-file", os.devnull], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(ckptfs.__file__))))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)


class Documentation(unittest.TestCase):
    def test_signatures_and_docstrings_are_visible_to_help(self):
        sig = inspect.signature(ckptfs.Repository.save)
        self.assertEqual(list(sig.parameters)[:3], ["self", "name", "state_dict"])
        self.assertEqual(sig.parameters["step"].kind, inspect.Parameter.KEYWORD_ONLY)
        for f in (ckptfs.init, ckptfs.open, ckptfs.Repository.save, ckptfs.Repository.async_save,
                  ckptfs.Repository.load, ckptfs.Repository.tensor, ckptfs.Repository.blob,
                  ckptfs.Repository.checkpoints, ckptfs.Repository.show, ckptfs.Repository.rm,
                  ckptfs.Repository.gc, ckptfs.Repository.import_safetensors, ckptfs.SaveHandle.result,
                  ckptfs.Box, ckptfs.Flat):
            self.assertTrue(f.__doc__ and len(f.__doc__) > 40, f)


if __name__ == "__main__":
    unittest.main()
