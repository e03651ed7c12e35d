"""Every change cancelfl makes to Flower's own code at run time, in one place, for the Flower releases it was read from.

Flower's deployment runtime moves a message as a tree of objects (the message, its records, arrays and array
chunks: about a dozen for a small model), one HTTP request per object, and waits between polls.  On a loaded
machine each request waits for the SuperLink's turn on a core, so a message hop costs its number of request
rounds times that wait.  The changes below alter no message, no check and no protocol step; they shorten
Flower's waits and run more of a message's object requests at once:

* object transfers (:func:`tune_object_transfers`, every process): a missing object is asked for again after
  :data:`OBJECT_PULL_BACKOFF` (Flower: 1 s doubling to 10 s; a message is listed before its objects arrive, and
  they follow within milliseconds), and up to :data:`OBJECT_CONCURRENCY` objects of a message are pushed or
  pulled at once (Flower: 2, and never more than the machine's cores: requests that mostly wait need no core);
* the SuperNode's reply push (:func:`tune_supernode`): an object push the SuperLink answers with a server error
  (a transient lock of its SQLite state on a loaded machine) is asked again (:func:`retrying_push`; Flower drops
  the reply);
* the SuperNode's loop (:func:`tune_supernode`): its idle wait (Flower: 3 s, a request to the SuperLink each)
  becomes the poll interval, shorter (:class:`PollClock`) within a while after each reply it sent; its waits
  for its ClientApp's reply and the reply's objects (0.5 s, a look into its own memory) become 20 ms;
* the ClientApp (:func:`tune_clientapp`, in each warm child of :mod:`server.clientapp_zygote`): a FAB this
  ``FLWR_HOME`` installed already (same SHA-256) is reused, and the app's bytecode is written next to that
  install even where ``PYTHONDONTWRITEBYTECODE`` is set.

The ServerApp (:mod:`server.app`) calls :func:`tune_serverapp`; a ServerApp of your own that runs these
strategies in deployment may call it too.  A Flower release outside :data:`SUPPORTED` gets none of these
changes (one warning names it) and runs with Flower's own waits.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time as _time
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

#: Flower release series whose code these changes were written against (``major.minor``).
SUPPORTED = ("1.42",)
#: (first, longest) wait in seconds before a process asks again for a message object that is not there yet.  The
#: cap keeps the requests of :data:`OBJECT_CONCURRENCY` waiting pulls few while a large message is still arriving.
OBJECT_PULL_BACKOFF = (0.05, 0.5)
#: Objects of one message pushed or pulled at once, in every process.
OBJECT_CONCURRENCY = 8
#: Tries of one object push the SuperLink answered with a server error (HTTP 5xx: a transient lock of its state),
#: waiting 50 ms, doubling, between them (Flower: one try, and the SuperNode drops the reply).
PUSH_TRIES = 5

#: Seconds between the SuperNode's checks of its own state while it waits for a reply or a reply's objects.
LOCAL_WAIT = 0.02
#: Seconds between the SuperNode's requests to the SuperLink within :data:`BUSY_WINDOW` of its last reply (the
#: next phase of a round follows within the ServerApp's pull interval and its work between phases).
BUSY_POLL = 0.05
#: Seconds after a reply during which the SuperNode polls every :data:`BUSY_POLL`.
BUSY_WINDOW = 5.0

_warned: list[str] = []


def supported() -> bool:
    """True when the installed Flower is a release in :data:`SUPPORTED`; else warns once and returns False."""
    try:
        found = version("flwr")
    except PackageNotFoundError:
        found = "none"
    if ".".join(found.split(".")[:2]) in SUPPORTED:
        return True
    if found not in _warned:
        _warned.append(found)
        warnings.warn(f"cancelfl: Flower {found} is not one of the releases its deployment tuning was written for "
                      f"({', '.join(SUPPORTED)}); Flower's own polling and object transfers apply", stacklevel=2)
    return False


def tune_object_transfers() -> bool:
    """Quick retries of missing objects and :data:`OBJECT_CONCURRENCY` pushes and pulls at once (this process).

    Sets the keyword defaults of Flower's ``pull_objects``, ``pull_and_inflate_object_from_tree``, ``push_objects``
    and ``push_object_contents_from_iterable`` (no Flower caller passes them) and lifts the cap of the worker count
    at the core count.  An object that never comes still fails the pull after Flower's 500 tries.
    Returns whether the change was made (:func:`supported`).
    """
    if not supported():
        return False
    from flwr.supercore.inflatable import inflatable_utils as iu

    first, cap = OBJECT_PULL_BACKOFF
    for fn in (iu.pull_objects, iu.pull_and_inflate_object_from_tree):
        fn.__kwdefaults__.update(initial_backoff=first, backoff_cap=cap, max_concurrent_pulls=OBJECT_CONCURRENCY)
    for fn in (iu.push_objects, iu.push_object_contents_from_iterable):
        fn.__kwdefaults__.update(max_concurrent_pushes=OBJECT_CONCURRENCY)
    iu.get_num_workers = _num_workers
    return True


def retrying_push(push_object, tries: int = PUSH_TRIES, first_wait: float = 0.05):
    """``push_object`` asked again, up to ``tries`` times in all, when the server answers with an HTTP 5xx.

    Pushing an object is idempotent (objects are named by their content's hash); any other error, and the last
    5xx, propagate as before.
    """
    import httpx

    def push(*args, **kwargs):
        wait = first_wait
        for attempt in range(tries):
            try:
                return push_object(*args, **kwargs)
            except httpx.HTTPStatusError as err:
                if err.response.status_code < 500 or attempt == tries - 1:
                    raise
            _time.sleep(wait)
            wait *= 2
    return push


def _num_workers(max_concurrent: int) -> int:
    """Flower's ``get_num_workers`` without the cap at the core count (the workers wait on requests)."""
    return max(1, int(max_concurrent))


def tune_serverapp() -> bool:
    """The ServerApp's changes: object transfers, the replies of one pull taken in parallel.

    Flower's ``HttpGrid.pull_messages`` pulls the objects of the replies that one request lists one reply after
    the other (each a round of object requests and a confirmation); here every reply's pull runs at once, each
    exactly as Flower's (:func:`_pull_messages`).  Returns whether the changes were made.
    """
    if not tune_object_transfers():
        return False
    from flwr.superlink.grid import http_grid

    http_grid.HttpGrid.pull_messages = _pull_messages
    return True


def _pull_messages(self, message_ids):
    """Flower 1.42's ``HttpGrid.pull_messages`` with the listed replies' objects pulled concurrently.

    Same requests, checks and results as Flower's (a reply whose objects cannot be pulled becomes an error
    message), in the order the SuperLink listed them.
    """
    import concurrent.futures

    import httpx
    from flwr.app import Metadata
    from flwr.app.error import Error
    from flwr.app.message import make_message
    from flwr.common.constant import ErrorCode
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest
    from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
    from flwr.supercore.date import now
    from flwr.superlink.grid import http_grid as hg

    run_id = self._run.run_id

    def inflate(msg_proto, msg_tree):
        msg_id = msg_proto.metadata.message_id
        try:
            contents = hg.pull_objects(
                object_ids=[tree.object_id for tree in hg.iterate_object_tree(msg_tree)],
                pull_object_fn=hg.make_pull_object_fn_protobuf(
                    pull_object_protobuf=self._runtime_client.PullObject, node=self.node, run_id=run_id))
        except hg.ObjectPullError as e:
            return make_message(
                metadata=Metadata(run_id=run_id, message_id="", src_node_id=self.node.node_id,
                                  dst_node_id=self.node.node_id, message_type=SYSTEM_MESSAGE_TYPE, group_id="",
                                  ttl=0, reply_to_message_id=msg_proto.metadata.reply_to_message_id,
                                  created_at=now().timestamp()),
                error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE,
                            reason=("Reply message objects are unavailable. The sender may not have completed the "
                                    f"upload before the object-push session expired. {e}")))
        self._runtime_client.ConfirmMessageReceived(
            ConfirmMessageReceivedRequest(node=self.node, run_id=run_id, message_object_id=msg_id))
        message = hg.inflate_object_from_contents(msg_id, contents)
        message.metadata.__dict__["_message_id"] = msg_id
        return message

    try:
        res = self._runtime_client.PullMessages(PullAppMessagesRequest(message_ids=message_ids))
        pairs = list(zip(res.messages_list, res.message_object_trees, strict=True))
        if len(pairs) <= 1:
            return [inflate(*p) for p in pairs]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(pairs)) as pool:
            return list(pool.map(lambda p: inflate(*p), pairs))
    except httpx.HTTPStatusError as e:
        if e.response.status_code == httpx.codes.REQUEST_ENTITY_TOO_LARGE:
            hg.log(hg.ERROR, hg.ERROR_MESSAGE_PULL_MESSAGES_PAYLOAD_TOO_LARGE)
            return []
        raise


