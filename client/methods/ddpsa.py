"""DDP-SA client (Wei et al., Algorithm 2, client loop): Laplace LDP + additive secret sharing.

Per round ``t``, on the received global model ``theta_t`` (FedSGD, as in the paper:
one gradient over the whole local dataset, no local steps):

1. per-sample gradients ``g_j`` of the cross-entropy loss at ``theta_t`` (exact layer-wise
   norms at about one backward pass, :mod:`protocols.per_example`), each clipped to L1 norm
   ``Delta`` = run-config ``clip`` over *all* parameters jointly;
2. ``s_i = sum_j g_j + noise`` with ``b = 2 Delta / eps_t`` (L1 sensitivity ``2 Delta`` to replacing
   one sample, :func:`protocols.ddpsa.l1_sensitivity`; the paper's ``Delta / eps_t`` assumes add/remove
   adjacency, which publishing ``N_i`` breaks) and the round's ``eps_t`` from the client's *own* budget
   schedule (Eq. 12, from its run config: :func:`protocols.floor.ddpsa_round_epsilon`; a larger ``eps_t``
   from the server is refused).  ``noise`` is the paper's ``Lap(0, b)^d`` in a ``"local"`` round, or in a
   ``"distributed"`` round this participant's share ``Gamma(1/n', b) - Gamma(1/n', b)`` of one central
   ``Lap(b)`` (:func:`protocols.ddpsa.distributed_laplace_share`, ``n'`` from the round's participant
   list and the client's own ``ddpsa-collude-frac``: :func:`protocols.floor.ddpsa_noise_share`; the
   client must be on the list);
3. fixed-point encoding into Z_2^64 (``2^frac_bits`` scaling instead of the paper's
   ``10^dn``; exact ring arithmetic, see :mod:`protocols.secret_sharing`), split into
   ``m`` shares -- additive, or Shamir with threshold ``t < m`` (any ``t`` servers reconstruct,
   ``t - 1`` learn nothing; the round's ``t`` is refused below the client's own
   ``ddpsa-threshold``) -- share ``j`` pushed over gRPC (TLS, signed with the node's roster
   identity) to intermediate server ``j``; with Shamir shares the push succeeds when ``t``
   servers took theirs.

The intermediate servers come from the client's *own* configuration (:func:`intermediate_servers`:
node config ``ddpsa-servers``/``ddpsa-ca``, else the run config): the list in the server's
:class:`client.messages.ddpsa.DdpsaRound` is only compared with it, and a round naming other
servers is refused before any work (a strategy cannot make a client send shares to servers it
controls).

Deviation (weighting): the paper's client averages, ``g~_i = s_i / N_i``, and the server
applies ``N_i / N`` to the aggregate -- a per-client weight that cannot be applied to a
secret-shared sum.  We share ``N_i g~_i = s_i`` (the noisy *sum*) instead, so the
reconstructed ring sum divided by ``N = sum_i N_i`` is exactly Eq. (5)'s
``sum_i (N_i / N) g~_i`` (``N_i`` is public in the paper and sent as ``num-examples``).

The round's parameters arrive as :class:`client.messages.ddpsa.DdpsaRound`.  ``query.ddpsa_identity``
(:func:`identity`) answers the node's roster name, which the parameter server lists as a participant.  The upload
to the Flower server is empty: only metrics (``num-examples``, ``train_loss`` at
``theta_t``, ``clipped_fraction`` and a :class:`client.messages.ddpsa.ShareReceipt`).
A push failure (an intermediate server down) raises
:class:`client.intermediate.SharePushError`, which becomes an error reply naming the
server.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from torch import nn

from client.env import ClientEnv, reply
from client.floor import release
from client.identity import node_identity
from client.intermediate import IntermediateServers, share_and_push
from client.messages.common import TrainIns
from client.messages.ddpsa import DdpsaRound, RosterName, ShareReceipt
from client.wire import from_record
from protocols.config import sharing_threshold
from protocols.ddpsa import distributed_laplace_share, l1_sensitivity, laplace_noise
from protocols.floor import FloorViolation, at_least, at_most, ddpsa_noise_share, ddpsa_round_epsilon
from protocols.per_example import PerExampleClipper
from protocols.privacy import LaplaceEvent, laplace_scale

#: Per-sample clipped gradients are summed this many samples at a time (bounds memory).
CHUNK = 256


def _noise_seed() -> bytes:
    """Fresh 32-byte CSPRNG seed for this round's Laplace noise (tests patch it)."""
    return os.urandom(32)


def clipped_gradient_sum(model: nn.Module, x: np.ndarray, y: np.ndarray, clip: float) -> tuple[np.ndarray, float, float]:
    """``sum_j g_j / max(1, ||g_j||_1 / clip)`` over all samples, as one float64 vector.

    The vector follows the model's ``state_dict`` order (that of :func:`protocols.arrays.flatten`).
    Returns ``(sum, mean loss at the current weights, fraction of samples clipped)``.
    """
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    state_keys = list(model.state_dict().keys())
    if names != state_keys:
        raise ValueError("DDP-SA needs a model whose state_dict holds exactly its trainable parameters")

    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    sums = [torch.zeros(p.shape, dtype=torch.float64) for _, p in model.named_parameters()]
    clipped, loss_sum = 0, 0.0
    model.eval()  # no dropout/batch-norm in our models; per-sample grads need a per-sample forward
    with PerExampleClipper(model, clip, norm="l1") as clip_sum:  # cross-entropy per sample
        for start in range(0, len(yt), CHUNK):
            grads, losses, n_clipped = clip_sum(xt[start:start + CHUNK], yt[start:start + CHUNK])
            clipped += n_clipped
            for acc, g in zip(sums, grads, strict=True):
                acc += g.to(torch.float64)
            loss_sum += float(losses.sum(dtype=torch.float64))
    vec = torch.cat([s.reshape(-1) for s in sums]).numpy()
    return vec, loss_sum / max(len(yt), 1), clipped / max(len(yt), 1)


