"""The ckpt command against a store that lies (hostile_s3.py): every
refusal ends in bounded time and memory with one clear line, and nothing is
written outside the cache directory or sent outside the repository."""
import itertools
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
from helpers import CKPT
from hostile_s3 import HostileS3

DEADLINE_S = 3        # CKPT_S3_REQUEST_DEADLINE for these tests
MAX_SECONDS = 45      # a refusal takes at most this long
MAX_RSS = 400 << 20   # and at most this much memory


class HostileStore(unittest.TestCase):
    counter = itertools.count()

    @classmethod
    def setUpClass(cls):
        cls.server = HostileS3()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-hostile-")
        self.home = os.path.join(self.tmp, "home")
        self.cwd = os.path.join(self.tmp, "cwd")
        os.makedirs(self.home)
        os.makedirs(self.cwd)
        self.url = f"s3://bucket/run-{next(self.counter)}"
        self.server.state.mode = "honest"
        self.data = np.random.default_rng(3).standard_normal(300_000).astype(np.float32)
        self.input = os.path.join(self.tmp, "in.safetensors")
        st.write(self.input, [("w", "F32", self.data)])
        self.ckpt("init", "--chunk-size", "64K")
        self.ckpt("import", "step-1", self.input)

    def tearDown(self):
        self.server.state.mode = "honest"
        shutil.rmtree(self.tmp, ignore_errors=True)

    def ckpt(self, *args, ok=True, without=(), extra=None):
        """Runs ckpt; returns (exit code, stdout bytes, stderr text, seconds, its own peak RSS in bytes)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPT_"))}
        env.update(AWS_ENDPOINT_URL=self.server.endpoint, AWS_ACCESS_KEY_ID="hostile", AWS_SECRET_ACCESS_KEY="secret",
                   HOME=self.home, CKPT_REPO=self.url, CKPT_S3_REQUEST_DEADLINE=str(DEADLINE_S))
        for name in without:
            env.pop(name, None)
        env.update(extra or {})
        t0 = time.monotonic()
        p = subprocess.Popen([CKPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=self.cwd)
        killer = threading.Timer(120, lambda: p.send_signal(signal.SIGKILL))
        killer.start()
        out, err = p.stdout.read(), p.stderr.read()  # both are small: read one, then the other
        p.stdout.close()
        p.stderr.close()
        _, status, usage = os.wait4(p.pid, 0)
        killer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - t0
        if ok:
            self.assertEqual(p.returncode, 0, err.decode(errors="replace"))
        return p.returncode, out, err.decode(errors="replace"), seconds, usage.ru_maxrss * 1024

    def refused(self, *args, says, without=(), env=None):
        code, _, err, seconds, rss = self.ckpt(*args, ok=False, without=without, extra=env)
        self.assertNotEqual(code, 0, f"ckpt {args} succeeded against a hostile store")
        self.assertNotEqual(code, -signal.SIGKILL, f"ckpt {args} hung")
        lines = err.strip().splitlines()
        self.assertEqual(len(lines), 1, err)
        self.assertIn(says, lines[0])
        self.assertLess(seconds, MAX_SECONDS, err)
        self.assertLess(rss, MAX_RSS, f"peak RSS {rss >> 20} MiB")
        self.assertEqual(os.listdir(self.cwd), [], "files were written in the working directory")
        self.assertEqual(sorted(os.listdir(self.tmp)), ["cwd", "home", "in.safetensors"])
        return lines[0]

    def test_an_honest_store_serves_the_checkpoint_bit_exact(self):
        _, out, _, _, _ = self.ckpt("cat", "step-1", "w")
        self.assertEqual(out, self.data.tobytes())

    def test_a_repository_id_that_is_a_path_is_refused_and_creates_nothing(self):
        target = os.path.join(self.tmp, "evil-target")
        caches = os.path.join(self.home, ".cache", "ckptfs")
        before = sorted(os.listdir(caches))  # the honest repository's
        self.server.state.evil_id_target = target.lstrip("/")
        self.server.state.mode = "evil-id"
        line = self.refused("ls", says="'repository_id' must be 1 to 64 of [A-Za-z0-9_-]")
        self.assertIn("ckptfs.json", line)
        self.assertFalse(os.path.exists(target))
        self.assertEqual(sorted(os.listdir(caches)), before)

    def test_no_home_means_a_clear_error_not_a_shared_directory(self):
        shared = f"/tmp/ckptfs-cache-{os.getuid()}"
        existed = os.path.exists(shared)
        self.refused("ls", says="HOME and XDG_CACHE_HOME are unset; give --cache-dir DIR", without=("HOME",
                                                                                                  "XDG_CACHE_HOME"))
        self.assertEqual(os.path.exists(shared), existed)
        _, out, _, _, _ = self.ckpt("ls", "--cache-dir", os.path.join(self.home, "given"), without=("HOME",))
        self.assertIn(b"step-1", out)
        self.assertEqual(os.stat(os.path.join(self.home, "given")).st_mode & 0o777, 0o700)

    def test_credentials_come_from_the_profile_and_are_read_again_when_expired(self):
        state = self.server.state
        creds = os.path.join(self.tmp, "credentials")
        config = os.path.join(self.tmp, "config")

        def write_credentials(key, secret):
            with open(creds, "w") as f:
                f.write(f"[default]\naws_access_key_id = other\naws_secret_access_key = other\n\n"
                        f"[ci]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
        write_credentials("old-key", "old-secret-123")
        with open(config, "w") as f:
            f.write(f"[profile ci]\nregion = us-east-1\nendpoint_url = {self.server.endpoint}\n")
        # A credential helper rewrites the file when the old key expires.
        state.expired_key = "old-key"
        state.on_expired = lambda: write_credentials("new-key", "new-secret-456")
        state.mode = "expiring"
        with state.lock:
            del state.access_keys[:]
        env = {"AWS_PROFILE": "ci", "AWS_SHARED_CREDENTIALS_FILE": creds, "AWS_CONFIG_FILE": config}
        rc, out, err, _, _ = self.ckpt("ls", without=("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
                                       extra=env)
        self.assertEqual(rc, 0, err)
        self.assertIn(b"step-1", out)
        with state.lock:
            keys = list(state.access_keys)
        self.assertEqual(keys[0], "old-key")
        self.assertEqual(keys[-1], "new-key")
        # Each of the command's two store clients (the repository's top and
        # its objects) learns of the expiry once, then uses the new key.
        self.assertLessEqual(keys.count("old-key"), 2, keys)
        # Credentials the store refuses: the message names where they came
        # from, never the secret.
        write_credentials("old-key", "old-secret-123")
        state.on_expired = None
        code, _, err, _, _ = self.ckpt("ls", ok=False, without=("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                                                 "AWS_SECRET_ACCESS_KEY"), extra=env)
        self.assertNotEqual(code, 0)
        self.assertIn(f"refused the credentials (ExpiredToken): check profile 'ci' of {creds}", err)
        self.assertNotIn("secret", err)

    def test_bodies_that_never_end_are_cut_at_their_bound(self):
        self.server.state.mode = "endless-config"
        self.refused("ls", says="longer than the 1048576 bytes such an answer may have")
        self.server.state.mode = "endless-error"
        self.refused("ls", says="longer than the 65536 bytes such an answer may have")

    def test_a_huge_content_length_is_refused_before_the_body_is_read(self):
        self.server.state.mode = "huge-length"
        self.refused("ls", says="longer than the 1048576 bytes")

    def test_a_trickling_answer_ends_at_the_request_deadline(self):
        self.server.state.mode = "trickle-config"
        line = self.refused("ls", says=f"no complete answer within {DEADLINE_S} s")
        self.assertIn("CKPT_S3_REQUEST_DEADLINE", line)

    def test_a_listing_that_repeats_its_token_stops(self):
        self.server.state.mode = "repeat-token"
        self.refused("ls", says="repeats a continuation token")

    def test_a_listing_with_a_fresh_token_on_every_page_stops(self):
        # The same keys again under new tokens: stopped at the second page.
        self.server.state.mode = "fresh-token"
        self.server.state.pages_sent = 0
        self.refused("ls", says="keys out of order or repeated, so the listing would not end")
        self.assertLessEqual(self.server.state.pages_sent, 4)  # two pages a listing; ls may list twice
        # Pages without keys under new tokens: stopped after 100.
        self.server.state.mode = "empty-pages"
        self.server.state.pages_sent = 0
        self.refused("ls", says="passed 100 pages that hold no key without ending")
        self.assertLessEqual(self.server.state.pages_sent, 110)
        # Keys that never run out: stopped at the bound, in bounded time.
        self.server.state.mode = "endless-keys"
        self.server.state.pages_sent = 0
        start = time.monotonic()
        self.refused("ls", says="the store's listing does not end (CKPT_S3_MAX_LIST_KEYS, now 20000",
                     env={"CKPT_S3_MAX_LIST_KEYS": "20000"})
        self.assertLessEqual(self.server.state.pages_sent, 25)  # 20 pages, and single-page listings elsewhere
        self.assertLess(time.monotonic() - start, 60)

    def test_a_listing_with_keys_outside_its_prefix_is_refused(self):
        self.server.state.mode = "outside-keys"
        self.refused("ls", says="returned a key outside it")

    def test_wrong_ranged_bodies_are_errors_not_wrong_bytes(self):
        for mode, says in (("short-range", "bytes asked for"), ("ignore-range", "bytes such an answer may have")):
            self.server.state.mode = mode
            shutil.rmtree(os.path.join(self.home, ".cache"), ignore_errors=True)  # no chunk cached
            code, out, err, _, _ = self.ckpt("cat", "step-1", "w", ok=False)
            self.assertNotEqual(code, 0, mode)
            self.assertIn(says, err, mode)
            self.assertNotEqual(out, self.data.tobytes())

    def test_gc_aborts_only_uploads_under_its_prefix(self):
        state = self.server.state
        prefix = self.url[len("s3://bucket/"):]
        with state.lock:
            state.uploads["good"] = ("bucket", prefix + "/objects/packs/unfinished", {})
            del state.requests[:]
        state.mode = "evil-uploads"
        self.ckpt("gc")
        with state.lock:
            deletes = [(path, q) for method, path, q in state.requests if method == "DELETE"]
        aborted = sorted(q["uploadId"] for _, q in deletes if "uploadId" in q)
        self.assertEqual(aborted, ["good"])
        for path, _ in deletes:
            self.assertTrue(path.startswith(f"/bucket/{prefix}/"), path)
            self.assertNotIn("..", path)


if __name__ == "__main__":
    unittest.main()
