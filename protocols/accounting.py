"""Privacy accounting for (subsampled) Gaussian mechanisms, over Google's dp-accounting.

We do not write our own accountant: this module is a thin, typed layer over
``dp_accounting``'s RDP accountant (the same backend Flower's
``flwr.serverapp.RdpAccountant`` uses) so that every method reports epsilon the
same way:

* :func:`gaussian_epsilon` -- epsilon of ``steps`` compositions of a Gaussian
  mechanism with ``noise_multiplier`` (noise std / L2 sensitivity), each
  applied to a Poisson subsample with rate ``sampling_rate`` (1.0 = no
  amplification, e.g. what the server sees of a client's own upload).
* :func:`calibrate_noise_multiplier` -- the smallest noise multiplier that
  meets a target (epsilon, delta).
* :class:`GaussianAccountant` -- incremental, for per-round reporting.

Fixed-size client sampling (m of N per round) is accounted as Poisson
sampling with q = m/N, the usual approximation in DP-FL papers; the README
says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import dp_accounting
from dp_accounting.rdp import RdpAccountant

#: RDP orders: dense at small alpha (large-sigma regime) up to 1024.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 20.0 for x in range(1, 100)] + list(range(6, 64)) + [64, 80, 96, 128, 160, 192, 256, 384, 512, 1024]
)


def _check(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> None:
    if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier}")
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def _event(noise_multiplier: float, sampling_rate: float) -> dp_accounting.DpEvent:
    gauss = dp_accounting.GaussianDpEvent(noise_multiplier)
    return gauss if sampling_rate >= 1 else dp_accounting.PoissonSampledDpEvent(sampling_rate, gauss)


def gaussian_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> float:
    """Epsilon spent after ``steps`` (subsampled) Gaussian releases at ``delta``."""
    _check(noise_multiplier, sampling_rate, steps, delta)
    if steps == 0:
        return 0.0
    acc = RdpAccountant(list(RDP_ORDERS))
    acc.compose(_event(noise_multiplier, sampling_rate), steps)
    return float(acc.get_epsilon(delta))


def calibrate_noise_multiplier(epsilon: float, delta: float, sampling_rate: float, steps: int,
                               *, tol: float = 1e-4) -> float:
    """Smallest noise multiplier whose ``steps`` releases stay within (epsilon, delta).

    Bisection on the monotone map sigma -> epsilon (relative tolerance ``tol``).
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    _check(1.0, sampling_rate, steps, delta)
    if steps == 0:
        raise ValueError("cannot calibrate for 0 steps")
    lo, hi = 1e-3, 1.0
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


@dataclass
class GaussianAccountant:
    """Running RDP account of one privacy guarantee (e.g. a client's uplink)."""

    delta: float
    _acc: RdpAccountant = field(default_factory=lambda: RdpAccountant(list(RDP_ORDERS)), repr=False)
    releases: int = 0

    def compose(self, noise_multiplier: float, sampling_rate: float = 1.0, count: int = 1) -> None:
        """Add ``count`` releases of a (subsampled) Gaussian mechanism."""
        _check(noise_multiplier, sampling_rate, count, self.delta)
        self._acc.compose(_event(noise_multiplier, sampling_rate), count)
        self.releases += count

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta`` (0 before any release)."""
        return float(self._acc.get_epsilon(self.delta)) if self.releases else 0.0
