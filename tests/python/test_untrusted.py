"""Files from elsewhere, and directories other users can write: `ckpt import`
and `ckpt export` with the torch formats run no code a file or the working
directory names, trust no partial export they did not make, follow no
symbolic link out of an imported directory without being told, and turn a
damaged input into one error line."""
import json
import os
import pickle
import subprocess
import sys
import unittest
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import ckptfs.formats as formats  # noqa: E402
from helpers import CKPT, CkptTestCase  # noqa: E402
from test_dcp import DCP_REASON  # noqa: E402


class _RunsCode:
    """Pickles as a call of os.system (what a hostile .metadata holds)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def dcp_save(state, path):
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)


class UntrustedTestCase(CkptTestCase):
    def setUp(self):
        super().setUp()
        ckptfs.init(self.repo)
        self.marker = self.path("code-ran")

    def ckpt(self, *args, ok=True, cwd=None, env=None):
        """`ckpt ARGS` with the torch formats handed to this Python."""
        e = dict(os.environ, CKPT_REPO=self.repo, CKPT_PYTHON=sys.executable, **(env or {}))
        p = subprocess.run([CKPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e, timeout=300,
                           cwd=cwd)
        err = p.stderr.decode(errors="replace").strip()
        if ok:
            self.assertEqual(p.returncode, 0, err)
        else:
            self.assertNotEqual(p.returncode, 0, f"ckpt {args} unexpectedly succeeded")
            self.assertTrue(err, "failed without a message")
            self.assertNotIn("Traceback", err)
        return p.stdout.decode(), err


@unittest.skipIf(DCP_REASON, DCP_REASON or "")
class Pickles(UntrustedTestCase):
    def hostile_dcp(self):
        path = self.path("hostile")
        dcp_save({"w": torch.arange(10.0)}, path)
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(_RunsCode(self.marker), f)
        return path

    def test_a_dcp_metadata_naming_other_code_is_refused_without_running_it(self):
        path = self.hostile_dcp()
        for args in (["--dry-run"], [], ["--dry-run", "--json"]):
            _, err = self.ckpt("import", *args, "x", path, ok=False)
            self.assertIn("names posix.system", err)
            self.assertIn("--trust-pickle", err)
            self.assertFalse(os.path.exists(self.marker), f"code ran under import {args}")
        self.assertEqual(ckptfs.open(self.repo).checkpoints(), [])
        with self.assertRaises(ckptfs.UnsupportedError):
            formats.import_checkpoint(ckptfs.open(self.repo), "x", path, dry_run=True)
        self.assertFalse(os.path.exists(self.marker))

    def test_trust_pickle_reads_it_as_torch_does(self):
        path = self.hostile_dcp()
        self.ckpt("import", "--trust-pickle", "--dry-run", "x", path, ok=False)  # not DCP metadata after all
        self.assertTrue(os.path.exists(self.marker))

    def test_a_real_dcp_checkpoint_of_every_metadata_kind_still_imports(self):
        path = self.path("real")
        dcp_save({"w": torch.arange(10.0), "b": torch.ones(3, dtype=torch.bfloat16),
                  "extra": {"epoch": 3, "names": ["a", "b"], "lr": 0.5}}, path)
        out, _ = self.ckpt("import", "--dry-run", "--json", "x", path)
        self.assertEqual(sorted(t["name"] for t in json.loads(out)["tensors"]), ["b", "w"])
        self.ckpt("import", "x", path)
        r = ckptfs.open(self.repo)
        w = torch.empty(10)
        r.load("x", {"w": w})
        self.assertTrue(torch.equal(w, torch.arange(10.0)))

    def test_a_damaged_metadata_is_one_line(self):
        path = self.path("damaged")
        dcp_save({"w": torch.arange(10.0)}, path)
        meta = os.path.join(path, ".metadata")
        with open(meta, "rb") as f:
            data = f.read()
        with open(meta, "wb") as f:
            f.write(data[: len(data) // 2])
        _, err = self.ckpt("import", "--dry-run", "x", path, ok=False)
        self.assertIn(".metadata", err)
        self.assertEqual(len(err.splitlines()), 1, err)


@unittest.skipIf(DCP_REASON, DCP_REASON or "")
class WorkingDirectory(UntrustedTestCase):
    def test_modules_in_the_working_directory_are_never_imported(self):
        cwd = self.path("cwd")
        os.makedirs(cwd)
        for module in ("argparse", "torch", "json", "ckptfs", "numpy"):
            with open(os.path.join(cwd, module + ".py"), "w") as f:
                f.write(f"open({self.marker!r}, 'a').write({module!r} + '\\n')\n")
        src = self.path("dcp")
        dcp_save({"w": torch.arange(10.0)}, src)
        tsave = self.path("t.pt")
        torch.save({"a": torch.ones(4)}, tsave)
        # PYTHONPATH's relative and empty entries would name the working
        # directory again: they are dropped.
        env = {"PYTHONPATH": os.pathsep.join(["", ".", os.environ.get("PYTHONPATH", "")])}
        self.ckpt("import", "--dry-run", "d", src, cwd=cwd, env=env)
        self.ckpt("import", "d", src, cwd=cwd, env=env)
        self.ckpt("import", "t", tsave, cwd=cwd, env=env)
        self.ckpt("export", "t", self.path("out"), "--format", "torch", cwd=cwd, env=env)
        self.assertFalse(os.path.exists(self.marker), open(self.marker).read() if os.path.exists(self.marker) else "")


if __name__ == "__main__":
    unittest.main()
