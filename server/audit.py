"""Privacy audit: an empirical lower bound on epsilon from the method's real release code (``cancelfl audit``).

:func:`run_audit` runs releases (:func:`server.audit_release.release`, one round each) until ``trials`` canary
records, then tests them: the statistic per record is Fisher's linear discriminant of its coordinates across the
view's vectors, fitted (with the test's threshold) on every fourth release and tested on the other three
(:func:`protocols.privacy.audit.audit_scores`: the odds of the hits against the misses, Clopper-Pearson, less
what delta may add); the report compares the bound with the run's own claim
(:mod:`server.audit_spec`).  The audit chooses only the model and the data (:mod:`server.audit_canaries`):

* **gradient canaries** (default): a bias-free linear model ``W`` (2 x d) at 0 and per client ``m`` records
  ``x = 10 clip e_k``, each in its own input coordinates; its clipped gradient is exactly ``+-clip v_k``
  (the whole clipping budget, in a direction no other record touches).  Flipping its label (drawn at random per
  record and release) is a replace-one neighbour that moves the full-batch step by the record sensitivity
  ``2 clip lr / n_k``.  Every record is one trial (the noise of every method is independent per coordinate).
  An adapter may ask for the one-hidden-layer MLP instead (``mlp_canaries``), and for one counted canary per
  release where a release's secret scales all its canaries' noise (``one_trial_per_release``).
* **adaptive canaries**: the label also moves a data-dependent noise scale across its whole range, and the
  statistic reads the noise scale as well as the shift.

What differs by method (canaries, planted faults, federation, services its releases need such as intermediate
servers, the view) is its card's audit adapter (:class:`server.audit_adapter.AuditAdapter`, :mod:`server.audits`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from protocols.config import RunConfig
from protocols.privacy.audit import audit_scores, fisher_scores, selects
from server.audit_canaries import _AdaptiveCanaries, _Canaries
from server.audit_release import release
from server.audit_spec import ADJACENCY_TEXT, CANARY_SCALE, AuditReport, AuditSpec

__all__ = ["canaries_for", "quiet", "run_audit"]


def run_audit(spec: AuditSpec, *, seed: int | None = None, progress: Callable[[str], None] | None = None
              ) -> AuditReport:
    """Run ``spec``: releases until ``trials`` canaries, then the test; ``seed`` fixes the canary labels only."""
    spec.validate()
    with quiet():
        return _run_audit(spec, seed, progress)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """One torch thread (the releases are small; threads only contend) and Flower's per-node warnings off."""
    import logging

    flwr_log = logging.getLogger("flwr")
    level, threads = flwr_log.level, torch.get_num_threads()
    flwr_log.setLevel(logging.ERROR)  # every release's nodes use the derived simulation identities (no roster)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        flwr_log.setLevel(level)
        torch.set_num_threads(threads)


def canaries_for(spec: AuditSpec) -> _Canaries | _AdaptiveCanaries:
    """The canaries of ``spec``'s releases (fresh labels are drawn per release)."""
    if spec.canary_kind == "adaptive":
        return _AdaptiveCanaries(spec.clients, CANARY_SCALE * spec.clip)
    return _Canaries(spec.clients, spec.per_client, spec.adapter.canary_scale * spec.clip, mlp=spec.adapter.mlp_canaries,
                     zero_out=spec.adjacency_used == "zero-out",
                     zero_output=spec.adapter.mlp_zero_output and spec.reads_secret)


def _run_audit(spec: AuditSpec, seed: int | None, progress: Callable[[str], None] | None) -> AuditReport:
    with spec.adapter.services(spec, spec.run_config()) as raw:  # e.g. intermediate servers, stopped on exit
        return _audit_releases(spec, raw, seed, progress)


def _audit_releases(spec: AuditSpec, raw: dict, seed: int | None, progress: Callable[[str], None] | None
                    ) -> AuditReport:
    cfg = RunConfig.from_mapping(raw)
    rng = np.random.default_rng(seed)
    canaries = canaries_for(spec)
    releases = math.ceil(spec.trials / spec.audited_per_release())
    t0, c0 = time.perf_counter(), time.process_time()
    feats, labels, owners, groups, keep = [], [], [], [], []
    claims: dict[str, float] = {}
    claim_delta = spec.delta
    for i in range(releases):
        rel = release(spec, cfg, canaries, rng, raw)
        feats.append(rel.features)
        labels.append(rel.labels)
        owners.append(rel.owner)
        groups.append(np.full(len(rel.labels), i))
        keep.append(rel.audited)
        claims, claim_delta = rel.claims, rel.claim_delta
        if progress is not None and (i + 1) % max(releases // 10, 1) == 0:
            progress(f"{i + 1}/{releases} releases, {time.perf_counter() - t0:.0f} s")
    keep_all = np.concatenate(keep)
    v = np.concatenate(feats)[keep_all]
    lab = np.concatenate(labels)[keep_all]
    own = np.concatenate(owners)[keep_all]
    grp = np.concatenate(groups)[keep_all]
    if spec.reads_secret:  # given the secret, a release's canaries are independent: fit and test within each release
        half = np.arange(len(lab)) % 2
        scores = fisher_scores(v, lab, grp * spec.clients + own, selects(half, 2))
        bound = audit_scores(scores, lab, half, claim_delta, spec.alpha, every=2)
    else:
        scores = fisher_scores(v, lab, own, selects(grp))
        if spec.adapter.one_trial_per_release:  # one secret per release scales every canary's noise
            first = np.r_[True, grp[1:] != grp[:-1]]  # the threshold is chosen for the same count (the fit used all)
            scores, lab, grp = scores[first], lab[first], grp[first]
        bound = audit_scores(scores, lab, grp, claim_delta, spec.alpha)
    account = spec.adapter.claim_account(spec)
    key = f"epsilon_{account}"
    claimed = float(claims.get(key, math.inf))
    of_run = "one round" if spec.rounds == 1 else f"its first round of {spec.rounds}"
    notes = [f"claim: the run's {key} after {of_run} at epsilon={spec.epsilon} (one released round)"]
    if claim_delta == 0.0 and math.isfinite(claimed):
        notes.append("claim: pure epsilon-DP (the view's accountant composes pure releases basically); the bound "
                     "uses delta = 0")
    notes += spec.adapter.notes(spec)
    tolerated = spec.adapter.tolerated_colluders(spec)
    return AuditReport(spec.method, spec.direction, spec.canary_kind, spec.colluders, spec.fault, claimed, claim_delta,
                       ADJACENCY_TEXT[spec.adjacency_used], bound, int(keep_all.sum()), releases, time.perf_counter() - t0,
                       notes, tolerated, spec.colluders <= tolerated and (not spec.reads_secret or spec.adapter.secret_claim),
                       spec.adapter.nominal_claim,
                       time.process_time() - c0, account)
