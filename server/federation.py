"""The federation check: is the federation a run was submitted to the one its run config describes.

Plain ``flwr run .`` submits to Flower's default local federation: a simulation with 2
SuperNodes, whose node configs say ``num-partitions = 2``.  The run config's ``num-clients``
(default 10) would then wait for nodes that never come, and each node would train on half the
data while the server accounts for a tenth.  :func:`fit_federation` asks the connected nodes
before the first round -- in Flower's simulation by counting its SuperNodes, in deployment by asking
the connected nodes (``query.federation``, :mod:`protocols.wire.federation`).  With ``num-clients``
left "auto" the run takes the federation's size (:mod:`protocols.federation`; each client does the same
from its node config); with a ``num-clients`` the user set, it stops within seconds, naming both fixes
in one line: more SuperNodes, or fewer clients.

When as many nodes as ``num-clients`` are connected from the start (``cancelfl run``,
``cancelfl deploy``, a matching federation), no message is sent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import ERROR, INFO
from typing import Any

from flwr.app import Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.superlink.grid import InMemoryGrid

from protocols.config import ConfigError, RunConfig
from protocols.federation import fitted, num_clients_left_auto
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


def fit_federation(grid: Grid, cfg: RunConfig, run_config: Mapping[str, Any]) -> RunConfig:
    """The run config to run on the grid's federation: ``cfg``, or ``cfg`` fitted to the federation's size.

    Args:
        grid: the run's grid (Flower's simulation grid or a deployment's).
        cfg: the run config the ServerApp resolved (its ``out-dir`` is kept).
        run_config: the run's raw run config (tells whether ``num-clients`` was left "auto").

    Returns:
        ``cfg`` when the nodes were started for ``cfg.num_clients`` (or none came within ``node-timeout``);
        else, with ``num-clients`` left "auto", the run config with ``num-clients`` = the federation's size.

    Raises:
        FederationMismatch: ``num-clients`` was set and the nodes were started for another number, the
            asked nodes disagree on ``num-partitions``, or the method cannot run on the federation's size;
            the one-line message names the fix.
    """
    infos: list[FederationInfo] = []
    size = federation_size(grid, cfg, infos)
    if size is None:
        return cfg
    if not num_clients_left_auto(run_config):
        raise FederationMismatch(fix_message(size, cfg.num_clients))
    sizes = sorted({i.num_partitions for i in infos})
    if len(sizes) > 1:
        raise FederationMismatch(f"the nodes' node configs disagree: num-partitions {sizes}. Fix: start every "
                                 f"SuperNode with the same --node-config 'num-partitions=N', or set run-config "
                                 f"num-clients")
    try:
        out = fitted(run_config, size, **{"out-dir": cfg.out_dir})
    except ConfigError as err:
        raise FederationMismatch(
            f"run-config num-clients \"auto\" takes the federation's {size} nodes, but {err}. Fix: run as many "
            f"SuperNodes as the method's {cfg.num_clients} clients -- with Flower's local simulation: flwr run . "
            f"--stream --federation-config 'num-supernodes={cfg.num_clients}'") from err
    log(INFO, "cancelfl: num-clients = %d, the federation's nodes (run-config num-clients is \"auto\"; "
        "--federation-config 'num-supernodes=N' for another size)", size)
    return out


def check_federation(grid: Grid, cfg: RunConfig) -> list[FederationInfo]:
    """Raise :class:`FederationMismatch` (with the fix) when the nodes' ``num-partitions`` is not ``num-clients``.

    Waits up to run-config ``node-timeout`` s for a first node; returns what the asked nodes said
    (empty when all ``num-clients`` nodes were connected at once, and none was asked).
    """
    infos: list[FederationInfo] = []
    size = federation_size(grid, cfg, infos)
    if size is not None:
        raise FederationMismatch(fix_message(size, cfg.num_clients))
    return infos


def federation_size(grid: Grid, cfg: RunConfig, infos: list[FederationInfo] | None = None) -> int | None:
    """The number of partitions the nodes were started for when it is not ``cfg.num_clients``, else None.

    Waits up to run-config ``node-timeout`` s for a first node (None if none comes: the round's own wait
    reports it).  In Flower's simulation the count of its SuperNodes is the answer; in deployment up to
    :data:`NODES_ASKED` connected nodes are asked (``query.federation``) unless ``num-clients`` nodes are
    connected; their answers are appended to ``infos``.
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
        return len(nodes) if nodes and len(nodes) != cfg.num_clients else None
    if not nodes or len(nodes) == cfg.num_clients:
        return None  # no node (the round's own wait reports it) or the expected federation
    asked = [Message(RecordDict(), n, f"query.{ACTION}") for n in nodes[:NODES_ASKED]]
    answers = [FederationInfo.from_content(reply.content)
               for reply in grid.send_and_receive(asked, timeout=min(cfg.round_timeout, 120.0)) if not reply.has_error()]
    if infos is not None:
        infos.extend(answers)
    wrong = sorted({i.num_partitions for i in answers} - {cfg.num_clients})
    return wrong[0] if wrong else None
