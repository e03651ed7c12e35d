"""LaDP-FL client (Li et al., Algorithm 2): clipped local training, then layer-wise noise.

Per round, for the received global model ``w_g``:

1. local SGD with every mini-batch gradient clipped to L2 norm ``G_c`` = run-config
   ``clip`` (Algorithm 2 lines 3-8);
2. sensitivity ``Delta_f = 2 eta E G_c`` (Theorem 2).  ``E`` is the number of *clipped
   gradient steps* (``local-epochs x ceil(N_i / batch-size)``): the paper's Eq. (2)
   takes one clipped step per "epoch", and the bound is per clipped step;
3. layer selection ``||w_local_j||_2 >= R`` (``ladp-norm-threshold``), privacy estimate
   ``P_j = min(KL(softmax(w_local_j) || softmax(w_g_j)), B)`` (``ladp-kl-cap``) and
   ``sigma_j = c Delta_f / (epsilon P_j)`` with ``c = c0 B`` (Algorithms 3-4) -- all in
   :func:`protocols.ladp.plan_layer_noise`, which uses the *corrected* Theorem 3
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
``sigma/<layer>``, ``selected/<layer>`` (0/1) and ``kl/<layer>`` (raw KL).  They reveal
the per-layer noise scale, which depends on the private local weights (a caveat of the paper's design, reported, not fixed).
"""

from __future__ import annotations

import math
import os

import numpy as np
from flwr.app import Message

from client.env import ClientEnv, local_training, reply
from client.floor import release
from client.messages.ladp import LayerNoise, NoiseReport
from client.wire import to_record
from protocols import ladp
from protocols.privacy import GaussianEvent

#: Floor of the KL estimate (``P_j -> 0`` would make sigma infinite; see protocols.ladp).
MIN_KL = 1e-12


def _noise_seed() -> bytes:
    """Fresh 32-byte CSPRNG seed for this upload's noise (tests patch it for determinism)."""
    return os.urandom(32)


def local_steps(num_examples: int, local_epochs: int, batch_size: int) -> int:
    """Number of clipped SGD steps ``E`` of one round (the ``E`` of Theorem 2)."""
    return local_epochs * math.ceil(num_examples / batch_size)


def train(msg: Message, env: ClientEnv) -> Message:
    """Clipped local training + LaDP layer-wise noise; uploads the noisy local model."""
    cfg = env.cfg
    global_w, local_w, loss = local_training(msg, env, grad_clip=cfg.clip)
    steps = local_steps(len(env.y), cfg.local_epochs, cfg.batch_size)
    eps_round = ladp.round_epsilon(cfg.epsilon, cfg.delta, cfg.num_rounds)  # the run's epsilon is the target
    plan = ladp.plan_layer_noise(
        local_w,
        global_w,
        epsilon=eps_round,
        delta=cfg.delta,
        lr=cfg.lr,
        local_steps=steps,
        grad_clip=cfg.clip,
        norm_threshold=cfg.ladp_norm_threshold,
        kl_cap=cfg.ladp_kl_cap,
        min_kl=min(MIN_KL, cfg.ladp_kl_cap),
    )
    noisy, noise_norms = ladp.apply_layer_noise(local_w, plan, _noise_seed())
    # Algorithm 2 computes KL for selected layers only; we report it for every
    # layer so the server-side means are not diluted by missing entries.
    report = NoiseReport(
        layers={name: LayerNoise(noise_norm=noise_norms[name], sigma=entry.sigma, selected=bool(entry.selected),
                                 kl=entry.kl if entry.kl is not None else ladp.softmax_kl(local_w[name], global_w[name]))
                for name, entry in plan.items()},
        sensitivity=ladp.sensitivity(cfg.lr, steps, cfg.clip),
        local_steps=steps,
    )
    # One round: a Gaussian release with multiplier >= c0 / epsilon (corrected Theorem 3; none if a layer went bare).
    z = 0.0 if report.unnoised_release else ladp.theorem3_c0_corrected(eps_round, cfg.delta) / eps_round
    spent = release(msg, env, GaussianEvent(z))
    return reply(msg, to_record(noisy, np.float32), len(env.y), train_loss=loss, **report.to_metrics(), **spent)
