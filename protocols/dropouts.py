"""Dropout-aware planning, Flower-free: how many of a round's participants may drop, and the noise it takes.

Run-config ``dropout-rate`` ``r`` (:class:`protocols.methods.pairwise.PairwiseOptions`) is the assumed chance that
a participant drops after the key phase, independently of the others.  A round of ``k`` participants plans for up
to :func:`dropout_bound` ``m`` dropouts: the smallest ``m`` with ``P[Binomial(k, r) > m] <= DROPOUT_TAIL``.

The pairwise methods lose noise when participants drop: recovery strips the pair noise (nadp, mpddp) or the
shares (niss) exchanged with the dropped, so the survivors' aggregate keeps only the survivors' own noise.  A plan
that meets its multiplier ``z`` (mpddp: its privacy-loss variance theta) for every survivor set of at most ``m``
dropouts scales its noise by :func:`nadp_dropout_factor` (nadp), :func:`niss_dropout_factor` (niss) or
:func:`mpddp_dropout_factor` (mpddp); both ends of the protocol compute the factor from the run config and public
values (sizes, graph), so a client refuses a plan with less.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

__all__ = ["DROPOUT_TAIL", "binom_tail", "dropout_bound", "mpddp_dropout_factor", "nadp_dropout_factor",
           "niss_dropout_factor"]

#: Chance, per round, that more participants drop than the plan allows for (the binomial tail the plan covers).
DROPOUT_TAIL = 1e-3


def binom_tail(n: int, p: float, k: int) -> float:
    """``P[Binomial(n, p) >= k]``."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return math.fsum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


@functools.lru_cache(maxsize=256)
def dropout_bound(k: int, rate: float, tail: float = DROPOUT_TAIL) -> int:
    """The most dropouts among ``k`` participants a plan covers: smallest ``m`` with ``P[Bin(k, rate) > m] <= tail``.

    Capped at ``k - 1`` (a round needs one survivor); 0 when ``rate == 0``.

    Raises:
        ValueError: ``rate`` outside ``[0, 1)``, ``tail`` outside ``(0, 1)`` or ``k < 1``.
    """
    if not (math.isfinite(rate) and 0.0 <= rate < 1.0):
        raise ValueError(f"dropout rate must be in [0, 1), got {rate!r}")
    if not 0.0 < tail < 1.0:
        raise ValueError(f"tail must be in (0, 1), got {tail!r}")
    if k < 1:
        raise ValueError(f"a round needs at least one participant, got {k}")
    if rate == 0.0:
        return 0
    m = 0
    while m < k - 1 and binom_tail(k, rate, m + 1) > tail:
        m += 1
    return m


def nadp_dropout_factor(sizes: Mapping[int, int], rate: float, tail: float = DROPOUT_TAIL) -> float:
    """``1 / sqrt(P_min)``: nadp's factor on ``sigma_down`` (and ``sigma_up``) for up to ``m`` dropouts.

    ``P_min = 1 - (sum of the m largest p_i)``, ``p_i = |D_i| / sum |D|``, ``m = dropout_bound(k, rate, tail)``.
    After dropouts the renormalised aggregate over the survivors ``S`` carries the residual std
    ``sqrt(P_S) sigma_down / P_S`` against the sensitivity ``max_S p_i Delta_i / P_S``: its multiplier is
    ``sqrt(P_S)`` times the planned one, and ``P_S >= P_min`` whenever at most ``m`` drop.  The survivors' joint
    view of the uploads is bounded by that aggregate, so the factor lifts both back to the plan's multiplier.
    """
    k = len(sizes)
    m = dropout_bound(k, rate, tail) if k > 1 else 0
    if m == 0:
        return 1.0
    total = math.fsum(sizes[c] for c in sorted(sizes))
    lost = math.fsum(sorted((sizes[c] / total for c in sorted(sizes)), reverse=True)[:m])
    return 1.0 / math.sqrt(max(1.0 - lost, 1e-12))


