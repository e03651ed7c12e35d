"""``cancelfl-bench audit``: a row above its claim is a violation only when a fresh audit confirms it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import benchmarks.audit as bench
from server.audit_spec import AuditSpec


def _report(lb: float, claimed: float = 1.0) -> SimpleNamespace:
    bound = SimpleNamespace(epsilon_lb=lb, epsilon_ub=lb + 1, epsilon_point=lb + 0.5, trials=1000,
                            true_positives=10, false_positives=2)
    return SimpleNamespace(bound=bound, claimed_epsilon=claimed, exceeds_claim=lb > claimed, violation=lb > claimed,
                           covered=True, claim_view="uploads", delta=1e-5, canary="gradient", seconds=1.0,
                           cpu_seconds=1.0, line=lambda: f"lb {lb}", as_dict=lambda: {"lb": lb})


@pytest.mark.parametrize(("bounds", "verdict", "audits"), [
    ((0.7,), "ok", 1),
    ((1.2, 0.8), "ok", 2),
    ((1.2, 1.3), "VIOLATION", 2),
])
def test_a_bound_above_the_claim_is_audited_again_before_it_is_a_violation(monkeypatch, bounds, verdict, audits):
    calls = []

    def fake(spec, seed=None):
        calls.append(seed)
        return _report(bounds[len(calls) - 1])

    monkeypatch.setattr(bench, "run_audit", fake)
    row = bench._row(AuditSpec("cdp", "model", 1.0, 1000), seed=7)
    assert row["verdict"] == verdict and len(calls) == audits
    assert calls == [7, 8][:audits]  # the confirmation draws fresh labels
    assert row["confirmed_lb"] == (bounds[1] if audits == 2 else None)


def test_a_planted_fault_is_judged_on_one_audit(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run_audit", lambda spec, seed=None: calls.append(seed) or _report(2.0))
    row = bench._row(AuditSpec("cdp", "model", 1.0, 1000, fault="halve-noise"), seed=None)
    assert row["verdict"] == "fault caught" and len(calls) == 1
