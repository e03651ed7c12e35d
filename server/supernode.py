"""``cancelfl-supernode``: Flower's ``flower-supernode`` with its per-message waits taken out.

Same arguments as ``flower-supernode`` (Flower 1.42).  Changes, none to what a message carries:

* a warm ClientApp process (:mod:`server.clientapp_zygote`) forks per message instead of a new
  interpreter importing torch and Flower each time;
* the SuperNode asks the SuperLink for messages every ``CANCELFL_POLL_INTERVAL`` seconds (default 0.2)
  instead of Flower's fixed 3 s, every 0.05 s for 5 s after each reply it sent (a round's next phase comes
  soon), looks for its ClientApp's reply every 20 ms instead of 0.5 s, and moves a message's objects with
  short retries and several requests at once (:func:`server.flower_tuning.tune_supernode`);
* each message's ClientApp reads the node's partition from ``CANCELFL_DATA_CACHE`` (default: a folder of this
  process, removed when it exits; ``off``: none) instead of loading and splitting the whole dataset
  (:mod:`protocols.task.partition_cache`);
* its SuperExec starts a message's ClientApp as soon as the SuperNode creates the task, woken through a socket
  (:mod:`server.superexec_wake`), and otherwise looks for tasks every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds
  (Flower's own setting and default, 1).

A ``--node-config`` holding a near miss of a key cancelfl reads (``max-epsilon-per-rnu``, ``lifetime_epsilon``:
:mod:`protocols.node_config`) stops it before anything starts, naming the key it likely means.
Every ClientApp process it starts runs only a FAB the node config's ``trusted-fab`` lists, when it sets one
(:mod:`server.fab_pin`); ``CANCELFL_TRUSTED_APP=DIR`` pins the FAB of the app in ``DIR``.
Set ``CANCELFL_WARM_CLIENTAPP=0`` to start a fresh ``flwr-clientapp`` per message as Flower does.
``CANCELFL_SUPERNODE_DIR`` names the folder the node's work folder is made in (default: the system's temporary
folder); its warm ClientApp serves ``zygote.sock`` there once it has imported its libraries (:func:`warm_count`).
With ``CANCELFL_TRACE`` set (:mod:`protocols.trace`) the SuperNode appends a ``node_pull`` line per message it
takes from the SuperLink and a ``node_push`` line per reply it sends.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time as _time
from collections.abc import Callable
from pathlib import Path

from server.executables import write_executable
from server.fab_pin import TRUSTED_APP_ENV, pin_own_app
from server.flower_tuning import tune_supernode
from server.superexec_wake import WAKE_ENV, waker
from server.superexec_wake import write_shim as write_superexec_shim

#: Folder the node's work folder is made in (default: the system's temporary folder).
WORK_DIR_ENV = "CANCELFL_SUPERNODE_DIR"
#: The warm ClientApp's socket in the node's work folder; it exists once the preload is done.
ZYGOTE_SOCKET = "zygote.sock"

#: Seconds between the SuperNode's requests to the SuperLink (run-time: ``CANCELFL_POLL_INTERVAL``).
DEFAULT_POLL_INTERVAL = 0.2


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


#: The ``flwr-clientapp`` that checks the node's FAB pin first (:func:`server.fab_pin.main`).
PINNED_CLIENTAPP = "#!{python}\nfrom server.fab_pin import main\nmain()\n"


def pinned_clientapp(folder: Path, python: str = sys.executable) -> Path:
    """Write ``folder/flwr-clientapp-pinned``: Flower's ``flwr-clientapp`` with :mod:`server.fab_pin` applied."""
    return write_executable(folder, "flwr-clientapp-pinned", PINNED_CLIENTAPP.format(python=python))


def start_clientapps(work: Path, *, warm: bool = True) -> subprocess.Popen | None:
    """Put this node's ``flwr-clientapp`` first on ``PATH`` (inherited by the SuperExec); returns the zygote.

    Every ClientApp process then checks the FAB against node config ``trusted-fab`` (:mod:`server.fab_pin`).
    ``warm``: the shim of a warm ClientApp that forks per message (:mod:`server.clientapp_zygote`), falling back
    to the pinned ``flwr-clientapp``; else the pinned one itself.
    """
    from server.clientapp_zygote import write_shim

    bin_dir = work / "bin"
    pinned = pinned_clientapp(bin_dir)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    if not warm:
        pinned.rename(bin_dir / "flwr-clientapp")
        return None
    sock = work / ZYGOTE_SOCKET
    zygote = subprocess.Popen([sys.executable, "-m", "server.clientapp_zygote", str(sock),
                               "--parent-pid", str(os.getpid())])
    write_shim(bin_dir)
    os.environ.update({"CANCELFL_ZYGOTE": str(sock), "CANCELFL_REAL_CLIENTAPP": str(pinned)})
    return zygote


