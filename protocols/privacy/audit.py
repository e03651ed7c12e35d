"""Empirical privacy auditing, Flower-free: a lower bound on epsilon from a distinguishing test's outcomes.

An (epsilon, delta)-DP mechanism bounds every test between neighbours D, D': ``P_D(S) <= e^epsilon P_D'(S) + delta``
(Kairouz et al. 2015).  :func:`audit_scores` runs the test on canary trials, each with a secret label in {+1, -1}
drawn by a fair coin independently of everything else, and a score ``T_i`` (larger: +1 more likely).  With
``R = label * T`` a trial is a *hit* when ``R > t`` and a *miss* when ``R < -t`` (the test "T > t" for +1 canaries
and its mirror for -1).  Averaging over the coin, every trial obeys ``P(hit) <= e^epsilon P(miss) + delta``.

The bound (:func:`epsilon_lower_bound`) conditions on the trials that hit or missed.  Split each hit into a part of
probability at most ``e^epsilon P(miss)`` and an excess of probability at most ``delta``: the excess hits over
``n`` independent trials are at most ``j``, the ``1 - alpha / 5`` quantile of Binomial(n, delta), and, given which
trials hit or missed otherwise, each of them is a hit with probability at most ``q = e^epsilon / (1 + e^epsilon)``.
So ``a = hits - j`` hits among ``a + misses`` is a binomial count with success probability ``<= q`` (up to the
``alpha / 5`` event), and the one-sided Clopper-Pearson lower end ``p`` of that proportion at ``4 alpha / 5`` gives
``epsilon_lb = ln(p / (1 - p))``, which exceeds the true epsilon with probability at most ``alpha``.  Without delta
(a pure-DP claim) ``j = 0`` and the whole ``alpha`` goes to the proportion.  Unlike separate intervals on the two
rates, it spends no confidence on how rare hits and misses are, only on their odds.

The threshold is chosen on every ``SELECT_EVERY``-th release (``group``), the one the caller also fits its statistic
on, and the bound counts the other releases' trials.  The caller must supply trials independent given their labels
(the noise of distinct canaries independent) and fair-coin labels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import beta, binom

__all__ = ["EXCESS_ALPHA", "SELECT_EVERY", "AuditBound", "audit_scores", "clopper_pearson", "delta_excess",
           "epsilon_from_rates", "epsilon_lower_bound", "fisher_scores", "gaussian_ceiling", "gdp_mu",
           "odds_lower_bound", "select_threshold", "selects"]


def clopper_pearson(k: int | np.ndarray, n: int | np.ndarray, alpha: float = 0.05
                    ) -> tuple[np.ndarray | float, np.ndarray | float]:
    """Two-sided ``1 - alpha`` Clopper-Pearson interval of a binomial proportion (``k`` successes of ``n``).

    Each end has one-sided coverage ``1 - alpha / 2``.  Vectorised over ``k``/``n``; raises ValueError on
    ``k`` outside ``0..n`` or ``alpha`` outside (0, 1).
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    if np.any(k < 0) or np.any(k > n):
        raise ValueError("successes must lie in 0..trials")
    with np.errstate(invalid="ignore"):
        lo = np.where(k > 0, beta.ppf(alpha / 2, k, n - k + 1), 0.0)
        hi = np.where(k < n, beta.ppf(1 - alpha / 2, k + 1, n - k), 1.0)
    if lo.ndim == 0:
        return float(lo), float(hi)
    return lo, hi


