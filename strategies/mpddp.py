"""MP_Server + DDP_Client (Yang et al.) and its two ablations MP-DP-Naive and MP-CDP: server side.

Supported models: ``model = "mlp"`` with at least one hidden layer (``hidden`` non-empty), trained with
the paper's loss 1/2 ||y - onehot||^2 (MSE on one-hot targets; central evaluation still reports
cross-entropy and accuracy).  The model perturbation (Eqs. 12-15) needs a ReLU MLP whose layers are
``nn.Linear`` (``client.models.MLP``); any other model is refused with a ``ConfigError`` at construction.

Round ``t`` (methods ``mpddp``, ``mpdp-naive``, ``mpcdp``):

1. (``mpddp`` only) the shared key phase (:class:`strategies.key_phase.KeyPhase`): X25519 keys of the
   key epoch (fetched only from clients without one), neighbour graph over the clients with a key
   (run-config ``graph`` = complete | n-out).
2. MP_Server (Algorithm 1): the server holds the true MLP (the runner's global ``ArrayRecord``, in the
   MLP's ``state_dict`` layout ``layers.i.weight``/``layers.i.bias``), draws a fresh one-time secret R
   from ``os.urandom`` and sends only the perturbed expanded model W-hat (2L-1 float64 matrices,
   :class:`client.messages.mpddp.PerturbedModel`) to the sampled clients, never the true model.  The relative distance
   between the two is reported as ``client_model_distance`` (and ``client_model_row_cosine_l1``, see
   caveats).
3. Clients (``client/methods/mpddp.py``) compute ONE full-batch gradient at W-hat plus Psi, Phi (FedSGD:
   local SGD steps cannot be mapped back by Eq. 22, so ``local-epochs``, ``batch-size`` and ``lr`` are
   unused) and add noise: ``mpddp`` eta_k + sum_v Delta_kv (Eq. 17, DN samplers, pairwise seeds from
   the key phase, purpose ``mpddp-delta``); ``mpdp-naive`` N(0, sigma^2) on the perturbed gradient;
   ``mpcdp`` nothing.  Uploads are 3L arrays (gradients, Psi, Phi; :func:`client.messages.mpddp.upload_record`).
4. MU_Server (Algorithm 3, :func:`protocols.mpddp.mu_server`): *unweighted* mean of the uploads (the
   Delta's only cancel in the plain mean; streamed from the wire by :func:`client.messages.mpddp.mean_upload`),
   recovery Eq. (22), update of every layer with the server learning rate xi (``mpddp-server-lr``).
   ``mpcdp`` adds N(0, (z S / K)^2) to the mean perturbed gradient before recovery.  For ``mpddp`` a
   participant of the key phase that does not upload leaves uncancelled Delta's in the mean: the survivors
   reveal that round's Delta seeds with it and the server subtracts them (dropout recovery,
   :mod:`strategies.recovery`; the paper has none); if that fails, the round fails (:class:`RoundFailed`) and
   the model is kept.

Calibration (run-config ``epsilon``/``delta`` = the budget over the whole run, the project convention).
Privacy unit: one RECORD (the paper's DP definition; its calibration's "S_f = B = 1" bounds a whole
client's gradient, a loose client-level figure: with 10-100 clients at epsilon 1 that noise drowns the
model).  Each client clips every example's PERTURBED gradient (on W-hat) to ``clip`` and uploads their mean
(:func:`protocols.mpddp.clipped_client_gradients`), so one record moves the noised upload by at most
S = 2 clip / n_k (replace-one, :func:`protocols.mpddp.mp_record_sensitivity`): enforced, in the space the
noise is added in.  The true-space gradient (what the published model moves by) is NOT bounded by it:
the client cannot compute it (it does not know R), so, as in the paper, the true-space figure is nominal.
The additive mask r^a is drawn at the output layer's RMS (:func:`protocols.mpddp.output_scale`): at
N(0, 1) the perturbed per-example gradients were ~100x the true ones and the noise ~100x the signal.
mpddp uses S of the round's smallest participant (public key-phase sizes, every client recomputes the
scales, :func:`protocols.floor.mpddp_floor`); mpdp-naive each client's own n_k; mpcdp the smallest upload's.
* ``mpddp``, complete graph (Theorem 10): the view of one round is a Gaussian mechanism whose privacy-loss
  variance is theta (Eq. 23 is exactly the Gaussian tail condition for a N(theta/2, theta) privacy loss),
  i.e. noise multiplier z = theta^-1/2.  We take the smallest z for which ``num-rounds`` compositions
  are (epsilon, delta)-DP under our RDP accountant (:mod:`protocols.privacy`, no sampling
  amplification: the server knows whom it sampled), set theta = 1/z^2 and split it between eta and Delta
  (90 % to eta, so the aggregate noise sigma_eta/sqrt(K) is within 5 % of the CDP level) with
  :func:`protocols.mpddp.sigmas_for_theta` (theta from :func:`protocols.mpddp.theta_for_noise_multiplier`)
  for the K clients that passed the key phase.  Reported
  epsilon after t rounds: the RDP accountant's epsilon of t such releases at ``delta``.
* ``mpddp``, random n-out graph (Theorem 11, (epsilon, 3 delta) per round, preconditions K >= 81 and
  n large enough): per round (epsilon/T, delta/T) through :func:`protocols.mpddp.calibrate` (which applies
  the theorem with delta/(3T)), composed by basic composition: epsilon after t rounds = t epsilon / T.
  Settings the theorem does not cover are refused (``ConfigError`` at construction for K =
  clients-per-round, ``RoundFailed`` if fewer clients pass the key phase).
* ``mpdp-naive``: sigma = z S_k per client, the same z (the paper's naive calibration;
  :func:`protocols.mpddp.calibrate_ldp`); the server announces z only (it need not know n_k).
* ``mpcdp``: sigma = z S / K on the mean perturbed gradient (the place of mpddp's eta), same z
  (:func:`protocols.mpddp.calibrate_cdp`).

CAVEATS (found while implementing, reported, not fixed -- they are properties of the paper's scheme):
* The uplink guarantee of ``mpddp`` is NOMINAL.  Theorems 5/6 make R o eta Gaussian only marginally over
  R; the server chose R.  Given R, client k's recovered noise on entry ij is R_ij (eta + sum Delta): the
  entries with small |R_ij| are barely protected.  Each round we report ``epsilon_given_R``: the RDP
  epsilon so far when every round's theta is divided by min_ij R_ij^2 (Gaussian approximation of the
  conditional noise, worst coordinate).  On our one-hidden-layer MLPs it is about 5x the nominal
  figure (R entries are single |DN*(1)| factors, min ~ 0.2); deeper MLPs multiply factors r_i s_j and
  get smaller minima.  The same figure is reported for ``mpdp-naive`` (whose noise is Gaussian given R).
* The record sensitivity S = 2 clip / n_k is enforced for the perturbed gradient only (see above).
* Psi_k and Phi_k are uploaded unnoised (as in the paper); they are deterministic functions of client
  k's data at W-hat, so strictly there is no DP guarantee for the uplink at all; ``epsilon_given_R``
  ignores them too.
* The released entries of R o eta share factors (R_ij = r_i s_j), so the noise vector is a Gaussian
  scale mixture with dependent scales, not i.i.d. N(0, sigma^2); Theorems 5/6 are entrywise only.
* What a client receives hides the model only up to positive row scales in layer 1 (R^(1)_ij = r_i):
  ``client_model_row_cosine_l1`` = 1 exactly, i.e. the direction of every first-layer neuron is revealed.
Headline ``epsilon``/``epsilon_uplink``/``epsilon_downlink`` of ``mpddp`` and ``mpdp-naive`` are the
nominal (paper-model) figures described above.  ``mpcdp``'s downlink figure is nominal too: the clip bounds
a record's perturbed gradient g^, but the published model moves by R o (g^ + r^T Psi - v Phi) for that
record while its noise is R o eta, so in the noise's own units the record moves it by ||g^ + r^T Psi - v Phi||,
which the clip does not bound (white-box, ``tests/test_audit.py``: above 2 clip for some secrets R).  The
audit (``cancelfl audit``) has not shown a violation with its canaries.  Its uplink is infinite (the server
sees every client's exact gradient).

Noise hooks: :meth:`_MpBase.round_noise` (the scales sent to the clients) and
:meth:`MpcdpStrategy.server_sigma` (MP-CDP's server noise) hold the whole calibration of a round.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid

from client.messages.common import TrainIns, merge_configs, num_examples
from client.messages.mpddp import DdpNoise, NaiveNoise, PerturbedModel, mean_upload
from client.wire import Weights, from_record, to_record
from protocols.config import ConfigError, RunConfig
from protocols.floor import ETA_SHARE, mpddp_floor, mpdp_naive_sigma
from protocols.mpddp import (
    MPSecret,
    calibrate_cdp,
    eq23_epsilon,
    mp_record_sensitivity,
    mp_server,
    mu_server,
    naive_client,
    output_scale,
    pairwise_delta,
    relative_distance,
    theta_complete,
    theta_n_out,
    torch_threads,
)
from protocols.mpddp import flatten as mp_flatten
from protocols.mpddp import unflatten as mp_unflatten
from protocols.mpddp.expansion import Layer
from protocols.privacy import (
    DpCompositionAccountant,
    DpEvent,
    GaussianEvent,
    PrivacyLedger,
    RdpAccountant,
    accountant_from_state,
    noise_multiplier,
)
from protocols.privacy.signal import NoiseEstimate, Release, gaussian_norm
from protocols.server_optimizers import NonFiniteGradient, make_server_optimizer, optimizer_from_state
from strategies.base import CancelStrategy, RoundFailed, RoundState
from strategies.key_phase import KeyPhase, KeyRound
from strategies.recovery import PairwiseRecovery, charge_shortfall, corrected_residual, probe_direction
from strategies.validation import FLOAT_DTYPES, ArraySpec, UploadSpec

__all__ = ["ETA_SHARE", "MpRound", "MpcdpStrategy", "MpddpStrategy", "MpdpNaiveStrategy", "check_model",
           "layers_from_weights", "weights_from_layers"]



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
    """What MP_Server keeps between configure_train and aggregate_train (never sent, except ``model``/``noise``)."""

    layers: list[Layer]
    secret: MPSecret
    #: W-hat as sent (one record, the same for every participant).
    model: ArrayRecord
    #: The noise scales sent to the clients (None for mpcdp).
    noise: DdpNoise | NaiveNoise | None = None
    #: Per-round privacy-loss variance (mpddp).
    theta: float = 0.0
    #: The round's key phase (mpddp).
    keys: KeyRound | None = None
    #: ``|D_i|`` of the uploads (the replies' num-examples; mpcdp's record sensitivity).
    sizes: dict[int, int] | None = None


# ----------------------------------------------------------------------------- strategies
class _MpBase(CancelStrategy):
    """MP_Server / MU_Server shared by the three methods."""

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
        return mp_record_sensitivity(self.cfg.clip, size)

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

    # ------------------------------------------------------------------ hooks of the three methods
    def key_round(self, grid: Grid, server_round: int, nodes: list[int]) -> KeyRound | None:
        """The round's key phase (mpddp); None for the methods without pairwise noise."""
        return None

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
        return mu_server(state.layers, mean_upload(records, len(state.layers)), state.secret, self.optimizer)

    def account(self, state: MpRound) -> None:
        """Per-round privacy bookkeeping once uploads arrived (the release happened)."""

    def round_event(self) -> GaussianEvent | DpEvent:
        """What one round releases under the calibration: a Gaussian with multiplier z (no sampling amplification)."""
        return GaussianEvent(self.z)

    def account_round(self, state: MpRound) -> None:
        self.privacy.compose(self.round_event())

    # ------------------------------------------------------------------ round template hooks
    def prepare_round(self, grid: Grid, server_round: int, nodes: list[int], arrays: ArrayRecord) -> MpRound:
        """MP_Server: (key phase,) a fresh secret R, the perturbed model W-hat and the round's noise scales."""
        with torch_threads(1):  # tiny matrices: thread hand-offs dominate otherwise
            layers = layers_from_weights(from_record(arrays))
            keys = self.key_round(grid, server_round, nodes)
            participants = keys.participants if keys is not None else list(nodes)
            w_hat, secret = mp_server(layers, os.urandom(32), additive_scale=output_scale(layers))
            state = MpRound(server_round, participants, layers, secret,
                            PerturbedModel(tuple(m.detach().cpu().numpy() for m in w_hat)).to_record(), keys=keys)
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
        return RecordDict({"arrays": state.model, "config": merge_configs(*parts)})

    def aggregate(self, state: MpRound, by_node: dict[int, Message], errors: list[str]) -> ArrayRecord:
        """MU_Server: unweighted mean, recovery (Eq. 22), update with xi."""
        with torch_threads(1):
            return self._aggregate(state, by_node, errors)

    def _aggregate(self, state: MpRound, by_node: dict[int, Message], errors: list[str]) -> ArrayRecord:
        rnd = state.round
        state.sizes = {}
        self.account(state)  # uploads reached the server: the round's release happened even if it fails below
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

    def _given_r_epsilon(self) -> float:
        return self._given_r.epsilon(self.cfg.delta)

    def state_dict(self) -> dict:
        """The ledger plus the given-R account (resume, :mod:`strategies.run.checkpoint`)."""
        return {**super().state_dict(), "given_r": self._given_r.to_state(), "optimizer": self.optimizer.to_state()}

    def load_state(self, state) -> None:
        super().load_state(state)
        self._given_r = accountant_from_state(state["given_r"])
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


