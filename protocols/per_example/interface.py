"""What every per-example clipping engine shares: the norm, the per-example loss and the results."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["FACTOR_MARGIN", "ClipFactors", "ClippedSum", "Descent", "Norm", "PerExampleLoss", "clip_factors",
           "cross_entropy", "kept_rows", "multiplier_limit"]

Norm = Literal["l2", "l1"]
#: ``loss(outputs, targets)`` -> one loss per example, shape ``(B,)``.
#: An example's scaled terms stay this many times above its dtype's smallest normal number (:func:`clip_factors`).
FACTOR_MARGIN = 4.0
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


class ClipFactors(NamedTuple):
    """How each example of a batch enters the clipped sum (:func:`clip_factors`)."""

    #: ``(B,)`` bool: the example's gradient norm and loss are finite (else it adds nothing); None: all are.
    keep: Tensor | None
    #: ``(B,)`` ``min(1, clip / ||g_i||)`` for a kept example, 0 for a dropped one.
    scale: Tensor
    #: ``(B,)`` the per-example losses, 0 for a dropped example.
    losses: Tensor
    #: 0-dim: the examples clipped (norm above ``clip``, or dropped: clipped to norm 0).
    clipped: Tensor


def multiplier_limit(clip: float, dtype: torch.dtype) -> float:
    """``C / (FACTOR_MARGIN tiny)``: the largest norm or multiplier :func:`clip_factors` keeps an example at in ``dtype``."""
    return clip / (FACTOR_MARGIN * torch.finfo(dtype).tiny)


def clip_factors(norms: Tensor, losses: Tensor, clip: float, multipliers: Tensor | None = None) -> ClipFactors:
    """The clipping rule of every engine: example i enters the sum as ``scale_i g_i``, ``scale_i = min(1, C / ||g_i||)``.

    An example whose gradient norm or loss is not finite (an overflow, e.g. on a model crafted so that one record's
    logits overflow while the others' do not, or a non-finite feature) is clipped to norm 0: ``scale_i = 0``, and the
    engine zeroes its per-example terms (``0 * inf`` is NaN).  The sum then stays finite and within the sensitivity
    ``C`` whatever the model; the clipped count counts a dropped example as clipped (as one whose norm exceeds ``C``).
    A zero gradient gets scale 1.

    So is an example whose scaled terms the dtype would round on its subnormal grid, where a rounding is relative to
    the smallest normal number ``tiny``, not to the term: a norm above ``C / (FACTOR_MARGIN tiny)`` (its factor
    ``C / ||g_i||`` subnormal, e.g. an L1 norm near float32's largest value: rounded up to 1.5 times itself), or a
    ``multipliers_i`` above it.  ``multipliers`` ``(B,)``: each example's largest ``|entry|`` of what the engine
    multiplies its scaled terms by (a layer's input times the scaled output gradient ``scale_i d_i``, of size about
    ``C / |a_i|``): a subnormal ``scale_i d_i``'s round-off times an input of ``1e38`` would let one record into a
    float32 DDP-SA sum at 1.9 times the clip.  Below those bounds every such product's round-off is at most ``2^-24 /
    FACTOR_MARGIN`` of the clip per coordinate.  A record's own values decide it, as for a non-finite one; no honest
    model comes near (float32 at ``C = 1``: a norm or an activation of ``2e37``).

    On the CPU a batch whose norms and losses sum to a finite number and within those bounds (every example kept)
    takes the plain rule (``keep`` None); elsewhere each example is checked (no host synchronisation off the CPU).
    """
    limit = multiplier_limit(clip, norms.dtype)
    widest = norms if multipliers is None else torch.maximum(norms, multipliers)
    if norms.device.type == "cpu" and math.isfinite(float(norms.sum() + losses.sum())) and float(widest.max()) <= limit:
        return ClipFactors(None, (clip / norms).clamp_(max=1.0), losses, (norms > clip).sum())
    nan = (norms * 0.0 + losses * 0.0).masked_fill_(widest > limit, math.nan)  # 0 where kept, NaN elsewhere
    keep = nan == 0
    scale = (clip / norms).clamp_(max=1.0).add_(nan).nan_to_num_(0.0)
    return ClipFactors(keep, scale, (losses + nan).nan_to_num_(0.0), (norms > clip).logical_or_(~keep).sum())


def kept_rows(keep: Tensor | None, t: Tensor) -> Tensor:
    """``t`` (batch axis first) with the rows of the examples not in ``keep`` zeroed (a new tensor; None: ``t``)."""
    if keep is None:
        return t
    return torch.where(keep.reshape(-1, *[1] * (t.dim() - 1)), t, 0.0)


def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-example cross-entropy (the default loss)."""
    return F.cross_entropy(outputs, targets, reduction="none")