def epsilon_from_rates(tpr: float | np.ndarray, fpr: float | np.ndarray, delta: float) -> float | np.ndarray:
    """The largest epsilon a test with these rates proves: ``max(ln((TPR - d) / FPR), ln((1 - FPR - d) / (1 - TPR)))``.

    0 where neither ratio exceeds 1; ``inf`` where a denominator is 0 and its numerator positive.
    """
    tpr = np.asarray(tpr, dtype=np.float64)
    fpr = np.asarray(fpr, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(tpr - delta > 0, np.log(np.maximum(tpr - delta, 1e-300)) - np.log(fpr), -np.inf)
        b = np.where(1 - fpr - delta > 0, np.log(np.maximum(1 - fpr - delta, 1e-300)) - np.log(1 - tpr), -np.inf)
    out = np.maximum(np.maximum(a, b), 0.0)
    return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class AuditBound:
    """A test's counts and what they prove: ``epsilon_lb`` holds with probability ``1 - alpha``."""

    threshold: float
    true_positives: int  # hits
    false_positives: int  # misses
    trials: int  # evaluation trials (the rates' denominator)
    tpr: tuple[float, float]  # Clopper-Pearson interval of the hit rate (context; the bound uses the odds)
    fpr: tuple[float, float]
    epsilon_lb: float  # from the hits' odds against the misses, less the delta excess (module docstring)
    epsilon_point: float  # from the measured rates
    epsilon_ub: float  # upper end of the odds' interval (inf when no miss was seen)
    alpha: float
    excess: int = 0  # hits set aside for delta (the 1 - alpha / 5 quantile of Binomial(trials, delta))

    def as_dict(self) -> dict[str, float | int | list[float]]:
        """JSON types (``inf`` as a float)."""
        d = asdict(self)
        d["tpr"], d["fpr"] = list(self.tpr), list(self.fpr)
        return d


#: Share of ``alpha`` spent on the hits that delta may add (:func:`delta_excess`).
EXCESS_ALPHA = 0.2
#: The threshold (and the caller's statistic) is fitted on releases with ``group % SELECT_EVERY == 0``.
SELECT_EVERY = 4


def delta_excess(n: int, delta: float, alpha: float = 0.05) -> tuple[int, float]:
    """``(j, alpha')``: the hits delta may add to ``n`` trials, and the confidence left for the odds.

    At most ``j`` trials hit through delta with probability ``>= 1 - EXCESS_ALPHA alpha``; ``(0, alpha)`` for
    ``delta = 0``.
    ``j`` is the ``1 - EXCESS_ALPHA alpha`` quantile of Binomial(n, delta), which dominates a sum of independent
    Bernoulli trials of probability at most delta.
    """
    if delta <= 0:
        return 0, alpha
    return int(binom.isf(EXCESS_ALPHA * alpha, n, delta)), (1 - EXCESS_ALPHA) * alpha


def odds_lower_bound(hits: np.ndarray | int, misses: np.ndarray | int, n: int, delta: float, alpha: float = 0.05
                     ) -> np.ndarray | float:
    """``epsilon_lb`` of ``hits`` and ``misses`` in ``n`` trials (module docstring); vectorised, 0 without hits."""
    j, a_odds = delta_excess(n, delta, alpha)
    a = np.maximum(np.asarray(hits, dtype=np.float64) - j, 0.0)
    m = np.asarray(misses, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(a > 0, beta.ppf(a_odds, np.maximum(a, 1.0), m + 1.0), 0.0)
        out = np.maximum(np.log(p) - np.log1p(-p), 0.0)
    return float(out) if out.ndim == 0 else out


def epsilon_lower_bound(tp: int, fp: int, n: int, delta: float, alpha: float = 0.05,
                        threshold: float = math.nan) -> AuditBound:
    """What ``tp`` hits and ``fp`` misses in ``n`` trials prove at confidence ``1 - alpha`` (module docstring).

    ``epsilon_ub``: the upper one-sided end (``1 - alpha'``) of the hits' odds among hits and misses (no excess
    removed); ``tpr``/``fpr``: each rate's two-sided Clopper-Pearson interval (shown, not used by the bound).
    Raises ValueError for ``n <= 0`` or counts outside ``0..n``.
    """
    if n <= 0:
        raise ValueError("an audit needs at least one trial")
    if not (0 <= tp and 0 <= fp and tp + fp <= n):
        raise ValueError("hits and misses must be disjoint counts of the trials")
    tpr_lo, tpr_hi = clopper_pearson(tp, n, alpha)
    fpr_lo, fpr_hi = clopper_pearson(fp, n, alpha)
    j, a_odds = delta_excess(n, delta, alpha)
    hi = float(beta.isf(a_odds, tp + 1, fp)) if fp > 0 else 1.0
    ub = math.inf if hi >= 1.0 else max(math.log(hi) - math.log1p(-hi), 0.0)
    return AuditBound(float(threshold), int(tp), int(fp), int(n), (float(tpr_lo), float(tpr_hi)),
                      (float(fpr_lo), float(fpr_hi)), odds_lower_bound(tp, fp, n, delta, alpha),
                      float(epsilon_from_rates(tp / n, fp / n, delta)), ub, alpha, j)


def _counts(r: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(#{r > t}, #{r < -t}) for every t."""
    s = np.sort(r)
    tp = len(s) - np.searchsorted(s, thresholds, side="right")
    fp = np.searchsorted(s, -thresholds, side="left")
    return tp, fp


def select_threshold(r: np.ndarray, delta: float, alpha: float = 0.05, candidates: int = 400) -> float:
    """The threshold t ``>= 0`` maximising :func:`odds_lower_bound` of the hits ``r > t`` and misses ``r < -t`` on ``r``.

    Candidates: quantiles of ``|r|`` from the median up to the largest value (fine steps in the tail), and a point
    just below the median, so that a statistic that separates every trial at one value (a noise-free release)
    counts them all.  The bound is computed at ``r``'s own size, which favours counts large enough to carry over to
    fresh trials.
    """
    r = np.asarray(r, dtype=np.float64)
    if r.size == 0:
        raise ValueError("no trials to select a threshold on")
    q = 1.0 - np.geomspace(0.5, 0.5 / r.size, candidates)
    ts = np.quantile(np.abs(r), q)
    ts = np.unique(np.append(ts, max(float(np.nextafter(ts[0], -np.inf)), 0.0)))
    tp, fp = _counts(r, ts)
    return float(ts[int(np.argmax(odds_lower_bound(tp, fp, r.size, delta, alpha)))])


def selects(groups: np.ndarray, every: int = SELECT_EVERY) -> np.ndarray:
    """The trials whose release fits the statistic and selects the threshold: ``groups % every == 0``."""
    return np.asarray(groups) % every == 0


def audit_scores(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, delta: float,
                 alpha: float = 0.05, every: int = SELECT_EVERY) -> AuditBound:
    """Threshold chosen on the releases :func:`selects` picks, epsilon lower bound from all the others.

    ``scores``: the test statistic per trial (larger = the +1 record more likely), fitted on the selecting
    releases only; ``labels``: +1/-1 per trial, fair coins; ``groups``: the release each trial came from (trials
    of one release stay on one side).  The bound counts hits ``labels * scores > t`` and misses ``< -t`` over
    every evaluation trial (:func:`epsilon_lower_bound`).  Raises ValueError on mismatched shapes, labels other
    than +-1, or a side without trials.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels)
    groups = np.asarray(groups)
    if not (scores.shape == labels.shape == groups.shape):
        raise ValueError("scores, labels and groups must have one entry per trial")
    if not np.all(np.isin(labels, (-1, 1))):
        raise ValueError("labels must be +1 or -1")
    r = labels * scores
    select = selects(groups, every)
    if select.all() or not select.any():
        raise ValueError(f"an audit needs trials from at least two releases, one of them a multiple of {every}")
    t = select_threshold(r[select], delta, alpha)
    tp, fp = _counts(r[~select], np.array([t]))
    return epsilon_lower_bound(int(tp[0]), int(fp[0]), int((~select).sum()), delta, alpha, threshold=t)


def fisher_scores(views: np.ndarray, labels: np.ndarray, owner: np.ndarray, fit: np.ndarray) -> np.ndarray:
    """Fisher discriminant per owner, fitted on the trials ``fit``; scores of every trial.

    ``views``: (trials, v) coordinates of each canary in each view vector.  Within-class covariance of
    each owner, pooled over the labels (ridge 1e-12 x trace; the mean difference alone for views without any spread).  An
    owner without fitting trials of both labels scores 0.
    """
    scores = np.zeros(len(labels))
    for o in np.unique(owner):
        rows = owner == o
        f = fit & rows
        if not (f & (labels > 0)).any() or not (f & (labels < 0)).any():
            continue  # no fitting trial of one side: this owner's trials carry no evidence (score 0)
        mu_p = views[f & (labels > 0)].mean(0)
        mu_n = views[f & (labels < 0)].mean(0)
        centred = np.where((labels[f] > 0)[:, None], views[f] - mu_p, views[f] - mu_n)
        cov = centred.T @ centred / max(len(centred) - 2, 1)
        spread = np.trace(cov)
        if spread > 0:
            w = np.linalg.solve(cov + np.eye(len(cov)) * 1e-12 * spread, mu_p - mu_n)
        else:  # no noise in the views: the mean difference separates them (a ridge of 0 would overflow to inf)
            w = mu_p - mu_n
        scores[rows] = (views[rows] - (mu_p + mu_n) / 2) @ w
    return scores


def gdp_mu(epsilon: float, delta: float) -> float:
    """The ``mu`` of the Gaussian mechanism (mu-GDP) that is exactly (epsilon, delta)-DP (Dong, Roth & Su 2019).

    Solves ``delta = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)``; raises ValueError for
    ``epsilon <= 0`` or ``delta`` outside (0, 1).
    """
    from scipy.optimize import brentq
    from scipy.stats import norm

    if not (epsilon > 0 and 0 < delta < 1):
        raise ValueError(f"need epsilon > 0 and delta in (0, 1), got {epsilon}, {delta}")

    def gap(mu: float) -> float:
        return norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2) - delta

    return float(brentq(gap, 1e-6, 100.0))


def gaussian_ceiling(epsilon: float, delta: float, trials: int, alpha: float = 0.05) -> float:
    """What :func:`audit_scores` proves at best on ``trials`` evaluation trials of a mechanism exactly at the claim.

    The mechanism: the Gaussian of :func:`gdp_mu`; the test: its likelihood ratio, counts at their expected values,
    the best threshold.  A row's ``epsilon_lb`` near this is all the trials allow; far below it, the canary or the
    statistic lacks power (or the mechanism leaks less than it claims).
    """
    from scipy.stats import norm

    mu = gdp_mu(epsilon, delta)
    t = np.linspace(0.0, 12.0, 1201)
    tp = np.round(norm.sf(t - mu / 2) * trials)
    fp = np.round(norm.sf(t + mu / 2) * trials)
    return float(np.max(odds_lower_bound(tp, fp, trials, delta, alpha)))