class PollClock:
    """Stands in for the ``time`` module inside Flower's SuperNode loop.

    Its idle wait (>= 1 s, Flower 1.42: 3 s, a request to the SuperLink each) becomes ``interval``, or ``busy``
    within ``window`` seconds of the last reply sent (:meth:`replied`); its waits for a reply and a reply's
    objects (0.5-1 s, a look into the SuperNode's own memory) become ``local``.
    """

    def __init__(self, interval: float, local: float = LOCAL_WAIT, busy: float = BUSY_POLL,
                 window: float = BUSY_WINDOW) -> None:
        self.interval, self.local, self.busy, self.window = interval, local, min(busy, interval), window
        self.last_reply = -float("inf")

    def replied(self) -> None:
        """The SuperNode sent a reply: the run's next message is likely to come soon."""
        self.last_reply = _time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Flower's wait of ``seconds``, shortened as the class says."""
        if seconds >= 1.0:
            recent = _time.monotonic() - self.last_reply < self.window
            seconds = min(seconds, self.busy if recent else self.interval)
        elif seconds >= 0.5:
            seconds = min(seconds, self.local)
        _time.sleep(seconds)

    def __getattr__(self, name: str):
        return getattr(_time, name)


def tune_supernode(interval: float) -> PollClock | None:
    """The SuperNode's changes: object transfers and the loop's waits (idle poll ``interval`` seconds).

    Returns the loop's :class:`PollClock` (None where Flower is not supported: nothing changed).
    """
    if not tune_object_transfers():
        return None
    import flwr.supernode.start_client_internal as loop

    loop.time = clock = PollClock(interval)  # the module's idle and reply waits (Flower 1.42: 3 s and 0.5 s)
    push = loop._push_messages

    def push_messages(**kw):
        try:
            return push(**{**kw, "push_object": retrying_push(kw["push_object"])})
        finally:
            clock.replied()
    loop._push_messages = push_messages
    return clock


