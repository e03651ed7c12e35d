"""DDP-SA's audit adapter: local intermediate servers, the reconstructed sum as the upload view, pure epsilon-DP.

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
from server.audit_adapter import AuditAdapter, ReleaseView
from server.audit_faults import HALVE_NOISE, SELF_TEST_TRIALS, Fault, patched
from server.audit_spec import AuditSpec

__all__ = ["DdpsaAudit"]

def _halve_laplace(victim: Callable[[], int | None]) -> AbstractContextManager:
    """The Laplace scale of the local noise or of the distributed share (a Gamma difference) halved.

    The PRG's normals stay as they are (the Gamma sampler draws from them).
    """
    import client.methods.ddpsa as ddpsa_client

    def halved(orig):
        return lambda size, scale, *a, **k: orig(size, scale / 2, *a, **k)

    return patched((ddpsa_client, "laplace_noise", halved), (ddpsa_client, "distributed_laplace_share", halved))


class DdpsaAudit(AuditAdapter):
    """The parameter server reconstructs only the sum: its upload view is the published aggregate."""

    pure_dp = True
    faults = MappingProxyType({HALVE_NOISE: Fault(_halve_laplace)})
    self_tests = ((HALVE_NOISE, SELF_TEST_TRIALS),)

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
                                        extra_args=["--run-idle-s", "0"]) as cluster:
            yield {**raw, **cluster.run_config()}

    def upload_view(self, rel: ReleaseView) -> np.ndarray:
        return self.model_view(rel)

    def notes(self, spec: AuditSpec) -> list[str]:
        return ["claim: pure epsilon-DP (Laplace); the bound uses delta = 0"]
