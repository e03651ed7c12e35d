"""L2 clipping of update vectors (the sensitivity bound every Gaussian mechanism here relies on)."""

from __future__ import annotations

import numpy as np


def clip_l2(vector: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """Scale ``vector`` so its L2 norm is at most ``bound``; returns (clipped float64 copy, original norm).

    The norm is ``m ||vector / m||`` (``m`` the largest ``|entry|``), which squaring neither underflows nor
    overflows: a vector whose squares all round to 0 (entries below ``~1e-162``, e.g. a float64 model trained at
    a tiny ``lr``) has a norm far above a bound as small, and ``sqrt(sum of squares)`` = 0 would return it unclipped.
    A clipped vector is ``(vector / m) (bound / ||vector / m||)``, whose factors stay normal numbers for any
    :func:`protocols.privacy.smallest_resolvable` ``bound``, so its norm is ``bound`` up to a float64 rounding.

    A vector with a non-finite entry (training diverged, e.g. on a received model on which one record's logits
    overflow) is clipped to zero, as :func:`protocols.per_example.clip_factors` clips such a record: NaN passes any
    scaling and any noise, so uploading it would tell the server, noiselessly, that the data made training diverge.
    The returned norm is then ``inf`` or NaN (a noiseless metric, :data:`client.floor.UNPROTECTED_METRICS`), as it
    is for a finite vector whose norm exceeds float64's range.

    Raises:
        ValueError: ``bound`` is not > 0.
    """
    if not bound > 0:
        raise ValueError(f"clip bound must be > 0, got {bound}")
    vector = np.array(vector, dtype=np.float64)  # a copy: the caller's array is never returned
    with np.errstate(over="ignore", invalid="ignore"):
        top = float(np.max(np.abs(vector))) if vector.size else 0.0
        if not np.isfinite(top):
            return np.zeros_like(vector), float(np.linalg.norm(vector))
        if top == 0.0:
            return vector, 0.0
        unit = vector / top  # entries in [-1, 1], the largest exactly 1
        relative = float(np.linalg.norm(unit))  # in [1, sqrt(size)]
        norm = top * relative
    if norm <= bound:
        return vector, norm
    return unit * (float(bound) / relative), norm
