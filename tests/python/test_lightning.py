"""Lightning with ckptfs.lightning.CkptfsCheckpointIO: a tiny LightningModule
trained on the CPU, ModelCheckpoint(save_top_k=2, save_last=True) saving
into a repository, removals becoming rm, and trainer.fit(ckpt_path=...)
resuming bit-identically to a run that never stopped."""
import json
import os
import sys
import time
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
from helpers import CkptTestCase  # noqa: E402

try:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptfs.lightning import CkptfsCheckpointIO, checkpoint_name, file_name
    LIGHTNING_REASON = None
except ImportError as e:  # the test environment installs lightning
    LIGHTNING_REASON = f"lightning is not importable: {e}"


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


if LIGHTNING_REASON is None:
    class TinyModule(L.LightningModule):
        def __init__(self, width=8):
            super().__init__()
            self.save_hyperparameters()
            self.frozen = torch.nn.Linear(width, width)       # never trained: deduplicated across checkpoints
            self.frozen.requires_grad_(False)
            self.layer = torch.nn.Linear(width, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(torch.tanh(self.frozen(x))), y)
            self.log("train_loss", loss, on_epoch=True, on_step=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05)

    def data():
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(64, 8, generator=gen)
        y = torch.randn(64, 4, generator=gen)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


@unittest.skipIf(LIGHTNING_REASON, LIGHTNING_REASON or "")
class Lightning(CkptTestCase):
    def setUp(self):
        super().setUp()
        ckptfs.init(self.repo)
        self.dirpath = self.path("ckpts")

    def trainer(self, epochs, checkpointing=True):
        callbacks = [ModelCheckpoint(dirpath=self.dirpath, filename="{epoch}-{step}", monitor="train_loss",
                                     mode="min", save_top_k=2, save_last=True)] if checkpointing else []
        return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, deterministic=True,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         plugins=[CkptfsCheckpointIO(self.repo)] if checkpointing else [],
                         enable_checkpointing=checkpointing)

    def test_top_k_checkpoints_live_in_the_repository_and_resume_bit_identically(self):
        L.seed_everything(0)
        straight = TinyModule()
        self.trainer(5, checkpointing=False).fit(straight, data())

        L.seed_everything(0)
        model = TinyModule()
        trainer = self.trainer(3)
        trainer.fit(model, data())
        callback = trainer.checkpoint_callback
        # Lightning's files are references, small; the checkpoints are in the repository.
        files = sorted(os.listdir(self.dirpath))
        self.assertEqual(files, sorted(os.path.basename(p) for p in [*callback.best_k_models, callback.last_model_path]))
        for f in files:
            self.assertLess(os.path.getsize(os.path.join(self.dirpath, f)), 1024, f)
            with open(os.path.join(self.dirpath, f)) as ref:
                self.assertEqual(json.load(ref)["checkpoint"], checkpoint_name(f))
        repo = ckptfs.open(self.repo)
        names = sorted(c["name"] for c in repo.checkpoints())
        kept = sorted(checkpoint_name(p) for p in callback.best_k_models) + [checkpoint_name(callback.last_model_path)]
        self.assertEqual(names, sorted(kept))
        # save_top_k=2 of 3 epochs: the first epoch's checkpoint was removed.
        self.assertEqual(len(names), 3, names)
        self.assertNotIn("epoch_3D0-step_3D8.ckpt", names)
        self.assertIn("epoch_3D2-step_3D24.ckpt", names)
        shown = repo.show("last.ckpt")
        tensors = {t["name"] for t in shown["tensors"]}
        self.assertIn("state_dict/layer.weight", tensors)
        self.assertIn("optimizer_states/0/state/0/exp_avg", tensors)
        self.assertEqual([b["name"] for b in shown["blobs"]], ["lightning.pt"])
        self.assertEqual(shown["step"], 24)
        # The frozen layer is stored once for all three checkpoints.
        du = json.loads(self.run_ckpt("du", "--json").stdout)
        frozen = sum(t.numel() * t.element_size() for t in model.frozen.state_dict().values())
        self.assertLessEqual(du["total"]["unique_raw_bytes"], du["total"]["logical_bytes"] - 2 * frozen)

        # Resume from last.ckpt to 5 epochs: the same weights as 5 epochs straight.
        L.seed_everything(0)
        resumed = TinyModule()
        trainer = self.trainer(5)
        trainer.fit(resumed, data(), ckpt_path=callback.last_model_path)
        self.assertEqual(trainer.global_step, 40)
        for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
            self.assertEqual(bits(a), bits(b), name)
        # And the resumed run's own checkpoints went on into the repository.
        self.assertIn("epoch_3D4-step_3D40.ckpt", [c["name"] for c in ckptfs.open(self.repo).checkpoints()])

    def test_fit_from_last_resumes_and_a_second_run_in_the_directory_gets_versioned_names(self):
        L.seed_everything(0)
        straight = TinyModule()
        self.trainer(5, checkpointing=False).fit(straight, data())
        L.seed_everything(0)
        first = self.trainer(3)
        first.fit(TinyModule(), data())
        first_names = sorted(c["name"] for c in ckptfs.open(self.repo).checkpoints())
        # ckpt_path="last" finds last.ckpt as it would a file of its own (a
        # module initialised from another seed ends equal only if restored).
        L.seed_everything(1)
        resumed = TinyModule()
        trainer = self.trainer(5)
        trainer.fit(resumed, data(), ckpt_path="last")
        self.assertEqual(os.path.basename(trainer.ckpt_path), "last.ckpt")
        self.assertEqual(trainer.global_step, 40)
        for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
            self.assertEqual(bits(a), bits(b), name)
        # A new run in the same directory: Lightning sees last.ckpt taken and
        # saves last-v1.ckpt, leaving the earlier run's last alone.
        L.seed_everything(0)
        second = self.trainer(1)
        second.fit(TinyModule(), data())
        self.assertEqual(os.path.basename(second.checkpoint_callback.last_model_path), "last-v1.ckpt")
        names = [c["name"] for c in ckptfs.open(self.repo).checkpoints()]
        self.assertIn("last-v1.ckpt", names)
        self.assertIn("last.ckpt", names)
        self.assertEqual(ckptfs.open(self.repo).show("last.ckpt")["step"], 40)

    def test_under_lightnings_async_checkpoint_io_saves_and_removals_land_in_the_repository(self):
        from unittest import mock  # noqa: PLC0415

        from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO  # noqa: PLC0415

        ours = CkptfsCheckpointIO(self.repo)
        save, landed = ours.save_checkpoint, []

        def slow_save(*args, **kwargs):
            # Each save lands well after the next epoch asks for the next
            # one, so that the top-k removal of epoch 0 comes while its save
            # is still queued on AsyncCheckpointIO's thread (as on a busy host).
            time.sleep(0.5)
            save(*args, **kwargs)
            landed.append(time.monotonic())

        saves = mock.Mock(side_effect=slow_save)
        remove, asked = ours.remove_checkpoint, []

        def timed_remove(*args, **kwargs):
            asked.append(time.monotonic())
            remove(*args, **kwargs)

        removals = mock.Mock(side_effect=timed_remove)
        ours.save_checkpoint, ours.remove_checkpoint = saves, removals
        trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, plugins=[AsyncCheckpointIO(ours)],
                            callbacks=[ModelCheckpoint(dirpath=self.dirpath, save_top_k=2, monitor="step",
                                                       mode="max")])
        trainer.fit(TinyModule(), data())
        self.assertEqual((saves.call_count, removals.call_count), (3, 1))
        self.assertLess(asked[0], landed[0], "the removal came after epoch 0's save landed: nothing was in flight")
        names = sorted(c["name"] for c in ckptfs.open(self.repo).checkpoints(include_pending=True))
        self.assertEqual(names, ["epoch_3D1-step_3D16.ckpt", "epoch_3D2-step_3D24.ckpt"])
        self.assertEqual(sorted(os.listdir(self.dirpath)), ["epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt"])

    def test_load_checkpoint_returns_lightnings_dict_with_its_tensors_and_hyperparameters(self):
        io = CkptfsCheckpointIO(self.repo)
        ckpt = {"epoch": 2, "global_step": 7, "state_dict": {"w": torch.arange(6.0).reshape(2, 3)},
                "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.ones(3)}},
                                      "param_groups": [{"lr": 0.1, "params": [0]}]}],
                "hyper_parameters": {"width": 8, "names": ("a", "b")}, "loops": {"fit_loop": {"x": [1, 2]}}}
        io.save_checkpoint(ckpt, self.path("somewhere/epoch=2-step=7.ckpt"))
        got = io.load_checkpoint(self.path("elsewhere/epoch=2-step=7.ckpt"))
        self.assertEqual(got["epoch"], 2)
        self.assertEqual(got["hyper_parameters"], {"width": 8, "names": ("a", "b")})
        self.assertEqual(got["loops"], {"fit_loop": {"x": [1, 2]}})
        self.assertTrue(torch.equal(got["state_dict"]["w"], ckpt["state_dict"]["w"]))
        state = got["optimizer_states"][0]["state"][0]
        self.assertTrue(torch.equal(state["step"], torch.tensor(7.0)) and torch.equal(state["exp_avg"], torch.ones(3)))
        # Another run saving the same file name elsewhere replaces the
        # checkpoint: the first run's reference says so instead of loading it.
        io.save_checkpoint(ckpt, self.path("run2/epoch=2-step=7.ckpt"))
        with self.assertRaisesRegex(ckptfs.NotFoundError, "another run saved a file of the same name"):
            io.load_checkpoint(self.path("somewhere/epoch=2-step=7.ckpt"))
        with open(self.path("plain.ckpt"), "wb") as f:
            torch.save({"epoch": 1}, f)
        with self.assertRaisesRegex(ckptfs.InvalidArgumentError, "not a ckptfs checkpoint reference"):
            io.load_checkpoint(self.path("plain.ckpt"))
        io.remove_checkpoint(self.path("run2/epoch=2-step=7.ckpt"))
        self.assertFalse(os.path.exists(self.path("run2/epoch=2-step=7.ckpt")))
        self.assertEqual(ckptfs.open(self.repo).checkpoints(), [])
        with self.assertRaises(ckptfs.NotFoundError):
            io.load_checkpoint(self.path("somewhere/epoch=2-step=7.ckpt"))

    def test_file_names_map_to_checkpoint_names_and_back(self):
        for path, name in [("d/epoch=3-step=120.ckpt", "epoch_3D3-step_3D120.ckpt"),
                           ("last.ckpt", "last.ckpt"),
                           ("a_b c.ckpt", "a_5Fb_20c.ckpt"),
                           (".hidden", "_2Ehidden"),
                           ("épоch.ckpt", "_C3_A9p_D0_BEch.ckpt")]:
            self.assertEqual(checkpoint_name(path), name)
            self.assertEqual(file_name(name), os.path.basename(path))
        with self.assertRaises(ckptfs.InvalidArgumentError):
            checkpoint_name("x" * 201)


