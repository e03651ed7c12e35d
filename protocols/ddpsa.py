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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "l1_clip",
    "l1_clip_torch",
    "laplace_noise",
    "laplace_scale",
    "ldp_noisy_mean",
    "ldp_noisy_mean_torch",
    "per_sample_gradients",
]


def laplace_scale(clip: float, epsilon: float) -> float:
    """Laplace scale ``b = Delta / eps`` for the clipped-sum query (sensitivity Delta)."""
    if not clip > 0:
        raise ValueError(f"clipping threshold Delta must be > 0, got {clip!r}")
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
    return float(clip) / float(epsilon)


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


def _flat_l1_norms(per_sample_grads: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(per_sample_grads) == 0:
        raise ValueError("need at least one per-sample gradient tensor")
    batch = per_sample_grads[0].shape[0]
    if batch == 0 or any(t.shape[0] != batch for t in per_sample_grads):
        raise ValueError("all per-sample gradient tensors need the same non-empty batch axis")
    return sum(t.detach().reshape(batch, -1).abs().sum(dim=1, dtype=torch.float64) for t in per_sample_grads)


def l1_clip_torch(per_sample_grads: Sequence[torch.Tensor], clip: float) -> list[torch.Tensor]:
    """Jointly L1-clip per-sample gradients of several parameter tensors.

    ``per_sample_grads[k]`` has shape ``(B, *param_k.shape)``; the per-sample L1 norm is
    taken over *all* parameters together (the model's full gradient, as in the paper).
    """
    if not clip > 0:
        raise ValueError(f"clipping threshold Delta must be > 0, got {clip!r}")
    norms = _flat_l1_norms(per_sample_grads)
    factor = torch.clamp(norms / clip, min=1.0)
    out = []
    for t in per_sample_grads:
        f = factor.to(t.dtype).reshape((-1,) + (1,) * (t.dim() - 1))
        out.append(t.detach() / f)
    return out


def ldp_noisy_mean_torch(
    per_sample_grads: Sequence[torch.Tensor],
    clip: float,
    epsilon: float,
    *,
    seed: bytes | None = None,
) -> list[torch.Tensor]:
    """Algorithm 2 client step in torch; returns one noisy mean gradient per parameter.

    Noise is drawn once for the concatenated parameter vector (d i.i.d. Laplace draws),
    computed in float64 and cast back to each tensor's dtype.
    """
    clipped = l1_clip_torch(per_sample_grads, clip)
    batch = clipped[0].shape[0]
    sums = [t.sum(dim=0, dtype=torch.float64) for t in clipped]
    d = sum(s.numel() for s in sums)
    noise = torch.from_numpy(laplace_noise(d, laplace_scale(clip, epsilon), seed=seed))
    out, off = [], 0
    for s, t in zip(sums, clipped, strict=True):
        n = s.numel()
        noisy = (s + noise[off : off + n].reshape(s.shape).to(s.device)) / batch
        out.append(noisy.to(t.dtype))
        off += n
    return out


def per_sample_gradients(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> list[torch.Tensor]:
    """Per-sample gradients via ``torch.func`` (vmap over a batch of size-1 losses).

    Returns one tensor ``(B, *p.shape)`` per parameter ``p`` with ``requires_grad``, in
    ``model.named_parameters()`` order.  ``loss_fn`` is called on a batch of one sample.
    Models whose forward mixes samples (e.g. BatchNorm in train mode) are not supported.
    """
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, inputs, targets)
    return [grads[k] for k in params]
