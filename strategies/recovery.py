"""Recover stage of the pairwise methods (nadp, niss, mpddp): the server removes orphaned pair noise exactly.

A participant that drops out after the round's pairs are fixed, or whose upload the server excludes
(:mod:`strategies.validation`), leaves its pair noise with every surviving neighbour uncancelled.  The recover
stage (:mod:`strategies.stages`) calls :meth:`PairwiseRecovery.recover` (or, with double masking,
:meth:`PairwiseRecovery.unmask`) with the grid it receives; the method's ``aggregate`` then subtracts the
survivors' corrections, so the aggregate is what the survivors alone would have produced.

* double masking (``self-mask``): a ``query.recover`` phase every round; each survivor reveals, per peer, either
  its share of the peer's self-mask seed or their pair seed, never both; a round fails only when a self-mask
  cannot be rebuilt from ``t`` shares.  Rounds with an upload not aggregated first run ``query.consistency``
  (:meth:`PairwiseRecovery.collect_signatures`): every survivor signs the round's outcome, and the recovery
  request carries the signatures each client checks before revealing pair seeds (:mod:`protocols.consistency`);
* direct reveal (``self-mask = false``): the phase runs only in rounds with dropouts; survivors reveal that
  round's pair material with the dropped; a second dropout fails the round (:class:`~strategies.base.RoundFailed`).

Accountants are charged with the noise really left (:func:`charge_shortfall`).  Threat model, client-side
checks (:func:`client.recovery.check_request`), costs and round fields: ``docs/robustness.md``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import DEBUG, INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from protocols.consistency import SignedOutcome
from protocols.masking import (
    mask_parameters,
    mask_threshold,
    rebuild_seed,
    self_masks,
    unmaskable,
)
from protocols.prg import gaussian
from protocols.privacy.budget import charge_shortfall
from protocols.wire.consistency import CONSISTENCY_RECORD, ConsistencyReply, ConsistencyRequest, SignedOutcomes
from protocols.wire.keys import probe_value
from protocols.wire.recovery import SELF_MASK_RECORD, RecoveryReply, RecoveryRequest, SelfMaskShares
from strategies.base import RoundFailed, RoundState
from strategies.validation import payload_bytes


@dataclass
class RecoveryOutcome:
    """What one round's recovery phase returned."""

    round: int
    dropped: list[int]
    survivors: list[int]
    #: survivor -> {dropped neighbour -> revealed material}.
    material: dict[int, dict[int, bytes]] = field(default_factory=dict)
    #: participants whose upload arrived but was excluded (their own noise is never revealed).
    excluded: list[int] = field(default_factory=list)
    #: survivor -> dropped neighbours whose pair noise in its own upload it kept (not revealed).
    kept: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: survivor -> projection of that kept noise on the cancellation check's direction (None: not given).
    kept_probe: dict[int, float | None] = field(default_factory=dict)
    seconds: float = 0.0
    #: double masking: node -> (rebuilt self-mask seed, std) of every aggregated upload.
    masks: dict[int, tuple[bytes, float]] = field(default_factory=dict)
    #: survivors that did not answer (or refused) the unmasking request: their pairs with the dropped stay.
    silent: list[int] = field(default_factory=list)
    #: bytes of the recovery messages, down (requests) and up (replies), summed over the asked survivors.
    bytes_down: int = 0
    bytes_up: int = 0
    #: signed outcomes collected in the consistency phase (rounds with uploads not aggregated; double masking).
    signatures: int = 0

    @property
    def gone_any(self) -> bool:
        """Whether some participant's pair noise had to be recovered (dropped or excluded)."""
        return bool(self.dropped)

    @property
    def pairs(self) -> int:
        """Number of (survivor, dropped) pairs whose material was revealed (wholly or, if kept, in part)."""
        return sum(len(m) for m in self.material.values())

    def is_kept(self, survivor: int, peer: int) -> bool:
        """Whether ``survivor`` kept its own pair noise with ``peer`` (it stays in the aggregate)."""
        return peer in self.kept.get(survivor, ())

    def probe_corrections(self, removed: list[float]) -> list[float] | None:
        """Projections to subtract from the survivors' probes: what was removed plus what was kept on purpose.

        None when a survivor kept noise without giving its projection (the residual cannot be measured).
        """
        kept = [p for n, p in self.kept_probe.items() if self.kept.get(n)]
        if any(p is None for p in kept):
            return None
        return removed + [float(p) for p in kept if p is not None]


