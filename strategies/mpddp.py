"""Server stages of MP_Server + DDP_Client (Yang et al.) and its ablations MP-DP-Naive and MP-CDP.

The round protocol, equations and caveats: ``docs/methods/mpddp.md``.  Models: ``model = "mlp"`` with at least one
hidden layer (a ReLU MLP of ``nn.Linear`` layers, :class:`protocols.task.models.MLP`), trained on the squared loss;
anything else is refused with a ``ConfigError`` at construction.

The stages of :mod:`strategies.stages`: keys (``mpddp`` only, :class:`strategies.key_phase.KeyPhase`), plan
(MP_Server, Algorithm 1: a fresh secret R, only the perturbed model W-hat is sent,
:class:`strategies.mp_server.MpStrategyBase`), train (one full-batch gradient at W-hat plus Psi, Phi and the
method's noise), recover (``mpddp``: a dropped participant's Delta's, :mod:`strategies.recovery`), aggregate
(MU_Server, Algorithm 3: unweighted mean, recovery Eq. 22, the server optimizer's step; ``mpcdp`` adds its noise
first), account (the given-R account, ``epsilon_given_R``, and a recovery's shortfall).  Calibration per record,
sensitivity 2 clip / n_k in the perturbed space: ``mpddp`` Theorem 10 (complete graph) or 11 (n-out, K >= 81),
``mpdp-naive`` :func:`protocols.mpddp.calibrate_ldp`, held by :meth:`~strategies.mp_server.MpStrategyBase.round_noise`;
every member's server Gaussian given R (``mpcdp``: all of it; the others less their clients' Gaussian: ``mpddp``'s
eta with ``mpddp-eta="gaussian"``, ``mpdp-naive``'s noise) by
:meth:`~strategies.mp_server.MpStrategyBase.given_r_noise`.
"""

from __future__ import annotations

import math
import time

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from protocols.config import ConfigError, RunConfig
from protocols.floor import ETA_SHARE, mpddp_complete, mpddp_floor, mpdp_naive_sigma
from protocols.mpddp import (
    eq23_epsilon,
    eta_variance,
    mu_server,
    n_out_shortfall,
    pairwise_delta,
    round_event,
    round_multiplier,
    theta_after,
)
from protocols.mpddp import flatten as mp_flatten
from protocols.mpddp import unflatten as mp_unflatten
from protocols.mpddp.expansion import Layer
from protocols.privacy import (
    DpCompositionAccountant,
    DpEvent,
    GaussianEvent,
    PerUnitAccountant,
    PrivacyLedger,
    RdpAccountant,
    receiver_std,
)
from protocols.wire.mpddp import DdpNoise, NaiveNoise, mean_upload
from strategies.base import RoundFailed, RoundState
from strategies.key_phase import KeyPhase
from strategies.mp_server import MpRound, MpStrategyBase, check_model, layers_from_weights, weights_from_layers
from strategies.recovery import PairwiseRecovery, charge_shortfall, probe_direction

__all__ = ["ETA_SHARE", "MpRound", "MpcdpStrategy", "MpddpStrategy", "MpdpNaiveStrategy", "check_model",
           "layers_from_weights", "weights_from_layers"]


