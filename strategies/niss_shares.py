"""NISS's share phase: one sealed share per neighbour, asked for one round ahead where the view allows.

Without asking ahead a NISS round has a ``query.shares`` phase before its train phase.  Asking ahead, the plan
stage of round r also builds round r+1's key round from the keys the server holds
(:meth:`strategies.key_phase.KeyPhase.peek`), and each of round r's train messages carries that round's
:class:`~protocols.wire.niss.ShareRequest` in :data:`~protocols.wire.niss.AHEAD_RECORD`; the client checks it
exactly as a ``query.shares`` request (roster view, floors, joint-view scale) and answers with its upload.
Round r+1 takes these replies only when its own key round shows the same view (participants, graph, keys,
signatures, sizes, key epoch, graph seed) at the same joint-view scale (the budget guard may raise it between
rounds); then only its participants without a good reply get a ``query.shares`` phase.  Anything else (a
dropout, a re-keyed node, a resumed server, which keeps no ahead replies) asks every participant in a
``query.shares`` phase, as does a re-run after failures (:data:`MAX_SHARE_ATTEMPTS`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from protocols import niss as niss_math
from protocols.floor import NissFloor, niss_floor
from protocols.niss import client_tau
from protocols.wire.niss import AHEAD_RECORD, ShareReply, ShareRequest
from strategies.base import RoundFailed, RoundState
from strategies.key_phase import KeyRound, largest_round, unplannable

#: How often the share phase is re-run after clients failed it, before the round fails.
MAX_SHARE_ATTEMPTS = 3


#: Bytes of one sealed payload besides its share vectors (header, seed, AEAD nonce and tag; ~100 in practice).
PAYLOAD_OVERHEAD = 1024


def _share_reply(reply: Message, expected: list[int], max_bytes: int | None = None) -> ShareReply | None:
    """The ``query.shares`` reply's :func:`_checked_shares` (None without a config record)."""
    return _checked_shares(reply.content["config"], expected, max_bytes) if "config" in reply.content else None


def _checked_shares(rec: ConfigRecord, expected: list[int], max_bytes: int | None = None) -> ShareReply | None:
    """The sealed payloads in ``rec``: one per neighbour, in neighbour order, at most ``max_bytes`` (else None).

    A malformed record gives None too.
    """
    try:
        shares = ShareReply.from_config(rec)
    except (ValueError, TypeError):
        return None
    if max_bytes is not None and sum(len(p) for p in shares.payloads) > max_bytes:
        return None  # never relayed: a payload larger than the shares the plan allows
    return shares if list(shares.to_ids) == expected else None


def sizes_of(kr: KeyRound) -> dict[int, int]:
    """The participants' dataset sizes as reported with their keys (public; the clients derive tau from them)."""
    return {n: kr.num_examples[n] for n in kr.participants if n in kr.num_examples}


@dataclass
class Ahead:
    """The next round's key round and scale as round r's train messages asked, and the good replies so far."""

    keys: KeyRound
    scale: float
    #: node -> its aggregation weight in that round (:func:`protocols.niss.aggregation_weights`).
    weights: dict[int, float] = field(default_factory=dict)
    #: node -> its share reply, one sealed payload per neighbour of ``keys`` in neighbour order.
    shares: dict[int, ShareReply] = field(default_factory=dict)

    def take(self, node: int, reply: Message, max_bytes: int) -> None:
        """Keep ``node``'s reply to the ahead request if it is well formed; the record leaves ``reply`` either way.

        Removed from the train reply so that the reply checks see the upload alone (:mod:`strategies.validation`).
        """
        if AHEAD_RECORD not in reply.content:
            return
        rec = reply.content[AHEAD_RECORD]
        del reply.content[AHEAD_RECORD]
        if node in self.keys.neighbours and \
                (shares := _checked_shares(rec, self.keys.neighbours[node], max_bytes)) is not None:
            self.shares[node] = shares

    def matching(self, kr: KeyRound, scale: float) -> dict[int, ShareReply]:
        """The replies round ``kr`` may use: all of them if ``kr`` has this view and scale, else none."""
        if scale != self.scale or not same_view(self.keys, kr):
            return {}
        return {n: s for n, s in self.shares.items() if n in kr.participants}


def same_view(a: KeyRound, b: KeyRound) -> bool:
    """Whether two key rounds show the clients the same view (what a share request binds; not the probe seed)."""
    return (a.round, a.participants, a.neighbours, a.public_keys, a.num_examples, a.key_epoch, a.graph_seed,
            a.signed_by, a.run_id) == (b.round, b.participants, b.neighbours, b.public_keys, b.num_examples,
                                       b.key_epoch, b.graph_seed, b.signed_by, b.run_id)


