"""MP_Server + DDP_Client (Yang et al.) and its two ablations MP-DP-Naive and MP-CDP: server side.

Supported models: ``model = "mlp"`` with at least one hidden layer (``hidden`` non-empty), trained with
the paper's loss 1/2 ||y - onehot||^2 (MSE on one-hot targets; central evaluation still reports
cross-entropy and accuracy).  The model perturbation (Eqs. 12-15) needs a ReLU MLP whose layers are
``nn.Linear`` (``client.models.MLP``); any other model is refused with a ``ConfigError`` at construction.

Round ``t`` (methods ``mpddp``, ``mpdp-naive``, ``mpcdp``):

1. (``mpddp`` only) the shared key phase (:func:`strategies.pairwise_phase.run_key_phase`): X25519
   keys of the key epoch (fetched only from clients without one), neighbour graph over the clients
   with a key (run-config ``graph`` = complete | n-out).
2. MP_Server (Algorithm 1): the server holds the true MLP (the runner's global ``ArrayRecord``, in the
   MLP's ``state_dict`` layout ``layers.i.weight``/``layers.i.bias``), draws a fresh one-time secret R
   from ``os.urandom`` and sends only the perturbed expanded model W-hat (2L-1 float64 matrices
   ``w_hat.0 .. w_hat.{2L-2}``) to the sampled clients, never the true model.  The relative distance
   between the two is reported as ``client_model_distance`` (and ``client_model_row_cosine_l1``, see
   caveats).
3. Clients (``client/methods/mpddp.py``) compute ONE full-batch gradient at W-hat plus Psi, Phi (FedSGD:
   local SGD steps cannot be mapped back by Eq. 22, so ``local-epochs``, ``batch-size`` and ``lr`` are
   unused) and add noise: ``mpddp`` eta_k + sum_v Delta_kv (Eq. 17, DN samplers, pairwise seeds from
   the key phase, purpose ``mpddp-delta``); ``mpdp-naive`` N(0, sigma^2) on the perturbed gradient;
   ``mpcdp`` nothing.  Uploads are 3L float64 arrays ``up.0 ..`` (gradients, Psi, Phi).
4. MU_Server (Algorithm 3): *unweighted* mean of the uploads (the Delta's only cancel in the plain
   mean), recovery Eq. (22), update of every layer with the server learning rate xi
   (``mpddp-server-lr``).  ``mpcdp`` instead recovers each client's gradient, clips it to ``clip``,
   averages and adds N(0, (z clip / K)^2) on the server.  For ``mpddp`` every participant of the key
   phase must upload: a dropout leaves uncancelled Delta's in the mean, so the round fails
   (:class:`RoundFailed`) and the model is kept (there is no seed recovery in this protocol).

Calibration (run-config ``epsilon``/``delta`` = the budget over the whole run, the project convention).
Sensitivity S = run-config ``clip`` (the paper sets S = 1).  It is an ASSUMPTION for ``mpddp`` and
``mpdp-naive``: clients only see perturbed gradients and the server only noised ones, so nobody can clip
the true per-client gradient (``mpcdp``'s trusted server does clip).
* ``mpddp``, complete graph (Theorem 10): the view of one round is a Gaussian mechanism whose privacy-loss
  variance is theta (Eq. 23 is exactly the Gaussian tail condition for a N(theta/2, theta) privacy loss),
  i.e. noise multiplier z = theta^-1/2.  We take the smallest z for which ``num-rounds`` compositions
  are (epsilon, delta)-DP under our RDP accountant (:mod:`protocols.accounting`, no sampling
  amplification: the server knows whom it sampled), set theta = 1/z^2 and split it between eta and Delta
  (90 % to eta, so the aggregate noise sigma_eta/sqrt(K) is within 5 % of the CDP level) with
  :func:`protocols.mpddp.sigmas_for_theta` for the K clients that passed the key phase.  Reported
  epsilon after t rounds: the RDP accountant's epsilon of t such releases at ``delta``.
* ``mpddp``, random n-out graph (Theorem 11, (epsilon, 3 delta) per round, preconditions K >= 81 and
  n large enough): per round (epsilon/T, delta/T) through :func:`protocols.mpddp.calibrate` (which applies
  the theorem with delta/(3T)), composed by basic composition: epsilon after t rounds = t epsilon / T.
  Settings the theorem does not cover are refused (``ConfigError`` at construction for K =
  clients-per-round, ``RoundFailed`` if fewer clients pass the key phase).
* ``mpdp-naive``: sigma = z S per client, the same z (the paper's naive calibration).
* ``mpcdp``: sigma = z S / K on the recovered mean of clipped per-client gradients, same z.

CAVEATS (found while implementing, reported, not fixed -- they are properties of the paper's scheme):
* The uplink guarantee of ``mpddp`` is NOMINAL.  Theorems 5/6 make R o eta Gaussian only marginally over
  R; the server chose R.  Given R, client k's recovered noise on entry ij is R_ij (eta + sum Delta): the
  entries with small |R_ij| are barely protected.  Each round we report ``epsilon_given_R``: the RDP
  epsilon so far when every round's theta is divided by min_ij R_ij^2 (Gaussian approximation of the
  conditional noise, worst coordinate).  On our one-hidden-layer MLPs it is about 5x the nominal
  figure (R entries are single |DN*(1)| factors, min ~ 0.2); deeper MLPs multiply factors r_i s_j and
  get smaller minima.  The same figure is reported for ``mpdp-naive`` (whose noise is Gaussian given R).
* The sensitivity S = ``clip`` is assumed, not enforced (see above); ``mpcdp`` measures it: on
  breast-cancer with K = 100, round-1 client gradients have mean L2 norm ~1.7, so S = 1 is violated.
* Psi_k and Phi_k are uploaded unnoised (as in the paper); they are deterministic functions of client
  k's data at W-hat, so strictly there is no DP guarantee for the uplink at all; ``epsilon_given_R``
  ignores them too.
* The released entries of R o eta share factors (R_ij = r_i s_j), so the noise vector is a Gaussian
  scale mixture with dependent scales, not i.i.d. N(0, sigma^2); Theorems 5/6 are entrywise only.
* What a client receives hides the model only up to positive row scales in layer 1 (R^(1)_ij = r_i):
  ``client_model_row_cosine_l1`` = 1 exactly, i.e. the direction of every first-layer neuron is revealed.
Headline ``epsilon``/``epsilon_uplink``/``epsilon_downlink`` of ``mpddp`` and ``mpdp-naive`` are the
nominal (paper-model) figures described above; ``mpcdp``'s downlink figure is a real guarantee (trusted
server, enforced clipping) and its uplink is infinite (the server sees every client's exact gradient).

Test-only route: the constructor's ``test_noise`` ("calibrated" by default; "off" = no noise at all;
"pairwise-only" = Delta's but no eta, to check exact cancellation) is not reachable from the run config;
with anything but "calibrated" the privacy report is infinite.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from client.wire import Weights, array_view, from_record, to_record
from protocols.accounting import GaussianAccountant, gaussian_epsilon, noise_multiplier
from protocols.config import ConfigError, RunConfig
from protocols.mpddp import (
    ClientUpload,
    MPSecret,
    add_cdp_noise,
    calibrate,
    eq23_epsilon,
    mp_server,
    recover,
    relative_distance,
    sgd_update,
    sigmas_for_theta,
    torch_threads,
)
from protocols.mpddp.expansion import Layer
from strategies.base import CancelStrategy, RoundFailed, split_replies
from strategies.pairwise_phase import forget_unresponsive, probe_residual, run_key_phase

TestNoise = Literal["calibrated", "off", "pairwise-only"]

#: Fraction of the per-round privacy-loss variance theta spent on the non-cancelling eta (see module doc).
ETA_SHARE = 0.9


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


def w_hat_record(w_hat: Sequence[torch.Tensor]) -> ArrayRecord:
    """The 2L-1 perturbed matrices as the train message's ArrayRecord (``w_hat.j``, float64)."""
    return to_record(OrderedDict((f"w_hat.{j}", m.detach().cpu().numpy()) for j, m in enumerate(w_hat)), np.float64)


