"""Round trace: one JSON line per event of a deployment round, for measuring where a round's time goes.

Every process of a deployment (the ServerApp's round loop, each warm ClientApp child of
:mod:`server.clientapp_zygote`) appends to the file named by :data:`TRACE_ENV` when it is set; nothing is
written otherwise.  Times are ``time.time()`` seconds (one clock: all processes run on one machine when
traced), so a message's path is followed across processes by its message id.
``benchmarks.roundtrace`` turns the file into the breakdown.
"""

from __future__ import annotations

import json
import os

#: Environment variable naming the trace file (JSON lines, appended; unset: no trace).
TRACE_ENV = "CANCELFL_TRACE"


def tracing() -> bool:
    """True when :data:`TRACE_ENV` names a file."""
    return bool(os.environ.get(TRACE_ENV))


def trace(event: str, **fields) -> None:
    """Append ``{"event": event, "pid": ..., **fields}`` as one line to the trace file (no-op when not tracing).

    One ``write`` of one line on a file opened with ``O_APPEND``: lines of concurrent processes do not interleave.
    """
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    line = (json.dumps({"event": event, "pid": os.getpid(), **fields}, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def traced_cpu() -> float:
    """CPU seconds of every live process tracing into this process's trace file, with their reaped children.

    Sums ``utime + stime + cutime + cstime`` (Linux ``/proc``) of the processes whose environment holds the same
    :data:`TRACE_ENV` value: the SuperLink, the SuperNodes, their SuperExecs and warm ClientApp processes (whose
    reaped per-message children count in them) and this ServerApp.  0.0 where there is no ``/proc``.
    """
    value = os.environ.get(TRACE_ENV)
    if not value or not os.path.isdir("/proc"):
        return 0.0
    needle = f"{TRACE_ENV}={value}".encode()
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime (stat fields 14-17)
    return total / ticks