@dataclass
class UnmaskPlan:
    """One round's double-masking requests (:meth:`PairwiseRecovery.unmask_plan`), until the answers come."""

    state: RoundState
    neighbours: Mapping[int, Sequence[int]]
    out: RecoveryOutcome
    keep: set[int]
    shares_of: dict[int, SelfMaskShares]
    thresholds: dict[int, int]
    #: Participants whose upload arrived (excluded ones included): every one is asked.
    received: list[int]
    #: Participants whose upload did not arrive.
    lost: list[int]
    #: The model the round trained from (set when the unmasking waits for the next round).
    model: ArrayRecord | None = None

    def request(self, node: int, signed: Mapping[int, SignedOutcome] | None = None) -> RecordDict:
        """``node``'s request: the sealed shares its kept neighbours made for it, and the signatures it checks."""
        neighbours, gone = self.neighbours, set(self.out.dropped)
        fwd = {x: self.shares_of[x].sealed[node] for x in neighbours.get(node, ())
               if x in self.keep and x in self.shares_of and node in self.shares_of[x].sealed}
        rd = RecordDict({"config": ConfigRecord(RecoveryRequest(self.state.round, tuple(self.received),
                                                                tuple(self.lost), tuple(self.out.excluded),
                                                                fwd).to_config())})
        # the signatures this node checks: those of the neighbours of its neighbours not aggregated
        signers = {s for k in gone & set(neighbours.get(node, ())) for s in neighbours.get(k, ())}
        entries = tuple(signed[s] for s in sorted(signers & set(signed or {})))
        if entries:
            rd[CONSISTENCY_RECORD] = ConfigRecord(SignedOutcomes(entries).to_config())
        return rd


