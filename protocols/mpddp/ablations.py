"""Noise helpers for the two ablations of Section 6.3.

* MP-DP-Naive: model perturbation [11] + plain DP. Each client adds eta_k ~ N(0, sigma^2) directly to its
  perturbed gradients (no pairwise Delta, no Theorem-3 shaping). After recovery the noise is R o eta_k,
  which is neither N(0, sigma^2) nor of controlled size (R is unbounded), hence the accuracy collapse the
  paper reports. Use `naive_client` with sigma = calibration.calibrate_ldp(z, sensitivity=S).
* MP-CDP: clients upload noise-free perturbed gradients; the (trusted) server recovers each client's true
  gradient, clips it to L2 norm S and averages (`clipped_mean`), then adds N(0, sigma^2) itself
  (`add_cdp_noise` with sigma = calibration.calibrate_cdp(z, K, sensitivity=S)).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from protocols import prg
from protocols.mpddp.ddp import flatten, unflatten
from protocols.mpddp.expansion import Layer
from protocols.mpddp.gradients import ClientUpload

__all__ = ["add_cdp_noise", "clipped_mean", "naive_client", "naive_gaussian_noise"]


def naive_gaussian_noise(seed: bytes, size: int, sigma: float) -> np.ndarray:
    """i.i.d. N(0, sigma^2) (float64) from a 32-byte seed."""
    if sigma < 0:
        raise ValueError("sigma must be non-negative")
    return prg.gaussian(seed, size, sigma) if sigma > 0 else np.zeros(size)


def naive_client(upload: ClientUpload, *, eta_seed: bytes, sigma: float) -> ClientUpload:
    """MP-DP-Naive client: perturbed gradients + N(0, sigma^2), Psi/Phi unchanged (Eq. 7)."""
    flat = flatten(upload.grads)
    flat = flat + naive_gaussian_noise(eta_seed, flat.size, sigma)
    return upload.with_grads(unflatten(flat, [g.double() for g in upload.grads]))


def add_cdp_noise(grads: Sequence[Layer], *, seed: bytes, sigma: float) -> list[Layer]:
    """MP-CDP server: recovered true mean gradient (dW, db per layer) + N(0, sigma^2) on every entry."""
    tensors = [t for pair in grads for t in pair]
    flat = flatten(tensors)
    noisy = unflatten(flat + naive_gaussian_noise(seed, flat.size, sigma), tensors)
    return [(noisy[2 * i], noisy[2 * i + 1]) for i in range(len(grads))]


def clipped_mean(per_client: Sequence[Sequence[Layer]], clip: float) -> tuple[list[Layer], list[float]]:
    """MP-CDP server: mean of the clients' recovered gradients, each scaled to L2 norm <= ``clip`` first.

    Returns (mean gradient as (dW, db) per layer, each client's L2 norm before clipping).
    """
    if not per_client:
        raise ValueError("no gradients to average")
    if not clip > 0:
        raise ValueError(f"clip must be positive, got {clip}")
    flat = [torch.cat([t.reshape(-1) for pair in g for t in pair]) for g in per_client]
    norms = [float(f.norm()) for f in flat]
    mean = torch.stack([f / max(1.0, n / clip) for f, n in zip(flat, norms, strict=True)]).mean(dim=0)
    out: list[Layer] = []
    off = 0
    for gw, gb in per_client[0]:
        nw, nb = gw.numel(), gb.numel()
        out.append((mean[off:off + nw].reshape(gw.shape), mean[off + nw:off + nw + nb]))
        off += nw + nb
    return out, norms
