"""The MP family's audit adapter (mpddp, mpdp-naive, mpcdp): an MLP canary and the server's recovery with R.

FedSGD on :func:`server.audit_canaries.canary_mlp` with the paper's xi step (SGD), so the model is linear in the
release.  The round's secret R scales the noise of every canary of a release alike: the threshold and the bound
count one canary per release.  Upload view: each upload recovered alone with R (Eq. 22), as the server can.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np

from server.audit_adapter import AuditAdapter, ReleaseView
from server.audit_canaries import MLP_HIDDEN
from server.audit_faults import HALVE_GAUSSIAN, HALVE_NOISE
from server.audit_spec import AuditSpec

__all__ = ["MpAudit", "MpddpAudit"]


class MpAudit(AuditAdapter):
    """mpdp-naive and mpcdp: their Gaussian std halved is the planted fault."""

    mlp_canaries = True
    one_trial_per_release = True
    faults = MappingProxyType({HALVE_NOISE: HALVE_GAUSSIAN})

    def federation(self, direction: str, canary: str) -> dict[str, int]:
        if canary == "adaptive":
            return super().federation(direction, canary)
        return {"trials": 12_000, "clients": 3, "per_client": 10}

    def run_config(self, spec: AuditSpec) -> dict[str, Any]:
        """FedSGD on the canary MLP with the paper's xi step (SGD), float64 sides, no self-mask.

        Self-mask off: the server removes the self-mask of every upload it holds, so its view is the same
        without it, and the recovery reads the uploads as they stand.
        """
        return {"hidden": str(MLP_HIDDEN), "server-optimizer": "sgd", "mpddp-server-lr": spec.lr,
                "mpddp-side-dtype": "float64", "self-mask": False}

    def notes(self, spec: AuditSpec) -> list[str]:
        return ["MP family: the release's secret R scales the noise of all its canaries, so the threshold and the "
                "bound count one canary per release (the others fit the test)"]

    def upload_view(self, rel: ReleaseView) -> np.ndarray:
        """Every upload recovered alone with the round's secret R (the server holds both), in partition order.

        Eq. (22) on one client's gradient, Psi and Phi gives that client's true-space gradient plus ``R o`` its
        noise (mpddp: eta and its uncancelled Delta's).
        """
        from protocols.mpddp import recover
        from protocols.wire.mpddp import mean_upload

        st = rel.strategy._state
        out = []
        for r in sorted(rel.replies, key=lambda r: rel.part[r.metadata.src_node_id]):
            up = mean_upload([(r.metadata.src_node_id, r.content["arrays"])], len(st.layers))
            out.append({f"layers.{i}.weight": w.numpy() for i, (w, _) in enumerate(recover(up, st.secret))})
        return rel.canaries.features(out)


class MpddpAudit(MpAudit):
    """mpddp: no planted fault (its noise is the clients' pairwise-cancelled share)."""

    faults = MappingProxyType({})
