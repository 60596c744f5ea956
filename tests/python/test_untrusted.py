"""Files from elsewhere, and directories other users can write: `ckpt import`
and `ckpt export` with the torch formats run no code a file or the working
directory names, trust no partial export they did not make, follow no
symbolic link out of an imported directory without being told, and turn a
damaged input into one error line."""
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import unittest
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import ckptfs.formats as formats  # noqa: E402
from helpers import CKPT, CkptTestCase  # noqa: E402
from test_dcp import DCP_REASON  # noqa: E402
from test_formats import export_dying_at_the_second_shard  # noqa: E402


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


class ExportPartials(UntrustedTestCase):
    """OUT.ckpt-export-partial is the export's own directory: a resume takes
    only one this user made, owner-only, with the same settings, and keeps
    a finished file only if its bytes are still those written."""

    def setUp(self):
        super().setUp()
        self.r = ckptfs.open(self.repo)
        gen = torch.Generator().manual_seed(7)
        self.r.save("big", {f"layer{i}": torch.randn(64, 64, generator=gen) for i in range(4)})
        self.out = self.path("out")
        self.partial = self.out + formats.PARTIAL_SUFFIX

    def interrupted(self, out=None):
        """An hf export of 'big' into `out` that stops after its first shard."""
        out = out or self.out
        export_dying_at_the_second_shard(self, self.r, "big", out)
        return out + formats.PARTIAL_SUFFIX

    def export(self, **kw):
        return formats.export_checkpoint(self.r, "big", self.out, format="hf", max_shard_size="20KB", **kw)

    def test_the_partial_directory_is_owner_only_and_the_result_is_not(self):
        partial = self.interrupted()
        self.assertEqual(os.stat(partial).st_mode & 0o777, 0o700)
        done = self.export()
        self.assertEqual(done["resumed_files"], 1)
        self.assertEqual(os.stat(self.out).st_mode & 0o777, 0o777 & ~formats.writing.umask())

    def test_a_finished_file_damaged_since_is_written_again(self):
        partial = self.interrupted()
        first = "model-00001-of-00004.safetensors"
        with open(os.path.join(partial, first), "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0xFF]))
        done = self.export()
        self.assertEqual((done["resumed_files"], done["rewritten_files"]), (0, [first]))
        fresh = formats.export_checkpoint(self.r, "big", self.path("fresh"), format="hf", max_shard_size="20KB")
        for f in fresh["files"]:
            with open(os.path.join(self.out, f), "rb") as a, open(os.path.join(self.path("fresh"), f), "rb") as b:
                self.assertEqual(a.read(), b.read(), f)
        # The CLI says so.
        self.interrupted(self.path("cli"))
        with open(os.path.join(self.path("cli") + formats.PARTIAL_SUFFIX, first), "ab") as f:
            f.write(b"x")
        _, err = self.ckpt("export", "big", self.path("cli"), "--format", "hf", "--max-shard-size", "20KB")
        self.assertIn(f"{first}, finished by the interrupted export, no longer had the bytes", err)

    def test_a_partial_others_can_write_or_that_is_a_link_is_refused(self):
        partial = self.interrupted()
        os.chmod(partial, 0o777)
        with self.assertRaises(ckptfs.AlreadyExistsError) as e:
            self.export()
        self.assertIn("was not made by an export of this user", str(e.exception))
        self.assertFalse(os.path.exists(self.out))
        # A link to a directory: refused too, and --clean removes the link,
        # not what it points to.
        elsewhere = self.path("elsewhere")
        os.rename(partial, elsewhere)
        os.symlink(elsewhere, partial)
        _, err = self.ckpt("export", "big", self.out, "--format", "hf", "--max-shard-size", "20KB", ok=False)
        self.assertIn("is not a directory an export made", err)
        self.ckpt("export", "big", self.out, "--format", "hf", "--max-shard-size", "20KB", "--clean")
        self.assertTrue(os.path.isdir(elsewhere))
        self.assertEqual(len(os.listdir(self.out)), 5)

    @unittest.skipUnless(os.geteuid() == 0, "needs root, to plant a directory owned by another user")
    def test_a_partial_planted_by_another_user_is_never_trusted(self):
        victim = self.path("victim")
        with open(victim, "wb") as f:
            f.write(b"secret")
        os.chmod(victim, 0o600)
        partial = self.interrupted()
        # Another user's copy of a real partial, a link where the next shard
        # goes: what the export would write there lands in the victim file.
        for n in os.listdir(partial):
            if n.endswith(".safetensors") and n != "model-00001-of-00004.safetensors":
                os.unlink(os.path.join(partial, n))
        os.symlink(victim, os.path.join(partial, "model-00002-of-00004.safetensors.tmp"))
        os.chmod(partial, 0o700)
        os.chown(partial, 65534, 65534)
        with self.assertRaises(ckptfs.AlreadyExistsError) as e:
            self.export()
        self.assertIn("owner uid 65534", str(e.exception))
        with open(victim, "rb") as f:
            self.assertEqual(f.read(), b"secret")
        self.assertFalse(os.path.exists(self.out))


class Links(UntrustedTestCase):
    """A symbolic link in an imported directory is followed only while it
    stays inside the directory, unless --follow-symlinks; a dry run lists
    the links it would follow."""

    def model_dir(self):
        from safetensors.torch import save_file  # noqa: PLC0415

        d = self.path("model")
        os.makedirs(os.path.join(d, "sub"))
        save_file({"a": torch.ones(3)}, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "sub", "tokenizer.json"), "w") as f:
            f.write("{}")
        os.symlink("sub/tokenizer.json", os.path.join(d, "tokenizer.json"))  # inside: followed
        return d

    def test_a_link_out_of_a_safetensors_model_directory_is_refused(self):
        d = self.model_dir()
        secret = self.path("secret")
        with open(secret, "w") as f:
            f.write("root:x")
        out, _ = self.ckpt("import", "--dry-run", "m", d)
        self.assertIn(f"(symbolic link {d}/tokenizer.json -> {d}/sub/tokenizer.json, followed)", out)
        os.symlink(secret, os.path.join(d, "config.json"))
        for args in (["--dry-run"], []):
            _, err = self.ckpt("import", *args, "m", d, ok=False)
            self.assertIn(f"{d}/config.json -> {secret}: a symbolic link in {d} to a file outside it", err)
            self.assertIn("--follow-symlinks", err)
        self.assertEqual(ckptfs.open(self.repo).checkpoints(), [])
        with self.assertRaises(ckptfs.InvalidArgumentError):
            ckptfs.open(self.repo).import_safetensors("m", d)
        out, _ = self.ckpt("import", "--dry-run", "--json", "--follow-symlinks", "m", d)
        self.assertEqual(sorted(x["target"] for x in json.loads(out)["links"]), sorted([secret, f"{d}/sub/tokenizer.json"]))
        self.ckpt("import", "--follow-symlinks", "m", d)
        self.assertEqual(ckptfs.open(self.repo).blob("m", "config.json"), b"root:x")

    @unittest.skipIf(DCP_REASON, DCP_REASON or "")
    def test_a_link_out_of_a_dcp_directory_is_refused(self):
        src = self.path("dcp")
        dcp_save({"w": torch.arange(10.0)}, src)
        secret = self.path("secret")
        with open(secret, "w") as f:
            f.write("root:x")
        os.symlink(secret, os.path.join(src, "common.pt"))
        _, err = self.ckpt("import", "--dry-run", "d", src, ok=False)
        self.assertIn(f"{src}/common.pt -> {secret}: a symbolic link in {src} to a file outside it", err)
        # A .distcp file the metadata names, moved out and linked back.
        os.unlink(os.path.join(src, "common.pt"))
        distcp = [n for n in os.listdir(src) if n.endswith(".distcp")][0]
        os.rename(os.path.join(src, distcp), self.path(distcp))
        os.symlink(self.path(distcp), os.path.join(src, distcp))
        _, err = self.ckpt("import", "d", src, ok=False)
        self.assertIn(f"{src}/{distcp} -> {self.path(distcp)}: a symbolic link", err)
        out, _ = self.ckpt("import", "--follow-symlinks", "--dry-run", "d", src)
        self.assertIn(f"(symbolic link {src}/{distcp} -> {self.path(distcp)}, followed)", out)
        self.ckpt("import", "--follow-symlinks", "d", src)


