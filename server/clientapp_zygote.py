"""A warm ``flwr-clientapp``: one process that has imported the heavy libraries forks a child per message.

Flower's SuperExec starts a new ``flwr-clientapp`` process for every message a SuperNode receives; importing
torch, Flower and dp-accounting costs seconds before the ClientApp handles anything.  The zygote imports
those libraries once (never the project's own modules: each message still loads the run's ClientApp from
its FAB, as Flower does) and serves a Unix socket.  The :data:`SHIM` placed first on the SuperExec's
``PATH`` as ``flwr-clientapp`` sends its arguments and standard streams to the zygote, which forks; the
child runs Flower's own ``flwr-clientapp`` entry point with them, the node's FAB pin applied
(:mod:`server.fab_pin`).  The shim relays signals to the child and exits with its exit code; without a zygote it
runs ``CANCELFL_REAL_CLIENTAPP`` (``cancelfl-supernode``'s: Flower's with the FAB pin).

The zygote applies :func:`server.flower_tuning.tune_clientapp` before it forks (a child reuses the install of
a FAB its ``FLWR_HOME`` already holds, keeps the app's bytecode, and moves message objects with short retries
and several requests at once); it imports that module and Flower, never the project's app modules.

After the fork every child reseeds numpy's and torch's global generators (DP noise always comes from the
OS CSPRNG; this keeps non-DP randomness, e.g. data shuffling, from repeating across messages).

With ``CANCELFL_TRACE`` set (:mod:`protocols.trace`), every child appends one ``clientapp`` line with the
times of Flower's steps (pull the message, install the FAB, load the ClientApp, handle, push the reply).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import sys
import time
import traceback
from pathlib import Path

from server.executables import write_executable

#: Libraries the zygote imports before forking (each optional); the project's modules are never preloaded.
PRELOAD = ("numpy", "scipy.stats", "scipy.signal", "scipy.io", "torch", "torch.optim", "torch._dynamo", "torch.profiler",
           "sklearn", "sklearn.datasets", "sklearn.model_selection", "sklearn.preprocessing", "dp_accounting",
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
    return write_executable(folder, "flwr-clientapp", f"#!{python} -S\n{SHIM}")


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


#: Environment variable naming the round-trace file (the value of ``protocols.trace.TRACE_ENV``; the zygote
#: imports none of the project's modules, see :data:`PRELOAD`).
TRACE_ENV = "CANCELFL_TRACE"


class _StepTrace:
    """Times the steps of Flower's ``run_clientapp`` in this child (wraps that module's functions)."""

    def __init__(self, t_fork: float) -> None:
        self.rec: dict = {"t_fork": t_fork}

    def install(self) -> None:
        """Wrap ``pull_task_input``, ``install_from_fab``, the ClientApp loader and call, ``push_message``."""
        import flwr.supernode.runtime.run_clientapp as rc

        rc.pull_task_input = self._timed("pull", rc.pull_task_input, self._message)
        rc.install_from_fab = self._timed("fab", rc.install_from_fab)
        rc.push_message = self._timed("push", rc.push_message)
        get_loader = rc.get_load_client_app_fn

        def loader(*args, **kwargs):
            load = self._timed("load", get_loader(*args, **kwargs))

            def load_app(*a, **k):
                return self._timed("handle", load(*a, **k))
            return load_app
        rc.get_load_client_app_fn = loader

    def _timed(self, name: str, fn, after=None):
        def wrapper(*args, **kwargs):
            t, c = time.time(), time.process_time()
            try:
                out = fn(*args, **kwargs)
                if after is not None:
                    after(out)
                return out
            finally:
                self.rec[name] = [t, time.time(), time.process_time() - c]
        return wrapper

    def _message(self, out) -> None:
        msg, context = out[0], out[1]
        self.rec.update(message_id=msg.metadata.message_id, message_type=msg.metadata.message_type,
                        created_at=msg.metadata.created_at, node_id=context.node_id, run_id=context.run_id)

    def write(self, code: int) -> None:
        """Append the ``clientapp`` line (end time, CPU seconds of the child, exit code) to the trace file."""
        line = {"event": "clientapp", "pid": os.getpid(), **self.rec, "t_end": time.time(),
                "cpu": time.process_time(), "code": code}
        fd = os.open(os.environ[TRACE_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line, default=str) + "\n").encode())
        finally:
            os.close(fd)


def _run_child(argv: list[str], fds: list[int], t_fork: float | None = None) -> None:
    """In the forked child: take the shim's streams and argv, run Flower's ``flwr-clientapp``, never return."""
    code = 1
    steps = _StepTrace(time.time() if t_fork is None else t_fork) if os.environ.get(TRACE_ENV) else None
    try:
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        _child_setup()
        if steps is not None:
            steps.install()
        from server.fab_pin import install as pin_fab

        pin_fab()  # node config 'trusted-fab': the FAB is checked before anything of it is installed or run
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
        if steps is not None:
            with contextlib.suppress(Exception):
                steps.write(code)
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
    with contextlib.suppress(ImportError, AttributeError):  # no Flower or another one: Flower's own steps
        from server.flower_tuning import tune_clientapp

        tune_clientapp()  # the forked children inherit it
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
            t_fork = time.time()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _run_child(argv, fds, t_fork)
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
