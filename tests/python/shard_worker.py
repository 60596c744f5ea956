"""One rank of a sharded save or load, run as its own process by the tests:

    shard_worker.py save|load REPO RANK WORLD_SIZE

Saves (world size 4) or loads (any world size) checkpoint 'sharded', whose
tensors full_state() defines, and prints "ok" when every byte loaded is right.
"""
import sys

import torch

import ckptfs


def full_state():
    gen = torch.Generator().manual_seed(1234)
    return {
        "attn.weight": torch.randn(12, 10, generator=gen),                      # boxes, 2 x 2 grid
        "flat.param": torch.randn(7, 9, generator=gen).to(torch.bfloat16),     # flat runs
        "norm": torch.randn(5, generator=gen, dtype=torch.float64),            # replicated on every rank
        "embed": torch.randint(-1000, 1000, (4, 3), generator=gen),            # rows of ranks 0 and 1 only
        "flag": torch.tensor(True),
    }


FLAT_SPLITS = [0, 10, 33, 50, 63]


def save(repo, rank, world):
    assert world == 4
    full = full_state()
    r0, c0 = (rank // 2) * 6, (rank % 2) * 5
    a, b = FLAT_SPLITS[rank], FLAT_SPLITS[rank + 1]
    state = {
        "attn.weight": full["attn.weight"][r0:r0 + 6, c0:c0 + 5],
        "flat.param": full["flat.param"].reshape(-1)[a:b],
        "norm": full["norm"],
        "flag": full["flag"],
    }
    shards = {
        "attn.weight": ckptfs.Box((12, 10), (r0, c0)),
        "flat.param": ckptfs.Flat((7, 9), a),
    }
    if rank < 2:
        state["embed"] = full["embed"][2 * rank:2 * rank + 2]
        shards["embed"] = ckptfs.Box((4, 3), (2 * rank, 0))
    if rank == 0:
        state["rng"] = b"rank0-rng-state"
    ckptfs.open(repo).save("sharded", state, step=10, rank=rank, world_size=world, shards=shards)


def load(repo, rank, world):
    full = full_state()
    rows = [12 * k // world for k in range(world + 1)]
    flat = [63 * k // world for k in range(world + 1)]
    targets = {
        "attn.weight": torch.empty(rows[rank + 1] - rows[rank], 10),
        "flat.param": torch.empty(flat[rank + 1] - flat[rank], dtype=torch.bfloat16),
        "norm": torch.empty(5, dtype=torch.float64),
        "embed": torch.empty(4, 1, dtype=torch.int64),
        "flag": torch.tensor(False),
    }
    shards = {
        "attn.weight": ckptfs.Box((12, 10), (rows[rank], 0)),
        "flat.param": ckptfs.Flat((7, 9), flat[rank]),
        "embed": ckptfs.Box((4, 3), (0, rank % 3)),
    }
    repo = ckptfs.open(repo)
    repo.load("sharded", targets, shards=shards)
    expected = {
        "attn.weight": full["attn.weight"][rows[rank]:rows[rank + 1]],
        "flat.param": full["flat.param"].reshape(-1)[flat[rank]:flat[rank + 1]],
        "norm": full["norm"],
        "embed": full["embed"][:, rank % 3:rank % 3 + 1],
        "flag": full["flag"],
    }
    for k, v in expected.items():
        if not torch.equal(targets[k], v):
            print(f"rank {rank}: {k} differs", file=sys.stderr)
            sys.exit(1)
    if repo.blob("sharded", "rng") != b"rank0-rng-state":
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    action, repo, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    {"save": save, "load": load}[action](repo, rank, world)
