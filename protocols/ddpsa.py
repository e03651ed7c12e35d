"""DDP-SA client-side local DP step (Wei et al., Algorithm 2, client loop).

For one client and one round::

    g_j      <- per-sample gradient of sample j
    g_j      <- g_j / max(1, ||g_j||_1 / Delta)          (L1 clipping)
    g_tilde  <- (sum_j g_j + Lap(0, 2 Delta/eps)^d) / N_i   (Laplace mechanism, then average)

The result is then fixed-point encoded and secret-shared (:mod:`protocols.secret_sharing`).

Privacy note (a correction of the paper's calibration): the paper adds ``Lap(Delta/eps)``, the
clipped sum's L1 sensitivity under add/remove-one-sample adjacency (its Definition 1, histograms
with ``||x - y||_1 <= 1``).  But ``N_i`` is public -- the paper's server weights by ``N_i / N``
and our clients send it as ``num-examples`` -- and publishing the exact count is not DP under
add/remove adjacency (it tells a dataset from its neighbour with certainty).  With ``N_i`` public
the neighbouring datasets are those that differ by *replacing* one sample (the unit of every
record-level method here, e.g. NADP-FL's ``2C/|D_i|``), and the clipped sum's L1 sensitivity is
``2 Delta`` (:func:`l1_sensitivity`): the noise scale is ``2 Delta / eps``, which makes each round
eps-DP per record with ``N_i`` published.  Averaging by ``N_i`` is then post-processing.

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
    "l1_sensitivity",
    "laplace_noise",
    "ldp_noisy_mean",
]


def l1_sensitivity(clip: float) -> float:
    """L1 sensitivity of the clipped per-sample gradient *sum* to replacing one sample: ``2 Delta``.

    Each sample contributes a vector of L1 norm at most ``Delta``; replacing it moves the sum by
    at most ``2 Delta`` (add/remove would give ``Delta``, but ``N_i`` is published: module docstring).
    """
    if not clip > 0:
        raise ValueError(f"clipping threshold Delta must be > 0, got {clip!r}")
    return 2.0 * float(clip)


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
    """Algorithm 2 client step in numpy: ``(sum_j clip(g_j) + Lap(2 Delta/eps)) / B`` (replace-one, module docstring).

    Returns an array of shape ``per_sample.shape[1:]`` (float64).
    """
    clipped = l1_clip(per_sample, clip)
    total = clipped.sum(axis=0)
    noise = laplace_noise(total.size, laplace_scale(l1_sensitivity(clip), epsilon), seed=seed).reshape(total.shape)
    return (total + noise) / clipped.shape[0]
