"""Privacy audit: an empirical lower bound on epsilon from the method's real release code (``cancelfl audit``).

:func:`run_audit` runs releases (:func:`server.audit_release.release`, one round each) until ``trials`` canary
records, then tests them: the statistic per record is Fisher's linear discriminant of its coordinates across the
view's vectors, fitted on one half of the releases and tested on the other
(:func:`protocols.privacy.audit.audit_scores`); the report compares the bound with the run's own claim
(:mod:`server.audit_spec`).  The audit chooses only the model and the data (:mod:`server.audit_canaries`):

* **gradient canaries** (default): a bias-free linear model ``W`` (2 x d) at 0 and per client ``m`` records
  ``x = 10 clip e_k``, each in its own input coordinates; its clipped gradient is exactly ``+-clip v_k``
  (the whole clipping budget, in a direction no other record touches).  Flipping its label (drawn at random per
  record and release) is a replace-one neighbour that moves the full-batch step by the record sensitivity
  ``2 clip lr / n_k``.  Every record is one trial (the noise of every method is independent per coordinate).
  ddpsa (L1 clipping): ``+-clip / 2`` on each of the record's two coordinates.
* **MP family** (mpddp, mpdp-naive, mpcdp): the same records on a one-hidden-layer MLP trained by FedSGD with
  the paper's xi step; the round's secret R scales the noise of every canary of a release alike, so the
  threshold and the bound count one canary per release.
* **adaptive canaries** (ladp's default): the label also moves ladp's KL estimate across its whole
  ``[B / max-boost, B]`` range, and the statistic reads the noise scale as well as the shift.

niss runs its real share phase, ddpsa pushes real shares to ``m`` local intermediate servers (TLS, the derived
simulation roster) started once per audit.  Planted faults for the audit's own tests: :mod:`server.audit_faults`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from protocols.config import RunConfig
from protocols.privacy.audit import audit_scores, fisher_scores
from server.audit_canaries import _AdaptiveCanaries, _Canaries
from server.audit_release import release
from server.audit_spec import ADJACENCY_TEXT, CANARY_SCALE, MP_FAMILY, PURE_DP, AuditReport, AuditSpec

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
    return _Canaries(spec.clients, spec.per_client, CANARY_SCALE * spec.clip, mlp=spec.method in MP_FAMILY,
                     zero_out=spec.adjacency_used == "zero-out")


@contextlib.contextmanager
def _run_config(spec: AuditSpec) -> Iterator[dict]:
    """The releases' run config; for ddpsa with local intermediate servers (started here, stopped on exit).

    The nodes use the derived simulation identities of the run seed, the roster the servers trust.
    """
    raw = spec.run_config()
    if spec.method != "ddpsa":
        yield raw
        return
    from protocols.identity import DerivedRoster
    from server.intermediate.launcher import start_intermediate_servers

    cfg = RunConfig.from_mapping(raw)
    # Every release is a run of its own (a fresh run id): the servers may evict a finished one at once.
    with start_intermediate_servers(cfg.ddpsa_num_servers, DerivedRoster(cfg.seed, cfg.num_clients),
                                    extra_args=["--run-idle-s", "0"]) as cluster:
        yield {**raw, **cluster.run_config()}


def _run_audit(spec: AuditSpec, seed: int | None, progress: Callable[[str], None] | None) -> AuditReport:
    with _run_config(spec) as raw:
        return _audit_releases(spec, raw, seed, progress)


def _audit_releases(spec: AuditSpec, raw: dict, seed: int | None, progress: Callable[[str], None] | None
                    ) -> AuditReport:
    cfg = RunConfig.from_mapping(raw)
    rng = np.random.default_rng(seed)
    canaries = canaries_for(spec)
    releases = math.ceil(spec.trials / spec.audited_per_release())
    t0 = time.perf_counter()
    feats, labels, owners, groups, keep = [], [], [], [], []
    claims: dict[str, float] = {}
    for i in range(releases):
        rel = release(spec, cfg, canaries, rng, raw)
        feats.append(rel.features)
        labels.append(rel.labels)
        owners.append(rel.owner)
        groups.append(np.full(len(rel.labels), i))
        keep.append(rel.audited)
        claims = rel.claims
        if progress is not None and (i + 1) % max(releases // 10, 1) == 0:
            progress(f"{i + 1}/{releases} releases, {time.perf_counter() - t0:.0f} s")
    keep_all = np.concatenate(keep)
    v = np.concatenate(feats)[keep_all]
    lab = np.concatenate(labels)[keep_all]
    own = np.concatenate(owners)[keep_all]
    grp = np.concatenate(groups)[keep_all]
    scores = fisher_scores(v, lab, own, grp % 2 == 0)
    if spec.method in MP_FAMILY:  # one secret R per release scales every canary's noise: one trial per release
        first = np.r_[True, grp[1:] != grp[:-1]]  # the threshold is chosen for the same count (the fit used all)
        scores, lab, grp = scores[first], lab[first], grp[first]
    bound = audit_scores(scores, lab, grp, spec.claim_delta, spec.alpha)
    key = "epsilon_uplink" if spec.direction == "upload" else "epsilon_downlink"
    claimed = float(claims.get(key, math.inf))
    notes = [f"claim: the run's {key} after one round at epsilon={spec.epsilon} (one-round mechanism)"]
    if spec.method == "niss" and spec.direction == "upload":
        notes.append("niss: epsilon_uplink covers the server's best linear combination of all uploads (every sigma_k "
                     "times the round's joint-view scale, protocols.niss_joint; a Gaussian approximation of the "
                     "distorted shares)")
    if spec.method in PURE_DP:
        notes.append("claim: pure epsilon-DP (Laplace); the bound uses delta = 0")
    if spec.canary_kind == "adaptive":
        notes.append("canary: adaptive (a label flip that also moves ladp's KL estimate; statistic: shift and noise scale)")
    if spec.method in MP_FAMILY:
        notes.append("MP family: the release's secret R scales the noise of all its canaries, so the threshold and the "
                     "bound count one canary per release (the others fit the test)")
    return AuditReport(spec.method, spec.direction, spec.canary_kind, spec.colluders, spec.fault, claimed, spec.claim_delta,
                       ADJACENCY_TEXT[spec.adjacency_used], bound, int(keep_all.sum()), releases, time.perf_counter() - t0, notes)
