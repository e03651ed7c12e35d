"""DDP-SA's audit adapter: local intermediate servers and the reconstructed sum as the upload view.

Its claim is pure epsilon-DP under basic composition (the bound uses delta = 0) and an (epsilon, delta) claim
under ``ddpsa-composition = "pld"`` or ``ddpsa-noise = "gaussian"`` (Gaussian DP); the audit reads which
from the run's ledger (:func:`server.audit_release.claim_of`).

L1-clipped canaries (``+-clip / 2`` on each of a record's two coordinates); the real shares are pushed to
``ddpsa-num-servers`` local intermediate servers (TLS, the derived simulation roster) started once per audit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import Any

import numpy as np

from protocols.config import RunConfig
from server.audit_adapter import AuditAdapter, GradientView, ReleaseView
from server.audit_faults import HALVE_NOISE, SELF_TEST_TRIALS, Fault, SelfTest, patched
from server.audit_spec import AuditSpec

__all__ = ["DdpsaAudit"]

def _halve_laplace(victim: Callable[[], int | None]) -> AbstractContextManager:
    """The Laplace scale of the local or distributed share (a Gamma difference), or the Gaussian share's std, halved.

    The PRG's normals stay as they are (the Gamma sampler draws from them).
    """
    import client.methods.ddpsa as ddpsa_client

    def halved(orig):
        return lambda size, scale, *a, **k: orig(size, scale / 2, *a, **k)

    return patched((ddpsa_client, "laplace_noise", halved), (ddpsa_client, "distributed_laplace_share", halved),
                   (ddpsa_client, "distributed_gaussian_share", halved))


def _schedule_once() -> AbstractContextManager:
    """Every release's strategy gets the same schedule: computed once (a PLD schedule takes seconds), then copied."""
    import copy
    import functools

    import strategies.ddpsa as ddpsa_strategy

    def memo(orig):
        cached = functools.lru_cache(maxsize=8)(lambda *a, **k: orig(*a, **k))
        return lambda *a, **k: copy.deepcopy(cached(*a, **k))

    return patched((ddpsa_strategy, "per_round_epsilons", memo))


class DdpsaAudit(AuditAdapter):
    """The parameter server reconstructs only the sum: its upload view is the published aggregate."""

    faults = MappingProxyType({HALVE_NOISE: Fault(_halve_laplace)})
    self_tests = (SelfTest(HALVE_NOISE, SELF_TEST_TRIALS),)
    #: The first of 100 rounds calibrated by their privacy-loss distribution: its ledger claims a little less than
    #: the round's Laplace epsilon, at delta (not a pure claim).
    #: Gaussian noise (cdp's calibration, composed as Gaussian DP): claimed at delta, with the default trials (the
    #: power check of a Gaussian row).
    variants = (("pld, 100 rounds", 100, MappingProxyType({"ddpsa-composition": "pld"}), SELF_TEST_TRIALS),
                ("gaussian", 1, MappingProxyType({"ddpsa-noise": "gaussian"}), None))

    def run_config(self, spec: AuditSpec) -> dict[str, Any]:
        """The server's plain SGD step (lr) with the reconstructed sum: a linear release."""
        return {"server-optimizer": "sgd"}

    @contextlib.contextmanager
    def services(self, spec: AuditSpec, raw: dict) -> Iterator[dict]:
        """Local intermediate servers for the audit's duration; the nodes trust the run seed's derived roster."""
        from protocols.identity import DerivedRoster
        from server.intermediate.launcher import start_intermediate_servers

        cfg = RunConfig.from_mapping(raw)
        # Every release is a run of its own (a fresh run id): the servers may evict a finished one at once.
        with start_intermediate_servers(cfg.ddpsa_num_servers, DerivedRoster(cfg.seed, cfg.num_clients),
                                        extra_args=["--run-idle-s", "0"]) as cluster, _schedule_once():
            yield {**raw, **cluster.run_config()}

    def upload_view(self, rel: ReleaseView) -> np.ndarray:
        return self.model_view(rel)

    def gradient_view(self, cap: Any) -> GradientView:
        """Alone the server sees nothing of one client; colluding with all m intermediate servers, its noisy gradient.

        The uniform Z_2^64 shares sit on the intermediate servers and the reply carries metrics only.  The worst
        case reconstructs the client's L1-clipped gradient sum + Laplace noise (FedSGD): the vector
        :meth:`uplink_side_channel` recorded under the roster name of the victim's share receipt.
        """
        from protocols.arrays import unflatten
        from protocols.wire.arrays import from_record
        from protocols.wire.ddpsa import ShareReceipt

        pushed = (cap.side or {}).get(ShareReceipt.client_of(cap.reply.content))
        if pushed is None:
            return GradientView(None, "nothing: secret shares on the intermediate servers (share vector not captured)")
        return GradientView(unflatten(pushed, from_record(cap.sent.content["arrays"])),
                            "alone: nothing (uniform shares); colluding with all m intermediate servers: "
                            "clipped gradient + Laplace (L1) or Gaussian (L2) noise share (attacked here)")

    @contextlib.contextmanager
    def uplink_side_channel(self, store: dict[str, np.ndarray]) -> Iterator[None]:
        """Record the vector each client secret-shares to the intermediate servers, by its roster name.

        The vector handed to ``share_and_push`` is exactly what all m intermediate servers together reconstruct
        for this client (the worst case: the server colludes with every one of them).
        """
        import client.methods.ddpsa as ddpsa_client

        original = ddpsa_client.share_and_push

        def recording(vector, codec, servers, run_id, rnd, signer, *args, **kwargs):
            store[signer.name] = np.array(vector, dtype=np.float64, copy=True)
            return original(vector, codec, servers, run_id, rnd, signer, *args, **kwargs)

        ddpsa_client.share_and_push = recording
        try:
            yield
        finally:
            ddpsa_client.share_and_push = original
