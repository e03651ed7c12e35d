"""A warm ``flwr-clientapp``: one process that has imported the heavy libraries forks a child per message.

Flower's SuperExec starts a new ``flwr-clientapp`` process for every message a SuperNode receives; importing
torch, Flower and dp-accounting costs seconds before the ClientApp handles anything.  The zygote imports
those libraries once (never the project's own modules: each message still loads the run's ClientApp from
its FAB, as Flower does) and serves a Unix socket.  The :data:`SHIM` placed first on the SuperExec's
``PATH`` as ``flwr-clientapp`` sends its arguments and standard streams to the zygote, which forks; the
child runs Flower's own ``flwr-clientapp`` entry point with them.  The shim relays signals to the child and
exits with its exit code; without a zygote it runs the real ``flwr-clientapp`` unchanged.

After the fork every child reseeds numpy's and torch's global generators (DP noise always comes from the
OS CSPRNG; this keeps non-DP randomness, e.g. data shuffling, from repeating across messages).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import sys
import traceback
from pathlib import Path

#: Libraries the zygote imports before forking (each optional); the project's modules are never preloaded.
PRELOAD = ("numpy", "scipy.stats", "scipy.signal", "torch", "torch.optim", "torch._dynamo", "sklearn", "dp_accounting",
           "cryptography", "grpc", "flwr_datasets", "datasets", "pyarrow",
           "flwr.app", "flwr.clientapp", "flwr.supernode.cli.flwr_clientapp", "flwr.supernode.runtime.run_clientapp")

#: The ``flwr-clientapp`` stand-in (stdlib only, started with ``python -S``: a few milliseconds).
SHIM = r'''
import json, os, signal, socket, sys
path, real = os.environ.get("CANCELFL_ZYGOTE", ""), os.environ["CANCELFL_REAL_CLIENTAPP"]
def fallback():
    os.execv(real, [real, *sys.argv[1:]])
fds = []
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        fds.append(os.open(os.devnull, os.O_RDWR))
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socket.send_fds(s, [json.dumps(sys.argv[1:]).encode()], fds)
    f = s.makefile("r")
    first = f.readline()
except OSError:
    fallback()
if not first.strip():
    fallback()
pid = int(first)
def relay(signum, _frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, relay)
line = f.readline()
sys.exit(int(line) if line.strip() else 1)
'''


def write_shim(folder: Path, python: str = sys.executable) -> Path:
    """Write the ``flwr-clientapp`` shim into ``folder`` (put it first on ``PATH``); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "flwr-clientapp"
    path.write_text(f"#!{python} -S\n{SHIM}")
    path.chmod(0o755)
    return path


def _preload() -> list[str]:
    loaded = []
    for name in PRELOAD:
        try:
            __import__(name)
            loaded.append(name)
        except Exception:  # noqa: BLE001 - an optional speed-up; the child imports what it needs anyway
            pass
    return loaded


def _child_setup() -> None:
    """Prepare a forked child: fresh generators and ``CANCELFL_CLIENT_THREADS`` torch threads (default 1).

    Python's ``random`` reseeds itself after a fork; numpy's and torch's global generators do not.  One thread:
    several clients share a machine's cores, and idle OpenMP threads spinning on a busy core slow a small
    model's step by orders of magnitude.
    """
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.seed()
        torch.set_num_threads(max(1, int(os.environ.get("CANCELFL_CLIENT_THREADS", "1"))))


def _run_child(argv: list[str], fds: list[int]) -> None:
    """In the forked child: take the shim's streams and argv, run Flower's ``flwr-clientapp``, never return."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        _child_setup()
        sys.argv = ["flwr-clientapp", *argv]
        from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

        flwr_clientapp()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the shim's stderr, then the exit code says it failed
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the process that started it exits, whatever this one is doing."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def serve(path: Path, parent_pid: int | None = None, poll: float = 0.05) -> None:
    """Serve ``flwr-clientapp`` requests on the Unix socket ``path`` until ``parent_pid`` is gone.

    Until the socket exists (the preload takes seconds) the shim runs the real ``flwr-clientapp``.
    """
    _die_with_parent()
    if parent_pid is not None and not _alive(parent_pid):
        return
    _preload()
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(64)
    waiting: dict[int, socket.socket] = {}
    while parent_pid is None or _alive(parent_pid):
        ready, _, _ = select.select([server], [], [], poll)
        if ready:
            conn, _ = server.accept()
            try:
                msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
                argv = json.loads(msg)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _run_child(argv, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        _reap(waiting)


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    """``python -m server.clientapp_zygote SOCKET [--parent-pid PID]``."""
    parser = argparse.ArgumentParser(description="serve warm flwr-clientapp processes on a Unix socket")
    parser.add_argument("socket", type=Path)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    serve(args.socket, args.parent_pid)


if __name__ == "__main__":
    main()
