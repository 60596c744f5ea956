"""One rank of a DCP job on the CPU (gloo), run as its own process by
test_dcp (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment):

    dcp_worker.py save REPO NAME
        (4 ranks) saves DTensors of every placement with dcp.save; prints
        "ok BYTES", the tensor bytes this rank's StorageWriter put
    dcp_worker.py save-other-names REPO NAME
        (any world size) as save, but rank 1 names NAME-other; prints
        "raised: TYPE: ..." with the line of the error naming both names
    dcp_worker.py load REPO NAME
        (any world size) loads them back at other placements with dcp.load
        and checks every element
    dcp_worker.py async-save REPO NAME thread|process
        (2 ranks) saves with dcp.async_save and waits on its future
    dcp_worker.py crash-save REPO NAME SCALE
        (4 ranks) a job that dies in the middle of dcp.async_save: rank 3
        before it writes, ranks 1 and 2 once their parts are committed,
        rank 0 before DCP's finish; the saved state is ROWS() * SCALE
    dcp_worker.py resave REPO NAME SCALE
        (any world size) the job restarted: dcp.async_save of ROWS() * SCALE
        to the same name, then dcp.load of it, checked element by element
    dcp_worker.py load-files DIR
        (any world size) loads the DTensors of every placement from DIR with
        stock dcp.load and FileSystemReader, and checks every element
    dcp_worker.py save-files DIR big|placements
        (any world size) saves with stock dcp.save and FileSystemWriter into
        DIR: BIG() sharded by rows, or the DTensors of every placement
    dcp_worker.py url-save URL / url-load URL / url-async-save URL
        (any world size) as save / load, through a ckptfs:// URL as DCP's
        checkpoint_id (fsspec; no ckptfs class named); url-async-save
        saves with dcp.async_save and waits on its future
    dcp_worker.py tc-save REPO NAME / tc-load REPO NAME
        (any world size) saves the DTensors of every placement with
        torch_checkpointing's CheckpointManager and the ckptfs backend
        (DefaultResharder), or loads them at other placements and checks
        every element
    dcp_worker.py save-hf DIR
        (any world size) saves the DTensors of every placement with stock
        dcp.save and torch's HuggingFaceStorageWriter, one safetensors file
        per rank (save_distributed=True), into DIR (tensors only)

Prints "ok" when its checks pass; FULL() is the state every run agrees on.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ckptfs.torch import StorageReader, StorageWriter
from worker_exit import leave


def staged_rows():
    """A tensor of 1 MiB."""
    return torch.randn(1024, 256, generator=torch.Generator().manual_seed(8))


def full():
    """The whole tensors; their sizes divide unevenly by 3 and 4."""
    gen = torch.Generator().manual_seed(7)
    return {
        "rows": torch.randn(10, 6, generator=gen),                          # Shard(0), 10 rows over 4 ranks
        "cols": torch.randn(5, 7, generator=gen).to(torch.bfloat16),       # Shard(1), 7 columns over 4
        "norm": torch.randn(8, generator=gen, dtype=torch.float64),        # Replicate
        "hsdp": torch.randn(9, 4, generator=gen),                          # 2-D mesh: Replicate x Shard(0)
        "grid": torch.randint(-99, 99, (6, 10), generator=gen),            # 2-D mesh: Shard(0) x Shard(1)
        "tiny": torch.randn(2, generator=gen),                             # fewer rows than ranks
    }


def big():
    """Tensors much larger than a 64 KiB chunk, for dedup across world sizes."""
    gen = torch.Generator().manual_seed(11)
    return {
        "layers.0.weight": torch.randn(2048, 512, generator=gen),                       # Shard(0): 4 MiB
        "embed.weight": torch.randn(1024, 256, generator=gen).to(torch.bfloat16),      # Replicate
        "layers.0.out.weight": torch.randn(256, 1024, generator=gen),                   # Shard(1): 1 MiB
        "layers.0.mlp.weight": torch.randn(512, 512, generator=gen).to(torch.bfloat16),  # (Shard(0), Shard(1))
    }


def placements(world, saving):
    """{name: (mesh shape, placements)} for the save (4 ranks) and a load at another world size."""
    if saving:
        return {
            "rows": ((world,), [Shard(0)]),
            "cols": ((world,), [Shard(1)]),
            "norm": ((world,), [Replicate()]),
            "hsdp": ((2, world // 2), [Replicate(), Shard(0)]),
            "grid": ((2, world // 2), [Shard(0), Shard(1)]),
            "tiny": ((world,), [Shard(0)]),
        }
    # Loaded with every placement changed.
    return {
        "rows": ((world,), [Shard(1)]),
        "cols": ((world,), [Shard(0)]),
        "norm": ((world,), [Shard(0)]),
        "hsdp": ((world,), [Shard(1)]),
        "grid": ((world,), [Replicate()]),
        "tiny": ((world,), [Replicate()]),
    }


def state(world, saving, zero):
    meshes = {}
    out = {}
    for name, tensor in full().items():
        shape, place = placements(world, saving)[name]
        mesh = meshes.get(shape)
        if mesh is None:
            mesh = meshes[shape] = init_device_mesh("cpu", shape)
        t = torch.zeros_like(tensor) if zero else tensor
        out[name] = distribute_tensor(t, mesh, place)
    out["step"] = 0 if zero else 1234
    out["extra"] = {"lr": 0.0 if zero else 3e-4, "names": [] if zero else ["a", "b"]}
    return out


def gather_metadata_on_cpu():
    """torch_checkpointing 0.1.1 gathers its sharding metadata across ranks
    in CUDA tensors (DefaultMetadataManager._all_gather_pickled_data asks for
    device="cuda"), which a CPU-only job has not: for that one call, tensors
    asked for on CUDA are made on the CPU (gloo gathers them). Nothing else
    of torch_checkpointing is changed."""
    from torch_checkpointing.metadata_manager import DefaultMetadataManager  # noqa: PLC0415

    gather = DefaultMetadataManager._all_gather_pickled_data
    if torch.cuda.is_available() or getattr(gather, "on_cpu", False):
        return

    def on_cpu(self, *args, **kwargs):
        make, to_cuda = torch.tensor, torch.Tensor.cuda
        torch.tensor = lambda *a, device=None, **k: make(*a, **k)
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return gather(self, *args, **kwargs)
        finally:
            torch.tensor, torch.Tensor.cuda = make, to_cuda

    on_cpu.on_cpu = True
    DefaultMetadataManager._all_gather_pickled_data = on_cpu


def same(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == torch.bfloat16 else torch.equal(a, b)


def check(sd):
    want = full()
    for name, tensor in want.items():
        got = sd[name].full_tensor()
        assert got.dtype == tensor.dtype and same(got, tensor), name
    assert sd["step"] == 1234, sd["step"]
    assert sd["extra"] == {"lr": 3e-4, "names": ["a", "b"]}, sd["extra"]


def main():
    action, repo = sys.argv[1], sys.argv[2]
    name = sys.argv[3] if len(sys.argv) > 3 else ""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    outcome = "ok"
    if action == "save":
        # The tensor bytes this rank's writer put (DCP's planner gives each
        # replicated item to one rank).
        writer = StorageWriter(repo, name, step=1234)
        wrote = writer.write_data

        def counted(plan, planner):
            future = wrote(plan, planner)
            counted.bytes = sum(r.size_in_bytes for r, item in zip(future.value(), plan.items)
                                if item.type != WriteItemType.BYTE_IO)
            return future
        writer.write_data = counted
        dcp.save(state(world, True, False), storage_writer=writer)
        outcome = f"ok {counted.bytes}"
    elif action == "save-other-names":
        mine = name + "-other" if dist.get_rank() == 1 else name
        try:
            dcp.save(state(world, True, False), storage_writer=StorageWriter(repo, mine))
        except BaseException as e:  # noqa: BLE001 - DCP wraps the coordinator's error in a BaseException
            said = [line for line in str(e).splitlines() if "saves checkpoint" in line]
            outcome = f"raised: {type(e).__name__}: {said[-1].strip() if said else str(e)[:300]}"
    elif action == "load":
        sd = state(world, False, True)
        dcp.load(sd, storage_reader=StorageReader(repo, name))
        check(sd)
    elif action in ("url-save", "url-load", "url-async-save"):
        import ckptfs.filesystem  # noqa: PLC0415

        ckptfs.filesystem.register()  # an installed package does it through its entry point
        if action == "url-save":
            dcp.save(state(world, True, False), checkpoint_id=repo)
        elif action == "url-async-save":
            dcp.async_save(state(world, True, False), checkpoint_id=repo).result()
        else:
            sd = state(world, False, True)
            dcp.load(sd, checkpoint_id=repo)
            check(sd)
    elif action in ("tc-save", "tc-load"):
        # torch_checkpointing's CheckpointManager with the ckptfs backend:
        # REPO a repository, NAME the checkpoint's path in it.
        from torch_checkpointing.checkpoint_manager import CheckpointManager, ItemSpec  # noqa: PLC0415
        from torch_checkpointing.default_resharder import DefaultResharder  # noqa: PLC0415

        from ckptfs.torch_checkpointing import CkptfsStorageConfig  # noqa: PLC0415

        gather_metadata_on_cpu()
        config = CheckpointManager.Config.with_sync_save()
        config.items = {"model": ItemSpec(resharder=DefaultResharder())}
        config.storage_config = CkptfsStorageConfig(repo)
        manager = config.build()
        tensors = {k: v for k, v in state(world, action == "tc-save", action == "tc-load").items()
                   if isinstance(v, torch.Tensor)}
        if action == "tc-save":
            manager.save(name, {"model": tensors})
        else:
            got = manager.load(name, into={"model": tensors})["model"]
            for key, tensor in full().items():
                assert same(got[key].full_tensor(), tensor), key
        manager.close()
    elif action == "load-files":
        sd = state(world, False, True)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(repo))
        check(sd)
    elif action == "save-files":
        mesh = init_device_mesh("cpu", (world,))
        if sys.argv[3] == "big":
            b = big()
            grid = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            sd = {"layers.0.weight": distribute_tensor(b["layers.0.weight"], mesh, [Shard(0)]),
                  "embed.weight": distribute_tensor(b["embed.weight"], mesh, [Replicate()]),
                  "layers.0.out.weight": distribute_tensor(b["layers.0.out.weight"], mesh, [Shard(1)]),
                  "layers.0.mlp.weight": distribute_tensor(b["layers.0.mlp.weight"], grid, [Shard(0), Shard(1)]),
                  "step": 77}
        else:
            sd = state(world, True, False)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(repo))
    elif action == "save-hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter  # noqa: PLC0415

        # Tensors only: this writer stores each rank's items as one
        # safetensors file and has no place for the others.
        sd = {k: v for k, v in state(world, True, False).items() if isinstance(v, torch.Tensor)}
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path=repo, save_distributed=True))
    elif action == "async-save":
        kind = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}[sys.argv[4]]
        mesh = init_device_mesh("cpu", (world,))
        # "big" is large enough for the writer's own staging buffers
        # (_core.STAGE_MIN_BYTES a rank); both change once async_save returns.
        sd = {"w": distribute_tensor(full()["rows"], mesh, [Shard(0)]),
              "big": distribute_tensor(staged_rows(), mesh, [Shard(0)]), "step": 5}
        overwrite = len(sys.argv) <= 5 or sys.argv[5] != "no-overwrite"
        future = dcp.async_save(sd, storage_writer=StorageWriter(repo, name, overwrite=overwrite),
                                async_checkpointer_type=kind)
        sd["w"].to_local().fill_(-1.0)
        sd["big"].to_local().fill_(-1.0)
        try:
            future.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            outcome = f"failed: {str(e).splitlines()[0]}"
    elif action == "every-placement":
        # One name saved again at every placement of a 1-D and a 2-D mesh
        # (each save replaces the last), each loaded into every placement.
        g = torch.arange(48, dtype=torch.float32).view(6, 8)
        one, two = init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2))
        layouts = [(one, [Shard(0)]), (one, [Replicate()]), (one, [Shard(1)]),
                   (two, [Replicate(), Replicate()]), (two, [Replicate(), Shard(0)]), (two, [Shard(0), Replicate()]),
                   (two, [Shard(0), Shard(0)]), (two, [Shard(1), Shard(0)])]
        loads = 0
        for saved_mesh, saved in layouts:
            dcp.save({"t": distribute_tensor(g, saved_mesh, saved)}, checkpoint_id=name,
                     storage_writer=StorageWriter(repo))
            for mesh, placement in layouts:
                target = {"t": distribute_tensor(torch.zeros_like(g), mesh, placement)}
                dcp.load(target, checkpoint_id=name, storage_reader=StorageReader(repo))
                assert torch.equal(target["t"].full_tensor(), g), (saved, placement)
                loads += 1
        outcome = f"ok {len(layouts)} saves {loads} loads"
    elif action == "sharded-tensors":
        # ShardedTensors (the older sharding API DCP still saves) of a
        # [10, 20] tensor under chunk and enumerable sharding specs, several
        # shards on a rank and uneven ones; one name saved again under each
        # spec, loaded under every other.
        from torch.distributed._shard import sharded_tensor  # noqa: PLC0415
        from torch.distributed._shard.sharding_spec import (  # noqa: PLC0415
            ChunkShardingSpec,
            EnumerableShardingSpec,
            ShardMetadata,
        )

        def rows(*parts):  # (rows, rank) per shard, top to bottom
            shards, start = [], 0
            for n, r in parts:
                shards.append(ShardMetadata(shard_offsets=[start, 0], shard_sizes=[n, 20], placement=f"rank:{r}"))
                start += n
            return EnumerableShardingSpec(shards=shards)
        specs = [ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
                 ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
                 ChunkShardingSpec(dim=1, placements=["rank:1", "rank:0"]),
                 rows((2, 0), (1, 1), (3, 0), (3, 1), (1, 0)),
                 rows((8, 1), (2, 0))]
        g = torch.arange(200, dtype=torch.float32).view(10, 20)

        def matches(st):
            for shard in st.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                if not torch.equal(shard.tensor, g[r:r + h, c:c + w]):
                    return False
            return True
        pairs = 0
        for saved in specs:
            st = sharded_tensor.empty(saved, 10, 20, init_rrefs=False)
            for shard in st.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(g[r:r + h, c:c + w])
            dcp.save({"st": st}, checkpoint_id=name, storage_writer=StorageWriter(repo))
            for loaded in specs:
                if loaded is saved:
                    continue
                target = {"st": sharded_tensor.zeros(loaded, 10, 20, init_rrefs=False)}
                dcp.load(target, checkpoint_id=name, storage_reader=StorageReader(repo))
                assert matches(target["st"]), (saved, loaded)
                pairs += 1
        outcome = f"ok {pairs} pairs"
    elif action in ("crash-save", "resave"):
        mesh = init_device_mesh("cpu", (world,))
        scale = float(sys.argv[4])

        def rows(zero=False):
            t = torch.zeros(10, 6) if zero else full()["rows"] * scale
            return {"w": distribute_tensor(t, mesh, [Shard(0)]), "step": 0 if zero else 8}
        writer = StorageWriter(repo, name)
        if action == "crash-save":
            wrote = writer.write_data

            def dying(plan, planner):
                if dist.get_rank() == 3:
                    os._exit(0)
                wrote(plan, planner).value()
                os._exit(0)  # ranks 1 and 2 committed their parts; rank 0 commits in finish()
            writer.write_data = dying
        future = dcp.async_save(rows(), storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD)
        future.result()
        back = rows(zero=True)
        dcp.load(back, storage_reader=StorageReader(repo, name))
        assert torch.equal(back["w"].full_tensor(), full()["rows"] * scale) and back["step"] == 8
    print(outcome)
    # DCP's process-based async saver is a daemon process that
    # multiprocessing ends at interpreter exit: run the exit handlers first,
    # or it would outlive this rank holding its stdout.
    leave(run_exit_handlers=action == "async-save" and sys.argv[4] == "process")


if __name__ == "__main__":
    main()