class MpddpStrategy(PairwiseRecovery, MpStrategyBase):
    """MP_Server + DDP_Client (Algorithms 1-4) with the shared key phase and Theorem 10/11 calibration."""

    #: The round loop may raise both scales by ``noise_scale`` (theta / scale^2) to keep epsilon within the run's
    #: target (:mod:`strategies.run.budget`); the clients use the larger of the sent scales and their own.
    scales_noise = True
    noise_scale = 1.0

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        k = cfg.clients_per_round
        if k < 2:
            raise ConfigError("method 'mpddp' needs at least 2 clients per round (pairwise noise); "
                              f"num-clients x sample-rate gives {k}")
        self.keys = KeyPhase(cfg)
        self.n_out = cfg.n_out if cfg.graph == "n-out" else None
        try:
            self._calibration(k, 1)  # coverage only: the sensitivity just scales the sigmas
        except ValueError as err:
            raise ConfigError(f"method 'mpddp' with K = {k} clients per round, epsilon = {cfg.epsilon}, "
                              f"delta = {cfg.delta}, graph = {cfg.graph!r}: {err}") from err
        # Per record owner (client), over the rounds it took part in: the noise is calibrated for the most rounds
        # the public schedule samples any client in (KeyPhase.releases); Theorem 11 rounds compose basically.
        nominal = PerUnitAccountant(None if self._complete(k) else DpCompositionAccountant())
        self.privacy = PrivacyLedger(cfg.delta, downlink=nominal, headline="downlink", extra={"uplink_nominal": nominal})
        self._given_r = PerUnitAccountant()

    def _complete(self, k: int) -> bool:
        return mpddp_complete(self.cfg, k)

    def _calibration(self, k: int, min_size: int, scale: float = 1.0) -> tuple[float, float, float]:
        """(sigma_eta, sigma_delta, theta) for K = k clients, the smallest of size ``min_size`` (ValueError if not covered)."""
        # The clients' own floor: one calibration for both ends, for the public schedule's releases.
        return mpddp_floor(self.cfg, k, min_size, scale, self._releases())

    def _releases(self) -> int:
        """Releases the noise is calibrated for: the schedule's most participations (``num-rounds`` before a roster)."""
        return self.keys.releases()

    def exchange_keys(self, grid: Grid, st: RoundState) -> None:
        """Keys stage: the shared key phase (:meth:`PairwiseRecovery.exchange_keys`), then the masking line."""
        super().exchange_keys(grid, st)
        assert st.keys is not None
        self.announce_masking(st.keys.neighbours)

    def pair_neighbours(self, state: MpRound) -> dict[int, list[int]] | None:
        """The round's pairing graph (None before the key stage)."""
        return None if state.keys is None else state.keys.neighbours

    def update(self, state: MpRound, records: list[tuple[int, ArrayRecord]]) -> tuple[list[Layer], list[Layer]]:
        """MU_Server on the survivors' mean, minus the Delta's they share with dropped peers (dropout recovery).

        The survivors revealed this round's pair seeds with the dropped (:mod:`strategies.recovery`); the server
        expands them with the client's own sampler and subtracts ``sum_i sum_{v dropped} Delta_iv / |S|``.
        """
        mean = mean_upload(records, len(state.layers))
        rec = self.recovered(state)
        self.probe_corrections = []
        if rec is not None and isinstance(state.noise, DdpNoise):
            t0 = time.process_time()
            flat = mp_flatten(mean.grads)
            if rec.masks:  # double masking: the rebuilt self-masks come off the mean
                flat = flat - self.mask_sum(state, flat.size) / len(records)
            probe = probe_direction(state.keys.probe_seed, flat.size) if self.cfg.cancellation_check and state.keys else None
            corr_sum = np.zeros(flat.size)
            for node, revealed in sorted(rec.material.items()):
                seeds = {j: seed for j, seed in revealed.items() if not rec.is_kept(node, j)}
                corr = pairwise_delta(flat.size, own_id=node, pair_seeds=seeds, sigma_delta=state.noise.sigma_delta)
                corr_sum += corr
                if probe is not None:
                    self.probe_corrections.append(float(np.dot(corr, probe)))
            self.probe_corrections = rec.probe_corrections(self.probe_corrections)
            mean = mean.with_grads(mp_unflatten(flat - corr_sum / len(records), list(mean.grads)))
            self.report(recovery_server_s=time.process_time() - t0)
            if rec.gone_any:
                state.theta_after = self._theta_after(state, len(records))
        mean = self.given_r_noise(state, mean, [n for n, _ in records])
        return mu_server(state.layers, mean, state.secret, self.optimizer)

    def gaussian_variance(self, state: MpRound, nodes: list[int]) -> float:
        """The survivors' eta in each entry of their mean when it is Gaussian given R, left to a receiving participant.

        ``(K - 1) sigma_eta^2 / K^2`` for K nodes (:func:`protocols.privacy.receiver_std`: a participant knows its own
        eta; the paper counts all K).  ``mpddp-eta="gaussian"`` only (the paper's DN(sigma, 1) is uniform given R:
        0).  sigma_eta is the scale the server sent, which each client's floor only raises; the Delta's cancel in the
        mean and are not counted.
        """
        if self.cfg.mpddp_eta != "gaussian" or not isinstance(state.noise, DdpNoise) or not nodes:
            return 0.0
        k = len(nodes)
        return receiver_std([eta_variance(state.noise.sigma_eta, "gaussian") / k**2] * k) ** 2

    def model_multiplier(self, state: MpRound) -> float:
        """The round's Gaussian multiplier, times the noise scale it was planned and charged with (``state``).

        Not the strategy's current ``noise_scale``: with ``unmask-next-round`` a round aggregates during the next
        one, after the budget guard has decided that round's scale.

        z for the releases (Theorem 10 graph), else the Gaussian meeting Eq. 23 at (epsilon/T, delta/T) (Theorem 11
        rounds compose basically).
        """
        complete = self._complete(self.cfg.clients_per_round)
        return round_multiplier(self.cfg.epsilon, self.cfg.delta, self._releases(), complete=complete) * state.noise_scale

    def _theta_after(self, state: MpRound, survivors: int) -> float:
        """Theorem 10/11's theta for the ``survivors`` left after a recovery (per unit sensitivity, as ``state.theta``).

        Raises:
            RoundFailed: the survivors are outside the calibration.
        """
        assert isinstance(state.noise, DdpNoise)
        # The sigmas are absolute: divide by the round's record sensitivity (mpddp_floor's, smallest listed |D_i|).
        sens = self.record_sensitivity(min(state.noise.sizes))
        se, sd = state.noise.sigma_eta / sens, state.noise.sigma_delta / sens
        try:
            theta = theta_after(se, sd, survivors, complete=self._complete(len(state.participants)), n_out=self.n_out)
        except ValueError as err:
            raise RoundFailed(f"round {state.round}: {survivors} survivors are outside the calibration: {err}") from err
        self.report(theta_after_recovery=theta)
        return theta

    def _charge_recovery(self, state: MpRound, theta: float) -> None:
        """Charge the nominal accounts with the round's noise really there (``theta`` after recovery)."""
        if theta <= state.theta:
            return
        units = state.participants
        if not self._complete(self.cfg.clients_per_round):  # Theorem 11 rounds, basic composition
            extra = n_out_shortfall(theta, self.cfg.epsilon, self.cfg.delta, self._releases())
            if extra > 0:
                self.privacy.downlink.compose(DpEvent(extra), units=units)
            return
        charge_shortfall(self.privacy.downlink, 1 / math.sqrt(state.theta), 1 / math.sqrt(theta), units=units)
        min_r = self._min_r(state)
        charge_shortfall(self._given_r, min_r / math.sqrt(state.theta), min_r / math.sqrt(theta), units=units)

    def round_noise(self, state: MpRound) -> DdpNoise:
        k = state.keys.calibration_size(self._complete) if state.keys is not None else len(state.participants)
        sizes = state.keys.num_examples if state.keys is not None else {}
        if any(n not in sizes for n in state.participants):
            raise RoundFailed(f"round {state.round}: a participant sent no |D_i| in the key phase; the record "
                              "sensitivity cannot be computed")
        listed = tuple(int(sizes[n]) for n in state.participants)  # PeerKeys.participants order
        state.noise_scale = self.noise_scale
        try:
            se, sd, state.theta = self._calibration(k, min(listed), state.noise_scale)
        except ValueError as err:
            raise RoundFailed(f"round {state.round}: {k} clients passed the key phase and the "
                              f"calibration does not cover it: {err}") from err
        return DdpNoise(se, sd, listed)

    def check_replies(self, state: MpRound, by_node: dict[int, Message], errors: list[str]) -> None:
        missing = sorted(set(state.participants) - set(by_node))
        rec = self.recovered(state)
        if rec is not None and set(rec.dropped) == set(missing):
            self.report_recovery(state, missing)
        elif missing:
            raise RoundFailed(
                f"round {state.round}: {len(missing)} of {len(state.participants)} clients did not upload after the "
                f"key phase ({missing[:5]}{'...' if len(missing) > 5 else ''}); their pairwise noise Delta would "
                "not cancel in the mean and their pair seeds were not recovered, so the round is discarded"
                + (f"; errors: {errors[0].splitlines()[0]}" if errors else ""))

    def account(self, state: MpRound) -> None:
        """Account stage: the given-R account of the round (uploads reached the server), then a recovery's shortfall."""
        if not state.aggregating:
            return
        if state.theta > 0:
            self._given_r.compose(GaussianEvent(self._min_r(state) / math.sqrt(state.theta)), units=state.participants)
            self.report(epsilon_given_R=self._given_r_epsilon())
        if state.theta_after is not None:
            self._charge_recovery(state, state.theta_after)

    def describe(self) -> dict[str, float | str]:
        k = self.cfg.clients_per_round
        se, sd, theta = self._calibration(k, 1)
        out = super().describe()
        out.update({
            "graph": "complete (Theorem 10)" if self._complete(k) else f"n-out n={self.n_out} (Theorem 11)",
            "clients_per_round": k,
            "sigma_eta_per_sensitivity": se / self.record_sensitivity(1),
            "sigma_delta_per_sensitivity": sd / self.record_sensitivity(1),
            "theta_round": theta,
            "eta_share": ETA_SHARE,
            "aggregate_noise_std_per_sensitivity": se / self.record_sensitivity(1) / math.sqrt(k),
            "epsilon_round_eq23": eq23_epsilon(theta, self.cfg.delta) if self._complete(k) else
            self.cfg.epsilon / self.cfg.num_rounds,
            "guarantee": f"model: given R (the clients' eta counted only if Gaussian, here {self.cfg.mpddp_eta}, "
                         "topped up by the server's Gaussian, protocols.mpddp.given_r_topup); uploads: the "
                         "paper's nominal Theorem 10/11 figure, not valid against the server, which knows R and gets "
                         "Psi/Phi unnoised",
        })
        if not self._complete(k):
            out["composition"] = "basic composition of Theorem 11 rounds at (epsilon/T, delta/T)"
        return out

    def planned_release(self, server_round: int) -> DpEvent | GaussianEvent:
        """What :meth:`charge_release` composes per participant at noise scale 1 (the budget guard's plan)."""
        return round_event(self.cfg.epsilon, self.cfg.delta, self._releases(),
                           complete=self._complete(self.cfg.clients_per_round))

    def charge_release(self, state: MpRound) -> None:
        """The planned round, per participant: a Gaussian of multiplier z (complete) or an (eps/T, delta/T) round.

        Theorem 10 / 11; T = the releases of the public schedule (:meth:`_releases`): :meth:`planned_release`, the
        Gaussian's multiplier raised by the budget guard's ``noise_scale`` the round was planned with.
        """
        event = self.planned_release(state.round)
        if isinstance(event, GaussianEvent):
            event = GaussianEvent(event.noise_multiplier * state.noise_scale)
        self.privacy.compose(event, units=state.participants)


