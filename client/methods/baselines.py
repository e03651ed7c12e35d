"""Client side of the baselines: FedAvg (no DP), local DP (DP-FedAvg) and central DP.

``ldp`` and ``cdp`` protect a *record* by default (run-config ``privacy-unit = "record"``): the client
trains with per-example clipping (:func:`client.env.record_level_training`), whose
sensitivity is :func:`protocols.privacy.record_sensitivity` (``a C lr / n_k`` for one full-batch step; a = 1 zero-out,
2 replace-one).
``privacy-unit = "client"`` keeps client-level DP-FedAvg: the whole update is clipped to ``clip``.
"""

from __future__ import annotations

import os

import numpy as np
from flwr.app import Message

from client.env import ClientEnv, client_level_update, local_training, record_level_training, reply
from client.floor import release
from client.records import to_record
from protocols.arrays import flatten, unflatten
from protocols.floor import at_least, ldp_noise_multiplier, ldp_noise_std
from protocols.privacy import GaussianEvent, record_sensitivity
from protocols.wire.baselines import ClippingNorm, LocalDpNoise


def train_fedavg(msg: Message, env: ClientEnv) -> Message:
    """Train and upload the local model (float32), weighted by the number of examples."""
    _, local_w, loss = local_training(msg, env)
    return reply(msg, to_record(local_w, np.float32), len(env.y), train_loss=loss, **release(msg, env))


def train_cdp(msg: Message, env: ClientEnv) -> Message:
    """Central DP: upload the local model un-noised (the server is trusted and adds the noise to the mean).

    Record level: per-example-clipped training, upload weighted by ``n_k`` (the server's
    example-weighted mean has record sensitivity ``a C lr / N``).  Client level: plain training,
    the server takes the uniform mean (sensitivity ``clip / k``), the update clipped to the norm the
    server's :class:`protocols.wire.baselines.ClippingNorm` names (Flower's ``fixedclipping_mod`` rule).
    """
    if env.cfg.privacy_unit == "client":
        norm = min(ClippingNorm.from_config(msg.content["config"]).clip, env.cfg.clip)  # never above its own clip
        global_w, clipped, loss, _ = client_level_update(msg, env, norm)
        clipped_w = unflatten(flatten(global_w) + clipped, global_w)
        return reply(msg, to_record(clipped_w, np.float32), len(env.y), train_loss=loss,
                     **release(msg, env))
    _, local_w, loss, frac = record_level_training(msg, env)
    return reply(msg, to_record(local_w, np.float32), len(env.y), train_loss=loss, clipped_fraction=frac,
                 **release(msg, env))


def train_ldp(msg: Message, env: ClientEnv) -> Message:
    """Local DP: the client noises its own upload, so the server only ever sees noised models.

    The noise multiplier z (for (epsilon, delta) over the run, exact RDP) and the std
    (:func:`protocols.floor.ldp_noise_std`) are the client's own, from its run config and its own
    dataset size; the server's :class:`protocols.wire.baselines.LocalDpNoise` multiplier is checked
    against z (a smaller one is refused) and used when larger (the server raises it to keep the run
    within its epsilon target): more noise than the floor, never less.  The noise comes from the
    AES-CTR CSPRNG of :mod:`protocols.prg`, freshly seeded from the OS.

    * record level (default): per-example-clipped training, then the local *model* plus
      N(0, (z * 2 C lr / n_k)^2) per coordinate (the NADP paper's LDP-FL comparator, Lemma 3).
    * client level: the update clipped to ``clip`` plus N(0, (z clip)^2).
    """
    from protocols.prg import gaussian

    z = ldp_noise_multiplier(env.cfg)
    asked = LocalDpNoise.from_config(msg.content["config"]).multiplier
    at_least("noise-multiplier", asked, z)
    scale = max(asked / z, 1.0)  # every std below times it: 1.0 exactly unless the server asked for more
    n_k = len(env.y)
    if env.cfg.privacy_unit == "client":
        global_w, clipped, loss, norm = client_level_update(msg, env, env.cfg.clip)
        std = ldp_noise_std(env.cfg) * scale
        # The noise joins the clipped update before the model: rounding the sum with a large model is then
        # post-processing of the noised update, not a function of the data the noise does not cover.
        noisy = flatten(global_w) + (clipped + gaussian(os.urandom(32), len(clipped), std))
        spent = release(msg, env, GaussianEvent(std / env.cfg.clip))
        return reply(msg, to_record(unflatten(noisy, global_w)), n_k, train_loss=loss, update_norm=norm, **spent)
    global_w, local_w, loss, frac = record_level_training(msg, env)
    sens = record_sensitivity(env.cfg, n_k)
    std = ldp_noise_std(env.cfg, n_k) * scale
    flat = flatten(local_w)
    noisy = flat + gaussian(os.urandom(32), len(flat), std)
    spent = release(msg, env, GaussianEvent(std / sens))
    return reply(msg, to_record(unflatten(noisy, global_w)), n_k, train_loss=loss, clipped_fraction=frac,
                 noise_std=std, **spent)
