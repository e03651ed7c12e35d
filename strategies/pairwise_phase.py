"""Server side of the key-exchange phase shared by every pairwise-noise method (nadp, niss, mpddp).

Round structure (all inside ``configure_train``, through the Grid it receives,
so it runs the same in simulation, deployment and in-process):

1. ``query.keys`` -- only for sampled clients the server holds no public key of
   the current *key epoch* (run-config ``key-rotation``: rounds per key pair;
   0 = one pair per node for the whole run, 1 = a fresh pair every round).
   Such a client makes an X25519 key pair for the epoch (private half kept in its
   ``Context.state``) and returns the public half.  A client that does not answer
   or sends a malformed key is left out of the round (logged); at least two must
   remain.  With session keys (the default) the phase runs in the first round and
   then only for newly sampled or re-keyed clients: in deployment every message
   phase costs a round trip per client, and X25519 with every peer is the
   dominant cryptographic cost; clients also cache their shared secrets.
2. The server builds the neighbour graph over the clients left (complete, or a
   random n-out graph from a fresh public ``graph-seed``) and sends each client
   its neighbours' ids and public keys with the train message.  Clients derive
   the round's pairwise seeds themselves with HKDF over (purpose, round, pair,
   run id), so seeds are fresh every round even under a long-lived key pair; the
   server never learns them.  Trade-off of a long-lived pair: whoever steals a
   client's private key can recompute that client's pair seeds of every round of
   the epoch (``key-rotation = 1`` restores per-round forward secrecy at the
   cost of one extra phase per round).
3. A participant that fails or does not reply in the train phase is forgotten
   (:func:`forget_keys`): its next selection re-runs the key phase for it, so a
   client that lost its state (restarted SuperNode) recovers by itself.

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import WARNING

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from protocols.graphs import complete_graph, n_out_graph
from protocols.keyagreement import KEY_BYTES
from strategies.base import CancelStrategy, RoundFailed


@dataclass(frozen=True)
class KeyEntry:
    """What the server knows about one client's key pair."""

    public_key: bytes
    epoch: int
    num_examples: int | None


def key_directory(strategy: CancelStrategy) -> dict[int, KeyEntry]:
    """The strategy's node -> :class:`KeyEntry` map (created on first use)."""
    directory = getattr(strategy, "_key_directory", None)
    if directory is None:
        directory = {}
        strategy._key_directory = directory
    return directory


def forget_keys(strategy: CancelStrategy, nodes: Iterable[int]) -> None:
    """Drop ``nodes`` from the key directory: they run the key phase again when next sampled."""
    directory = key_directory(strategy)
    for n in nodes:
        directory.pop(int(n), None)


def forget_unresponsive(strategy: CancelStrategy, participants: Iterable[int], replies: Iterable[Message]) -> None:
    """Forget every participant without a good train reply (error, no reply, or a reply from elsewhere)."""
    ok = {r.metadata.src_node_id for r in replies if not r.has_error()}
    forget_keys(strategy, [n for n in participants if n not in ok])


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
    #: key epoch of the round (see ``key-rotation``) and the nodes that ran the key phase this round.
    key_epoch: int = 0
    keyed: list[int] = field(default_factory=list)

    def peer_config(self, node: int) -> ConfigRecord:
        """What ``node`` needs to derive its pairwise seeds, plus the probe seed."""
        peers = self.neighbours[node]
        return ConfigRecord({
            "peer-ids": [str(p) for p in peers],
            "peer-keys": [self.public_keys[p] for p in peers],
            "key-epoch": self.key_epoch,
            "graph-seed": self.graph_seed,
            "probe-seed": self.probe_seed,
        })


def run_key_phase(strategy: CancelStrategy, grid: Grid, server_round: int, nodes: list[int]) -> KeyRound:
    """Make sure every node in ``nodes`` has a public key of this round's epoch; build the neighbour graph."""
    cfg = strategy.cfg
    epoch = cfg.key_epoch(server_round)
    directory = key_directory(strategy)
    need = [n for n in nodes if n not in directory or directory[n].epoch != epoch]
    for n in need:
        directory.pop(n, None)  # a stale epoch's key must never be used again
    if need:
        replies, _errors = strategy.exchange(
            grid, need,
            lambda _n: RecordDict({"config": ConfigRecord({"round": server_round, "key-epoch": epoch})}), "keys")
        for node, reply in replies.items():
            rec = reply.content["config"] if "config" in reply.content else {}
            pk = rec.get("public-key")
            if isinstance(pk, bytes) and len(pk) == KEY_BYTES and any(pk):
                n = rec.get("num-examples")
                valid_n = isinstance(n, int) and not isinstance(n, bool) and n > 0
                directory[node] = KeyEntry(pk, epoch, n if valid_n else None)
            else:
                log(WARNING, "round %d: node %s sent a malformed public key; it is left out", server_round, node)
    participants = sorted(n for n in nodes if n in directory)
    keys = {n: directory[n].public_key for n in participants}
    sizes = {n: directory[n].num_examples for n in participants if directory[n].num_examples is not None}
    dropped = sorted(set(nodes) - set(participants))
    if len(participants) < 2:
        raise RoundFailed(f"round {server_round}: pairwise noise needs at least 2 clients with valid keys, "
                          f"got {len(participants)} (dropped: {dropped})")
    graph_seed = os.urandom(32)
    if cfg.graph == "n-out" and cfg.n_out < len(participants) - 1:
        neighbours = n_out_graph(participants, cfg.n_out, graph_seed)
    else:
        neighbours = complete_graph(participants)
    return KeyRound(server_round, participants, keys, neighbours, graph_seed, os.urandom(32), dropped, sizes,
                    epoch, sorted(n for n in need if n in directory))


def probe_residual(replies: list[Message]) -> float | None:
    """Relative cancellation residual from the clients' ``mask-probe`` metrics (None if not reported)."""
    probes = [float(r.content["metrics"]["mask-probe"]) for r in replies if "mask-probe" in r.content["metrics"]]
    if not probes:
        return None
    scale = math.sqrt(sum(p * p for p in probes))
    return abs(math.fsum(probes)) / scale if scale > 0 else 0.0
