"""Shared helpers for the integration tests: run the real ckpt binary."""
import os
import shutil
import subprocess
import tempfile
import unittest

CKPT = os.environ.get("CKPT_BIN") or os.path.join(os.path.dirname(__file__), "../../build/tools/ckpt")
# ckpt with its crash points armed from CKPTFS_TEST_CRASH_AT and
# CKPTFS_TEST_CRASH_COUNT_FILE (ckpt itself never reads them).
CKPT_CRASHING = os.environ.get("CKPT_CRASHING_BIN") or os.path.join(os.path.dirname(__file__),
                                                                    "../../build/tests/ckpt_crashing")
CRASH_VARIABLES = ("CKPTFS_TEST_CRASH_AT", "CKPTFS_TEST_CRASH_COUNT_FILE")


def ckpt_for(env):
    """The binary to run with `env`: the crashing one when it arms crash points."""
    return CKPT_CRASHING if env and any(k in env for k in CRASH_VARIABLES) else CKPT


class CkptTestCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-it-")
        self.repo = os.path.join(self.tmp, "repo")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.tmp, name)

    def have_s3(self):
        """Whether an S3 endpoint is configured (AWS_ENDPOINT_URL); a failure
        instead of False where CKPTFS_REQUIRE_S3 says the run must have one."""
        if os.environ.get("AWS_ENDPOINT_URL"):
            return True
        if os.environ.get("CKPTFS_REQUIRE_S3"):
            self.fail("CKPTFS_REQUIRE_S3 is set but no S3 endpoint is configured")
        return False

    def require_s3(self):
        """Skips the test, saying why, unless an S3 endpoint is configured."""
        if not self.have_s3():
            self.skipTest("no S3 endpoint configured (AWS_ENDPOINT_URL)")

    def run_ckpt(self, *args, ok=True, env=None, stdout=subprocess.PIPE, use_repo=True):
        cmd = [CKPT, *args]
        e = dict(os.environ)
        e.pop("CKPT_REPO", None)
        if use_repo:
            e["CKPT_REPO"] = self.repo
        if env:
            e.update(env)
        p = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, env=e, timeout=300)
        if ok is True:
            self.assertEqual(p.returncode, 0, f"{cmd} failed: {p.stderr.decode(errors='replace')}")
        elif ok is False:
            self.assertNotEqual(p.returncode, 0, f"{cmd} unexpectedly succeeded")
            err = p.stderr.decode(errors="replace").strip()
            self.assertTrue(err, f"{cmd} failed without a message")
        return p

    def error_of(self, *args, **kw):
        """Runs a command that must fail; returns its stderr text."""
        return self.run_ckpt(*args, ok=False, **kw).stderr.decode()
