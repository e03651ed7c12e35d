"""DDP_Client (Algorithm 2, Eq. 17): independent eta_k plus pairwise-cancelling Delta_{k,v} on the gradients.

    grad~_k = grad_k + sum_{v in N(k)} Delta_{k,v} + eta_k,
    eta_k[ij] ~ DN(sigma_eta, 1) (Eq. 16),  Delta_{k,v}[ij] ~ DN(sigma_Delta, 1) (Eq. 19),  Delta_{k,v} = -Delta_{v,k}.

DN(sigma, 1) is Uniform(-sqrt2 sigma, sqrt2 sigma), so after the server's recovery R o eta and
R o Delta are exactly N(0, sigma^2) entrywise (Theorems 5, 6), but only over R's draw: the server holds R, and
given R eta is uniform.  ``eta="gaussian"`` draws eta_k ~ N(0, sigma_eta^2) instead, Gaussian for every observer,
so the model's guarantee given R can count it (:func:`eta_variance`).  Noise goes only on the gradients:
Psi and Phi are sent unnoised, as in the paper (they do leak data-dependent information to the
server per client; routing them through secure aggregation would be the fix, outside the paper).

The pairwise part uses the shared engine protocols.pairwise.pairwise_noise with DN(sigma_Delta, 1) written as
prg.symmetric_uniform at scale sqrt2 * sigma_Delta (the engine's exact integer fast path): one vector over
all trainable gradient entries in layer order (flatten()).
Pair seeds must be symmetric and fresh per round, e.g.
keyagreement.derive_pair_seed(shared, purpose="mpddp-delta", round_num=t, node_a=k, node_b=v).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from protocols.methods.mpddp import ETA_DISTRIBUTIONS
from protocols.mpddp.gradients import ClientUpload
from protocols.mpddp.samplers import sample_dn
from protocols.pairwise import pairwise_noise
from protocols.prg import gaussian, symmetric_uniform

__all__ = ["ETA_DISTRIBUTIONS", "ddp_client", "delta_variance", "eta_noise", "eta_variance", "flatten", "pairwise_delta",
           "unflatten"]


def flatten(tensors: Sequence[Tensor]) -> np.ndarray:
    """Concatenate tensors (layer order, row-major) into one float64 vector."""
    return np.concatenate([t.detach().cpu().double().reshape(-1).numpy() for t in tensors])


def unflatten(vec: np.ndarray, like: Sequence[Tensor]) -> list[Tensor]:
    """Split a flat vector back into tensors shaped (and typed) like `like`."""
    out, off = [], 0
    for t in like:
        n = t.numel()
        out.append(torch.from_numpy(np.ascontiguousarray(vec[off : off + n])).reshape(t.shape).to(t.dtype))
        off += n
    if off != vec.size:
        raise ValueError(f"vector has {vec.size} entries, tensors need {off}")
    return out


def pairwise_delta(size: int, *, own_id: int, pair_seeds: Mapping[int, bytes], sigma_delta: float) -> np.ndarray:
    """sum_{v in N(k)} Delta_{k,v} (Eq. 19), flat float64 of length ``size``: the part that cancels in the mean.

    pair_seeds: neighbour id -> shared 32-byte seed for this round; zeros when sigma_delta = 0 or no neighbour.
    """
    if sigma_delta < 0:
        raise ValueError("noise scales must be non-negative")
    if sigma_delta == 0 or not pair_seeds:
        return np.zeros(size, dtype=np.float64)
    # DN(sigma, 1) = sqrt2 * sigma * Uniform[-1, 1): the engine's exact integer fast path.
    return pairwise_noise(own_id, pair_seeds, size, sampler=symmetric_uniform, scale=math.sqrt(2.0) * sigma_delta)


def delta_variance(sigma_delta: float) -> float:
    """Per-entry variance of one pair's Delta_{k,v} in :func:`pairwise_delta`: DN(sigma, 1), ``2 sigma^2 / 3``."""
    if sigma_delta < 0:
        raise ValueError("noise scales must be non-negative")
    return 2.0 / 3.0 * sigma_delta**2


def _check_eta(sigma_eta: float, eta: str) -> None:
    if sigma_eta < 0:
        raise ValueError("noise scales must be non-negative")
    if eta not in ETA_DISTRIBUTIONS:
        raise ValueError(f"eta must be one of {ETA_DISTRIBUTIONS}, got {eta!r}")


def eta_noise(seed: bytes, size: int, sigma_eta: float, eta: str = "uniform") -> np.ndarray:
    """eta_k entrywise from the client's private 32-byte seed; zeros when sigma_eta = 0.

    ``eta="uniform"``: DN(sigma_eta, 1) (Eq. 16); ``"gaussian"``: N(0, sigma_eta^2).  Raises ValueError for a
    negative scale or another ``eta``.
    """
    _check_eta(sigma_eta, eta)
    if sigma_eta == 0:
        return np.zeros(size, dtype=np.float64)
    return gaussian(seed, size, sigma_eta) if eta == "gaussian" else sample_dn(seed, size, sigma_eta, 1)


def eta_variance(sigma_eta: float, eta: str) -> float:
    """Per-entry variance of :func:`eta_noise`: ``sigma_eta^2`` (gaussian) or ``2 sigma_eta^2 / 3`` (DN(sigma, 1))."""
    _check_eta(sigma_eta, eta)
    return sigma_eta**2 if eta == "gaussian" else 2.0 / 3.0 * sigma_eta**2


def ddp_client(
    upload: ClientUpload,
    *,
    own_id: int,
    pair_seeds: Mapping[int, bytes],
    eta_seed: bytes,
    sigma_eta: float,
    sigma_delta: float,
    eta: str = "uniform",
) -> tuple[ClientUpload, np.ndarray]:
    """Algorithm 2: the upload with double-perturbed gradients (Eq. 17; Psi, Phi unchanged) and its Delta part.

    Returns ``(noised upload, sum_v Delta_{k,v})``; the second (flat, layer order) is what must cancel in the
    server's mean, so callers can project it for the cancellation check.  eta_seed: the client's private
    32-byte seed (os.urandom(32) per round); eta: its distribution (:func:`eta_noise`).  The noised
    gradients are always float64: sigma_Delta is large and must cancel to round-off in the server's sum,
    which float32 cannot do.
    """
    flat = flatten(upload.grads)
    delta = pairwise_delta(flat.size, own_id=own_id, pair_seeds=pair_seeds, sigma_delta=sigma_delta)
    noised = flat + delta + eta_noise(eta_seed, flat.size, sigma_eta, eta)
    return upload.with_grads(unflatten(noised, [g.double() for g in upload.grads])), delta
