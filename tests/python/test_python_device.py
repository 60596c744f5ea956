"""Tests of the Python package that need the device machine: CUDA tensors
(a GPU and a CUDA build), and the torch.distributed.checkpoint storage
(torch >= 2.4). Each class skips, giving the reason, where its need is not
met; the CPU suite (test_python) runs everywhere."""
import json
import os
import socket
import sys
import tempfile
import time
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../integration"))

import ckptfs  # noqa: E402
import ckptfs.torch as ckptfs_torch  # noqa: E402
from helpers import CkptTestCase  # noqa: E402
from test_python import TORCH_DTYPES, bits, random_tensor, run_ranks  # noqa: E402


def cuda_unavailable_reason():
    if not torch.cuda.is_available():
        return f"no GPU usable by torch {torch.__version__}"
    ok, why = ckptfs.cuda_available()
    return None if ok else why


CUDA_REASON = cuda_unavailable_reason()
DCP_REASON = ckptfs_torch.dcp_unavailable_reason()


@unittest.skipIf(CUDA_REASON, CUDA_REASON or "")
class Cuda(CkptTestCase):
    def setUp(self):
        super().setUp()
        self.r = ckptfs.init(self.repo, chunk_size=1 << 20)

    def test_cuda_tensors_save_and_load_bit_exact(self):
        gen = torch.Generator().manual_seed(9)
        host = {str(dt): random_tensor(gen, dt, (301, 77)) for dt in TORCH_DTYPES}
        host["scalar"] = torch.tensor(1.5)
        host["empty"] = torch.empty(0, 3)
        state = {k: v.cuda() for k, v in host.items()}
        state["transposed"] = host[str(torch.float32)].cuda().t()  # not contiguous
        self.r.save("gpu", state)
        for key, value in state.items():
            back = self.r.tensor("gpu", key, device="cuda")
            self.assertEqual(back.device.type, "cuda")
            self.assertEqual(bits(back), bits(value), key)
            target = torch.empty_like(value, device="cuda")
            self.r.load("gpu", {key: target})
            self.assertEqual(bits(target), bits(value), key)
        # a shard of a CUDA tensor, loaded into a CUDA target at another sharding
        full = host[str(torch.bfloat16)]
        rows = [0, 150, 301]
        for rank in range(2):
            self.r.save("sharded", {"w": full[rows[rank]:rows[rank + 1]].cuda()}, rank=rank, world_size=2,
                        shards={"w": ckptfs.Box(tuple(full.shape), (rows[rank], 0))})
        part = torch.empty(301, 40, dtype=torch.bfloat16, device="cuda")
        self.r.load("sharded", {"w": part}, shards={"w": ckptfs.Box(tuple(full.shape), (0, 37))})
        self.assertEqual(bits(part), bits(full[:, 37:]))

    def test_async_save_from_cuda_blocks_only_for_the_device_to_host_copy(self):
        state = {f"layer{i}": torch.randn(64 << 20, device="cuda").to(torch.bfloat16) for i in range(8)}  # 1 GiB
        expected = {k: v.clone() for k, v in state.items()}
        pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
        torch.cuda.synchronize()
        copies = []
        for _ in range(3):
            t0 = time.perf_counter()
            for k, v in state.items():
                pinned[k].copy_(v, non_blocking=True)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        copy = min(copies)
        self.r.async_save("warm", {"x": state["layer0"]}).result()  # pinned buffers allocated once
        blocked = []
        for i in range(2):
            handle = self.r.async_save(f"s{i}", state)
            for v in state.values():
                v.add_(1)  # training goes on
            blocked.append(handle.blocking_seconds)
            handle.result(timeout=600)
            for v in state.values():
                v.sub_(1)
        print(f"\nasync_save of 1 GiB from CUDA blocked {min(blocked):.3f} s; pinned copy {copy:.3f} s", file=sys.stderr)
        self.assertLess(min(blocked), 2 * copy + 0.05)
        for k, v in expected.items():
            self.assertEqual(bits(self.r.tensor("s0", k, device="cuda")), bits(v), k)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DCP_WORKER = r"""
import os, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
try:
    from torch.distributed.tensor import DTensor, Shard, Replicate, distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Shard, Replicate, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh
import ckptfs
from ckptfs.torch import StorageReader, StorageWriter

action, repo, name = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
gen = torch.Generator().manual_seed(42)
full = {
    "model.w": torch.randn(16, 12, generator=gen),
    "model.b": torch.randn(12, generator=gen).to(torch.bfloat16),
    "model.emb": torch.randint(0, 100, (10, 6), generator=gen),
}
placement = {"save": Shard(0), "save-once": Shard(0), "load": Shard(1)}[action]
def state():
    sd = {
        "model.w": distribute_tensor(full["model.w"].clone(), mesh, [placement]),
        "model.b": distribute_tensor(full["model.b"].clone(), mesh, [Replicate()]),
        "model.emb": distribute_tensor(full["model.emb"].clone(), mesh, [Shard(0)]),
        "step": 7,
        "extra": {"lr": 0.5},
    }
    return sd
if action in ("save", "save-once"):
    dcp.save(state(), storage_writer=StorageWriter(repo, name, step=7, overwrite=action == "save"))
else:
    sd = state()
    for k in ("model.w", "model.b", "model.emb"):
        sd[k].to_local().zero_()
    sd["step"] = 0
    sd["extra"] = {"lr": 0.0}
    dcp.load(sd, storage_reader=StorageReader(repo, name))
    for k in ("model.w", "model.b", "model.emb"):
        got = sd[k].full_tensor()
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                           full[k].view(torch.uint8) if got.dtype == torch.bfloat16 else full[k]), k
    assert sd["step"] == 7 and sd["extra"]["lr"] == 0.5, (sd["step"], sd["extra"])
    print("ok")
# At exit, torch's gloo sometimes aborts in its static destructors ("terminate
# called without an active exception"), with or without ckptfs: end here.
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


@unittest.skipIf(DCP_REASON, DCP_REASON or "")
class DistributedCheckpoint(CkptTestCase):
    def run_group(self, action, name, world=2):
        script = os.path.join(self.tmp, "dcp_worker.py")
        with open(script, "w") as f:
            f.write(DCP_WORKER)
        port = free_port()
        return run_ranks(self, lambda r: [sys.executable, script, action, self.repo, name], world,
                         lambda r: dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                         fresh=True)

    def test_dcp_save_and_load_of_dtensor_state_dicts_reshard_on_a_2_rank_gloo_group(self):
        ckptfs.init(self.repo)
        self.run_group("save", "dcp-7")
        repo = ckptfs.open(self.repo)
        [ckpt] = repo.checkpoints()
        self.assertEqual((ckpt["name"], ckpt["world_size"], ckpt["step"]), ("dcp-7", 2, 7))
        self.assertEqual([o.strip() for o in self.run_group("load", "dcp-7")], ["ok", "ok"])
        # an ordinary checkpoint: whole tensors for the CLI, the mount and NumPy
        w = repo.tensor("dcp-7", "model.w")
        self.assertEqual(tuple(w.shape), (16, 12))
        self.assertIn("ok", self.run_ckpt("verify").stdout.decode())

    def test_one_writer_and_one_reader_serve_every_step_through_checkpoint_id(self):
        import torch.distributed.checkpoint as dcp
        ckptfs.init(self.repo)
        writer = ckptfs_torch.StorageWriter(self.repo)
        reader = ckptfs_torch.StorageReader(self.repo)
        for step in (100, 200):
            dcp.save({"w": torch.full((3, 4), float(step)), "meta": {"step": step}}, storage_writer=writer,
                     checkpoint_id=f"step-{step:06d}")
        repo = ckptfs.open(self.repo)
        self.assertEqual([(c["name"], c["step"]) for c in repo.checkpoints()],
                         [("step-000100", 100), ("step-000200", 200)])
        for step in (200, 100):
            sd = {"w": torch.zeros(3, 4), "meta": {"step": 0}}
            dcp.load(sd, storage_reader=reader, checkpoint_id=f"step-{step:06d}")
            self.assertTrue(torch.equal(sd["w"], torch.full((3, 4), float(step))))
            self.assertEqual(sd["meta"]["step"], step)
        self.assertTrue(ckptfs_torch.StorageWriter.validate_checkpoint_id("step-000100"))
        self.assertTrue(ckptfs_torch.StorageWriter.validate_checkpoint_id("run1/step-000100"))
        for bad in ("a//b", "run1/100", "", ".hidden", "a/.b", "x" * 201, "/data/ckpt"):
            self.assertFalse(ckptfs_torch.StorageReader.validate_checkpoint_id(bad), bad)
        with self.assertRaises(ckptfs.InvalidArgumentError) as e:
            dcp.save({"w": torch.zeros(1)}, storage_writer=writer, checkpoint_id="../escape")
        self.assertIn("'../escape' is a path outside the repository", str(e.exception))
        with self.assertRaises(ckptfs.InvalidArgumentError) as e:
            dcp.save({"w": torch.zeros(1)}, storage_writer=writer, checkpoint_id="a//b")
        self.assertIn("'a//b' is not a checkpoint name", str(e.exception))
        # DCP reports errors of the write phase as its CheckpointException,
        # a BaseException.
        with self.assertRaises(BaseException) as e:
            dcp.save({"w": torch.zeros(1)}, storage_writer=ckptfs_torch.StorageWriter(self.repo))
        self.assertIn("no checkpoint name: give StorageWriter a name, or dcp.save a checkpoint_id", str(e.exception))
        self.assertEqual(len(repo.checkpoints(include_pending=True)), 2)

    def test_a_failed_dcp_save_leaves_nothing_visible(self):
        ckptfs.init(self.repo)
        repo = ckptfs.open(self.repo)
        repo.save("dcp-7", {"x": torch.zeros(1)})  # the name is taken: every rank fails
        procs_failed = False
        try:
            self.run_group("save-once", "dcp-7")  # overwrite=False
        except AssertionError:
            procs_failed = True
        self.assertTrue(procs_failed)
        self.assertEqual([c["name"] for c in repo.checkpoints(include_pending=True)], ["dcp-7"])


@unittest.skipIf(CUDA_REASON, CUDA_REASON or "")
class CollectiveOnCuda(CkptTestCase):
    """Collective saves and restores (process_group=) of CUDA tensors, rank
    r on GPU r modulo the GPUs there are, each job's default group NCCL
    for CUDA tensors and gloo for CPU ones. With a GPU per rank the fetched
    regions travel over the job's NCCL group; with several ranks on one
    GPU, which NCCL refuses at its first collective, these passing also
    shows that ckptfs then keeps to its own gloo group."""

    def job(self, world, action, name, layout, mode="", parse=True):
        worker = os.path.join(HERE, "collective_worker.py")
        port = free_port()
        outs = run_ranks(self, lambda r: [sys.executable, worker, action, self.repo, name, layout, mode], world,
                         lambda r: dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                        MASTER_PORT=str(port), CKPT_TEST_CUDA="1"), fresh=True)
        last = [o.strip().splitlines()[-1] for o in outs]
        return [json.loads(x) for x in last] if parse else last

    def referenced_bytes(self, name):
        du = json.loads(self.run_ckpt("du", "--json").stdout)
        [c] = [c for c in du["checkpoints"] if c["name"] == name]
        return c["referenced_bytes"]

    def test_cuda_tensors_are_saved_once_per_replica_and_restored_fetching_each_chunk_once(self):
        ckptfs.init(self.repo, chunk_size=64 << 10, pack_size=1 << 20)
        saved = self.job(4, "save", "hsdp", "hsdp", "verify")
        plan = saved[0]["plan"]
        self.assertTrue(all(s["plan"] == plan for s in saved), saved)
        self.assertEqual(sum(s["logical"] for s in saved), plan["unique_bytes"])
        self.assertLess(plan["unique_bytes"], plan["held_bytes"])
        # Restored into CUDA tensors (the workers check every element) at
        # the saved world size, at 2 ranks, and at 3, whose cuts split
        # stored chunks that the ranks then hand over.
        for world in (4, 2, 3):
            with self.subTest(world=world):
                got = self.job(world, "load", "hsdp", "hsdp" if world != 3 else "mixed")
                self.assertEqual(sum(g["fetched"] for g in got), self.referenced_bytes("hsdp"), got)
                over = "caller:cuda" if torch.cuda.device_count() >= world else "ckptfs:cpu"
                self.assertEqual({tuple(g["delivered"]) for g in got}, {(over,)}, got)

    def test_replicas_on_the_gpu_that_differ_fail_on_every_rank_and_nothing_shows(self):
        ckptfs.init(self.repo, chunk_size=64 << 10, pack_size=1 << 20)
        outs = self.job(4, "save", "d", "hsdp", "differ", parse=False)
        for out in outs:
            self.assertIn("raised: CollectiveError", out)
            self.assertIn("the replicas of 'norm' differ", out)
        self.assertEqual(ckptfs.open(self.repo).checkpoints(include_pending=True), [])

class WithoutDcp(unittest.TestCase):
    @unittest.skipUnless(DCP_REASON, "this torch has DCP")
    def test_using_the_dcp_classes_on_an_old_torch_says_what_is_missing(self):
        with tempfile.TemporaryDirectory() as d:
            ckptfs.init(os.path.join(d, "r"))
            for cls in (ckptfs_torch.StorageWriter, ckptfs_torch.StorageReader):
                with self.assertRaises(ckptfs.UnsupportedError) as e:
                    cls(os.path.join(d, "r"), "x")
                self.assertIn("torch >= 2.4", str(e.exception))


if __name__ == "__main__":
    unittest.main()
