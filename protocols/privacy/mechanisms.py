"""Noise mechanisms: what noise one release needs for (epsilon, delta)-DP, and the converse.

* Gaussian mechanism N(0, sigma^2) with L2 sensitivity ``Delta``:
  :func:`gaussian_delta` (the exact privacy profile), :func:`classic_gaussian_sigma`
  (Dwork & Roth, valid for epsilon < 1), :func:`analytic_gaussian_sigma` /
  :func:`analytic_gaussian_epsilon` (Balle & Wang 2018, exact for every epsilon).
* Laplace mechanism Lap(0, b) with L1 sensitivity ``Delta``: :func:`laplace_scale`.

Compositions of several releases live in :mod:`protocols.privacy.accountant` (RDP,
Gaussian DP, pure-DP composition) and :mod:`protocols.privacy.composition`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr

__all__ = [
    "analytic_gaussian_epsilon",
    "check_eps_delta",
    "analytic_gaussian_sigma",
    "classic_gaussian_sigma",
    "gaussian_delta",
    "laplace_scale",
]


def check_eps_delta(epsilon: float, delta: float) -> None:
    """ValueError unless ``epsilon`` is finite and > 0 and ``delta`` lies in (0, 1) (every (epsilon, delta) calibration)."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    if not (0 < delta < 1):
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")


def _check_sensitivity(sensitivity: float) -> None:
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise ValueError(f"sensitivity must be a finite number > 0, got {sensitivity!r}")


def _exp_times_ndtr(log_factor: float, x: float) -> float:
    """``exp(log_factor) * Phi(x)`` computed in log space (no overflow for large eps)."""
    return math.exp(log_factor + float(log_ndtr(x)))


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float = 1.0) -> float:
    """Exact delta(epsilon) of the Gaussian mechanism N(0, sigma^2) with L2 sensitivity.

    Balle & Wang 2018, Theorem 8: the mechanism is (epsilon, delta)-DP iff
    ``Phi(D/(2s) - e s/D) - e^e Phi(-D/(2s) - e s/D) <= delta``.  This is the
    *defining equation* the analytic Gaussian mechanism solves with equality.
    """
    if not (sigma > 0):
        raise ValueError(f"sigma must be > 0, got {sigma!r}")
    _check_sensitivity(sensitivity)
    a = sensitivity / (2.0 * sigma)
    b = epsilon * sigma / sensitivity
    return float(ndtr(a - b)) - _exp_times_ndtr(epsilon, -a - b)


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Classic Gaussian mechanism (Dwork & Roth 2014, Thm A.1; NISS Theorem 1; LaDP-FL Theorem 1).

    ``sigma = sensitivity * sqrt(2 ln(1.25/delta)) / epsilon``.  The theorem is only
    proved for ``0 < epsilon < 1``; larger epsilon is refused (use
    :func:`analytic_gaussian_sigma`).
    """
    check_eps_delta(epsilon, delta)
    _check_sensitivity(sensitivity)
    if epsilon >= 1:
        raise ValueError(
            f"the classic Gaussian mechanism is only valid for epsilon < 1 (got {epsilon}); use analytic_gaussian_sigma"
        )
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def _bracket_root(f: Callable[[float], float], lo: float, increasing: bool) -> tuple[float, float]:
    """Find ``hi > lo`` such that ``f`` changes sign on ``[lo, hi]`` (doubling search).

    Raises:
        ArithmeticError: no sign change within 200 doublings (a target out of float range), as other calibration
            overflows are reported.
    """
    hi = max(1.0, 2.0 * lo)
    for _ in range(200):
        val = f(hi)
        if (val >= 0) if increasing else (val <= 0):
            return lo, hi
        lo, hi = hi, 2.0 * hi
    raise ArithmeticError("could not bracket the analytic Gaussian mechanism root")


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float, *, tol: float = 1e-12) -> float:
    """Analytic Gaussian mechanism (Balle & Wang, ICML 2018, Algorithm 1).

    Returns the *smallest* sigma for which N(0, sigma^2) is (epsilon, delta)-DP for
    L2 sensitivity ``sensitivity``; valid for every ``epsilon > 0``.  The result
    satisfies :func:`gaussian_delta` ``(sigma, epsilon, sensitivity) == delta`` up to
    the root-finding tolerance.
    """
    check_eps_delta(epsilon, delta)
    _check_sensitivity(sensitivity)
    eps = float(epsilon)

    # delta_0 = Phi(0) - e^eps Phi(-sqrt(2 eps)): the delta at alpha = 1.
    delta0 = 0.5 - _exp_times_ndtr(eps, -math.sqrt(2.0 * eps))
    if delta >= delta0:
        # B+(v) = Phi(sqrt(eps v)) - e^eps Phi(-sqrt(eps (v+2))), increasing in v.
        def b_plus(v: float) -> float:
            return float(ndtr(math.sqrt(eps * v))) - _exp_times_ndtr(eps, -math.sqrt(eps * (v + 2.0))) - delta

        if b_plus(0.0) >= 0:  # delta == delta0 exactly
            v_star = 0.0
        else:
            lo, hi = _bracket_root(b_plus, 0.0, increasing=True)
            v_star = brentq(b_plus, lo, hi, xtol=tol, rtol=4 * np.finfo(float).eps)
        alpha = math.sqrt(1.0 + v_star / 2.0) - math.sqrt(v_star / 2.0)
    else:
        # B-(u) = Phi(-sqrt(eps u)) - e^eps Phi(-sqrt(eps (u+2))), decreasing in u.
        def b_minus(u: float) -> float:
            return float(ndtr(-math.sqrt(eps * u))) - _exp_times_ndtr(eps, -math.sqrt(eps * (u + 2.0))) - delta

        lo, hi = _bracket_root(b_minus, 0.0, increasing=False)
        u_star = brentq(b_minus, lo, hi, xtol=tol, rtol=4 * np.finfo(float).eps)
        alpha = math.sqrt(1.0 + u_star / 2.0) + math.sqrt(u_star / 2.0)
    return alpha * sensitivity / math.sqrt(2.0 * eps)


def analytic_gaussian_epsilon(sigma: float, delta: float, sensitivity: float = 1.0) -> float:
    """Smallest epsilon for which N(0, sigma^2) with L2 ``sensitivity`` is (epsilon, delta)-DP.

    Inverse of :func:`analytic_gaussian_sigma` in epsilon: the root of
    ``gaussian_delta(sigma, eps, sensitivity) = delta`` (decreasing in eps), Balle &
    Wang 2018, Theorem 8.
    """
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be finite and > 0, got {sigma!r}")
    if not (0 < delta < 1):
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    _check_sensitivity(sensitivity)
    if gaussian_delta(sigma, 0.0, sensitivity) <= delta:
        return 0.0

    def f(eps: float) -> float:
        return gaussian_delta(sigma, eps, sensitivity) - delta

    lo, hi = _bracket_root(f, 0.0, increasing=False)  # every epsilon a run may target (z down to 1e-3)
    return float(brentq(f, lo, hi, xtol=1e-13, rtol=4 * np.finfo(float).eps))


def laplace_scale(sensitivity: float, epsilon: float) -> float:
    """Laplace mechanism (Dwork & Roth 2014, Thm 3.6; DDP-SA Algorithm 2): ``b = Delta_1 / epsilon``.

    Lap(0, b) added to a query with L1 sensitivity ``Delta_1`` is epsilon-DP.
    """
    if not sensitivity > 0:
        raise ValueError(f"L1 sensitivity (clipping threshold Delta) must be > 0, got {sensitivity!r}")
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
    return float(sensitivity) / float(epsilon)
