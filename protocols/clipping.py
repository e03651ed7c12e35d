"""L2 clipping of update vectors (the sensitivity bound every Gaussian mechanism here relies on)."""

from __future__ import annotations

import numpy as np


def clip_l2(vector: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """Scale ``vector`` so its L2 norm is at most ``bound``; returns (clipped copy, original norm)."""
    if not bound > 0:
        raise ValueError(f"clip bound must be > 0, got {bound}")
    norm = float(np.linalg.norm(vector))
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return np.asarray(vector, dtype=np.float64) * scale, norm
