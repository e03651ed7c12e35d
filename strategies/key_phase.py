"""Server side of the key-exchange phase shared by every pairwise-noise method (nadp, niss, mpddp).

A pairwise method owns one :class:`KeyPhase` (``self.keys = KeyPhase(cfg)``) and calls :meth:`KeyPhase.run` from
its ``prepare_round`` hook, inside ``configure_train`` (the same in simulation, deployment and in-process):

1. ``query.keys`` (:class:`protocols.wire.keys.KeyRequest`) goes only to sampled clients without a public key
   for the current key epoch (``key-rotation``) and to connected nodes whose roster name the server does not
   know yet (in the first round: every connected node); a client that does not answer, sends a malformed key or
   one not signed by its roster identity is left out of the round (logged); at least two must remain.  The server
   learns the roster from the replies (each carries its node's roster digest; while the server holds none, the
   first :attr:`KeyPhase.ROSTER_ASKS` send the text, and the one most replies vouch for is adopted).
2. The round's sample and graph are the roster's (:func:`protocols.graphs.roster_round_of`: from the
   roster digest and the round number only), restricted to the sampled nodes present with a key
   (:func:`protocols.graphs.present_graph`); a participant with fewer present neighbours than its floor is left
   out (it would refuse).  Each client gets its neighbours' ids, keys, roster names and signatures and the
   participant list with roster names (:meth:`KeyRound.peer_keys`) and derives the pair seeds itself.
3. A participant that fails in the train phase is forgotten (:meth:`KeyPhase.forget_unresponsive`): it is asked
   for a key again at the next key phase.

:func:`probe_residual` evaluates the optional cancellation check.  Design and trade-offs: ``docs/concepts.md``.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from logging import WARNING
from typing import TYPE_CHECKING

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from protocols.config import ConfigError, RunConfig
from protocols.graphs import RosterRound, calibration_size, present_floor, present_graph, roster_round_of
from protocols.identity import IdentityError, Roster, verify_key
from protocols.schedule import roster_participations, roster_releases
from protocols.wire.keys import KeyReply, KeyRequest, PeerKeys, probe_value
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
    #: the Flower run id (signed into every key).
    run_id: int = 0
    #: the round's public sample of roster names and its graph (None only for a hand-made round).
    roster_round: RosterRound | None = None

    def peer_keys(self, node: int, neighbours: Sequence[int] | None = None) -> PeerKeys:
        """What ``node`` needs to derive its pairwise seeds (its neighbours by default), plus the public seeds.

        Carries the neighbours' signed keys and the round's participant list with roster names: the client
        checks the signatures against its roster, the graph against the roster's and binds the participants
        and graph seed into its pair seeds.
        """
        peers = list(self.neighbours[node] if neighbours is None else neighbours)
        signed = [self.signed_by.get(p, ("", b"")) for p in peers]
        return PeerKeys(tuple(peers), tuple(self.public_keys[p] for p in peers), self.key_epoch,
                        self.graph_seed, self.probe_seed, tuple(n for n, _ in signed), tuple(s for _, s in signed),
                        tuple(self.participants), tuple(self.signed_by.get(p, ("", b""))[0] for p in self.participants))


    def roster_degrees(self) -> dict[int, int] | None:
        """Participant -> its neighbours in the roster's graph of the round, present or not (None: no roster round)."""
        rr = self.roster_round
        if rr is None:
            return None
        out: dict[int, int] = {}
        for n in self.participants:
            try:
                out[n] = len(rr.neighbours(self.signed_by[n][0]))
            except KeyError:  # unsigned, or a name the roster's round does not sample: the clients refuse the view
                continue
        return out

    def calibration_size(self, complete: Callable[[int], bool]) -> int:
        """The participant count K to calibrate for, where ``complete(K)`` says the calibration assumes a complete graph.

        Raises RoundFailed when it would while the roster's graph of the round is sparse (too few present).
        """
        try:
            return calibration_size(self.roster_round, len(self.participants), complete)  # the clients' check too
        except ValueError as err:
            raise RoundFailed(f"round {self.round}: {err}") from err


