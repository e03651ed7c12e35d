"""Client side of ``mpddp`` (DDP_Client), ``mpdp-naive`` and ``mpcdp``: gradient at W-hat, Psi, Phi, noise.

The train message (:mod:`client.messages.mpddp`) carries the perturbed expanded model W-hat
(:class:`~client.messages.mpddp.PerturbedModel`) and the noise scales chosen by the server
(semi-honest model, as the ``ldp`` baseline: clients follow the protocol and use the scales they are
sent).  The client computes ONE full-batch gradient of the paper's loss 1/2 ||y - onehot||^2 at W-hat
on its whole partition, plus Psi and Phi (:func:`protocols.mpddp.client_gradients`; FedSGD, so
``local-epochs``/``batch-size``/``lr`` are unused), then by method:

* ``mpddp``: :func:`protocols.mpddp.ddp_client` (Algorithm 2): eta_k ~ DN(sigma_eta, 1) from a fresh
  ``os.urandom`` seed plus sum_v Delta_kv with Delta_kv ~ DN(sigma_Delta, 1) from the pairwise seeds of
  the round's key phase (purpose ``mpddp-delta``; :func:`client.pairwise_phase.pair_seeds`).  With
  run-config ``cancellation-check`` it also reports the projection of its Delta part on the round's
  public direction (diagnostic only).
* ``mpdp-naive``: :func:`protocols.mpddp.naive_client`, N(0, sigma^2) on the perturbed gradient.
* ``mpcdp``: nothing (the server adds the noise).

Psi and Phi are uploaded unnoised, as in the paper (they are data-dependent: see the caveats in
:mod:`strategies.mpddp`).  Upload (:func:`client.messages.mpddp.upload_record`): gradients float64,
Psi/Phi in run-config ``mpddp-side-dtype`` (float64 by default; float32 halves the upload).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from flwr.app import Message

from client.env import ClientEnv, reply
from client.messages.keys import probe_metric
from client.messages.mpddp import DdpNoise, NaiveNoise, PerturbedModel, upload_record
from client.pairwise_phase import mask_probe, pair_seeds
from protocols.mpddp import client_gradients, ddp_client, naive_client, one_hot, torch_threads

#: HKDF purpose of the pairwise Delta seeds (fixed on the client: the server cannot redirect it).
DELTA_PURPOSE = "mpddp-delta"


def train(msg: Message, env: ClientEnv) -> Message:
    """One round of the client: gradient + Psi, Phi at W-hat, method noise, upload."""
    with torch_threads(1):  # tiny matrices: thread hand-offs dominate otherwise
        return _train(msg, env)


def _train(msg: Message, env: ClientEnv) -> Message:
    method = env.cfg.method
    cfg = msg.content["config"]
    w_hat = [torch.from_numpy(m) for m in PerturbedModel.from_record(msg.content["arrays"]).matrices]
    x = torch.from_numpy(np.asarray(env.x, dtype=np.float64).reshape(len(env.x), -1))
    y = one_hot(torch.from_numpy(np.asarray(env.y)), env.num_classes)
    up = client_gradients(w_hat, x, y)
    metrics: dict[str, float] = {}
    if method == "mpddp":
        noise = DdpNoise.from_config(cfg)
        up, delta = ddp_client(up, own_id=env.node_id, pair_seeds=pair_seeds(msg, env, DELTA_PURPOSE),
                               eta_seed=os.urandom(32), sigma_eta=noise.sigma_eta, sigma_delta=noise.sigma_delta)
        if env.cfg.cancellation_check:
            metrics.update(probe_metric(mask_probe(msg, delta)))
    elif method == "mpdp-naive":
        up = naive_client(up, eta_seed=os.urandom(32), sigma=NaiveNoise.from_config(cfg).sigma)
    elif method != "mpcdp":
        raise ValueError(f"client.methods.mpddp does not handle method {method!r}")
    return reply(msg, upload_record(up, env.cfg.mpddp_side_dtype), len(env.y), **metrics)
