"""Server side of the key-exchange phase shared by every pairwise-noise method (nadp, niss, mpddp).

A pairwise method owns one :class:`KeyPhase` (``self.keys = KeyPhase(cfg)``) and calls :meth:`KeyPhase.run` from
its ``prepare_round`` hook, inside ``configure_train`` (the same in simulation, deployment and in-process):

1. ``query.keys`` (:class:`client.messages.keys.KeyRequest`) goes only to sampled clients without a public key
   for the current key epoch (``key-rotation``); a client that does not answer or sends a malformed key is left
   out of the round (logged); at least two must remain.
2. The neighbour graph over the rest comes from the public view (:func:`protocols.identity.view_graph_seed`, not
   chosen by the server); each client gets its neighbours' ids, keys, roster names and signatures and the
   participant list (:meth:`KeyRound.peer_keys`) and derives the pair seeds itself.
3. A participant that fails in the train phase is forgotten (:meth:`KeyPhase.forget_unresponsive`): its next
   selection re-runs the key phase for it.

:func:`probe_residual` evaluates the optional cancellation check.  Design and trade-offs: ``docs/concepts.md``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from logging import WARNING
from typing import TYPE_CHECKING

from flwr.app import Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from client.messages.keys import KeyReply, KeyRequest, PeerKeys, probe_value
from protocols.config import RunConfig
from protocols.graphs import round_graph
from protocols.identity import view_graph_seed
from strategies.base import RoundFailed

if TYPE_CHECKING:
    from strategies.base import CancelStrategy


@dataclass(frozen=True)
class KeyEntry:
    """What the server knows about one client's key pair."""

    public_key: bytes
    epoch: int
    num_examples: int | None
    #: roster name and Ed25519 signature the client sent with the key (relayed; every peer verifies them).
    name: str = ""
    signature: bytes = b""


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
    #: node -> (roster name, signature) sent with its key (relayed to its peers, who verify them).
    signed_by: dict[int, tuple[str, bytes]] = field(default_factory=dict)
    #: the Flower run id (part of the graph seed, :func:`protocols.identity.view_graph_seed`).
    run_id: int = 0

    def peer_keys(self, node: int, neighbours: Sequence[int] | None = None) -> PeerKeys:
        """What ``node`` needs to derive its pairwise seeds (its neighbours by default), plus the public seeds.

        Carries the neighbours' signed keys and the round's participant list: the client checks the
        signatures against its roster and binds the participants and graph seed into its pair seeds.
        """
        peers = list(self.neighbours[node] if neighbours is None else neighbours)
        signed = [self.signed_by.get(p, ("", b"")) for p in peers]
        return PeerKeys(tuple(peers), tuple(self.public_keys[p] for p in peers), self.key_epoch,
                        self.graph_seed, self.probe_seed, tuple(n for n, _ in signed), tuple(s for _, s in signed),
                        tuple(self.participants))


class KeyPhase:
    """The server's key directory (node -> public key of an epoch) and the per-round key phase."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.directory: dict[int, KeyEntry] = {}

    def graph(self, participants: Sequence[int], seed: bytes) -> dict[int, list[int]]:
        """The neighbour graph of ``participants`` under the run's graph rule (run-config ``graph``, ``n-out``)."""
        return round_graph(self.cfg.graph, self.cfg.n_out, participants, seed)

    def view_graph(self, run_id: int, server_round: int, key_epoch: int,
                   participants: Sequence[int]) -> tuple[bytes, dict[int, list[int]]]:
        """(graph seed, graph) the round's view determines: the seed every client recomputes and checks."""
        seed = view_graph_seed(run_id=run_id, round_num=server_round, key_epoch=key_epoch, participants=participants)
        return seed, self.graph(participants, seed)

    def run(self, strategy: CancelStrategy, grid: Grid, server_round: int, nodes: list[int]) -> KeyRound:
        """Make sure every node in ``nodes`` has a public key of this round's epoch; build the neighbour graph."""
        epoch = self.cfg.key_epoch(server_round)
        directory = self.directory
        need = [n for n in nodes if n not in directory or directory[n].epoch != epoch]
        for n in need:
            directory.pop(n, None)  # a stale epoch's key must never be used again
        if need:
            request = KeyRequest(server_round, epoch).to_config()
            replies, _errors = strategy.exchange(grid, need, lambda _n: RecordDict({"config": request}), "keys")
            for node, msg in replies.items():
                try:
                    if "config" not in msg.content:
                        raise ValueError("reply has no config")
                    key = KeyReply.from_config(msg.content["config"])
                    cap = strategy.max_examples
                    if key.num_examples is not None and (key.num_examples < 1 or (cap and key.num_examples > cap)):
                        raise ValueError(f"implausible num-examples {key.num_examples} (largest partition: {cap})")
                except ValueError as err:
                    log(WARNING, "round %d: node %s sent a malformed key reply (%s); it is left out",
                        server_round, node, err)
                    continue
                directory[node] = KeyEntry(key.public_key, epoch, key.num_examples, key.name, key.signature)
        participants = sorted(n for n in nodes if n in directory)
        dropped = sorted(set(nodes) - set(participants))
        if len(participants) < 2:
            raise RoundFailed(f"round {server_round}: pairwise noise needs at least 2 clients with valid keys, "
                              f"got {len(participants)} (dropped: {dropped})")
        keys = {n: directory[n].public_key for n in participants}
        sizes = {n: directory[n].num_examples for n in participants if directory[n].num_examples is not None}
        run_id = int(grid.run.run_id)
        graph_seed, graph = self.view_graph(run_id, server_round, epoch, participants)
        signed = {n: (directory[n].name, directory[n].signature) for n in participants}
        return KeyRound(server_round, participants, keys, graph, graph_seed, os.urandom(32), dropped, sizes, epoch,
                        sorted(n for n in need if n in directory), signed, run_id)

    def regraph(self, kr: KeyRound, participants: Iterable[int]) -> KeyRound:
        """``kr`` restricted to ``participants`` (a subset) with a fresh graph over them (e.g. after dropouts)."""
        keep = sorted(participants)
        if not set(keep) <= set(kr.participants):
            raise ValueError("regraph: participants must be a subset of the key round's participants")
        graph_seed, graph = self.view_graph(kr.run_id, kr.round, kr.key_epoch, keep)
        return replace(kr, participants=keep, neighbours=graph, graph_seed=graph_seed,
                       dropped=sorted(set(kr.dropped) | (set(kr.participants) - set(keep))))

    def forget(self, nodes: Iterable[int]) -> None:
        """Drop ``nodes`` from the directory: they run the key phase again when next sampled."""
        for n in nodes:
            self.directory.pop(int(n), None)

    def forget_unresponsive(self, participants: Iterable[int], replies: Iterable[Message]) -> None:
        """Forget every participant without a good reply (error, no reply, or a reply from elsewhere)."""
        ok = {r.metadata.src_node_id for r in replies if not r.has_error()}
        self.forget(n for n in participants if n not in ok)


def probe_residual(replies: Iterable[Message]) -> float | None:
    """Relative cancellation residual ``|sum p_i| / sqrt(sum p_i^2)`` of the clients' mask probes (None if none).

    About 1e-16 when the pairwise noise cancelled, O(1) when it did not.
    """
    probes = [v for v in (probe_value(r.content["metrics"]) for r in replies) if v is not None]
    if not probes:
        return None
    scale = math.sqrt(sum(p * p for p in probes))
    return abs(math.fsum(probes)) / scale if scale > 0 else 0.0
