"""Helpers shared by the Python benchmarks (tools/bench/*.py)."""
import os


def minor_faults():
    """Minor page faults of this process so far."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def drop_caches():
    """Writes dirty pages back and drops the page cache; False where that is
    not allowed (not root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_bytes(path):
    """(bytes read, bytes written) so far by the block device holding
    `path`, from /proc/diskstats; None where that device is not listed
    there (tmpfs, overlay)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if int(fields[0]) == major and int(fields[1]) == minor:
                    return int(fields[5]) * 512, int(fields[9]) * 512
    except OSError:
        pass
    return None


def markov_batches(torch, vocab, seq, seed=1):
    """A function n -> (inputs, targets): n sequences of `seq` tokens of a
    fixed random Markov chain over `vocab` tokens, with 4 likely successors
    per token (learnable, unlike random tokens). The same seed gives the
    same chain and the same batches."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=gen)

    def batch(n):
        x = torch.empty(n, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
        for t in range(seq):
            x[:, t + 1] = succ[x[:, t], torch.randint(0, 4, (n,), generator=gen)]
        return x[:, :-1], x[:, 1:]

    return batch


def add_scratch_dir_option(parser):
    """--dir: where a benchmark's repositories and files go, /dev/shm by
    default (the code's speed, not the disk's), /tmp without it."""
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp",
                        help="where the repositories and files go (default /dev/shm)")


def llm_state(torch, mib, seed):
    """bf16 weights, fp32 master weights and two fp32 moments (an LLM's
    training state under AdamW): 14 bytes a parameter, about `mib` MiB in
    all. The same seed gives the same bytes."""
    rows = max(1, ((mib << 20) // 14) // 1024)
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(rows, 1024, generator=gen) * 0.02
    return {"weight": master.to(torch.bfloat16), "master": master,
            "exp_avg": torch.randn(rows, 1024, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(rows, 1024, generator=gen) * 1e-6}


def state_bytes(state):
    """The bytes of a state dict's tensors."""
    return sum(v.numel() * v.element_size() for v in state.values())
