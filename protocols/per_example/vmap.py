"""The reference engine: per-example gradients materialised with ``torch.func.vmap``, then clipped and summed.

Any model whose forward keeps examples independent; also the fallback of
:class:`protocols.per_example.PerExampleClipper` for models the layer-wise closed forms do not cover.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from protocols.per_example.interface import ClippedSum, Norm, PerExampleLoss, cross_entropy

__all__ = ["VMAP_CHUNK", "per_example_gradients", "vmap_clipped_grad_sum"]

#: Examples per chunk of the vmap path (bounds the memory of the materialised gradients).
VMAP_CHUNK = 256


def per_example_gradients(model: nn.Module, x: Tensor, y: Tensor, loss: PerExampleLoss = cross_entropy
                          ) -> dict[str, Tensor]:
    """Per-example gradients ``(B, *p.shape)`` of every trainable parameter, by name, via ``torch.func.vmap``."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0)).sum()

    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def vmap_clipped_grad_sum(model: nn.Module, x: Tensor, y: Tensor, clip: float, *, norm: Norm = "l2",
                          loss: PerExampleLoss = cross_entropy) -> ClippedSum:
    """:func:`clipped_grad_sum` by materialising per-example gradients, ``VMAP_CHUNK`` examples at a time."""
    named = dict(model.named_parameters())
    total = {k: torch.zeros_like(p) for k, p in named.items()}
    clipped = 0
    for start in range(0, len(y), VMAP_CHUNK):
        xs, ys = x[start:start + VMAP_CHUNK], y[start:start + VMAP_CHUNK]
        g = per_example_gradients(model, xs, ys, loss)
        flat = [t.reshape(len(ys), -1) for t in g.values()]
        if norm == "l2":
            norms = sum((t * t).sum(1) for t in flat).sqrt()
        else:
            norms = sum(t.abs().sum(1) for t in flat)
        scale = 1.0 / torch.clamp(norms / clip, min=1.0)
        clipped += int((norms > clip).sum())
        for k, t in g.items():
            total[k] += torch.einsum("b,b...->...", scale.to(t.dtype), t)
    with torch.no_grad():
        losses = loss(model(x), y)
    return ClippedSum(list(total.values()), losses, clipped)
