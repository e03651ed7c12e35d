"""Privacy-loss-distribution (PLD) composition of pure-DP releases, over Google's dp-accounting.

A Laplace release of scale ``b`` on a query of L1 sensitivity ``S`` (``epsilon = S / b``) has the PLD of
dp-accounting's ``from_laplace_mechanism(1 / epsilon)``: a ``d``-dimensional Laplace mechanism under an L1 bound leaks
most when the whole shift is on one coordinate, the one-dimensional mechanism (a shift spread over coordinates is
dominated at every epsilon; ``tests/test_ddpsa_pld.py`` checks spreads numerically).  Any
other ``epsilon``-DP release (e.g. DDP-SA's difference-of-Gammas noise when shares are missing) is charged the PLD
of ``from_privacy_parameters(epsilon, 0)``, which dominates every ``epsilon``-DP mechanism.  PLDs compose
by convolution (Koskela et al. 2020; Doroshenko et al. 2022); dp-accounting's pessimistic discretisation keeps every
epsilon an upper bound.  :func:`laplace_pld_scale` inverts the composition: the largest per-round epsilons of a
given shape whose T Laplace releases meet a total ``(epsilon, delta)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from dp_accounting.pld import privacy_loss_distribution as _pld
from dp_accounting.pld.common import DifferentialPrivacyParameters

from protocols.privacy.search import largest_within

__all__ = ["DISCRETIZATION", "laplace_pld_scale", "pld_epsilon"]

#: Width of dp-accounting's privacy-loss grid per unit of the largest release's epsilon (at least this absolute
#: width); pessimistic rounding: a coarser grid only loosens the bound.
DISCRETIZATION = 1e-4


def _check(epsilons: Sequence[float]) -> None:
    if not all(math.isfinite(e) and e > 0 for e in epsilons):
        raise ValueError(f"every epsilon must be finite and > 0, got {list(epsilons)!r}")


@lru_cache(maxsize=256)
def _single(epsilon: float, laplace: bool, grid: float) -> _pld.PrivacyLossDistribution:
    if laplace:
        return _pld.from_laplace_mechanism(1.0 / epsilon, value_discretization_interval=grid)
    return _pld.from_privacy_parameters(DifferentialPrivacyParameters(epsilon, 0.0), value_discretization_interval=grid)


def pld_epsilon(releases: Sequence[tuple[float, bool, int]], delta: float) -> float:
    """Epsilon at ``delta`` of the composed ``releases``, each ``(epsilon, laplace, count)``.

    ``laplace`` True: ``count`` Laplace releases of that epsilon (scale = sensitivity / epsilon); False: ``count``
    releases only known to be ``epsilon``-DP.  The figure is never above basic composition's ``sum epsilon``
    (both are valid bounds; the smaller is returned).

    Raises:
        ValueError: ``delta`` outside ``(0, 1)``, an epsilon not finite and > 0, or a negative count.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    releases = [(float(e), bool(lap), int(c)) for e, lap, c in releases if c]
    if any(c < 0 for _, _, c in releases):
        raise ValueError("release counts must be >= 0")
    if not releases:
        return 0.0
    _check([e for e, _, _ in releases])
    grid = DISCRETIZATION * max(1.0, max(e for e, _, _ in releases))
    composed = None
    for eps, laplace, count in releases:
        one = _single(eps, laplace, grid)
        part = one.self_compose(count) if count > 1 else one
        composed = part if composed is None else composed.compose(part)
    basic = math.fsum(e * c for e, _, c in releases)
    return min(float(composed.get_epsilon_for_delta(delta)), basic)


@lru_cache(maxsize=64)
def _scale(shape: tuple[float, ...], epsilon: float, delta: float) -> float:
    def spent(c: float) -> float:
        merged: dict[float, int] = {}
        for s in shape:
            merged[c * s] = merged.get(c * s, 0) + 1
        return pld_epsilon([(e, True, n) for e, n in merged.items()], delta)

    lo = epsilon / math.fsum(shape)  # basic composition: always within the budget
    return largest_within(spent, epsilon, lo, lo * 1.05, rel_tol=1e-3)


def laplace_pld_scale(shape: Sequence[float], epsilon: float, delta: float) -> float:
    """Largest ``c`` whose Laplace releases of epsilons ``c * shape`` compose (PLD) to at most ``(epsilon, delta)``.

    Bisection on :func:`pld_epsilon`, starting from basic composition's ``epsilon / sum(shape)`` (the answer is
    never below it).  One release keeps ``epsilon / shape[0]``: pure epsilon-DP (delta would buy it under 1e-4).
    Cached per ``(shape, epsilon, delta)``: clients and the server recompute the same schedule.

    Raises:
        ValueError: an empty or non-positive shape, ``epsilon`` not finite and > 0, ``delta`` outside ``(0, 1)``.
    """
    shape = tuple(float(s) for s in shape)
    if not shape:
        raise ValueError("need at least one round")
    _check(shape)
    _check([epsilon])
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if len(shape) == 1:
        return float(epsilon) / shape[0]
    return _scale(shape, float(epsilon), float(delta))
