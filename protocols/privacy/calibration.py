"""Epsilon of repeated Gaussian releases, and the noise multiplier that meets a target (epsilon, delta).

* :func:`gaussian_epsilon` -- ``steps`` (Poisson-subsampled) Gaussian releases under the
  RDP accountant (:class:`protocols.privacy.accountant.RdpAccountant`, :data:`RDP_ORDERS`).
* :func:`calibrate_noise_multiplier` / :func:`noise_multiplier` -- its inverse: the smallest
  noise multiplier (noise std / L2 sensitivity) whose releases stay within the budget.
* :func:`gdp_epsilon` -- exact epsilon of unsampled Gaussian releases (Gaussian DP).
* :func:`multiplier_under` -- the noise multiplier that meets a target under any accountant of Gaussian releases
  (a method that changes its accountant calibrates with the one it charges).
"""

from __future__ import annotations

import math
from functools import lru_cache

from protocols.privacy.accountant import Accountant, GdpAccountant, RdpAccountant, accountant_from_state
from protocols.privacy.events import GaussianEvent

__all__ = ["MIN_NOISE_MULTIPLIER", "calibrate_noise_multiplier", "gaussian_epsilon", "gdp_epsilon", "multiplier_under",
           "noise_multiplier"]

#: The smallest noise multiplier (noise std / sensitivity) a calibration returns: a target epsilon larger than its
#: releases spend gets this noise and spends less than the target (about 5.3e5 over one release at delta 1e-5).
MIN_NOISE_MULTIPLIER = 1e-3


def _check(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> None:
    if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier}")
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def gaussian_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> float:
    """RDP epsilon at ``delta`` of ``steps`` Gaussian releases with ``noise_multiplier``, each on a sample of rate q."""
    _check(noise_multiplier, sampling_rate, steps, delta)
    return RdpAccountant([GaussianEvent(noise_multiplier, sampling_rate, steps)]).epsilon(delta)


@lru_cache(maxsize=64)
def calibrate_noise_multiplier(epsilon: float, delta: float, sampling_rate: float, steps: int,
                               *, tol: float = 1e-4) -> float:
    """Smallest noise multiplier whose ``steps`` releases stay within (epsilon, delta) under :func:`gaussian_epsilon`.

    Bisection on the monotone map z -> epsilon (relative tolerance ``tol``); the result errs on the safe side and is
    at least :data:`MIN_NOISE_MULTIPLIER`.
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    _check(1.0, sampling_rate, steps, delta)
    if steps == 0:
        raise ValueError("cannot calibrate for 0 steps")
    lo, hi = MIN_NOISE_MULTIPLIER, 1.0
    while gaussian_epsilon(hi, sampling_rate, steps, delta) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e7:
            raise ValueError(f"no noise multiplier reaches epsilon={epsilon} at delta={delta}")
    while (hi - lo) / hi > tol:
        mid = 0.5 * (lo + hi)
        if gaussian_epsilon(mid, sampling_rate, steps, delta) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


@lru_cache(maxsize=64)
def noise_multiplier(epsilon: float, delta: float, num_rounds: int) -> float:
    """``z``: smallest per-round noise std / sensitivity whose ``num_rounds`` unsampled releases are (eps, delta)-DP."""
    return calibrate_noise_multiplier(epsilon, delta, 1.0, num_rounds)


def gdp_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """Exact epsilon at ``delta`` of ``releases`` unsampled Gaussian releases (:class:`GdpAccountant`).

    T releases with multiplier ``z`` are one release with ``z / sqrt(T)`` (Dong, Roth & Su 2019, Cor. 3.3).
    """
    if releases < 0:
        raise ValueError(f"releases must be >= 0, got {releases}")
    return GdpAccountant([GaussianEvent(noise_multiplier, 1.0, releases)]).epsilon(delta)


def multiplier_under(accountant: Accountant, epsilon: float, delta: float, releases: int, *,
                     sampling_rate: float = 1.0, tol: float = 1e-4) -> float:
    """Smallest noise multiplier whose ``releases`` Gaussian releases, composed by ``accountant``, stay within budget.

    ``accountant`` is empty: the composition the method charges its releases with (its strategy's ledger and its
    clients' :func:`client.floor.release` take the same), left unchanged.  Bisection on the monotone map
    z -> epsilon (relative tolerance ``tol``); the result errs on the safe side and is at least
    :data:`MIN_NOISE_MULTIPLIER`.  With a fresh
    :class:`RdpAccountant` it is :func:`calibrate_noise_multiplier`.

    Raises:
        ValueError: ``accountant`` holds releases or cannot compose Gaussian releases, or no multiplier up to 1e7
            meets the budget.
    """
    if accountant.releases:
        raise ValueError("calibrate with an empty accountant")
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    _check(1.0, sampling_rate, releases, delta)
    if releases == 0:
        raise ValueError("cannot calibrate for 0 releases")
    state = accountant.to_state()

    def spent(z: float) -> float:
        acc = accountant_from_state(state)
        acc.compose(GaussianEvent(z, sampling_rate, releases))
        return acc.epsilon(delta)

    lo, hi = MIN_NOISE_MULTIPLIER, 1.0
    while spent(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e7:
            raise ValueError(f"no noise multiplier reaches epsilon={epsilon} at delta={delta}")
    while (hi - lo) / hi > tol:
        mid = 0.5 * (lo + hi)
        if spent(mid) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi
