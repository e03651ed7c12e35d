"""The MP family's model claim given the server's secret R: the clip's bound, the audit's soundness and a planted fault.

Given R, a record moves the R-divided release by its weighted ``g^_b - r^T Psi_b + v Phi_b`` (Theorem 1, Eq. 22);
the clients clip ``||g^_b|| + rho ||Psi_b|| + rho^2 ||Phi_b||`` and the server's noise covers ``kappa`` times the
record sensitivity (:mod:`protocols.mpddp.calibration`).
"""

from __future__ import annotations

import os

import pytest
import torch

from protocols.mpddp import (
    clipped_client_gradients,
    mask_reference,
    mp_server,
    one_hot,
    output_scale,
    recover_blocks,
    secret_factor,
)
from protocols.task.models import MLP, get_weights
from server.audit import run_audit
from server.audit_canaries import canary_mlp
from server.audit_spec import AuditSpec
from strategies.mpddp import layers_from_weights


def _moves(layers, x, clip: float, draws: int, *, with_rho: bool) -> list[float]:
    """Per secret: the largest R-divided move of one record's clipped upload over kappa clip (the record's own batch)."""
    out = []
    for _ in range(draws):
        w_hat, secret = mp_server(layers, os.urandom(32), additive_scale=output_scale(layers))
        rho = mask_reference(w_hat[-1].numpy())
        kappa = secret_factor(float(secret.r_vec.norm()), rho)
        worst = 0.0
        for b in range(len(x)):
            y = one_hot(torch.tensor([b % layers[-1][0].shape[0]]), layers[-1][0].shape[0], torch.float64)
            up, _ = clipped_client_gradients(w_hat, x[b:b + 1], y, clip, rho=rho if with_rho else None)
            moved = torch.cat([(g / r).reshape(-1) for g, r in zip(recover_blocks(up, secret), secret.trainable_R(),
                                                                    strict=True)])
            worst = max(worst, float(moved.norm()) / (kappa * clip))
        out.append(worst)
    return out


def test_the_clip_bounds_a_record_given_r_and_the_perturbed_clip_alone_does_not():
    """Given R, one record moves the R-divided release by at most kappa clip with rho; without rho, up to ~10x more."""
    torch.manual_seed(0)
    canary = layers_from_weights(get_weights(canary_mlp(8)))
    x = torch.zeros(1, 8, dtype=torch.float64)
    x[0, 0] = 10.0
    assert max(_moves(canary, x, 1.0, 300, with_rho=True)) <= 1.0 + 1e-9
    assert max(_moves(canary, x, 1.0, 300, with_rho=False)) > 1.5  # the old calibration: no bound given R
    mlp = layers_from_weights(get_weights(MLP(6, [5, 4], 3).double()))
    records = torch.randn(12, 6, dtype=torch.float64) * 3.0
    assert max(_moves(mlp, records, 0.5, 40, with_rho=True)) <= 1.0 + 1e-9


@pytest.mark.parametrize("method", ["mpcdp", "mpddp"])
def test_model_view_given_r_is_sound_and_catches_the_perturbed_clip(method):
    """The white-box audit given R: the real code stays within its claim; the old calibration is flagged."""
    honest = run_audit(AuditSpec(method, "model", 4.0, trials=16_000), seed=3)
    assert not honest.violation and honest.epsilon_lb <= honest.claimed_epsilon, honest.line()
    assert honest.bound.trials > honest.releases  # every canary of a release counts given R
    faulty = run_audit(AuditSpec(method, "model", 4.0, trials=16_000, fault="perturbed-clip"), seed=3)
    assert faulty.violation and faulty.epsilon_lb > faulty.claimed_epsilon, faulty.line()