class KernelFiles(UntrustedTestCase):
    """procfs and sysfs files say they hold 0 bytes (or 4096) and then give
    others: refused, never stored as an empty blob."""

    def test_proc_and_sys_files_are_refused(self):
        _, err = self.ckpt("import", "--blob", "status=/proc/self/status", "x", self.model(), ok=False)
        self.assertIn("/proc/self/status is a file of a kernel filesystem", err)
        d = self.model()
        os.symlink("/proc/self/status", os.path.join(d, "status.json"))
        _, err = self.ckpt("import", "--follow-symlinks", "x", d, ok=False)
        self.assertIn(f"{d}/status.json is a file of a kernel filesystem", err)
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
            _, err = self.ckpt("import", "--blob", "t=/sys/kernel/mm/transparent_hugepage/enabled", "x", self.model(),
                               ok=False)
            self.assertIn("is a file of a kernel filesystem", err)
        self.assertEqual(ckptfs.open(self.repo).checkpoints(), [])

    def model(self):
        from safetensors.torch import save_file  # noqa: PLC0415

        d = self.path(f"model{len(os.listdir(self.tmp))}")
        os.makedirs(d)
        save_file({"a": torch.ones(3)}, os.path.join(d, "model.safetensors"))
        return d


class DamagedTorchInputs(UntrustedTestCase):
    def test_a_deeply_nested_torch_save_file_is_one_line(self):
        path = self.path("nested.pt")
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(20000)
        try:
            state = {"w": torch.ones(2)}
            for _ in range(3000):
                state = {"x": state}
            torch.save(state, path)
        finally:
            sys.setrecursionlimit(limit)
        _, err = self.ckpt("import", "n", path, ok=False)
        self.assertEqual(len(err.splitlines()), 1, err[-2000:])
        self.assertIn("nests objects deeper than", err)

    def test_a_torch_save_file_truncated_during_its_import_is_one_line(self):
        path = self.path("big.pt")
        gen = torch.Generator().manual_seed(1)
        torch.save({f"w{i}": torch.randn(1 << 20, generator=gen) for i in range(48)}, path)
        e = dict(os.environ, CKPT_REPO=self.repo, CKPT_PYTHON=sys.executable)
        p = subprocess.Popen([CKPT, "import", "--progress=json", "big", path], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=e)
        # Once the import has mapped the file (the command's Python, which
        # replaced the ckpt process), it is stopped, the file cut short and
        # the import let go on.
        deadline = time.monotonic() + 120
        while True:
            self.assertIsNone(p.poll(), "the import ended before it mapped its input")
            self.assertLess(time.monotonic(), deadline)
            try:
                with open(f"/proc/{p.pid}/maps") as f:
                    if path in f.read():
                        break
            except OSError:
                pass
            time.sleep(0.0005)
        os.kill(p.pid, signal.SIGSTOP)
        os.truncate(path, 4096)
        os.kill(p.pid, signal.SIGCONT)
        rest = p.stderr.read().decode().strip()
        self.assertEqual(p.wait(timeout=300), 1, rest)
        lines = [x for x in rest.splitlines() if not x.startswith("{")]
        self.assertEqual(len(lines), 1, rest)
        self.assertIn("was truncated or damaged while it was read", lines[0])
        self.assertEqual(ckptfs.open(self.repo).checkpoints(), [])


if __name__ == "__main__":
    unittest.main()
