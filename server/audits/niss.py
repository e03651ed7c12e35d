"""NISS's audit adapter: its real share phase, colluding neighbours; heavier-tailed noise needs more trials.

``--colluders K``: K clients hand the server the round's pair material they hold with every audited client (their
:class:`client.recovery.RecoveryStore`, what a dropout would reveal): their own shares sent to it, the shares it
sent them and their distorted negations of those.  The view is every upload plus those vectors, read together by
the audit's linear discriminant (which subtracts whatever combination of them helps).  The claim covers up to
``floor(niss-rho x neighbours)`` colluding neighbours (Theorem 3's tau); more are outside it.  Without colluders
the row is checked against the run's second upload figure, the view with no colluding neighbour
(``epsilon_uplink_no_colluder``, :meth:`protocols.floor.NissFloor.open_multipliers`).
"""

from __future__ import annotations

from collections import OrderedDict
from types import MappingProxyType
from typing import Any

import numpy as np

from protocols.config import RunConfig
from protocols.methods import NO_COLLUDER
from protocols.niss import ShareBundle, bundle_shares, distorted_contribution
from protocols.niss_joint import colluder_count
from protocols.wire.arrays import from_record
from protocols.wire.niss import NissMetrics, RelayedInbox
from protocols.wire.recovery import NissPairMaterial
from server.audit_adapter import AuditAdapter, GradientView, ReleaseView, weights_view
from server.audit_faults import HALVE_GAUSSIAN, HALVE_NOISE, SELF_TEST_TRIALS, SelfTest
from server.audit_spec import AuditSpec

__all__ = ["NissAudit"]


class NissAudit(AuditAdapter):
    """Upload view: all uploads together (self-masks removed); ``halve-noise`` halves every share and distortion."""

    colluders = True
    faults = MappingProxyType({HALVE_NOISE: HALVE_GAUSSIAN})
    self_tests = (SelfTest(HALVE_NOISE, SELF_TEST_TRIALS),)

    def federation(self, direction: str, canary: str, *, given_secret: bool = False) -> dict[str, int]:
        fed = super().federation(direction, canary)
        return {**fed, "trials": 800_000, "per_client": 1_000} if canary == "gradient" else fed

    def claim_account(self, spec: AuditSpec) -> str:
        """Uploads with no colluder: the run's figure for that view (:data:`protocols.methods.NO_COLLUDER`).

        With colluders (any number up to ``floor(niss-rho x m)`` and beyond) the claim, which covers the worst
        ``floor(niss-rho x m)`` of them.
        """
        if spec.direction == "upload" and spec.colluders == 0:
            return NO_COLLUDER
        return super().claim_account(spec)

    def tolerated_colluders(self, spec: AuditSpec) -> int:
        """``floor(niss-rho x m)`` of a client's m neighbours (complete graph: the other participants)."""
        cfg = RunConfig.from_mapping(spec.run_config())
        return colluder_count(cfg.niss_rho, spec.clients - 1)

    def upload_view(self, rel: ReleaseView) -> np.ndarray:
        uploads = rel.uploads()
        feats = rel.features_of(uploads)
        if not rel.spec.colluders:
            return feats
        shape = next(iter(uploads.values())).shape
        revealed = [v.reshape(shape) for v in _revealed(rel, int(np.prod(shape)))]
        return np.concatenate([feats, rel.canaries.features([{"linear.weight": v} for v in revealed])], axis=1)

    def notes(self, spec: AuditSpec) -> list[str]:
        if spec.direction != "upload":
            return []
        out = ["niss: epsilon_uplink covers the server's best linear combination of all uploads and the material "
               "of up to floor(niss-rho x neighbours) colluders (every sigma_k times the round's joint-view scale, "
               "protocols.niss_joint; a Gaussian approximation of the distorted shares); epsilon_uplink_no_colluder "
               "the same view with no colluding neighbour (the claim of a row without colluders)"]
        if spec.colluders:
            out.append(f"colluders: {spec.colluders} neighbours hand the server their pair material with every "
                       f"audited client; the claim covers {self.tolerated_colluders(spec)} (niss-rho)")
        return out

    def gradient_view(self, cap: Any) -> GradientView:
        """Upload = p w_k + own shares + distorted negated shares; the server knows p and divides by it."""
        p = RelayedInbox.from_config(cap.sent.content["config"]).weight
        up = OrderedDict((k, v / p) for k, v in from_record(cap.reply.content["arrays"]).items())
        return weights_view(cap, up, "p*w_k + own noise shares + distorted received shares; divided by the public p")


def _revealed(rel: ReleaseView, size: int) -> list[np.ndarray]:
    """Per colluder c and audited neighbour t: ``n_{c->t}``, c's distorted ``-n_{t->c}``, and ``n_{t->c}`` (seed encoding).

    The first sits (distorted by t) in t's upload, the second in c's, the third in t's; t's own distortion of
    ``n_{c->t}`` stays secret.
    """
    taus = {r.metadata.src_node_id: NissMetrics.from_metrics(r.content["metrics"]).tau for r in rel.replies}
    colluders = rel.colluders()
    out = []
    for c in colluders:
        held = rel.material_of(c)
        for t in sorted(set(rel.part) - set(colluders)):
            if t not in held:
                continue  # not neighbours this round
            m = NissPairMaterial.from_bytes(held[t], size)
            own = (bundle_shares(ShareBundle(c, t, m.out_count, m.out_std, m.out_seed), size).sum(axis=0)
                   if m.out_seed is not None else np.zeros(size))
            out.append(own)
            if m.in_seed is not None:
                theirs = bundle_shares(ShareBundle(t, c, m.in_count, m.in_std, m.in_seed), size)
                out.append(theirs.sum(axis=0))
                out.append(-theirs.sum(axis=0) if m.in_dseed is None
                           else distorted_contribution(-theirs, taus[c], m.in_dseed))
            elif m.in_vector is not None:
                out.append(m.in_vector)
    return out
