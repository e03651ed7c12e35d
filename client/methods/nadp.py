"""Client side of NADP-FL (Noise-Annihilation DP-FL, Algorithm 1 of the paper).

Per round a sampled client

1. answered ``query.keys`` (first round of a key epoch) with an X25519 public key and its dataset size
   ``|D_i|`` (:func:`client.pairwise_phase.handle_keys`);
2. receives the global model plus the round's public plan
   (:class:`client.messages.nadp.NadpPlan`: the participants' ids and sizes,
   ``sigma_up``, ``sigma_down`` (Eq. 3) and the compensation factor
   ``lambda``) and its peer keys; it rebuilds the pairing graph
   (:func:`protocols.graphs.round_graph` from the round's public graph seed)
   and recomputes the noise allocation itself (Alg. 2 or the sparse-graph rule,
   :func:`protocols.nadp.upload_noise_scales`, deterministic in those public
   values, so both ends of every pair get the identical ``sigma_ij``);
3. trains locally with *per-example* gradient clipping at ``C`` (Lemma 1's
   sensitivity ``2C/|D_i|`` is a bound on a mean of per-example clipped
   gradients; clipping the mini-batch mean, as ``client.training.train(...,
   grad_clip=)`` does, would only bound it by ``2C``);
4. uploads ``w_i + (1/p_i) (n_i + lambda (sum_{j>i} n_ij - sum_{j<i} n_ij))``
   (Alg. 1, line 15) in float64: ``n_i`` from a fresh secret seed
   (``os.urandom``), ``n_ij`` from the pair's DH seed (purpose
   ``nadp-counteract``, already distinct per round) through the shared
   pairwise-noise engine.

With run-config ``nadp-variant = "record-ldp"`` the client instead adds only
independent noise of the std the server sends (the paper's LDP-FL comparator,
Lemma 3): same training, same sensitivity, no cancellation.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import torch
from flwr.app import Message
from torch import nn

from client.env import ClientEnv, reply
from client.messages.common import TrainIns
from client.messages.keys import PeerKeys, probe_metric
from client.messages.nadp import NadpPlan
from client.models import get_weights
from client.pairwise_phase import mask_probe, pair_seeds
from client.training import on_device
from client.wire import Weights, from_record, to_record
from protocols.arrays import flatten, unflatten
from protocols.graphs import round_graph
from protocols.nadp import nadp_upload, upload_noise_scales
from protocols.pairwise import pairwise_noise
from protocols.per_example import clipped_grad_sum
from protocols.prg import gaussian

PAIR_PURPOSE = "nadp-counteract"


def residual_seed() -> bytes:
    """Fresh secret seed of the residual noise ``n_i`` (a function so tests can pin it)."""
    return os.urandom(32)


# ------------------------------------------------- per-example clipped training
def batches(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Shuffled consecutive batches; the last one may be smaller.

    The batch structure must match :func:`protocols.nadp.local_sgd_sensitivity`
    (which the server uses to calibrate the noise).
    """
    order = rng.permutation(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


def clipped_sgd(model: nn.Module, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
                clip: float, seed: int) -> tuple[float, float]:
    """SGD where each step uses the mean of per-example gradients clipped to L2 norm ``clip``.

    Returns (mean training loss of the last epoch, fraction of clipped examples).
    """
    rng = np.random.default_rng(seed)
    xt, yt = on_device(model, x, y)  # run-config 'device': the model's device
    params = list(model.parameters())
    model.train()
    last, clipped, seen = 0.0, 0, 0
    for _ in range(epochs):
        total, count = 0.0, 0
        for idx in batches(len(yt), batch_size, rng):
            ix = torch.as_tensor(idx, device=xt.device)
            grads, losses, n_clipped = clipped_grad_sum(model, xt[ix], yt[ix], clip)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p -= (lr / len(idx)) * g
            total += float(losses.sum())
            count += len(idx)
            clipped += n_clipped
            seen += len(idx)
        last = total / max(count, 1)
    return last, clipped / max(seen, 1)


def clipped_local_training(msg: Message, env: ClientEnv) -> tuple[Weights, Weights, float, float]:
    """Train the received global model with per-example clipping at run-config ``clip``.

    Deterministic given the message (batch order from the public round seed).
    Returns ``(global_weights, local_weights, train_loss, clipped_fraction)``.
    """
    global_w = from_record(msg.content["arrays"])
    model = env.model(global_w)
    rnd = TrainIns.from_config(msg.content["config"]).round
    cfg = env.cfg
    loss, frac = clipped_sgd(model, env.x, env.y, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                             clip=cfg.clip, seed=env.round_seed(rnd))
    return global_w, get_weights(model), loss, frac


# ------------------------------------------------------------------- handler
def noise_parts(msg: Message, env: ClientEnv, plan: NadpPlan, size: int) -> tuple[float, np.ndarray, np.ndarray]:
    """``(p_i, residual n_i, counteracting sum c_i)`` of this client for the round.

    ``c_i = sum_{j>i} n_ij - sum_{j<i} n_ij`` with per-pair stds from the
    allocation (zero vector for the record-ldp variant).
    """
    me = env.node_id
    if me not in plan.sizes:
        raise ValueError(f"node {me} is not in this round's nadp participants")
    if plan.sizes[me] != len(env.y):
        raise ValueError(f"server lists |D_i|={plan.sizes[me]} for node {me}, but it holds {len(env.y)} examples")
    if plan.variant == "record-ldp":
        total = math.fsum(plan.sizes[c] for c in sorted(plan.ids))
        p_i = plan.sizes[me] / total
        # upload noise std sigma_i  <=>  residual std p_i * sigma_i before the 1/p_i factor
        return p_i, gaussian(residual_seed(), size, p_i * plan.ldp_stds[me]), np.zeros(size)
    # The pair variances depend on the whole graph (neighbours' degrees): rebuild it from public values.
    peer_keys = PeerKeys.from_config(msg.content["config"])
    if peer_keys.graph_seed is None:
        raise ValueError("nadp: the train message carries no graph seed")
    graph = round_graph(env.cfg.graph, env.cfg.n_out, plan.ids, peer_keys.graph_seed)
    alloc = upload_noise_scales(plan.sizes, plan.sigma_up, plan.sigma_down, graph=graph)
    if sorted(peer_keys.peer_ids) != sorted(graph[me]):
        # Every pair of the plan's graph must be keyed; a missing pair would break cancellation.
        raise ValueError("nadp: the peer list differs from the round's pairing graph")
    seeds = pair_seeds(msg, env, purpose=PAIR_PURPOSE)
    residual = gaussian(residual_seed(), size, alloc.residual_std[me])
    counteract = pairwise_noise(me, seeds, size, scale=alloc.counteracting_stds(me))
    return alloc.weights[me], residual, counteract


def train(msg: Message, env: ClientEnv) -> Message:
    """NADP-FL local step: clipped training, residual + counteracting noise, float64 upload."""
    plan = NadpPlan.from_config(msg.content["config"])
    _, local_w, loss, clip_frac = clipped_local_training(msg, env)
    w = flatten(local_w)
    p_i, residual, counteract = noise_parts(msg, env, plan, len(w))
    lam = plan.lam if plan.variant == "nadp" else 1.0
    upload = nadp_upload(w, p_i, residual, counteract, lam)
    metrics: dict[str, float] = {"train_loss": loss, "clipped_fraction": clip_frac}
    if env.cfg.cancellation_check and plan.variant == "nadp":
        # The part that enters the aggregate: p_i * (lam * c_i / p_i) = lam * c_i.
        metrics.update(probe_metric(mask_probe(msg, lam * counteract)))
    return reply(msg, to_record(unflatten(upload, local_w)), len(env.y), **metrics)