class KeyPhase:
    """The server's key directory (node -> public key of an epoch and roster name) and the per-round key phase."""

    #: the key phase draws the round's sample itself (from the roster): the strategy hands it every usable node.
    samples_roster = True
    #: nodes asked for the roster's text while the server holds none.
    ROSTER_ASKS = 3

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.directory: dict[int, KeyEntry] = {}
        #: the roster the clients trust (learned from their key replies).
        self.roster: Roster | None = None
        #: node -> roster name of every node whose key was accepted (kept when its key is forgotten).
        self.names: dict[int, str] = {}
        #: the Flower run id of the last key phase (signed into every key).
        self.run_id = 0

    def roster_round(self, server_round: int) -> RosterRound:
        """The round's public sample of roster names and its graph (what every client recomputes)."""
        if self.roster is None:
            raise RoundFailed(f"round {server_round}: no roster learned from the clients yet")
        return roster_round_of(self.cfg, self.roster, server_round)

    def releases(self) -> int:
        """Releases the noise is calibrated for: the most rounds the roster's public schedule samples any name in.

        ``num-rounds`` while no roster is known (more noise than the schedule needs, never less).
        """
        return self.cfg.num_rounds if self.roster is None else roster_releases(self.cfg, self.roster)

    def schedule_left(self, first: int, last: int) -> tuple[dict[int, int], int] | None:
        """Rounds ``first..last`` of the public schedule that sample each known node, and the most any name gets.

        None while no roster is known (the schedule is not known yet).
        """
        if self.roster is None:
            return None
        counts = roster_participations(self.cfg, self.roster, first, last)
        return {n: counts.get(name, 0) for n, name in self.names.items()}, max(counts.values(), default=0)

    def schedule_state(self) -> dict | None:
        """The roster (public) and the node names learnt, as JSON types (None before a roster is known)."""
        if self.roster is None:
            return None
        return {"roster": self.roster.to_json(), "names": {str(n): name for n, name in sorted(self.names.items())}}

    def load_schedule(self, state: dict) -> None:
        """Inverse of :meth:`schedule_state`: a resumed run knows its public schedule before its first key phase.

        The clients still check every round's view against the roster they trust.
        """
        self.roster = Roster.from_json(state["roster"])
        self.names = {int(n): str(name) for n, name in state.get("names", {}).items()}

    def run(self, strategy: CancelStrategy, grid: Grid, server_round: int, nodes: list[int]) -> KeyRound:
        """Key the round's public sample among ``nodes`` (the usable connected nodes); build its graph.

        Also sets ``strategy.sampled`` to the participants and reports their mean neighbour count (``neighbours``).
        """
        epoch = self.cfg.key_epoch(server_round)
        run_id = int(grid.run.run_id)
        directory = self.directory
        sample = set(self.roster_round(server_round).sample) if self.roster is not None else set()
        unknown = [n for n in nodes if n not in directory]
        stale = [n for n in nodes if n in directory and directory[n].name in sample and directory[n].epoch != epoch]
        need = sorted(set(unknown) | set(stale))
        for n in stale:
            directory.pop(n, None)  # a stale epoch's key must never be used again
        if need:
            asks = set(need[:self.ROSTER_ASKS]) if self.roster is None else set()
            replies, _errors = strategy.exchange(
                grid, need,
                lambda n: RecordDict({"config": ConfigRecord(KeyRequest(server_round, epoch, n in asks).to_config())}), "keys")
            keys = {}
            for node, msg in sorted(replies.items()):
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
                keys[node] = key
            if self.roster is None:
                self.roster = _adopt_roster(keys.values())
            for node, key in keys.items():
                self._enter(node, key, epoch, run_id, server_round)
        if self.roster is None:
            raise RoundFailed(f"round {server_round}: no client sent the roster it trusts (asked {need[:self.ROSTER_ASKS]})")
        rr = self.roster_round(server_round)
        sample = set(rr.sample)
        present = {n: directory[n].name for n in sorted(nodes) if n in directory
                   and directory[n].epoch == epoch and directory[n].name in sample}
        participants, graph = _above_floor(self.cfg, rr, present)
        strategy.sampled = list(participants)
        dropped = sorted((set(need) & set(nodes)) - set(directory)) + sorted(set(present) - set(participants))
        if len(participants) < 2:
            raise RoundFailed(f"round {server_round}: pairwise noise needs at least 2 clients with valid keys, "
                              f"got {len(participants)} of the {len(rr.sample)} the roster samples (dropped: {dropped})")
        strategy.report(neighbours=sum(len(graph[n]) for n in participants) / len(participants))  # mean degree
        self.run_id = run_id
        return self._key_round(server_round, rr, participants, graph, epoch, run_id, sorted(dropped),
                               sorted(n for n in need if n in participants))

    def peek(self, server_round: int, nodes: Iterable[int]) -> KeyRound | None:
        """Round ``server_round``'s key round over ``nodes`` from the keys held now, without a key phase.

        What :meth:`run` returns for the same nodes if the directory does not change before then (a node
        forgotten or re-keyed meanwhile gives :meth:`run` another round).  None without a roster, when a sampled
        node holds a key of another epoch (it would be re-keyed) or with fewer than two participants.
        """
        if self.roster is None:
            return None
        epoch = self.cfg.key_epoch(server_round)
        rr = self.roster_round(server_round)
        sample = set(rr.sample)
        present = {}
        for n in sorted(nodes):
            entry = self.directory.get(n)
            if entry is None or entry.name not in sample:
                continue
            if entry.epoch != epoch:
                return None
            present[n] = entry.name
        participants, graph = _above_floor(self.cfg, rr, present)
        if len(participants) < 2:
            return None
        return self._key_round(server_round, rr, participants, graph, epoch, self.run_id, [], [])

    def _key_round(self, server_round: int, rr: RosterRound, participants: list[int], graph: dict[int, list[int]], epoch: int,
                   run_id: int, dropped: list[int], keyed: list[int]) -> KeyRound:
        """The key round of ``participants`` (keys, sizes and signatures from the directory; a fresh probe seed)."""
        directory = self.directory
        keys_of = {n: directory[n].public_key for n in participants}
        sizes = {n: directory[n].num_examples for n in participants if directory[n].num_examples is not None}
        signed = {n: (directory[n].name, directory[n].signature) for n in participants}
        return KeyRound(server_round, participants, keys_of, graph, rr.seed, os.urandom(32), dropped, sizes,
                        epoch, keyed, signed, run_id, rr)

    def _enter(self, node: int, key: KeyReply, epoch: int, run_id: int, server_round: int) -> None:
        """Record a key reply whose signature checks against the roster (a newer node id under a name wins)."""
        assert self.roster is not None
        try:
            if key.roster_digest and key.roster_digest != self.roster.digest():
                raise IdentityError("it trusts another roster than the run's")
            verify_key(self.roster, name=key.name, signature=key.signature, run_id=run_id, key_epoch=epoch,
                       node_id=node, x25519_public=key.public_key)
        except IdentityError as err:
            log(WARNING, "round %d: node %s is left out: %s", server_round, node, err)
            return
        for other in [n for n, e in self.directory.items() if e.name == key.name and n != node]:
            log(WARNING, "round %d: node %s now answers as %r; node %s is forgotten", server_round, node, key.name, other)
            self.directory.pop(other)
        self.directory[node] = KeyEntry(key.public_key, epoch, key.num_examples, key.name, key.signature)
        self.names[node] = key.name

    def regraph(self, kr: KeyRound, participants: Iterable[int]) -> KeyRound:
        """``kr`` restricted to ``participants`` (a subset, e.g. after failures): the same roster graph, fewer present."""
        keep = set(participants)
        if not keep <= set(kr.participants):
            raise ValueError("regraph: participants must be a subset of the key round's participants")
        rr = kr.roster_round if kr.roster_round is not None else self.roster_round(kr.round)
        parts, graph = _above_floor(self.cfg, rr, {n: kr.signed_by[n][0] for n in sorted(keep)})
        return replace(kr, participants=parts, neighbours=graph,
                       dropped=sorted(set(kr.dropped) | (set(kr.participants) - set(parts))))

    def forget(self, nodes: Iterable[int]) -> None:
        """Drop ``nodes`` from the directory: they run the key phase again when next sampled."""
        for n in nodes:
            self.directory.pop(int(n), None)

    def forget_unresponsive(self, participants: Iterable[int], replies: Iterable[Message]) -> None:
        """Forget every participant without a good reply (error, no reply, or a reply from elsewhere)."""
        ok = {r.metadata.src_node_id for r in replies if not r.has_error()}
        self.forget(n for n in participants if n not in ok)


