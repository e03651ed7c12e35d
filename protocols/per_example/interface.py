"""What every per-example clipping engine shares: the norm, the per-example loss and the results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch.nn.functional as F
from torch import Tensor

__all__ = ["ClippedSum", "Descent", "Norm", "PerExampleLoss", "cross_entropy"]

Norm = Literal["l2", "l1"]
#: ``loss(outputs, targets)`` -> one loss per example, shape ``(B,)``.
PerExampleLoss = Callable[[Tensor, Tensor], Tensor]


class Descent(NamedTuple):
    """Per-example losses ``(B,)`` and the number clipped (0-dim) (:meth:`protocols.per_example.PerExampleClipper.descend`)."""

    losses: Tensor
    clipped: Tensor


class ClippedSum(NamedTuple):
    """``sum_i clip(g_i, C)`` per parameter (``model.parameters()`` order), per-example losses, #clipped."""

    grads: list[Tensor]
    losses: Tensor
    clipped: int


def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-example cross-entropy (the default loss)."""
    return F.cross_entropy(outputs, targets, reduction="none")
