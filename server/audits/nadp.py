"""NADP-FL's audit adapter: colluding peers, pair-noise faults on the client and the recovery lie on the server.

Faults: ``halve-noise`` (its Gaussian and pairwise stds halved), ``skip-pair-noise`` (one client uploads without
its pair noise), ``strip-pair-noise`` (server side, run by the view: the server tells every neighbour of one client
that it dropped while holding its upload, and removes the revealed pair noise from it; planted with
``self-mask = false``, since with double masking the clients refuse).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import Any

import numpy as np
from flwr.app import Message

from protocols.pairwise import pairwise_noise
from protocols.wire.arrays import from_record
from server.audit_adapter import AuditAdapter, GradientView, ReleaseView, weights_view
from server.audit_faults import HALVE_NOISE, Fault, SelfTest, halved_std, patched
from server.local_grid import LocalGrid

__all__ = ["NadpAudit"]

SKIP_PAIR_NOISE = "skip-pair-noise"
STRIP_PAIR_NOISE = "strip-pair-noise"
#: What the server reads from one upload, per ``nadp-variant`` (the attacks benchmark's note).
_UPLOADS = {
    "nadp": "local model (per-example clipped SGD) + (residual + counteracting pairwise noise)/p_i: gradient + noise/lr",
    "record-ldp": "local model (per-example clipped SGD) + record-level LDP noise: gradient + noise/lr",
}


def _halve_noise(victim: Callable[[], int | None]) -> AbstractContextManager:
    """The Gaussian std halved in :func:`protocols.prg.gaussian` and nadp's own reference, and its pair-noise stds."""
    import client.methods.nadp as nadp_client
    import protocols.prg as prg

    def halved_pairs(orig):
        return lambda *a, scale=1.0, **k: orig(
            *a, scale={j: s / 2 for j, s in scale.items()} if isinstance(scale, dict) else scale / 2, **k)

    return patched((prg, "gaussian", halved_std), (nadp_client, "gaussian", halved_std),
                   (nadp_client, "pairwise_noise", halved_pairs))


def _skip_pair_noise(victim: Callable[[], int | None]) -> AbstractContextManager:
    """The victim client uploads without its pair noise."""
    import client.methods.nadp as nadp_client

    def skipping(orig):
        return lambda own_id, seeds, size, **kw: np.zeros(size) if own_id == victim() else orig(own_id, seeds, size, **kw)

    return patched((nadp_client, "pairwise_noise", skipping))


class NadpAudit(AuditAdapter):
    """Upload view: all uploads (self-masks removed), less the pair noise colluders or the lie reveal."""

    colluders = True
    faults = MappingProxyType({
        HALVE_NOISE: Fault(_halve_noise),
        SKIP_PAIR_NOISE: Fault(_skip_pair_noise, per_client=True),
        STRIP_PAIR_NOISE: Fault(None, per_client=True, run_config=MappingProxyType({"self-mask": False})),
    })
    #: Client faults self-tested on the uploads: every std halved (4 x 500 canaries a release), one client without
    #: its pair noise (its 500 canaries a release are audited).
    self_tests = (SelfTest(HALVE_NOISE, 128_000), SelfTest(SKIP_PAIR_NOISE, 256_000))

    def upload_view(self, rel: ReleaseView):
        spec = rel.spec
        uploads = rel.uploads()
        if spec.fault == STRIP_PAIR_NOISE:
            _strip(rel.strategy, rel.grid, rel.victim, [n for n in uploads if n != rel.victim], uploads, rel.replies)
        elif spec.colluders:
            colluders = rel.colluders()
            held = {c: rel.material_of(c) for c in colluders}
            for target in sorted(set(uploads) - set(colluders)):
                _strip_with(rel.strategy, target, {c: held[c][target] for c in colluders if target in held[c]}, uploads)
        return rel.features_of(uploads)

    def gradient_view(self, cap: Any) -> GradientView:
        """Upload = w_i + (n_i + lambda c_i) / p_i: own and pairwise noise (the pair part cancels only in the sum)."""
        return weights_view(cap, from_record(cap.reply.content["arrays"]), _UPLOADS[cap.cfg.nadp_variant])


def _strip_with(strategy, target: int, seeds: dict[int, bytes], uploads: dict[int, np.ndarray]) -> None:
    """Remove from ``target``'s upload its pair noise with the peers whose seeds the server holds (in place).

    Peer j's own term for the pair is ``lam * pairwise_noise(j, {target: seed}, scale=std_j,target)`` in the
    aggregate (exactly what the strategy's dropout recovery subtracts); the target's term is its negative,
    scaled by ``1 / p_target`` in the upload.
    """
    st = strategy._state
    alloc, lam, p = st.allocation, st.plan.lam, st.weights[target]
    shape = uploads[target].shape
    flat = uploads[target].ravel()
    for j, seed in seeds.items():
        std = alloc.counteracting_stds(j)[target]
        flat += lam * pairwise_noise(j, {target: seed}, flat.size, scale={target: std}) / p
    uploads[target] = flat.reshape(shape)


def _strip(strategy, grid: LocalGrid, target: int, survivors: list[int], uploads: dict[int, np.ndarray],
           replies: list[Message]) -> None:
    """The planted server fault: the real recovery phase run for ``target`` although its upload is held."""
    st = dataclasses.replace(strategy._state, recovery=None)  # the round again, as the lying server tells it
    st.replies = {r.metadata.src_node_id: r for r in replies if r.metadata.src_node_id in survivors}
    st.uploaded, st.dropped = set(survivors), [target]  # the lie: target's upload "never arrived"
    strategy.recover(grid, st)
    rec = strategy.recovered(st)
    seeds = {j: m[target] for j, m in rec.material.items() if target in m and not rec.is_kept(j, target)}
    _strip_with(strategy, target, seeds, uploads)
