"""LaDP-FL's audit adapter: white-box gradient canaries (default), adaptive canaries, ``halve-noise`` and ``private-kl``.

Both canaries run ladp's stock client (:func:`client.methods.ladp.train`): per-example-clipped training on the
canaries, ``Delta_f`` from the client's own record count, the layer-wise plan of :func:`protocols.ladp.plan_public_noise`
(selection on the received model, ``P_j`` from the server's public estimates, ``B`` in round 1) and the Gaussian
draws of :func:`protocols.ladp.apply_layer_noise`.  Every gradient canary has its own coordinate of the one noised
layer, so one release's single draw per client gives ``clients x per_client`` independent trials.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import Any

from protocols.wire.arrays import from_record
from server.audit_adapter import AuditAdapter, GradientView, weights_view
from server.audit_faults import HALVE_GAUSSIAN, HALVE_NOISE, Fault, SelfTest, patched
from server.audit_spec import AuditSpec

__all__ = ["LadpAudit"]

PRIVATE_KL = "private-kl"

#: Gradient canaries per audit: the upload view reads all 4 uploads; the model view averages the fewest clients
#: (2: each client's noise enters the example-weighted mean with the same std, so the mean's multiplier is
#: ``z sqrt(clients)`` while the claim is the upload's).  About 15 s and 50 s of CPU on this machine.
_GRADIENT = {"upload": {"trials": 600_000, "clients": 4, "per_client": 500},
             "model": {"trials": 2_400_000, "clients": 2, "per_client": 1_000}}
#: Adaptive canaries: one trial per client upload (16 per release), one per release for the model (2 clients).
_ADAPTIVE = {"upload": {"trials": 9_600, "clients": 16, "per_client": 2},
             "model": {"trials": 3_200, "clients": 2, "per_client": 2}}


def _private_kl(victim: Callable[[], int | None]) -> AbstractContextManager:
    """P_j from the client's trained local model (the paper's Algorithm 3), not the server's public estimate."""
    import client.methods.ladp as ladp_client
    from protocols.ladp import softmax_kl

    return patched((ladp_client, "privacy_estimates", lambda orig: lambda msg, local_w, global_w: {
        name: softmax_kl(local_w[name], global_w[name]) for name in local_w}))


class LadpAudit(AuditAdapter):
    """Gradient canaries test the floor noise; adaptive ones move the layer's KL estimate across ``[B / max-boost, B]``.

    ``private-kl`` (a data-dependent noise scale) is audited with the adaptive canaries, ``halve-noise`` with the
    gradient canaries.
    """

    canaries = ("gradient", "adaptive")
    faults = MappingProxyType({HALVE_NOISE: HALVE_GAUSSIAN, PRIVATE_KL: Fault(_private_kl)})
    fault_canaries = MappingProxyType({PRIVATE_KL: "adaptive"})
    #: halve-noise: 32 upload releases of 2,000 canaries (16,000 trials leave it at about the claim).
    self_tests = (SelfTest(PRIVATE_KL, 3_200), SelfTest(HALVE_NOISE, 64_000))

    def federation(self, direction: str, canary: str, *, given_secret: bool = False) -> dict[str, int]:
        """Gradient canaries: 4 clients x 500 (upload), 2 x 1,000 (model); adaptive: 16 clients, 2 (model)."""
        return dict((_ADAPTIVE if canary == "adaptive" else _GRADIENT)[direction])

    def notes(self, spec: AuditSpec) -> list[str]:
        if spec.canary_kind == "adaptive":
            return ["canary: adaptive (a label flip that also moves ladp's KL estimate; statistic: shift and noise "
                    "scale)"]
        if spec.direction == "model":
            return [f"model view: the example-weighted mean of {spec.clients} uploads (noise multiplier z sqrt("
                    f"{spec.clients})); the claim is the upload's epsilon (post-processing)"]
        return []

    def gradient_view(self, cap: Any) -> GradientView:
        """Layers above the norm threshold carry Gaussian noise, the others are exact."""
        return weights_view(cap, from_record(cap.reply.content["arrays"]),
                            "local model with layer-wise Gaussian noise (un-noised layers exact): gradient + noise/lr")
