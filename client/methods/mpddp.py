"""Client side of ``mpddp`` (DDP_Client), ``mpdp-naive`` and ``mpcdp``: gradient at W-hat, Psi, Phi, noise.

The train message carries the perturbed expanded model W-hat (``w_hat.0 .. w_hat.{2L-2}``, float64) and
the noise scales chosen by the server (semi-honest model, as the ``ldp`` baseline: clients follow the
protocol and use the scales they are sent).  The client computes ONE full-batch gradient of the paper's
loss 1/2 ||y - onehot||^2 at W-hat on its whole partition, plus Psi and Phi
(:func:`protocols.mpddp.client_gradients`; FedSGD, so ``local-epochs``/``batch-size``/``lr`` are unused),
then by method:

* ``mpddp``: eta_k ~ DN(sigma_eta, 1) from a fresh ``os.urandom`` seed plus sum_v Delta_kv with
  Delta_kv ~ DN(sigma_Delta, 1) from the pairwise seeds of the round's key phase (purpose
  ``mpddp-delta``; :func:`client.pairwise_phase.pair_seeds`, :func:`protocols.pairwise.pairwise_noise`).
  With run-config ``cancellation-check`` it also reports ``mask-probe``, the projection of its Delta part
  on the round's public direction (diagnostic only).
* ``mpdp-naive``: N(0, sigma^2) on the perturbed gradient.
* ``mpcdp``: nothing (the server adds the noise).

Psi and Phi are uploaded unnoised, as in the paper (they are data-dependent: see the caveats in
:mod:`strategies.mpddp`).  Upload: 3L arrays ``up.0 ..`` = [gradients..., Psi..., Phi...]; gradients float64,
Psi/Phi in run-config ``mpddp-side-dtype`` (float64 by default; float32 halves the upload).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import numpy as np
import torch
from flwr.app import Message

from client.env import ClientEnv, reply
from client.pairwise_phase import mask_probe, pair_seeds
from client.wire import from_record, to_record
from protocols.mpddp import client_gradients, ddp_noise, flatten, naive_client, one_hot, torch_threads, unflatten

#: HKDF purpose of the pairwise Delta seeds (fixed on the client: the server cannot redirect it).
DELTA_PURPOSE = "mpddp-delta"


def _scale(cfg, key: str) -> float:
    value = float(cfg[key])
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"train config '{key}' = {value!r} must be a finite number >= 0")
    return value


def received_model(msg: Message) -> list[torch.Tensor]:
    """The 2L-1 perturbed matrices W-hat of the train message, in layer order (float64)."""
    arrays = from_record(msg.content["arrays"])
    n = len(arrays)
    names = [f"w_hat.{j}" for j in range(n)]
    if list(arrays) != names or n < 3 or n % 2 == 0:
        raise ValueError(f"expected an expanded model w_hat.0..w_hat.(2L-2) with L >= 2, got {list(arrays)}")
    return [torch.from_numpy(arrays[k]) for k in names]


def train(msg: Message, env: ClientEnv) -> Message:
    """One round of the client: gradient + Psi, Phi at W-hat, method noise, float64 upload."""
    with torch_threads(1):  # tiny matrices: thread hand-offs dominate otherwise
        return _train(msg, env)


def _train(msg: Message, env: ClientEnv) -> Message:
    method = env.cfg.method
    cfg = msg.content["config"]
    w_hat = received_model(msg)
    x = torch.from_numpy(np.asarray(env.x, dtype=np.float64).reshape(len(env.x), -1))
    y = one_hot(torch.from_numpy(np.asarray(env.y)), env.num_classes)
    up = client_gradients(w_hat, x, y)
    metrics: dict[str, float] = {}
    if method == "mpddp":
        sigma_eta, sigma_delta = _scale(cfg, "sigma-eta"), _scale(cfg, "sigma-delta")
        flat = flatten(up.grads)
        seeds = pair_seeds(msg, env, DELTA_PURPOSE)
        # Delta part and eta part drawn separately so the cancellation probe sees only the Delta's.
        delta = ddp_noise(flat.size, own_id=env.node_id, pair_seeds=seeds, eta_seed=os.urandom(32),
                          sigma_eta=0.0, sigma_delta=sigma_delta)
        eta = ddp_noise(flat.size, own_id=env.node_id, pair_seeds={}, eta_seed=os.urandom(32),
                        sigma_eta=sigma_eta, sigma_delta=0.0)
        up = up.with_grads(unflatten(flat + delta + eta, [g.double() for g in up.grads]))
        if env.cfg.cancellation_check:
            metrics["mask-probe"] = mask_probe(msg, delta)
    elif method == "mpdp-naive":
        up = naive_client(up, eta_seed=os.urandom(32), sigma=_scale(cfg, "sigma"))
    elif method != "mpcdp":
        raise ValueError(f"client.methods.mpddp does not handle method {method!r}")
    # Gradients always in float64 (the Delta's must cancel to round-off); Psi/Phi are unnoised side
    # information sent in run-config mpddp-side-dtype (validated by RunConfig).
    dtypes = [np.float64] * up.num_layers + [np.dtype(env.cfg.mpddp_side_dtype)] * (2 * up.num_layers)
    parts = zip(up.to_arrays(), dtypes, strict=True)
    arrays = OrderedDict((f"up.{i}", np.asarray(a, dtype=dt)) for i, (a, dt) in enumerate(parts))
    return reply(msg, to_record(arrays, None), len(env.y), **metrics)
