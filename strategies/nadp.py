"""Server stages of NADP-FL (Noise-Annihilation DP-FL); the round protocol and equations: ``docs/methods/nadp.md``.

The stages of :mod:`strategies.stages`: keys (:class:`strategies.key_phase.KeyPhase`), plan (the public round
plan, :func:`protocols.nadp.round_plan`: sigma_up and sigma_down from Theorem 1 / Eq. 3, lambda from Eq. 8), train
(:class:`protocols.wire.nadp.NadpPlan` plus the peer keys; the round is charged as the messages leave), recover
(dropout recovery and unmasking, :mod:`strategies.recovery`), aggregate (``sum_i p_i upload_i`` in float64,
:func:`protocols.nadp.nadp_aggregate`), account (the noise the survivors left beyond the plan,
:func:`protocols.privacy.budget.top_up`).

Accounting per record over the rounds its owner took part in (no sampling amplification: the sample is public):
``epsilon_uplink`` = RDP of all uploads jointly (the aggregate included), ``epsilon_downlink`` = RDP of the
published aggregate against any receiver (a participant knows its own residual:
:func:`protocols.nadp_recovery.receiver_noise_after`), ``epsilon`` = their max; the paper's Lemma 2 figures as ``epsilon_paper``,
``epsilon_uplink_paper``, ``epsilon_downlink_paper`` and one upload alone as ``epsilon_uplink_marginal``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from protocols.arrays import flatten, unflatten
from protocols.config import RunConfig
from protocols.floor import nadp_round_noise
from protocols.nadp import (
    NoiseAllocation,
    eq3_multiplier,
    nadp_aggregate,
    normalize_weights,
    rdp_multiplier,
)
from protocols.nadp_recovery import excluded_uplink_std, noise_after, receiver_noise_after, survivor_uplink_stds
from protocols.pairwise import pairwise_noise
from protocols.privacy import (
    GaussianEvent,
    Lemma2Accountant,
    PerUnitAccountant,
    PrivacyLedger,
    receiver_std,
    record_training_movement,
)
from protocols.privacy.budget import empty_like, top_up
from protocols.privacy.signal import NoiseEstimate, gaussian_norm
from protocols.wire.arrays import from_record
from protocols.wire.common import TrainIns, merge_configs
from protocols.wire.nadp import NadpPlan
from strategies.base import CancelStrategy, RoundFailed, RoundState
from strategies.key_phase import KeyPhase, KeyRound, largest_round, unplannable
from strategies.records import to_record
from strategies.recovery import PairwiseRecovery, corrected_residual, probe_direction
from strategies.validation import gaussian_norm_bound


@dataclass
class NadpRound(RoundState):
    """The round's plan (``keys`` is the key stage's round): public plan, weights, sensitivities, allocation."""

    plan: NadpPlan  # what every participant gets (public)
    weights: dict[int, float]  # normalised p_i
    sensitivity: dict[int, float]  # per-record L2 sensitivity of each client's local model
    allocation: NoiseAllocation | None  # None for the record-ldp variant
    #: The survivors whose releases the account stage composes (set by the aggregate stage).
    survivors: list[int] | None = None


class NadpStrategy(PairwiseRecovery, CancelStrategy):
    """NADP-FL: pairwise counteracting noise for the uplink, residual noise for the downlink."""

    wire_dtype = np.float64
    #: The round loop may raise every noise std of a round by :attr:`noise_scale` (>= 1) to keep epsilon
    #: within the run's target after rounds that cost more than planned (:mod:`strategies.run.budget`).
    scales_noise = True
    noise_scale = 1.0

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.variant = cfg.nadp_variant
        #: Noise multiplier of every reported view (RDP, T releases, no sampling amplification claimed): nadp's
        #: aggregate and joint upload view (:func:`protocols.nadp.round_plan`), record-ldp's single upload.
        self.z = rdp_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
        #: The paper's Eq. 3 multiplier (Lemma 2 over 2T queries), reported for comparison only.
        self.z_eq3 = eq3_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
        self.keys = KeyPhase(cfg)
        self._check_largest_round()
        # Per record owner (client), over the rounds it took part in: RDP accountants of the server's joint view
        # of the uploads, of the published aggregate and (reported) of one upload alone; the paper's Lemma 2
        # composition per phase and of both.
        self.privacy = PrivacyLedger(cfg.delta, uplink=PerUnitAccountant(), downlink=PerUnitAccountant(), extra={
            "uplink_marginal": PerUnitAccountant(), "uplink_paper": Lemma2Accountant(),
            "downlink_paper": Lemma2Accountant(), "paper": Lemma2Accountant()})
        self._warned_steps = False

    # ----------------------------------------------------------- calibration
    def _check_largest_round(self) -> None:
        """Plan :func:`strategies.key_phase.largest_round` once: settings no round can plan raise ``ConfigError``."""
        sizes, graph = largest_round(self.cfg)
        try:
            noise = nadp_round_noise(self.cfg, sizes, graph)
            stds = (list(noise.ldp_stds.values()) if noise.ldp_stds is not None else
                    [noise.sigmas.sigma_up, noise.sigmas.sigma_down] if noise.sigmas is not None else [])
            if not all(math.isfinite(s) for s in stds):
                raise ValueError(f"the noise stds are not finite numbers: {stds[:2]}")
        except (ValueError, ArithmeticError) as err:
            raise unplannable(self.cfg, err) from err

    def plan_round(self, keys: KeyRound) -> NadpRound:
        """Calibrate and allocate the round's noise from the participants' reported sizes.

        Raises:
            RoundFailed: a participant reported no ``|D_i|`` with its key.
        """
        rnd = keys.round
        missing = [n for n in keys.participants if n not in keys.num_examples]
        if missing:
            raise RoundFailed(f"round {rnd}: nodes {missing} did not report num-examples with their key; "
                              "nadp needs every participant's |D_i|")
        ids = tuple(keys.participants)
        sizes = {n: keys.num_examples[n] for n in ids}
        if not self._warned_steps and (self.cfg.local_epochs > 1 or self.cfg.batch_size < max(sizes.values())):
            self._warned_steps = True
            log(WARNING, "nadp: local-epochs=%d, batch-size=%d give several local SGD steps; the record sensitivity "
                "is then 2C*lr*(1/b + steps - 1) (a record also influences later steps through the weights), far "
                "above Lemma 1's 2C*lr/|D_i|. Use local-epochs=1 and batch-size >= |D_i| (one full-batch step, as "
                "in the paper's experiments) for a useful model.", self.cfg.local_epochs, self.cfg.batch_size)
        weights = normalize_weights(sizes)
        scale = self.noise_scale  # the clients derive the same (their floor), every std times the plan's scale
        # Calibrated for the most rounds the public schedule samples any client in (the clients compute the same).
        # lambda counts each participant's colluders in its roster neighbourhood, present or not (the clients do too).
        noise = nadp_round_noise(self.cfg, sizes, keys.neighbours, scale, self.keys.releases(), keys.roster_degrees())
        sens = dict(noise.sensitivities)
        if noise.ldp_stds is not None:  # record-ldp (Lemma 3)
            plan = NadpPlan(self.variant, ids, sizes, 0.0, 0.0, 1.0, dict(noise.ldp_stds), scale)
            return NadpRound(rnd, list(ids), plan, weights, sens, None, keys=keys)
        if noise.lam_problem is not None:
            log(WARNING, "nadp: %s; using lambda = 1 (no collusion protection this round)", noise.lam_problem)
        assert noise.sigmas is not None
        plan = NadpPlan(self.variant, ids, sizes, noise.sigmas.sigma_up, noise.sigmas.sigma_down, noise.lam, {}, scale)
        return NadpRound(rnd, list(ids), plan, weights, sens, noise.allocation, keys=keys)

    # ------------------------------------------------------------ stages
    def plan(self, grid: Grid, st: RoundState) -> NadpRound:
        """Plan stage: calibration and allocation over the key stage's participants."""
        assert st.keys is not None
        st = self.plan_round(st.keys)
        if st.allocation is not None:
            self.announce_masking(st.keys.neighbours)
        return st

    def train_content(self, st: NadpRound, node: int, arrays: ArrayRecord) -> RecordDict:
        """Model + round + the public plan + this node's peer keys."""
        return RecordDict({"arrays": arrays, "config": ConfigRecord(merge_configs(
            TrainIns(st.round).to_config(), st.plan.to_config(), st.keys.peer_keys(node).to_config()))})

    def aggregate(self, st: NadpRound) -> ArrayRecord:
        """Aggregate stage: ``sum_{i in S} p_i upload_i / P_S`` over the survivors S (float64), with dropout reporting.

        Raises:
            RoundFailed: the uploads have different shapes.
        """
        by_node = st.replies
        survivors = sorted(by_node)
        uploads = {n: from_record(by_node[n].content["arrays"]) for n in survivors}
        like = uploads[survivors[0]]
        flat = {n: flatten(u) for n, u in uploads.items()}
        self.remove_masks(st, flat)  # double masking: the rebuilt self-masks come off first
        dims = {v.shape for v in flat.values()}
        if len(dims) != 1:
            raise RoundFailed(f"round {st.round}: uploads have different shapes {sorted(dims)}")
        dim = next(iter(dims))[0]
        acc = nadp_aggregate(flat, st.weights)  # ascending id order: reproducible float64 sum
        dropped = sorted(set(st.participants) - set(survivors))
        t0 = time.process_time()
        corrections = self._remove_orphaned_pairs(st, acc)
        if self.recovered(st) is not None:
            self.report(recovery_server_s=time.process_time() - t0)
        if dropped:
            acc /= math.fsum(st.weights[n] for n in survivors)  # renormalise over the survivors
        st.survivors = survivors
        self._report_round(st, list(by_node.values()), survivors, dropped, dim, corrections)
        return to_record(unflatten(acc, like), self.wire_dtype)

    # ------------------------------------------------------------- recovery
    def pair_neighbours(self, st: NadpRound) -> dict[int, list[int]] | None:
        """The round's pairing graph (None for record-ldp: no pair noise)."""
        return None if st.allocation is None else st.keys.neighbours

    def _remove_orphaned_pairs(self, st: NadpRound, acc: np.ndarray) -> list[float] | None:
        """Subtract ``lam * n_ij`` of every (survivor i, dropped j) pair from ``acc`` (in place).

        The survivors revealed the round's pair seeds (:mod:`strategies.recovery`); the server expands them
        with the client's own engine and per-pair std.  Returns the corrections' projections on the
        cancellation check's direction (empty without recovery or without the check; None when not measurable).
        A survivor that kept its pairs (all its neighbours dropped) revealed nothing: they stay.
        """
        rec = self.recovered(st)
        if rec is None or st.allocation is None:
            return []
        probe = probe_direction(st.keys.probe_seed, len(acc)) if self.cfg.cancellation_check else None
        out: list[float] = []
        for node, revealed in sorted(rec.material.items()):
            seeds = {j: seed for j, seed in revealed.items() if not rec.is_kept(node, j)}
            if not seeds:
                continue
            stds = st.allocation.counteracting_stds(node)
            corr = st.plan.lam * pairwise_noise(node, seeds, len(acc), scale={j: stds[j] for j in seeds})
            acc -= corr
            if probe is not None:
                out.append(float(np.dot(corr, probe)))
        return rec.probe_corrections(out)

    # ------------------------------------------------------------- reporting
    def noise_estimate(self, num_params: int) -> NoiseEstimate | None:
        """Noise std left in the last round's aggregate vs ``lr clip steps`` (each step moves <= lr clip)."""
        st = self._state
        if not isinstance(st, NadpRound):
            return None
        c = self.cfg
        signal = max(record_training_movement(c, s) for s in st.plan.sizes.values())
        std, _ = self._noise_after(st, list(st.participants))
        return NoiseEstimate(gaussian_norm(std, num_params), signal, c.num_rounds)

    def _noise_after(self, st: NadpRound, survivors: list[int]) -> tuple[float, float]:
        """(per-coordinate std of all noise in the aggregate, of the uncancelled pair part).

        After dropout recovery only the survivors' residual noise is left (no uncancelled pair noise).
        """
        if st.allocation is None:  # record-ldp: independent noise, nothing to cancel
            w = sum(st.weights[n] for n in survivors)
            var = math.fsum((st.weights[n] * st.plan.ldp_stds[n]) ** 2 for n in survivors)
            return math.sqrt(var) / w, 0.0
        rec = self.recovered(st)  # removed exactly, except the pairs a survivor kept
        kept = None if rec is None else [(i, j) for i, peers in rec.kept.items() for j in peers]
        return noise_after(st.allocation, st.plan.lam, survivors, kept)

    def _receiver_std(self, st: NadpRound, survivors: list[int]) -> float:
        """Per-coordinate std of the aggregate's noise left to a receiving participant that knows its own part.

        What the model's account charges (:func:`protocols.privacy.receiver_variance`); the clients charge the same.
        """
        if st.allocation is None:  # record-ldp: independent noise, each participant knows its own
            w = sum(st.weights[n] for n in survivors)
            return receiver_std((st.weights[n] * st.plan.ldp_stds[n]) ** 2 for n in survivors) / w
        rec = self.recovered(st)
        kept = None if rec is None else [(i, j) for i, peers in rec.kept.items() for j in peers]
        return receiver_noise_after(st.allocation, st.plan.lam, survivors, kept)

    def _report_round(self, st: NadpRound, good: list[Message], survivors: list[int], dropped: list[int],
                      dim: int, corrections: list[float] | None) -> None:
        total_std, unc_std = self._noise_after(st, survivors)
        figures: dict[str, float] = {
            "aggregate_noise_std": total_std,
            "uncancelled_noise_std": unc_std,
            # expected L2 norm of the uncancelled pair noise in the aggregate (0 without dropout)
            "uncancelled_noise_norm": unc_std * math.sqrt(dim),
            "clients_dropped": float(len(dropped)),
            "nadp_lambda": st.plan.lam,
        }
        if st.allocation is not None:
            figures["sigma_up"] = st.plan.sigma_up
            figures["sigma_down"] = st.plan.sigma_down
            figures["min_uplink_std"] = min(st.allocation.uplink_std(n, st.plan.lam) for n in st.allocation.client_ids)
        # per-coordinate std of the noise in one upload (the least noised one) and left in the model (strategies.run.report)
        figures["upload_noise_std"] = figures.get("min_uplink_std", min(st.plan.ldp_stds.values(), default=0.0))
        figures["model_noise_std"] = total_std
        if dropped and unc_std > 0:
            log(WARNING, "nadp: %d of %d participants did not upload; their pair noise with the %d survivors "
                "stays in the model (per-coordinate std %.3g)", len(dropped), len(st.participants),
                len(survivors), unc_std)
        self.report_recovery(st, dropped)
        if self.cfg.cancellation_check and st.allocation is not None:
            res = corrected_residual([r for r in good if r.metadata.src_node_id in set(survivors)], corrections)
            if res is not None:
                figures["cancellation_residual"] = res
        self.report(**figures)

    def charge_release(self, st: NadpRound) -> None:
        """Train stage: charge the round when its noise is released, every participant as planned."""
        self._compose(st, list(st.participants))
        self._planned_charge = self._round_charge(st, list(st.participants))

    def account(self, st: NadpRound) -> None:
        """Account stage: after dropouts, charge the survivors what their noise really left beyond the plan.

        Nothing more when every participant survived or the aggregate stage did not reach the survivors
        (``st.survivors``): the planned charge of :meth:`charge_release` stands.
        """
        survivors = st.survivors
        if survivors is not None and set(survivors) != set(st.participants):
            top_up(self.privacy, self._planned_charge, self._round_charge(st, survivors))

    def account_revealed(self, st: NadpRound) -> None:
        """A failed recovery's revealed pairs, charged to the uploads as if it had completed.

        The answering clients priced the same outcome; no model is published, so nothing for it.
        """
        out = st.failed_recovery
        st.recovery, st.survivors = out, list(out.survivors)
        top_up(self.privacy, self._planned_charge, self._round_charge(st, st.survivors),
               accounts=("uplink", "uplink_marginal"))

    def _round_charge(self, st: NadpRound, survivors: list[int]) -> PrivacyLedger:
        """The round's charge alone (:meth:`_compose` into empty accountants parallel to ``self.privacy``)."""
        ledger, self.privacy = self.privacy, empty_like(self.privacy)
        try:
            self._compose(st, survivors)
            return self.privacy
        finally:
            self.privacy = ledger

    def _compose(self, st: NadpRound, survivors: list[int]) -> None:
        """The releases of ``survivors`` (RDP, no sampling amplification) and the paper's figures."""
        w_s = math.fsum(st.weights[n] for n in survivors)
        total_std, _ = self._noise_after(st, survivors)
        # Downlink: a record of survivor i moves the (renormalised) aggregate by <= p_i Delta_i / P_S.
        d_down = max(st.weights[n] * st.sensitivity[n] for n in survivors) / w_s
        z_down = self._receiver_std(st, survivors) / d_down  # against any receiver; the paper's counts all noise
        paper = self.privacy.extra
        if st.allocation is None:
            z_up = {n: st.plan.ldp_stds[n] / st.sensitivity[n] for n in survivors}
            z_marg = z_up
            paper_events = {"uplink_paper": GaussianEvent(min(z_up.values()), self.cfg.sample_rate)}  # Lemma 3: qT
        else:
            z_up, z_marg = self._uplink_multipliers(st, survivors)
            paper_events = {"uplink_paper": GaussianEvent(st.plan.sigma_up / max(st.sensitivity.values())),
                            "downlink_paper": GaussianEvent(total_std / d_down)}
        for n in survivors:
            self.privacy.uplink.compose(GaussianEvent(z_up[n]), units=[n])
            paper["uplink_marginal"].compose(GaussianEvent(z_marg[n]), units=[n])
        self.privacy.downlink.compose(GaussianEvent(z_down), units=survivors)
        for name, event in paper_events.items():
            paper[name].compose(event)
            paper["paper"].compose(event)
        rec = self.recovered(st)
        if rec is not None and st.allocation is not None:
            for n in rec.excluded:
                self.privacy.uplink.compose(GaussianEvent(self._excluded_multiplier(st, n)), units=[n])

    def _excluded_multiplier(self, st: NadpRound, node: int) -> float:
        """Noise multiplier of an excluded upload the server holds, its pair seeds revealed.

        Its residual noise stays and, with ``self-mask``, its self-mask (std ``uplink_std``, the client's whole
        upload noise, :func:`client.methods.nadp.noise_parts`): an excluded node is named not aggregated, so its
        neighbours reveal its pair seeds and never a share of its self-mask seed, and a server without colluding
        clients (nadp's guarantee) cannot get both (the signed consistency check, :mod:`protocols.consistency`).
        Without ``self-mask`` only the residual is left.
        """
        assert st.allocation is not None
        rec = self.recovered(st)
        masked = self.cfg.self_mask and rec is not None and node not in rec.masks
        return excluded_uplink_std(st.allocation, st.plan.lam, node, masked) / st.sensitivity[node]

    def _uplink_multipliers(self, st: NadpRound, survivors: list[int]) -> tuple[dict[int, float], dict[int, float]]:
        """Per survivor: noise multiplier of the server's joint view of the uploads, and of its upload alone.

        Without recovery the full joint view is a conservative (more informative) stand-in for the subset of
        uploads that arrived.  After recovery the server also holds the pairs with the dropped: the view is
        that of the survivors' uploads with those pairs removed (noise really there).
        """
        assert st.allocation is not None
        rec = self.recovered(st)
        joint, marg = survivor_uplink_stds(st.allocation, st.plan.lam, survivors, rec is not None and rec.gone_any)
        return ({n: joint[n] / st.sensitivity[n] for n in survivors},
                {n: marg[n] / st.sensitivity[n] for n in survivors})

    def norm_limit(self, st: NadpRound, node: int) -> float | None:
        """Per-example-clipped SGD moves the model by <= ``lr clip steps``; plus a Gaussian tail bound of the upload noise."""
        c = self.cfg
        size = st.plan.sizes.get(node)
        if size is None or self.round_model is None:
            return None
        std = st.plan.ldp_stds[node] if st.allocation is None else st.allocation.uplink_std(node, st.plan.lam)
        if st.allocation is not None and self.cfg.self_mask:
            std *= math.sqrt(2.0)  # the self-mask has the upload noise's std (client.methods.nadp.noise_parts)
        return record_training_movement(c, size) + gaussian_norm_bound(std, self.model_dim())

    def describe(self) -> dict[str, float | str]:
        """Key parameters (summary.json)."""
        c = self.cfg
        out: dict[str, float | str] = {
            "variant": self.variant,
            "noise_multiplier": self.z,
            "noise_multiplier_eq3_paper": self.z_eq3,
            "lambda": c.nadp_lambda if c.nadp_lambda > 0 else f"Eq. 8 (tau={c.nadp_tau})",
            "local_epochs": float(c.local_epochs),
            "batch_size": float(c.batch_size),
            "clipping": "per-example",
        }
        return out
