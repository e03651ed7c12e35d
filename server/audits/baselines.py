"""The audit adapter of the baselines with DP (ldp, cdp): the default view, their Gaussian std halved as the fault."""

from __future__ import annotations

from types import MappingProxyType

from server.audit_adapter import AuditAdapter
from server.audit_faults import HALVE_GAUSSIAN, HALVE_NOISE

__all__ = ["BaselineAudit"]


class BaselineAudit(AuditAdapter):
    """ldp and cdp: every upload (cdp: un-noised, no uplink claim) and the aggregate, on gradient canaries."""

    faults = MappingProxyType({HALVE_NOISE: HALVE_GAUSSIAN})
