"""A training process that forks while a save is in flight (test_python's
ForkSafety): children made by every multiprocessing start method open the
repository again and save and load; a bare fork() child finds the
inherited handles refusing with a clear error and exits without waiting
for its parent's save. Prints the checkpoints in the end; exit 0 when all
went as expected."""
import multiprocessing as mp
import os
import sys
import time

import numpy as np

import ckptfs

BIG = 1 << 20


def child(url, name):
    repo = ckptfs.open(url)
    a = np.arange(100_000, dtype=np.float32) + len(name)
    repo.save(name, {"a": a})
    out = np.empty_like(a)
    repo.load(name, {"a": out})
    assert (out == a).all(), name
    base = np.empty(BIG, dtype=np.float32)
    repo.load("parent", {"a": base})
    assert (base == np.arange(BIG, dtype=np.float32)).all(), name


def wait_or_kill(pid, seconds):
    """The child's exit code, or None when it hung (it is then killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def bare_fork_child(url, repo, handle):
    code = 0
    try:
        repo.checkpoints()
        code = 10
    except ckptfs.Error as e:
        if "open the repository again" not in str(e):
            code = 11
    try:
        handle.result()
        code = 12
    except ckptfs.Error as e:
        if "before the process was forked" not in str(e):
            code = 13
    again = ckptfs.open(url)
    if "parent" not in [c["name"] for c in again.checkpoints()]:
        code = 14
    return code


def main():
    url = sys.argv[1]
    repo = ckptfs.open(url)
    repo.save("parent", {"a": np.arange(BIG, dtype=np.float32)})
    # 128 MiB: still in flight when the children start.
    handle = repo.async_save("parent-async", {"a": np.random.default_rng(1).random(16 << 20)})
    for method in ("fork", "forkserver", "spawn"):
        p = mp.get_context(method).Process(target=child, args=(url, "child-" + method))
        p.start()
        p.join(120)
        if p.is_alive():
            p.kill()
            sys.exit(f"a child started by {method} hung")
        if p.exitcode != 0:
            sys.exit(f"a child started by {method} failed: exit {p.exitcode}")
    pid = os.fork()
    if pid == 0:
        # Leaves like a script that ends: atexit handlers and destructors run.
        sys.exit(bare_fork_child(url, repo, handle))
    code = wait_or_kill(pid, 120)
    if code != 0:
        sys.exit(f"the bare fork() child {'hung' if code is None else f'failed at check {code}'}")
    handle.result()
    print(" ".join(sorted(c["name"] for c in repo.checkpoints())))


if __name__ == "__main__":
    main()
