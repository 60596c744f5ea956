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