def _adopt_roster(replies: Iterable[KeyReply]) -> Roster | None:
    """The roster text whose digest most replies carry (None if no reply sent a matching text)."""
    replies = list(replies)
    votes = Counter(r.roster_digest for r in replies if r.roster_digest)
    texts = {}
    for r in replies:
        if r.roster:
            try:
                roster = Roster.from_json(r.roster)
            except IdentityError as err:
                log(WARNING, "a client sent a malformed roster (%s)", err)
                continue
            texts.setdefault(roster.digest(), roster)
    for digest, _count in sorted(votes.items(), key=lambda kv: (-kv[1], kv[0])):
        if digest in texts:
            if len(votes) > 1:
                log(WARNING, "the clients trust %d different rosters; the run uses the one %d of %d replies carry",
                    len(votes), votes[digest], sum(votes.values()))
            return texts[digest]
    return None


def _above_floor(cfg: RunConfig, rr: RosterRound, present: dict[int, str]) -> tuple[list[int], dict[int, list[int]]]:
    """Participants and present graph after leaving out, repeatedly, every node below its present floor."""
    present = dict(present)
    while True:
        graph = present_graph(rr, present)
        short = [n for n, nb in graph.items()
                 if len(nb) < present_floor(len(rr.neighbours(present[n])), cfg.mask_corruption_rate)]
        if not short:
            return sorted(present), graph
        log(WARNING, "round: nodes %s have fewer present roster neighbours than their floor; left out", short[:10])
        for n in short:
            present.pop(n)