class MpddpStrategy(PairwiseRecovery, _MpBase):
    """MP_Server + DDP_Client (Algorithms 1-4) with the shared key phase and Theorem 10/11 calibration."""

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
        if not self._complete(k):  # Theorem 11 rounds compose by basic composition
            nominal = DpCompositionAccountant()
            self.privacy = PrivacyLedger(cfg.delta, downlink=nominal, headline="downlink",
                                         extra={"uplink_nominal": nominal})

    def _complete(self, k: int) -> bool:
        return self.n_out is None or self.n_out >= k - 1

    def _calibration(self, k: int, min_size: int) -> tuple[float, float, float]:
        """(sigma_eta, sigma_delta, theta) for K = k clients, the smallest of size ``min_size`` (ValueError if not covered)."""
        return mpddp_floor(self.cfg, k, min_size)  # the clients' own floor: one calibration for both ends

    def key_round(self, grid: Grid, server_round: int, nodes: list[int]) -> KeyRound:
        self.grid = grid  # for the dropout recovery phase (aggregate_train gets no grid)
        kr = self.keys.run(self, grid, server_round, nodes)
        self.announce_masking(kr.neighbours)
        return kr

    def pair_neighbours(self, state: MpRound) -> dict[int, list[int]] | None:
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
                self._charge_recovery(state, len(records))
        return mu_server(state.layers, mean, state.secret, self.optimizer)

    def _charge_recovery(self, state: MpRound, survivors: int) -> None:
        """Charge the nominal accounts with the round's noise really there: Theorem 10/11 for the survivors."""
        assert isinstance(state.noise, DdpNoise)
        # theta is per unit sensitivity (state.theta is), the sigmas are absolute: divide by the round's record
        # sensitivity (mpddp_floor's, from the smallest listed |D_i|).  Without it a record-level round with
        # dropouts was charged theta / sens^2: epsilon 9.6 instead of ~1.1 for 10 % dropouts on digits.
        sens = self.record_sensitivity(min(state.noise.sizes))
        se, sd, n_out = state.noise.sigma_eta / sens, state.noise.sigma_delta / sens, self.n_out
        try:
            theta = (theta_complete(se, sd, survivors) if self._complete(len(state.participants))
                     else theta_n_out(se, sd, survivors, n_out or 1))
        except ValueError as err:
            raise RoundFailed(f"round {state.round}: {survivors} survivors are outside the calibration: {err}") from err
        self.report(theta_after_recovery=theta)
        if theta <= state.theta:
            return
        if isinstance(self.privacy.downlink, DpCompositionAccountant):  # Theorem 11 rounds, basic composition
            t = self.cfg.num_rounds
            extra = eq23_epsilon(theta, self.cfg.delta / (3 * t)) - self.cfg.epsilon / t
            if extra > 0:
                self.privacy.downlink.compose(DpEvent(extra))
            return
        charge_shortfall(self.privacy.downlink, 1 / math.sqrt(state.theta), 1 / math.sqrt(theta))
        min_r = self._min_r(state)
        charge_shortfall(self._given_r, min_r / math.sqrt(state.theta), min_r / math.sqrt(theta))

    def round_noise(self, state: MpRound) -> DdpNoise:
        k = state.keys.calibration_size(self._complete) if state.keys is not None else len(state.participants)
        sizes = state.keys.num_examples if state.keys is not None else {}
        if any(n not in sizes for n in state.participants):
            raise RoundFailed(f"round {state.round}: a participant sent no |D_i| in the key phase; the record "
                              "sensitivity cannot be computed")
        listed = tuple(int(sizes[n]) for n in state.participants)  # PeerKeys.participants order
        try:
            se, sd, state.theta = self._calibration(k, min(listed))
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
        if state.theta > 0:
            self._given_r.compose(GaussianEvent(self._min_r(state) / math.sqrt(state.theta)))
            self.report(epsilon_given_R=self._given_r_epsilon())

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
            "guarantee": "nominal (paper model): not valid against the server, which knows R and gets Psi/Phi "
                         "unnoised; see epsilon_given_R",
        })
        if not self._complete(k):
            out["composition"] = "basic composition of Theorem 11 rounds at (epsilon/T, delta/T)"
        return out

    def round_event(self) -> GaussianEvent | DpEvent:
        """Complete graph: Gaussian with multiplier z; n-out graph: a Theorem 11 round, (epsilon/T, delta/T)-DP."""
        if self._complete(self.cfg.clients_per_round):
            return super().round_event()
        return DpEvent(self.cfg.epsilon / self.cfg.num_rounds, self.cfg.delta / self.cfg.num_rounds)