def tune_clientapp() -> bool:
    """A warm ClientApp child's changes: object transfers, FAB install reuse, the app's bytecode kept.

    Returns whether they were made.
    """
    if not tune_object_transfers():
        return False
    cached_fab_install()
    cached_app_bytecode()
    return True


def cached_fab_install() -> None:
    """Flower's per-message FAB install returns at once for a FAB this ``FLWR_HOME`` holds already.

    Flower extracts the whole FAB and checks every file's hash for every message, then finds the app
    installed.  The first install of a FAB (Flower's own, all checks) leaves a marker named by the SHA-256
    of the FAB's bytes; a later message whose FAB has the same SHA-256 uses that install.
    """
    import flwr.supernode.runtime.run_clientapp as rc
    from flwr.supercore.utils import get_flwr_home

    install = rc.install_from_fab

    def install_from_fab(fab_file, install_dir=None, skip_prompt=False):
        if not isinstance(fab_file, bytes) or install_dir is not None:
            return install(fab_file, install_dir, skip_prompt)
        marker = get_flwr_home() / "apps" / ".cancelfl-installed" / hashlib.sha256(fab_file).hexdigest()
        with contextlib.suppress(OSError):
            done = Path(marker.read_text())
            if (done / "pyproject.toml").is_file():
                return done
        path = install(fab_file, install_dir, skip_prompt)
        with contextlib.suppress(OSError):
            marker.parent.mkdir(parents=True, exist_ok=True)
            tmp = marker.with_name(f"{marker.name}.{os.getpid()}")
            tmp.write_text(str(path))
            os.replace(tmp, marker)
        return path
    rc.install_from_fab = install_from_fab


def cached_app_bytecode() -> None:
    """Loading the ClientApp writes and reuses the bytecode of the FAB's modules.

    With ``PYTHONDONTWRITEBYTECODE`` set (as in the project's Docker image) every message would compile the
    app's modules from source again; while Flower loads the ClientApp this writes their bytecode next to the
    installed FAB (``__pycache__`` under ``FLWR_HOME/apps``), so later messages load it.
    """
    import flwr.supernode.runtime.run_clientapp as rc

    get_loader = rc.get_load_client_app_fn

    def loader(*args, **kwargs):
        load = get_loader(*args, **kwargs)

        def load_app(*a, **k):
            keep, sys.dont_write_bytecode = sys.dont_write_bytecode, False
            try:
                return load(*a, **k)
            finally:
                sys.dont_write_bytecode = keep
        return load_app
    rc.get_load_client_app_fn = loader


__all__ = ["OBJECT_CONCURRENCY", "OBJECT_PULL_BACKOFF", "PUSH_TRIES", "SUPPORTED", "PollClock", "retrying_push",
           "supported", "tune_clientapp", "tune_object_transfers", "tune_serverapp", "tune_supernode"]
