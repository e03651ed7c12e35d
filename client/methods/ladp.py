"""LaDP-FL client (Li et al., Algorithm 2): clipped local training, then layer-wise noise.

Per round, for the received global model ``w_g``:

1. local SGD with every *per-example* gradient clipped to L2 norm ``G_c`` = run-config
   ``clip`` (:func:`client.env.record_level_training`; Algorithm 2 lines 3-8 clip the
   mini-batch gradient instead);
2. sensitivity ``Delta_f`` = :func:`protocols.privacy.record_sensitivity` of that training and
   the client's own ``N_i``: ``2 G_c eta / N_i`` for one full-batch step (the default regime).
   This replaces Theorem 2's ``2 eta E G_c``: that bound only holds because the mini-batch
   mean's clip bounds what *any* change of the data can do (a client-level bound, at chance
   accuracy at epsilon 1); per-example clipping makes the one-record bound -- the paper's
   adjacency -- correct and ``N_i`` times tighter (:mod:`protocols.ladp`);
3. layer selection ``||w_g_j||_2 >= R`` (``ladp-norm-threshold``) on the received global model, privacy
   estimate ``P_j = min(est_j, B)`` (``ladp-kl-cap``) from the server's public estimate ``est_j`` (the KL
   between the last two published global models, :class:`client.messages.ladp.PublicEstimates`; ``B`` in
   round 1), floored at ``B / ladp-max-boost``, and ``sigma_j = c Delta_f / (epsilon P_j)`` with ``c = c0 B``
   (Algorithms 3-4) -- all in :func:`protocols.ladp.plan_public_noise`.  Algorithm 2 computes selection and
   ``P_j`` from the trained local model, which makes the noise scale a function of the private data (not
   DP: :mod:`protocols.ladp`).  The plan uses the *corrected* Theorem 3
   constant ``c0 = (m + sqrt(m^2 + 2 eps)) / 2``, ``m = max(1, sqrt(ln(2/(pi delta^2))))``
   (the paper's Eq. (11) has ``L/2`` in place of ``L`` and is not (eps, delta)-DP);
4. Gaussian noise from the AES-CTR CSPRNG (fresh ``os.urandom`` seed) added to the
   selected layers; the noisy model is uploaded (the server takes the example-weighted
   mean, Algorithm 1).

A "layer" is one ``state_dict`` tensor (a module's weight and bias are separate layers).
Theorem 3 is applied per round at ``epsilon_r = protocols.ladp.round_epsilon(epsilon, delta,
num-rounds)``, so the run's ``epsilon``/``delta`` is the whole-run target (:mod:`strategies.ladp`).

Metrics sent with the upload (a :class:`client.messages.ladp.NoiseReport`; the server
averages them over clients, by examples): ``noised_layers``, ``num_layers``, ``total_noise_norm`` (L2 norm of the whole noise
vector), ``sensitivity``, ``local_steps`` and per layer ``noise_norm/<layer>``,
``sigma/<layer>``, ``selected/<layer>`` (0/1) and ``kl/<layer>`` (the public estimate used); the noise
norms are the expected ones (``sigma_j sqrt(size_j)``): every figure is a function of public inputs.
"""

from __future__ import annotations

import math
import os

import numpy as np
from flwr.app import Message

from client.env import ClientEnv, record_level_training, reply
from client.floor import release
from client.messages.ladp import LayerNoise, NoiseReport, PublicEstimates
from client.wire import to_record
from protocols import ladp
from protocols.privacy import GaussianEvent, local_sgd_steps, record_sensitivity

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
    noisy, _ = ladp.apply_layer_noise(local_w, plan, _noise_seed())
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
    z = 0.0 if report.unnoised_release else ladp.theorem3_c0_corrected(eps_round, cfg.delta) / eps_round
    spent = release(msg, env, GaussianEvent(z))
    return reply(msg, to_record(noisy, np.float32), len(env.y), train_loss=loss, clipped_fraction=clip_frac,
                 **report.to_metrics(), **spent)
