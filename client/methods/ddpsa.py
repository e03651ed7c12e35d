"""DDP-SA client (Wei et al., Algorithm 2, client loop): Laplace (or Gaussian) DP noise + secret sharing.

Per round ``t`` on the received global model (FedSGD: one gradient over the whole local dataset):

1. per-sample gradients, the linear model's centred over the classes (run-config ``ddpsa-centering``,
   :func:`protocols.ddpsa.centred_cross_entropy`), clipped to L1 norm ``Delta`` = run-config ``clip``
   (:mod:`protocols.per_example`);
2. ``s_i = sum_j g_j + noise``, ``b = 2 Delta / eps_t`` with ``eps_t`` from the client's own schedule
   (:func:`protocols.ddpsa_floor.ddpsa_round_epsilon`, Eq. 12) and the noise share from
   :func:`protocols.ddpsa_floor.ddpsa_noise_share` (the client must be on the participant list; a node asking for a
   guarantee counts the colluders of its whole roster, as the server chooses who shares a round); a ``"gaussian"``
   round (:func:`gaussian_gradient_sum`) clips in L2 and adds its share of ``N(0, (z Delta_2)^2)``, ``z`` at
   least :func:`protocols.ddpsa_floor.ddpsa_noise_multiplier` of the client's own config;
3. ``s_i`` (the noisy sum, not the paper's average: a shared sum cannot be weighted) fixed-point encoded
   (:mod:`protocols.secret_sharing`, on a grid no coarser than :func:`protocols.ddpsa.min_frac_bits` allows and in
   a range no smaller than :func:`protocols.ddpsa.min_codec_range`),
   split into ``m`` shares and each pushed, signed, to its intermediate server, with the client's terms
   (:class:`protocols.wire.intermediate.ShareTerms`): the participants it was shown (a round registered for others
   refuses the push) and :func:`protocols.ddpsa_floor.ddpsa_min_summed`, the fewest clients
   a partial sum holding the share may cover (a distributed share: all the participants it was
   shown but ``floor(d n)``).  Before the round is charged, :func:`preflight` asks every server whether it would
   take the shares on those terms (a round registered there otherwise than shown is refused unpaid).

The servers come from the client's own configuration (:func:`intermediate_servers`); the round's parameters
arrive as :class:`protocols.wire.ddpsa.DdpsaRound` and are refused when looser than the client's own.
``query.ddpsa_identity`` (:func:`identity`) answers the roster name.  The reply carries only metrics and a
:class:`protocols.wire.ddpsa.ShareReceipt`; a failed push raises :class:`protocols.wire.intermediate.SharePushError`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from torch import nn

from client.env import ClientEnv, full_batch_dtype, reply
from client.floor import policy, release, trust_minimum
from client.identity import authenticating_identity, node_identity
from protocols.ddpsa import (
    central_scale,
    centred_cross_entropy,
    clip_norm,
    composition_accountant,
    distributed_gaussian_share,
    distributed_laplace_share,
    gaussian_share_std,
    is_linear_classifier,
    laplace_noise,
    min_codec_range,
    min_frac_bits,
)
from protocols.ddpsa_floor import ddpsa_min_summed, ddpsa_noise_multiplier, ddpsa_noise_share, ddpsa_round_epsilon
from protocols.floor import FloorViolation, at_least, at_most
from protocols.identity import Identity
from protocols.methods.ddpsa import sharing_threshold
from protocols.node_config import DDPSA_CA, DDPSA_SERVERS
from protocols.per_example import PerExampleClipper, cross_entropy
from protocols.privacy import (
    Event,
    GaussianEvent,
    LaplaceEvent,
    l1_sensitivity,
    laplace_scale,
)
from protocols.wire.arrays import from_record
from protocols.wire.common import TrainIns
from protocols.wire.ddpsa import RECEIPT, DdpsaRound, RosterName, ShareReceipt
from protocols.wire.intermediate import IntermediateServers, SharePushError, ShareTerms, check_shares, share_and_push

#: Per-sample clipped gradients are summed this many samples at a time (bounds memory).
CHUNK = 256


def _noise_seed() -> bytes:
    """Fresh 32-byte CSPRNG seed for this round's Laplace noise (tests patch it)."""
    return os.urandom(32)


