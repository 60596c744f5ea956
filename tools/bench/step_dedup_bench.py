"""Dedup between the checkpoints of a real training run: how many new bytes
each checkpoint adds, in ckptfs and with Hugging Face Xet-style
content-defined chunking of the same checkpoints.

A small GPT (4 blocks, width 256, vocabulary 8192, tied to nothing, so
that the embedding is a third of the parameters as in GPT-2 small) learns
sequences of a fixed random Markov chain with AdamW for --steps steps,
saving every --every steps, in three settings:

- full:     every parameter trains;
- frozen:   the token and position embeddings are frozen (no grad, no
            optimizer state), the rest trains;
- lora:     the base model is frozen; rank-8 LoRA adapters on the
            attention's query, key, value and output projections train.

Each checkpoint is what a job saves: the whole model's weights (fp32) and
the optimizer's state of what trains (Adam's moments and step), under
DCP-style names ("model.*", "optim.state.*"). Per setting and checkpoint:

- ckptfs: saved with repo.save into one repository per setting (4 MiB
  chunks, the default); the chunks it adds (deduplicated against every
  earlier checkpoint, before compression) and the bytes it adds to the
  packs (after compression), over the checkpoint's logical bytes;
- Xet-style CDC: the same tensors written as one safetensors file per
  checkpoint and chunked in order by `cdc_bench` (a gear hash cutting
  64 KiB chunks of 8 to 128 KiB, each named by its hash): the bytes of the
  chunks it had not seen, over the file's bytes.

The first checkpoint of a setting adds everything; the table gives the
median over the later ones, and their sum over the run.

    build/venv/bin/python tools/bench/step_dedup_bench.py [--steps 300] [--every 50] [--dir /dev/shm]

(ckptfs importable: PYTHONPATH=build/python, or the package installed;
safetensors installed; build/tools/cdc_bench built.)
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from bench_util import add_scratch_dir_option, markov_batches

VOCAB, WIDTH, BLOCKS, HEADS, SEQ, RANK = 8192, 256, 4, 4, 64, 8


def build_model(torch, lora):
    nn = torch.nn

    class Linear(nn.Linear):
        """A linear layer, with a rank-RANK LoRA adapter when asked."""

        def __init__(self, n_in, n_out, adapter):
            super().__init__(n_in, n_out)
            if adapter:
                self.lora_a = nn.Parameter(torch.randn(RANK, n_in) / n_in ** 0.5)
                self.lora_b = nn.Parameter(torch.zeros(n_out, RANK))

        def forward(self, x):
            y = super().forward(x)
            if hasattr(self, "lora_a"):
                y = y + (x @ self.lora_a.t()) @ self.lora_b.t() * (16.0 / RANK)
            return y

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.q, self.k, self.v, self.o = (Linear(WIDTH, WIDTH, lora) for _ in range(4))
            self.fc1, self.fc2 = Linear(WIDTH, 4 * WIDTH, False), Linear(4 * WIDTH, WIDTH, False)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.ln1(x)
            q, k, v = (m(h).view(b, t, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, WIDTH))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.ln, self.head = nn.LayerNorm(WIDTH), Linear(WIDTH, VOCAB, False)

        def forward(self, x):
            h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln(h))

    return GPT()


def state_of(model, opt):
    """A DCP-style flat state dict: the model's weights, the optimizer's state."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            state[f"optim.state.{names[id(p)]}.{k}"] = v.detach().clone().reshape(v.shape or (1,))
    return state


