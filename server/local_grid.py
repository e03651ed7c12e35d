"""An in-process Flower ``Grid``: runs a ``ClientApp`` directly, without a SuperLink.

Used by the fast ``--engine inprocess`` runner, the benchmarks and the tests.
It keeps one ``Context`` per node (so ``Context.state`` persists across
messages exactly as on a SuperNode), gives each node the same ``node_config``
(``partition-id``/``num-partitions``) as Flower's simulation, turns a ClientApp
exception into an error reply (as Flower does), and can make chosen nodes drop
out (no reply) to test dropout handling (run-config ``fault-drop-rate`` is the round loop's, every engine:
:mod:`strategies.run.faults`).
"""

from __future__ import annotations

import secrets
import tempfile
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from server.keys import make_identities, node_name

SERVER_NODE_ID = 1  # the SuperLink node id Flower uses for the ServerApp


class LocalGrid(Grid):
    """Grid whose nodes are in-process ClientApp instances."""

    #: Node ``i`` gets id ``1_000_003 * (i + node_id_offset)`` (another offset renumbers the nodes, as Flower does).
    node_id_offset = 7

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: dict, *, run_id: int | None = None,
                 node_config: dict | None = None, identities: bool = True) -> None:
        """Nodes ``0..num_nodes-1`` with in-process contexts.

        ``run_id`` None = a fresh random one (as a SuperLink gives each run); ``node_config`` is added to every
        node's (e.g. a policy of :mod:`protocols.floor`); without a ``ledger-dir`` the nodes keep their privacy
        ledgers (:mod:`client.ledger`) in a temporary folder of this grid.  With ``identities`` (and no
        ``identity-key`` in ``node_config``) every node gets an Ed25519 identity file and the roster, made as
        ``cancelfl keys`` does in a temporary folder of this grid (:mod:`client.identity`), its key derived from
        the run seed (:func:`server.keys.generate`); without, the nodes fall back to the derived simulation
        identities.
        """
        if run_id is None:
            run_id = secrets.randbits(63) or 1
        extra = dict(node_config or {})
        if "ledger-dir" not in extra:
            self._ledger_tmp = tempfile.TemporaryDirectory(prefix="cancelfl-ledger-")
            extra["ledger-dir"] = self._ledger_tmp.name
        self.client_app = client_app
        self.run_config = dict(run_config)
        self._run = Run.create_empty(run_id)
        self._run.override_config = dict(run_config)
        # Messages take their source identity from the process-wide TaskIdentity,
        # which a SuperLink-spawned ServerApp process has set; set it here too.
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SERVER_NODE_ID
        TaskIdentity.task_id = 0
        # Node ids are arbitrary 64-bit values in Flower; use large distinct ones.
        self.node_ids = [1_000_003 * (i + self.node_id_offset) for i in range(num_nodes)]
        self.contexts = {
            nid: Context(run_id=run_id, node_id=nid, state=RecordDict(), run_config=dict(run_config),
                         node_config={"partition-id": i, "num-partitions": num_nodes, **extra})
            for i, nid in enumerate(self.node_ids)
        }
        if identities and "identity-key" not in extra:
            self._identity_tmp = tempfile.TemporaryDirectory(prefix="cancelfl-identities-")
            # Seeded by the run seed: a run with the same seed samples the same clients (see server.keys.generate).
            keys, roster = make_identities(Path(self._identity_tmp.name), [node_name(i) for i in range(num_nodes)],
                                           seed=int(run_config.get("seed", 0) or 0))
            for i, nid in enumerate(self.node_ids):
                self.contexts[nid].node_config.update({"identity-key": str(keys[node_name(i)]), "roster": str(roster)})
        #: Nodes that silently drop every message (set by tests to simulate dropout).
        self.offline: set[int] = set()
        #: Wall time spent inside each node's ClientApp (seconds), for overhead figures.
        self.client_time: dict[int, float] = dict.fromkeys(self.node_ids, 0.0)

    # --- Grid API -------------------------------------------------------------
    def set_run(self, run: Run) -> None:  # noqa: D102 - Grid API
        self._run = run

    @property
    def run(self) -> Run:  # noqa: D102 - Grid API
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # noqa: D102 - deprecated Grid API
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102 - Grid API
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102 - Grid API
        raise NotImplementedError("LocalGrid delivers synchronously: use send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102 - Grid API
        raise NotImplementedError("LocalGrid delivers synchronously: use send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Deliver each message to its node's ClientApp, one after another, and collect every reply (``timeout``: unused)."""
        messages = list(messages)
        replies = []
        for msg in messages:
            dst = msg.metadata.dst_node_id
            if dst not in self.contexts:
                raise ValueError(f"message for unknown node {dst}")
            if dst in self.offline:
                continue
            msg.metadata.__dict__["_message_id"] = uuid4().hex
            msg.metadata.__dict__["_run_id"] = self._run.run_id
            t0 = time.perf_counter()
            try:
                reply = self.client_app(msg, self.contexts[dst])
            except Exception as exc:  # noqa: BLE001 - mirrors Flower: a failing ClientApp yields an error reply
                reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
                reply = Message(Error(code=1, reason=reason), reply_to=msg)
            self.client_time[dst] += time.perf_counter() - t0
            replies.append(reply)
        return replies
