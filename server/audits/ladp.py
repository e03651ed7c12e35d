"""LaDP-FL's audit adapter: adaptive canaries by default (its noise scale is data-dependent) and ``private-kl``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import Any

from protocols.wire.arrays import from_record
from server.audit_adapter import AuditAdapter, GradientView, weights_view
from server.audit_faults import HALVE_GAUSSIAN, HALVE_NOISE, Fault, patched
from server.audit_spec import AuditSpec

__all__ = ["LadpAudit"]

PRIVATE_KL = "private-kl"


def _private_kl(victim: Callable[[], int | None]) -> AbstractContextManager:
    """P_j from the client's trained local model (the paper's Algorithm 3), not the server's public estimate."""
    import client.methods.ladp as ladp_client
    from protocols.ladp import softmax_kl

    return patched((ladp_client, "privacy_estimates", lambda orig: lambda msg, local_w, global_w: {
        name: softmax_kl(local_w[name], global_w[name]) for name in local_w}))


class LadpAudit(AuditAdapter):
    """Adaptive canaries move the layer's KL estimate across ``[B / ladp-max-boost, B]`` (replace-one)."""

    canaries = ("adaptive", "gradient")
    faults = MappingProxyType({HALVE_NOISE: HALVE_GAUSSIAN, PRIVATE_KL: Fault(_private_kl)})
    self_tests = ((PRIVATE_KL, None),)

    def notes(self, spec: AuditSpec) -> list[str]:
        if spec.canary_kind != "adaptive":
            return []
        return ["canary: adaptive (a label flip that also moves ladp's KL estimate; statistic: shift and noise scale)"]

    def gradient_view(self, cap: Any) -> GradientView:
        """Layers above the norm threshold carry Gaussian noise, the others are exact."""
        return weights_view(cap, from_record(cap.reply.content["arrays"]),
                            "local model with layer-wise Gaussian noise (un-noised layers exact): gradient + noise/lr")
