"""MP_Server and MU_Server (Yang et al., Algorithms 1 and 3): the server side shared by mpddp, mpdp-naive, mpcdp.

:class:`MpStrategyBase` perturbs the true MLP with a fresh one-time secret R each round (plan stage), sends only
W-hat, and recovers the mean perturbed gradient with Eq. (22) before the server optimizer's step (aggregate
stage).  The methods (:mod:`strategies.mpddp`) differ in :meth:`MpStrategyBase.round_noise` (the scales the
clients get), :meth:`MpStrategyBase.update` and their accounts.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from protocols.config import ConfigError, RunConfig
from protocols.mpddp import (
    MPSecret,
    given_r_topup,
    mask_reference,
    mp_record_sensitivity,
    mp_server,
    mu_server,
    naive_client,
    output_scale,
    relative_distance,
    secret_factor,
    torch_threads,
)
from protocols.mpddp.expansion import Layer
from protocols.mpddp.gradients import ClientUpload
from protocols.privacy import (
    GaussianEvent,
    PerUnitAccountant,
    PrivacyLedger,
    RdpAccountant,
    accountant_from_state,
    noise_multiplier,
)
from protocols.privacy.signal import NoiseEstimate, Release, gaussian_norm
from protocols.server_optimizers import NonFiniteGradient, make_server_optimizer, optimizer_from_state
from protocols.wire.arrays import Weights, from_record
from protocols.wire.common import TrainIns, merge_configs, num_examples
from protocols.wire.mpddp import DdpNoise, NaiveNoise, PerturbedModel, mean_upload
from strategies.base import CancelStrategy, RoundFailed, RoundState
from strategies.records import to_record
from strategies.recovery import corrected_residual
from strategies.validation import FLOAT_DTYPES, ArraySpec, UploadSpec


# ----------------------------------------------------------------------------- model layout
def layers_from_weights(weights: Mapping[str, np.ndarray]) -> list[Layer]:
    """MLP ``state_dict`` arrays (``layers.i.weight``, ``layers.i.bias``) -> [(W, b), ...] float64 tensors."""
    n = len(weights) // 2
    expected = [f"layers.{i}.{p}" for i in range(n) for p in ("weight", "bias")]
    if sorted(weights) != sorted(expected) or len(weights) % 2:
        raise RoundFailed(f"global model is not an MLP state_dict (layers.i.weight/bias); keys: {sorted(weights)}")
    return [(torch.as_tensor(np.asarray(weights[f"layers.{i}.weight"], dtype=np.float64)),
             torch.as_tensor(np.asarray(weights[f"layers.{i}.bias"], dtype=np.float64))) for i in range(n)]


def weights_from_layers(layers: Sequence[Layer]) -> Weights:
    """Inverse of :func:`layers_from_weights`."""
    out: Weights = OrderedDict()
    for i, (w, b) in enumerate(layers):
        out[f"layers.{i}.weight"] = w.detach().cpu().double().numpy().copy()
        out[f"layers.{i}.bias"] = b.detach().cpu().double().numpy().copy()
    return out


def check_model(cfg: RunConfig) -> None:
    """Refuse models the model perturbation does not cover (ConfigError)."""
    if cfg.model != "mlp":
        raise ConfigError(f"method {cfg.method!r} supports only model = 'mlp' (a ReLU MLP, the layer "
                          f"expansion of Eq. 12 needs Linear layers); got model = {cfg.model!r}")
    if len(cfg.hidden_sizes) < 1:
        raise ConfigError(f"method {cfg.method!r} needs an MLP with at least one hidden layer (L >= 2, "
                          "Eq. 14 needs r^(1) and s^(L-1)); run-config 'hidden' is empty")


def _flat(grads: Sequence[Layer]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for pair in grads for t in pair])


@dataclass
class MpRound(RoundState):
    """The round's secret and plan (never sent, except ``model``/``noise``; ``keys``: mpddp's key round)."""

    layers: list[Layer]
    secret: MPSecret
    #: W-hat as sent (one record, the same for every participant).
    model: ArrayRecord
    #: The noise scales sent to the clients (None for mpcdp).
    noise: DdpNoise | NaiveNoise | None = None
    #: Per-round privacy-loss variance (mpddp).
    theta: float = 0.0
    #: ``|D_i|`` of the uploads (the replies' num-examples; mpcdp's record sensitivity).
    sizes: dict[int, int] | None = None
    #: Privacy-loss variance of the survivors after a dropout recovery (mpddp; set by the aggregate stage).
    theta_after: float | None = None
    #: kappa = max(1, (||r|| / rho)^2): a record's effect given R over its record sensitivity (server-only).
    kappa: float = 1.0
    #: The budget guard's noise scale the round was planned and charged with (``mpddp``; 1 for the others).
    noise_scale: float = 1.0


# ----------------------------------------------------------------------------- strategies
class MpStrategyBase(CancelStrategy):
    """MP_Server / MU_Server (Algorithms 1 and 3) shared by mpddp, mpdp-naive and mpcdp."""

    wire_dtype = np.float64

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        check_model(cfg)
        #: The server's step with the recovered gradient (xi = ``mpddp-server-lr``; Adam by the regime: post-processing).
        self.optimizer = make_server_optimizer(cfg.server_optimizer, cfg.mpddp_server_lr)
        self.z = noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
        # Nominal (paper-model) guarantee: a Gaussian release with multiplier z per round.  It is the published
        # model's epsilon; the uploads have none (Psi/Phi go up un-noised and the server knows R), so the
        # uplink is null and the paper's figure is the extra account "uplink_nominal" (same releases).
        nominal = RdpAccountant()
        self.privacy = PrivacyLedger(cfg.delta, downlink=nominal, headline="downlink", extra={"uplink_nominal": nominal})
        self._given_r = RdpAccountant()
        #: Recovered aggregate gradient of the last successful round, [(dW, db), ...] (tests, diagnostics).
        self.last_gradient: list[Layer] | None = None
        #: Cancellation check: projections of what dropout recovery removed this round (None: not measurable).
        self.probe_corrections: list[float] | None = []
        #: Smallest ``|D_i|`` among the last round's uploads (None before the first round).
        self.min_size: int | None = None

    def record_sensitivity(self, size: int) -> float:
        """``2 clip / size``: one record's L2 effect on the mean of ``size`` per-example-clipped perturbed gradients."""
        return mp_record_sensitivity(self.cfg.clip, size, adjacency=self.cfg.adjacency)

    def mean_noise_std(self) -> float | None:
        """Per-entry std of the DP noise in the mean perturbed gradient (None before the first round).

        The CDP level ``z S / K``, S = the record sensitivity of the smallest client; mpddp's eta keeps the
        noise within 5 % of it; mpdp-naive overrides (``z S / sqrt(K)``).
        """
        if self.min_size is None:
            return None
        return self.z * self.record_sensitivity(self.min_size) / self.cfg.clients_per_round

    def noise_estimate(self, num_params: int) -> NoiseEstimate | None:
        """Noise in the mean gradient (:meth:`mean_noise_std` per entry) vs the clipped mean's bound ``clip``."""
        std = self.mean_noise_std()
        if std is None:
            return None
        return NoiseEstimate(gaussian_norm(std, num_params), self.cfg.clip, self.cfg.num_rounds, space="gradient")

    def _release(self, flat: torch.Tensor, secret: MPSecret) -> Release | None:
        """The recovered mean gradient the server optimizer steps with (:attr:`last_release`), and its noise.

        Recovery multiplies the mean noise entrywise by R: power std^2 sum R^2, effective dim
        (sum R^2)^2 / sum R^4.
        """
        std = self.mean_noise_std()
        if std is None:
            return None
        r2 = [rm.detach().double().square() for rm in secret.trainable_R()]
        p2 = math.fsum(float(x.sum()) for x in r2)
        p4 = math.fsum(float(x.square().sum()) for x in r2)
        return Release(flat.detach().double().cpu().numpy(), std * std * p2, p2 * p2 / p4 if p4 > 0 else None)

    # ------------------------------------------------------------------ what the three methods differ in
    def round_noise(self, state: MpRound) -> DdpNoise | NaiveNoise | None:
        """Calibration: the noise scales sent to the clients of ``state`` (None: clients add none)."""
        return None

    def check_replies(self, state: MpRound, by_node: dict[int, Message], errors: list[str]) -> None:
        """Refuse rounds whose aggregate would be wrong (mpddp: every participant must upload)."""

    def upload_spec(self, state: MpRound) -> UploadSpec:
        """3L arrays ``up.i``: gradients (float64, (n_l, n_{l-1}+1)), Psi ((n_L, n_l, n_{l-1}+1)), Phi (as the gradient)."""
        blocks = [(int(w.shape[0]), int(w.shape[1]) + 1) for w, _ in state.layers]
        n_out = blocks[-1][0]
        shapes = [*blocks, *((n_out, *b) for b in blocks), *blocks]
        return {f"up.{i}": ArraySpec(shape, ("float64",) if i < len(blocks) else FLOAT_DTYPES)
                for i, shape in enumerate(shapes)}

    def update_of(self, state: MpRound, node: int, flat: np.ndarray) -> np.ndarray:
        """The whole upload (gradients and side information; no bound is guaranteed: the round-median rule)."""
        return flat

    def update(self, state: MpRound, records: list[tuple[int, ArrayRecord]]) -> tuple[list[Layer], list[Layer]]:
        """MU_Server (Algorithm 3) on the streamed mean of the uploads: (new model, recovered gradient)."""
        mean = self.given_r_noise(state, mean_upload(records, len(state.layers)), [n for n, _ in records])
        return mu_server(state.layers, mean, state.secret, self.optimizer)

    def model_multiplier(self, state: MpRound) -> float:
        """The Gaussian multiplier of the model's claim for round ``state`` (charged by :meth:`charge_release`)."""
        return self.z

    def gaussian_variance(self, state: MpRound, nodes: list[int]) -> float:
        """Variance of the Gaussian noise the clients ``nodes`` put in each entry of the mean (given R); none here."""
        return 0.0

    def given_r_noise(self, state: MpRound, mean: ClientUpload, nodes: list[int]) -> ClientUpload:
        """The mean upload plus the Gaussian that makes the round's release a Gaussian mechanism given R.

        Given R, a record moves the R-divided release by at most ``kappa S / K`` (S: the record sensitivity of the
        smallest upload, :func:`protocols.mpddp.calibration.secret_factor`); the server adds
        :func:`protocols.mpddp.calibration.given_r_topup` of std for multiplier :meth:`model_multiplier`, counting
        the clients' Gaussian noise (:meth:`gaussian_variance`), before recovery (Eq. 22).
        """
        sizes = state.sizes or {}
        sens = self.record_sensitivity(min(sizes[n] for n in nodes) if sizes else 1)
        std = given_r_topup(self.model_multiplier(state), state.kappa, sens, len(nodes), self.gaussian_variance(state, nodes))
        self.report(secret_factor=state.kappa, given_r_noise_std=std)
        return naive_client(mean, eta_seed=os.urandom(32), sigma=std) if std > 0 else mean

    # ------------------------------------------------------------------ stages
    def plan(self, grid: Grid, st: RoundState) -> MpRound:
        """Plan stage, MP_Server: a fresh secret R, the perturbed model W-hat and the round's noise scales.

        Raises:
            RoundFailed: the global model is not an MLP, or the calibration does not cover the round.
        """
        assert self.round_model is not None
        with torch_threads(1):  # tiny matrices: thread hand-offs dominate otherwise
            layers = layers_from_weights(from_record(self.round_model))
            w_hat, secret = mp_server(layers, os.urandom(32), additive_scale=output_scale(layers))
            w_hat_arrays = PerturbedModel(tuple(m.detach().cpu().numpy() for m in w_hat)).to_arrays()
            state = MpRound(st.round, list(st.participants), layers, secret, to_record(w_hat_arrays, np.float64), keys=st.keys)
            state.kappa = secret_factor(float(secret.r_vec.norm()), mask_reference(w_hat[-1].detach().cpu().numpy()))
            state.noise = self.round_noise(state)
            if state.noise is not None:
                self.report(**{k: v for k, v in asdict(state.noise).items() if k != "sizes"})  # the scales
            dist = relative_distance(layers, w_hat)
        self.report(client_model_distance=dist["overall"], client_model_row_cosine_l1=dist["row_cosine"][0])
        return state

    def train_content(self, state: MpRound, node: int, arrays: ArrayRecord) -> RecordDict:
        """W-hat (never the true model ``arrays``), the round, and the method's noise scales and peers."""
        parts = [TrainIns(state.round).to_config()]
        if state.keys is not None:
            parts.append(state.keys.peer_keys(node).to_config())
        if state.noise is not None:
            parts.append(state.noise.to_config())
        return RecordDict({"arrays": state.model, "config": ConfigRecord(merge_configs(*parts))})

    def charge_release(self, state: MpRound) -> None:
        """The planned round: a Gaussian release with multiplier z (no sampling amplification)."""
        self.privacy.compose(GaussianEvent(self.z))

    def aggregate(self, state: MpRound) -> ArrayRecord:
        """Aggregate stage, MU_Server: unweighted mean, recovery (Eq. 22), update with xi.

        Raises:
            RoundFailed: the replies cannot make the round's aggregate (:meth:`check_replies`), an upload is
                malformed or the recovered gradient is not finite.
        """
        with torch_threads(1):
            return self._aggregate(state, state.replies, state.errors)

    def _aggregate(self, state: MpRound, by_node: dict[int, Message], errors: list[str]) -> ArrayRecord:
        rnd = state.round
        state.sizes = {}
        self.check_replies(state, by_node, errors)
        records = []
        for node, r in by_node.items():
            try:
                records.append((node, r.content["arrays"]))
                state.sizes[node] = num_examples(r.content["metrics"])
            except KeyError as err:
                raise RoundFailed(f"round {rnd}: malformed upload from node {node}: {err}") from err
        try:
            new_layers, grads = self.update(state, records)
        except NonFiniteGradient as err:  # the server optimizer refused it before stepping
            self.min_size = min(state.sizes.values())
            raise RoundFailed(f"round {rnd}: recovered gradient is not finite") from err
        except ValueError as err:
            raise RoundFailed(f"round {rnd}: malformed upload or recovery failed: {err}") from err
        self.min_size = min(state.sizes.values())
        flat = _flat(grads)
        self.last_gradient = [(gw.clone(), gb.clone()) for gw, gb in grads]
        self.last_release = self._release(flat, state.secret)
        self.report(recovered_grad_norm=float(flat.norm()))
        if self.cfg.cancellation_check:
            res = corrected_residual(by_node.values(), self.probe_corrections)
            if res is not None:
                self.report(cancellation_residual=res)
        return to_record(weights_from_layers(new_layers), self.wire_dtype)

    # ------------------------------------------------------------------ reports
    def _min_r(self, state: MpRound) -> float:
        return float(min(float(rm.abs().min()) for rm in state.secret.trainable_R()))

    def unit_accounts(self) -> list[PerUnitAccountant]:
        """The ledger's per-client accounts and the given-R account when it is one."""
        extra = [self._given_r] if isinstance(self._given_r, PerUnitAccountant) else []
        return [*super().unit_accounts(), *extra]

    def _given_r_epsilon(self) -> float:
        return self._given_r.epsilon(self.cfg.delta)

    def state_dict(self) -> dict:
        """The ledger plus the given-R account (resume, :mod:`strategies.run.checkpoint`)."""
        return {**super().state_dict(), "given_r": self._given_r.to_state(), "optimizer": self.optimizer.to_state()}

    def load_state(self, state) -> None:
        self._given_r = accountant_from_state(state["given_r"])  # before the base renumbers the accounts
        super().load_state(state)
        if "optimizer" in state:
            self.optimizer = optimizer_from_state(state["optimizer"])

    def describe(self) -> dict[str, float | str]:
        return {
            "noise_multiplier": self.z,
            "privacy_unit": "record",
            "per_example_clip": self.cfg.clip,
            "sensitivity": "2 clip / |D_i| of the perturbed gradient (replace-one record; the paper's S_f = B is "
                           "a client-level bound)",
            "server_lr": self.optimizer.lr,
            "server_optimizer": self.optimizer.describe(),
            "composition": "RDP accountant over num-rounds Gaussian releases, no sampling amplification",
        }


__all__ = ["MpRound", "MpStrategyBase", "check_model", "layers_from_weights", "weights_from_layers"]