def niss_dropout_factor(sigmas: Mapping[int, float], graph: Mapping[int, Sequence[int]], rate: float,
                        tail: float = DROPOUT_TAIL) -> float:
    """``1 / sqrt(1 - L_m / sum_k sigma_k^2)``: niss's factor on every ``sigma_k`` for up to ``m`` dropouts.

    The aggregate keeps the shares exchanged among survivors (Theorem 2's ``tau^2`` times their variance); a
    dropped ``j`` takes out its own shares (``sigma_j^2``) and those its neighbours sent it (``sigma_i^2 / d_i``
    each, ``d_i`` = ``i``'s degree; recovery removes them), at most ``c_j = sigma_j^2 + sum_{i in N(j)} sigma_i^2 /
    d_i``.  So the survivors keep at least ``sum_k sigma_k^2 - L_m``, ``L_m`` = the sum of the ``m`` largest
    ``c_j``, and the downlink multiplier (:func:`protocols.niss.downlink_multiplier`) scales with its square root.
    On a complete graph the minimum is exact: the ``m`` largest ``sigma`` drop and each survivor keeps
    ``(k - m - 1) / (k - 1)`` of its shares (the larger of the two lower bounds is used).

    Raises:
        ValueError: ``m`` dropouts can remove all the shares (too few participants for ``rate``).
    """
    k = len(graph)
    m = dropout_bound(k, rate, tail) if k > 1 else 0
    if m == 0:
        return 1.0
    total = math.fsum(sigmas[n] ** 2 for n in sorted(graph))
    cost = {j: sigmas[j] ** 2 + math.fsum(sigmas[i] ** 2 / max(len(graph[i]), 1) for i in graph[j]) for j in graph}
    kept = total - math.fsum(sorted(cost.values(), reverse=True)[:m])
    if all(len(graph[n]) == k - 1 for n in graph):
        smallest = sorted(sigmas[n] ** 2 for n in graph)[: k - m]
        kept = max(kept, math.fsum(smallest) * (k - m - 1) / (k - 1))
    if kept <= total * 1e-9:
        raise ValueError(f"run-config 'dropout-rate' = {rate}: up to {m} of {k} participants may drop, which can "
                         "remove all of niss's shares; lower the rate or sample more clients per round")
    return math.sqrt(total / kept)


def mpddp_dropout_factor(sigma_eta: float, sigma_delta: float, k: int, rate: float, *, complete: bool,
                         n_out: int | None, tail: float = DROPOUT_TAIL) -> float:
    """``sqrt(theta(k - m) / theta(k))``: mpddp's factor on ``sigma_eta`` and ``sigma_delta`` for up to ``m`` dropouts.

    ``theta(K')`` = :func:`protocols.mpddp.theta_after` of the planned sigmas for ``K'`` participants: the function
    the server charges a recovery with (:mod:`strategies.mpddp`) and each survivor's ledger tops up to
    (:mod:`client.recovery_ledger`); ``m = dropout_bound(k, rate, tail)``.  When ``j`` drop, the server removes their
    pair noise Delta from the survivors' mean and prices the round at ``theta(k - j)``: Theorem 10 (complete graph)
    ``(1/sigma_eta^2 + 1/sigma_delta^2) / K'``, Theorem 11 (n-out graph) ``1/(sigma_eta^2 K') + c(K') /
    sigma_delta^2`` with ``c(K') = 1/(floor((n-1)/3) - 1) + (12 + 6 log K')/K'``.  Both only grow as ``K'`` falls
    (``c`` decreases for ``K' >= 1``), so ``k - m`` survivors are the worst case, and both are ``1/s^2`` times their
    value when both sigmas are times ``s``: with the sigmas times this factor, ``theta(k - j)`` for every
    ``j <= m`` is at most the planned ``theta(k)``, and a recovery of up to ``m`` dropouts costs no more than the
    round's charge.  Complete graph: ``sqrt(k / (k - m))``.  A margin of 1e-12 keeps round-off from charging a
    shortfall.  The sigmas may be absolute or per unit sensitivity (only their ratio counts).

    Raises:
        ValueError: the ``k - m`` survivors are outside the theorem (``theta_after`` refuses them), naming the rate.
    """
    m = dropout_bound(k, rate, tail) if k > 1 else 0
    if m == 0:
        return 1.0
    from protocols.mpddp.calibration import theta_after

    try:
        planned = theta_after(sigma_eta, sigma_delta, k, complete=complete, n_out=n_out)
        worst = max(theta_after(sigma_eta, sigma_delta, k - j, complete=complete, n_out=n_out) for j in range(1, m + 1))
    except ValueError as err:
        raise ValueError(f"run-config 'dropout-rate' = {rate}: up to {m} of {k} participants may drop, and the "
                         f"theorem does not cover the {k - m} left: {err}") from err
    return max(1.0, math.sqrt(worst / planned)) * (1 + 1e-12)
