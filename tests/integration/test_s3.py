"""Integration tests of repositories on S3 (a real Ceph RGW, which the test
command starts with tools/s3-server.sh): simulated hosts that share nothing
but the S3 endpoint save, commit, list, mount, collect and get killed.

A simulated host is a process tree with its own mount namespace (unshare -m)
and a private tmpfs at one fixed path holding its catalog, so every host
uses the same path for different storage and an accidentally shared local
file fails the test. Without the privileges for namespaces, hosts are plain
processes with a cache directory each.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
import uuid

import numpy as np

import st
from helpers import CKPT, ckpt_for

HAVE_S3 = bool(os.environ.get("AWS_ENDPOINT_URL"))
HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None
HOST_STATE = "/tmp/ckptfs-simulated-host"  # each host's private tmpfs
BUCKET = "ckptfs-integration"
KILL_POINTS = 30


def namespaces_work():
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        return False
    return subprocess.run(["unshare", "-m", "true"], stderr=subprocess.DEVNULL).returncode == 0


NAMESPACES = namespaces_work()


def require_s3():
    if HAVE_S3:
        return
    why = "no S3 server: AWS_ENDPOINT_URL is unset (start one with tools/s3-server.sh start DIR)"
    if os.environ.get("CKPTFS_REQUIRE_S3"):
        raise AssertionError(why)
    raise unittest.SkipTest(why)


def processes_running(args):
    """The pids of the processes whose command line ends with `args`."""
    tail = "\0".join(args).encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().endswith(tail):
                    pids.append(int(entry))
        except OSError:
            pass  # gone meanwhile
    return pids


class Host:
    """One simulated host."""

    def __init__(self, tmp, name, namespace=True):
        self.name = name
        self.proc = None
        if NAMESPACES and namespace:
            os.makedirs(HOST_STATE, exist_ok=True)
            self.proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c",
                 f"mount -t tmpfs -o size=1g tmpfs {HOST_STATE} && echo ready && exec sleep 100000"],
                stdout=subprocess.PIPE)
            if self.proc.stdout.readline().strip() != b"ready":
                raise AssertionError(f"host {name}: could not set up its namespace")
            self.cache = HOST_STATE + "/cache"
            self.prefix = ["nsenter", "-t", str(self.proc.pid), "-m", "--"]
        else:
            self.cache = os.path.join(tmp, "host-" + name)
            self.prefix = []

    def command(self, *args, env=None):
        return [*self.prefix, ckpt_for(env), *args]

    def env(self, extra=None):
        e = dict(os.environ)
        e.pop("CKPT_REPO", None)
        e.pop("CKPTFS_TEST_CRASH_AT", None)
        e["CKPT_CACHE_DIR"] = self.cache
        e.update(extra or {})
        return e

    def run(self, *args, ok=True, env=None, timeout=300):
        p = subprocess.run(self.command(*args, env=env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=self.env(env), timeout=timeout)
        if ok and p.returncode != 0:
            raise AssertionError(f"host {self.name}: ckpt {' '.join(args)} failed ({p.returncode}): "
                                 f"{p.stderr.decode(errors='replace')}")
        return p

    def start(self, *args, env=None):
        return subprocess.Popen(self.command(*args, env=env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=self.env(env))

    def names(self, repo, pending=False):
        out = self.run("-r", repo, "ls", "--json", *(["--all"] if pending else [])).stdout
        return [c["name"] for c in json.loads(out)]

    def digest(self, repo, ckpt, tensor):
        return hashlib.sha256(self.run("-r", repo, "cat", ckpt, tensor).stdout).hexdigest()

    def wipe(self):
        """Deletes the host's local state."""
        subprocess.run([*self.prefix, "rm", "-rf", self.cache], check=True)

    def close(self):
        if self.proc:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


class S3Case(unittest.TestCase):
    """A fresh repository (its own prefix) and fresh hosts per test."""

    def setUp(self):
        require_s3()
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-s3-")
        self.repo = f"s3://{BUCKET}/{self.id().split('.')[-1]}-{uuid.uuid4().hex[:8]}"
        self.hosts = []
        self.rng = np.random.default_rng(3)

    def tearDown(self):
        for h in self.hosts:
            h.close()
        mnt = os.path.join(self.tmp, "mnt")
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", mnt])
        shutil.rmtree(self.tmp, ignore_errors=True)

    def host(self, name):
        h = Host(self.tmp, name)
        self.hosts.append(h)
        return h

    def path(self, name):
        return os.path.join(self.tmp, name)

    def sharded_files(self, tensors, world):
        """tensors: {name: (dtype, array)}, split by rows into `world` box
        shards; returns one safetensors file per rank."""
        files = []
        for r in range(world):
            entries, shards = [], {}
            for name, (dt, a) in tensors.items():
                rows = np.array_split(np.arange(a.shape[0]), world)[r]
                part = a[rows[0]:rows[-1] + 1]
                entries.append((name, dt, part))
                shards[name] = {"global_shape": list(a.shape), "offsets": [int(rows[0])] + [0] * (a.ndim - 1)}
            p = self.path(f"rank{r}.safetensors")
            st.write(p, entries, {"ckptfs.shards": json.dumps(shards)})
            files.append(p)
        return files


