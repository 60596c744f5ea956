"""torch.distributed.checkpoint with a ckptfs repository, on the CPU (gloo):
DTensors of every placement (Shard(0), Shard(1), Replicate, uneven shards,
a 2-D replicate x shard mesh as HSDP uses) saved by 4 ranks and loaded at 3
and 2 with other placements; dcp.async_save in a thread and in a process;
and interop both ways with repo.save, ckpt export and the mount. Each rank
is a process of its own (dcp_worker.py)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import ckptfs.torch as ckptfs_torch  # noqa: E402
import dcp_worker  # noqa: E402
from helpers import CkptTestCase  # noqa: E402
from test_python import bits, run_ranks  # noqa: E402
from test_python_device import free_port  # noqa: E402

DCP_REASON = ckptfs_torch.dcp_unavailable_reason()
WORKER = os.path.join(HERE, "dcp_worker.py")
HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


@unittest.skipIf(DCP_REASON, DCP_REASON or "")
class DcpTestCase(CkptTestCase):
    def setUp(self):
        super().setUp()
        ckptfs.init(self.repo)
        self.r = ckptfs.open(self.repo)

    def run_job(self, world, *args):
        port = free_port()
        outs = run_ranks(self, lambda r: [sys.executable, WORKER, *args], world,
                         lambda r: dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        return [o.strip().splitlines()[-1] if o.strip() else "" for o in outs]


class Placements(DcpTestCase):
    def test_ranks_naming_different_checkpoints_fail_every_rank_naming_both(self):
        outs = self.run_job(2, "save-other-names", self.repo, "n")
        for line in outs:
            self.assertIn("raised:", line)
            self.assertIn("rank 0 saves checkpoint 'n' and rank 1 saves 'n-other'", line)
        self.assertEqual(self.r.checkpoints(include_pending=True), [])

    def test_dtensors_of_every_placement_saved_by_4_ranks_load_at_3_and_2_with_other_placements(self):
        saved = self.run_job(4, "save", self.repo, "dt")
        self.assertEqual([s.split()[0] for s in saved], ["ok"] * 4)
        # DCP's planner gives each replicated item (the norm on every rank,
        # the HSDP replicas) to one rank: the writers put every tensor byte
        # once across the ranks.
        want = dcp_worker.full()
        self.assertEqual(sum(int(s.split()[1]) for s in saved),
                         sum(t.numel() * t.element_size() for t in want.values()))
        [c] = self.r.checkpoints()
        self.assertEqual((c["name"], c["world_size"], c["step"]), ("dt", 4, 1234))
        for world in (3, 2):
            with self.subTest(world=world):
                self.assertEqual(self.run_job(world, "load", self.repo, "dt"), ["ok"] * world)


class Interop(DcpTestCase):
    def test_a_dcp_checkpoint_reads_as_whole_tensors_through_the_api_export_and_the_mount(self):
        self.run_job(4, "save", self.repo, "dt")
        want = dcp_worker.full()
        for name, tensor in want.items():
            self.assertEqual(bits(self.r.tensor("dt", name)), bits(tensor), name)
        from safetensors.torch import load_file
        out = self.path("dt.safetensors")
        self.run_ckpt("export", "dt", out)
        exported = load_file(out)
        self.assertEqual(sorted(exported), sorted(want))
        for name, tensor in want.items():
            self.assertEqual(bits(exported[name]), bits(tensor), name)
        if not HAVE_FUSE:
            self.skipTest("no FUSE here (/dev/fuse, fusermount3)")
        mnt = tempfile.mkdtemp(prefix="ckptfs-dcp-mnt-")
        self.run_ckpt("mount", mnt)
        try:
            for name, tensor in want.items():
                if tensor.dtype == torch.bfloat16:
                    continue  # NumPy has no bfloat16: its .npy is covered by the mount tests
                got = np.load(os.path.join(mnt, "dt", name + ".npy"))
                np.testing.assert_array_equal(got, tensor.numpy(), err_msg=name)
        finally:
            subprocess.run(["fusermount3", "-u", mnt])
            os.rmdir(mnt)

    def test_a_checkpoint_saved_with_repo_save_by_2_ranks_loads_through_dcp(self):
        import torch.distributed.checkpoint as dcp
        want = dcp_worker.full()
        for rank in (0, 1):
            part = {k: v.reshape(-1).chunk(2)[rank] for k, v in want.items()}
            starts = {k: 0 if rank == 0 else want[k].reshape(-1).chunk(2)[0].numel() for k in want}
            self.r.save("plain", part, rank=rank, world_size=2, step=3,
                        shards={k: ckptfs.Flat(tuple(want[k].shape), starts[k]) for k in want})
        sd = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(sd, storage_reader=ckptfs_torch.StorageReader(self.repo, "plain"))
        for name, tensor in want.items():
            self.assertEqual(bits(sd[name]), bits(tensor), name)


class AsyncSave(DcpTestCase):
    def test_async_save_in_a_thread_and_in_a_process_commits_the_checkpoint(self):
        # The workers change their tensors once async_save returns: what
        # was staged is saved.
        want = dcp_worker.full()["rows"]
        for kind in ("thread", "process"):
            with self.subTest(kind=kind):
                self.assertEqual(self.run_job(2, "async-save", self.repo, f"async-{kind}", kind), ["ok"] * 2)
                self.assertEqual(bits(ckptfs.open(self.repo).tensor(f"async-{kind}", "w")), bits(want))
                self.assertEqual(bits(ckptfs.open(self.repo).tensor(f"async-{kind}", "big")), bits(dcp_worker.staged_rows()))
        self.assertEqual(sorted(c["name"] for c in ckptfs.open(self.repo).checkpoints()),
                         ["async-process", "async-thread"])

    def test_a_failed_async_save_raises_from_its_future_and_leaves_nothing_visible(self):
        self.r.save("taken", {"x": torch.zeros(3)})
        outs = self.run_job(2, "async-save", self.repo, "taken", "thread", "no-overwrite")
        for out in outs:
            self.assertTrue(out.startswith("failed: "), out)
        [c] = ckptfs.open(self.repo).checkpoints(include_pending=True)
        self.assertEqual((c["name"], c["world_size"]), ("taken", 1))
        self.assertEqual(bits(ckptfs.open(self.repo).tensor("taken", "x")), bits(torch.zeros(3)))
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())


class SavingANameAgain(DcpTestCase):
    def test_a_save_replaces_the_name_as_filesystemwriter_does_unless_told_not_to(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        dcp.save({"w": torch.ones(4), "step": 1}, storage_writer=ckptfs_torch.StorageWriter(self.repo, "s"),
                 no_dist=True)
        before = ckptfs.open(self.repo).checkpoints()
        # Saved again at another world size, by a job of 2 ranks.
        outs = self.run_job(2, "async-save", self.repo, "s", "thread")
        self.assertEqual(outs, ["ok"] * 2)
        repo = ckptfs.open(self.repo)
        [now] = repo.checkpoints(include_pending=True)
        self.assertEqual((now["name"], now["world_size"]), ("s", 2))
        self.assertGreaterEqual(now["committed"], before[0]["committed"])
        self.assertEqual(bits(repo.tensor("s", "w")), bits(dcp_worker.full()["rows"]))
        # overwrite=False refuses and leaves the name as it was.
        with self.assertRaises(BaseException) as e:  # DCP wraps it in its CheckpointException
            dcp.save({"w": torch.zeros(4)}, storage_writer=ckptfs_torch.StorageWriter(self.repo, "s", overwrite=False),
                     no_dist=True)
        self.assertIn("AlreadyExistsError", str(e.exception))
        self.assertEqual(bits(ckptfs.open(self.repo).tensor("s", "w")), bits(dcp_worker.full()["rows"]))
        # The old version's bytes go at the next gc; what is left verifies.
        self.assertEqual(json.loads(self.run_ckpt("gc", "--json").stdout)["removed_collected"], 1)
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())


class Resharding(DcpTestCase):
    def test_a_name_saved_again_at_every_placement_loads_into_every_placement(self):
        # As PyTorch's DTensor resharding tests do with FileSystemWriter
        # (which overwrites): 1-D and 2-D meshes, Shard and Replicate, on 4 ranks.
        self.assertEqual(self.run_job(4, "every-placement", self.repo, "dt"), ["ok 8 saves 64 loads"] * 4)
        [c] = ckptfs.open(self.repo).checkpoints(include_pending=True)
        self.assertEqual((c["name"], c["world_size"]), ("dt", 4))
        self.assertEqual(json.loads(self.run_ckpt("gc", "--json").stdout)["removed_collected"], 7)


    def test_sharded_tensors_under_chunk_and_enumerable_specs_reshard_on_load(self):
        # As PyTorch's file system checkpoint tests do with FileSystemWriter.
        self.assertEqual(self.run_job(2, "sharded-tensors", self.repo, "st"), ["ok 20 pairs"] * 2)

    def test_a_stateful_object_and_plain_tensors_round_trip_in_one_process(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        class Blob:  # a Stateful: DCP saves what state_dict() gives and hands it back to load_state_dict()
            def __init__(self, value):
                self.state = {"blob": value}

            def state_dict(self):
                return self.state

            def load_state_dict(self, state):
                self.state = state

        torch.manual_seed(4)
        module = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Linear(5, 1))
        saved = dict(module.state_dict(), extra=Blob(b"some bytes for testing"))
        dcp.save(saved, storage_writer=ckptfs_torch.StorageWriter(self.repo, "s"), no_dist=True)
        back = dict(torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Linear(5, 1)).state_dict(), extra=Blob(b""))
        dcp.load(back, storage_reader=ckptfs_torch.StorageReader(self.repo, "s"), no_dist=True)
        self.assertEqual(back["extra"].state, {"blob": b"some bytes for testing"})
        for k, v in module.state_dict().items():
            self.assertEqual(bits(back[k]), bits(v), k)


class CheckpointIdsAsPaths(DcpTestCase):
    def test_a_checkpoint_id_that_is_a_path_in_the_repository_names_a_grouped_checkpoint(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        for step in (5, 10):
            dcp.save({"w": torch.full((3,), float(step))}, checkpoint_id=os.path.join(self.repo, "run1", f"step-{step}"),
                     storage_writer=ckptfs_torch.StorageWriter(self.repo), no_dist=True)
        repo = ckptfs.open(self.repo)
        self.assertEqual([(c["name"], c["step"]) for c in repo.checkpoints(group="run1")],
                         [("run1/step-5", 5), ("run1/step-10", 10)])
        back = {"w": torch.zeros(3)}
        dcp.load(back, checkpoint_id=os.path.join(self.repo, "run1", "step-10"),
                 storage_reader=ckptfs_torch.StorageReader(self.repo), no_dist=True)
        self.assertTrue(torch.equal(back["w"], torch.full((3,), 10.0)))
        # A name relative to the repository is the same checkpoint; a path elsewhere is refused.
        dcp.load(back, checkpoint_id="run1/step-5", storage_reader=ckptfs_torch.StorageReader(self.repo), no_dist=True)
        self.assertTrue(torch.equal(back["w"], torch.full((3,), 5.0)))
        with self.assertRaises(ckptfs.InvalidArgumentError) as e:
            ckptfs_torch.StorageWriter(self.repo).reset(os.path.join(self.tmp, "elsewhere", "step-1"))
        self.assertIn("outside the repository", str(e.exception))
        # On S3 a checkpoint_id under the repository's URL names the same way.
        under = ckptfs_torch._checkpoint_name
        self.assertEqual(under("s3://bucket/runs/run1/step-10", "s3://bucket/runs"), "run1/step-10")
        self.assertEqual(under("s3://bucket/runs/run1/step-10", "s3://bucket/runs/"), "run1/step-10")
        self.assertEqual(under("run1/step-10", "s3://bucket/runs"), "run1/step-10")
        with self.assertRaises(ckptfs.InvalidArgumentError):
            under("s3://other/run1/step-10", "s3://bucket/runs")  # not a name, and not under the repository


class DtypeConversion(DcpTestCase):
    def test_a_load_into_other_dtypes_converts_as_filesystemreader_does(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        gen = torch.Generator().manual_seed(9)
        saved = {"f32": torch.randn(33, 7, generator=gen), "bf16": torch.randn(5, 9, generator=gen).bfloat16(),
                 "i64": torch.randint(-1000, 1000, (17,), generator=gen), "same": torch.randn(4, generator=gen)}
        files = self.path("files")
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(files), no_dist=True)
        dcp.save(saved, storage_writer=ckptfs_torch.StorageWriter(self.repo, "conv"), no_dist=True)

        def targets():
            return {"f32": torch.zeros(33, 7, dtype=torch.bfloat16), "bf16": torch.zeros(5, 9, dtype=torch.float64),
                    "i64": torch.zeros(17, dtype=torch.float32), "same": torch.zeros(4)}
        theirs, ours = targets(), targets()
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(files), no_dist=True)
        dcp.load(ours, storage_reader=ckptfs_torch.StorageReader(self.repo, "conv"), no_dist=True)
        for key in saved:
            self.assertEqual(ours[key].dtype, theirs[key].dtype, key)
            self.assertEqual(bits(ours[key]), bits(theirs[key]), key)
        self.assertFalse(torch.equal(ours["f32"].float(), saved["f32"]))  # rounded to bfloat16 on the way
        self.assertTrue(torch.equal(ours["i64"], saved["i64"].float()))


class TrainingCheckpointExports(DcpTestCase):
    def test_a_model_and_optimizer_save_exports_as_a_release_with_the_prefix_and_keeps_its_nesting(self):
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from safetensors.torch import load_file  # noqa: PLC0415

        model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(3, 6)).sum().backward()
        optim.step()
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        config = b'{"model_type": "tiny"}'
        dcp.save(state, storage_writer=ckptfs_torch.StorageWriter(self.repo, "train", blobs={"config.json": config}),
                 no_dist=True)
        release = self.path("release")
        python = {"CKPT_PYTHON": sys.executable}  # the torch formats run in this Python
        out = json.loads(self.run_ckpt("export", "train", release, "--format", "hf", "--prefix", "model.",
                                       "--json", env=python).stdout)
        self.assertEqual(sorted(os.listdir(release)), ["config.json", "model.safetensors"])
        self.assertTrue(any("non-tensor value" in why for why in out["left_out"]), out["left_out"])
        weights = load_file(os.path.join(release, "model.safetensors"))
        self.assertEqual(sorted(weights), sorted(model.state_dict()))
        for key, value in model.state_dict().items():
            self.assertEqual(bits(weights[key]), bits(value), key)
        # --format torch gives the state back nested, as it was saved.
        self.run_ckpt("export", "train", self.path("pt"), "--format", "torch", env=python)
        back = torch.load(os.path.join(self.path("pt"), "model.pt"), weights_only=True)
        self.assertEqual(sorted(back), ["model", "optim"])
        self.assertEqual(sorted(back["model"]), sorted(model.state_dict()))
        self.assertEqual(back["optim"]["param_groups"][0]["lr"], 0.01)
        # The object DCP's own dcp_to_torch_save gives of the same save.
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: PLC0415

        dcp.save(state, storage_writer=dcp.FileSystemWriter(self.path("files")), no_dist=True)
        dcp_to_torch_save(self.path("files"), self.path("theirs.pt"))
        theirs = torch.load(self.path("theirs.pt"), weights_only=True)

        def shape_of(obj):
            if isinstance(obj, dict):
                return {k: shape_of(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return [shape_of(v) for v in obj]
            return bits(obj) if isinstance(obj, torch.Tensor) else obj
        self.assertEqual(shape_of(back), shape_of(theirs))
        # --format dcp keeps it too: DCP's own conversion of the export gives the same object.
        self.run_ckpt("export", "train", self.path("dcp"), "--format", "dcp", env=python)
        dcp_to_torch_save(self.path("dcp"), self.path("ours.pt"))
        ours = torch.load(self.path("ours.pt"), weights_only=True)
        self.assertEqual(ours.pop("config.json"), config)  # the blob given beside DCP's items, as an item
        self.assertEqual(shape_of(ours), shape_of(theirs))


class RestartAfterACrash(DcpTestCase):
    def test_a_job_killed_during_async_save_saves_the_name_again_at_4_and_at_2_ranks_without_mixing(self):
        rows = dcp_worker.full()["rows"]
        for name, world in (("step-8", 4), ("step-9", 2)):
            with self.subTest(restarted_at=world):
                self.assertEqual(self.run_job(4, "crash-save", self.repo, name, "1"), [""] * 4)
                # StorageWriter replaces a name (overwrite=True): its pending
                # ranks are those of the replacement, "NAME~".
                [pending] = [c for c in ckptfs.open(self.repo).checkpoints(include_pending=True)
                             if c["name"] == name + "~"]
                self.assertEqual((pending["state"], pending["world_size"], pending["committed_ranks"]),
                                 ("pending", 4, 2))
                # The restarted job saves the same name and resumes from it.
                self.assertEqual(self.run_job(world, "resave", self.repo, name, "2"), ["ok"] * world)
                repo = ckptfs.open(self.repo)
                [saved] = [c for c in repo.checkpoints(include_pending=True) if c["name"] == name]
                self.assertEqual((saved["state"], saved["world_size"]), ("committed", world))
                # Only the restarted job's bytes: nothing of the crashed attempt.
                self.assertEqual(bits(repo.tensor(name, "w")), bits(rows * 2))
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())


class Pickling(unittest.TestCase):
    @unittest.skipIf(DCP_REASON, DCP_REASON or "")
    def test_writers_and_readers_pickle_and_reopen_their_repository(self):
        import pickle
        with tempfile.TemporaryDirectory() as d:
            repo = os.path.join(d, "r")
            ckptfs.init(repo)
            cache = os.path.join(d, "cache")  # (a local repository keeps no catalog there)
            w = pickle.loads(pickle.dumps(ckptfs_torch.StorageWriter(repo, "n", step=4, tags={"a": "b"},
                                                                     blobs={"config.json": b"{}"}, cache_dir=cache)))
            self.assertEqual((w.url, w.name, w.step, w.tags, w.blobs, w.cache_dir),
                             (repo, "n", 4, {"a": "b"}, {"config.json": b"{}"}, cache))
            r = pickle.loads(pickle.dumps(ckptfs_torch.StorageReader(repo, "n", cache_dir=cache)))
            self.assertEqual((r.url, r.name, r.cache_dir), (repo, "n", cache))


if __name__ == "__main__":
    unittest.main()