class MpdpNaiveStrategy(MpStrategyBase):
    """MP-DP-Naive (Section 6.3): model perturbation + N(0, (z S)^2) on each perturbed gradient."""

    def round_noise(self, state: MpRound) -> NaiveNoise:
        """The multiplier z: each client adds ``z 2 clip / |D_k|`` from its own size (the server need not know it)."""
        return NaiveNoise(self.z)

    def mean_noise_std(self) -> float | None:
        """Independent noise ``z S`` per client: ``z S / sqrt(K)`` per entry of the mean gradient."""
        if self.min_size is None:
            return None
        return mpdp_naive_sigma(self.cfg, self.min_size) / math.sqrt(self.cfg.clients_per_round)

    def gaussian_variance(self, state: MpRound, nodes: list[int]) -> float:
        """Each client's ``N(0, (z S_k)^2)`` (:func:`protocols.floor.mpdp_naive_sigma`) in the mean of K uploads.

        Left to a receiving participant, which knows its own (:func:`protocols.privacy.receiver_std`).
        """
        sizes = state.sizes or {}
        return receiver_std(mpdp_naive_sigma(self.cfg, sizes[n]) ** 2 / len(nodes) ** 2 for n in nodes) ** 2

    def account(self, state: MpRound) -> None:
        """Account stage: the given-R account of one upload (R-divided: sensitivity kappa S, noise z S)."""
        if state.aggregating:
            self._given_r.compose(GaussianEvent(self.z / state.kappa))
            self.report(epsilon_given_R=self._given_r_epsilon())

    def describe(self) -> dict[str, float | str]:
        out = super().describe()
        out.update({"sigma_per_sensitivity": self.z,
                    "guarantee": "model: given R (the clients' Gaussian, topped up by the server where kappa needs it); "
                                 "uploads: epsilon_given_R (R-divided, multiplier z / kappa)"})
        return out