def upload_from_record(record: ArrayRecord, num_layers: int) -> ClientUpload:
    """A client's ``up.0 .. up.{3L-1}`` arrays -> ClientUpload (ValueError if malformed)."""
    arrays = from_record(record)
    names = [f"up.{i}" for i in range(3 * num_layers)]
    if list(arrays) != names:
        raise ValueError(f"expected arrays {names[0]}..{names[-1]}, got {list(arrays)[:4]}...")
    return ClientUpload.from_arrays([arrays[k] for k in names])


def mean_upload(records: Sequence[tuple[int, ArrayRecord]], num_layers: int) -> ClientUpload:
    """Eqs. (20), (21) straight from the wire: the unweighted mean of ``(node id, upload record)`` pairs.

    Sums zero-copy views of the received bytes into one float64 accumulator (in upload order, the
    same float operations as :func:`protocols.mpddp.aggregate`), so the server never holds a second
    copy of K uploads (K x 2.4 MB on the MNIST MLP).  ValueError names the first malformed upload.
    """
    if not records:
        raise ValueError("no uploads to aggregate")
    names = [f"up.{i}" for i in range(3 * num_layers)]
    acc: list[np.ndarray] = []
    for node, record in records:
        if list(record) != names:
            raise ValueError(f"node {node}: expected arrays {names[0]}..{names[-1]}, got {list(record)[:4]}...")
        views = [array_view(record[k]) for k in names]
        if any(v.dtype.kind != "f" for v in views):
            raise ValueError(f"node {node}: upload arrays must be floating point")
        if not acc:
            acc = [np.array(v, dtype=np.float64) for v in views]
            continue
        for a, v, k in zip(acc, views, names, strict=True):
            if v.shape != a.shape:
                raise ValueError(f"node {node}: {k} has shape {v.shape}, the first upload {a.shape}")
            np.add(a, v, out=a)
    for a in acc:
        a /= len(records)
    return ClientUpload.from_arrays(acc)