def noisy_gradient_sum(model: nn.Module, x: np.ndarray, y: np.ndarray, clip: float, epsilon: float,
                       *, honest: int | None = None, seed: bytes | None = None) -> tuple[np.ndarray, float, float]:
    """Algorithm 2's client step before encoding: clipped sum + noise of scale ``b = 2 clip / epsilon``.

    ``honest`` None: ``Lap(b)`` per coordinate (the paper's local noise); else this client's share
    ``Gamma(1/honest, b) - Gamma(1/honest, b)`` of one central ``Lap(b)``.  Returns ``(noisy sum s_i,
    mean loss, clipped fraction)``; ``seed`` = None draws fresh OS randomness.
    """
    total, loss, frac = clipped_gradient_sum(model, x, y, clip)
    b = laplace_scale(l1_sensitivity(clip), epsilon)
    if honest is None:
        noise = laplace_noise(total.size, b, seed=seed)
    else:
        noise = distributed_laplace_share(total.size, b, honest, seed=seed)
    return total + noise, loss, frac


def intermediate_servers(env: ClientEnv, plan: DdpsaRound) -> IntermediateServers:
    """The intermediate servers of this client's own configuration; refuses a round that names others.

    Node config ``ddpsa-servers`` / ``ddpsa-ca`` win over the run config's (the node's own settings).

    Raises:
        FloorViolation: the client has no servers configured, or the round's list differs from its own.
    """
    nc = env.context.node_config
    own = tuple(a.strip() for a in str(nc.get("ddpsa-servers", env.cfg.ddpsa_servers)).split(",") if a.strip())
    ca = str(nc.get("ddpsa-ca", env.cfg.ddpsa_ca))
    why = "DDP-SA shares go only to the intermediate servers of this client's own configuration"
    if not own or not ca:
        raise FloorViolation("ddpsa-servers", list(plan.servers), "none configured",
                             why + " (set node config or run config 'ddpsa-servers' and 'ddpsa-ca')")
    if tuple(plan.servers) != own:
        raise FloorViolation("ddpsa-servers", list(plan.servers), list(own), why)
    try:
        return IntermediateServers.load(own, ca)
    except (OSError, ValueError) as err:
        raise FloorViolation("ddpsa-ca", ca, "a readable PEM CA certificate", str(err)) from err


def identity(msg: Message, env: ClientEnv) -> Message:
    """``query.ddpsa_identity``: the roster name this node pushes its shares under."""
    return Message(RosterName(node_identity(env).identity.name).to_content(), reply_to=msg)


def train(msg: Message, env: ClientEnv) -> Message:
    """One DDP-SA round: noisy clipped gradient sum, secret-shared to the m intermediate servers."""
    conf = msg.content["config"]
    rnd = TrainIns.from_config(conf).round
    plan = DdpsaRound.from_config(conf)
    servers = intermediate_servers(env, plan)  # before any work: a strategy's own servers are refused
    me = node_identity(env).identity
    # The privacy floor: eps_t from the client's own budget schedule; the server's figure is only checked.
    eps_t = ddpsa_round_epsilon(env.cfg, rnd)
    at_most("ddpsa-epsilon", plan.epsilon, eps_t, f"this client's eps_t of round {rnd} from its run config")
    if me.name not in plan.participants:
        raise FloorViolation("ddpsa-participants", list(plan.participants), f"a list naming {me.name!r}",
                             "the round's noise is split over the listed participants")
    honest = ddpsa_noise_share(env.cfg, plan.noise, len(plan.participants))
    at_least("ddpsa-threshold", plan.threshold, sharing_threshold(env.cfg.ddpsa_threshold, len(servers)),
             "fewer intermediate servers than this client's 'ddpsa-threshold' could reconstruct its upload")
    model = env.model(from_record(msg.content["arrays"]))
    noisy, loss, frac = noisy_gradient_sum(model, env.x, env.y, env.cfg.clip, eps_t, honest=honest,
                                           seed=_noise_seed())
    spent = release(msg, env, LaplaceEvent(eps_t))  # recorded before any share leaves
    t0 = time.perf_counter()
    size = share_and_push(noisy, plan.codec(), servers, plan.run_id, rnd, me, threshold=plan.shamir_threshold)
    receipt = ShareReceipt(me.name, share_bytes=8 * size * len(servers), share_time_s=time.perf_counter() - t0)
    out = reply(msg, ArrayRecord(), len(env.y), train_loss=loss, clipped_fraction=frac, **receipt.to_metrics(),
                **spent)
    receipt.attach(out.content)
    return out
