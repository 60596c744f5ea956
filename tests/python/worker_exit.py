"""How the multi-process test workers end."""
import atexit
import os
import sys

import torch.distributed as dist


def leave(run_exit_handlers=False):
    """Ends this rank: its process group, then the process itself without
    C++ static destructors. At exit, torch's gloo sometimes aborts there
    ("terminate called without an active exception"; about 1 run in 20 on
    2 busy cores, with DCP's own FileSystemReader and no ckptfs loaded too),
    which would fail a rank whose work passed every check. With
    run_exit_handlers, Python's exit handlers (atexit) run first, as they
    would at a normal exit."""
    dist.destroy_process_group()
    if run_exit_handlers:
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