class PairwiseRecovery:
    """Keys and recover stages of the pairwise strategies (before :class:`~strategies.base.CancelStrategy` in the bases).

    The method implements :meth:`pair_neighbours`; its ``aggregate`` reads :meth:`recovered` and subtracts
    the corrections.
    """

    #: A round's unmasking that waits for the next round's train messages (run-config ``unmask-next-round``).
    pending_unmask: UnmaskPlan | None = None

    def exchange_keys(self, grid: Grid, st: RoundState) -> None:
        """Keys stage: the shared key phase over the sampled nodes; the participants are those with a key."""
        kr = self.keys.run(self, grid, st.round, st.participants)  # type: ignore[attr-defined]
        st.keys, st.participants = kr, list(kr.participants)

    def pair_neighbours(self, state: RoundState) -> Mapping[int, Sequence[int]] | None:
        """Each participant's pairwise neighbours this round (None: the round has no pair noise)."""
        raise NotImplementedError

    @staticmethod
    def recovered(state: RoundState) -> RecoveryOutcome | None:
        """The recover stage's outcome of ``state``'s round, if a recovery phase ran in it."""
        return state.recovery

    def recover(self, grid: Grid | None, st: RoundState) -> None:
        """Recover stage: ask the survivors with a dropped neighbour for this round's pair material of the dropped.

        Self-masked uploads (:meth:`unmask`): every round.  Otherwise every survivor stays in ``st.replies``;
        sets ``st.recovery`` when a phase ran.

        Raises:
            RoundFailed: a survivor refuses or does not answer (no threshold), or a phase is needed and
                ``grid`` is None.
        """
        st.recovery = None
        by_node = st.replies
        neighbours = self.pair_neighbours(st)
        if neighbours is not None and any(SELF_MASK_RECORD in m.content for m in by_node.values()):
            self.unmask(grid, st, neighbours)
            return
        gone = sorted(set(st.dropped) & set(st.participants))
        if not gone or neighbours is None:
            return
        grid = _need_grid(grid, st, "dropout recovery")
        survivors = sorted(by_node)
        gone_set = set(gone)
        # Uploads that arrived but were excluded by the reply checks: the server holds them, so the request says
        # so and the clients reveal only what leaves those peers' own noise with them (client.recovery).
        held = sorted(gone_set & st.uploaded)
        lost = sorted(gone_set - set(held))
        ask = [n for n in survivors if gone_set & set(neighbours.get(n, ()))]
        request = RecordDict({"config": ConfigRecord(RecoveryRequest(st.round, tuple(survivors) + tuple(held),
                                                                     tuple(lost), tuple(held)).to_config())})
        out = RecoveryOutcome(st.round, gone, survivors, excluded=held)
        t0 = time.perf_counter()
        replies, _errors = self.exchange(grid, ask, lambda _n: request, "recover")  # type: ignore[attr-defined]
        out.seconds = time.perf_counter() - t0
        out.bytes_down = payload_bytes(request) * len(ask)
        silent, refused = [], []
        for node in ask:
            msg = replies.get(node)
            if msg is None or "config" not in msg.content:
                silent.append(node)
                continue
            out.bytes_up += payload_bytes(msg.content)
            try:
                rep = RecoveryReply.from_config(msg.content["config"])
            except ValueError as err:
                refused.append(f"node {node}: malformed reply ({err})")
                continue
            if rep.refused:
                refused.append(f"node {node} refused: {rep.refused}")
                continue
            expected = sorted(gone_set & set(neighbours[node]))
            if sorted(rep.peers) != expected:
                refused.append(f"node {node}: material for {sorted(rep.peers)}, expected {expected}")
                continue
            out.material[node] = rep.by_peer()
            if rep.kept:
                out.kept[node], out.kept_probe[node] = rep.kept, rep.kept_probe
        if silent or refused:
            st.failed_recovery = out if any(out.material.values()) else None
            raise RoundFailed(
                f"round {st.round}: dropout recovery of {gone} failed"
                + (f"; survivors {silent} did not answer (a second dropout cannot be repaired without a "
                   "threshold scheme: their uploads are held, so their pairs must stay secret)" if silent else "")
                + (f"; {'; '.join(refused)}" if refused else ""))
        st.recovery = out

    def mask_thresholds(self, neighbours: Mapping[int, Sequence[int]]) -> dict[int, int]:
        """Each node's self-mask threshold, from its degree and run-config ``mask-corruption-rate``."""
        rate = self.cfg.mask_corruption_rate  # type: ignore[attr-defined]
        return {n: mask_threshold(len(nb), rate) for n, nb in neighbours.items() if nb}

    def _threshold_rule(self, neighbours: Mapping[int, Sequence[int]], thresholds: Mapping[int, int],
                        nodes: Iterable[int]) -> str:
        """The self-mask thresholds of ``nodes`` in words: per degree, the neighbours kept it needs and at rate 0.

        Every figure is :func:`protocols.masking.mask_threshold`'s (``thresholds``: :meth:`mask_thresholds`).
        """
        rate = self.cfg.mask_corruption_rate  # type: ignore[attr-defined]
        rule = sorted({(len(neighbours[n]), thresholds[n]) for n in nodes if n in thresholds})
        needs = "; ".join(f"a client with {d} neighbours needs {t} of them kept ({mask_threshold(d, 0.0)} at rate 0)"
                          for d, t in rule)
        return (f"{needs} (protocols.masking.mask_threshold of its neighbour count and the rate, run-config "
                f"'mask-corruption-rate' = {rate:g}; 0 needs the fewest)")

    def announce_masking(self, neighbours: Mapping[int, Sequence[int]]) -> None:
        """Log the self-mask parameters at the first masked round's smallest degree, once per run.

        :meth:`protocols.masking.MaskParameters.describe`: the threshold and Bell et al.'s two failure figures.
        A warning where the assumed colluders alone rebuild a self-mask; otherwise a detail, shown with
        ``--verbose`` (the strategy's ``verbose``).
        """
        if self.cfg.self_mask and not self.__dict__.get("_announced_mask") and neighbours:  # type: ignore[attr-defined]
            self.__dict__["_announced_mask"] = True
            cfg = self.cfg  # type: ignore[attr-defined]
            params = mask_parameters(min(len(nb) for nb in neighbours.values()), cfg.dropout_rate,
                                     cfg.mask_corruption_rate)
            level = WARNING if params.colluders_rebuild else INFO if getattr(self, "verbose", False) else DEBUG
            log(level, "%s %s", cfg.method, params.describe())

    def unmask(self, grid: Grid | None, state: RoundState, neighbours: Mapping[int, Sequence[int]]) -> None:
        """Double masking: one ``query.recover`` phase to every participant whose upload arrived.

        Kept: the aggregatable uploads with at least ``t`` kept neighbours (:func:`protocols.masking.unmaskable`);
        the others are excluded too (held, not aggregated; their neighbours reveal their pair seeds instead).
        Every participant whose upload arrived (excluded ones included: they hold shares) gets the request
        with the sealed self-mask shares its neighbours made for it (and, when some upload is not aggregated,
        the signatures of the consistency phase, :meth:`collect_signatures`), and reveals its shares of the
        kept neighbours' seeds and its pair seeds with the others.  Every kept upload's seed is rebuilt from any
        ``t`` shares (checked against its commitment); a survivor that does not answer (a further dropout)
        is unmasked the same way and its pairs with the dropped stay in the aggregate as extra noise
        (``kept``).  Narrows ``state.replies`` to the kept uploads and sets ``state.recovery``.

        Run-config ``unmask-next-round``: a round where every upload is kept and another round follows is not
        unmasked now; the requests wait in ``self.pending_unmask`` for the next round's train messages
        (:mod:`strategies.pipelined`) and ``state.deferred`` is set.

        Raises:
            RoundFailed: a kept upload's seed cannot be rebuilt (fewer than ``t`` of its neighbours answered).
        """
        plan = self.unmask_plan(state, neighbours)
        if (self.cfg.unmask_next_round and not plan.out.dropped  # type: ignore[attr-defined]
                and state.round < self.cfg.num_rounds  # type: ignore[attr-defined]
                and self.cfg.clients_per_round >= self.cfg.num_clients):  # type: ignore[attr-defined]
            state.deferred = True
            plan.model = self.round_model  # type: ignore[attr-defined]
            self.pending_unmask = plan
            return
        grid = _need_grid(grid, state, "unmasking")
        t0 = time.perf_counter()
        outcome = ConsistencyRequest(state.round, tuple(plan.received), tuple(plan.lost), tuple(plan.out.excluded))
        signed = self.collect_signatures(grid, plan.out, outcome, plan.received) if plan.out.dropped else {}
        requests = {n: plan.request(n, signed) for n in plan.received}
        replies, _errors = self.exchange(grid, plan.received, lambda n: requests[n], "recover")  # type: ignore[attr-defined]
        plan.out.seconds = time.perf_counter() - t0
        plan.out.bytes_down += sum(payload_bytes(r) for r in requests.values())
        self.finish_unmask(plan, {n: m.content for n, m in replies.items()})

    def unmask_plan(self, state: RoundState, neighbours: Mapping[int, Sequence[int]]) -> UnmaskPlan:
        """What :meth:`unmask` asks: the kept and excluded uploads, and who is asked (every upload that arrived).

        Raises:
            RoundFailed: malformed self-mask shares, or no upload can be unmasked.
        """
        by_node = state.replies
        shares_of: dict[int, SelfMaskShares] = {}
        for n, m in by_node.items():
            if SELF_MASK_RECORD in m.content:
                try:
                    shares_of[n] = SelfMaskShares.from_config(m.content[SELF_MASK_RECORD])
                except ValueError as err:
                    raise RoundFailed(f"round {state.round}: node {n} sent malformed self-mask shares ({err})") from err
        thresholds = self.mask_thresholds(neighbours)
        held = sorted(set(state.dropped) & state.uploaded)
        masked = {n for n in by_node if n in shares_of}
        received = sorted(set(by_node) | set(held))
        keep = unmaskable(neighbours, set(by_node), {n: thresholds.get(n, 0) for n in by_node})
        keep -= {n for n in keep if n not in masked and neighbours.get(n)}  # a pairwise upload without its shares
        if not keep:
            raise RoundFailed(f"round {state.round}: no upload can be unmasked (each has fewer kept neighbours than its "
                              f"self-mask threshold; {len(by_node)} of {len(state.participants)} uploads arrived): "
                              + self._threshold_rule(neighbours, thresholds, by_node))
        excluded = sorted(set(held) | (set(by_node) - keep))
        lost = sorted(set(state.participants) - set(received))
        out = RecoveryOutcome(state.round, sorted(set(lost) | set(excluded)), sorted(keep), excluded=excluded)
        return UnmaskPlan(state, neighbours, out, keep, shares_of, thresholds, received, lost)

    def finish_unmask(self, plan: UnmaskPlan, answers: Mapping[int, RecordDict]) -> None:
        """Rebuild every kept upload's self-mask from the answers (node -> content with a ``"config"`` record).

        A node of ``plan.received`` without a usable answer is silent.  Narrows ``state.replies`` to the kept uploads
        and sets ``state.recovery``.

        Raises:
            RoundFailed: a kept upload's seed cannot be rebuilt (fewer than ``t`` of its neighbours answered).
        """
        state, neighbours, out, keep = plan.state, plan.neighbours, plan.out, plan.keep
        gone_set = set(out.dropped)
        collected: dict[int, list[bytes]] = {n: [] for n in keep}
        for node in plan.received:
            content = answers.get(node)
            rep = None
            if content is not None and "config" in content:
                out.bytes_up += payload_bytes(content)
                try:
                    rep = RecoveryReply.from_config(content["config"])
                except ValueError as err:
                    log(WARNING, "round %d: node %s sent a malformed unmasking reply (%s)", state.round, node, err)
            if rep is not None and rep.refused:
                log(WARNING, "round %d: node %s refused to unmask: %s", state.round, node, rep.refused)
                rep = None
            # An excluded node reveals no pair material (its aggregated neighbours reveal their side).
            expected = sorted(gone_set & set(neighbours.get(node, ()))) if node in keep else []
            if rep is not None and sorted(rep.peers) != expected:
                log(WARNING, "round %d: node %s revealed pair material for %s, expected %s", state.round, node,
                    sorted(rep.peers), expected)
                rep = None
            if rep is None:
                out.silent.append(node)
                if expected and node in keep:
                    out.kept[node], out.kept_probe[node] = tuple(expected), None
                continue
            if node in keep:  # a neighbour short of signatures: its pair stays (kept, empty material)
                out.material[node] = {p: m for p, m in rep.by_peer().items() if p not in rep.kept}
                if rep.kept:
                    out.kept[node], out.kept_probe[node] = tuple(rep.kept), None
            for x, share in zip(rep.mask_peers, rep.mask_shares, strict=True):
                if x in collected and node in neighbours.get(x, ()):
                    collected[x].append(share)
        missing = []
        for x in sorted(keep):
            if x not in plan.shares_of:
                continue
            seed = rebuild_seed(collected[x], plan.thresholds[x], plan.shares_of[x].commitment)
            if seed is None:
                missing.append(f"node {x} ({len(collected[x])} shares, needs {plan.thresholds[x]})")
            else:
                out.masks[x] = (seed, plan.shares_of[x].std)
        if missing:
            state.failed_recovery = out if any(out.material.values()) else None
            raise RoundFailed(f"round {state.round}: self-masks cannot be removed: {'; '.join(missing)}; "
                              f"survivors {out.silent} did not answer or refused")
        state.recovery = out
        state.replies = {n: state.replies[n] for n in sorted(keep)}

    def collect_signatures(self, grid: Grid, out: RecoveryOutcome, request: ConsistencyRequest,
                           ask: Sequence[int]) -> dict[int, SignedOutcome]:
        """Consistency phase (``query.consistency``): every node of ``ask`` signs the round's outcome ``request``.

        Run only in rounds that declare some upload not aggregated (pair material is revealed only there).
        Returns node -> its signature (refusals and silence are logged; the clients check the signatures).
        Adds the phase's bytes to ``out`` and the number of signatures to ``out.signatures``.
        """
        content = RecordDict({"config": ConfigRecord(request.to_config())})
        replies, _errors = self.exchange(grid, ask, lambda _n: content, "consistency")  # type: ignore[attr-defined]
        out.bytes_down += payload_bytes(content) * len(ask)
        signed = {}
        for node in ask:
            msg = replies.get(node)
            if msg is None or "config" not in msg.content:
                continue
            out.bytes_up += payload_bytes(msg.content)
            try:
                rep = ConsistencyReply.from_config(msg.content["config"])
            except ValueError as err:
                log(WARNING, "round %d: node %s sent a malformed consistency reply (%s)", request.round, node, err)
                continue
            if rep.refused:
                log(WARNING, "round %d: node %s refused to sign the outcome: %s", request.round, node, rep.refused)
                continue
            signed[node] = SignedOutcome(node, rep.name, rep.signature)
        out.signatures = len(signed)
        return signed

    def remove_masks(self, state: RoundState, flat: dict[int, np.ndarray]) -> None:
        """Subtract each upload's rebuilt self-mask from ``flat`` (node -> flat upload, in place)."""
        rec = self.recovered(state)
        if rec is None:
            return
        nodes = [n for n in sorted(rec.masks) if n in flat]
        masks = self_masks([rec.masks[n] for n in nodes], [len(flat[n]) for n in nodes])
        for n, mask in zip(nodes, masks, strict=True):
            flat[n] = np.subtract(flat[n], mask, out=mask)

    def mask_sum(self, state: RoundState, size: int) -> np.ndarray:
        """Sum of the rebuilt self-masks of ``state``'s round (zeros without double masking)."""
        total = np.zeros(size)
        rec = self.recovered(state)
        for mask in self_masks([m for _n, m in sorted(rec.masks.items())] if rec is not None else [], size):
            total += mask
        return total

    def report_recovery(self, state: RoundState, dropped: Iterable[int]) -> None:
        """Round-report figures of the recovery (call from ``aggregate``)."""
        rec = self.recovered(state)
        n_dropped = len(set(dropped))
        # ``dropped`` counts every sampled client lost this round (niss reports the share-phase ones first)
        earlier = self.round_report().get("dropped", 0.0)  # type: ignore[attr-defined]
        figures = {"dropped": earlier + n_dropped, "recovery": 1.0 if rec is not None and rec.gone_any else 0.0}
        if rec is not None and rec.masks:
            n = max(len(rec.survivors), 1)
            figures.update(unmask_s=rec.seconds, unmask_bytes_per_client=(rec.bytes_down + rec.bytes_up) / n,
                           consistency_signatures=float(rec.signatures),
                           self_masks_removed=float(len(rec.masks)), unmask_silent=float(len(rec.silent)))
        if rec is not None and rec.gone_any:
            figures.update(recovered_pairs=rec.pairs, kept_pairs=sum(len(k) for k in rec.kept.values()),
                           recovery_s=rec.seconds,
                           recovery_bytes_down_per_survivor=rec.bytes_down / max(len(rec.survivors), 1),
                           recovery_bytes_up_per_survivor=rec.bytes_up / max(len(rec.survivors), 1),
                           recovery_bytes_per_survivor=(rec.bytes_down + rec.bytes_up) / max(len(rec.survivors), 1))
        self.report(**figures)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- server-side helpers