def clipped_gradient_sum(model: nn.Module, x: np.ndarray, y: np.ndarray, clip: float, *, centred: bool = False,
                         norm: str = "l1") -> tuple[np.ndarray, float, float]:
    """``sum_j g_j / max(1, ||g_j|| / clip)`` over all samples, as one float64 vector (``norm``: ``"l1"`` or ``"l2"``).

    ``centred``: ``g_j`` is the linear model's median-centred gradient (:func:`protocols.ddpsa.centred_cross_entropy`).
    The vector follows the model's ``state_dict`` order (that of :func:`protocols.arrays.flatten`).
    Returns ``(sum, mean loss at the current weights, fraction of samples clipped)``.

    Raises:
        ValueError: a model whose ``state_dict`` is not its trainable parameters, or ``centred`` with a model that
            is not linear (:func:`protocols.ddpsa.is_linear_classifier`).
    """
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    state_keys = list(model.state_dict().keys())
    if names != state_keys:
        raise ValueError("DDP-SA needs a model whose state_dict holds exactly its trainable parameters")
    if centred and not is_linear_classifier(model):
        raise ValueError("centred gradients are for the linear model only (they would change hidden layers' steps)")

    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    first = next(model.parameters())
    xt = xt.to(first.dtype) if xt.is_floating_point() else xt  # a model widened to float64 takes its data so
    sums = [torch.zeros(p.shape, dtype=torch.float64) for _, p in model.named_parameters()]
    clipped, loss_sum = 0, 0.0
    model.eval()  # no dropout/batch-norm in our models; per-sample grads need a per-sample forward
    loss = centred_cross_entropy if centred else cross_entropy  # cross-entropy per sample
    with PerExampleClipper(model, clip, norm=norm, loss=loss) as clip_sum:
        for start in range(0, len(yt), CHUNK):
            grads, losses, n_clipped = clip_sum(xt[start:start + CHUNK], yt[start:start + CHUNK])
            clipped += n_clipped
            for acc, g in zip(sums, grads, strict=True):
                acc += g.to(torch.float64)
            loss_sum += float(losses.sum(dtype=torch.float64))
    vec = torch.cat([s.reshape(-1) for s in sums]).numpy()
    return vec, loss_sum / max(len(yt), 1), clipped / max(len(yt), 1)


def noisy_gradient_sum(model: nn.Module, x: np.ndarray, y: np.ndarray, clip: float, epsilon: float,
                       *, adjacency: str, honest: int | None = None, seed: bytes | None = None,
                       centred: bool = False) -> tuple[np.ndarray, float, float]:
    """Algorithm 2's client step before encoding: clipped sum + noise of scale ``b = a clip / epsilon``.

    ``a`` = :func:`protocols.privacy.sensitivity.adjacency_factor` of ``adjacency`` (2: the paper's replace-one).

    ``honest`` None: ``Lap(b)`` per coordinate (the paper's local noise); else this client's share
    ``Gamma(1/honest, b) - Gamma(1/honest, b)`` of one central ``Lap(b)``.  Returns ``(noisy sum s_i,
    mean loss, clipped fraction)``; ``seed`` = None draws fresh OS randomness; ``centred``: as in
    :func:`clipped_gradient_sum`.
    """
    total, loss, frac = clipped_gradient_sum(model, x, y, clip, centred=centred)
    b = laplace_scale(l1_sensitivity(clip, adjacency=adjacency), epsilon)
    if honest is None:
        noise = laplace_noise(total.size, b, seed=seed)
    else:
        noise = distributed_laplace_share(total.size, b, honest, seed=seed)
    return total + noise, loss, frac


def gaussian_gradient_sum(model: nn.Module, x: np.ndarray, y: np.ndarray, clip: float, multiplier: float,
                          honest: int, *, adjacency: str, seed: bytes | None = None
                          ) -> tuple[np.ndarray, float, float]:
    """``ddpsa-noise = "gaussian"``: L2-clipped sum + this client's share ``N(0, (z Delta_2)^2 / honest)``.

    ``Delta_2`` = ``a clip`` (``a`` as in :func:`noisy_gradient_sum`); ``n'`` = ``honest`` such shares sum to the
    central ``N(0, (z Delta_2)^2)`` (:func:`protocols.ddpsa.gaussian_share_std`).  Returns as
    :func:`noisy_gradient_sum` does.
    """
    total, loss, frac = clipped_gradient_sum(model, x, y, clip, norm=clip_norm("gaussian"))
    std = gaussian_share_std(l1_sensitivity(clip, adjacency=adjacency), multiplier, honest)
    return total + distributed_gaussian_share(total.size, std, seed=seed), loss, frac


