"""Closed-form composition theorems: DDP-SA's Theorem 2 / Eq. 12 and NADP-FL's Lemma 2.

DDP-SA (Wei et al.) Theorem 2 composes T rounds of an (eps, delta)-DP mechanism: basic ``(T eps, T delta)``;
advanced ``(eps sqrt(2T ln(1/delta')) + T eps (e^eps - 1), T delta + delta')`` (Eq. 11).  Eq. 12 allocates a
total budget uniformly or with decay ``eps_t = eps_total alpha^(t-1) / sum_i alpha^(i-1)``.  Splitting so that the
``eps_t`` sum to the total is right only under basic composition; under advanced composition
:func:`per_round_epsilons` scales the allocation shape until the heterogeneous bound
``sqrt(2 ln(1/delta') sum_t eps_t^2) + sum_t eps_t (e^{eps_t} - 1)`` (Dwork & Roth 2014, Thm 3.20) meets it, and
under ``"pld"`` until the privacy-loss distribution of the T Laplace releases (:mod:`protocols.privacy.pld`) meets it.

NADP-FL (Lemma 2, Eq. 2): ``sigma = Delta sqrt(2 Q ln(1/delta)) / eps`` for Q Gaussian queries
(:func:`lemma2_sigma`) and its inverse :func:`lemma2_epsilon`.  These are the paper's figures: its Appendix C
drops ``rho`` from the moments-accountant bound ``rho + 2 sqrt(rho ln(1/delta))``, so they under-estimate epsilon.
:class:`protocols.privacy.accountant.DpCompositionAccountant` composes released rounds with these bounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from protocols.privacy.pld import laplace_pld_scale, pld_epsilon
from protocols.privacy.search import largest_within

__all__ = [
    "BudgetSchedule",
    "PrivacyBudget",
    "advanced_composition",
    "basic_composition",
    "compose_advanced",
    "compose_basic",
    "exponential_allocation",
    "lemma2_epsilon",
    "lemma2_sigma",
    "per_round_epsilons",
    "uniform_allocation",
]

Allocation = Literal["uniform", "exponential"]
Composition = Literal["basic", "advanced", "best", "pld"]


@dataclass(frozen=True)
class PrivacyBudget:
    """An (epsilon, delta) differential-privacy guarantee."""

    epsilon: float
    delta: float


@dataclass(frozen=True)
class BudgetSchedule:
    """Per-round budgets whose composition fits inside a total (epsilon, delta) budget.

    Attributes:
        epsilons: per-round epsilon, index 0 = first round.
        delta_per_round: per-round delta of the mechanism (0 for the Laplace mechanism).
        delta_prime: slack delta' consumed by advanced composition (0 under basic, the whole delta under pld).
        composition: what certifies the schedule ("basic", "advanced" or "pld").
        spent: the composed guarantee certified for the whole schedule (<= the target).
    """

    epsilons: NDArray[np.float64]
    delta_per_round: float
    delta_prime: float
    composition: Literal["basic", "advanced", "pld"]
    spent: PrivacyBudget


def _check_eps(eps: float) -> None:
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"epsilon must be finite and > 0, got {eps!r}")


def _check_delta(delta: float, name: str = "delta") -> None:
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {delta!r}")


def _check_rounds(rounds: int) -> None:
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")


def basic_composition(epsilon: float, delta: float, rounds: int) -> PrivacyBudget:
    """Theorem 2 (1): T rounds of (eps, delta)-DP are (T eps, T delta)-DP."""
    _check_eps(epsilon)
    _check_delta(delta)
    _check_rounds(rounds)
    return PrivacyBudget(rounds * epsilon, rounds * delta)


def advanced_composition(epsilon: float, delta: float, rounds: int, delta_prime: float) -> PrivacyBudget:
    """Theorem 2 (2), Eq. 11: ``eps*sqrt(2T ln(1/delta')) + T eps (e^eps - 1)``, ``T delta + delta'``."""
    _check_eps(epsilon)
    _check_delta(delta)
    _check_rounds(rounds)
    if not 0.0 < delta_prime < 1.0:
        raise ValueError(f"delta_prime must be in (0, 1), got {delta_prime!r}")
    eps_total = epsilon * math.sqrt(2.0 * rounds * math.log(1.0 / delta_prime)) + rounds * epsilon * math.expm1(epsilon)
    return PrivacyBudget(eps_total, rounds * delta + delta_prime)


def _as_schedule(epsilons: Sequence[float], deltas: Sequence[float] | float) -> tuple[np.ndarray, np.ndarray]:
    eps = np.asarray(epsilons, dtype=np.float64).ravel()
    if eps.size == 0:
        raise ValueError("need at least one round")
    if not (np.all(eps > 0) and np.all(np.isfinite(eps))):
        raise ValueError("all per-round epsilons must be finite and > 0")
    dl = np.broadcast_to(np.asarray(deltas, dtype=np.float64), eps.shape)
    if not (np.all(dl >= 0) and np.all(dl < 1)):
        raise ValueError("all per-round deltas must be in [0, 1)")
    return eps, dl


def compose_basic(epsilons: Sequence[float], deltas: Sequence[float] | float = 0.0) -> PrivacyBudget:
    """Compose a heterogeneous schedule with basic composition: ``(sum eps_t, sum delta_t)``."""
    eps, dl = _as_schedule(epsilons, deltas)
    return PrivacyBudget(float(eps.sum()), float(dl.sum()))


def compose_advanced(
    epsilons: Sequence[float],
    deltas: Sequence[float] | float = 0.0,
    *,
    delta_prime: float,
) -> PrivacyBudget:
    """Advanced composition of a heterogeneous schedule (reduces to Eq. 11 if uniform).

    ``eps = sqrt(2 ln(1/delta') sum eps_t^2) + sum eps_t (e^{eps_t} - 1)``,
    ``delta = sum delta_t + delta'``.
    """
    if not 0.0 < delta_prime < 1.0:
        raise ValueError(f"delta_prime must be in (0, 1), got {delta_prime!r}")
    eps, dl = _as_schedule(epsilons, deltas)
    e = math.sqrt(2.0 * math.log(1.0 / delta_prime) * float(np.sum(eps**2))) + float(np.sum(eps * np.expm1(eps)))
    return PrivacyBudget(e, float(dl.sum()) + delta_prime)


def uniform_allocation(epsilon_total: float, rounds: int) -> NDArray[np.float64]:
    """``eps_t = eps_total / T`` for every round."""
    _check_eps(epsilon_total)
    _check_rounds(rounds)
    return np.full(rounds, epsilon_total / rounds)


def exponential_allocation(epsilon_total: float, rounds: int, alpha: float) -> NDArray[np.float64]:
    """Eq. 12: ``eps_t = eps_total * alpha^(t-1) / sum_{i=1..T} alpha^(i-1)``, t = 1..T.

    Early rounds (large gradients) get more budget.  ``alpha`` in (0, 1]; alpha = 1 is the
    uniform allocation.  The returned values sum to ``eps_total``.
    """
    _check_eps(epsilon_total)
    _check_rounds(rounds)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    # Computed in log space so tiny alpha / huge T cannot underflow the normaliser to 0.
    logw = np.arange(rounds, dtype=np.float64) * math.log(alpha)
    w = np.exp(logw - logw.max())
    return epsilon_total * w / w.sum()


def _scale_for_advanced(shape: np.ndarray, epsilon_total: float, delta_prime: float) -> float:
    """Largest c with compose_advanced(c * shape).epsilon <= epsilon_total (bisection)."""

    def spent(c: float) -> float:
        return compose_advanced(c * shape, delta_prime=delta_prime).epsilon

    return largest_within(spent, epsilon_total, 0.0, 1.0, rel_tol=1e-15)  # spent(0+) -> 0


def per_round_epsilons(
    epsilon_total: float,
    delta_total: float,
    rounds: int,
    *,
    allocation: Allocation = "uniform",
    alpha: float = 0.95,
    composition: Composition = "basic",
    delta_per_round: float = 0.0,
) -> BudgetSchedule:
    """Per-round epsilons for T rounds that fit a total (epsilon_total, delta_total) budget.

    Args:
        epsilon_total: total epsilon for the whole training run.
        delta_total: total delta for the whole training run.
        rounds: T.
        allocation: "uniform" or "exponential" (Eq. 12, with ``alpha``) -- the *shape*.
        alpha: decay factor for the exponential allocation.
        composition: "basic" (eps_t sum to eps_total, Eq. 12 literally), "advanced"
            (shape scaled so the heterogeneous advanced bound equals eps_total, with
            ``delta' = delta_total - T * delta_per_round``) or "best" (whichever of the
            two gives larger per-round epsilons; both bounds are valid, so the tighter
            certificate is used) or "pld" (shape scaled so the privacy-loss distribution of T
            Laplace releases meets ``(epsilon_total, delta_total)``; pure releases only,
            ``delta_per_round`` 0; never below basic's per-round epsilons).
        delta_per_round: delta of each round's mechanism (0 for pure Laplace LDP).

    Returns:
        A :class:`BudgetSchedule`; ``schedule.spent`` is within the target budget.
    """
    _check_eps(epsilon_total)
    _check_delta(delta_total, "delta_total")
    _check_rounds(rounds)
    _check_delta(delta_per_round, "delta_per_round")
    if rounds * delta_per_round > delta_total:
        raise ValueError(
            f"rounds * delta_per_round = {rounds * delta_per_round:g} exceeds delta_total = {delta_total:g}"
        )
    if allocation == "uniform":
        shape = uniform_allocation(1.0, rounds)
    elif allocation == "exponential":
        shape = exponential_allocation(1.0, rounds, alpha)
    else:
        raise ValueError(f"unknown allocation {allocation!r} (use 'uniform' or 'exponential')")

    def basic() -> BudgetSchedule:
        eps = epsilon_total * shape
        return BudgetSchedule(eps, delta_per_round, 0.0, "basic", compose_basic(eps, delta_per_round))

    def advanced() -> BudgetSchedule:
        delta_prime = delta_total - rounds * delta_per_round
        if delta_prime <= 0.0:
            raise ValueError(
                "advanced composition needs delta' = delta_total - T*delta_per_round > 0; "
                f"got delta_total={delta_total:g}, T*delta_per_round={rounds * delta_per_round:g}"
            )
        eps = _scale_for_advanced(shape, epsilon_total, delta_prime) * shape
        return BudgetSchedule(
            eps,
            delta_per_round,
            delta_prime,
            "advanced",
            compose_advanced(eps, delta_per_round, delta_prime=delta_prime),
        )

    def pld() -> BudgetSchedule:
        if delta_per_round != 0.0 or not delta_total > 0.0:
            raise ValueError("PLD composition takes pure (Laplace) rounds, delta_per_round 0, and delta_total > 0")
        eps = laplace_pld_scale(shape, epsilon_total, delta_total) * shape
        spent = pld_epsilon([(float(e), True, 1) for e in eps], delta_total)
        return BudgetSchedule(eps, 0.0, delta_total, "pld", PrivacyBudget(spent, delta_total))

    if composition == "basic":
        return basic()
    if composition == "pld":
        return pld()
    if composition == "advanced":
        return advanced()
    if composition == "best":
        b = basic()
        if delta_total - rounds * delta_per_round <= 0.0:
            return b
        a = advanced()
        return a if a.epsilons[0] > b.epsilons[0] else b
    raise ValueError(f"unknown composition {composition!r} (use 'basic', 'advanced', 'best' or 'pld')")


# ----------------------------------------------------------------------------- NADP-FL Lemma 2
def _check_lemma2_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return delta


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def lemma2_sigma(sensitivity: float, epsilon: float, delta: float, num_queries: float) -> float:
    """NADP-FL Lemma 2 / Eq. 2: ``Delta sqrt(2 Q ln(1/delta)) / epsilon`` for Q composed Gaussian queries."""
    return (
        _positive("sensitivity", sensitivity)
        * math.sqrt(2.0 * _positive("num_queries", num_queries) * math.log(1.0 / _check_lemma2_delta(delta)))
        / _positive("epsilon", epsilon)
    )


def lemma2_epsilon(terms: Iterable[tuple[float, float, float]], delta: float) -> float:
    """Inverse of :func:`lemma2_sigma` over mixed ratios: ``sqrt(2 ln(1/delta) sum count (Delta/sigma)^2)``.

    ``terms`` are ``(sensitivity, sigma, count)`` triples; a ``sigma`` of 0 gives ``inf``.
    """
    log_term = math.log(1.0 / _check_lemma2_delta(delta))
    total = 0.0
    for sens, sigma, count in terms:
        if sigma < 0 or sens < 0 or count < 0:
            raise ValueError("sensitivity, sigma and count must be >= 0")
        if count == 0 or sens == 0:
            continue
        if sigma == 0:
            return math.inf
        total += count * (sens / sigma) ** 2
    return math.sqrt(2.0 * log_term * total)
