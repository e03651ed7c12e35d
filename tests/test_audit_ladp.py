"""ladp's white-box gradient canaries drive its stock client: the noise the client's own plan sets, sound and powerful.

The gradient canaries run :func:`client.methods.ladp.train` on the canaries (record sensitivity from the client's
own record count, :func:`protocols.ladp.plan_public_noise`, the Gaussian draws of
:func:`protocols.ladp.apply_layer_noise`); the audit does not flag the real code in either view and catches the
noise std halved in ladp's release.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols import ladp
from protocols.config import RunConfig
from protocols.privacy import record_sensitivity
from server.audit import canaries_for, quiet, run_audit
from server.audit_release import release
from server.audit_spec import AuditSpec, default_canary, federation


def _noise_std(spec: AuditSpec, releases: int = 4) -> tuple[float, float]:
    """(measured, planned) per-coordinate noise std of client 0's upload on the other clients' canaries.

    Client 0 holds no record on those coordinates, so its upload there is its layer noise alone; the planned std is
    ``c0 Delta_f / epsilon_r`` with ``Delta_f`` from client 0's own record count (round 1: ``P_j = B``).
    """
    cfg = RunConfig.from_mapping(spec.run_config())
    canaries = canaries_for(spec)
    rng = np.random.default_rng(7)
    with quiet():
        rels = [release(spec, cfg, canaries, rng) for _ in range(releases)]
    noise = np.concatenate([r.features[r.owner != 0, 0] for r in rels])
    eps_r = ladp.round_epsilon(cfg.epsilon, cfg.delta, cfg.num_rounds)
    planned = ladp.theorem3_c0_corrected(eps_r, cfg.delta) / eps_r * record_sensitivity(cfg, spec.per_client)
    return float(np.std(noise)), planned


def test_ladp_is_audited_with_gradient_canaries_by_default_and_private_kl_with_adaptive_ones():
    assert default_canary("ladp") == "gradient"
    assert default_canary("ladp", "private-kl") == "adaptive" and default_canary("ladp", "halve-noise") == "gradient"
    assert federation("ladp", "model")["clients"] == 2  # the mean of the fewest uploads: the most power
    assert AuditSpec("ladp", fault="private-kl").adjacency_used == "replace-one"


@pytest.mark.parametrize("per_client", [250, 1_000])
def test_ladp_gradient_release_noise_is_the_clients_own_plan(per_client):
    """The std follows the client's record count N_i (the data-dependent sensitivity), at the floor c0 Delta_f/eps."""
    measured, planned = _noise_std(AuditSpec("ladp", "upload", 4.0, clients=2, per_client=per_client))
    assert measured == pytest.approx(planned, rel=0.08)
    halved, _ = _noise_std(AuditSpec("ladp", "upload", 4.0, clients=2, per_client=per_client, fault="halve-noise"))
    assert halved == pytest.approx(planned / 2, rel=0.08)  # the fault reaches the draws the release really makes


def test_ladp_gradient_canaries_are_not_flagged_in_either_view_and_have_power():
    for direction, trials in (("upload", 120_000), ("model", 240_000)):
        fed = federation("ladp", direction)
        report = run_audit(AuditSpec("ladp", direction, 4.0, trials=trials, clients=fed["clients"],
                                     per_client=fed["per_client"]), seed=3)
        assert report.canary == "gradient" and report.claimed_epsilon == pytest.approx(4.0, rel=1e-6)
        assert not report.violation, report.line()
        assert report.epsilon_lb > 1.0, report.line()  # measured about 2.7 (upload) and 1.7 (model)


def test_ladp_halved_noise_is_caught_by_the_gradient_canaries():
    report = run_audit(AuditSpec("ladp", "upload", 4.0, trials=120_000, clients=2, fault="halve-noise"), seed=5)
    assert report.canary == "gradient" and math.isfinite(report.claimed_epsilon)
    assert report.epsilon_lb > report.claimed_epsilon, report.line()


def test_ladp_adaptive_model_view_neighbours_differ_in_one_record():
    """Only client 0's canary carries the release's secret: the others' records stay at label 0 in every draw."""
    from server.audit_canaries import _AdaptiveCanaries

    canaries = _AdaptiveCanaries(3, 10.0)
    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(40):
        canaries.draw(rng, "model")
        assert not canaries.labels[1:].any() and canaries.signs().shape == (1,)
        for c in (1, 2):
            assert canaries.data(c)[1].tolist() == [0, 0]
        seen.add(int(canaries.labels[0]))
    assert seen == {0, 1}