def intermediate_servers(env: ClientEnv, plan: DdpsaRound) -> IntermediateServers:
    """The intermediate servers of this client's own configuration; refuses a round that names others.

    Node config ``ddpsa-servers`` / ``ddpsa-ca`` win over the run config's (the node's own settings).  A node whose
    policy asks for a guarantee takes both from its node config alone for a round whose noise is split over the
    participants (any but ``"local"``): the run config's are the parameter server's choice, and whoever holds
    ``threshold`` of the servers reconstructs this node's own sum, which carries only its ``1/n'`` share of the noise
    its ledger charges.

    Raises:
        FloorViolation: the client has no servers configured, the round's list differs from its own, or a node asking
            for a guarantee would push a split-noise share to servers its node config does not name.
    """
    nc = env.context.node_config
    own = tuple(a.strip() for a in str(nc.get(DDPSA_SERVERS, env.cfg.ddpsa_servers)).split(",") if a.strip())
    ca = str(nc.get(DDPSA_CA, env.cfg.ddpsa_ca))
    why = "DDP-SA shares go only to the intermediate servers of this client's own configuration"
    if plan.noise != "local" and policy(env).wants_guarantee and not (nc.get(DDPSA_SERVERS) and nc.get(DDPSA_CA)):
        raise FloorViolation("ddpsa-servers", list(plan.servers), "node config 'ddpsa-servers' and 'ddpsa-ca'",
                             "the run config's intermediate servers are the parameter server's choice: holding them, "
                             "it reconstructs this node's sum, which carries only its share of the round's noise; "
                             "this node's 'max-epsilon-per-run' / 'lifetime-epsilon' asks for a guarantee, so it "
                             "pushes only to the servers of its node config")
    if not own or not ca:
        raise FloorViolation("ddpsa-servers", list(plan.servers), "none configured",
                             why + " (set node config or run config 'ddpsa-servers' and 'ddpsa-ca')")
    if tuple(plan.servers) != own:
        raise FloorViolation("ddpsa-servers", list(plan.servers), list(own), why)
    try:
        return IntermediateServers.load(own, ca)
    except (OSError, ValueError) as err:
        raise FloorViolation("ddpsa-ca", ca, "a readable PEM CA certificate", str(err)) from err


def preflight(servers: IntermediateServers, plan: DdpsaRound, rnd: int, me: Identity, length: int,
              terms: ShareTerms) -> None:
    """Before the charge: refuse round ``rnd`` unless enough servers would take this client's shares of ``length``.

    One concurrent ``CheckShare`` per server (:func:`protocols.wire.intermediate.check_shares`), the push's own rule:
    a round the parameter server registered at the servers otherwise than it shows the client (other participants,
    round, run or length) would refuse every push after the ledger paid for it, a drain the server could repeat.

    Raises:
        FloorViolation: fewer servers than the push needs (all ``m`` additive, ``threshold`` Shamir) would take it.
    """
    need = plan.shamir_threshold or len(servers)
    try:
        check_shares(servers, plan.run_id, rnd, me, length, threshold=plan.shamir_threshold, terms=terms)
    except SharePushError as err:
        raise FloorViolation("ddpsa-servers", f"{len(servers) - len(err.failures)} of {len(servers)} taking "
                             f"round {rnd}", f"{need} intermediate servers taking its shares",
                             f"a round the intermediate servers refuse releases nothing and is not charged: {err}"
                             ) from None


def identity(msg: Message, env: ClientEnv) -> Message:
    """``query.ddpsa_identity``: the roster name this node pushes its shares under."""
    return Message(RecordDict({RECEIPT: ConfigRecord(RosterName(node_identity(env).identity.name).to_config())}), reply_to=msg)


