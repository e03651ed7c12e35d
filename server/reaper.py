"""The launch's reaper: stops every process of a launch whose launcher died without stopping them (SIGKILL).

The processes a launcher starts die with it (Linux parent-death signal, :mod:`server.processes`), but their
descendants in other sessions (the SuperLink's ``flower-superexec`` and ``flwr-serverapp``, Ray's daemons) would
run on.  :func:`start_reaper` starts ``python -m server.reaper LAUNCHER_PID MARK`` in its own session: it waits
until the launcher is gone, then stops every process carrying the launch mark (:data:`server.processes.LAUNCH_MARK`):
SIGTERM, up to 10 s, SIGKILL.  It carries the mark itself, so a launcher that closes normally stops it with the rest.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


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
    from server.processes import marked_pids

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
    return subprocess.Popen([sys.executable, "-m", "server.reaper", str(os.getpid()), mark], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd=str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    """``python -m server.reaper LAUNCHER_PID MARK``."""
    args = sys.argv[1:] if argv is None else argv
    reap_after(int(args[0]), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
