#!/usr/bin/python3
"""Writes a small two-rank sharded checkpoint as safetensors files.

rank0.safetensors and rank1.safetensors each hold one rank's part: the
attention weight split by rows (box shards, tensor parallel), the MLP weight
split at an arbitrary element (flat shards, FSDP style), and a replicated
norm weight. expected/<name>.npy holds every whole tensor for checking.
"""
import json
import os
import struct
import sys

import numpy as np


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    pos, parts = 0, []
    for name, dtype, arr in tensors:
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [pos, pos + len(data)]}
        parts.append(data)
        pos += len(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(parts))


def main(out):
    rng = np.random.default_rng(100)
    qkv = rng.normal(0, 0.02, (96, 64)).astype(np.float32)
    mlp = rng.normal(0, 0.02, (64, 48)).astype(np.float32)
    norm = np.ones(64, dtype=np.float32)
    os.makedirs(f"{out}/expected", exist_ok=True)
    for name, arr in [("layers.0.attn.qkv.weight", qkv), ("layers.0.mlp.weight", mlp), ("layers.0.norm.weight", norm)]:
        np.save(f"{out}/expected/{name}.npy", arr)
    flat = mlp.reshape(-1)
    cut = 1000  # not a row boundary
    for rank, (rows, flat_part, flat_start) in enumerate([(slice(0, 48), flat[:cut], 0), (slice(48, 96), flat[cut:], cut)]):
        shards = {
            "layers.0.attn.qkv.weight": {"global_shape": [96, 64], "offsets": [rows.start, 0]},
            "layers.0.mlp.weight": {"global_shape": [64, 48], "flat_start": flat_start},
        }
        write_safetensors(f"{out}/rank{rank}.safetensors",
                          [("layers.0.attn.qkv.weight", "F32", qkv[rows]), ("layers.0.mlp.weight", "F32", flat_part),
                           ("layers.0.norm.weight", "F32", norm)],
                          {"ckptfs.shards": json.dumps(shards)})
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
