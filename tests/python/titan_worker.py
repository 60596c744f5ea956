"""A few training steps of a small model with torchtitan's own checkpoint
manager (torchtitan.components.checkpointer.dcp.CheckpointManager, with its
OptimizersContainer and LRSchedulersContainer), its checkpoint folder a
ckptfs:// URL (DCP through fsspec), run as a process of its own by
test_filesystem:

    titan_worker.py FOLDER STEPS [DIE_AFTER]

Resumes from the newest checkpoint in FOLDER if there is one, trains up to
step STEPS (a checkpoint every 2 steps, the last 2 kept), and prints one
line of JSON: {"resumed_from": STEP or 0, "losses": {STEP: LOSS}}. With
DIE_AFTER, the process dies right after that step (os._exit), as a killed
job does.

torchtitan trains its own models on an accelerator only (with none, its
device is "cuda": torchtitan/tools/utils.py), so the model here is a small
MLP on the CPU, trained with torchtitan's optimizer, scheduler and
checkpoint manager, unchanged.
"""
import json
import os
import sys
import warnings

import torch

import ckptfs.filesystem

warnings.simplefilter("ignore")
ckptfs.filesystem.register()  # an installed package does it through its entry point

from torchtitan.components.checkpointer.dcp import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def batch(step):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 64, generator=gen)
    return x, x[:, :8].sum(dim=1, keepdim=True)


def main():
    folder, steps = sys.argv[1], int(sys.argv[2])
    die_after = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    # torchtitan runs under torchrun: one rank of gloo here.
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
            implementation="for-loop"),
        model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    state = TrainState()
    checkpointer = CheckpointManager(
        CheckpointManager.Config(enable=True, folder=folder, interval=2, keep_latest_k=2,
                                 last_save_model_only=False),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None)
    checkpointer.load()
    resumed_from = state.step
    losses = {}
    for step in range(state.step + 1, steps + 1):
        x, y = batch(step)
        optimizers.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        schedulers.step()
        state.step = step
        losses[step] = loss.item()
        checkpointer.save(curr_step=step, last_step=step == steps)
        if step == die_after:
            print(json.dumps({"resumed_from": resumed_from, "losses": losses}), flush=True)
            os._exit(3)
    checkpointer.close()
    torch.distributed.destroy_process_group()
    print(json.dumps({"resumed_from": resumed_from, "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
