"""Auditing is part of a method's unit: a method added from a test module brings its own audit adapter.

``gldp`` (:mod:`tests.test_method_unit`, a Gaussian local-DP method) is registered here with
``MethodSpec.audit`` naming :class:`GldpAudit`, defined in this module: its federation and its planted fault
(a client that skips its noise).  ``cancelfl audit`` then audits it on its real strategy and client handler;
a method whose card names no adapter is refused as not auditable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import MappingProxyType

import numpy as np
import pytest

from protocols.config import ConfigError
from protocols.methods import register
from server.audit import run_audit
from server.audit_adapter import AuditAdapter
from server.audit_faults import Fault, patched
from server.audit_spec import AuditSpec, faults
from server.launch import main
from tests.test_method_unit import GLDP


def _skip_noise(victim: Callable[[], int | None]) -> AbstractContextManager:
    """The clients of gldp upload without noise (they draw it from :func:`protocols.prg.gaussian` at release)."""
    import protocols.prg as prg

    return patched((prg, "gaussian", lambda orig: lambda seed, size, std=1.0, *a, **k: np.zeros(size)))


class GldpAudit(AuditAdapter):
    """gldp's audit: the default view of every noised upload, a small federation, and its own planted fault."""

    faults = MappingProxyType({"skip-noise": Fault(_skip_noise)})

    def federation(self, direction: str, canary: str) -> dict[str, int]:
        return {"trials": 400, "clients": 2, "per_client": 50}


AUDITED = dataclasses.replace(GLDP, audit=GldpAudit)
SPEC = AuditSpec("gldp", "upload", 1.0, trials=400, clients=2, per_client=50)


def test_a_method_registered_from_a_test_module_is_audited_by_its_own_adapter(capsys):
    with register(AUDITED):
        honest = run_audit(SPEC, seed=3)
        faulty = run_audit(dataclasses.replace(SPEC, fault="skip-noise"), seed=3)
        with pytest.raises(ConfigError, match="planted in: gldp"):  # its fault is its own
            AuditSpec("ldp", fault="skip-noise").validate()
        # The CLI knows it: its fault is accepted, its federation the default; the fault is flagged (exit 1).
        # (2,000 canaries: 20 releases, the statistic fitted on 5; on 4 releases a fit on one could miss every hit)
        assert main(["audit", "--method", "gldp", "--epsilon", "1", "--fault", "skip-noise", "--trials", "2000"]) == 1
        assert "VIOLATION" in capsys.readouterr().out
    # Twice ldp's noise: the claim is finite and below the run's epsilon, and the honest release is not flagged.
    assert math.isfinite(honest.claimed_epsilon) and honest.claimed_epsilon < SPEC.epsilon
    assert honest.trials >= SPEC.trials and not honest.violation, honest.line()
    # Un-noised uploads separate the neighbours: far more privacy loss than claimed.
    assert faulty.bound.false_positives == 0 and faulty.epsilon_lb > faulty.claimed_epsilon + 1, faulty.line()
    with register(AUDITED):  # whatever the canaries (seeds whose noise-free scores were all one value)
        for seed in (0, 53, 80):
            caught = run_audit(dataclasses.replace(SPEC, fault="skip-noise", trials=2000), seed=seed)
            assert caught.violation, caught.line()
    assert "skip-noise" not in faults()  # unregistered with its method
    with pytest.raises(ConfigError, match="unknown method 'gldp'"):
        SPEC.validate()


def test_a_method_without_an_adapter_is_refused_as_not_auditable(capsys):
    with register(GLDP):
        with pytest.raises(ConfigError, match="'gldp' is not auditable"):
            SPEC.validate()
        assert main(["audit", "--method", "gldp"]) == 2
    assert "not auditable" in capsys.readouterr().err
    assert main(["audit", "--method", "fedavg"]) == 2
    assert "'fedavg' is not auditable" in capsys.readouterr().err
