"""The reference engine: per-example gradients materialised with ``torch.func.vmap``, then clipped and summed.

Any model whose forward keeps examples independent; also the fallback of
:class:`protocols.per_example.PerExampleClipper` for models the layer-wise closed forms do not cover.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from protocols.per_example.interface import ClippedSum, Norm, PerExampleLoss, clip_factors, cross_entropy, kept_rows

__all__ = ["VMAP_CHUNK", "per_example_gradients", "vmap_clipped_grad_sum"]

#: Examples per chunk of the vmap path (bounds the memory of the materialised gradients).
VMAP_CHUNK = 256


def per_example_gradients(model: nn.Module, x: Tensor, y: Tensor, loss: PerExampleLoss = cross_entropy
                          ) -> dict[str, Tensor]:
    """Per-example gradients ``(B, *p.shape)`` of every trainable parameter, by name, via ``torch.func.vmap``."""
    return _gradients_and_losses(model, x, y, loss)[0]


def _gradients_and_losses(model: nn.Module, x: Tensor, y: Tensor, loss: PerExampleLoss
                          ) -> tuple[dict[str, Tensor], Tensor]:
    """:func:`per_example_gradients` and the per-example losses ``(B,)`` of the same forward."""
    from torch.func import functional_call, grad_and_value, vmap

    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0)).sum()

    grads, losses = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0))(params, x, y)
    return grads, losses.detach()


def vmap_clipped_grad_sum(model: nn.Module, x: Tensor, y: Tensor, clip: float, *, norm: Norm = "l2",
                          loss: PerExampleLoss = cross_entropy) -> ClippedSum:
    """:func:`clipped_grad_sum` by materialising per-example gradients, ``VMAP_CHUNK`` examples at a time.

    Each chunk's examples are weighted by :func:`protocols.per_example.interface.clip_factors` (a dropped
    example's gradient zeroed).
    """
    named = dict(model.named_parameters())
    total = {k: torch.zeros_like(p) for k, p in named.items()}
    clipped = 0
    losses = []
    for start in range(0, len(y), VMAP_CHUNK):
        xs, ys = x[start:start + VMAP_CHUNK], y[start:start + VMAP_CHUNK]
        g, chunk_losses = _gradients_and_losses(model, xs, ys, loss)
        flat = [t.reshape(len(ys), -1) for t in g.values()]
        if norm == "l2":
            norms = sum((t * t).sum(1) for t in flat).sqrt()
        else:
            norms = sum(t.abs().sum(1) for t in flat)
        factors = clip_factors(norms, chunk_losses, clip)
        clipped += int(factors.clipped)
        losses.append(factors.losses)
        for k, t in g.items():
            total[k] += torch.einsum("b,b...->...", factors.scale.to(t.dtype), kept_rows(factors.keep, t))
    return ClippedSum(list(total.values()), torch.cat(losses), clipped)