def run_setting(setting, args, torch, ckptfs, save_file, work):
    torch.manual_seed(0)
    model = build_model(torch, lora=setting == "lora")
    for n, p in model.named_parameters():
        if setting == "frozen" and (n.startswith("tok.") or n.startswith("pos.")):
            p.requires_grad_(False)
        if setting == "lora" and "lora_" not in n:
            p.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3 if setting == "lora" else 3e-4, weight_decay=0.1)
    batch = markov_batches(torch, VOCAB, SEQ)
    repo = ckptfs.init(os.path.join(work, setting))
    files, rows = [], []
    loss = None
    before = {"unique_raw_bytes": 0, "referenced_bytes": 0}
    for step in range(1, args.steps + 1):
        x, y = batch(16)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every:
            continue
        state = state_of(model, opt)
        logical = sum(v.numel() * v.element_size() for v in state.values())
        repo.save(f"step-{step}", state, step=step)
        total = repo.du()["total"]
        path = os.path.join(work, f"{setting}-{step}.safetensors")
        save_file({k: v.contiguous() for k, v in sorted(state.items())}, path)
        files.append(path)
        rows.append({"step": step, "logical": logical, "loss": float(loss.detach()),
                     "ckptfs_new": total["unique_raw_bytes"] - before["unique_raw_bytes"],
                     "ckptfs_stored": total["referenced_bytes"] - before["referenced_bytes"]})
        before = total
    cdc = subprocess.run([args.cdc_bench, "--json", *files], check=True, stdout=subprocess.PIPE, text=True)
    for row, line in zip(rows, cdc.stdout.splitlines()):
        c = json.loads(line)
        row["cdc_new"], row["cdc_file"] = c["new_bytes"], c["bytes"]
    trainable = sum(p.numel() for p in trained)
    return rows, trainable, sum(p.numel() for p in model.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per setting (default 300)")
    ap.add_argument("--every", type=int, default=50, help="save every N steps (default 50)")
    ap.add_argument("--settings", default="full,frozen,lora", help="which settings (default full,frozen,lora)")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--cdc-bench", default=os.path.join(here, "..", "..", "build", "tools", "cdc_bench"),
                    help="the cdc_bench program (default build/tools/cdc_bench)")
    add_scratch_dir_option(ap)
    args = ap.parse_args()
    if not os.path.exists(args.cdc_bench):
        raise SystemExit(f"step_dedup_bench: {args.cdc_bench} not found (ninja -C build cdc_bench)")
    import torch
    from safetensors.torch import save_file

    import ckptfs

    torch.set_num_threads(2)
    work = tempfile.mkdtemp(prefix="ckptfs-step-dedup-", dir=args.dir)
    try:
        print(f"{'setting':8s} {'trains':>14s} {'MiB/ckpt':>8s} {'loss':>11s}   new bytes / logical, "
              f"median of checkpoints 2..n (sum over the run / sum of logical)")
        print(f"{'':8s} {'':>14s} {'':>8s} {'':>11s}   {'ckptfs dedup':>16s} {'ckptfs stored':>16s} "
              f"{'Xet-style CDC':>16s}")
        for setting in args.settings.split(","):
            t0 = time.perf_counter()
            rows, trainable, params = run_setting(setting, args, torch, ckptfs, save_file, work)
            later = rows[1:] or rows
            med = statistics.median

            def figure(key, of="logical"):
                part = med(r[key] / r[of] for r in later)
                whole = sum(r[key] for r in rows) / sum(r[of] for r in rows)
                return f"{part:6.3f} ({whole:5.3f})"

            print(f"{setting:8s} {trainable / params:6.1%} of {params / 1e6:4.1f}M "
                  f"{rows[0]['logical'] / 2**20:8.1f} {rows[0]['loss']:5.2f}>{rows[-1]['loss']:4.2f}   "
                  f"{figure('ckptfs_new'):>16s} {figure('ckptfs_stored'):>16s} {figure('cdc_new', 'cdc_file'):>16s}"
                  f"   [{time.perf_counter() - t0:.0f} s, {len(rows)} checkpoints]")
        print("\n(new bytes: what a checkpoint adds beyond every earlier one of its run; ckptfs dedup counts "
              "its new chunks decoded, ckptfs stored the bytes they take in packs after compression; "
              "Xet-style CDC the new 64 KiB content-defined chunks of the same tensors as a safetensors file)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