def warm_count(folder: Path) -> int:
    """How many SuperNodes whose work folders are in ``folder`` (``CANCELFL_SUPERNODE_DIR``) serve a warm ClientApp."""
    return sum(1 for _ in folder.glob(f"*/{ZYGOTE_SOCKET}"))


def _waking(loop, wake: Callable[[], None]) -> None:
    """Wrap the SuperNode loop's pull step so that every task it creates wakes the SuperExec (``wake``)."""
    pull_and_store = loop._pull_and_store_message
    wrapped: list = []  # the node states whose create_task wakes already (kept: no id is reused)

    def pull_and_store_message(**kw):
        state = kw["state"]
        if not any(state is seen for seen in wrapped):
            create_task = state.create_task

            def create_and_wake(*args, **kwargs):
                task_id = create_task(*args, **kwargs)
                if task_id is not None:
                    wake()
                return task_id
            state.create_task = create_and_wake
            wrapped.append(state)
        return pull_and_store(**kw)

    loop._pull_and_store_message = pull_and_store_message


def _traced(loop) -> None:
    """Wrap the SuperNode loop's pull and push steps to trace each message (``protocols.trace``)."""
    from protocols.trace import trace

    pull_and_store, push = loop._pull_and_store_message, loop._push_messages

    def pull_and_store_message(**kw):
        got: dict = {}
        receive = kw["receive"]

        def traced_receive():
            recv = receive()
            if recv is not None:
                got.update(message_id=recv[0].metadata.message_id, t_received=_time.time())
            return recv
        t = _time.time()
        out = pull_and_store(**{**kw, "receive": traced_receive})
        if got:
            trace("node_pull", t=t, t_end=_time.time(), **got)
        return out

    def push_messages(**kw):
        sent: dict = {}
        send = kw["send"]

        def traced_send(message, *args):
            sent.update(reply_to=message.metadata.reply_to_message_id, t_send=_time.time())
            return send(message, *args)
        t = _time.time()
        out = push(**{**kw, "send": traced_send})
        trace("node_push", t=t, t_end=_time.time(), **sent)
        return out

    loop._pull_and_store_message, loop._push_messages = pull_and_store_message, push_messages


def check_node_config_arg(argv: list[str]) -> None:
    """Refuse a ``--node-config`` in ``argv`` holding a near miss of a key cancelfl reads (SystemExit naming both).

    The arguments are read with ``flower-supernode``'s own parser and node-config syntax; a malformed one is left to
    Flower to report.
    """
    from flwr.common.config import parse_config_args
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    from protocols.node_config import check_node_config, trusted_fabs

    raw = _parse_args_run_supernode().parse_known_args(argv)[0].node_config
    try:
        node_config = parse_config_args([raw]) if raw else {}
    except Exception:  # noqa: BLE001 - Flower's own parse reports it, as flower-supernode does
        return
    try:
        check_node_config(node_config)
        trusted_fabs(node_config)
    except ValueError as err:  # NodeConfigError, or a malformed 'trusted-fab'
        raise SystemExit(f"cancelfl-supernode: {err}") from None


def main(argv: list[str] | None = None) -> None:
    """Run Flower's SuperNode with the changes above; arguments as ``flower-supernode``."""
    args = sys.argv[1:] if argv is None else argv
    if own := os.environ.get(TRUSTED_APP_ENV):
        try:
            args, digest = pin_own_app(args, Path(own))
        except (ValueError, OSError) as err:
            raise SystemExit(f"cancelfl-supernode: {TRUSTED_APP_ENV}={own}: {err}") from None
        print(f"cancelfl-supernode: runs only the app {digest} ({TRUSTED_APP_ENV}={own})", flush=True)
    check_node_config_arg(args)
    interval = poll_interval()
    work = Path(tempfile.mkdtemp(prefix="cancelfl-supernode-", dir=os.environ.get(WORK_DIR_ENV) or None))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    wake_path = work / "superexec.wake"
    os.environ[WAKE_ENV] = str(wake_path)
    # The node's partition, kept for the next message's process (protocols.task.partition_cache).
    os.environ.setdefault("CANCELFL_DATA_CACHE", str(work / "data-cache"))
    zygote = start_clientapps(work, warm=os.environ.get("CANCELFL_WARM_CLIENTAPP", "1") != "0")
    if zygote is not None:
        atexit.register(zygote.terminate)
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli.flower_supernode import flower_supernode

    write_superexec_shim(work / "bin")  # first on PATH (start_clientapps): the SuperExec Flower starts is woken
    _waking(loop, waker(wake_path))
    if os.environ.get("CANCELFL_TRACE"):
        _traced(loop)
    tune_supernode(interval)
    sys.argv = ["flower-supernode", *args]
    flower_supernode()


if __name__ == "__main__":
    main()