class MpdpNaiveStrategy(_MpBase):
    """MP-DP-Naive (Section 6.3): model perturbation + N(0, (z S)^2) on each perturbed gradient."""

    def round_noise(self, state: MpRound) -> NaiveNoise:
        """The multiplier z: each client adds ``z 2 clip / |D_k|`` from its own size (the server need not know it)."""
        return NaiveNoise(self.z)

    def mean_noise_std(self) -> float | None:
        """Independent noise ``z S`` per client: ``z S / sqrt(K)`` per entry of the mean gradient."""
        if self.min_size is None:
            return None
        return mpdp_naive_sigma(self.cfg, self.min_size) / math.sqrt(self.cfg.clients_per_round)

    def account(self, state: MpRound) -> None:
        self._given_r.compose(GaussianEvent(self._min_r(state) * self.z))
        self.report(epsilon_given_R=self._given_r_epsilon())

    def describe(self) -> dict[str, float | str]:
        out = super().describe()
        out.update({"sigma_per_sensitivity": self.z,
                    "guarantee": "nominal: R o eta is not Gaussian (the paper's Problem 1); see epsilon_given_R"})
        return out



class MpcdpStrategy(_MpBase):
    """MP-CDP (Section 6.3): noise-free uploads of per-example-clipped means; the (trusted) server adds the Gaussian.

    Record level: the server cannot clip per record (it gets per-client means), so the clients clip per
    example on W-hat as in mpddp and the server adds ``N(0, (z S / K)^2)`` to the mean PERTURBED gradient,
    ``S = 2 clip / min |D_i|`` of the uploads (their num-examples): the same place and the same record
    sensitivity as mpddp's eta (which is within 5 % of this level), so the two differ only in who adds the noise.
    """

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        # Trusted server: it sees every client's exact gradient (no uplink guarantee); the model is CDP.
        self.privacy = PrivacyLedger(cfg.delta, downlink=RdpAccountant(), headline="downlink")

    def server_sigma(self, num_clients: int, min_size: int) -> float:
        """Calibration: std of the server's Gaussian on the mean of ``num_clients`` clipped means (smallest ``min_size``)."""
        return calibrate_cdp(self.z, num_clients, sensitivity=self.record_sensitivity(min_size))

    def update(self, state: MpRound, records: list[tuple[int, ArrayRecord]]) -> tuple[list[Layer], list[Layer]]:
        mean = mean_upload(records, len(state.layers))
        sizes = state.sizes or {}
        min_size = min(sizes[node] for node, _ in records) if sizes else 1
        sigma = self.server_sigma(len(records), min_size)
        self.report(sigma=sigma)
        if sigma > 0:
            mean = naive_client(mean, eta_seed=os.urandom(32), sigma=sigma)
        return mu_server(state.layers, mean, state.secret, self.optimizer)

    def describe(self) -> dict[str, float | str]:
        out = super().describe()
        out.update({"aggregate_noise_std_per_sensitivity": self.z / self.cfg.clients_per_round,
                    "guarantee": "downlink CDP on the perturbed mean (record level, per-example clipping on W-hat); "
                                 "uplink none (trusted server)"})
        return out