class MpcdpStrategy(MpStrategyBase):
    """MP-CDP (Section 6.3): noise-free uploads of per-example-clipped means; the (trusted) server adds the Gaussian.

    Record level: the server cannot clip per record (it gets per-client means), so the clients clip per
    example on W-hat as in mpddp and the server adds ``N(0, (z S / K)^2)`` to the mean PERTURBED gradient,
    ``S = 2 clip / min |D_i|`` of the uploads (their num-examples): the same place and the same record
    sensitivity as mpddp's eta (which is within 5 % of this level), so the two differ only in who adds the noise.
    The server's Gaussian is the base's given-R noise (:meth:`~strategies.mp_server.MpStrategyBase.given_r_noise`,
    std ``z kappa S / K``: no client noise to count).
    """

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        # Trusted server: it sees every client's exact gradient (no uplink guarantee); the model is CDP.
        self.privacy = PrivacyLedger(cfg.delta, downlink=RdpAccountant(), headline="downlink")

    def describe(self) -> dict[str, float | str]:
        out = super().describe()
        out.update({"aggregate_noise_std_per_sensitivity": self.z / self.cfg.clients_per_round,
                    "guarantee": "downlink CDP given R on the perturbed mean (record level, per-example clip of g^, "
                                 "Psi, Phi on W-hat, noise z kappa S / K); uplink none (trusted server)"})
        return out