def check_model(cfg: RunConfig) -> None:
    """Refuse models the model perturbation does not cover (ConfigError)."""
    if cfg.model != "mlp":
        raise ConfigError(f"method {cfg.method!r} supports only model = 'mlp' (a ReLU MLP, the layer "
                          f"expansion of Eq. 12 needs Linear layers); got model = {cfg.model!r}")
    if len(cfg.hidden_sizes) < 1:
        raise ConfigError(f"method {cfg.method!r} needs an MLP with at least one hidden layer (L >= 2, "
                          "Eq. 14 needs r^(1) and s^(L-1)); run-config 'hidden' is empty")


@dataclass
class _RoundState:
    """What the server keeps between configure_train and aggregate_train (never sent)."""

    round: int
    layers: list[Layer]
    secret: MPSecret
    participants: list[int]
    num_clients: int  # K used for calibration
    sigma_eta: float = 0.0
    sigma_delta: float = 0.0
    theta: float = 0.0  # per-round privacy-loss variance (mpddp)


# ----------------------------------------------------------------------------- strategies
class _MpBase(CancelStrategy):
    """MP_Server / MU_Server shared by the three methods."""

    wire_dtype = np.float64

    def __init__(self, cfg: RunConfig, *, test_noise: TestNoise = "calibrated") -> None:
        super().__init__(cfg)
        check_model(cfg)
        if test_noise not in ("calibrated", "off", "pairwise-only"):
            raise ValueError(f"test_noise must be calibrated, off or pairwise-only, got {test_noise!r}")
        self.test_noise: TestNoise = test_noise
        self.lr = float(cfg.mpddp_server_lr)
        self.z = noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
        self._state: _RoundState | None = None
        self._given_r = GaussianAccountant(cfg.delta)
        #: Recovered aggregate gradient of the last successful round, [(dW, db), ...] (tests, diagnostics).
        self.last_gradient: list[Layer] | None = None

    @property
    def noisy(self) -> bool:
        """Whether the calibrated noise is on (False only in the test-only modes)."""
        return self.test_noise == "calibrated"

    # ------------------------------------------------------------------ hooks for the subclasses
    def round_config(self, state: _RoundState) -> dict[str, float | str]:
        """Method-specific entries of the train config."""
        return {}

    def prepare_round(self, grid: Grid, server_round: int, nodes: list[int]) -> tuple[list[int], dict[int, ConfigRecord]]:
        """Participants and per-node extra config (mpddp runs the key phase here)."""
        return nodes, {}

    def calibrate_round(self, state: _RoundState) -> None:
        """Fill the noise scales of ``state`` for its number of clients."""

    # ------------------------------------------------------------------ Flower API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """MP_Server: perturb the true model with a fresh secret and send W-hat to the participants."""
        with torch_threads(1):
            return self._configure_train(server_round, arrays, grid)

    def _configure_train(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> list[Message]:
        self._round_report = {}
        self._state = None
        layers = layers_from_weights(from_record(arrays))
        nodes = self.sample_nodes(grid, server_round)
        participants, extra = self.prepare_round(grid, server_round, nodes)
        w_hat, secret = mp_server(layers, os.urandom(32))
        state = _RoundState(server_round, layers, secret, participants, len(participants))
        self.calibrate_round(state)
        self._state = state
        dist = relative_distance(layers, w_hat)
        self.report(client_model_distance=dist["overall"], client_model_row_cosine_l1=dist["row_cosine"][0])
        record = w_hat_record(w_hat)
        base = {"round": server_round, **self.round_config(state)}

        def content(node: int) -> RecordDict:
            cfg_rec = extra.get(node, ConfigRecord())
            for k, v in base.items():
                cfg_rec[k] = v
            return RecordDict({"arrays": record, "config": cfg_rec})

        return self.make_messages(participants, content)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """MU_Server: unweighted mean, recovery (Eq. 22), update with xi."""
        with torch_threads(1):
            return self._aggregate_train(server_round, list(replies))

    def _aggregate_train(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord, MetricRecord]:
        state = self._state
        if state is None or state.round != server_round:
            raise RoundFailed(f"round {server_round}: no MP_Server state (configure_train did not run)")
        good, errors = split_replies(list(replies))
        forget_unresponsive(self, state.participants, good)
        good = [r for r in good if r.metadata.src_node_id in set(state.participants)]
        if not good:
            raise RoundFailed(f"round {server_round}: no client upload ({len(errors)} errors)")
        self.account(state)  # uploads reached the server: the round's release happened even if it fails below
        self.check_replies(state, good, errors)
        records = []
        for r in good:
            try:
                records.append((r.metadata.src_node_id, r.content["arrays"]))
            except KeyError as err:
                raise RoundFailed(f"round {server_round}: malformed upload from node {r.metadata.src_node_id}: {err}") from err
        try:
            grads = self.recover_gradient(state, records)
        except ValueError as err:
            raise RoundFailed(f"round {server_round}: malformed upload or recovery failed: {err}") from err
        flat = torch.cat([t.reshape(-1) for pair in grads for t in pair])
        if not bool(torch.isfinite(flat).all()):
            raise RoundFailed(f"round {server_round}: recovered gradient is not finite")
        self.last_gradient = [(gw.clone(), gb.clone()) for gw, gb in grads]
        new_layers = sgd_update(state.layers, grads, self.lr)
        self.report(recovered_grad_norm=float(flat.norm()))
        if self.cfg.cancellation_check:
            res = probe_residual(good)
            if res is not None:
                self.report(cancellation_residual=res)
        return to_record(weights_from_layers(new_layers), self.wire_dtype), self.mean_metrics(good)

    def check_replies(self, state: _RoundState, good: list[Message], errors: list[str]) -> None:
        """Refuse rounds whose aggregate would be wrong (mpddp: every participant must upload)."""

    def recover_gradient(self, state: _RoundState, records: list[tuple[int, ArrayRecord]]) -> list[Layer]:
        """Eqs. (20)-(22): recovered mean gradient (streamed mean of the uploads, then recovery)."""
        return recover(mean_upload(records, len(state.layers)), state.secret)

    def account(self, state: _RoundState) -> None:
        """Per-round privacy bookkeeping once uploads arrived (the release happened)."""

    # ------------------------------------------------------------------ reports
    def _min_r(self, state: _RoundState) -> float:
        return float(min(float(rm.abs().min()) for rm in state.secret.trainable_R()))

    def _given_r_epsilon(self) -> float:
        return self._given_r.epsilon() if self._given_r.releases else 0.0

    def describe(self) -> dict[str, float | str]:
        return {
            "noise_multiplier": self.z,
            "sensitivity_assumed": self.cfg.clip,
            "server_lr": self.lr,
            "test_noise": self.test_noise,
            "composition": "RDP accountant over num-rounds Gaussian releases, no sampling amplification",
        }


class MpddpStrategy(_MpBase):
    """MP_Server + DDP_Client (Algorithms 1-4) with the shared key phase and Theorem 10/11 calibration."""

    def __init__(self, cfg: RunConfig, *, test_noise: TestNoise = "calibrated") -> None:
        super().__init__(cfg, test_noise=test_noise)
        k = cfg.clients_per_round
        if k < 2:
            raise ConfigError("method 'mpddp' needs at least 2 clients per round (pairwise noise); "
                              f"num-clients x sample-rate gives {k}")
        self.n_out = cfg.n_out if cfg.graph == "n-out" else None
        try:
            self._calibration(k)
        except ValueError as err:
            raise ConfigError(f"method 'mpddp' with K = {k} clients per round, epsilon = {cfg.epsilon}, "
                              f"delta = {cfg.delta}, graph = {cfg.graph!r}: {err}") from err

    def _complete(self, k: int) -> bool:
        return self.n_out is None or self.n_out >= k - 1

    def _calibration(self, k: int) -> tuple[float, float, float]:
        """(sigma_eta, sigma_delta, theta) for K = k clients (ValueError if not covered)."""
        cfg = self.cfg
        if self._complete(k):
            theta = 1.0 / self.z**2
            se, sd = sigmas_for_theta(theta, k, eta_share=ETA_SHARE, sensitivity=cfg.clip)
            return se, sd, theta
        t = cfg.num_rounds
        cal = calibrate(cfg.epsilon / t, cfg.delta / t, k, self.n_out, eta_share=ETA_SHARE, sensitivity=cfg.clip)
        return cal.sigma_eta, cal.sigma_delta, cal.theta

    def prepare_round(self, grid: Grid, server_round: int, nodes: list[int]) -> tuple[list[int], dict[int, ConfigRecord]]:
        kr = run_key_phase(self, grid, server_round, nodes)
        return kr.participants, {n: kr.peer_config(n) for n in kr.participants}

    def calibrate_round(self, state: _RoundState) -> None:
        try:
            state.sigma_eta, state.sigma_delta, state.theta = self._calibration(state.num_clients)
        except ValueError as err:
            raise RoundFailed(f"round {state.round}: {state.num_clients} clients passed the key phase and the "
                              f"calibration does not cover it: {err}") from err
        if self.test_noise == "off":
            state.sigma_eta = state.sigma_delta = 0.0
        elif self.test_noise == "pairwise-only":
            state.sigma_eta = 0.0
        self.report(sigma_eta=state.sigma_eta, sigma_delta=state.sigma_delta)

    def round_config(self, state: _RoundState) -> dict[str, float | str]:
        return {"sigma-eta": state.sigma_eta, "sigma-delta": state.sigma_delta}

    def check_replies(self, state: _RoundState, good: list[Message], errors: list[str]) -> None:
        got = {r.metadata.src_node_id for r in good}
        missing = sorted(set(state.participants) - got)
        if missing:
            raise RoundFailed(
                f"round {state.round}: {len(missing)} of {len(state.participants)} clients did not upload after the "
                f"key phase ({missing[:5]}{'...' if len(missing) > 5 else ''}); their pairwise noise Delta would "
                "not cancel in the mean and DDP_Client has no seed recovery, so the round is discarded"
                + (f"; errors: {errors[0].splitlines()[0]}" if errors else ""))

    def account(self, state: _RoundState) -> None:
        if self.noisy and state.theta > 0:
            self._given_r.compose(self._min_r(state) / math.sqrt(state.theta))
            self.report(epsilon_given_R=self._given_r_epsilon())

    def describe(self) -> dict[str, float | str]:
        k = self.cfg.clients_per_round
        se, sd, theta = self._calibration(k)
        out = super().describe()
        out.update({
            "graph": "complete (Theorem 10)" if self._complete(k) else f"n-out n={self.n_out} (Theorem 11)",
            "clients_per_round": k,
            "sigma_eta": se,
            "sigma_delta": sd,
            "theta_round": theta,
            "eta_share": ETA_SHARE,
            "aggregate_noise_std": se / math.sqrt(k),
            "epsilon_round_eq23": eq23_epsilon(theta, self.cfg.delta) if self._complete(k) else
            self.cfg.epsilon / self.cfg.num_rounds,
            "guarantee": "nominal (paper model): not valid against the server, which knows R and gets Psi/Phi "
                         "unnoised; see epsilon_given_R",
        })
        if not self._complete(k):
            out["composition"] = "basic composition of Theorem 11 rounds at (epsilon/T, delta/T)"
        return out

    def privacy_report(self, server_round: int) -> dict[str, float]:
        if not self.noisy:
            return {"epsilon": math.inf, "epsilon_uplink": math.inf, "epsilon_downlink": math.inf}
        if self._complete(self.cfg.clients_per_round):
            eps = gaussian_epsilon(self.z, 1.0, server_round, self.cfg.delta)
        else:
            eps = server_round * self.cfg.epsilon / self.cfg.num_rounds
        return {"epsilon": eps, "epsilon_uplink": eps, "epsilon_downlink": eps}


class MpdpNaiveStrategy(_MpBase):
    """MP-DP-Naive (Section 6.3): model perturbation + N(0, (z S)^2) on each perturbed gradient."""

    def calibrate_round(self, state: _RoundState) -> None:
        state.sigma_eta = self.z * self.cfg.clip if self.noisy else 0.0
        self.report(sigma=state.sigma_eta)

    def round_config(self, state: _RoundState) -> dict[str, float | str]:
        return {"sigma": state.sigma_eta}

    def account(self, state: _RoundState) -> None:
        if self.noisy:
            self._given_r.compose(self._min_r(state) * self.z)
            self.report(epsilon_given_R=self._given_r_epsilon())

    def describe(self) -> dict[str, float | str]:
        out = super().describe()
        out.update({"sigma": self.z * self.cfg.clip,
                    "guarantee": "nominal: R o eta is not Gaussian (the paper's Problem 1); see epsilon_given_R"})
        return out

    def privacy_report(self, server_round: int) -> dict[str, float]:
        if not self.noisy:
            return {"epsilon": math.inf, "epsilon_uplink": math.inf, "epsilon_downlink": math.inf}
        eps = gaussian_epsilon(self.z, 1.0, server_round, self.cfg.delta)
        return {"epsilon": eps, "epsilon_uplink": eps, "epsilon_downlink": eps}


class MpcdpStrategy(_MpBase):
    """MP-CDP (Section 6.3): noise-free uploads, the (trusted) server clips, averages and adds Gaussian noise."""

    def recover_gradient(self, state: _RoundState, records: list[tuple[int, ArrayRecord]]) -> list[Layer]:
        uploads = []
        for node, record in records:
            try:
                uploads.append(upload_from_record(record, len(state.layers)))
            except (ValueError, KeyError) as err:
                raise ValueError(f"node {node}: {err}") from err
        per_client = [recover(u, state.secret) for u in uploads]
        clip = self.cfg.clip
        flat = [torch.cat([t.reshape(-1) for pair in g for t in pair]) for g in per_client]
        norms = [float(f.norm()) for f in flat]
        mean = torch.stack([f / max(1.0, n / clip) for f, n in zip(flat, norms, strict=True)]).mean(dim=0)
        grads: list[Layer] = []
        off = 0
        for gw, gb in per_client[0]:
            grads.append((mean[off:off + gw.numel()].reshape(gw.shape), mean[off + gw.numel():off + gw.numel() + gb.numel()]))
            off += gw.numel() + gb.numel()
        k = len(uploads)
        sigma = self.z * clip / k if self.noisy else 0.0
        self.report(clipped_fraction=sum(n > clip for n in norms) / k, mean_client_grad_norm=float(np.mean(norms)),
                    sigma=sigma)
        return add_cdp_noise(grads, seed=os.urandom(32), sigma=sigma) if sigma > 0 else grads

    def describe(self) -> dict[str, float | str]:
        out = super().describe()
        out.update({"aggregate_noise_std": self.z * self.cfg.clip / self.cfg.clients_per_round,
                    "guarantee": "downlink CDP with enforced per-client clipping; uplink none (trusted server)"})
        return out

    def privacy_report(self, server_round: int) -> dict[str, float]:
        if not self.noisy:
            return {"epsilon": math.inf, "epsilon_uplink": math.inf, "epsilon_downlink": math.inf}
        eps = gaussian_epsilon(self.z, 1.0, server_round, self.cfg.delta)
        return {"epsilon": eps, "epsilon_uplink": math.inf, "epsilon_downlink": eps}
