"""LaDP-FL server (Li et al., Algorithm 1): example-weighted mean of layer-wise noised models.

Clients (:mod:`client.methods.ladp`) add Gaussian noise to their selected layers (:mod:`protocols.ladp`); the
server averages the uploads by ``|D_i| / D`` (Algorithm 1, line 6), sends each round the public KL estimates
(:func:`protocols.ladp.public_estimates` of the last two published global models, none in round 1) and reports
which layers got noise and how much.

``self.privacy`` (read by ``privacy_report``) composes ``T`` Gaussian releases of multiplier
``c0 / epsilon_r`` exactly (:class:`protocols.privacy.GdpAccountant`, :func:`protocols.ladp.round_epsilon`);
downlink = uplink (post-processing).  Once any client released an un-noised layer the model-level epsilon
is ``math.inf``; ``epsilon_noised_layers`` gives the guarantee of the noised layers alone.

Round figures (from each :class:`protocols.wire.ladp.NoiseReport`): ``noised_layers``, ``total_noise_norm``,
``aggregate_noise_norm`` (``sqrt(sum_i w_i^2 ||n_i||^2)``), ``epsilon_noised_layers``, ``epsilon_basic`` and
``noise_norm/<layer>``.  Accounting details: ``docs/methods/ladp.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid

from protocols import ladp
from protocols.config import ConfigError, RunConfig
from protocols.floor import NOISE_SCALE
from protocols.privacy import (
    GaussianEvent,
    GdpAccountant,
    PrivacyLedger,
    record_sensitivity,
    record_training_movement,
)
from protocols.privacy.signal import NoiseEstimate
from protocols.wire.arrays import from_record
from protocols.wire.common import merge_configs, num_examples
from protocols.wire.ladp import NoiseReport, PublicEstimates
from strategies.base import CancelStrategy, RoundFailed, RoundState


@dataclass
class LadpRound(RoundState):
    """A LaDP round: whether some upload released un-noised layers (set by the aggregate stage)."""

    unnoised: bool = False


class LadpStrategy(CancelStrategy):
    """Algorithm 1 of LaDP-FL plus per-layer noise reporting and exact composition."""

    #: The round loop may raise every layer's noise std by ``noise_scale`` (>= 1; the clients multiply their own
    #: plan's stds by it, never less than 1) to keep epsilon within the run's target (:mod:`strategies.run.budget`).
    scales_noise = True
    noise_scale = 1.0

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        try:
            #: Per-round Theorem 3 epsilon whose num-rounds releases compose to the run's epsilon.
            self.epsilon_round = ladp.round_epsilon(cfg.epsilon, cfg.delta, cfg.num_rounds)
            # c0 of the corrected Theorem 3 (c = c0 * B; the B cancels in sigma_min).
            self.c0 = ladp.theorem3_c(self.epsilon_round, cfg.delta, 1.0, "corrected")
        except (ValueError, ArithmeticError) as err:
            raise ConfigError(f"method 'ladp' cannot calibrate its noise for epsilon = {cfg.epsilon:g}, delta = "
                              f"{cfg.delta:g} over {cfg.num_rounds} rounds: {type(err).__name__}: {err}") from err
        #: Smallest noise multiplier sigma_j / Delta_f any noised layer gets.
        self.noise_multiplier = ladp.round_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
        std = self.noise_multiplier * record_sensitivity(cfg, 1)  # a one-record client's floor noise
        if not (math.isfinite(std) and std > 0):
            raise ConfigError(f"method 'ladp' cannot calibrate its noise for clip = {cfg.clip:g}, lr = {cfg.lr:g}, "
                              f"epsilon = {cfg.epsilon:g}: a client's noise std would be {std:g}, not a finite number > 0")
        # One exact (GDP) bound for both views; an un-noised upload composes a release without noise (inf).
        # The paper's claim, restricted to the noised layers, is the extra account "noised_layers".
        model = GdpAccountant()
        self.privacy = PrivacyLedger(cfg.delta, uplink=model, downlink=model, extra={"noised_layers": GdpAccountant()})
        #: The global model of the previous round (public) and this round's per-layer estimates from it.
        self._previous: dict | None = None
        self._estimates: dict[str, float] = {}

    def train_content(self, state: RoundState, node: int, arrays: ArrayRecord) -> RecordDict:
        """The global model, the round, and the public per-layer privacy estimates (:mod:`protocols.ladp`)."""
        scale = {NOISE_SCALE: float(self.noise_scale)} if self.noise_scale != 1.0 else {}
        return RecordDict({"arrays": arrays, "config": ConfigRecord(merge_configs(
            self.train_config(state.round), PublicEstimates(self._estimates).to_config(), scale))})

    def plan(self, grid: Grid, st: RoundState) -> LadpRound:
        """Plan stage: the round's estimates, KL between the model sent now and the one sent last round (both published)."""
        assert self.round_model is not None
        current = from_record(self.round_model)
        self._estimates = ladp.public_estimates(current, self._previous)
        self._previous = current
        return LadpRound(st.round, list(st.participants))

    def charge_release(self, state: RoundState) -> None:
        """Every noised layer gets at least multiplier z: the round is a Gaussian release with z (model and layers)."""
        event = GaussianEvent(self.noise_multiplier * self.noise_scale)
        self.privacy.compose(event)
        self.privacy.extra["noised_layers"].compose(event)

    def aggregate(self, state: LadpRound) -> ArrayRecord | None:
        """Aggregate stage: example-weighted mean (Algorithm 1 line 6) and the round's noise figures.

        Raises:
            RoundFailed: a reply's noise report is malformed.
        """
        by_node = state.replies
        reports, weights = [], []
        for node in sorted(by_node):
            metrics = by_node[node].content["metrics"]
            try:
                reports.append(NoiseReport.from_metrics(metrics))
            except ValueError as err:
                raise RoundFailed(f"round {state.round}: node {node} sent a malformed LaDP noise report: {err}") from err
            weights.append(float(num_examples(metrics)))
        arrays = super().aggregate(state)
        state.unnoised = any(r.unnoised_release for r in reports)
        total_w, n = sum(weights), len(reports)
        per_layer = [r.noise_norms() for r in reports]
        self.report(
            noised_layers=sum(r.noised_layers for r in reports) / n,
            total_noise_norm=sum(r.total_noise_norm for r in reports) / n,
            aggregate_noise_norm=math.sqrt(
                sum((w / total_w) ** 2 * r.total_noise_norm ** 2 for w, r in zip(weights, reports, strict=True))
            ),
            **self.privacy.extra_report(),  # epsilon_noised_layers
            epsilon_basic=state.round * self.epsilon_round,
            **{k: sum(layers.get(k, 0.0) for layers in per_layer) / n for k in sorted(set().union(*per_layer))},
        )
        return arrays

    def account(self, state: LadpRound) -> None:
        """Account stage: an upload with layers below R went out without noise, so no model-level DP is left."""
        if state.unnoised:
            self.privacy.compose(GaussianEvent(0.0))

    def noise_estimate(self, num_params: int) -> NoiseEstimate | None:
        """Round 1's measured noise norm in the mean vs ``lr clip E`` (E clipped steps on the largest partition)."""
        noise = self._round_report.get("aggregate_noise_norm")
        if noise is None or self.max_examples is None:
            return None
        c = self.cfg
        return NoiseEstimate(float(noise), record_training_movement(c, self.max_examples), c.num_rounds)

    def describe(self) -> dict[str, float | str]:
        return {
            "epsilon_per_round": self.epsilon_round,
            "delta_per_round": self.cfg.delta,
            "theorem3_c0": self.c0,
            "theorem3_c": self.c0 * self.cfg.ladp_kl_cap,
            "min_noise_multiplier": self.noise_multiplier,
            "norm_threshold_R": self.cfg.ladp_norm_threshold,
            "kl_cap_B": self.cfg.ladp_kl_cap,
            "grad_clip_Gc": self.cfg.clip,
            "composition": "exact Gaussian composition (GDP), epsilon at run-config delta",
        }

