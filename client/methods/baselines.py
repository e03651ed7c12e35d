"""Client side of the baselines: FedAvg (no DP), local DP (DP-FedAvg) and central DP."""

from __future__ import annotations

import os

import numpy as np
from flwr.app import Message

from client.env import ClientEnv, local_training, reply
from client.floor import release
from client.messages.baselines import LocalDpNoise, uniform_weight
from client.wire import to_record
from protocols.arrays import flatten, unflatten
from protocols.clipping import clip_l2
from protocols.floor import at_least, ldp_noise_std
from protocols.privacy import GaussianEvent


def train_fedavg(msg: Message, env: ClientEnv) -> Message:
    """Train and upload the local model (float32), weighted by the number of examples."""
    _, local_w, loss = local_training(msg, env)
    return reply(msg, to_record(local_w, np.float32), len(env.y), train_loss=loss, **release(msg, env))


def train_cdp(msg: Message, env: ClientEnv) -> Message:
    """Like FedAvg, but with unit weight: central DP needs a uniform mean (sensitivity clip/m).

    Clipping is done by Flower's ``fixedclipping_mod`` around this handler.
    """
    _, local_w, loss = local_training(msg, env)
    return reply(msg, to_record(local_w, np.float32), len(env.y), train_loss=loss, **uniform_weight(),
                 **release(msg, env))


def train_ldp(msg: Message, env: ClientEnv) -> Message:
    """Client-level local DP: clip the update to ``clip`` and add Gaussian noise before upload.

    The noise std (noise multiplier x clip, for (epsilon, delta) over the run) is the client's
    own (:func:`protocols.floor.ldp_noise_std` of its run config); the server's
    :class:`client.messages.baselines.LocalDpNoise` is only checked against it (a smaller
    one is refused).  The noise comes from the AES-CTR CSPRNG of :mod:`protocols.prg`,
    freshly seeded from the OS.
    """
    from protocols.prg import gaussian

    std = ldp_noise_std(env.cfg)
    at_least("noise-std", LocalDpNoise.from_config(msg.content["config"]).std, std)
    global_w, local_w, loss = local_training(msg, env)
    delta = flatten(local_w) - flatten(global_w)
    clipped, norm = clip_l2(delta, env.cfg.clip)
    noisy = flatten(global_w) + clipped + gaussian(os.urandom(32), len(clipped), std)
    spent = release(msg, env, GaussianEvent(std / env.cfg.clip))
    return reply(msg, to_record(unflatten(noisy, global_w)), len(env.y), train_loss=loss, update_norm=norm, **spent)