def probe_residual(replies: Iterable[Message]) -> float | None:
    """Relative cancellation residual ``|sum p_i| / sqrt(sum p_i^2)`` of the clients' mask probes (None if none).

    About 1e-16 when the pairwise noise cancelled, O(1) when it did not.
    """
    probes = [v for v in (probe_value(r.content["metrics"]) for r in replies) if v is not None]
    if not probes:
        return None
    scale = math.sqrt(sum(p * p for p in probes))
    return abs(math.fsum(probes)) / scale if scale > 0 else 0.0


def largest_round(cfg: RunConfig) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Sizes and graph of the largest round the public schedule allows, for a method's checks at start.

    ``clients-per-round`` participants of one record each on run-config ``graph`` (an n-out graph: the one of a
    fixed seed; each round's is random): a plan that fails for it (an epsilon, clip or dropout-rate no
    calibration can meet) is refused before round 1 instead of in it.
    """
    from protocols.graphs import round_graph

    k = cfg.clients_per_round
    return dict.fromkeys(range(k), 1), round_graph(cfg.graph, cfg.n_out, list(range(k)), bytes(32))


def unplannable(cfg: RunConfig, err: Exception) -> ConfigError:
    """The ``ConfigError`` for a round plan of :func:`largest_round` that failed with ``err``, naming the keys."""
    return ConfigError(f"method {cfg.method!r} cannot plan a round of {cfg.clients_per_round} clients with "
                       f"epsilon = {cfg.epsilon:g}, delta = {cfg.delta:g}, clip = {cfg.clip:g}, dropout-rate = "
                       f"{cfg.dropout_rate:g}: {type(err).__name__ + ': ' if isinstance(err, ArithmeticError) else ''}"
                       f"{err}")
