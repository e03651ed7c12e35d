"""Bisection for calibrations: the largest scale whose composed privacy cost stays within a budget."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["largest_within"]


def largest_within(spent: Callable[[float], float], budget: float, lo: float, hi: float, *, rel_tol: float,
                   max_steps: int = 200) -> float:
    """Largest ``c`` (to ``rel_tol``) with ``spent(c) <= budget``, for ``spent`` continuous and increasing.

    Args:
        spent: the privacy cost of scale ``c``.
        budget: the most it may cost.
        lo: a scale within the budget (``spent(lo) <= budget``, or 0).
        hi: a first upper guess (> ``lo``); doubled until it exceeds the budget.
        rel_tol: stop once the bracket is narrower than ``rel_tol * hi``.
        max_steps: most bisection steps.

    Returns:
        The lower end of the final bracket: always within the budget.
    """
    while spent(hi) <= budget:
        lo, hi = hi, hi * 2.0
    for _ in range(max_steps):
        mid = 0.5 * (lo + hi)
        if spent(mid) <= budget:
            lo = mid
        else:
            hi = mid
        if hi - lo <= rel_tol * hi:
            break
    return lo
