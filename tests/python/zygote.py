"""Rank processes without paying torch's import each time.

A multi-process test starts one process per rank, and each used to spend
about 2.5 s of CPU importing torch and torch.distributed before doing a
few milliseconds of work; on 2 cores that was most of the Python stages'
time. `spawn` starts the same scripts as `subprocess.Popen([sys.executable,
script, ...])` would, but forked from a *zygote*: a Python process started
once per test process that has imported torch, torch.distributed (with DCP,
FSDP and DTensor) and NumPy, and has run nothing else (no torch op, so no
thread pool; no ckptfs handle). Each child is a real process with its own
pid, environment, working directory, argv and stdout/stderr pipes; it runs
the script as `__main__` and ends as the script ends it (exit status,
signal, traceback), so a test kills, waits for and reads it as it would a
Popen. What a fresh interpreter would differ in (modules imported before
the script, the hash seed) is nothing the rank scripts depend on.

Only `[sys.executable, SCRIPT.py, ...]` with the zygote's PYTHONPATH goes
through the zygote; anything else, or CKPTFS_TEST_NO_ZYGOTE=1 in the
environment, is a plain subprocess.Popen.

    python zygote.py     the zygote itself: prints its socket path, then
                         forks a child per request until its stdin closes
"""
import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor")
_MAX_REQUEST = 1 << 20


def _serve(path):
    """The zygote's loop; returns only in a forked child, with its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print(path, flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listen")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    waiting = {}  # pid -> the connection that hears its exit status
    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):  # the test process is gone
                    for pid in waiting:
                        _kill(pid)
                    os._exit(0)
                continue
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
            request = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_child(request, fds):
    """In the forked child: becomes the script's process and runs it."""
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    script = os.path.abspath(argv[1])
    sys.argv = argv[1:]
    sys.path[0] = os.path.dirname(script)
    import runpy  # noqa: PLC0415

    runpy.run_path(script, run_name="__main__")


class Process:
    """The Popen subset the tests use, for a child of the zygote."""

    def __init__(self, conn, out, err):
        self._conn = conn
        self._file = conn.makefile("r")
        line = self._file.readline()
        if not line.startswith("pid "):
            raise RuntimeError(f"the test zygote did not start the process (it said {line!r})")
        self.pid = int(line.split()[1])
        self.returncode = None
        self._out, self._err = out, err

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                line = self._file.readline()
            except (socket.timeout, TimeoutError):
                raise subprocess.TimeoutExpired("zygote child", timeout) from None
            if not line.startswith("exit "):
                raise RuntimeError(f"the test zygote lost process {self.pid} (it said {line!r})")
            self.returncode = int(line.split()[1])
            self._file.close()
            self._conn.close()
        return self.returncode

    def kill(self):
        if self.returncode is None:
            _kill(self.pid)

    def communicate(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = {self._out: [], self._err: []}
        sel = selectors.DefaultSelector()
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        open_fds = set(chunks)
        while open_fds:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                sel.close()
                raise subprocess.TimeoutExpired("zygote child", timeout)
            for key, _ in sel.select(timeout=left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
                    open_fds.discard(key.fd)
        sel.close()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return b"".join(chunks[self._out]), b"".join(chunks[self._err])


class _Zygote:
    def __init__(self):
        self._dir = tempfile.mkdtemp(prefix="ckptfs-zygote-")
        self.pythonpath = os.environ.get("PYTHONPATH")
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, cwd=self._dir)
        self.path = self._proc.stdout.readline().decode().strip()
        if not self.path:
            raise RuntimeError(f"the test zygote did not start (exit status {self._proc.wait()})")
        atexit.register(self.close)

    def spawn(self, argv, env, cwd):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode()
            socket.send_fds(conn, [request], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        return Process(conn, out_r, err_r)

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait()
        self._proc.stdout.close()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


_zygote = None
_lock = threading.Lock()


def spawn(argv, env=None):
    """Popen(argv, env=env, stdout=PIPE, stderr=PIPE), through the zygote
    when argv runs a Python script with this interpreter (see above)."""
    global _zygote
    env = dict(os.environ if env is None else env)
    through = (len(argv) >= 2 and argv[0] == sys.executable and str(argv[1]).endswith(".py")
               and not os.environ.get("CKPTFS_TEST_NO_ZYGOTE"))
    with _lock:
        if through and _zygote is None:
            _zygote = _Zygote()
        zygote = _zygote
    if through and env.get("PYTHONPATH") == zygote.pythonpath:
        return zygote.spawn([str(a) for a in argv], env, os.getcwd())
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _main():
    import importlib  # noqa: PLC0415

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    path = os.path.join(os.getcwd(), "zygote.sock")
    request, fds = _serve(path)
    _run_child(request, fds)


if __name__ == "__main__":
    _main()
