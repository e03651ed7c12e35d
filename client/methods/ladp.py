"""LaDP-FL client (Li et al., Algorithm 2): clipped local training, then layer-wise noise.

Per round, for the received global model ``w_g``:

1. local SGD with every per-example gradient clipped to ``G_c`` = run-config ``clip``
   (:func:`client.env.record_level_training`);
2. ``Delta_f`` = :func:`protocols.privacy.record_sensitivity` of that training (replaces Theorem 2);
3. the noise plan from public inputs only (:func:`protocols.ladp.plan_public_noise`, Algorithms 3-4): selection
   ``||w_g_j||_2 >= R`` on the received model, ``P_j`` from the server's
   :class:`protocols.wire.ladp.PublicEstimates` floored at ``B / ladp-max-boost``, the corrected Theorem 3
   constant, at ``epsilon_r = protocols.ladp.round_epsilon(epsilon, delta, num-rounds)``;
4. a layer whose float32 upload grid may round its noise away is refused on public values
   (:func:`protocols.ladp.check_upload_grid`), before the noise;
5. Gaussian noise from :mod:`protocols.prg` (fresh ``os.urandom`` seed) on the selected layers; upload.

The upload carries a :class:`protocols.wire.ladp.NoiseReport` (``noised_layers``, ``num_layers``,
``total_noise_norm``, ``sensitivity``, ``local_steps``, per layer ``noise_norm``, ``sigma``, ``selected``,
``kl``); noise norms are expected ones (``sigma_j sqrt(size_j)``), so every figure depends on public inputs only.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import numpy as np
from flwr.app import Message

from client.env import ClientEnv, record_level_training, reply
from client.floor import release
from client.records import to_record
from protocols import ladp
from protocols.floor import noise_scale_of
from protocols.privacy import GaussianEvent, local_sgd_steps, record_sensitivity, record_training_movement
from protocols.wire.ladp import LayerNoise, NoiseReport, PublicEstimates

#: A KL cap B below any whole-layer KL: every selected layer gets the floor noise (the "full LDP" comparator).
MIN_KL = 1e-12


def _noise_seed() -> bytes:
    """Fresh 32-byte CSPRNG seed for this upload's noise (tests patch it for determinism)."""
    return os.urandom(32)


def local_steps(num_examples: int, local_epochs: int, batch_size: int) -> int:
    """Number of clipped SGD steps ``E`` of one round (reported; the ``E`` of Theorem 2)."""
    return local_sgd_steps(num_examples, epochs=local_epochs, batch_size=batch_size)


def privacy_estimates(msg: Message, local_w: dict[str, np.ndarray], global_w: dict[str, np.ndarray]) -> dict[str, float]:
    """The per-layer ``P_j`` the noise is set from: the server's public estimates (never the local model)."""
    return dict(PublicEstimates.from_config(msg.content["config"]).layers)


def train(msg: Message, env: ClientEnv) -> Message:
    """Per-example clipped local training + LaDP layer-wise noise; uploads the noisy local model."""
    cfg = env.cfg
    global_w, local_w, loss, clip_frac = record_level_training(msg, env)
    steps = local_steps(len(env.y), cfg.local_epochs, cfg.batch_size)
    sens = record_sensitivity(cfg, len(env.y))  # the client's own N_i: nothing comes from the server
    eps_round = ladp.round_epsilon(cfg.epsilon, cfg.delta, cfg.num_rounds)  # the run's epsilon is the target
    plan = ladp.plan_public_noise(
        global_w,
        privacy_estimates(msg, local_w, global_w),
        epsilon=eps_round,
        delta=cfg.delta,
        sensitivity=sens,
        norm_threshold=cfg.ladp_norm_threshold,
        kl_cap=cfg.ladp_kl_cap,
        min_kl=cfg.ladp_kl_cap / cfg.ladp_max_boost,  # a layer's noise is at most max-boost x the floor
    )
    scale = noise_scale_of(msg.content["config"])  # the server may raise the noise (budget guard), never lower it
    plan = {name: replace(entry, sigma=entry.sigma * scale) for name, entry in plan.items()}
    # Decided on public values before the noise: a refusal decided on the noisy model would release it uncharged.
    ladp.check_upload_grid(global_w, plan, record_training_movement(cfg, len(env.y)), np.float32)
    noisy, _ = ladp.apply_layer_noise(local_w, plan, _noise_seed(), upload_dtype=np.float32)
    # Every reported figure is public (the plan's): the realised noise norm would reveal the noise itself.
    report = NoiseReport(
        layers={name: LayerNoise(noise_norm=entry.sigma * math.sqrt(np.size(local_w[name])), sigma=entry.sigma,
                                 selected=bool(entry.selected), kl=entry.privacy if entry.privacy is not None else 0.0)
                for name, entry in plan.items()},
        sensitivity=sens,
        local_steps=steps,
    )
    # One round: a Gaussian release with multiplier min_j sigma_j / Delta_f >= c0 / epsilon (corrected Theorem 3;
    # none if a layer went bare).
    z = 0.0 if report.unnoised_release else ladp.round_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds, scale=scale)
    spent = release(msg, env, GaussianEvent(z))
    return reply(msg, to_record(noisy, np.float32), len(env.y), train_loss=loss, clipped_fraction=clip_frac,
                 **report.to_metrics(), **spent)
