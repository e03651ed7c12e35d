"""Per-example L2 norms that squaring does not underflow: the closed forms' norms of products ``d a^T``."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["outer_norms_sq", "row_max", "row_norms"]


def row_max(t: Tensor) -> Tensor:
    """Each example's largest ``|entry|`` of ``t`` (batch axis first), at least the dtype's smallest normal number."""
    return t.abs().flatten(1).amax(1).clamp_(min=torch.finfo(t.dtype).tiny)


def row_norms(t: Tensor) -> Tensor:
    """Per-row L2 norm of ``t`` ``(B, K)`` that squaring does not underflow or overflow: ``m ||t / m||``.

    ``m`` is the row's largest ``|t_ij|`` (the dtype's smallest normal number for a zero row).  The result is 0 or
    ``inf`` only where the norm itself is below or above the dtype's range; a non-finite entry gives NaN or ``inf``.
    """
    m = row_max(t)
    return torch.linalg.vector_norm(t / m[:, None], dim=1).mul_(m)


def outer_norms_sq(d: Tensor, a: Tensor, bias: bool, a_norms: Tensor | None = None) -> Tensor:
    """Per-example ``||d_i||^2 (||a_i||^2 + 1)`` (``bias``) or ``||d_i||^2 ||a_i||^2``, ``d: (B, O)``, ``a: (B, K)``.

    The squared L2 norm of a Linear layer's per-example gradient ``(d_i a_i^T, d_i)`` or ``d_i a_i^T``.
    ``a_norms``: ``row_norms(a)`` where the caller keeps it (without ``bias`` only; computed here when None).

    Not ``|d|^2 (|a|^2 + 1)`` as written: a tiny output gradient (a saturated softmax: ``d ~ 1e-24``) times a large
    input is a gradient far above the clip whose ``|d|^2`` alone rounds to 0, and the example would enter the
    clipped sum unclipped.  Here each factor multiplies in before the next: the result rounds to 0 only where it
    is itself below the dtype's smallest normal number, and is ``inf`` (the example dropped,
    :func:`.interface.clip_factors`) where it is above the dtype's largest.
    """
    nd = row_norms(d)
    if bias:  # |a|^2 below the range is lost against the 1; above it the example is dropped either way
        return nd * (nd * torch.linalg.vecdot(a, a).add_(1.0))
    return (nd * (row_norms(a) if a_norms is None else a_norms)).square_()