@unittest.skipIf(LIGHTNING_REASON, LIGHTNING_REASON or "")
class LightningUrl(CkptTestCase):
    """ModelCheckpoint(dirpath="ckptfs://...") with no plugin: Lightning
    writes its .ckpt files through fsspec, removes the ones save_top_k
    drops, and fit resumes from last.ckpt bit-identically."""

    def test_a_ckptfs_url_as_dirpath_saves_removes_and_resumes_from_last_ckpt(self):
        import ckptfs.filesystem

        ckptfs.filesystem.register()
        ckptfs.init(self.repo)
        dirpath = f"ckptfs://{self.repo}/run1/ckpts"

        def trainer(epochs, checkpointing=True):
            callbacks = [ModelCheckpoint(dirpath=dirpath, filename="{epoch}-{step}", monitor="train_loss",
                                         mode="min", save_top_k=2, save_last=True)] if checkpointing else []
            return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, deterministic=True,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                             enable_checkpointing=checkpointing)

        L.seed_everything(0)
        straight = TinyModule()
        trainer(5, checkpointing=False).fit(straight, data())
        L.seed_everything(0)
        trainer(3).fit(TinyModule(), data())
        import fsspec
        fs = fsspec.filesystem("ckptfs", skip_instance_cache=True)
        files = sorted(os.path.basename(p) for p in fs.ls(dirpath, detail=False))
        self.assertEqual(len(files), 3, files)  # save_top_k=2 and last: the first epoch's file was removed
        self.assertIn("last.ckpt", files)
        self.assertNotIn("epoch=0-step=8.ckpt", files)
        L.seed_everything(1)
        resumed = TinyModule()
        t = trainer(5)
        # Lightning 2.6 passes the names its filesystem lists through
        # os.path.normpath, which folds the '//' of any URL, so ckpt_path="last"
        # finds no remote checkpoint; the URL of last.ckpt is what works.
        t.fit(resumed, data(), ckpt_path=f"{dirpath}/last.ckpt")
        self.assertEqual(t.global_step, 40)
        for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
            self.assertEqual(bits(a), bits(b), name)
        self.run_ckpt("verify")


if __name__ == "__main__":
    unittest.main()