def _need_grid(grid: Grid | None, st: RoundState, phase: str) -> Grid:
    """``grid``, or :class:`RoundFailed` when the round needs a phase with the clients and has none."""
    if grid is None:
        raise RoundFailed(f"round {st.round}: {phase} needs the grid (drive the round with strategies.stages.run_round)")
    return grid


def probe_direction(seed: bytes, size: int) -> np.ndarray:
    """The cancellation check's public random direction (what :func:`client.pairwise_phase.mask_probe` uses)."""
    return gaussian(seed, size)


def corrected_residual(replies: Iterable[Message], corrections: Iterable[float] | None) -> float | None:
    """Relative cancellation residual of the survivors' mask probes after the recovery's corrections.

    ``corrections``: the projections of the subtracted (and the deliberately kept) vectors on the same public
    direction (:meth:`RecoveryOutcome.probe_corrections`); None: not measurable this round.
    """
    if corrections is None:
        return None
    probes = [v for v in (probe_value(r.content["metrics"]) for r in replies) if v is not None]
    if not probes:
        return None
    scale = math.sqrt(math.fsum(p * p for p in probes))
    total = math.fsum(probes) - math.fsum(corrections)
    return abs(total) / scale if scale > 0 else 0.0


__all__ = ["PairwiseRecovery", "RecoveryOutcome", "charge_shortfall", "corrected_residual", "probe_direction"]
