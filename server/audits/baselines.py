"""The audit adapters of the baselines with DP (ldp, cdp): the default view, their Gaussian std halved as the fault.

``halve-noise`` halves the std where the real code draws it (:data:`server.audit_faults.HALVE_GAUSSIAN`): ldp's
clients (:func:`client.methods.baselines.train_ldp`), cdp's server (the strategy's aggregation); each is
self-tested in the view whose claim it breaks (ldp: the uploads; cdp: the published model, its uploads claim
nothing).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from protocols.wire.arrays import from_record
from server.audit_adapter import AuditAdapter, GradientView, weights_view
from server.audit_faults import HALVE_GAUSSIAN, HALVE_NOISE, SelfTest

__all__ = ["BaselineAudit", "CdpAudit", "LdpAudit"]

#: What the server reads from one upload after one SGD step, per method (the attacks benchmark's note).
_UPLOADS = {"ldp": "noisy local model (Gaussian, std z*clip per coordinate): gradient + noise/lr",
            "cdp": "clipped local model, noise only added by the server to the mean: exact (clipped) gradient"}


class BaselineAudit(AuditAdapter):
    """ldp and cdp: every upload (cdp: un-noised, no uplink claim) and the aggregate, on gradient canaries."""

    faults = MappingProxyType({HALVE_NOISE: HALVE_GAUSSIAN})

    def gradient_view(self, cap: Any) -> GradientView:
        """ldp: upload = w + clip(update) + N(0, (z clip)^2), gradient + noise/lr; cdp: the clipped local model."""
        return weights_view(cap, from_record(cap.reply.content["arrays"]), _UPLOADS[cap.cfg.method])


class LdpAudit(BaselineAudit):
    """ldp: ``halve-noise`` (the clients' Gaussian) self-tested on the uploads (4 x 500 canaries per release)."""

    self_tests = (SelfTest(HALVE_NOISE, 400_000),)


class CdpAudit(BaselineAudit):
    """cdp: ``halve-noise`` (the server's Gaussian on the mean) self-tested on the published model."""

    self_tests = (SelfTest(HALVE_NOISE, 400_000, "model"),)
