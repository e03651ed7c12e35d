"""The launch's reaper: stops every process of a launch whose launcher died without stopping them (SIGKILL).

The processes a launcher starts die with it (Linux parent-death signal, :mod:`server.processes`), but their
descendants in other sessions (the SuperLink's ``flower-superexec`` and ``flwr-serverapp``, Ray's daemons) would
run on.  :func:`start_reaper` starts ``python -m server.reaper LAUNCHER_PID MARK`` in its own session: it waits
until the launcher is gone, then stops every process carrying the launch mark (:data:`LAUNCH_MARK`):
SIGTERM, up to 10 s, SIGKILL.  It does not carry the mark itself; a launcher that closes normally stops it
(:meth:`server.processes.Processes.close`).  Also how a launch's processes are found (:func:`marked_pids`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: Environment variable every process of one launch inherits (a fresh id per workspace): how the launcher
#: finds and stops the descendants that left their process group.
LAUNCH_MARK = "CANCELFL_LAUNCH_ID"


def marked_pids(mark: str) -> list[int]:
    """Pids of live processes whose environment holds ``LAUNCH_MARK=mark`` (empty where there is no /proc)."""
    return pids_with_env(LAUNCH_MARK, mark)


def pids_with_env(name: str, value: str) -> list[int]:
    """Pids of live processes (not this one) whose environment holds ``name=value`` (empty without /proc)."""
    needle = f"{name}={value}".encode()
    me, pids = os.getpid(), []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()  # empty for zombies: they are gone already
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _identity(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat`` field 22): None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return None if fields[0] in ("Z", "X") else fields[19]


def reap_after(launcher: int, mark: str, *, poll: float = 0.5, grace: float = 10.0) -> None:
    """Wait until process ``launcher`` is gone, then stop every live process marked ``mark`` (not this one)."""
    started = _identity(launcher)
    while started is not None and _identity(launcher) == started:
        time.sleep(poll)
    deadline = time.time() + grace
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked_pids(mark):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        while marked_pids(mark) and time.time() < deadline:
            time.sleep(0.2)


def start_reaper(mark: str, env: dict[str, str]) -> subprocess.Popen | None:
    """Start the reaper of this process's launch (``env`` carries the mark); None where there is no ``/proc``."""
    if not Path("/proc/self/stat").is_file():
        return None
    own = {k: v for k, v in env.items() if k != LAUNCH_MARK}  # not a process of the launch itself
    return subprocess.Popen([sys.executable, "-m", "server.reaper", str(os.getpid()), mark], env=own,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd=str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    """``python -m server.reaper LAUNCHER_PID MARK``."""
    args = sys.argv[1:] if argv is None else argv
    reap_after(int(args[0]), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
