"""The round loop's grid: counts bytes per node and phase time, pulls deployment replies quickly, injects faults.

In deployment the ServerApp also shortens Flower's object transfers (``server.flower_tuning.tune_serverapp``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from logging import WARNING

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid

from protocols.trace import trace, tracing
from protocols.wire.ddpsa import SHARE_BYTES
from strategies.run.faults import fault_drops
from strategies.validation import payload_bytes

__all__ = ["OFF_GRID_BYTES", "MeteredGrid"]

#: Train-reply figure of the uplink bytes a client sent past the grid (DDP-SA's shares to its intermediate servers,
#: :class:`protocols.wire.ddpsa.ShareReceipt`); recorded per round as ``client_off_grid_bytes``.
OFF_GRID_BYTES = SHARE_BYTES


class MeteredGrid(Grid):
    """Wraps a Grid and counts payload bytes per node in both directions; injects ``fault-drop-rate`` dropouts.

    ``fault_rate`` > 0 (a TESTING AID, :mod:`strategies.run.faults`): each round's train messages to the chosen
    nodes are counted as sent but never delivered; :attr:`fault_dropped` records them per round.
    """

    def __init__(self, inner: Grid, *, fault_rate: float = 0.0, seed: int = 0) -> None:
        self.inner = inner
        self.fault_rate, self.seed = float(fault_rate), int(seed)
        #: round -> nodes whose train message was withheld (fault injection).
        self.fault_dropped: dict[int, set[int]] = {}
        self.sent: dict[int, int] = defaultdict(int)
        self.received: dict[int, int] = defaultdict(int)
        self.phase_times: dict[str, float] = defaultdict(float)
        #: Flower's deployment grid: replies are pulled here (:meth:`_poll`).
        self.deployed = _polls_slowly(inner)

    def reset(self) -> None:
        """Start counting a new round."""
        self.sent.clear()
        self.received.clear()
        self.phase_times.clear()

    # Delegation of the Grid API
    def set_run(self, run):  # noqa: D102
        self.inner.set_run(run)

    @property
    def run(self):  # noqa: D102
        return self.inner.run

    def create_message(self, *args, **kwargs):  # noqa: D102
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.inner.get_node_ids()

    def push_messages(self, messages):  # noqa: D102
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids):  # noqa: D102
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Send, receive and count bytes; phase time is accumulated by message type."""
        messages = list(messages)
        if not messages:
            return []
        for m in messages:
            self.sent[m.metadata.dst_node_id] += payload_bytes(m.content)
        if self.fault_rate > 0:
            rnd, drop = fault_drops(messages, self.fault_rate, self.seed, len(self.fault_dropped) + 1)
            if drop:
                self.fault_dropped[rnd] = drop
                messages = [m for m in messages if m.metadata.dst_node_id not in drop]
        t0 = time.perf_counter()
        replies = (self._poll(messages, timeout) if self.deployed
                   else list(self.inner.send_and_receive(messages, timeout=timeout)))
        self.phase_times[messages[0].metadata.message_type] += time.perf_counter() - t0
        for r in replies:
            if not r.has_error():
                self.received[r.metadata.src_node_id] += payload_bytes(r.content)
        return replies

    def _poll(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """Push, then pull the replies every 20-100 ms until all arrived or ``timeout`` (Flower's HttpGrid: 3 s).

        A pull the SuperLink answers with a server error (HTTP 5xx, e.g. under heavy load) is asked again.
        """
        t_push = time.time()
        pending = set(self.inner.push_messages(messages))
        if tracing():
            trace("push", t=t_push, t_end=time.time(), message_type=messages[0].metadata.message_type,
                  message_ids=sorted(pending))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        wait = 0.02
        while pending and (end is None or time.monotonic() < end):
            t_pull = time.time()
            try:
                got = list(self.inner.pull_messages(pending))
            except Exception as err:  # noqa: BLE001 - only a server error is retried, below
                if getattr(getattr(err, "response", None), "status_code", 0) < 500:
                    raise
                log(WARNING, "pulling replies: the SuperLink answered %s; asking again", err.response.status_code)
                got = []
            if got and tracing():
                t_got = time.time()
                for m in got:
                    trace("reply", t_pull=t_pull, t=t_got, reply_to=m.metadata.reply_to_message_id,
                          created_at=m.metadata.created_at, node_id=m.metadata.src_node_id)
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if pending:
                time.sleep(wait if end is None else max(0.0, min(wait, end - time.monotonic())))
                wait = min(wait * 1.5, 0.1)
        return replies


def _polls_slowly(grid: Grid) -> bool:
    """True for Flower's deployment grid (``HttpGrid``), whose ``send_and_receive`` pulls every 3 s."""
    return any(cls.__name__ == "HttpGrid" for cls in type(grid).__mro__)
