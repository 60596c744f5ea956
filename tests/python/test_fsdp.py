"""FSDP2 through DCP on the CPU: a small transformer wrapped with
fully_shard, trained by 4 gloo ranks with AdamW, saved with dcp.save into a
ckptfs repository (and with DCP's own FileSystemWriter), restored with
dcp.load at 2 and at 3 ranks, and trained on. Each rank is a process of its
own (fsdp_worker.py)."""
import json
import os
import shutil
import sys
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import ckptfs.torch as ckptfs_torch  # noqa: E402
from helpers import CkptTestCase  # noqa: E402
from test_python import run_ranks  # noqa: E402
from test_python_device import free_port  # noqa: E402

DCP_REASON = ckptfs_torch.dcp_unavailable_reason()
HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None
WORKER = os.path.join(HERE, "fsdp_worker.py")


@unittest.skipIf(DCP_REASON, DCP_REASON or "")
class Fsdp2(CkptTestCase):
    def run_job_outputs(self, world, *args):
        """Every rank's stdout, stripped."""
        port = free_port()
        outs = run_ranks(self, lambda r: [sys.executable, WORKER, *args], world,
                         lambda r: dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        return [o.strip() for o in outs]

    def run_job(self, world, *args):
        """Rank 0's JSON line."""
        [line] = [o for o in self.run_job_outputs(world, *args)[0].splitlines() if o.startswith("{")]
        return json.loads(line)

    def test_saved_at_4_ranks_restored_at_2_and_3_trains_on_exactly_as_from_dcps_own_checkpoint(self):
        ckptfs.init(self.repo)
        fsdir = self.path("dcp-fs")
        trained = self.run_job(4, "train", self.repo, fsdir)
        self.assertNotEqual(trained["initial"], trained["model"], "training changed nothing")

        repo = ckptfs.open(self.repo)
        [ckpt] = repo.checkpoints()
        self.assertEqual((ckpt["name"], ckpt["world_size"], ckpt["step"]), ("step-3", 4, 3))
        names = {t["name"] for t in repo.show("step-3")["tensors"]}
        self.assertIn("model.embed.weight", names)
        self.assertTrue(any(n.startswith("optim.state.") and n.endswith(".exp_avg_sq") for n in names), names)

        for world in (2, 3):
            with self.subTest(world=world):
                ours = self.run_job(world, "resume", "ckptfs", self.repo, fsdir)
                theirs = self.run_job(world, "resume", "fs", self.repo, fsdir)
                # Restored exactly what was saved: the whole model and optimizer state.
                self.assertEqual(ours["model"], trained["model"])
                self.assertEqual(ours["optim"], trained["optim"])
                # And training goes on bit-identically to a restore from DCP's own files.
                self.assertEqual(ours, theirs)
                self.assertNotEqual(ours["model_after"], ours["model"])
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())

    def test_saved_at_4_ranks_through_a_ckptfs_url_and_restored_at_2_exactly(self):
        """Stock dcp.save/dcp.load with checkpoint_id="ckptfs://..." (fsspec)
        and FSDP2: the same state, the same training after the restore."""
        ckptfs.init(self.repo)
        url = f"ckptfs://{self.repo}/fsdp/step-3"
        trained = self.run_job(4, "train", self.repo, url)
        names = sorted(c["name"] for c in ckptfs.open(self.repo).checkpoints())
        self.assertEqual(names, ["fsdp/step-3", "step-3"])
        ours = self.run_job(2, "resume", "ckptfs", self.repo, url)
        through_url = self.run_job(2, "resume", "fs", self.repo, url)
        self.assertEqual(through_url["model"], trained["model"])
        self.assertEqual(through_url["optim"], trained["optim"])
        self.assertEqual(through_url, ours)
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())

    def test_a_job_killed_during_async_save_resumes_from_its_last_checkpoint_bit_exact_at_4_ranks_and_at_2(self):
        # The same job, never killed: the state after every step.
        reference = self.path("reference")
        ckptfs.init(reference)
        never_killed = self.run_job(4, "job", reference, "6", "0")
        self.assertIsNone(never_killed["resumed_from"])
        # Killed in the middle of step 4's async save.
        ckptfs.init(self.repo)
        outs = self.run_job_outputs(4, "job", self.repo, "6", "4")
        self.assertEqual(outs, [""] * 4, "every rank should have died in the save")
        repo = ckptfs.open(self.repo)
        self.assertEqual([c["name"] for c in repo.checkpoints()], ["step-1", "step-2", "step-3"])
        [pending] = [c for c in repo.checkpoints(include_pending=True) if c["state"] == "pending"]
        self.assertTrue(pending["name"].startswith("step-4"), pending)
        self.assertEqual(pending["world_size"], 4)
        # The same crash, for the restart at 2 ranks.
        shutil.copytree(self.repo, self.path("for-2-ranks"), symlinks=True)
        for world, repo_dir in ((4, self.repo), (2, self.path("for-2-ranks"))):
            with self.subTest(restarted_at=world):
                resumed = self.run_job(world, "job", repo_dir, "6", "0")
                # Resumed from the last committed step, with exactly what it held.
                self.assertEqual(resumed["resumed_from"], 3)
                self.assertEqual(resumed["restored"], never_killed["after"]["3"])
                if world == 4:
                    # At the same world size, training goes on bit-exact:
                    # steps 4-6 give what the job never killed got.
                    for step in ("4", "5", "6"):
                        self.assertEqual(resumed["after"][step], never_killed["after"][step], step)
                else:
                    self.assertNotEqual(resumed["after"]["6"], resumed["restored"], "training changed nothing")
                # Step 4 saved again over the crashed attempt, never mixed
                # with it: at the restarted world size, every rank's part.
                repo = ckptfs.open(repo_dir)
                listed = {c["name"]: c for c in repo.checkpoints(include_pending=True)}
                self.assertEqual(sorted(listed), [f"step-{i}" for i in range(1, 7)])
                for step in (4, 5, 6):
                    c = listed[f"step-{step}"]
                    self.assertEqual((c["state"], c["world_size"], c["step"]), ("committed", world, step))
                self.assertIn("ok", self.run_ckpt("verify", env={"CKPT_REPO": repo_dir}).stdout.decode())

    @unittest.skipUnless(HAVE_FUSE, "no FUSE here (/dev/fuse, fusermount3)")
    def test_a_hugging_face_model_saved_from_fsdp2_with_its_config_loads_with_from_pretrained_when_mounted(self):
        from test_huggingface import HF_REASON, assert_loads_like, mounted, tiny_model
        if HF_REASON:
            self.skipTest(HF_REASON)
        ckptfs.init(self.repo)
        self.run_job(2, "hf", self.repo)
        with mounted(self) as mnt:
            assert_loads_like(self, os.path.join(mnt, "fsdp-hf"), tiny_model(), torch.tensor([[1, 5, 9, 33, 70]]))


if __name__ == "__main__":
    unittest.main()
