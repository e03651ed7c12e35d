"""DDP-SA client-side local DP step (Wei et al., Algorithm 2, client loop).

For one client and one round::

    g_j      <- per-sample gradient of sample j
    g_j      <- g_j / max(1, ||g_j||_1 / Delta)          (L1 clipping)
    g_tilde  <- (sum_j g_j + Lap(0, Delta/eps)^d) / N_i   (Laplace mechanism, then average)

The result is then fixed-point encoded and secret-shared (:mod:`protocols.secret_sharing`).

Privacy note: the clipped *sum* has L1 sensitivity ``Delta`` under add/remove-one-sample
adjacency (the paper's Definition 1, histograms with ``||x - y||_1 <= 1``), so the noise
scale ``Delta/eps`` of the paper gives eps-DP per round for that adjacency.  Under
replace-one adjacency the sensitivity is ``2*Delta``; callers wanting that notion should
pass ``epsilon/2``.  Averaging by ``N_i`` is post-processing (``N_i`` treated as public,
as in the paper).

Laplace noise comes from the project CSPRNG (:func:`protocols.prg.laplace`); without an
explicit seed a fresh ``os.urandom`` seed is drawn for every call.

The numpy functions here state the step on materialised per-sample gradients; the client
computes the clipped sum without materialising them (:func:`protocols.per_example.clipped_grad_sum`
with ``norm="l1"``), and the tests check the two agree.
"""

from __future__ import annotations

import os

import numpy as np
from numpy.typing import ArrayLike, NDArray

from protocols.privacy import laplace_scale

__all__ = [
    "l1_clip",
    "laplace_noise",
    "ldp_noisy_mean",
]


def laplace_noise(size: int, scale: float, *, seed: bytes | None = None) -> NDArray[np.float64]:
    """``size`` i.i.d. Lap(0, scale) draws from the CSPRNG (fresh os.urandom seed if None)."""
    # Lazy import keeps this module importable before/without the PRG module.
    from protocols.prg import laplace

    if not scale > 0:
        raise ValueError(f"Laplace scale must be > 0, got {scale!r}")
    return np.asarray(
        laplace(os.urandom(32) if seed is None else seed, int(size), float(scale)),
        dtype=np.float64,
    )


def l1_clip(per_sample: ArrayLike, clip: float) -> NDArray[np.float64]:
    """Clip each sample (axis 0) to L1 norm ``<= clip``: ``g / max(1, ||g||_1 / clip)``.

    Args:
        per_sample: array of shape ``(B, ...)``; the norm is over all non-batch axes.
        clip: the threshold Delta (> 0).
    """
    if not clip > 0:
        raise ValueError(f"clipping threshold Delta must be > 0, got {clip!r}")
    g = np.asarray(per_sample, dtype=np.float64)
    if g.ndim < 1 or g.shape[0] == 0:
        raise ValueError("per_sample must have a non-empty leading batch axis")
    norms = np.abs(g.reshape(g.shape[0], -1)).sum(axis=1)
    factor = np.maximum(1.0, norms / clip)
    return g / factor.reshape((-1,) + (1,) * (g.ndim - 1))


def ldp_noisy_mean(
    per_sample: ArrayLike, clip: float, epsilon: float, *, seed: bytes | None = None
) -> NDArray[np.float64]:
    """Algorithm 2 client step in numpy: ``(sum_j clip(g_j) + Lap(Delta/eps)) / B``.

    Returns an array of shape ``per_sample.shape[1:]`` (float64).
    """
    clipped = l1_clip(per_sample, clip)
    total = clipped.sum(axis=0)
    noise = laplace_noise(total.size, laplace_scale(clip, epsilon), seed=seed).reshape(total.shape)
    return (total + noise) / clipped.shape[0]
