"""NISS's audit adapter: its real share phase; heavier-tailed noise (distorted shares) needs more trials."""

from __future__ import annotations

from types import MappingProxyType

from server.audit_adapter import AuditAdapter
from server.audit_faults import HALVE_GAUSSIAN, HALVE_NOISE, SELF_TEST_TRIALS
from server.audit_spec import AuditSpec

__all__ = ["NissAudit"]

class NissAudit(AuditAdapter):
    """Upload view: all uploads together (self-masks removed); ``halve-noise`` halves every share and distortion."""

    faults = MappingProxyType({HALVE_NOISE: HALVE_GAUSSIAN})
    self_tests = ((HALVE_NOISE, SELF_TEST_TRIALS),)

    def federation(self, direction: str, canary: str) -> dict[str, int]:
        fed = super().federation(direction, canary)
        return {**fed, "trials": 600_000} if canary == "gradient" else fed

    def notes(self, spec: AuditSpec) -> list[str]:
        if spec.direction != "upload":
            return []
        return ["niss: epsilon_uplink covers the server's best linear combination of all uploads (every sigma_k "
                "times the round's joint-view scale, protocols.niss_joint; a Gaussian approximation of the "
                "distorted shares)"]
