"""A ``flower-superexec`` that its SuperNode wakes when it creates a task, instead of one that polls for tasks.

Flower's SuperExec asks its SuperNode for a task (a message to run a ClientApp for), then sleeps
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds, for as long as the node runs: polling every 50 ms costs a SuperNode and
its SuperExec about a tenth of a core together while idle, polling every second adds up to a second to every
message.  ``cancelfl-supernode`` (:mod:`server.supernode`) puts :data:`SHIM` first on the ``PATH`` as
``flower-superexec`` and names a Unix datagram socket in :data:`WAKE_ENV`; this module binds it and replaces the
loop's sleep with :class:`WakeClock`, which returns as soon as a datagram arrives.  The SuperNode sends one after
each task it creates (:func:`waker`), so a message's ClientApp starts at once while the loop otherwise asks once per
interval (its fallback: a datagram lost or sent before the socket was bound).  Nothing in a message goes through the
socket.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import time as _time
from collections.abc import Callable
from pathlib import Path

from server.executables import write_executable

#: Environment variable naming the wake socket's path (set by ``cancelfl-supernode`` for the SuperExec it starts).
WAKE_ENV = "CANCELFL_SUPEREXEC_WAKE"
#: The ``flower-superexec`` stand-in: Flower's, with :class:`WakeClock` in its loop.
SHIM = "#!{python}\nfrom server.superexec_wake import main\nmain()\n"


class WakeClock:
    """Stands in for the ``time`` module of Flower's SuperExec loop: its sleep ends at a wake datagram.

    Each datagram received stands for a task created: after a wake the loop asks again at once, once per datagram
    (two messages arriving together make two tasks), before it waits again.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = 0

    def sleep(self, seconds: float) -> None:
        """Wait up to ``seconds``, or not at all while wakes are pending; a datagram ends the wait."""
        if self.pending == 0:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, seconds))
            if not ready:
                return
        self.pending += self._drain()
        self.pending = max(0, self.pending - 1)

    def _drain(self) -> int:
        count = 0
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                self.sock.recv(64)
                count += 1
        return count

    def __getattr__(self, name: str):
        return getattr(_time, name)


def bind(path: Path) -> socket.socket:
    """A non-blocking Unix datagram socket bound at ``path`` (a stale file there is replaced)."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    return sock


def waker(path: Path) -> Callable[[], None]:
    """A function that wakes the SuperExec listening at ``path``; it never blocks nor raises (the poll is the fallback)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    target = str(path)

    def wake() -> None:
        with contextlib.suppress(OSError):  # not bound yet, gone, or its queue full: the loop's own poll finds the task
            sock.sendto(b"\x01", target)

    return wake


def write_shim(folder: Path, python: str = sys.executable) -> Path:
    """Write ``folder/flower-superexec`` (:data:`SHIM`); returns its path."""
    return write_executable(folder, "flower-superexec", SHIM.format(python=python))


def main() -> None:
    """``flower-superexec`` with :class:`WakeClock` in its loop when :data:`WAKE_ENV` names a socket path."""
    import flwr.supercore.superexec.run_superexec as loop
    from flwr.supercore.cli.flower_superexec import flower_superexec

    if path := os.environ.get(WAKE_ENV):
        loop.time = WakeClock(bind(Path(path)))
    sys.argv[0] = "flower-superexec"
    flower_superexec()


if __name__ == "__main__":
    main()
