"""``cancelfl-supernode``: Flower's ``flower-supernode`` with its per-message waits taken out.

Same arguments as ``flower-supernode`` (Flower 1.41).  Three changes, none to what a message carries:

* a warm ClientApp process (:mod:`server.clientapp_zygote`) forks per message instead of a new
  interpreter importing torch and Flower each time;
* the SuperNode asks the SuperLink for messages every ``CANCELFL_POLL_INTERVAL`` seconds (default 0.2)
  instead of Flower's fixed 3 s while idle and 0.5 s while a reply is pending;
* its SuperExec looks for new tasks every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds (Flower's own
  setting; default here 0.05 instead of 1).

Set ``CANCELFL_WARM_CLIENTAPP=0`` to start a fresh ``flwr-clientapp`` per message as Flower does.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time as _time
from pathlib import Path

#: Seconds between the SuperNode's requests to the SuperLink (run-time: ``CANCELFL_POLL_INTERVAL``).
DEFAULT_POLL_INTERVAL = 0.2


class _PollClock:
    """Stands in for the ``time`` module inside Flower's SuperNode loop: its waits of >= 0.5 s become ``interval``."""

    def __init__(self, interval: float) -> None:
        self.interval = interval

    def sleep(self, seconds: float) -> None:
        _time.sleep(min(seconds, self.interval) if seconds >= 0.5 else seconds)

    def __getattr__(self, name: str):
        return getattr(_time, name)


def poll_interval() -> float:
    """``CANCELFL_POLL_INTERVAL`` in seconds (0.01-3)."""
    raw = os.environ.get("CANCELFL_POLL_INTERVAL", str(DEFAULT_POLL_INTERVAL))
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"cancelfl-supernode: CANCELFL_POLL_INTERVAL={raw!r} is not a number of seconds") from None
    if not 0.01 <= value <= 3.0:
        raise SystemExit(f"cancelfl-supernode: CANCELFL_POLL_INTERVAL={value} must be within 0.01-3 s")
    return value


def start_warm_clientapp(work: Path) -> subprocess.Popen | None:
    """Start the zygote and put the ``flwr-clientapp`` shim first on ``PATH`` (inherited by the SuperExec)."""
    from server.clientapp_zygote import write_shim

    real = shutil.which("flwr-clientapp")
    if real is None:
        return None
    sock = work / "zygote.sock"
    zygote = subprocess.Popen([sys.executable, "-m", "server.clientapp_zygote", str(sock),
                               "--parent-pid", str(os.getpid())])
    shim_dir = work / "bin"
    write_shim(shim_dir)
    os.environ.update({"CANCELFL_ZYGOTE": str(sock), "CANCELFL_REAL_CLIENTAPP": real,
                       "PATH": f"{shim_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    return zygote


def main(argv: list[str] | None = None) -> None:
    """Run Flower's SuperNode with the changes above; arguments as ``flower-supernode``."""
    interval = poll_interval()
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.05")
    work = Path(tempfile.mkdtemp(prefix="cancelfl-supernode-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    if os.environ.get("CANCELFL_WARM_CLIENTAPP", "1") != "0":
        zygote = start_warm_clientapp(work)
        if zygote is not None:
            atexit.register(zygote.terminate)
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli.flower_supernode import flower_supernode

    loop.time = _PollClock(interval)  # the module's idle and reply waits (Flower 1.41: 3 s and 0.5 s)
    sys.argv = ["flower-supernode", *(sys.argv[1:] if argv is None else argv)]
    flower_supernode()


if __name__ == "__main__":
    main()
