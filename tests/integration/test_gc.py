"""Integration tests of dedup across versions, du, diff, rm and gc: crash
safety (SIGKILL at many points of save, rm and gc), gc racing saves in other
processes, and gc under a live mount."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import numpy as np

import st
from helpers import CKPT, CkptTestCase, ckpt_for

HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None
KILL_POINTS = 30  # per command, spread over the whole run


def run(repo, *args, env=None, check=True):
    e = {**os.environ, "CKPT_REPO": repo}
    e.pop("CKPTFS_TEST_CRASH_AT", None)
    if env:
        e.update(env)
    p = subprocess.run([ckpt_for(env), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"ckpt {' '.join(args)} failed ({p.returncode}): {p.stderr.decode()}")
    return p


def digest(repo, ckpt, tensor):
    return hashlib.sha256(run(repo, "cat", ckpt, tensor).stdout).hexdigest()


class DedupAndReports(CkptTestCase):
    def setUp(self):
        super().setUp()
        self.run_ckpt("init", "--chunk-size", "64K")
        self.rng = np.random.default_rng(5)

    def test_versions_store_only_what_changed_and_reports_agree(self):
        frozen = self.rng.standard_normal((1024, 256)).astype(np.float32)  # 1 MiB, 16 chunks
        heads = []
        for i in range(4):
            head = self.rng.standard_normal((64, 256)).astype(np.float32)
            heads.append(head)
            st.write(self.path(f"v{i}.safetensors"), [("base", "F32", frozen), ("head", "F32", head)])
            out = json.loads(self.run_ckpt("import", f"v{i}", self.path(f"v{i}.safetensors"), "--step", str(i),
                                           "--json").stdout)
            if i > 0:
                # only the changed tensor's chunks were written
                self.assertLessEqual(out["stored_bytes"], head.nbytes + 4096)
                self.assertEqual(out["chunks_deduplicated"], 16)
        # saving identical state again adds nothing
        again = json.loads(self.run_ckpt("import", "v3-again", self.path("v3.safetensors"), "--json").stdout)
        self.assertEqual(again["stored_bytes"], 0)
        du = json.loads(self.run_ckpt("du", "--json").stdout)
        self.assertGreater(du["total"]["dedup_ratio"], 3.0)
        by = {c["name"]: c for c in du["checkpoints"]}
        self.assertAlmostEqual(by["v1"]["exclusive_bytes"], heads[1].nbytes, delta=8192)
        # exclusive bytes are what removing v1 alone reclaims
        before = json.loads(self.run_ckpt("du", "--json").stdout)["total"]
        self.run_ckpt("rm", "v1")
        self.run_ckpt("gc")
        after = json.loads(self.run_ckpt("du", "--json").stdout)["total"]
        self.assertEqual(before["referenced_bytes"] - after["referenced_bytes"], by["v1"]["exclusive_bytes"])
        self.assertGreaterEqual(before["pack_bytes"] - after["pack_bytes"], by["v1"]["exclusive_bytes"])
        self.run_ckpt("import", "v1", self.path("v1.safetensors"), "--step", "1")
        self.assertEqual(by["v3"]["exclusive_bytes"], 0)  # v3-again shares everything
        diff = {d["name"]: d for d in json.loads(self.run_ckpt("diff", "v0", "v1", "--json", "--all").stdout)}
        self.assertFalse(diff["base"]["changed"])
        self.assertEqual(diff["base"]["shared_fraction"], 1.0)
        self.assertEqual(diff["base"]["changed_chunks"], 0)
        self.assertTrue(diff["head"]["changed"])
        d = (heads[1].astype(np.float64) - heads[0].astype(np.float64))
        self.assertAlmostEqual(diff["head"]["max_abs_diff"], float(np.abs(d).max()), places=5)
        self.assertAlmostEqual(diff["head"]["mean_abs_diff"], float(np.abs(d).mean()), places=5)
        self.assertAlmostEqual(diff["head"]["relative_l2"],
                               float(np.linalg.norm(d) / np.linalg.norm(heads[0].astype(np.float64))), places=5)
        self.assertEqual(diff["head"]["changed_chunks"], diff["head"]["chunks"])
        # Without --all, --json lists only what changed, as the table does.
        changed_only = json.loads(self.run_ckpt("diff", "v0", "v1", "--json").stdout)
        self.assertEqual([d["name"] for d in changed_only], ["head"])
        self.assertIn("1 of 2 tensors differ", self.run_ckpt("diff", "v0", "v1").stdout.decode())
        self.assertIn("no checkpoint", self.error_of("diff", "v0", "nope"))

    def test_gc_retention_dry_run_and_reclaim(self):
        base = self.rng.standard_normal((512, 256)).astype(np.float32)
        for i in range(6):
            head = self.rng.standard_normal((128, 256)).astype(np.float32)
            st.write(self.path("s.safetensors"), [("base", "F32", base), ("head", "F32", head)])
            self.run_ckpt("import", f"step-{i}", self.path("s.safetensors"), "--step", str(i * 10))
        before = json.loads(self.run_ckpt("du", "--json").stdout)["total"]
        dry = json.loads(self.run_ckpt("gc", "--keep-last", "2", "--keep-every", "20", "--dry-run", "--json").stdout)
        self.assertEqual(dry["removed"], ["step-1", "step-3"])
        self.assertEqual(json.loads(self.run_ckpt("du", "--json").stdout)["total"], before)  # nothing changed
        text = self.run_ckpt("gc", "--keep-last", "2", "--keep-every", "20", "--dry-run").stdout.decode()
        self.assertIn("would remove step-1", text)
        self.assertIn("in packs after it", text)  # the state after the gc, not now
        out = self.run_ckpt("gc", "--keep-last", "2", "--keep-every", "20").stdout.decode()
        self.assertIn("removing step-1", out)
        self.assertIn("in packs now", out)
        names = [c["name"] for c in json.loads(self.run_ckpt("ls", "--json").stdout)]
        self.assertEqual(names, ["step-0", "step-2", "step-4", "step-5"])
        after = json.loads(self.run_ckpt("du", "--json").stdout)["total"]
        self.assertLess(after["pack_bytes"], before["pack_bytes"])
        # stored bytes match what the remaining checkpoints reference, within the
        # rewrite threshold (packs are at least half live)
        self.assertLessEqual(after["pack_bytes"], 2 * after["referenced_bytes"])
        self.run_ckpt("verify")
        self.assertIn("--keep-every", self.error_of("gc", "--keep-every", "0"))
        self.assertIn("no committed checkpoint", self.error_of("gc", "--keep", "nope"))
        self.assertIn("nothing was removed", self.error_of("rm", "step-0", "nope"))
        self.assertEqual(len(json.loads(self.run_ckpt("ls", "--json").stdout)), 4)

    def test_thin_retention_from_the_cli_says_what_it_drops_and_show_and_copy_keep_the_mark(self):
        for step in range(3):
            st.write(self.path("s.safetensors"), [
                ("model.w", "BF16", st.random_array(self.rng, "BF16", (256, 64))),
                ("optimizer_states.0.state.0.exp_avg", "F32", self.rng.standard_normal((256, 64)).astype(np.float32))])
            self.run_ckpt("import", f"step-{step}", self.path("s.safetensors"), "--step", str(step))
        p = self.run_ckpt("gc", "--thin-keep", "model.*", ok=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--thin-older-than", p.stderr.decode())
        self.assertIn("--thin-older-than N", self.run_ckpt("gc", "--help").stdout.decode())
        text = self.run_ckpt("gc", "--thin-older-than", "2", "--dry-run").stdout.decode()
        self.assertIn("would thin step-0 (no --keep-* rule: nothing is removed; thin-older-than 2: the 3rd newest "
                      "by step, drops 1 tensor of optimizer, scheduler and RNG state, 64.0 KiB)", text)
        self.assertIn("would keep step-1 (no --keep-* rule: nothing is removed; thin-older-than 2: among the newest 2 "
                      "by step, whole)", text)
        out = self.run_ckpt("gc", "--thin-older-than", "2").stdout.decode()
        self.assertIn("thinning step-0 (", out)
        shown = self.run_ckpt("show", "step-0").stdout.decode()
        self.assertRegex(shown, r"thinned: +\d{4}-\d\d-\d\dT[0-9:]+Z: dropped 1 tensor \(65536 bytes\) of "
                                r"optimizer, scheduler and RNG state")
        self.assertNotIn("exp_avg", shown)
        p = self.run_ckpt("import", "forged", self.path("s.safetensors"), "--tag", "ckptfs.thinned=no", ok=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("ckptfs's own", p.stderr.decode())
        other = self.path("copy")
        self.run_ckpt("-r", other, "init")
        self.run_ckpt("copy", self.repo, other, "step-0")
        copied = json.loads(self.run_ckpt("-r", other, "show", "step-0", "--json").stdout)
        self.assertIsNotNone(copied["thinned"])
        self.assertEqual([t["name"] for t in copied["tensors"]], ["model.w"])

    def test_an_import_without_a_step_keeps_keep_every_on_steps_and_the_dry_run_says_why(self):
        st.write(self.path("s.safetensors"), [("x", "F32", self.rng.standard_normal(1000).astype(np.float32))])
        self.run_ckpt("import", "imported", self.path("s.safetensors"))  # no step
        for step in (5, 10, 15, 20, 25):
            st.write(self.path("s.safetensors"), [("x", "F32", self.rng.standard_normal(1000).astype(np.float32))])
            self.run_ckpt("import", f"step-{step:06d}", self.path("s.safetensors"), "--step", str(step))
        args = ("gc", "--keep-last", "2", "--keep-every", "10", "--dry-run")
        dry = json.loads(self.run_ckpt(*args, "--json").stdout)
        self.assertEqual(dry["removed"], ["step-000005", "step-000015"])
        why = {d["name"]: d for d in dry["retention"]}
        self.assertEqual(why["step-000010"], {"name": "step-000010", "step": 10, "keep": True,
                                              "why": "keep-every 10: step 10", "thin": False, "thin_why": "",
                                              "thin_tensors": 0, "thin_blobs": 0, "thin_bytes": 0})
        self.assertIsNone(why["imported"]["step"])
        text = self.run_ckpt(*args).stdout.decode().splitlines()
        self.assertIn("would keep step-000020 (keep-last 2: the 2nd newest by commit order; keep-every 10: step 20)",
                      text)
        self.assertIn("would remove step-000005 (keep-last 2: the 5th newest by commit order; keep-every 10: step 5 "
                      "is not a multiple of 10)", text)
        self.assertEqual(len([line for line in text if line.startswith(("would keep ", "would remove "))]), 6)
        out = self.run_ckpt("gc", "--keep-last", "2", "--keep-every", "10").stdout.decode()
        self.assertIn("removing step-000015 (", out)
        self.assertEqual([line.split(" (")[0] for line in out.splitlines() if not line.startswith("reclaimed")],
                         ["removing step-000005", "removing step-000015"])  # a run names only what it removes
        names = [c["name"] for c in json.loads(self.run_ckpt("ls", "--json").stdout)]
        self.assertEqual(names, ["imported", "step-000010", "step-000020", "step-000025"])

    def test_retention_refuses_to_remove_the_newest_unless_told(self):
        for i in range(3):
            st.write(self.path("s.safetensors"), [("x", "F32", self.rng.standard_normal(1000).astype(np.float32))])
            self.run_ckpt("import", f"step-{i}", self.path("s.safetensors"), "--step", str(i))
        err = self.error_of("gc", "--keep-last", "0")
        self.assertIn("would remove every checkpoint (3); nothing was removed", err)
        self.assertIn("--allow-removing-newest", err)
        err = self.error_of("gc", "--keep", "step-0", "--dry-run")
        self.assertIn("newest committed checkpoint 'step-2'", err)
        self.assertEqual(len(json.loads(self.run_ckpt("ls", "--json").stdout)), 3)
        self.assertIn("is not a duration", self.error_of("gc", "--keep-within", "3 days"))
        # Everything was committed within the hour: --keep-within keeps it all.
        out = json.loads(self.run_ckpt("gc", "--keep-within", "1h", "--json").stdout)
        self.assertEqual(out["removed"], [])
        out = json.loads(self.run_ckpt("gc", "--keep-last", "0", "--allow-removing-newest", "--json").stdout)
        self.assertEqual(sorted(out["removed"]), ["step-0", "step-1", "step-2"])
        self.assertEqual(json.loads(self.run_ckpt("ls", "--json").stdout), [])
        self.assertIn("--allow-removing-newest", self.run_ckpt("gc", "--help").stdout.decode())


class CrashSafety(unittest.TestCase):
    """SIGKILL at many points of a save, an rm and a gc never loses or
    corrupts a committed checkpoint that was not being removed."""

    NAMES = [f"c{i:02d}" for i in range(16)]

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ckptfs-crash-")
        cls.base = os.path.join(cls.tmp, "base")
        # --no-adaptive: the codec's choices (and so pack sizes and the number
        # of crash points a run passes) must not depend on timing.
        run(cls.base, "init", "--chunk-size", "64K", "--pack-size", "256K", "--no-adaptive")
        rng = np.random.default_rng(1)
        shared = rng.standard_normal((256, 256)).astype(np.float32)
        cls.digests = {}
        for i, name in enumerate(cls.NAMES):
            own = rng.standard_normal((128, 256)).astype(np.float32)
            p = os.path.join(cls.tmp, f"{name}.safetensors")
            st.write(p, [("shared", "F32", shared), ("own", "F32", own)])
            run(cls.base, "import", name, p, "--step", str(i))
            cls.digests[name] = {"shared": hashlib.sha256(shared.tobytes()).hexdigest(),
                                 "own": hashlib.sha256(own.tobytes()).hexdigest()}
        cls.new_own = rng.standard_normal((2048, 256)).astype(np.float32)  # 2 MiB: 32 chunks, several packs
        cls.new_file = os.path.join(cls.tmp, "new.safetensors")
        st.write(cls.new_file, [("shared", "F32", shared), ("own", "F32", cls.new_own)])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def fresh(self, i):
        repo = os.path.join(self.tmp, f"r{i}")
        shutil.rmtree(repo, ignore_errors=True)
        shutil.copytree(self.base, repo)
        return repo

    def points(self, args, repo=None, minimum=KILL_POINTS):
        """KILL_POINTS kill points spread over a whole uninterrupted run (every
        point when the run has fewer)."""
        repo = repo or self.fresh("count")
        count_file = os.path.join(self.tmp, "count")
        run(repo, *args, env={"CKPTFS_TEST_CRASH_COUNT_FILE": count_file})
        with open(count_file) as f:
            total = int(f.read())
        self.assertGreaterEqual(total, minimum, f"{args} passes only {total} crash points")
        pts = sorted({1 + (total - 1) * k // (KILL_POINTS - 1) for k in range(KILL_POINTS)})
        self.killed_points = len(pts)
        return pts

    def names(self, repo, pending=False):
        return [c["name"] for c in json.loads(run(repo, "ls", "--json", *(["--all"] if pending else [])).stdout)]

    def check_survivors(self, repo, survivors):
        """verify re-hashes every chunk and checks every tiling; the listing
        holds every survivor; a sample is compared byte for byte."""
        run(repo, "verify")
        names = self.names(repo)
        for n in survivors:
            self.assertIn(n, names)
        for n in survivors[:: max(1, len(survivors) // 3)]:
            for t in ("shared", "own"):
                self.assertEqual(digest(repo, n, t), self.digests[n][t], f"{n}/{t}")

    def collect_and_check(self, repo, survivors):
        """The next gc reclaims whatever the killed command left behind."""
        run(repo, "gc")
        du = json.loads(run(repo, "du", "--json").stdout)["total"]
        self.assertLessEqual(du["pack_bytes"], 2 * du["referenced_bytes"] + 4096)
        # no orphan pack left on disk: the files are exactly the catalog's packs
        packs_dir = os.path.join(repo, "objects", "packs")
        on_disk = sum(os.path.getsize(os.path.join(packs_dir, f)) for f in os.listdir(packs_dir))
        self.assertEqual(on_disk, du["pack_bytes"])
        tmp_files = [f for _, _, fs in os.walk(os.path.join(repo, "objects")) for f in fs if f.startswith(".tmp-")]
        self.assertEqual(tmp_files, [])
        self.check_survivors(repo, survivors)

    def kill_at(self, repo, args, point):
        rc = run(repo, *args, env={"CKPTFS_TEST_CRASH_AT": str(point)}, check=False).returncode
        self.assertEqual(rc, -signal.SIGKILL, f"{args}: crash point {point} did not kill")

    def test_killed_save(self):
        args = ["import", "new", self.new_file, "--step", "99"]
        for i, pt in enumerate(self.points(args)):
            repo = self.fresh(i)
            self.kill_at(repo, args, pt)
            self.check_survivors(repo, self.NAMES)
            if "new" in self.names(repo):  # killed after its commit point: complete and right
                self.assertEqual(hashlib.sha256(run(repo, "cat", "new", "own").stdout).hexdigest(),
                                 hashlib.sha256(self.new_own.tobytes()).hexdigest())
            else:
                self.assertNotIn("new", self.names(repo, pending=True))
            self.collect_and_check(repo, self.NAMES + (["new"] if "new" in self.names(repo) else []))

    def test_killed_rm(self):
        removed = self.NAMES[1:15]
        args = ["rm", *removed]
        for i, pt in enumerate(self.points(args)):
            repo = self.fresh(i)
            self.kill_at(repo, args, pt)
            names = self.names(repo)
            # all or nothing from the catalog's point of view
            self.assertIn(len(set(removed) & set(names)), (0, len(removed)))
            survivors = [n for n in self.NAMES if n in names]
            self.check_survivors(repo, survivors)
            self.collect_and_check(repo, survivors)

    def test_killed_gc(self):
        args = ["gc", "--keep-last", "1"]  # removes 15, deletes and rewrites packs
        for i, pt in enumerate(self.points(args)):
            repo = self.fresh(i)
            self.kill_at(repo, args, pt)
            names = self.names(repo)
            self.assertIn(self.NAMES[-1], names)
            survivors = [n for n in self.NAMES if n in names]
            self.check_survivors(repo, survivors)
            self.collect_and_check(repo, survivors)

    def test_killed_thin(self):
        # thins 14 checkpoints (each a replacing save and a rename), then
        # collects their dropped tensors; every checkpoint is at each point
        # whole or thinned, never a mix, and the next run finishes the job
        args = ["gc", "--thin-older-than", "2", "--thin-keep", "shared"]
        for i, pt in enumerate(self.points(args)):
            repo = self.fresh(i)
            self.kill_at(repo, args, pt)
            run(repo, "verify")
            listed = {c["name"]: c for c in json.loads(run(repo, "ls", "--json").stdout)}
            self.assertEqual(sorted(listed), self.NAMES)
            for n, c in listed.items():
                thinned = c["thinned"] is not None
                self.assertEqual(c["tensors"], 1 if thinned else 2, n)
                self.assertFalse(thinned and n in self.NAMES[-2:], n)
            for n in self.NAMES[::5]:
                self.assertEqual(digest(repo, n, "shared"), self.digests[n]["shared"], n)
                if listed[n]["thinned"] is None:
                    self.assertEqual(digest(repo, n, "own"), self.digests[n]["own"], n)
            run(repo, *args)
            listed = {c["name"]: c for c in json.loads(run(repo, "ls", "--json").stdout)}
            self.assertEqual([n for n in self.NAMES if listed[n]["thinned"]], self.NAMES[:-2])
            self.assertEqual(self.names(repo, pending=True), self.NAMES)  # no replacement left pending
            self.collect_and_check(repo, self.NAMES[-2:])
            for n in self.NAMES[:-2:4]:
                self.assertEqual(digest(repo, n, "shared"), self.digests[n]["shared"], n)

    def test_killed_sweep_after_a_killed_save(self):
        # a save killed half-way leaves orphans; a gc sweeping them is killed too
        repo = self.fresh("combo")
        run(repo, "import", "new", self.new_file, env={"CKPTFS_TEST_CRASH_AT": "30"}, check=False)
        self.assertNotIn("new", self.names(repo, pending=True))
        run(repo, "rm", *self.NAMES[:8])
        args = ["gc"]
        probe = repo + "-count"
        shutil.copytree(repo, probe)
        for pt in self.points(args, repo=probe, minimum=10):
            r = repo + f"-{pt}"
            shutil.copytree(repo, r)
            self.kill_at(r, args, pt)
            self.collect_and_check(r, self.NAMES[8:])
            shutil.rmtree(r)


class Concurrency(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-conc-")
        self.repo = os.path.join(self.tmp, "repo")
        run(self.repo, "init", "--chunk-size", "64K", "--pack-size", "512K")
        self.rng = np.random.default_rng(9)
        self.frozen = self.rng.standard_normal((1024, 256)).astype(np.float32)

    def tearDown(self):
        mnt = os.path.join(self.tmp, "mnt")
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", mnt])
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write_version(self, i):
        head = np.full((64, 256), i, dtype=np.float32)
        p = os.path.join(self.tmp, f"v{i}.safetensors")
        st.write(p, [("frozen", "F32", self.frozen), ("head", "F32", head)])
        return p

    def test_gc_racing_saves_that_dedup_against_old_chunks(self):
        files = [self.write_version(i) for i in range(14)]
        run(self.repo, "import", "v0", files[0], "--step", "0")
        errors = []

        def saver():
            for i in range(1, len(files)):
                p = run(self.repo, "import", f"v{i}", files[i], "--step", str(i), check=False)
                if p.returncode != 0:
                    errors.append(p.stderr.decode())

        t = threading.Thread(target=saver)
        t.start()
        gcs = [0, 0]

        def collector(k):
            # removes the older versions whose chunks the saves deduplicate
            # against, and rewrites their packs; two collectors race each other
            while t.is_alive():
                p = run(self.repo, "gc", "--keep-last", "1", check=False)
                if p.returncode != 0:
                    errors.append(p.stderr.decode())
                gcs[k] += 1

        collectors = [threading.Thread(target=collector, args=(k,)) for k in range(2)]
        for c in collectors:
            c.start()
        t.join()
        for c in collectors:
            c.join()
        self.assertEqual(errors, [])
        self.assertGreaterEqual(min(gcs), 1)
        self.assertGreaterEqual(sum(gcs), 3)
        run(self.repo, "verify")
        names = [c["name"] for c in json.loads(run(self.repo, "ls", "--json").stdout)]
        self.assertIn("v13", names)
        for n in names:
            i = int(n[1:])
            out = run(self.repo, "cat", n, "frozen").stdout
            self.assertEqual(out, self.frozen.tobytes(), n)
            self.assertEqual(run(self.repo, "cat", n, "head").stdout, np.full((64, 256), i, np.float32).tobytes())

    @unittest.skipUnless(HAVE_FUSE, "no /dev/fuse or fusermount3")
    def test_gc_under_a_mount_never_breaks_surviving_reads(self):
        # "keep" deduplicates its frozen tensor against packs of versions that
        # gc removes, so gc rewrites those packs and moves keep's chunks.
        files = [self.write_version(i) for i in range(6)]
        for i in range(3):
            run(self.repo, "import", f"old{i}", files[i], "--step", str(i))
        run(self.repo, "import", "keep", files[5], "--step", "100")
        mnt = os.path.join(self.tmp, "mnt")
        os.makedirs(mnt)
        proc = subprocess.Popen([CKPT, "mount", "-r", self.repo, mnt, "-f", "--cache-size", "1M", "--prefetch", "0"],
                                stderr=subprocess.PIPE)
        stop = threading.Event()
        threads = []
        try:
            deadline = time.time() + 10
            while not os.path.ismount(mnt) and time.time() < deadline:
                time.sleep(0.05)
            want_frozen = self.frozen.tobytes()
            want_head = np.full((64, 256), 5, np.float32).tobytes()
            failures, reads = [], [0]

            def reader():
                while not stop.is_set():
                    for name, want in (("frozen", want_frozen), ("head", want_head)):
                        path = os.path.join(mnt, "keep", f"{name}.npy")
                        try:
                            fd = os.open(path, os.O_RDONLY)
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # make the daemon serve it
                            data = b""
                            while True:
                                piece = os.read(fd, 1 << 20)
                                if not piece:
                                    break
                                data += piece
                            os.close(fd)
                            if data[128:] != want:
                                failures.append(f"{name}: wrong bytes")
                        except OSError as e:
                            failures.append(f"{name}: {e}")
                        reads[0] += 1

            threads.extend(threading.Thread(target=reader) for _ in range(2))
            for th in threads:
                th.start()
            for i in range(3, 6):
                run(self.repo, "import", f"old{i}", files[i - 3], "--step", str(i))
            for _ in range(3):
                gc = json.loads(run(self.repo, "gc", "--keep", "keep", "--json").stdout)
                run(self.repo, "import", "tmp", files[1], "--step", "7")
                run(self.repo, "rm", "tmp")
            stop.set()
            for th in threads:
                th.join()
            self.assertEqual(failures, [])
            self.assertGreater(reads[0], 4)
            run(self.repo, "verify")
        finally:
            # Readers stop before the mount goes, even when the test failed
            # midway (they would otherwise loop on errors for ever).
            stop.set()
            for th in threads:
                th.join()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
            proc.stderr.close()


if __name__ == "__main__":
    unittest.main()
