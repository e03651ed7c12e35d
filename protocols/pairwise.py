"""Pairwise cancelling noise: the one engine every cancelfl method uses.

For every edge (i, j) both ends expand the same pair seed ``s_ij`` into ``z_ij = sampler(s_ij, size)``; the lower
id adds it, the higher subtracts it::

    noise_i = sum_j sign(i, j) * c_ij * z_ij,   sign(i, j) = +1 if i < j else -1

so ``sum_i noise_i = 0`` up to float rounding whenever ``c_ij == c_ji`` (callers derive the scale from shared
information; ``z_ij`` is bit-identical at both ends, :mod:`protocols.prg`).  Fast paths with the same law:
``gaussian`` resolves the ziggurat's slow path for all peers at once; ``symmetric_uniform`` sums the peers'
streams exactly as integers per distinct scale (:func:`protocols.prg.symmetric_uniform_sum`), leaving one
rounding per party.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from protocols.prg import gaussian, gaussian_many, symmetric_uniform, symmetric_uniform_sum

__all__ = ["Sampler", "pairwise_noise", "residual_norm"]

Sampler = Callable[[bytes, int], np.ndarray]  # (seed, size) -> float64 vector


def pairwise_noise(
    own_id: int,
    pair_seeds: Mapping[int, bytes],
    size: int,
    *,
    sampler: Sampler = gaussian,
    scale: float | Mapping[int, float] = 1.0,
) -> np.ndarray:
    """Sum over peers j of sign(own_id, j) * scale_j * sampler(pair_seeds[j], size).

    ``scale`` is one float for all peers or a mapping peer -> float that must contain
    every peer. Returns a new float64 vector of length ``size`` (zeros if no peers).
    Memory: one accumulator plus one sampler output at a time.
    """
    size = operator.index(size)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    own_id = operator.index(own_id)
    if own_id in pair_seeds:
        raise ValueError(f"pair_seeds contains own id {own_id}: a node cannot pair with itself")
    if isinstance(scale, Mapping):
        missing = [j for j in pair_seeds if j not in scale]
        if missing:
            raise ValueError(f"scale mapping lacks peers {sorted(missing)[:10]}")
        scales = {j: float(scale[j]) for j in pair_seeds}
    else:
        scales = dict.fromkeys(pair_seeds, float(scale))
    bad = {j: c for j, c in scales.items() if not math.isfinite(c)}
    if bad:
        raise ValueError(f"non-finite scale for peers {sorted(bad)[:10]}")

    acc = np.zeros(size, dtype=np.float64)
    order = sorted(pair_seeds)  # fixed order: the result does not depend on dict order
    if sampler is symmetric_uniform:
        for c in sorted(set(scales.values())):
            peers = [p for p in order if scales[p] == c]
            plus = [pair_seeds[p] for p in peers if own_id < p]
            minus = [pair_seeds[p] for p in peers if own_id > p]
            part = symmetric_uniform_sum(plus, minus, size)
            acc += part if c == 1.0 else c * part
        return acc
    if sampler is gaussian:  # same bits, the ziggurat's slow path resolved for many peers at once
        streams = gaussian_many([pair_seeds[p] for p in order], size)
    else:
        streams = (sampler(pair_seeds[p], size) for p in order)
    for peer, z in zip(order, streams, strict=True):
        z = np.asarray(z, dtype=np.float64)
        if z.shape != (size,):
            raise ValueError(f"sampler returned shape {z.shape}, expected ({size},)")
        c = scales[peer]
        if c != 1.0:
            z = z * c  # identical operation at both ends -> bit-identical product
        if own_id < peer:
            acc += z
        else:
            acc -= z
    return acc


def residual_norm(vectors: Sequence[np.ndarray]) -> float:
    """Euclidean norm of the sum of ``vectors`` (how far the noise is from cancelling)."""
    total: np.ndarray | None = None
    for v in vectors:
        v = np.asarray(v, dtype=np.float64)
        total = v.copy() if total is None else total + v
    return 0.0 if total is None else float(np.linalg.norm(total))
