"""Server side of the key-exchange phase shared by every pairwise-noise method (nadp, niss, mpddp).

Round structure (all inside ``configure_train``, through the Grid it receives,
so it runs the same in simulation, deployment and in-process):

1. ``query.keys`` -- each sampled client makes a fresh X25519 key pair for the
   round (private half kept in its ``Context.state``) and returns the public half.
   A client that does not answer or sends a malformed key is left out of the
   round (logged); at least two must remain.
2. The server builds the neighbour graph over the clients left (complete, or a
   random n-out graph from a fresh public ``graph-seed``) and sends each client
   its neighbours' ids and public keys with the train message.  Clients derive
   pairwise seeds themselves; the server never learns them.

Node ids travel as decimal strings: they are unsigned 64-bit values and
ConfigRecord integers are signed.

Cancellation check: with run-config ``cancellation-check = true`` each client
also reports the projection of its pairwise-noise contribution (the part that
must cancel in the aggregate) on a public random direction; the relative
residual ``|sum p_i| / sqrt(sum p_i^2)`` is ~1e-16 when the noise cancelled and
O(1) when it did not.  It reveals one random projection of each client's
pairwise mask, so it is a diagnostic (off by default), not for production.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from logging import WARNING

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from protocols.graphs import complete_graph, n_out_graph
from protocols.keyagreement import KEY_BYTES
from strategies.base import CancelStrategy, RoundFailed


@dataclass
class KeyRound:
    """Outcome of one round's key phase."""

    round: int
    participants: list[int]
    public_keys: dict[int, bytes]
    neighbours: dict[int, list[int]]
    graph_seed: bytes
    probe_seed: bytes
    dropped: list[int] = field(default_factory=list)
    #: ``num-examples`` each participant reported with its key (absent for clients that did not send it).
    num_examples: dict[int, int] = field(default_factory=dict)

    def peer_config(self, node: int) -> ConfigRecord:
        """What ``node`` needs to derive its pairwise seeds, plus the probe seed."""
        peers = self.neighbours[node]
        return ConfigRecord({
            "peer-ids": [str(p) for p in peers],
            "peer-keys": [self.public_keys[p] for p in peers],
            "graph-seed": self.graph_seed,
            "probe-seed": self.probe_seed,
        })


def run_key_phase(strategy: CancelStrategy, grid: Grid, server_round: int, nodes: list[int]) -> KeyRound:
    """Collect fresh public keys from ``nodes`` and build the round's neighbour graph."""
    cfg = strategy.cfg
    replies, _errors = strategy.exchange(
        grid, nodes, lambda _n: RecordDict({"config": ConfigRecord({"round": server_round})}), "keys")
    keys: dict[int, bytes] = {}
    sizes: dict[int, int] = {}
    for node, reply in replies.items():
        rec = reply.content["config"] if "config" in reply.content else {}
        pk = rec.get("public-key")
        if isinstance(pk, bytes) and len(pk) == KEY_BYTES and any(pk):
            keys[node] = pk
            n = rec.get("num-examples")
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                sizes[node] = n
        else:
            log(WARNING, "round %d: node %s sent a malformed public key; it is left out", server_round, node)
    participants = sorted(keys)
    dropped = sorted(set(nodes) - set(participants))
    if len(participants) < 2:
        raise RoundFailed(f"round {server_round}: pairwise noise needs at least 2 clients with valid keys, "
                          f"got {len(participants)} (dropped: {dropped})")
    graph_seed = os.urandom(32)
    if cfg.graph == "n-out" and cfg.n_out < len(participants) - 1:
        neighbours = n_out_graph(participants, cfg.n_out, graph_seed)
    else:
        neighbours = complete_graph(participants)
    return KeyRound(server_round, participants, keys, neighbours, graph_seed, os.urandom(32), dropped, sizes)


def probe_residual(replies: list[Message]) -> float | None:
    """Relative cancellation residual from the clients' ``mask-probe`` metrics (None if not reported)."""
    probes = [float(r.content["metrics"]["mask-probe"]) for r in replies if "mask-probe" in r.content["metrics"]]
    if not probes:
        return None
    scale = math.sqrt(sum(p * p for p in probes))
    return abs(math.fsum(probes)) / scale if scale > 0 else 0.0
