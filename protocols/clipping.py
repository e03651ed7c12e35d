"""L2 clipping of update vectors (the sensitivity bound every Gaussian mechanism here relies on)."""

from __future__ import annotations

import math

import numpy as np


def clip_l2(vector: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """Scale ``vector`` so its L2 norm is at most ``bound``; returns (clipped copy, original norm).

    A vector with a non-finite entry (training diverged, e.g. on a received model on which one record's logits
    overflow) is clipped to zero, as :func:`protocols.per_example.clip_factors` clips such a record: NaN passes any
    scaling and any noise, so uploading it would tell the server, noiselessly, that the data made training diverge.
    The returned norm is then ``inf`` or NaN (a noiseless metric, :data:`client.floor.UNPROTECTED_METRICS`).
    """
    if not bound > 0:
        raise ValueError(f"clip bound must be > 0, got {bound}")
    vector = np.asarray(vector, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        norm = float(np.linalg.norm(vector))
    if not math.isfinite(norm):
        if not np.isfinite(vector).all():
            return np.zeros_like(vector), norm
        top = float(np.max(np.abs(vector)))  # finite entries whose squares overflow: the norm, scaled
        norm = top * float(np.linalg.norm(vector / top))
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return vector * scale, norm