class SharePhase:
    """The plan stage's share phase of :class:`strategies.niss.NissStrategy` (before the recovery mixin in the bases)."""

    #: the next round's share request as this round's train messages carry it (None: not asked ahead).
    _ahead: Ahead | None
    #: the usable nodes of the round's sampling (the next round's key round is built over the same).
    _nodes: list[int]

    def exchange_keys(self, grid: Grid, st: RoundState) -> None:
        """Keys stage (:class:`~strategies.recovery.PairwiseRecovery`), remembering the usable nodes it was given."""
        self._nodes = list(st.participants)
        super().exchange_keys(grid, st)  # type: ignore[misc]

    def _plan_ahead(self, rnd: int) -> Ahead | None:
        """Round ``rnd + 1``'s key round as far as the keys held now give it, and its scale (None: not asked ahead)."""
        if rnd >= self.cfg.num_rounds or (nxt := self.keys.peek(rnd + 1, self._nodes)) is None:
            return None
        nxt = self._sized(nxt)
        return Ahead(nxt, self._scale(nxt), self._weights(nxt)) if len(nxt.participants) >= 2 else None

    def _share_request(self, kr: KeyRound, node: int, weights: dict[int, float], scale: float) -> ConfigRecord:
        """``node``'s share request: its neighbours' signed keys and the round's view; the probe seed comes with train."""
        peers = dataclasses.replace(kr.peer_keys(node), probe_seed=None)
        return ConfigRecord(ShareRequest(kr.round, weights[node], peers, sizes_of(kr), scale).to_config())

    def _sized(self, kr: KeyRound) -> KeyRound:
        """Record level: ``kr`` without the participants that reported no size (no size, no weight)."""
        if self.cfg.privacy_unit == "record":
            unsized = [n for n in kr.participants if n not in kr.num_examples]
            if unsized:  # protocols.niss.aggregation_weights: left out of this round
                kr = self.keys.regraph(kr, [n for n in kr.participants if n in kr.num_examples])
        return kr

    def check_largest_round(self) -> None:
        """The joint-view scale of :func:`strategies.key_phase.largest_round` once; ``ConfigError`` if none exists.

        Refuses at start what every such round would refuse: e.g. a ``dropout-rate`` whose planned dropouts can
        remove all the shares of ``clients-per-round`` participants, or sigmas that are not finite.
        """
        sizes, graph = largest_round(self.cfg)
        try:
            weights = niss_math.aggregation_weights(self.cfg, list(graph), sizes)
            sigmas = [niss_math.client_sigma(self.cfg, weights[n], sizes[n]) for n in graph]
            if not all(math.isfinite(s) and s > 0 for s in sigmas):
                raise ValueError(f"the clients' noise std sigma_k = {sigmas[0]:g} is not a finite number > 0")
            scale = niss_floor(self.cfg, sizes, graph, client_tau(self.cfg, sizes)).scale
            if not math.isfinite(scale) and len(graph) == 2:
                raise ValueError("with 2 clients per round each participant knows the residual of every share that "
                                 "hides the other's record in the published model; niss needs 3 or more: set "
                                 "run-config 'num-clients' x 'sample-rate' >= 3")
            if not math.isfinite(scale):
                raise ValueError(f"the joint-view noise scale {scale:g} is not finite")
        except (ValueError, ArithmeticError) as err:
            raise unplannable(self.cfg, err) from err

    def _floor(self, kr: KeyRound, open_view: bool = False) -> NissFloor:
        """The round's :func:`protocols.floor.niss_floor` (the clients derive the same and refuse less)."""
        tau, releases = client_tau(self.cfg, sizes_of(kr)), self.keys.releases()
        return niss_floor(self.cfg, sizes_of(kr), kr.neighbours, tau, releases=releases, open_view=open_view,
                          degrees=kr.roster_degrees())

    def _scale(self, kr: KeyRound) -> float:
        """Joint-view scale (:func:`protocols.floor.niss_floor`, clients refuse less) times the guard's ``noise_scale``."""
        return self._floor(kr).scale * self.noise_scale

    def _weights(self, kr: KeyRound) -> dict[int, float]:
        return niss_math.aggregation_weights(self.cfg, kr.participants, sizes_of(kr))

    def _share_phase(self, grid: Grid, kr: KeyRound) -> tuple[KeyRound, dict[int, ShareReply]]:
        """The participants' shares: those asked for ahead if the view is the one asked for, the rest by ``query.shares``.

        The phase runs until every remaining participant answered correctly (re-graphing after failures; a new view
        asks everyone again).
        """
        kr = self._sized(kr)
        ahead, self._ahead = self._ahead, None
        have = ahead.matching(kr, self._scale(kr)) if ahead is not None else {}
        self.report(shares_ahead=float(len(have)))
        for _attempt in range(MAX_SHARE_ATTEMPTS):
            if len(kr.participants) < 2:
                break
            weights, scale = self._weights(kr), self._scale(kr)
            ask = [n for n in kr.participants if n not in have]
            replies: dict[int, Message] = {}
            if ask:
                replies, _errors = self.exchange(
                    grid, ask, lambda n, kr=kr, w=weights, sc=scale: RecordDict(
                        {"config": self._share_request(kr, n, w, sc)}), "shares")
            good = dict(have)
            good.update({n: shares for n, r in replies.items() if n in kr.neighbours and n in ask
                         and (shares := _share_reply(r, kr.neighbours[n], self.share_bytes(n, kr))) is not None})
            failed = sorted(set(kr.participants) - set(good))
            if not failed:
                return kr, good
            self.keys.forget(failed)  # re-keyed when next sampled (e.g. a node that lost its state)
            kr, have = self.keys.regraph(kr, good), {}  # another view: every remaining participant is asked again
        raise RoundFailed(f"round {kr.round}: NISS share exchange did not complete "
                          f"({len(kr.participants)} client(s) left after dropping {kr.dropped})")

    def share_bytes(self, node: int, kr: KeyRound) -> int:
        """Most bytes ``node``'s share reply may hold (larger replies are never relayed).

        Its one share per neighbour (:data:`protocols.niss.SHARES_PER_NEIGHBOUR`) as float64 vectors (vector
        encoding; a seed payload is far smaller), plus :data:`PAYLOAD_OVERHEAD` per neighbour.
        """
        degree = len(kr.neighbours.get(node, []))
        count = niss_math.SHARES_PER_NEIGHBOUR * degree if self.cfg.niss_share_encoding == "vector" else 0
        return 8 * count * self.model_dim() + PAYLOAD_OVERHEAD * max(degree, 1)



__all__ = ["AHEAD_RECORD", "Ahead", "MAX_SHARE_ATTEMPTS", "PAYLOAD_OVERHEAD", "SharePhase", "same_view", "sizes_of"]
