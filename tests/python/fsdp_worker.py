"""One rank of a small FSDP2 training job on the CPU (gloo), run as its own
process by test_fsdp (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the
environment):

    fsdp_worker.py train REPO FSDIR
        trains 3 steps, then saves model and optimizer state with dcp.save
        twice: into checkpoint 'step-3' of the ckptfs repository REPO, and
        with DCP's own FileSystemWriter into FSDIR (or, FSDIR a ckptfs:// URL,
        FsspecWriter through it)
    fsdp_worker.py resume ckptfs|fs REPO FSDIR
        builds the job at this world size, restores 'step-3' from one of the
        two with dcp.load, and trains 2 more steps

    fsdp_worker.py job REPO STEPS CRASH_AT
        a training job as a user writes one: resumes from the repository's
        latest checkpoint when it has one, then trains up to step STEPS,
        starting dcp.async_save of model and optimizer as 'step-N' after
        each step (waiting for the save before it, as torchtitan does). At
        step CRASH_AT (0: never) the job dies in the middle of that save:
        rank 3 before it writes, the others once their parts are committed,
        so the checkpoint stays pending with parts of some ranks

    fsdp_worker.py hf REPO
        wraps test_huggingface's tiny Llama with fully_shard and saves its
        model state with dcp.save as checkpoint 'fsdp-hf', its config.json
        beside it as a blob

Rank 0 prints one JSON line: digests of the whole model and optimizer state
(after training for 'train', right after the restore for 'resume'), the
per-step global losses as float.hex, and for 'resume' the digests after
the 2 steps. For 'job': the step it resumed from, the digests right after
that restore, and the digests after each step it trained.
"""
import hashlib
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptfs.torch import StorageReader, StorageWriter
from worker_exit import leave

VOCAB, DIM, LAYERS = 97, 32, 2


class TinyLM(nn.Module):
    """A small pre-norm transformer language model."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=2 * DIM, dropout=0.0, batch_first=True,
                                       norm_first=True)
            for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def build(world):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, first_step, steps, rank):
    losses = []
    for step in range(first_step, first_step + steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item().hex())
    return losses


def digest(tree):
    """SHA-256 of every tensor's bytes and every other value in a nested state dict, in key order."""
    h = hashlib.sha256()

    def walk(prefix, value):
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{prefix}/{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        elif isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{prefix}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{prefix}={value!r}".encode())

    walk("", tree)
    return h.hexdigest()


def full_digests(model, opt):
    """Digests of the whole (unsharded) model and optimizer state; every rank takes part."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, opt, options=options)
    return digest(msd), digest(osd)


def run_job(model, opt, repo, steps, crash_at, rank):
    import os

    import ckptfs
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    out = {"resumed_from": None, "after": {}}
    latest = ckptfs.open(repo).resume_point("latest", process_group=dist.group.WORLD)
    first = 1
    if latest is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=StorageReader(repo, latest["name"]))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out["resumed_from"] = latest["step"]
        out["restored"] = full_digests(model, opt)
        first = latest["step"] + 1
    # The saves run on a thread of their own while training goes on: their
    # collectives get a group of their own (as torchtitan's async saves do),
    # or the two threads' collectives would interleave on one group.
    saves_group = dist.new_group(backend="gloo")
    saving = None
    for step in range(first, steps + 1):
        train(model, opt, step - 1, 1, rank)
        out["after"][step] = full_digests(model, opt)
        if saving is not None:
            saving.result()
        model_sd, optim_sd = get_state_dict(model, opt)
        writer = StorageWriter(repo, f"step-{step}", step=step)
        if step == crash_at:
            wrote = writer.write_data

            def dying(plan, planner, wrote=wrote):
                if dist.get_rank() == 3:
                    os._exit(0)
                wrote(plan, planner).value()
                os._exit(0)  # this rank's part is committed; the job dies before DCP's finish
            writer.write_data = dying
        saving = dcp.async_save({"model": model_sd, "optim": optim_sd}, storage_writer=writer,
                                process_group=saves_group, async_checkpointer_type=AsyncCheckpointerType.THREAD)
    if saving is not None:
        saving.result()
    if rank == 0:
        print(json.dumps(out))


def save_hugging_face_model(repo):
    from test_huggingface import tiny_model

    model = tiny_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    config = model.config.to_json_string().encode()
    dcp.save(get_model_state_dict(model),
             storage_writer=StorageWriter(repo, "fsdp-hf", blobs={"config.json": config}))


def main():
    action = sys.argv[1]
    if any(a.startswith("ckptfs://") for a in sys.argv):
        import ckptfs.filesystem  # noqa: PLC0415

        ckptfs.filesystem.register()  # an installed package does it through its entry point
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if action == "hf":
        save_hugging_face_model(sys.argv[2])
        if rank == 0:
            print(json.dumps({"saved": "fsdp-hf"}))
        leave()
    model, opt = build(world)
    out = {}
    if action == "job":
        run_job(model, opt, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), rank)
        leave()
    if action == "train":
        repo, fsdir = sys.argv[2], sys.argv[3]
        out["initial"] = full_digests(model, opt)[0]
        out["losses"] = train(model, opt, 0, 3, rank)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.save(state, storage_writer=StorageWriter(repo, "step-3", step=3))
        dcp.save(state, checkpoint_id=fsdir)
        out["model"], out["optim"] = full_digests(model, opt)
    else:
        source, repo, fsdir = sys.argv[2], sys.argv[3], sys.argv[4]
        model_sd, optim_sd = get_state_dict(model, opt)  # sets up the optimizer state to load into
        state = {"model": model_sd, "optim": optim_sd}
        if source == "ckptfs":
            dcp.load(state, storage_reader=StorageReader(repo, "step-3"))
        else:
            dcp.load(state, checkpoint_id=fsdir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out["model"], out["optim"] = full_digests(model, opt)
        out["losses"] = train(model, opt, 3, 2, rank)
        out["model_after"], out["optim_after"] = full_digests(model, opt)
    if rank == 0:
        print(json.dumps(out))
    leave()


if __name__ == "__main__":
    main()
