"""Empirical privacy auditing, Flower-free: a lower bound on epsilon from a distinguishing test's error rates.

An (epsilon, delta)-DP mechanism bounds every test between neighbours D, D': ``TPR <= e^epsilon FPR + delta`` and
``1 - FPR <= e^epsilon (1 - TPR) + delta`` (Kairouz et al. 2015).  Observed rates with Clopper-Pearson intervals
give a lower bound ``epsilon_lb`` at the stated confidence (Jagielski et al. 2020; Nasr et al. 2021):
:func:`epsilon_lower_bound`.

:func:`audit_scores` runs the test on canary trials with labels in {+1, -1} and scores ``T_i``: with
``R = label * T``, ``R > t`` counts as a true and ``R < -t`` as a false positive (the test "T > t" for +1 canaries
and its mirror for -1).  The evaluation set is balanced by an index rule that ignores the scores, so pooled rates
obey the same inequality; the pooled count of independent trials has tails no heavier than the binomial
(Hoeffding 1956), so the bounds stay conservative.  The threshold is chosen on one half of the releases
(``group``) and the bound computed on the other.  The caller must supply trials independent given their labels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import beta

__all__ = ["AuditBound", "audit_scores", "balanced", "clopper_pearson", "epsilon_from_rates",
           "epsilon_lower_bound", "gaussian_ceiling", "gdp_mu", "select_threshold"]


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
    true_positives: int
    false_positives: int
    trials: int  # the pooled rates' denominator
    tpr: tuple[float, float]  # Clopper-Pearson interval
    fpr: tuple[float, float]
    epsilon_lb: float  # lower end: from the TPR lower and FPR upper ends
    epsilon_point: float  # from the measured rates
    epsilon_ub: float  # upper end of what this test could show (inf when no false positive was seen)
    alpha: float

    def as_dict(self) -> dict[str, float | int | list[float]]:
        """JSON types (``inf`` as a float)."""
        d = asdict(self)
        d["tpr"], d["fpr"] = list(self.tpr), list(self.fpr)
        return d


def epsilon_lower_bound(tp: int, fp: int, n: int, delta: float, alpha: float = 0.05,
                        threshold: float = math.nan) -> AuditBound:
    """What ``tp`` true and ``fp`` false positives in ``n`` trials prove at confidence ``1 - alpha``.

    ``epsilon_lb`` uses the lower Clopper-Pearson end of TPR and the upper end of FPR (each one-sided
    ``1 - alpha / 2``, so both hold together with probability ``1 - alpha``).
    """
    if n <= 0:
        raise ValueError("an audit needs at least one trial")
    tpr_lo, tpr_hi = clopper_pearson(tp, n, alpha)
    fpr_lo, fpr_hi = clopper_pearson(fp, n, alpha)
    return AuditBound(float(threshold), int(tp), int(fp), int(n), (float(tpr_lo), float(tpr_hi)),
                      (float(fpr_lo), float(fpr_hi)), float(epsilon_from_rates(tpr_lo, fpr_hi, delta)),
                      float(epsilon_from_rates(tp / n, fp / n, delta)), float(epsilon_from_rates(tpr_hi, fpr_lo, delta)),
                      alpha)


def _counts(r: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(#{r > t}, #{r < -t}) for every t."""
    s = np.sort(r)
    tp = len(s) - np.searchsorted(s, thresholds, side="right")
    fp = np.searchsorted(s, -thresholds, side="left")
    return tp, fp


def select_threshold(r: np.ndarray, delta: float, alpha: float = 0.05, candidates: int = 400) -> float:
    """The threshold t maximising the epsilon lower bound of the pooled test ``R > t`` vs ``R < -t`` on ``r``.

    Candidates: quantiles of ``|r|`` from the median up to the largest value (fine steps in the tail).
    """
    r = np.asarray(r, dtype=np.float64)
    if r.size == 0:
        raise ValueError("no trials to select a threshold on")
    q = 1.0 - np.geomspace(0.5, 0.5 / r.size, candidates)
    ts = np.unique(np.quantile(np.abs(r), q))
    tp, fp = _counts(r, ts)
    n = r.size
    tpr_lo, _ = clopper_pearson(np.minimum(tp, n), np.full_like(tp, n), alpha)
    _, fpr_hi = clopper_pearson(np.minimum(fp, n), np.full_like(fp, n), alpha)
    eps = epsilon_from_rates(tpr_lo, fpr_hi, delta)
    return float(ts[int(np.argmax(eps))])


def balanced(labels: np.ndarray) -> np.ndarray:
    """Indices of an equal number of +1 and -1 labels: the first ``min(#+, #-)`` of each, in index order."""
    labels = np.asarray(labels)
    pos = np.flatnonzero(labels > 0)
    neg = np.flatnonzero(labels < 0)
    k = min(len(pos), len(neg))
    return np.sort(np.concatenate([pos[:k], neg[:k]]))


def audit_scores(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, delta: float,
                 alpha: float = 0.05) -> AuditBound:
    """Threshold chosen on the releases of even ``groups``, epsilon lower bound from those of odd ``groups``.

    ``scores``: the test statistic per trial (larger = the +1 record more likely); ``labels``: +1/-1 per
    trial; ``groups``: the release each trial came from (trials of one release stay on one side).
    Each side is balanced (:func:`balanced`); the bound counts ``labels * scores > t`` against ``< -t``
    over the evaluation side: every trial is one draw of the pooled TPR and of the pooled FPR (``trials`` = its
    size; the two bounds hold together by the union bound, no independence between them needed).
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels)
    groups = np.asarray(groups)
    if not (scores.shape == labels.shape == groups.shape):
        raise ValueError("scores, labels and groups must have one entry per trial")
    if not np.all(np.isin(labels, (-1, 1))):
        raise ValueError("labels must be +1 or -1")
    r = labels * scores
    select = groups % 2 == 0
    sel = np.flatnonzero(select)
    ev = np.flatnonzero(~select)
    sel = sel[balanced(labels[sel])]
    ev = ev[balanced(labels[ev])]
    if sel.size == 0 or ev.size == 0:
        raise ValueError("an audit needs +1 and -1 trials from at least two releases")
    t = select_threshold(r[sel], delta, alpha)
    tp, fp = _counts(r[ev], np.array([t]))
    return epsilon_lower_bound(int(tp[0]), int(fp[0]), ev.size, delta, alpha, threshold=t)


def fisher_scores(views: np.ndarray, labels: np.ndarray, owner: np.ndarray, fit: np.ndarray) -> np.ndarray:
    """Fisher discriminant per owner, fitted on the trials ``fit``; scores of every trial.

    ``views``: (trials, v) coordinates of each canary in each view vector.  Within-class covariance pooled
    over owners and labels (ridge 1e-12 x trace for views without noise).
    """
    scores = np.empty(len(labels))
    for o in np.unique(owner):
        rows = owner == o
        f = fit & rows
        mu_p = views[f & (labels > 0)].mean(0)
        mu_n = views[f & (labels < 0)].mean(0)
        centred = np.where((labels[f] > 0)[:, None], views[f] - mu_p, views[f] - mu_n)
        cov = centred.T @ centred / max(len(centred) - 2, 1)
        cov += np.eye(len(cov)) * (1e-12 * np.trace(cov) + 1e-300)
        w = np.linalg.solve(cov, mu_p - mu_n)
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
    lo, _ = clopper_pearson(tp, np.full_like(tp, trials), alpha)
    _, hi = clopper_pearson(fp, np.full_like(fp, trials), alpha)
    return float(np.max(epsilon_from_rates(lo, hi, delta)))
