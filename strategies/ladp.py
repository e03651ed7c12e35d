"""LaDP-FL server (Li et al., Algorithm 1): example-weighted mean of layer-wise noised models.

Clients (:mod:`client.methods.ladp`) train with per-example clipped gradients and add Gaussian
noise to the layers whose weight norm reaches ``R`` (``ladp-norm-threshold``), with
``sigma_j = c Delta_f / (epsilon P_j)`` and ``Delta_f`` the record-level sensitivity of their
training (``2 G_c eta / N_i`` for one full-batch step; it replaces Theorem 2's ``2 eta E G_c``,
see :mod:`protocols.ladp`); the server only averages the noisy uploads by
``|D_i| / D`` (Algorithm 1 line 6) and reports, per round, which layers got noise and
how much.

Privacy accounting (``self.privacy``, read by ``privacy_report``)
----------------------------------------------------------------
``epsilon``/``delta`` in the run config are the *whole-run* target (the convention of every
method): each round uses the paper's Theorem 3 at the per-round ``epsilon_r``
(:func:`protocols.ladp.round_epsilon`, client and server alike) whose ``T`` releases
compose exactly to ``epsilon``.  With the corrected constant ``c = c0 B`` and ``P_j <= B`` every noised
layer gets ``sigma_j >= c0 Delta_f / epsilon`` and the whole model moves by at most
``Delta_f`` (L2) between datasets that differ in one record, so one round is a Gaussian mechanism with
noise multiplier ``z = sigma_min / Delta_f = c0 / epsilon_r`` (independent of the
client's ``Delta_f``).  Over ``T`` rounds we compose *exactly*
(:class:`protocols.privacy.GdpAccountant`): ``T`` Gaussian releases with multiplier ``z``
are equivalent to one with multiplier ``z / sqrt(T)`` (Gaussian DP, Dong-Roth-Su 2019),
whose epsilon at ``delta`` comes from the analytic Gaussian privacy profile (Balle &
Wang 2018).  This is tighter than the basic composition
``(T eps, T delta)`` (also reported, as ``epsilon_basic``) and than RDP.  No sampling
amplification: the server knows whom it sampled.  The same bound is reported for the
downlink (the global model is post-processing of the uploads).

Data-independent noise scale: the paper's Algorithm 2 selects layers and sets ``P_j`` from the trained local
model, a function of the private data that the Gaussian-mechanism argument does not cover (a record that moves
the KL changes sigma, which the upload reveals).  Here the server sends each round the KL between the last two
global models it published (:func:`protocols.ladp.public_estimates`, none in round 1) and the client selects
on the received global model's layer norms (:func:`protocols.ladp.plan_public_noise`), so every sigma_j is
fixed before the client touches its data.

Honest caveat: layers below ``R`` are uploaded *without* noise, so there is no model-level guarantee: once any
client has released an un-noised layer, ``epsilon`` is reported as infinite (``math.inf``); the guarantee
restricted to the noised layers (the paper's claim) is reported per round as ``epsilon_noised_layers``.

Round figures (``report``, written to metrics.jsonl), from each client's
:class:`client.messages.ladp.NoiseReport`: ``noised_layers`` (mean number
of noised layers per client), ``total_noise_norm`` (mean per client of the L2 norm of
its noise), ``aggregate_noise_norm`` (expected L2 norm of the noise left in the
weighted mean, ``sqrt(sum_i w_i^2 ||n_i||^2)``), ``epsilon_noised_layers``,
``epsilon_basic`` and ``noise_norm/<layer>`` (expected, mean per client).  The aggregated client
metrics also carry ``sigma/<layer>``, ``kl/<layer>`` (the public estimate used) and ``selected/<layer>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr.app import ArrayRecord, RecordDict
from flwr.serverapp import Grid

from client.messages.common import merge_configs, num_examples
from client.messages.ladp import NoiseReport, PublicEstimates
from client.wire import from_record
from protocols import ladp
from protocols.config import RunConfig
from protocols.privacy import GaussianEvent, GdpAccountant, PrivacyLedger, record_training_movement
from protocols.privacy.signal import NoiseEstimate
from strategies.base import CancelStrategy, RoundFailed, RoundState


@dataclass
class LadpRound(RoundState):
    """A LaDP round: whether some upload released un-noised layers (set by the aggregate stage)."""

    unnoised: bool = False


class LadpStrategy(CancelStrategy):
    """Algorithm 1 of LaDP-FL plus per-layer noise reporting and exact composition."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        #: Per-round Theorem 3 epsilon whose num-rounds releases compose to the run's epsilon.
        self.epsilon_round = ladp.round_epsilon(cfg.epsilon, cfg.delta, cfg.num_rounds)
        # c0 of the corrected Theorem 3 (c = c0 * B; the B cancels in sigma_min).
        self.c0 = ladp.theorem3_c(self.epsilon_round, cfg.delta, 1.0, "corrected")
        #: Smallest noise multiplier sigma_j / Delta_f any noised layer gets.
        self.noise_multiplier = self.c0 / self.epsilon_round
        # One exact (GDP) bound for both views; an un-noised upload composes a release without noise (inf).
        # The paper's claim, restricted to the noised layers, is the extra account "noised_layers".
        model = GdpAccountant()
        self.privacy = PrivacyLedger(cfg.delta, uplink=model, downlink=model, extra={"noised_layers": GdpAccountant()})
        #: The global model of the previous round (public) and this round's per-layer estimates from it.
        self._previous: dict | None = None
        self._estimates: dict[str, float] = {}

    def train_content(self, state: RoundState, node: int, arrays: ArrayRecord) -> RecordDict:
        """The global model, the round, and the public per-layer privacy estimates (:mod:`protocols.ladp`)."""
        return RecordDict({"arrays": arrays, "config": merge_configs(
            self.train_config(state.round), PublicEstimates(self._estimates).to_config())})

    def plan(self, grid: Grid, st: RoundState) -> LadpRound:
        """Plan stage: the round's estimates, KL between the model sent now and the one sent last round (both published)."""
        assert self.round_model is not None
        current = from_record(self.round_model)
        self._estimates = ladp.public_estimates(current, self._previous)
        self._previous = current
        return LadpRound(st.round, list(st.participants))

    def charge_release(self, state: RoundState) -> None:
        """Every noised layer gets at least multiplier z: the round is a Gaussian release with z (model and layers)."""
        event = GaussianEvent(self.noise_multiplier)
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
