"""Integration tests of the ckpt CLI: the real binary, real repositories."""
import json
import os
import pathlib
import signal
import struct
import subprocess
import time
import unittest

import numpy as np

import st
from helpers import CKPT, CkptTestCase

COMMANDS = ["init", "import", "ls", "show", "cat", "export", "verify", "reindex"]


rand = st.random_array


class HelpAndUsage(CkptTestCase):
    def test_every_command_has_help(self):
        for c in COMMANDS:
            p = self.run_ckpt(c, "--help")
            out = p.stdout.decode()
            self.assertIn(f"usage: ckpt {c}", out)
            self.assertIn("--help", out)
            if "--repo" in out:  # every command that opens a repository
                self.assertIn("--cache-dir DIR", out)
        self.assertIn("commands:", self.run_ckpt("--help").stdout.decode())

    def test_usage_errors_exit_2_and_failures_exit_1(self):
        def status(*args, **kw):
            p = self.run_ckpt(*args, ok=None, **kw)
            self.assertEqual(len(p.stderr.decode().strip().splitlines()), 1, args)
            return p.returncode
        self.assertEqual(status("frobnicate"), 2)
        self.assertEqual(status("ls", "--bogus"), 2)
        self.assertEqual(status("cat", "only-one"), 2)
        self.assertEqual(status("ls", use_repo=False), 2)  # no repository named
        self.assertEqual(status("init", "--chunk-size", "1000"), 2)
        self.run_ckpt("init")
        st.write(self.path("m.safetensors"), [("x", "F32", np.zeros(3, np.float32))])
        self.assertEqual(status("import", "a", self.path("m.safetensors"), "--step", "ten"), 2)
        self.assertEqual(status("import", "a", self.path("m.safetensors"), "--rank", "2", "--world-size", "2"), 2)
        self.assertEqual(status("import", "a", self.path("m.safetensors"), "--tag", "novalue"), 2)
        self.assertEqual(status("cat", "a", "x", "--format", "csv"), 2)
        self.assertEqual(status("gc", "--keep-every", "0"), 2)
        self.assertEqual(status("gc", "--keep-last", "-1"), 2)
        # the command line is fine but the operation fails
        self.assertEqual(status("show", "nope"), 1)
        self.assertEqual(status("import", "a", self.path("missing.safetensors")), 1)
        self.assertEqual(status("init"), 1)  # already a repository
        self.assertEqual(status("gc", "--keep", "nope"), 1)

    def test_repository_is_required_and_checked(self):
        self.assertIn("CKPT_REPO", self.error_of("ls", use_repo=False))
        self.assertIn("does not exist", self.error_of("ls"))
        os.makedirs(self.path("foreign"))
        self.assertIn("not a ckptfs repository", self.error_of("ls", "-r", self.path("foreign")))
        self.run_ckpt("init")
        self.assertIn("already holds", self.error_of("init"))
        # -r wins over CKPT_REPO
        self.run_ckpt("init", "-r", self.path("other"))
        self.assertIn("no checkpoints", self.run_ckpt("ls", "-r", self.path("other")).stdout.decode())
        # Missing parents are made.
        self.run_ckpt("init", "-r", self.path("runs/llama/repo"))
        self.assertIn("no checkpoints", self.run_ckpt("ls", "-r", self.path("runs/llama/repo")).stdout.decode())
        # Global options may also come before the command, in any spelling.
        for args in (["-r", self.path("other"), "ls"], ["--repo", self.path("other"), "ls"],
                     ["--repo=" + self.path("other"), "ls"], ["-r" + self.path("other"), "ls", "--json"]):
            out = self.run_ckpt(*args, use_repo=False).stdout.decode()
            self.assertTrue("no checkpoints" in out or out.strip() == "[]", (args, out))
        p = self.run_ckpt("-r", ok=None, use_repo=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("needs a value", p.stderr.decode())

    def test_global_options_are_parsed_once_wherever_they_appear(self):
        self.run_ckpt("init")
        other = self.path("other")
        self.run_ckpt("init", "-r", other)
        # before the command, after it, between its arguments: the same options
        for args in (["--quiet", "-r", other, "ls"], ["ls", "--quiet", "-r", other], ["ls", "-r", other, "--json"],
                     ["--cache-dir", self.path("c"), "ls", "-r", other]):
            out = self.run_ckpt(*args, use_repo=False).stdout.decode()
            self.assertTrue("no checkpoints" in out or out.strip() == "[]", (args, out))
        for args, says in ((["-r", other, "ls", "-r", other], "given twice"),
                           (["--progress", "ls", "--quiet"], "contradict"),
                           (["--progress=yes", "ls"], "--progress takes"),
                           (["--cache-dir=", "ls"], "--cache-dir needs a value"),
                           (["--json", "ls"], "unknown option '--json' before the command")):
            p = self.run_ckpt(*args, ok=None)
            self.assertEqual(p.returncode, 2, args)
            self.assertIn(says, p.stderr.decode(), args)
        # every command's help lists them
        for cmd in ("ls", "gc", "import", "mount"):
            text = self.run_ckpt(cmd, "--help").stdout.decode()
            for opt in ("--repo", "--cache-dir", "--progress", "--quiet"):
                self.assertIn(opt, text, (cmd, opt))
        # crash points are armed only by the crash tests' own ckpt_crashing
        st.write(self.path("t.safetensors"), [("x", "F32", np.arange(4, dtype=np.float32))])
        self.run_ckpt("import", "uncrashed", self.path("t.safetensors"), env={"CKPTFS_TEST_CRASH_AT": "1"})
        # a malformed setting in the environment is named
        p = self.run_ckpt("ls", ok=None, env={"CKPT_LOCK_STALE_SECONDS": "soon"})
        self.assertEqual(p.returncode, 2)
        self.assertIn("CKPT_LOCK_STALE_SECONDS", p.stderr.decode())

    def test_newer_format_version_is_refused(self):
        self.run_ckpt("init")
        cfg_path = os.path.join(self.repo, "ckptfs.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["format_version"] = 7
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        self.assertIn("format version 7", self.error_of("ls"))

    def test_init_options_are_validated(self):
        self.assertIn("chunk size", self.error_of("init", "--chunk-size", "1000"))
        self.assertIn("compression", self.error_of("init", "--compression", "lz4"))
        self.run_ckpt("init", "--chunk-size", "1M", "--level", "3", "--compression", "zstd")
        cfg = json.loads(pathlib.Path(self.repo, "ckptfs.json").read_text())
        self.assertEqual(cfg["chunk_size"], 1 << 20)
        self.assertEqual(cfg["level"], 3)


ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


class BuildProgress(CkptTestCase):
    """What `pip install .` shows while it compiles (pip hides the build's
    own output): a wheel build compiles through tools/build_progress.sh,
    which names each file on the terminal, and writes nothing where there
    is none."""

    def configure(self, *extra):
        out = self.path("wheel-build")
        subprocess.run(["cmake", "-S", ROOT, "-B", out, "-G", "Ninja", "-DSKBUILD=2",
                        f"-DSKBUILD_SCRIPTS_DIR={out}/scripts", "-DCKPTFS_PYTHON=OFF", *extra],
                       check=True, capture_output=True, timeout=300)
        with open(os.path.join(out, "CMakeFiles", "rules.ninja")) as f:
            rules = f.read()
        with open(os.path.join(out, "build.ninja")) as f:
            targets = f.read()
        return rules, targets

    def test_a_wheel_build_compiles_through_the_launcher_and_builds_no_simulator(self):
        rules, targets = self.configure()
        self.assertIn(os.path.join(ROOT, "tools", "build_progress.sh") + " " + ROOT + " ", rules)
        self.assertNotIn("ckpt-sim", targets)
        self.assertIn("build tools/ckpt:", targets)
        rules, _ = self.configure("-DCKPTFS_BUILD_PROGRESS=OFF")
        self.assertNotIn("build_progress.sh", rules)

    def test_the_launcher_names_the_file_on_a_terminal_and_runs_the_compiler(self):
        compiler = self.path("cc.sh")
        record = self.path("ran")
        with open(compiler, "w") as f:
            f.write(f'#!/bin/sh\necho "$@" > {record}\n')
        os.chmod(compiler, 0o755)
        command = [os.path.join(ROOT, "tools", "build_progress.sh"), ROOT, compiler, "-O2", "-o", "x.o",
                   "-c", os.path.join(ROOT, "engine", "ckpt", "gc.cc")]
        # On a terminal (script(1) gives the command one): one line.
        p = subprocess.run(["script", "-qec", " ".join(command), "/dev/null"], capture_output=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(b"ckptfs build: compiling engine/ckpt/gc.cc", p.stdout)
        with open(record) as f:
            self.assertEqual(f.read().split(), command[3:])
        os.remove(record)
        # Without one (CI, a pipe): nothing, and the compiler still runs.
        p = subprocess.run(command, capture_output=True, start_new_session=True, timeout=60)
        self.assertEqual((p.returncode, p.stdout, p.stderr), (0, b"", b""))
        self.assertTrue(os.path.exists(record))


class ImportAndRead(CkptTestCase):
    def setUp(self):
        super().setUp()
        self.run_ckpt("init", "--chunk-size", "64K")
        self.rng = np.random.default_rng(1)

    def check_tensor(self, ckpt, name, want, dtype_name):
        raw = self.run_ckpt("cat", ckpt, name).stdout
        self.assertEqual(raw, np.ascontiguousarray(want).astype(st.DTYPES[dtype_name]).tobytes(), name)
        npy_path = self.path("t.npy")
        with open(npy_path, "wb") as f:
            self.run_ckpt("cat", ckpt, name, "--format", "npy", stdout=f)
        got = np.load(npy_path)
        self.assertEqual(got.shape, want.shape)
        self.assertEqual(got.dtype, np.dtype(st.DTYPES[dtype_name]))
        self.assertEqual(got.tobytes(), np.ascontiguousarray(want).astype(st.DTYPES[dtype_name]).tobytes(), name)

    def test_hf_checkpoint_split_over_files_imports_as_one(self):
        tensors = {}
        dtypes = list(st.DTYPES)
        for i, dt in enumerate(dtypes):
            shape = [(3, 5), (7,), (), (0, 4), (2, 3, 4)][i % 5]
            tensors[f"model.layer{i}.{dt.lower()}"] = (dt, rand(self.rng, dt, shape))
        names = sorted(tensors)
        st.write(self.path("a.safetensors"), [(n, *tensors[n]) for n in names[:8]])
        st.write(self.path("b.safetensors"), [(n, *tensors[n]) for n in names[8:]])
        out = self.run_ckpt("import", "hf", self.path("a.safetensors"), self.path("b.safetensors"), "--step", "12",
                            "--tag", "run=alpha", "--json").stdout
        info = json.loads(out)
        self.assertTrue(info["visible"])
        self.assertTrue(info["checkpoint_visible"])
        for n, (dt, arr) in tensors.items():
            self.check_tensor("hf", n, arr, dt)
        listing = json.loads(self.run_ckpt("ls", "--json").stdout)
        self.assertEqual([c["name"] for c in listing], ["hf"])
        self.assertEqual(listing[0]["step"], 12)
        self.assertEqual(listing[0]["tags"], {"run": "alpha"})
        show = json.loads(self.run_ckpt("show", "hf", "--json").stdout)
        self.assertEqual(len(show["tensors"]), len(tensors))
        by_name = {t["name"]: t for t in show["tensors"]}
        self.assertEqual(by_name[names[0]]["dtype"], tensors[names[0]][0])
        self.assertIn("hf", self.run_ckpt("show", "hf").stdout.decode())
        # export, read back with the independent parser
        self.run_ckpt("export", "hf", self.path("out.safetensors"))
        got, meta = st.read(self.path("out.safetensors"))
        self.assertEqual(meta["ckptfs.step"], "12")
        for n, (dt, arr) in tensors.items():
            self.assertEqual(got[n][0], dt)
            self.assertEqual(got[n][1].tobytes(), np.ascontiguousarray(arr).astype(st.DTYPES[dt]).tobytes())
        self.assertIn("exists", self.error_of("export", "hf", self.path("out.safetensors")))
        self.run_ckpt("export", "hf", self.path("out.safetensors"), "--force")
        v = json.loads(self.run_ckpt("verify", "--json").stdout)
        self.assertTrue(v["ok"])
        self.assertGreater(v["chunks"], 0)

    def write_ranks(self, world, tensors_fn):
        """tensors_fn(rank) -> (list of (name, dtype, array), shard map)."""
        paths = []
        for r in range(world):
            ts, shards = tensors_fn(r)
            p = self.path(f"rank{r}.safetensors")
            st.write(p, ts, {"ckptfs.shards": json.dumps(shards)} if shards else None)
            paths.append(p)
        return paths

    def sharded_state(self, world):
        w = rand(self.rng, "BF16", (64, 96))
        f = rand(self.rng, "F32", (33, 17))
        e = rand(self.rng, "F32", (10,))
        flat = f.reshape(-1)
        cuts = [0] + sorted(self.rng.choice(np.arange(1, flat.size), world - 1, replace=False).tolist()) + [flat.size]

        def rank(r):
            cols = 96 // world
            ts = [("w", "BF16", w[:, r * cols:(r + 1) * cols]), ("f", "F32", flat[cuts[r]:cuts[r + 1]]), ("e", "F32", e)]
            shards = {"w": {"global_shape": [64, 96], "offsets": [0, r * cols]},
                      "f": {"global_shape": [33, 17], "flat_start": cuts[r]}}
            return ts, shards
        return {"w": ("BF16", w), "f": ("F32", f), "e": ("F32", e)}, rank

    def test_ranks_in_separate_processes_commit_the_checkpoint_once(self):
        want, rank = self.sharded_state(4)
        paths = self.write_ranks(4, rank)
        # Three ranks first, one after another: not visible yet.
        for r in range(3):
            self.run_ckpt("import", "s", paths[r], "--rank", str(r), "--world-size", "4", "--step", "5")
            self.assertEqual(json.loads(self.run_ckpt("ls", "--json").stdout), [])
        pending = json.loads(self.run_ckpt("ls", "--all", "--json").stdout)
        self.assertEqual(pending[0]["state"], "pending")
        self.assertEqual((pending[0]["ranks_committed"], pending[0]["ranks_missing"]), ([0, 1, 2], [3]))
        self.assertIn("not committed", self.error_of("cat", "s", "w"))
        # What a pending checkpoint waits for, in the listing and from show.
        self.assertIn("missing ranks 3)", self.run_ckpt("ls", "--all").stdout.decode())
        shown = self.run_ckpt("show", "s").stdout.decode()
        self.assertIn("3 of 4 committed (0-2); missing 3", shown)
        self.assertIn("ckpt rm s", shown)
        self.assertEqual(json.loads(self.run_ckpt("show", "s", "--json").stdout)["ranks_missing"], [3])
        self.run_ckpt("import", "s", paths[3], "--rank", "3", "--world-size", "4", "--step", "5")
        for n, (dt, arr) in want.items():
            self.check_tensor("s", n, arr, dt)
        # Concurrently, as a launcher would run them.
        procs = [subprocess.Popen([CKPT, "import", "c", p, "--rank", str(r), "--world-size", "4"],
                                  env={**os.environ, "CKPT_REPO": self.repo}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for r, p in enumerate(paths)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, err)
        for n, (dt, arr) in want.items():
            self.check_tensor("c", n, arr, dt)
        # Same bytes: the second checkpoint stored nothing new.
        show = json.loads(self.run_ckpt("show", "c", "--json").stdout)
        self.assertEqual(show["tensors"][0]["shards"][0]["ranks"], [0, 1, 2, 3])  # replicated 'e'
        self.run_ckpt("verify")

    def test_all_shards_in_one_import(self):
        want, rank = self.sharded_state(3)
        paths = self.write_ranks(3, rank)
        self.run_ckpt("import", "one", *paths)
        for n, (dt, arr) in want.items():
            self.check_tensor("one", n, arr, dt)

    def test_overlapping_shards_with_different_bytes_fail_and_stay_invisible(self):
        a = rand(self.rng, "F32", (8, 4))
        b = a.copy()
        b[4, 0] += 1
        paths = self.write_ranks(2, lambda r: ([("x", "F32", (a if r == 0 else b)[r * 3:r * 3 + 5])],
                                               {"x": {"global_shape": [8, 4], "offsets": [r * 3, 0]}}))
        self.run_ckpt("import", "o", paths[0], "--rank", "0", "--world-size", "2")
        err = self.error_of("import", "o", paths[1], "--rank", "1", "--world-size", "2")
        self.assertIn("tensor 'x'", err)
        self.assertIn("different bytes", err)
        self.assertEqual(len(err.strip().splitlines()), 1)
        self.assertEqual(json.loads(self.run_ckpt("ls", "--json").stdout), [])

    def test_gap_fails_naming_the_tensor(self):
        a = rand(self.rng, "F32", (8, 4))
        paths = self.write_ranks(2, lambda r: ([("x", "F32", a[r * 5:r * 5 + 3])],
                                               {"x": {"global_shape": [8, 4], "offsets": [r * 5, 0]}}))
        self.run_ckpt("import", "g", paths[0], "--rank", "0", "--world-size", "2")
        err = self.error_of("import", "g", paths[1], "--rank", "1", "--world-size", "2")
        self.assertIn("tensor 'x'", err)
        self.assertIn("not fully covered", err)
        self.assertEqual(json.loads(self.run_ckpt("ls", "--json").stdout), [])

    def test_show_stats_counts_nans_and_matches_numpy(self):
        x = self.rng.standard_normal(100_000).astype(np.float32)
        x[[3, 99]] = np.nan
        x[7] = np.inf
        st.write(self.path("s.safetensors"), [("x", "F32", x), ("y", "I32", np.arange(-2, 3, dtype=np.int32))])
        self.run_ckpt("import", "s", self.path("s.safetensors"))
        stats = {s["name"]: s for s in json.loads(self.run_ckpt("show", "s", "--stats", "--json").stdout)}
        f = x[np.isfinite(x)].astype(np.float64)
        self.assertEqual((stats["x"]["nan_count"], stats["x"]["inf_count"]), (2, 1))
        self.assertAlmostEqual(stats["x"]["mean"], f.mean(), places=9)
        self.assertAlmostEqual(stats["x"]["std"], f.std(), places=9)
        self.assertAlmostEqual(stats["x"]["l2_norm"], np.linalg.norm(f), places=6)
        self.assertEqual((stats["x"]["min"], stats["x"]["max"]), (float(f.min()), float(f.max())))
        self.assertEqual((stats["y"]["min"], stats["y"]["max"], stats["y"]["zero_count"]), (-2, 2, 1))
        one = json.loads(self.run_ckpt("show", "s", "y", "--stats", "--json").stdout)
        self.assertEqual([s["name"] for s in one], ["y"])
        self.assertIn("NAN", self.run_ckpt("show", "s", "--stats").stdout.decode())
        self.assertIn("no tensor 'z'", self.error_of("show", "s", "z", "--stats"))
        self.assertIn("go with --stats", self.error_of("show", "s", "y"))

    def test_one_ranks_file_without_rank_is_refused_before_anything_is_written(self):
        a = rand(self.rng, "F32", (8, 4))
        paths = self.write_ranks(2, lambda r: ([("x", "F32", a[r * 4:r * 4 + 4])],
                                               {"x": {"global_shape": [8, 4], "offsets": [r * 4, 0]}}))
        packs = pathlib.Path(self.repo, "objects", "packs")
        err = self.error_of("import", "r", paths[0])
        self.assertIn("tensor 'x': the files hold 16 of its 32 elements; nothing was written", err)
        self.assertIn("--rank R --world-size N", err)
        self.assertEqual(list(packs.iterdir()) if packs.exists() else [], [])
        self.run_ckpt("import", "r", *paths)  # both parts at once are whole

    def test_progress_is_shown_on_a_terminal_only(self):
        big = self.rng.standard_normal((1024, 1024)).astype(np.float32)
        st.write(self.path("big.safetensors"), [("big", "F32", big)])
        self.run_ckpt("import", "p", self.path("big.safetensors"))
        # stderr is a pseudo-terminal: progress is drawn, then cleared
        import pty
        master, slave = pty.openpty()
        env = {**os.environ, "CKPT_REPO": self.repo}
        p = subprocess.run([CKPT, "export", "p", self.path("p.safetensors")], stdout=subprocess.PIPE, stderr=slave,
                           env=env, timeout=120)
        os.close(slave)
        drawn = b""
        while True:
            try:
                piece = os.read(master, 65536)
            except OSError:
                break
            if not piece:
                break
            drawn += piece
        os.close(master)
        self.assertEqual(p.returncode, 0)
        self.assertIn(b"exporting p: 100.0%", drawn)
        self.assertRegex(drawn, rb"of 4\.0 MiB, [0-9.]+ [KMG]?i?B/s")  # throughput beside the bytes
        self.assertIn(b"\r\x1b[K", drawn)  # the line is cleared when done
        # not a terminal: nothing but the result
        q = self.run_ckpt("export", "p", self.path("p2.safetensors"))
        self.assertEqual(q.stderr, b"")
        # --progress forces lines, --progress=json gives objects, --quiet nothing
        q = self.run_ckpt("export", "p", self.path("p3.safetensors"), "--progress")
        self.assertIn(b"exporting p: 100.0% (4.0 MiB of 4.0 MiB", q.stderr)
        q = self.run_ckpt("--progress=json", "export", "p", self.path("p4.safetensors"))
        lines = [json.loads(line) for line in q.stderr.decode().splitlines()]
        self.assertEqual(lines[-1]["finished"], True)
        self.assertEqual(lines[-1]["done_bytes"], lines[-1]["total_bytes"])
        self.assertEqual(lines[-1]["progress"], "exporting p")
        self.assertIn("bytes_per_second", lines[-1])
        q = self.run_ckpt("verify", "--quiet")
        self.assertEqual(q.stderr, b"")
        # gc says which phase it is in, as lines or as objects
        q = self.run_ckpt("gc", "--progress")
        self.assertIn(b"gc: waiting for saves in progress\n", q.stderr)
        q = self.run_ckpt("--progress=json", "gc")
        phases = [json.loads(line)["phase"] for line in q.stderr.decode().splitlines()]
        self.assertEqual(phases[:2], ["waiting for any other gc of this host", "finding live chunks"])
        self.assertEqual(self.run_ckpt("gc").stderr, b"")

    def test_blobs(self):
        st.write(self.path("m.safetensors"), [("x", "F32", rand(self.rng, "F32", (3,)))])
        with open(self.path("rng.bin"), "wb") as f:
            f.write(os.urandom(100000))
        self.run_ckpt("import", "b", self.path("m.safetensors"), "--blob", f"rng_state={self.path('rng.bin')}")
        got = self.run_ckpt("cat", "b", "rng_state", "--blob").stdout
        with open(self.path("rng.bin"), "rb") as f:
            self.assertEqual(got, f.read())

    def test_names_and_lookups(self):
        st.write(self.path("m.safetensors"), [("x", "F32", rand(self.rng, "F32", (3,)))])
        self.run_ckpt("import", "a", self.path("m.safetensors"))
        self.assertIn("already exists (an overwriting save replaces it: ckpt import --overwrite",
                      self.error_of("import", "a", self.path("m.safetensors")))
        self.assertIn("may hold only", self.error_of("import", "bad:name", self.path("m.safetensors")))
        self.assertIn("has an empty part", self.error_of("import", "bad//name", self.path("m.safetensors")))
        self.assertIn("must not be digits only", self.error_of("import", "run/100", self.path("m.safetensors")))
        # Groups: names with '/', listed and retained group by group.
        for name in ("run1/step-1", "run1/step-2", "run1/eval/step-2", "run2/step-1"):
            self.run_ckpt("import", name, self.path("m.safetensors"), "--step", name[-1])
        ls = lambda *a: [c["name"] for c in json.loads(self.run_ckpt("ls", "--json", *a).stdout)]  # noqa: E731
        self.assertEqual(ls("run1/"), ["run1/step-1", "run1/step-2", "run1/eval/step-2"])
        self.assertEqual(ls("run1/eval"), ["run1/eval/step-2"])
        self.assertIn("run1/eval/step-2", self.run_ckpt("ls", "run1").stdout.decode())
        self.assertIn("is a group of checkpoints", self.error_of("import", "run1", self.path("m.safetensors")))
        self.run_ckpt("gc", "--group", "run1", "--keep-last", "1")
        self.assertEqual(ls(), ["a", "run1/eval/step-2", "run2/step-1"])
        self.assertIn("no checkpoint named 'zzz'", self.error_of("show", "zzz"))
        self.assertIn("no tensor 'nope'", self.error_of("cat", "a", "nope"))
        self.assertIn("no checkpoint", self.error_of("export", "zzz", self.path("o.safetensors")))
        self.assertIn("no checkpoint", self.error_of("verify", "zzz"))


    def test_import_overwrite_replaces_the_name_and_the_old_bytes_go_at_gc(self):
        first = rand(self.rng, "F32", (1000,))
        second = rand(self.rng, "F32", (1000,))
        st.write(self.path("1.safetensors"), [("x", "F32", first)])
        st.write(self.path("2.safetensors"), [("x", "F32", second)])
        self.run_ckpt("import", "a", self.path("1.safetensors"), "--step", "1")
        self.run_ckpt("import", "a", self.path("2.safetensors"), "--step", "2", "--overwrite")
        self.assertEqual(self.run_ckpt("cat", "a", "x").stdout, second.astype(np.float32).tobytes())
        [rec] = json.loads(self.run_ckpt("ls", "--all", "--json").stdout)
        self.assertEqual((rec["name"], rec["step"]), ("a", 2))
        gc = json.loads(self.run_ckpt("gc", "--json").stdout)
        self.assertEqual(gc["removed_collected"], 1)
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())
        # A name that does not exist yet is simply saved.
        self.run_ckpt("import", "b", self.path("1.safetensors"), "--overwrite")
        self.assertEqual(self.run_ckpt("cat", "b", "x").stdout, first.astype(np.float32).tobytes())
        # Ranks of one import cannot share an attempt: refused, naming why.
        self.assertIn("needs a save attempt", self.error_of("import", "a", self.path("1.safetensors"), "--overwrite",
                                                            "--rank", "0", "--world-size", "2"))

class SourceRewrittenDuringImports(CkptTestCase):
    """A file rewritten in place while `ckpt import` reads it (a training
    job writing its next checkpoint over the last): each import holds at
    worst a mix of old and new bytes, the store never a chunk that fails
    its id, and the original bytes imported afterwards read back exactly."""

    def test_100_imports_of_a_file_rewritten_meanwhile_leave_every_chunk_verified(self):
        import threading
        self.run_ckpt("init", "--chunk-size", "64K")
        rng = np.random.default_rng(3)
        original = rng.standard_normal(1 << 18).astype(np.float32)  # 16 chunks
        src = self.path("live.safetensors")
        st.write(src, [("w", "F32", original)])
        data_start = os.path.getsize(src) - original.nbytes
        stop = threading.Event()

        def rewrite():
            g = np.random.default_rng(4)
            fd = os.open(src, os.O_WRONLY)
            try:
                while not stop.is_set():  # same size: only the tensor's bytes change
                    at = int(g.integers(0, original.nbytes // 4 - 256)) * 4
                    os.pwrite(fd, g.bytes(1024), data_start + at)
            finally:
                os.close(fd)

        t = threading.Thread(target=rewrite)
        t.start()
        try:
            for i in range(100):
                self.run_ckpt("import", f"racy-{i}", src)
        finally:
            stop.set()
            t.join()
        self.run_ckpt("verify")
        clean = self.path("clean.safetensors")
        st.write(clean, [("w", "F32", original)])
        self.run_ckpt("import", "clean", clean)
        self.assertEqual(self.run_ckpt("cat", "clean", "w").stdout, original.tobytes())
        self.run_ckpt("verify")


class VerifyAndRepair(CkptTestCase):
    """A chunk whose stored bytes fail their id is named against every
    checkpoint that uses it; --repair stores it again from a repository
    that has it (here a backup made with ckpt copy), and every checkpoint
    reads back exactly."""

    def test_a_damaged_chunk_is_named_for_every_user_and_repaired_from_a_copy(self):
        self.run_ckpt("init", "--chunk-size", "64K")
        rng = np.random.default_rng(8)
        w = rng.standard_normal((64, 1024)).astype(np.float32)  # 256 KiB: 4 chunks, shared by a and b
        v = rng.standard_normal((4096,)).astype(np.float32)
        st.write(self.path("a.safetensors"), [("w", "F32", w)])
        st.write(self.path("b.safetensors"), [("w", "F32", w), ("v", "F32", v)])
        self.run_ckpt("import", "a", self.path("a.safetensors"))
        self.run_ckpt("import", "b", self.path("b.safetensors"))
        backup = self.path("backup")
        self.run_ckpt("-r", backup, "init", "--chunk-size", "64K", use_repo=False)
        self.run_ckpt("copy", self.repo, backup, "--all", use_repo=False)
        # a's import wrote one pack, of w's chunks only: damage its first chunk.
        packs = pathlib.Path(self.repo, "objects", "packs")
        first = min(packs.iterdir(), key=lambda p: p.stat().st_mtime_ns)
        raw = bytearray(first.read_bytes())
        raw[16 + 100] ^= 0x5A
        first.write_bytes(bytes(raw))

        p = self.run_ckpt("verify", "--json", ok=None)
        self.assertEqual(p.returncode, 1)
        report = json.loads(p.stdout)
        self.assertFalse(report["ok"])
        self.assertEqual(len(report["bad_chunks"]), 1, report)
        self.assertEqual(report["bad_chunks"][0]["checkpoints"], ["a", "b"])
        named = {x["checkpoint"] for x in report["problems"]}
        self.assertEqual(named, {"a", "b"})

        err = self.error_of("verify", "--repair")
        self.assertIn("unrepaired: chunk " + report["bad_chunks"][0]["chunk"], err)
        self.assertIn("used by a, b", err)

        p = self.run_ckpt("verify", "--repair", "--from", backup)
        self.assertIn("repaired chunk " + report["bad_chunks"][0]["chunk"] + " from " + backup, p.stdout.decode())
        self.run_ckpt("verify")
        self.assertEqual(self.run_ckpt("cat", "a", "w").stdout, w.tobytes())
        self.assertEqual(self.run_ckpt("cat", "b", "w").stdout, w.tobytes())
        self.assertEqual(self.run_ckpt("cat", "b", "v").stdout, v.tobytes())
        self.assertIn("--from is for --repair", self.error_of("verify", "--from", backup))


class WritingFiles(CkptTestCase):
    """Export never replaces what it did not create, and Ctrl-C or SIGTERM
    during import or export leaves nothing behind."""

    def setUp(self):
        super().setUp()
        self.run_ckpt("init", "--pack-size", "4M")
        rng = np.random.default_rng(9)
        # 256 MiB of incompressible tensors: long enough to interrupt.
        st.write(self.path("big.safetensors"),
                 [(f"t{i:02d}", "U8", rng.integers(0, 256, 4 << 20, dtype=np.uint8)) for i in range(64)])
        st.write(self.path("small.safetensors"), [("x", "F32", np.arange(6, dtype=np.float32))])
        self.run_ckpt("import", "small", self.path("small.safetensors"))

    def packs(self):
        return sorted(os.listdir(os.path.join(self.repo, "objects", "packs")))

    def interrupt_when(self, args, ready, sig):
        """Starts ckpt ARGS, sends `sig` once ready() is true, and returns
        (exit status, stderr)."""
        p = subprocess.Popen([CKPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "CKPT_REPO": self.repo})
        deadline = time.monotonic() + 60
        while not ready() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self.assertIsNone(p.poll(), "the command ended before it could be interrupted")
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        return p.returncode, err.decode()

    def test_an_interrupted_import_leaves_nothing_and_says_so(self):
        before = self.packs()
        for sig, code, name in ((signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")):
            rc, err = self.interrupt_when(["import", "big", self.path("big.safetensors")],
                                          lambda: len(self.packs()) > len(before), sig)
            self.assertEqual(rc, code, err)
            self.assertIn(f"interrupted ({name}): import of big stopped; nothing of it was kept", err)
            self.assertEqual(self.packs(), before)
            names = [c["name"] for c in json.loads(self.run_ckpt("ls", "--all", "--json").stdout)]
            self.assertEqual(names, ["small"])
        self.run_ckpt("verify")

    def test_an_interrupted_copy_leaves_nothing_pending_and_a_rerun_completes_it(self):
        self.run_ckpt("import", "big", self.path("big.safetensors"))
        dst = self.path("dst")
        self.run_ckpt("init", "--pack-size", "4M", env={"CKPT_REPO": dst})
        dst_packs = os.path.join(dst, "objects", "packs")

        def two_packs_written():
            return os.path.isdir(dst_packs) and len(os.listdir(dst_packs)) >= 2

        rc, err = self.interrupt_when(["copy", self.repo, dst, "big"], two_packs_written, signal.SIGINT)
        self.assertEqual(rc, 130, err)
        self.assertIn(f"interrupted (SIGINT): copy stopped; nothing is left pending in {dst}", err)
        listed = json.loads(self.run_ckpt("ls", "--all", "--json", env={"CKPT_REPO": dst}).stdout)
        self.assertEqual(listed, [])
        self.run_ckpt("copy", self.repo, dst, "big")
        self.assertEqual(self.run_ckpt("cat", "big", "t00", env={"CKPT_REPO": dst}).stdout,
                         self.run_ckpt("cat", "big", "t00").stdout)

    def test_an_interrupted_export_leaves_nothing_and_a_killed_ones_temporary_is_removed_next_time(self):
        self.run_ckpt("import", "big", self.path("big.safetensors"))
        out = self.path("out.safetensors")
        tmp_prefix = os.path.basename(out) + ".ckpt-tmp-"

        def temporaries():
            return [n for n in os.listdir(self.tmp) if n.startswith(tmp_prefix)]
        rc, err = self.interrupt_when(["export", "big", out], lambda: temporaries() != [], signal.SIGTERM)
        self.assertEqual(rc, 143, err)
        self.assertIn("interrupted (SIGTERM): export of big stopped; nothing was written to", err)
        self.assertFalse(os.path.exists(out))
        self.assertEqual(temporaries(), [])
        # A SIGKILLed export leaves its temporary, named by its pid: the next
        # export removes it, and says so.
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = f"{out}.ckpt-tmp-{dead.pid}"
        with open(stale, "wb") as f:
            f.write(b"partial")
        p = self.run_ckpt("export", "small", out)
        self.assertIn(f"removed {stale}, left by an export that did not finish", p.stderr.decode())
        self.assertFalse(os.path.exists(stale))
        self.assertTrue(os.path.exists(out))

    def test_export_replaces_only_regular_files_and_only_with_force(self):
        out = self.path("o.safetensors")
        victim = self.path("victim")
        with open(victim, "w") as f:
            f.write("keep me")
        os.symlink(victim, out)
        self.assertIn("is a symbolic link; --force replaces only regular files",
                      self.error_of("export", "small", out, "--force"))
        self.assertEqual(pathlib.Path(victim).read_text(), "keep me")
        os.unlink(out)
        os.mkfifo(out)
        self.assertIn("is a FIFO", self.error_of("export", "small", out, "--force"))
        os.unlink(out)
        os.mkdir(out)
        self.assertIn("is a directory", self.error_of("export", "small", out, "--force"))
        os.rmdir(out)
        with open(out, "w") as f:
            f.write("old")
        self.assertIn("exists (use --force to overwrite)", self.error_of("export", "small", out))
        self.run_ckpt("export", "small", out, "--force")
        self.assertEqual(st.read(out)[0]["x"][1].tolist(), [0, 1, 2, 3, 4, 5])


class BadInput(CkptTestCase):
    """Malformed input gets one clear line and a non-zero exit, and the
    repository stays intact."""

    def setUp(self):
        super().setUp()
        self.run_ckpt("init")
        st.write(self.path("good.safetensors"), [("x", "F32", np.arange(6, dtype=np.float32).reshape(2, 3))])
        self.run_ckpt("import", "good", self.path("good.safetensors"))

    def assert_intact(self):
        self.run_ckpt("verify")
        names = [c["name"] for c in json.loads(self.run_ckpt("ls", "--all", "--json").stdout)]
        self.assertEqual(names, ["good"])

    def write_raw(self, name, header, data=b""):
        p = self.path(name)
        h = header if isinstance(header, bytes) else header.encode()
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + data)
        return p

    def test_inputs_that_are_not_regular_files_are_refused_at_once(self):
        fifo = self.path("fifo")
        os.mkfifo(fifo)
        os.mkdir(self.path("dir"))
        good = self.path("good.safetensors")
        cases = [(("import", "x", fifo), "not a regular file"),
                 (("import", "x", good, "--blob", "z=/dev/zero"), "not a regular file"),
                 (("import", "x", good, "--blob", f"f={fifo}"), "not a regular file"),
                 (("import", "x", good, "--blob", f"d={self.path('dir')}"), "not a regular file"),
                 (("import", "x", good, "--blob", f"m={self.path('missing')}"), "missing")]
        for args, says in cases:
            t0 = time.monotonic()
            err = self.error_of(*args)  # a FIFO or /dev/zero would block or fill memory
            self.assertLess(time.monotonic() - t0, 30, args)
            self.assertIn(says, err, args)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assert_intact()
        # A symbolic link to a regular file (as in Hugging Face's cache) is fine.
        os.symlink(good, self.path("link.safetensors"))
        os.symlink(good, self.path("blob-link"))
        self.run_ckpt("import", "linked", self.path("link.safetensors"), "--blob", f"b={self.path('blob-link')}")
        self.assertEqual(self.run_ckpt("cat", "linked", "b", "--blob").stdout, open(good, "rb").read())

    def test_names_are_checked_before_anything_is_written_and_never_printed_raw(self):
        x = np.arange(4, dtype=np.float32)
        st.write(self.path("ctl.safetensors"), [("ok", "F32", x), ("evil\x1b[2J", "F32", x)])
        st.write(self.path("long.safetensors"), [("ok", "F32", x), ("n" * 301, "F32", x)])
        before = sorted(os.listdir(os.path.join(self.repo, "objects", "packs")))
        err = self.error_of("import", "x", self.path("ctl.safetensors"))
        self.assertIn("evil\\x1b[2J", err)
        self.assertNotIn("\x1b", err)
        self.assertIn("more than the 300 allowed", self.error_of("import", "x", self.path("long.safetensors")))
        self.assertIn("holds a control character", self.error_of("import", "x", self.path("good.safetensors"),
                                                                 "--tag", "k=\x1b]0;owned\x07"))
        self.assertIn("'latest' is reserved", self.error_of("import", "latest", self.path("good.safetensors")))
        self.assertEqual(sorted(os.listdir(os.path.join(self.repo, "objects", "packs"))), before)
        self.assert_intact()

    def test_a_directory_without_weights_is_refused_naming_the_checkpoints_inside(self):
        # A training run's directory, a checkpoint in each subdirectory: not a
        # model directory whose one text file would be the whole checkpoint.
        run = self.path("run")
        for step in (100, 200, 300, 400):
            os.makedirs(os.path.join(run, f"iter_{step:07d}"))
            st.write(os.path.join(run, f"iter_{step:07d}", "model.safetensors"),
                     [("x", "F32", np.zeros(3, np.float32))])
        with open(os.path.join(run, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("400\n")
        err = self.error_of("import", "run", run).strip().splitlines()[-1]
        self.assertIn(f"{run} holds no weights to import", err)
        self.assertIn("checkpoints are in its subdirectories (iter_0000100, iter_0000200, iter_0000300 and 1 more)",
                      err)
        os.makedirs(self.path("notes"))
        with open(self.path("notes/readme.txt"), "w") as f:
            f.write("hello\n")
        self.assertIn("holds no weights to import (no *.safetensors, no DCP .metadata)\n",
                      self.error_of("import", "notes", self.path("notes")))
        self.assert_intact()

    def test_malformed_safetensors(self):
        good = pathlib.Path(self.path("good.safetensors")).read_bytes()
        cases = {
            "bad header length": (good[:8][::-1] + good[8:], "bad header length"),
            "truncated": (good[:-5], "past the end"),
            "too short": (b"abc", "too short"),
        }
        for label, (content, expect) in cases.items():
            p = self.path(label.replace(" ", "_") + ".safetensors")
            pathlib.Path(p).write_bytes(content)
            err = self.error_of("import", "new", p)
            self.assertIn(expect, err, label)
            self.assertIn(p, err)
        p = self.write_raw("json.safetensors", '{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]')
        self.assertIn("not valid JSON", self.error_of("import", "new", p))
        p = self.write_raw("dtype.safetensors", '{"x": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}', b"1234")
        self.assertIn("unknown dtype 'Q7'", self.error_of("import", "new", p))
        p = self.write_raw("size.safetensors", '{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', b"1234")
        self.assertIn("needs 8 bytes", self.error_of("import", "new", p))
        self.assertIn("No such file", self.error_of("import", "new", self.path("missing.safetensors")))
        self.assert_intact()

    def test_malformed_shard_metadata(self):
        x = np.zeros((2, 3), np.float32)
        for meta, expect in [
            ("not json", "ckptfs.shards"),
            (json.dumps({"x": {"global_shape": [4, 3]}}), "exactly one of offsets and flat_start"),
            (json.dumps({"x": {"global_shape": [4, 3], "offsets": [3, 0]}}), "exceeds shape"),
            (json.dumps({"x": {"global_shape": [4, 3], "offsets": [0]}}), "same rank"),
            (json.dumps({"x": {"global_shape": [4, 3], "flat_start": 0}}), "must be 1-D"),
            (json.dumps({"y": {"global_shape": [4, 3], "flat_start": 0}}), "does not hold"),
        ]:
            st.write(self.path("m.safetensors"), [("x", "F32", x)], {"ckptfs.shards": meta})
            self.assertIn(expect, self.error_of("import", "new", self.path("m.safetensors")), meta)
        self.assert_intact()

    def test_bad_rank_arguments(self):
        p = self.path("good.safetensors")
        self.assertIn("go together", self.error_of("import", "n", p, "--rank", "0"))
        self.assertIn("--rank must be", self.error_of("import", "n", p, "--rank", "2", "--world-size", "2"))
        self.assertIn("integer", self.error_of("import", "n", p, "--step", "ten"))
        self.assert_intact()

    def test_corrupt_pack_is_reported_and_never_read_wrong(self):
        big = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
        st.write(self.path("big.safetensors"), [("big", "F32", big)])
        self.run_ckpt("import", "big", self.path("big.safetensors"))
        packs = os.path.join(self.repo, "objects", "packs")
        largest = max((os.path.join(packs, n) for n in os.listdir(packs)), key=os.path.getsize)
        with open(largest, "r+b") as f:
            f.seek(4096)
            b = f.read(1)
            f.seek(4096)
            f.write(bytes([b[0] ^ 0xFF]))
        err = self.error_of("verify")
        self.assertIn("problem", err)
        self.assertIn("pack", err)
        report = json.loads(self.run_ckpt("verify", "--json", ok=False).stdout)
        self.assertFalse(report["ok"])
        p = self.run_ckpt("cat", "big", "big", ok=False)
        self.assertIn("chunk", p.stderr.decode())
        self.assertIn(os.path.basename(largest).split(".")[0], p.stderr.decode())
        self.assertNotEqual(p.stdout, big.tobytes())
        self.assertLess(len(p.stdout), big.nbytes)

    def test_full_disk_fails_cleanly_and_keeps_the_repository(self):
        if os.geteuid() != 0:
            self.skipTest("needs root to mount a small tmpfs")
        small = self.path("small")
        os.makedirs(small)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", small]).returncode != 0:
            self.skipTest("could not mount a tmpfs")
        try:
            repo = os.path.join(small, "repo")
            self.run_ckpt("init", "-r", repo, "--compression", "none")
            st.write(self.path("ok.safetensors"), [("x", "F32", np.arange(1000, dtype=np.float32))])
            self.run_ckpt("import", "-r", repo, "fits", self.path("ok.safetensors"))
            big = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB
            st.write(self.path("big.safetensors"), [("big", "F32", big)])
            err = self.error_of("import", "-r", repo, "too-big", self.path("big.safetensors"))
            self.assertIn("No space left on device", err)
            self.assertEqual(len(err.strip().splitlines()), 1)
            self.run_ckpt("verify", "-r", repo)
            names = [c["name"] for c in json.loads(self.run_ckpt("ls", "-r", repo, "--all", "--json").stdout)]
            self.assertEqual(names, ["fits"])
            self.assertEqual(self.run_ckpt("cat", "-r", repo, "fits", "x").stdout,
                             np.arange(1000, dtype=np.float32).tobytes())
            # gc clears what the failed save left; then there is room again
            self.run_ckpt("gc", "-r", repo)
            self.run_ckpt("import", "-r", repo, "after", self.path("ok.safetensors"))
        finally:
            subprocess.run(["umount", small])

    def test_reindex_rebuilds_a_damaged_catalog(self):
        data = os.path.join(self.repo, "catalog", "data.mdb")
        want = np.arange(6, dtype=np.float32).tobytes()
        # zeroed pages, random pages (LMDB trusts its pages: it may follow a
        # garbage page number off the map, which ckpt reports too), a file
        # that is not LMDB at all
        for damage in ("zeroed", "random", "random", "random", "whole"):
            with open(data, "r+b") as f:
                size = os.path.getsize(data)
                if damage == "whole":
                    f.truncate(0)
                    f.write(os.urandom(50000))
                else:
                    f.seek(2 * 4096)
                    f.write(bytes(size - 2 * 4096) if damage == "zeroed" else os.urandom(size - 2 * 4096))
            p = self.run_ckpt("cat", "good", "x", ok=None)
            self.assertEqual(p.returncode, 1, damage)
            err = p.stderr.decode()
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertIn("ckpt reindex", err, damage)
            self.run_ckpt("reindex")
            self.assertEqual(self.run_ckpt("cat", "good", "x").stdout, want)
            self.assert_intact()

    def test_reindex_rebuilds_a_deleted_catalog(self):
        import shutil
        shutil.rmtree(os.path.join(self.repo, "catalog"))
        self.assertIn("reindex", self.error_of("ls"))
        out = json.loads(self.run_ckpt("reindex", "--json").stdout)
        self.assertEqual(out["checkpoints"], 1)
        self.assertEqual(self.run_ckpt("cat", "good", "x").stdout, np.arange(6, dtype=np.float32).tobytes())
        self.assert_intact()


if __name__ == "__main__":
    unittest.main()


CRAFT = os.environ.get("CRAFT_RECORD_BIN") or os.path.join(os.path.dirname(__file__), "../../build/tests/craft_record")
DAMAGE_KINDS = {
    # kind: what the one-line error says
    "short-shard": "its region needs",
    "box-rank": "does not match a tensor of shape",
    "huge-chunk": "chunk of 268435457 bytes",
}


class DamagedRecords(CkptTestCase):
    """Records that pass their checksum but contradict themselves (written by
    a bug, a bad disk or on purpose) are rejected by every command with one
    line, never a crash, and never touch the checkpoints that are intact."""

    def setUp(self):
        super().setUp()
        self.run_ckpt("init", "--chunk-size", "64K")
        rng = np.random.default_rng(3)
        self.w = rng.standard_normal((300, 256)).astype(np.float32)  # 300 KiB: several chunks
        self.v = rng.standard_normal((40000,)).astype(np.float32)    # 160 KiB: several chunks
        st.write(self.path("m.safetensors"), [("w", "F32", self.w), ("v", "F32", self.v)])
        self.run_ckpt("import", "good", self.path("m.safetensors"), "--step", "1")
        self.good_export = self.path("good.safetensors")
        self.run_ckpt("export", "good", self.good_export)

    def craft(self, *args):
        p = subprocess.run([CRAFT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        return p.stdout.decode().strip()

    def fails_cleanly(self, *args, expect):
        p = self.run_ckpt(*args, ok=None)
        err = p.stderr.decode(errors="replace").strip()
        self.assertEqual(p.returncode, 1, f"{args}: exit {p.returncode} (negative: killed by a signal): {err}")
        self.assertEqual(len(err.splitlines()), 1, f"{args}: {err}")
        self.assertIn(expect, err, args)
        return err

    def assert_good_intact(self):
        self.run_ckpt("export", "good", self.path("again.safetensors"), "--force")
        self.assertEqual(pathlib.Path(self.path("again.safetensors")).read_bytes(),
                         pathlib.Path(self.good_export).read_bytes())

    def test_damaged_catalog_records_fail_every_command_cleanly(self):
        for kind, expect in DAMAGE_KINDS.items():
            with self.subTest(kind=kind):
                tensor = self.craft("catalog", self.repo, "good", kind)
                self.assertEqual(tensor, "v")  # tensors are in name order
                for args in [("show", "good"), ("show", "good", "--json"), ("cat", "good", "v"),
                             ("cat", "good", "w"), ("export", "good", self.path("out.safetensors")),
                             ("du",), ("diff", "good", "good")]:
                    err = self.fails_cleanly(*args, expect=expect)
                    self.assertIn("ckpt reindex", err)
                self.assertFalse(os.path.exists(self.path("out.safetensors")))
                p = self.run_ckpt("verify", ok=None)
                self.assertEqual(p.returncode, 1)
                self.assertIn(expect, p.stderr.decode())
                # The manifest is intact: reindex brings the checkpoint back whole.
                self.run_ckpt("reindex")
                self.run_ckpt("verify")
                self.assert_good_intact()

    def test_damaged_manifests_are_skipped_by_reindex_and_reported_by_verify(self):
        for kind in DAMAGE_KINDS:
            self.assertEqual(self.craft("manifest", self.repo, "good", "bad-" + kind, kind), "v")
        p = self.run_ckpt("reindex", ok=None)
        err = p.stderr.decode()
        self.assertEqual(p.returncode, 1, err)
        for kind, expect in DAMAGE_KINDS.items():
            self.assertRegex(err, f"skipped manifest manifests/bad-{kind}.manifest: .*{expect}")
        self.assertIn("reindex skipped 3 damaged objects", err)
        # None of them became visible; the intact checkpoint is whole.
        listed = [c["name"] for c in json.loads(self.run_ckpt("ls", "--json").stdout)]
        self.assertEqual(listed, ["good"])
        for kind in DAMAGE_KINDS:
            self.fails_cleanly("cat", "bad-" + kind, "v", expect="no checkpoint named")
            self.fails_cleanly("export", "bad-" + kind, self.path("out.safetensors"), expect="no checkpoint named")
        p = self.run_ckpt("verify", ok=None)
        self.assertEqual(p.returncode, 1)
        for kind, expect in DAMAGE_KINDS.items():
            self.assertRegex(p.stderr.decode(), f"manifest manifests/bad-{kind}.manifest: .*{expect}")
        self.run_ckpt("verify", "good")
        self.assert_good_intact()
