"""L2 clipping of update vectors (the sensitivity bound every Gaussian mechanism here relies on)."""

from __future__ import annotations

import math

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
    top, relative = norm_factors(vector)
    if not np.isfinite(top):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.zeros_like(vector), float(np.linalg.norm(vector))
    if top == 0.0:
        return vector, 0.0
    norm = top * relative
    if norm <= bound:
        return vector, norm
    return vector / top * (float(bound) / relative), norm


def norm_factors(array: np.ndarray) -> tuple[float, float]:
    """The L2 (Frobenius) norm of ``array`` as two factors ``(m, ||array / m||)``, ``m`` the largest ``|entry|``.

    Their product is the norm, and no square over- or underflows on the way (``sqrt(sum of squares)`` is 0 for
    entries below ``~1e-162`` and ``inf`` above ``~1e154``).  Returns ``(0.0, 0.0)`` for an empty or all-zero array
    and ``(m, nan)`` when ``m`` is not finite (an ``inf`` or NaN entry).
    """
    values = np.asarray(array, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        top = float(np.max(np.abs(values))) if values.size else 0.0
        if top == 0.0:
            return 0.0, 0.0
        if not np.isfinite(top):
            return top, math.nan
        return top, float(np.linalg.norm(values / top))  # entries in [-1, 1]: the factor is in [1, sqrt(size)]