class MultiHost(S3Case):
    def model(self):
        return {
            "layers.0.w": ("F32", self.rng.standard_normal((96, 700)).astype(np.float32)),
            "layers.0.b": ("BF16", st.random_array(self.rng, "BF16", (40, 33))),
            "embed": ("F16", self.rng.standard_normal((64, 64)).astype(np.float16)),
        }

    def test_four_ranks_on_three_hosts_commit_and_read_back_on_a_fourth(self):
        a, b, c = (self.host(n) for n in "abc")
        d = Host(self.tmp, "d", namespace=False)  # its mount must be visible here
        self.hosts.append(d)
        a.run("-r", self.repo, "init", "--chunk-size", "64K", "--pack-size", "1M")
        model = self.model()
        files = self.sharded_files(model, 4)
        placement = [a, a, b, c]  # ranks 0 and 1 share host a
        procs = [placement[r].start("-r", self.repo, "import", "--rank", str(r), "--world-size", "4",
                                    "--step", "100", "--json", "step-100", files[r]) for r in range(4)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            self.assertEqual(p.returncode, 0, err.decode())
            outs.append(json.loads(out))
        self.assertGreaterEqual(sum(o["visible"] for o in outs), 1, outs)
        for h in (a, b, c, d):
            self.assertEqual(h.names(self.repo), ["step-100"], h.name)
        listing = json.loads(d.run("-r", self.repo, "ls", "--json").stdout)[0]
        self.assertEqual((listing["step"], listing["world_size"]), (100, 4))
        for name, (_, arr) in model.items():
            self.assertEqual(d.digest(self.repo, "step-100", name), sha(arr), name)
        d.run("-r", self.repo, "verify")
        # exported whole by the fourth host: one file, not four
        out = self.path("export.safetensors")
        d.run("-r", self.repo, "export", "step-100", out)
        back, _ = st.read(out)
        for name, (dt, arr) in model.items():
            self.assertEqual(back[name][0], dt)
            self.assertEqual(sha(back[name][1]), sha(arr), name)
        self.assertEqual(d.names(self.repo, pending=True), ["step-100"])
        if not HAVE_FUSE:
            self.skipTest("no FUSE here (/dev/fuse, fusermount3): the read through a mount did not run")
        # mounted on the fourth host, and read at another sharding than the
        # ranks' rows: column halves of every tensor through the mount
        mnt = self.path("mnt")
        os.makedirs(mnt)
        d.run("-r", self.repo, "mount", mnt)
        try:
            for name, (_, arr) in model.items():
                view = np.load(os.path.join(mnt, "step-100", name + ".npy"), mmap_mode="r")
                half = arr.shape[1] // 2
                for cols in (slice(0, half), slice(half, None)):
                    got = np.ascontiguousarray(view[:, cols])
                    self.assertEqual(got.tobytes(), np.ascontiguousarray(arr[:, cols]).view(got.dtype).tobytes(),
                                     name)
                del view
        finally:
            subprocess.run(["fusermount3", "-u", mnt])

    def test_a_partial_checkpoint_is_invisible_on_every_host(self):
        a, b, c = (self.host(n) for n in "abc")
        a.run("-r", self.repo, "init", "--chunk-size", "64K")
        model = self.model()
        files = self.sharded_files(model, 3)
        a.run("-r", self.repo, "import", "--rank", "0", "--world-size", "3", "s", files[0])
        b.run("-r", self.repo, "import", "--rank", "2", "--world-size", "3", "s", files[2])
        for h in (a, b, c):
            self.assertEqual(h.names(self.repo), [], h.name)
            # show says what the pending checkpoint waits for, on every host
            self.assertIn("2 of 3 committed (0,2); missing 1", h.run("-r", self.repo, "show", "s").stdout.decode())
            self.assertNotEqual(h.run("-r", self.repo, "cat", "s", "embed", ok=False).returncode, 0)
        # pending on every host, with the ranks that are in
        for h in (a, b, c):
            pending = json.loads(h.run("-r", self.repo, "ls", "--all", "--json").stdout)
            self.assertEqual([(p["name"], p["state"], p["committed_ranks"], p["world_size"]) for p in pending],
                             [("s", "pending", 2, 3)], h.name)
            self.assertEqual((pending[0]["ranks_committed"], pending[0]["ranks_missing"]), ([0, 2], [1]))
            # and where the ranks that began run; rank 1 never began
            shown = json.loads(h.run("-r", self.repo, "show", "s", "--json").stdout)
            self.assertEqual([(r["rank"], r["committed"]) for r in shown["ranks_started"]], [(0, True), (2, True)])
            self.assertTrue(all(r["host"] and r["pid"] > 0 for r in shown["ranks_started"]))
            self.assertIn("not begun: 1", h.run("-r", self.repo, "show", "s").stdout.decode())
        # a disagreeing world size is refused before anything is written
        err = c.run("-r", self.repo, "import", "--rank", "1", "--world-size", "4", "s", files[1], ok=False).stderr
        self.assertIn("world size", err.decode())
        c.run("-r", self.repo, "import", "--rank", "1", "--world-size", "3", "s", files[1])
        for h in (a, b, c):
            self.assertEqual(h.names(self.repo), ["s"], h.name)

    def test_a_failed_tiling_check_names_the_tensor_and_stays_invisible(self):
        a, b = self.host("a"), self.host("b")
        a.run("-r", self.repo, "init", "--chunk-size", "64K")
        w = self.rng.standard_normal((8, 16)).astype(np.float32)
        for r, rows in enumerate([(0, 5), (4, 8)]):  # rows 4 overlap with different bytes
            part = w[rows[0]:rows[1]].copy()
            if r == 1:
                part[0] += 1
            p = self.path(f"bad{r}.safetensors")
            st.write(p, [("w", "F32", part)],
                     {"ckptfs.shards": json.dumps({"w": {"global_shape": [8, 16], "offsets": [rows[0], 0]}})})
            h = (a, b)[r]
            proc = h.run("-r", self.repo, "import", "--rank", str(r), "--world-size", "2", "bad", p, ok=(r == 0))
        self.assertEqual(proc.returncode, 1)
        self.assertIn("'w'", proc.stderr.decode())
        for h in (a, b, self.host("c")):
            self.assertEqual(h.names(self.repo), [])
        # rm clears the failed attempt everywhere
        a.run("-r", self.repo, "rm", "bad")
        self.assertEqual(b.names(self.repo, pending=True), [])

    @unittest.skipUnless(HAVE_FUSE, "no /dev/fuse or fusermount3: FUSE tests need them")
    def test_a_mount_shows_what_other_hosts_commit_within_its_poll_interval(self):
        a = self.host("a")
        reader = Host(self.tmp, "mounting", namespace=False)  # its mount must be visible here
        a.run("-r", self.repo, "init", "--chunk-size", "64K")
        model = self.model()
        files = self.sharded_files(model, 2)
        for r in range(2):
            a.run("-r", self.repo, "import", "--rank", str(r), "--world-size", "2", "one", files[r])
        mnt = self.path("mnt")
        os.makedirs(mnt)
        reader.run("-r", self.repo, "mount", "--poll", "1", mnt)
        try:
            with open(os.path.join(mnt, "one", "layers.0.w.npy"), "rb") as f:
                arr = np.load(f)
            self.assertEqual(sha(arr), sha(model["layers.0.w"][1]))
            self.assertEqual(sorted(os.listdir(mnt)), ["latest", "one"])
            st.write(self.path("two.safetensors"), [("x", "F32", np.arange(10, dtype=np.float32))])
            a.run("-r", self.repo, "import", "two", self.path("two.safetensors"))
            deadline = time.monotonic() + 10
            while "two" not in os.listdir(mnt) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.assertIn("two", os.listdir(mnt))
            with open(os.path.join(mnt, "two", "x.npy"), "rb") as f:
                self.assertEqual(np.load(f).tolist(), list(range(10)))
            a.run("-r", self.repo, "rm", "one")
            deadline = time.monotonic() + 10
            while "one" in os.listdir(mnt) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.assertNotIn("one", os.listdir(mnt))
        finally:
            subprocess.run(["fusermount3", "-u", mnt])

    @unittest.skipUnless(HAVE_FUSE, "no /dev/fuse or fusermount3: FUSE tests need them")
    def test_a_mount_shows_a_checkpoint_removed_and_saved_again_under_its_name_on_other_hosts(self):
        a, c = self.host("a"), self.host("c")
        reader = Host(self.tmp, "mounting", namespace=False)  # its mount must be visible here
        a.run("-r", self.repo, "init", "--chunk-size", "64K")
        st.write(self.path("v1.safetensors"), [("t", "F32", np.arange(10, dtype=np.float32))])
        a.run("-r", self.repo, "import", "x", self.path("v1.safetensors"))
        mnt = self.path("mnt")
        os.makedirs(mnt)
        reader.run("-r", self.repo, "mount", "--poll", "1", mnt)
        pids = processes_running(["mount", "--poll", "1", mnt])
        self.assertEqual(len(pids), 1, pids)
        try:
            with open(os.path.join(mnt, "x", "t.npy"), "rb") as f:
                self.assertEqual(np.load(f).tolist(), list(range(10)))
            # Between two of the mount's polls (its daemon stopped meanwhile),
            # "x" is removed on one host and saved again on a host that never
            # knew it, so it even gets the same commit sequence.
            os.kill(pids[0], signal.SIGSTOP)
            try:
                a.run("-r", self.repo, "rm", "x")
                v2 = np.arange(100, 124, dtype=np.int64).reshape(4, 6)
                st.write(self.path("v2.safetensors"), [("t", "I64", v2)])
                c.run("-r", self.repo, "import", "x", self.path("v2.safetensors"))
            finally:
                os.kill(pids[0], signal.SIGCONT)
            deadline = time.monotonic() + 15
            while True:
                with open(os.path.join(mnt, "x", "t.npy"), "rb") as f:
                    got = np.load(f)
                if got.shape == v2.shape or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            self.assertEqual(got.tolist(), v2.tolist())
            listed = json.loads(reader.run("-r", self.repo, "ls", "--json").stdout)
            self.assertEqual([e["name"] for e in listed], ["x"])
        finally:
            subprocess.run(["fusermount3", "-u", mnt])

    @unittest.skipUnless(HAVE_FUSE, "no /dev/fuse or fusermount3: FUSE tests need them")
    def test_an_mmap_through_a_mount_outlives_rm_and_gc_on_another_host(self):
        a = self.host("a")
        reader = Host(self.tmp, "mounting", namespace=False)  # its mount must be visible here
        a.run("-r", self.repo, "init", "--chunk-size", "64K")
        v = self.rng.integers(0, 1 << 31, size=(512, 512), dtype=np.int32)  # 1 MiB: stored raw
        st.write(self.path("v.safetensors"), [("t", "I32", v)])
        a.run("-r", self.repo, "import", "victim", self.path("v.safetensors"))
        st.write(self.path("k.safetensors"), [("t", "F32", np.arange(10, dtype=np.float32))])
        a.run("-r", self.repo, "import", "kept", self.path("k.safetensors"))
        mnt = self.path("mnt")
        os.makedirs(mnt)
        reader.run("-r", self.repo, "mount", "--poll", "1", mnt)
        try:
            arr = np.load(os.path.join(mnt, "victim", "t.npy"), mmap_mode="r")
            a.run("-r", self.repo, "rm", "victim")
            report = json.loads(a.run("-r", self.repo, "gc", "--json").stdout)
            self.assertEqual(report["removed_kept_for_readers"], 1)
            deadline = time.monotonic() + 10
            while "victim" in os.listdir(mnt) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.assertNotIn("victim", os.listdir(mnt))
            self.assertEqual(sha(arr), sha(v))  # every page through the mapping, after the name went
            del arr
            deadline = time.monotonic() + 20
            while True:
                report = json.loads(a.run("-r", self.repo, "gc", "--json").stdout)
                if report["removed_collected"] == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            self.assertEqual(report["removed_collected"], 1)
            self.assertGreaterEqual(report["bytes_reclaimed"], v.nbytes)
            with open(os.path.join(mnt, "kept", "t.npy"), "rb") as f:
                self.assertEqual(np.load(f).tolist(), list(range(10)))
        finally:
            subprocess.run(["fusermount3", "-u", mnt])

    @unittest.skipUnless(HAVE_FUSE, "no /dev/fuse or fusermount3: FUSE tests need them")
    def test_a_mount_daemon_keeps_a_cache_directory_given_relative_to_the_callers(self):
        # The daemon works in "/": a relative --cache-dir must still name the
        # directory under the caller's, not one under "/".
        h = Host(self.tmp, "relative", namespace=False)
        h.run("-r", self.repo, "init", "--chunk-size", "64K")
        st.write(self.path("x.safetensors"), [("x", "F32", np.arange(10, dtype=np.float32))])
        h.run("-r", self.repo, "import", "one", self.path("x.safetensors"))
        name = "cache-" + uuid.uuid4().hex[:8]
        os.makedirs(self.path("mnt"))
        p = subprocess.run([CKPT, "-r", self.repo, "mount", "--cache-dir", name, "mnt"], cwd=self.tmp,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=h.env(), timeout=120)
        try:
            self.assertEqual(p.returncode, 0, p.stderr.decode())
            with open(self.path("mnt/one/x.npy"), "rb") as f:
                self.assertEqual(np.load(f).tolist(), list(range(10)))
            self.assertTrue(os.path.exists(os.path.join(self.tmp, name, "repository")))
            self.assertFalse(os.path.exists("/" + name), "the daemon kept its catalog under /")
        finally:
            subprocess.run(["fusermount3", "-u", self.path("mnt")])
            shutil.rmtree("/" + name, ignore_errors=True)

    def test_the_cache_directory_comes_from_the_option_the_variable_or_home(self):
        h = Host(self.tmp, "plain", namespace=False)
        h.run("-r", self.repo, "init")
        opt, var, home = self.path("by-option"), self.path("by-variable"), self.path("home")
        h.run("-r", self.repo, "ls", "--cache-dir", opt, env={"CKPT_CACHE_DIR": var})
        self.assertTrue(os.path.exists(os.path.join(opt, "repository")))
        self.assertFalse(os.path.exists(var))
        h.run("-r", self.repo, "ls", env={"CKPT_CACHE_DIR": var})
        self.assertTrue(os.path.exists(os.path.join(var, "repository")))
        e = {"CKPT_CACHE_DIR": "", "HOME": home, "XDG_CACHE_HOME": ""}
        h.run("-r", self.repo, "ls", env=e)
        (repo_id,) = os.listdir(os.path.join(home, ".cache", "ckptfs"))
        with open(os.path.join(home, ".cache", "ckptfs", repo_id, "repository")) as f:
            self.assertEqual(f.read(), f"{repo_id} {self.repo}\n")
        # one directory cannot serve two repositories
        other = self.repo + "-other"
        h.run("-r", other, "init")
        err = h.run("-r", other, "ls", "--cache-dir", opt, ok=False).stderr.decode()
        self.assertIn("another repository", err)

    def test_deleting_a_hosts_state_loses_nothing(self):
        a = self.host("a")
        a.run("-r", self.repo, "init", "--chunk-size", "64K")
        x = self.rng.standard_normal((300, 300)).astype(np.float32)
        st.write(self.path("x.safetensors"), [("x", "F32", x)])
        a.run("-r", self.repo, "import", "--step", "1", "c1", self.path("x.safetensors"))
        a.wipe()
        fresh = Host(self.tmp, "fresh")
        self.hosts.append(fresh)
        self.assertEqual(fresh.names(self.repo), ["c1"])
        self.assertEqual(fresh.digest(self.repo, "c1", "x"), sha(x))
        rebuilt = json.loads(a.run("-r", self.repo, "reindex", "--json").stdout)
        self.assertEqual(rebuilt["checkpoints"], 1)
        self.assertEqual(a.digest(self.repo, "c1", "x"), sha(x))
        # du, diff and verify work on S3 repositories
        a.run("-r", self.repo, "import", "--step", "2", "c2", self.path("x.safetensors"))
        du = json.loads(fresh.run("-r", self.repo, "du", "--json").stdout)
        self.assertGreater(du["total"]["dedup_ratio"], 1.9)
        diff = json.loads(fresh.run("-r", self.repo, "diff", "--json", "--all", "c1", "c2").stdout)
        self.assertTrue(diff and not any(t["changed"] for t in diff), diff)
        fresh.run("-r", self.repo, "verify")


class CrashSafety(S3Case):
    """Savers and gc SIGKILLed at many points, one after another in one
    repository: after each kill, a host that never saw the repository
    verifies it, finds every committed checkpoint intact and no killed save
    visible; a crashed holder's lock object does not stop the next command
    for longer than the stale time."""

    STALE = {"CKPT_LOCK_STALE_SECONDS": "0.3"}  # commands here run one at a time

    def setUp(self):
        super().setUp()
        self.a = self.host("a")
        self.a.run("-r", self.repo, "init", "--chunk-size", "64K", "--pack-size", "128K", "--no-adaptive")
        self.shared = self.rng.standard_normal((128, 256)).astype(np.float32)
        self.digests = {}

    def save(self, name, env=None, ok=True, rows=512):
        own = self.rng.standard_normal((rows, 256)).astype(np.float32)  # 512 KiB: 8 chunks, 4 packs
        p = self.path(name + ".safetensors")
        st.write(p, [("shared", "F32", self.shared), ("own", "F32", own)])
        proc = self.a.run("-r", self.repo, "import", name, p, env={**self.STALE, **(env or {})}, ok=ok)
        self.digests[name] = sha(own)
        return proc

    def spread(self, args_fn):
        """Kill points over a whole uninterrupted run."""
        count = self.path("count")
        args_fn("probe", {"CKPTFS_TEST_CRASH_COUNT_FILE": count})
        with open(count) as f:
            total = int(f.read())
        self.assertGreaterEqual(total, KILL_POINTS)
        return sorted({1 + (total - 1) * k // (KILL_POINTS - 1) for k in range(KILL_POINTS)})

    def check(self, committed):
        fresh = Host(self.tmp, "checker-" + uuid.uuid4().hex[:6], namespace=False)
        fresh.run("-r", self.repo, "verify", env=self.STALE)
        names = fresh.names(self.repo)
        for n in committed:
            self.assertIn(n, names)
        # verify re-hashed every chunk; a sample is compared with what was saved
        for n in names[-2:]:
            self.assertEqual(fresh.digest(self.repo, n, "own"), self.digests[n], n)
        shutil.rmtree(fresh.cache, ignore_errors=True)
        return names

    def test_killed_saves_lose_nothing_and_never_show(self):
        committed = []
        for i in range(3):
            self.save(f"base{i}")
            committed.append(f"base{i}")
        points = self.spread(lambda name, env: self.save(name, env))
        committed.append("probe")
        kills = 0
        for pt in points:
            name = f"killed{pt}"
            rc = self.save(name, {"CKPTFS_TEST_CRASH_AT": str(pt)}, ok=False).returncode
            kills += rc == -signal.SIGKILL
            names = self.check(committed)
            if name in names:  # killed after its manifest was in: complete and right
                committed.append(name)
            else:
                self.assertNotIn(name, self.a.names(self.repo, pending=False))
        self.assertGreaterEqual(kills, KILL_POINTS - 2)
        time.sleep(0.4)  # the killed savers' locks are stale now
        self.a.run("-r", self.repo, "gc", env=self.STALE)
        self.check(committed)

    def test_killed_gcs_lose_nothing_referenced(self):
        for i in range(4):
            self.save(f"base{i}", rows=1536)
        kept = ["base3"]

        def one_gc(name, env):
            self.save(name, rows=1536)  # one new, one old removed: 12 packs of garbage for this gc
            kept.append(name)
            self.a.run("-r", self.repo, "rm", kept.pop(0), env=self.STALE)
            return self.a.run("-r", self.repo, "gc", env={**self.STALE, **env}, ok=False)

        points = self.spread(one_gc)
        kills = 0
        for pt in points:
            rc = one_gc(f"g{pt}", {"CKPTFS_TEST_CRASH_AT": str(pt)}).returncode
            kills += rc == -signal.SIGKILL
            self.check(kept)
            time.sleep(0.4)  # a killed gc's exclusive lock goes stale
        self.assertGreaterEqual(kills, KILL_POINTS // 2)
        self.a.run("-r", self.repo, "gc", env=self.STALE)
        self.check(kept)


class GcRacingSaves(S3Case):
    def test_gc_on_one_host_while_two_others_save_loses_nothing(self):
        a, b, c = (self.host(n) for n in "abc")
        a.run("-r", self.repo, "init", "--chunk-size", "64K", "--pack-size", "256K")
        frozen = self.rng.standard_normal((256, 256)).astype(np.float32)
        digests, files = {}, {}
        for h in (b, c):
            for i in range(6):
                own = self.rng.standard_normal((128, 256)).astype(np.float32)
                name = f"{h.name}{i}"
                files[name] = self.path(name + ".safetensors")
                st.write(files[name], [("frozen", "F32", frozen), ("own", "F32", own)])
                digests[name] = sha(own)
        savers = [subprocess.Popen(["sh", "-c", " && ".join(
            " ".join([*h.command("-r", self.repo, "import", f"{h.name}{i}", files[f"{h.name}{i}"])])
            for i in range(6))], env=h.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for h in (b, c)]
        gcs = 0
        while any(p.poll() is None for p in savers):
            a.run("-r", self.repo, "gc", "--keep-last", "4")
            gcs += 1
        for p in savers:
            self.assertEqual(p.wait(), 0, p.stderr.read().decode())
            p.stderr.close()
        self.assertGreaterEqual(gcs, 1)
        a.run("-r", self.repo, "gc", "--keep-last", "4")
        fresh = self.host("d")
        fresh.run("-r", self.repo, "verify")
        names = fresh.names(self.repo)
        self.assertEqual(len(names), 4, names)
        for n in names:
            self.assertEqual(fresh.digest(self.repo, n, "own"), digests[n], n)
            self.assertEqual(fresh.digest(self.repo, n, "frozen"), sha(frozen), n)


class ThinRacingSaves(S3Case):
    @unittest.skipUnless(HAVE_FUSE, "no /dev/fuse or fusermount3: FUSE tests need them")
    def test_thinning_on_one_host_while_two_others_save_and_a_fourth_reads_loses_nothing(self):
        a, b, c = (self.host(n) for n in "abc")
        d = Host(self.tmp, "mounting", namespace=False)  # its mount must be visible here
        self.hosts.append(d)
        a.run("-r", self.repo, "init", "--chunk-size", "64K", "--pack-size", "256K")
        frozen = self.rng.standard_normal((256, 256)).astype(np.float32)
        digests, files = {}, {}
        for h in (b, c):
            for i in range(5):
                moment = self.rng.standard_normal((128, 256)).astype(np.float32)
                name = f"{h.name}{i}"
                files[name] = self.path(name + ".safetensors")
                st.write(files[name], [("model.w", "F32", frozen), ("optim.state.model.w.exp_avg", "F32", moment)])
                digests[name] = sha(moment)
        b.run("-r", self.repo, "import", "b0", files["b0"], "--step", "0")
        # a reader on host d holds b0 whole (a mount) through its thinning
        mnt = self.path("mnt")
        os.makedirs(mnt)
        d.run("-r", self.repo, "mount", "--poll", "1", mnt)
        held = np.load(os.path.join(mnt, "b0", "optim.state.model.w.exp_avg.npy"), mmap_mode="r")
        def saves(h):
            first = 1 if h.name == "b" else 0
            return " && ".join(" ".join(h.command("-r", self.repo, "import", f"{h.name}{i}", files[f"{h.name}{i}"],
                                                  "--step", str(10 * i + (h.name == "c"))))
                               for i in range(first, 5))
        savers = [subprocess.Popen(["sh", "-c", saves(h)], env=h.env(), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE) for h in (b, c)]
        runs = 0
        while any(p.poll() is None for p in savers):
            a.run("-r", self.repo, "gc", "--thin-older-than", "2")
            runs += 1
        for p in savers:
            self.assertEqual(p.wait(), 0, p.stderr.read().decode())
            p.stderr.close()
        self.assertGreaterEqual(runs, 1)
        out = json.loads(a.run("-r", self.repo, "gc", "--thin-older-than", "2", "--json").stdout)
        self.assertEqual(out["thin_skipped"], [])
        self.assertEqual(sha(held), digests["b0"])  # every page, after b0 was thinned
        del held
        # the mount shows the thinned b0 (its poll picks it up): the model alone, readable
        deadline = time.monotonic() + 20
        while "optim.state.model.w.exp_avg.npy" in os.listdir(os.path.join(mnt, "b0")) and time.monotonic() < deadline:
            time.sleep(0.3)
        shown = os.listdir(os.path.join(mnt, "b0"))
        self.assertEqual(sorted(f for f in shown if f.endswith(".npy")), ["model.w.npy"])
        self.assertEqual(sha(np.load(os.path.join(mnt, "b0", "model.w.npy"))), sha(frozen))
        fresh = self.host("e")
        fresh.run("-r", self.repo, "verify")
        listed = json.loads(fresh.run("-r", self.repo, "ls", "--json").stdout)
        self.assertEqual(sorted(c["name"] for c in listed), sorted(digests))
        by_step = sorted(listed, key=lambda c: c["step"])
        for c in by_step[:-2]:
            self.assertIsNotNone(c["thinned"], c["name"])
            self.assertEqual(c["tensors"], 1, c["name"])
        for c in by_step[-2:]:
            self.assertIsNone(c["thinned"], c["name"])
            self.assertEqual(fresh.digest(self.repo, c["name"], "optim.state.model.w.exp_avg"), digests[c["name"]])
        for c in listed:
            self.assertEqual(fresh.digest(self.repo, c["name"], "model.w"), sha(frozen), c["name"])
        # the dropped moments are reclaimed: what stays is the frozen weights
        # and the newest two checkpoints' moments
        du = json.loads(fresh.run("-r", self.repo, "du", "--json").stdout)["total"]
        self.assertLess(du["referenced_bytes"], frozen.nbytes + 3 * 128 * 256 * 4)


class Copy(S3Case):
    """ckpt copy between a local repository and S3, and back."""

    COPY_KILL_POINTS = 12

    def setUp(self):
        super().setUp()
        self.a = self.host("a")
        self.local = self.path("local")
        self.a.run("-r", self.local, "init", "--chunk-size", "64K", "--pack-size", "1M")
        model = {
            "w": ("F32", self.rng.standard_normal((256, 1024)).astype(np.float32)),  # 1 MiB
            "norm": ("BF16", st.random_array(self.rng, "BF16", (4096,))),
        }
        for step in (1, 2):  # four ranks, one file each
            for r, f in enumerate(self.sharded_files(model, 4)):
                self.a.run("-r", self.local, "import", f"step-{step}", f, "--rank", str(r), "--world-size", "4")
            model["w"][1][0][:] += 1  # one row of the next step changes
        self.caches = {}

    def ck(self, *args, repo, env=None, ok=True):
        """ckpt ... with the catalog of S3 repository `repo` (if any) in a
        cache directory of its own."""
        cache = self.caches.setdefault(repo, self.path(f"cache-{len(self.caches)}"))
        return self.a.run(*args, env={"CKPT_CACHE_DIR": cache, **(env or {})}, ok=ok)

    def fresh_s3(self):
        url = f"s3://{BUCKET}/copy-{uuid.uuid4().hex[:10]}"
        self.ck("-r", url, "init", "--chunk-size", "64K", "--pack-size", "1M", repo=url)
        return url

    def copy(self, src, dst, *args, env=None, ok=True):
        return self.ck("copy", src, dst, *args, "--json", repo=src if src.startswith("s3:") else dst, env=env, ok=ok)

    def names(self, repo):
        return [c["name"] for c in json.loads(self.ck("-r", repo, "ls", "--json", repo=repo).stdout)]

    def export(self, repo, name):
        out = self.path(f"export-{uuid.uuid4().hex[:8]}.safetensors")
        self.ck("-r", repo, "export", name, out, repo=repo)
        with open(out, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def test_local_to_s3_to_local_is_byte_identical_and_a_second_copy_sends_nothing(self):
        s3 = self.fresh_s3()
        first = json.loads(self.copy(self.local, s3, "--all").stdout)
        self.assertEqual([c["outcome"] for c in first["checkpoints"]], ["copied", "copied"])
        # step-2 shares every chunk but the changed row's with step-1
        self.assertLess(first["checkpoints"][1]["raw_bytes_sent"], first["checkpoints"][1]["raw_bytes_present"] / 5)
        other = self.path("other")
        self.a.run("-r", other, "init")
        json.loads(self.copy(s3, other, "step-1", "step-2").stdout)
        for name in ("step-1", "step-2"):
            self.assertEqual(self.export(other, name), self.export(self.local, name))
        # And from one store repository to another: each keeps its catalog
        # under the cache root, since one cache directory holds one catalog.
        s3b = self.fresh_s3()
        env = dict(os.environ, XDG_CACHE_HOME=self.path("xdg"))
        env.pop("CKPT_CACHE_DIR", None)
        p = subprocess.run([CKPT, "copy", s3, s3b, "--last", "1", "--json", "--progress=json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        between = json.loads(p.stdout)
        last = json.loads(p.stderr.decode().splitlines()[-1])  # its progress, as it went
        self.assertTrue(last["finished"], last)
        self.assertEqual(last["done_bytes"], last["total_bytes"])
        self.assertGreater(last["total_bytes"], 0)
        self.assertEqual([(c["name"], c["outcome"]) for c in between["checkpoints"]], [("step-2", "copied")])
        self.assertEqual(self.export(s3b, "step-2"), self.export(self.local, "step-2"))
        self.ck("-r", other, "verify", repo=other)
        show = lambda repo: json.loads(self.ck("-r", repo, "show", "step-2", "--json", repo=repo).stdout)
        self.assertEqual(show(other)["world_size"], 4)
        du = lambda: json.loads(self.ck("-r", s3, "du", "--json", repo=s3).stdout)["total"]["pack_bytes"]
        packs_before = du()
        again = json.loads(self.copy(self.local, s3, "--all").stdout)
        self.assertEqual([c["outcome"] for c in again["checkpoints"]], ["present", "present"])
        self.assertEqual((again["chunks_sent"], again["stored_bytes_sent"]), (0, 0))
        self.assertEqual(du(), packs_before)

    def test_a_copy_killed_anywhere_resumes_and_ends_identical(self):
        want = {n: self.export(self.local, n) for n in ("step-1", "step-2")}
        count = self.path("count")
        full = json.loads(self.copy(self.local, self.fresh_s3(), "--all",
                                    env={"CKPTFS_TEST_CRASH_COUNT_FILE": count}).stdout)["stored_bytes_sent"]
        with open(count) as f:
            total = int(f.read())
        self.assertGreaterEqual(total, self.COPY_KILL_POINTS)
        n = self.COPY_KILL_POINTS
        points = sorted({1 + (total - 1) * k // (n - 1) for k in range(n)})
        kills, resent = 0, []
        for pt in points:
            s3 = self.fresh_s3()
            rc = self.copy(self.local, s3, "--all", env={"CKPTFS_TEST_CRASH_AT": str(pt)}, ok=False).returncode
            kills += rc == -signal.SIGKILL
            visible = self.names(s3)
            for name in visible:  # whatever shows is whole
                self.assertEqual(self.export(s3, name), want[name], f"kill point {pt}")
            resumed = json.loads(self.copy(self.local, s3, "--all").stdout)
            self.assertEqual(sorted(self.names(s3)), ["step-1", "step-2"])
            for name, digest in want.items():
                self.assertEqual(self.export(s3, name), digest, f"kill point {pt}")
            resent.append(resumed["stored_bytes_sent"])
        self.assertGreaterEqual(kills, len(points) - 1)
        # A resumed copy sends at most what a whole copy does, and, after
        # the later kill points, less: what the killed copy committed (its
        # ranks) or finished (its packs) is not sent again.
        self.assertLessEqual(max(resent), full)
        self.assertLess(sum(resent), len(resent) * full * 3 // 4, resent)


class Drain(S3Case):
    """ckpt drain: fast tiers of two hosts (local directories) in front of
    an S3 repository; each host drains its own ranks."""

    KILL_POINTS = 10

    def setUp(self):
        super().setUp()
        self.a, self.b = self.host("a"), self.host("b")
        self.a.run("-r", self.repo, "init", "--chunk-size", "64K", "--pack-size", "1M")
        model = {"w": ("F32", self.rng.standard_normal((256, 1024)).astype(np.float32)),  # 1 MiB
                 "norm": ("BF16", st.random_array(self.rng, "BF16", (4096,)))}
        files = self.sharded_files(model, 4)
        self.fast = {h: self.path(f"fast-{h.name}") for h in (self.a, self.b)}
        for h in (self.a, self.b):
            h.run("-r", self.fast[h], "init", "--chunk-size", "64K", "--pack-size", "1M")
        # ranks 0 and 1 on host a, 2 and 3 on host b: each fast tier holds
        # its host's ranks of step-1, pending there
        for r in range(4):
            h = self.a if r < 2 else self.b
            h.run("-r", self.fast[h], "import", "step-1", files[r], "--rank", str(r), "--world-size", "4",
                  "--step", "1")
        reference = self.path("reference")
        self.a.run("-r", reference, "init")
        for r in range(4):
            self.a.run("-r", reference, "import", "step-1", files[r], "--rank", str(r), "--world-size", "4",
                       "--step", "1")
        self.want = self.export(reference, "step-1")

    def export(self, repo, name):
        out = self.path(f"export-{uuid.uuid4().hex[:8]}.safetensors")
        self.a.run("-r", repo, "export", name, out)
        with open(out, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def drain(self, h, *args, ok=True, env=None):
        return h.run("-r", self.fast[h], "drain", *args, ok=ok, env=env)

    def visible(self):
        return [c["name"] for c in json.loads(self.a.run("-r", self.repo, "ls", "--json").stdout)]

    def states(self, h):
        return {c["name"]: c["tier_state"] for c in json.loads(self.drain(h, "--status", "--json").stdout)}

    def test_each_host_drains_its_ranks_and_the_last_makes_the_checkpoint_durable(self):
        refused = self.drain(self.a, ok=False)
        self.assertEqual(refused.returncode, 2)
        self.assertIn("names no shared tier", refused.stderr.decode())
        first = json.loads(self.drain(self.a, "--to", self.repo, "--json").stdout)
        self.assertEqual([(c["name"], c["ranks_copied"], c["durable"]) for c in first["checkpoints"]],
                         [("step-1", 2, False)])
        self.assertEqual(self.states(self.a), {"step-1": "drained"})
        self.assertEqual(self.visible(), [])
        ls = self.a.run("-r", self.fast[self.a], "ls").stdout.decode()
        self.assertIn("drained", ls)
        # --wait on host a gives up after --timeout: host b has not drained
        waited = self.drain(self.a, "--wait", "--timeout", "2", ok=False)
        self.assertEqual(waited.returncode, 1)
        self.assertIn("not every checkpoint is durable", waited.stderr.decode())
        second = json.loads(self.drain(self.b, "--to", self.repo, "--json").stdout)
        self.assertEqual([(c["name"], c["ranks_copied"], c["durable"]) for c in second["checkpoints"]],
                         [("step-1", 2, True)])
        # the norm both halves hold is sent once
        self.assertLess(second["raw_bytes_sent"], first["raw_bytes_sent"] + 4096 * 2)
        self.assertEqual(self.visible(), ["step-1"])
        self.assertEqual(self.export(self.repo, "step-1"), self.want)
        done = json.loads(self.drain(self.a, "--wait", "--json").stdout)
        self.assertEqual([c["tier_state"] for c in done["fast_tier"]], ["durable"])
        self.assertEqual(done["chunks_sent"], 0)

    def test_a_drain_killed_anywhere_resumes_and_nothing_half_done_is_visible(self):
        self.drain(self.b, "--to", self.repo)
        count = self.path("count")
        with open(os.path.join(self.fast[self.a], "shared-tier"), "w") as f:
            f.write(self.repo + "\n")
        # how many crash points a whole drain of host a passes, on a copy
        probe = self.path("probe")
        shutil.copytree(self.fast[self.a], probe)
        probe_repo = f"s3://{BUCKET}/drain-probe-{uuid.uuid4().hex[:8]}"
        elsewhere = self.host("p")  # a catalog of its own for the probe's repository
        elsewhere.run("-r", probe_repo, "init", "--chunk-size", "64K", "--pack-size", "1M")
        with open(os.path.join(probe, "shared-tier"), "w") as f:
            f.write(probe_repo + "\n")
        elsewhere.run("-r", probe, "drain", "--no-trim", env={"CKPTFS_TEST_CRASH_COUNT_FILE": count})
        with open(count) as f:
            total = int(f.read())
        self.assertGreaterEqual(total, 3)
        points = sorted({1 + (total - 1) * k // (self.KILL_POINTS - 1) for k in range(self.KILL_POINTS)})
        kills = 0
        for pt in points:
            rc = self.drain(self.a, "--no-trim", ok=None, env={"CKPTFS_TEST_CRASH_AT": str(pt)}).returncode
            kills += rc == -signal.SIGKILL
            if self.visible():  # whatever shows is whole
                self.assertEqual(self.export(self.repo, "step-1"), self.want, f"kill point {pt}")
        self.assertGreater(kills, 0)
        self.drain(self.a, "--no-trim")
        self.assertEqual(self.visible(), ["step-1"])
        self.assertEqual(self.export(self.repo, "step-1"), self.want)
        self.a.run("-r", self.repo, "verify")

    def test_a_drain_killed_while_it_trims_never_loses_a_checkpoint(self):
        # four checkpoints of one rank in a fast tier of their own; step-1,
        # the oldest, is never drained, the others are drained and trimmed
        # down to the newest (--keep-last 1) by the same command
        fast = self.path("fast-solo")
        self.a.run("-r", fast, "init", "--chunk-size", "64K", "--pack-size", "1M")
        with open(os.path.join(fast, "shared-tier"), "w") as f:
            f.write(self.repo + "\n")
        want = {}
        for step in range(1, 5):
            path = self.path(f"solo-{step}.safetensors")
            st.write(path, [("w", "F32", self.rng.standard_normal((128, 512)).astype(np.float32))])
            self.a.run("-r", fast, "import", f"step-{step}", path, "--step", str(step))
            want[f"step-{step}"] = self.export(fast, f"step-{step}")
        args = ("-r", fast, "drain", "step-2", "step-3", "step-4", "--keep-last", "1")
        probe = self.path("probe-solo")
        shutil.copytree(fast, probe)
        elsewhere = self.host("q")
        probe_repo = f"s3://{BUCKET}/drain-trim-probe-{uuid.uuid4().hex[:8]}"
        elsewhere.run("-r", probe_repo, "init", "--chunk-size", "64K", "--pack-size", "1M")
        with open(os.path.join(probe, "shared-tier"), "w") as f:
            f.write(probe_repo + "\n")
        count = self.path("count-solo")
        elsewhere.run("-r", probe, *args[2:], env={"CKPTFS_TEST_CRASH_COUNT_FILE": count})
        with open(count) as f:
            total = int(f.read())
        points = sorted({1 + (total - 1) * k // (self.KILL_POINTS - 1) for k in range(self.KILL_POINTS)})
        kills = 0
        for pt in points:
            kills += self.a.run(*args, ok=None, env={"CKPTFS_TEST_CRASH_AT": str(pt)}).returncode == -signal.SIGKILL
            here = [c["name"] for c in json.loads(self.a.run("-r", fast, "ls", "--json").stdout)]
            there = self.visible()
            self.assertIn("step-1", here, f"kill point {pt}")  # never drained: never dropped
            for name, digest in want.items():  # every checkpoint is whole in one tier or both
                self.assertTrue(name in here or name in there, f"kill point {pt}: {name} lost")
                self.assertEqual(self.export(fast if name in here else self.repo, name), digest, f"{pt} {name}")
        self.assertGreater(kills, 0)
        self.a.run(*args)
        self.assertEqual(sorted(c["name"] for c in json.loads(self.a.run("-r", fast, "ls", "--json").stdout)),
                         ["step-1", "step-4"])
        self.assertEqual(self.visible(), ["step-2", "step-3", "step-4"])

    def test_gc_on_a_fast_tier_keeps_what_is_not_durable(self):
        self.drain(self.a, "--to", self.repo, "--status")
        gc = json.loads(self.a.run("-r", self.fast[self.a], "gc", "--keep-last", "1", "--json").stdout)
        self.assertEqual(gc["removed"], [])
        self.assertEqual(json.loads(self.a.run("-r", self.fast[self.a], "ls", "--json").stdout)[0]["tier_state"],
                         "local")


class Errors(S3Case):
    def one_line(self, proc):
        self.assertEqual(proc.returncode, 1, proc.stderr.decode())
        err = proc.stderr.decode().strip()
        self.assertEqual(len(err.splitlines()), 1, err)
        return err

    def test_bad_credentials_a_missing_bucket_and_an_unreachable_endpoint_each_give_one_line(self):
        h = self.host("a")
        h.run("-r", self.repo, "init")
        err = self.one_line(h.run("-r", self.repo, "ls", ok=False, env={"AWS_SECRET_ACCESS_KEY": "wrong"}))
        self.assertIn("credentials", err)
        err = self.one_line(h.run("-r", "s3://ckptfs-no-such-bucket/x", "ls", ok=False))
        self.assertIn("does not exist", err)
        err = self.one_line(h.run("-r", self.repo, "ls", ok=False,
                                  env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}))
        self.assertIn("127.0.0.1:9", err)
        err = self.one_line(h.run("-r", f"s3://{BUCKET}/nothing-here-{uuid.uuid4().hex[:6]}", "ls", ok=False))
        self.assertIn("no ckptfs repository", err)
        err = self.one_line(h.run("-r", self.repo, "init", ok=False))
        self.assertIn("already holds", err)


if __name__ == "__main__":
    unittest.main()
