"""DDP_Client (Algorithm 2, Eq. 17): independent eta_k plus pairwise-cancelling Delta_{k,v} on the gradients.

    grad~_k = grad_k + sum_{v in N(k)} Delta_{k,v} + eta_k,
    eta_k[ij] ~ DN(sigma_eta, 1) (Eq. 16),  Delta_{k,v}[ij] ~ DN(sigma_Delta, 1) (Eq. 19),  Delta_{k,v} = -Delta_{v,k}.

DN(sigma, 1) is Uniform(-sqrt2 sigma, sqrt2 sigma), so after the server's recovery R o eta and
R o Delta are exactly N(0, sigma^2) entrywise (Theorems 5, 6). Noise goes only on the gradients:
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

from protocols.mpddp.gradients import ClientUpload
from protocols.mpddp.samplers import sample_dn
from protocols.pairwise import pairwise_noise
from protocols.prg import symmetric_uniform

__all__ = ["ddp_client", "ddp_noise", "flatten", "unflatten"]


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


def ddp_noise(
    size: int,
    *,
    own_id: int,
    pair_seeds: Mapping[int, bytes],
    eta_seed: bytes,
    sigma_eta: float,
    sigma_delta: float,
) -> np.ndarray:
    """Flat noise eta_k + sum_v Delta_{k,v} (float64, length `size`).

    eta_seed: the client's private 32-byte seed (os.urandom(32) per round); pair_seeds: neighbour id ->
    shared 32-byte seed for this round. sigma_* = 0 switches that part off.
    """
    if sigma_eta < 0 or sigma_delta < 0:
        raise ValueError("noise scales must be non-negative")
    noise = np.zeros(size, dtype=np.float64)
    if sigma_eta > 0:
        noise += sample_dn(eta_seed, size, sigma_eta, 1)
    if sigma_delta > 0 and pair_seeds:
        # DN(sigma, 1) = sqrt2 * sigma * Uniform[-1, 1): the engine's exact integer fast path.
        noise += pairwise_noise(own_id, pair_seeds, size, sampler=symmetric_uniform, scale=math.sqrt(2.0) * sigma_delta)
    return noise


def ddp_client(
    upload: ClientUpload,
    *,
    own_id: int,
    pair_seeds: Mapping[int, bytes],
    eta_seed: bytes,
    sigma_eta: float,
    sigma_delta: float,
) -> ClientUpload:
    """Algorithm 2: returns the upload with double-perturbed gradients (Eq. 17); Psi, Phi unchanged.

    The noised gradients are always float64: sigma_Delta is large and must cancel to round-off in the
    server's sum, which float32 cannot do.
    """
    flat = flatten(upload.grads)
    flat = flat + ddp_noise(
        flat.size,
        own_id=own_id,
        pair_seeds=pair_seeds,
        eta_seed=eta_seed,
        sigma_eta=sigma_eta,
        sigma_delta=sigma_delta,
    )
    return upload.with_grads(unflatten(flat, [g.double() for g in upload.grads]))
