"""The federation check: is the federation a run was submitted to the one its run config describes.

Plain ``flwr run .`` submits to Flower's default local federation: a simulation with 2
SuperNodes, whose node configs say ``num-partitions = 2``.  The run config's ``num-clients``
(default 10) would then wait for nodes that never come, and each node would train on half the
data while the server accounts for a tenth.  :func:`check_federation` asks the connected nodes
before the first round -- in Flower's simulation by counting its SuperNodes, in deployment by asking
the connected nodes (``query.federation``, :mod:`protocols.wire.federation`) -- and stops the run
within seconds, naming both fixes: more SuperNodes, or fewer clients.

When as many nodes as ``num-clients`` are connected from the start (``cancelfl run``,
``cancelfl deploy``, a matching federation), no message is sent.
"""

from __future__ import annotations

import time
from logging import ERROR

from flwr.app import Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.superlink.grid import InMemoryGrid

from protocols.config import ConfigError, RunConfig
from protocols.wire.federation import ACTION, FederationInfo

#: Nodes asked (their node configs should agree; a few suffice).
NODES_ASKED = 3


class FederationMismatch(ConfigError):
    """The nodes were started for another number of clients than the run's ``num-clients``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # Logged at once: Flower's simulation re-raises a ServerApp error only after its Ray start-up ends.
        log(ERROR, "cancelfl: %s", message)


def fix_message(num_partitions: int, num_clients: int) -> str:
    """What is wrong and the two commands that fix it."""
    return (f"the federation's SuperNodes were started for {num_partitions} partitions (their node config says "
            f"num-partitions={num_partitions}), but run-config num-clients={num_clients}. Fix: run as many "
            f"SuperNodes as clients -- with Flower's local simulation: "
            f"flwr run . --stream --federation-config 'num-supernodes={num_clients}' -- or use the SuperNodes "
            f"you have: flwr run . --stream --run-config 'num-clients={num_partitions}'")


def check_federation(grid: Grid, cfg: RunConfig) -> list[FederationInfo]:
    """Raise :class:`FederationMismatch` (with the fix) when the nodes' ``num-partitions`` is not ``num-clients``.

    Waits up to run-config ``node-timeout`` s for a first node; returns what the asked nodes said
    (empty when all ``num-clients`` nodes were connected at once, and none was asked).
    """
    deadline = time.time() + cfg.node_timeout
    nodes = sorted(grid.get_node_ids())
    while not nodes and time.time() < deadline:
        time.sleep(0.2)
        nodes = sorted(grid.get_node_ids())
    if isinstance(grid, InMemoryGrid):
        # Flower's simulation registers all its SuperNodes at once, right after the ServerApp starts: the
        # count is the federation (its node configs say num-partitions = count); no message needed.
        time.sleep(1.0)
        nodes = sorted(grid.get_node_ids())
        if nodes and len(nodes) != cfg.num_clients:
            raise FederationMismatch(fix_message(len(nodes), cfg.num_clients))
        return []
    if not nodes or len(nodes) == cfg.num_clients:
        return []  # no node (the round's own wait reports it) or the expected federation
    asked = [Message(RecordDict(), n, f"query.{ACTION}") for n in nodes[:NODES_ASKED]]
    infos = []
    for reply in grid.send_and_receive(asked, timeout=min(cfg.round_timeout, 120.0)):
        if not reply.has_error():
            infos.append(FederationInfo.from_content(reply.content))
    sizes = sorted({i.num_partitions for i in infos})
    wrong = [s for s in sizes if s != cfg.num_clients]
    if wrong:
        raise FederationMismatch(fix_message(wrong[0], cfg.num_clients))
    return infos