def train(msg: Message, env: ClientEnv) -> Message:
    """One DDP-SA round: noisy clipped gradient sum, secret-shared to the m intermediate servers."""
    conf = msg.content["config"]
    rnd = TrainIns.from_config(conf).round
    plan = DdpsaRound.from_config(conf)
    me = authenticating_identity(env).identity  # one the server cannot sign for: it must not push as the others
    servers = intermediate_servers(env, plan)  # before any work: a strategy's own servers are refused
    # The privacy floor: eps_t from the client's own budget schedule; the server's figure is only checked.
    eps_t = ddpsa_round_epsilon(env.cfg, rnd)
    at_most("ddpsa-epsilon", plan.epsilon, eps_t, f"this client's eps_t of round {rnd} from its run config")
    if me.name not in plan.participants:
        raise FloorViolation("ddpsa-participants", list(plan.participants), f"a list naming {me.name!r}",
                             "the round's noise is split over the listed participants")
    # The participants are the server's choice: a node asking for a guarantee counts its roster's colluders.
    federation = len(node_identity(env).roster) if policy(env).wants_guarantee else 0
    honest = ddpsa_noise_share(env.cfg, plan.noise, len(plan.participants), federation=federation)
    node_t = trust_minimum(env, "ddpsa-threshold")  # the node's own, resolved for its own servers (0 = auto)
    at_least("ddpsa-threshold", plan.threshold, max(sharing_threshold(t, len(servers)) for t in
                                                    (env.cfg.ddpsa_threshold, *([] if node_t is None else [node_t]))),
             "fewer intermediate servers than this client's 'ddpsa-threshold' could reconstruct its upload")
    scale = central_scale(env.cfg.clip, adjacency=env.cfg.adjacency, epsilon=eps_t, multiplier=plan.multiplier)
    if honest is not None:  # a split noise: the codec's round-off of every share must stay far below the central noise
        at_least("ddpsa-frac-bits", plan.frac_bits, min_frac_bits(len(plan.participants), scale),
                 "a coarser fixed-point grid rounds away the noise split over the participants")
    # Decided on public values before any work: a range the noisy sum may leave would refuse it after the charge.
    at_least("ddpsa-max-clients", plan.codec().max_abs, min_codec_range(len(env.y), env.cfg.clip, scale),
             f"a fixed-point range (ddpsa-frac-bits = {plan.frac_bits}) too small for this client's noisy sum")
    if plan.noise == "gaussian":  # more noise than the client's own z is taken (the server charges the plan's)
        at_least("ddpsa-noise-multiplier", plan.multiplier, ddpsa_noise_multiplier(env.cfg),
                 "this client's noise multiplier from its run config (cdp's calibration)")
    dtype = full_batch_dtype(env.cfg.clip)  # float64 where float32 does not resolve the clip
    weights = from_record(msg.content["arrays"])
    length = sum(int(np.asarray(a).size) for a in weights.values())  # the gradient vector's (state_dict order)
    terms = ShareTerms(plan.participants, ddpsa_min_summed(env.cfg, plan.noise, len(plan.participants),
                                                           threshold=plan.threshold, servers=len(servers)))
    with ThreadPoolExecutor(max_workers=1) as pool:  # the servers' answers arrive while the gradients are computed
        checked = pool.submit(preflight, servers, plan, rnd, me, length, terms)
        noisy, loss, frac, event = _noisy_sum(env, plan, weights, eps_t, honest, dtype)
        checked.result()  # a round no push could enter is refused unpaid
    if noisy.size != length:
        raise ValueError(f"the noisy sum has {noisy.size} values where the model has {length}")
    # Recorded before any share leaves, composed as the server charges it (run-config 'ddpsa-composition').
    spent = release(msg, env, event,
                    accountant=composition_accountant(env.cfg.ddpsa_composition, env.cfg.ddpsa_noise))
    t0 = time.perf_counter()
    size = share_and_push(noisy, plan.codec(), servers, plan.run_id, rnd, me, threshold=plan.shamir_threshold,
                          terms=terms)
    receipt = ShareReceipt(me.name, share_bytes=8 * size * len(servers), share_time_s=time.perf_counter() - t0)
    out = reply(msg, ArrayRecord(), len(env.y), train_loss=loss, clipped_fraction=frac, **receipt.to_metrics(),
                **spent)
    out.content[RECEIPT] = ConfigRecord(receipt.to_config())
    return out


def _noisy_sum(env: ClientEnv, plan: DdpsaRound, weights: dict[str, np.ndarray], eps_t: float, honest: int | None,
               dtype: str) -> tuple[np.ndarray, float, float, Event]:
    """The client's noisy clipped gradient sum of the round, its loss and clipped fraction, and the release.

    The sum is computed in ``dtype`` (:func:`client.env.full_batch_dtype`) where the model's own is narrower.
    """
    model = env.model(weights)
    if dtype == "float64" and next(model.parameters()).dtype == torch.float32:
        model = model.double()  # float32 rounds the clip's records on its subnormal grid
    if plan.noise == "gaussian":
        assert honest is not None  # ddpsa_noise_share splits every Gaussian round
        noisy, loss, frac = gaussian_gradient_sum(model, env.x, env.y, env.cfg.clip, plan.multiplier, honest,
                                                  seed=_noise_seed(), adjacency=env.cfg.adjacency)
        return noisy, loss, frac, GaussianEvent(plan.multiplier)
    noisy, loss, frac = noisy_gradient_sum(model, env.x, env.y, env.cfg.clip, eps_t, honest=honest,
                                           seed=_noise_seed(), adjacency=env.cfg.adjacency,
                                           centred=env.cfg.ddpsa_centering and is_linear_classifier(model))
    return noisy, loss, frac, LaplaceEvent(eps_t)
