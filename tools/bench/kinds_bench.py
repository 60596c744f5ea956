"""Compression per kind of training state, on the state of a small
transformer trained for a few hundred steps (not random values): ckptfs's
codec (byte grouping + zstd) against plain zstd -3 on the same bytes.

A decoder-only transformer (4 layers, width 256, vocabulary 512) learns
sequences of a fixed random Markov chain with AdamW in fp32 for --steps
steps. Its state is then what a mixed-precision job saves: the bf16 copy of
the weights ("model.*", weights_16bit), the fp32 master weights
("master.*", weights_fp32) and Adam's moments ("optim.state.*.exp_avg",
"exp_avg_sq"). For each kind:

- stored / logical in a ckptfs repository that compresses every chunk
  (adaptive off), from `ckpt du --by-kind` (repo.du(by_kind=True));
- the same for `zstd -3 -T1` of the kind's bytes (the zstd command);
- encode throughput on one thread: a save of the kind alone into a
  repository opened with one worker thread (hash, group, compress, write
  to the page cache), against `zstd -3 -T1` compressing the same bytes;
- decode throughput on one thread: a load of it back (read, decompress,
  ungroup, verify), against `zstd -d -T1`;
- the codec alone on a 4 MiB chunk of each kind's bytes, one thread
  (`codec_bench --input`, when built): hash, zstd -1, ckptfs's encode and
  decode, against memcpy.

Medians of --runs for the throughputs; minor page faults of the ckptfs
save beside it.

    build/venv/bin/python tools/bench/kinds_bench.py [--steps 300] [--runs 3] [--dir /dev/shm]

(ckptfs importable: PYTHONPATH=build/python, or the package installed;
the zstd command on PATH: apt-get install zstd.)
"""
import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_util import add_scratch_dir_option, markov_batches

VOCAB, WIDTH, LAYERS, SEQ = 512, 256, 4, 64


def train(steps, torch):
    """The state dict of a mixed-precision job after `steps` AdamW steps."""
    torch.manual_seed(0)
    batch = markov_batches(torch, VOCAB, SEQ)

    layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
    body = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    embed, head = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB)
    model = torch.nn.ModuleDict({"embed": embed, "body": body, "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(SEQ)
    loss = None
    for _ in range(steps):
        x, y = batch(16)
        logits = head(body(embed(x), mask=mask, is_causal=True))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for n, p in model.named_parameters():
        state[f"model.{n}"] = p.detach().to(torch.bfloat16)
        state[f"master.{n}"] = p.detach().clone()
    for p, s in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            state[f"optim.state.{names[id(p)]}.{k}"] = s[k].clone()
    return state, float(loss.detach())


def kind_of(name):
    if name.endswith(".exp_avg_sq"):
        return "adam_exp_avg_sq"
    if name.endswith(".exp_avg"):
        return "adam_exp_avg"
    return "weights_16bit" if name.startswith("model.") else "weights_fp32"


def zstd(args, src, dst):
    """Seconds `zstd ARGS src -o dst` takes (one thread)."""
    t = time.perf_counter()
    subprocess.run(["zstd", "-q", "-f", "-T1", *args, src, "-o", dst], check=True)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each throughput; medians are reported (default 3)")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--codec-bench", default=os.path.join(here, "..", "..", "build", "tools", "codec_bench"),
                    help="the codec_bench program (default build/tools/codec_bench; skipped when missing)")
    add_scratch_dir_option(ap)
    args = ap.parse_args()
    if not shutil.which("zstd"):
        raise SystemExit("kinds_bench: the zstd command is needed (apt-get install zstd)")
    import torch

    import ckptfs

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    state, loss = train(args.steps, torch)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f} s, loss {loss:.2f}; "
          f"{sum(v.numel() * v.element_size() for v in state.values()) / 2**20:.1f} MiB of state, "
          f"{os.cpu_count()} CPUs")
    work = tempfile.mkdtemp(prefix="ckptfs-kinds-bench-", dir=args.dir)
    try:
        kinds = {}
        inputs = []  # codec_bench's --input of each kind's bytes
        for k, v in state.items():
            kinds.setdefault(kind_of(k), {})[k] = v
        repo_path = os.path.join(work, "all")
        repo = ckptfs.init(repo_path, chunk_size=1 << 20, adaptive=False)
        repo.save("trained", state)
        by_kind = {k["kind"]: k for k in repo.du(by_kind=True)["kinds"]}
        print(f"\n{'kind':16s} {'MiB':>6s} {'ckptfs':>7s} {'zstd-3':>7s} {'ratio':>6s}   {'encode MB/s':>18s} "
              f"{'decode MB/s':>18s}  faults/MiB")
        print(f"{'':16s} {'':>6s} {'stored/logical':>15s} {'':>6s}   {'ckptfs / zstd-3':>18s} "
              f"{'ckptfs / zstd -d':>18s}")
        for kind, part in kinds.items():
            logical = sum(v.numel() * v.element_size() for v in part.values())
            raw = os.path.join(work, kind + ".raw")
            with open(raw, "wb") as f:
                for v in part.values():
                    f.write(v.contiguous().view(torch.uint8).numpy().tobytes())
            inputs += ["--input", f"{'BF16' if kind == 'weights_16bit' else 'F32'}:{raw}:{kind}"]
            enc, dec, zenc, zdec, faults = [], [], [], [], []
            for run in range(args.runs):
                one = ckptfs.init(os.path.join(work, f"{kind}-{run}"), chunk_size=1 << 20, adaptive=False, threads=1)
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t = time.perf_counter()
                one.save("k", part)
                enc.append(logical / (time.perf_counter() - t) / 1e6)
                faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / (logical / 2**20))
                targets = {k: torch.empty_like(v) for k, v in part.items()}
                t = time.perf_counter()
                one.load("k", targets)
                dec.append(logical / (time.perf_counter() - t) / 1e6)
                assert all(torch.equal(targets[k].view(torch.uint8), v.view(torch.uint8)) for k, v in part.items())
                zenc.append(logical / zstd(["-3"], raw, raw + ".zst") / 1e6)
                zdec.append(logical / zstd(["-d"], raw + ".zst", raw + ".out") / 1e6)
            z = os.path.getsize(raw + ".zst") / logical
            stored = by_kind[kind]["stored_fraction"]
            m = statistics.median
            print(f"{kind:16s} {logical / 2**20:6.1f} {stored:7.3f} {z:7.3f} {stored / z:6.2f}   "
                  f"{m(enc):7.0f} / {m(zenc):7.0f}   {m(dec):7.0f} / {m(zdec):7.0f}   {m(faults):8.0f}")
        print("\n(ratio: ckptfs's stored fraction over zstd -3's; below 1 ckptfs stores less. Encode and decode "
              "on one thread, ckptfs's including the hash and the write to the page cache, zstd's a file to a file)")
        if os.path.exists(args.codec_bench):
            print("\nThe codec alone, on a 4 MiB chunk of each kind's bytes (codec_bench --input):")
            sys.stdout.flush()
            subprocess.run([args.codec_bench, "--mib", "4", "--runs", "50", *inputs], check=True)
        else:
            print(f"\n(codec_bench not found at {args.codec_bench}: the codec alone not measured)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
