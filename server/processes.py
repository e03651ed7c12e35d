"""Background OS processes of one launch: started with log files, stopped with all their descendants.

Every process of a launch inherits :data:`LAUNCH_MARK` (a fresh id per launch) in its environment, which is how
descendants that left their process group are found (Linux ``/proc``); each started process leads its own group
and is killed when the launcher dies (Linux parent-death signal); should the launcher die without stopping them,
:mod:`server.reaper` stops the rest.  Also a free loopback port, waiting for a port
to listen, and the launch's throwaway work folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from server.defaults import APP_DIR
from server.reaper import LAUNCH_MARK, marked_pids, pids_with_env, start_reaper

__all__ = ["LAUNCH_MARK", "Processes", "free_port", "marked_pids", "pids_with_env", "wait_for_port", "workspace"]

def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Start background processes with log files; stop them and all their descendants on close.

    Each process leads its own process group (``start_new_session``); Flower's children of a SuperNode
    (``flower-superexec``, ``flwr-clientapp``) stay in it, so the group is signalled also when its leader
    already died (a killed SuperNode leaves them running otherwise).  Descendants that left the group
    (the SuperLink starts ``flower-superexec`` in a new session, Ray starts its own daemons) are found by
    the launch mark every one of them inherits in its environment (:data:`LAUNCH_MARK`, Linux ``/proc``).
    """

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, env
        self.mark = env.get(LAUNCH_MARK, "")
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: list = []
        # Stops the launch's processes should this launcher die without close() (SIGKILL): server.reaper.
        self._reaper = start_reaper(self.mark, env) if self.mark else None

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        """Start ``cmd`` in its own process group, logging to ``<workdir>/<name>.log``."""
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=APP_DIR,
                                start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        """Raise with the log tail if a started process already exited."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail}")

    def descendants(self) -> list[int]:
        """Live processes (other than this one) started by this launch, found by their launch mark."""
        return marked_pids(self.mark) if self.mark else []

    def _signal(self, sig: int) -> None:
        marked = self.descendants()
        groups = set()
        for pid in marked:
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(pid))
        for _, proc in self.procs:
            # A reaped leader's group is signalled only while a marked member is in it (its pid may be reused).
            if proc.poll() is None or proc.pid in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
        for pid in marked:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def close(self, grace: float = 10.0) -> None:
        """Stop every process started here and all their descendants: TERM, up to ``grace`` s, then KILL."""
        self._signal(signal.SIGTERM)
        deadline = time.time() + grace
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.time()))
        while self.descendants() and time.time() < deadline:
            time.sleep(0.2)
        self._signal(signal.SIGKILL)
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        end = time.time() + 5
        while self.descendants() and time.time() < end:  # SIGKILL is asynchronous
            time.sleep(0.05)
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._reaper is not None:  # nothing left to reap
            self._reaper.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=5)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the launcher dies, even by SIGKILL (no cleanup ran)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def wait_for_port(port: int, timeout: float = 60.0, procs: Processes | None = None) -> None:
    """Wait until something listens on 127.0.0.1:``port``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if procs:
            procs.check_alive()
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


@contextlib.contextmanager
def workspace(keep: str | None = None) -> Iterator[Path]:
    """A temporary folder for FLWR_HOME, databases and logs (kept if ``keep`` is given)."""
    path = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="cancelfl-"))
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)

