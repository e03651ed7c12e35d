"""The audit's self-tests: every noising method plants a fault in its real release code, and the audit flags it.

Each built-in method names its self-test rows (:attr:`server.audit_adapter.AuditAdapter.self_tests`); the rows
added for nadp, ldp, cdp and the MP family are run here at small trial counts (canary labels seeded) beside the
same release without the fault, which stays within its claim.  The MP family's ``halve-noise`` reaches the draws
its clients really make (eta_k, the Delta's) and leaves the server's secret R as it is.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from server.audit import run_audit
from server.audit_spec import DIRECTIONS, AuditSpec, audit_adapter, auditable_methods, default_direction, federation


def test_every_auditable_method_self_tests_a_planted_fault_in_the_view_it_breaks():
    for method in auditable_methods():
        adapter = audit_adapter(method)
        assert adapter.self_tests, f"{method}: no planted-fault self-test row"
        for t in adapter.self_tests:
            assert t.fault in adapter.faults and t.view in DIRECTIONS, (method, t)
    # The uploads of cdp and of the MP family claim nothing: their noise faults are audited on the model.
    for method in ("cdp", "mpddp", "mpdp-naive", "mpcdp"):
        assert default_direction(method, "halve-noise") == "model"
    assert default_direction("ldp", "halve-noise") == default_direction("nadp", "skip-pair-noise") == "upload"


#: (method, fault, trials): the new self-test rows at epsilon 4, on each method's own federation.
ROWS = [("ldp", "halve-noise", 64_000), ("cdp", "halve-noise", 64_000), ("nadp", "halve-noise", 64_000),
        ("nadp", "skip-pair-noise", 128_000), ("mpddp", "halve-noise", 256_000)]


@pytest.mark.parametrize(("method", "fault", "trials"), ROWS)
def test_a_planted_fault_is_caught_and_the_same_release_without_it_is_not(method, fault, trials):
    direction = default_direction(method, fault)
    fed = federation(method, direction, fault=fault)
    spec = AuditSpec(method, direction, 4.0, trials, fault=fault, clients=fed["clients"], per_client=fed["per_client"])
    faulty = run_audit(spec, seed=5)
    assert faulty.exceeds_claim and faulty.violation, faulty.line()
    honest = run_audit(AuditSpec(method, direction, 4.0, trials, clients=fed["clients"], per_client=fed["per_client"]),
                       seed=5)
    assert not honest.exceeds_claim and honest.claimed_epsilon == pytest.approx(faulty.claimed_epsilon), honest.line()


def test_mp_halve_noise_halves_the_clients_eta_and_deltas_and_leaves_the_secret_alone():
    """The fault acts where the client draws its noise (:func:`protocols.mpddp.ddp_client`), not on R's draw."""
    from protocols.mpddp import ClientUpload, ddp_client, mp_server, output_scale
    from protocols.task.models import get_weights
    from server.audit_canaries import canary_mlp
    from strategies.mpddp import layers_from_weights

    size = 40_000
    zeros = torch.zeros(1, size, dtype=torch.float64)
    upload = ClientUpload((zeros,), (zeros.unsqueeze(0),), (zeros,))
    layers = layers_from_weights(get_weights(canary_mlp(8)))
    seed = os.urandom(32)

    def draws() -> tuple[float, float, torch.Tensor]:
        eta, _ = ddp_client(upload, own_id=1, pair_seeds={}, eta_seed=os.urandom(32), sigma_eta=1.0, sigma_delta=0.0,
                            eta="gaussian")
        _, delta = ddp_client(upload, own_id=1, pair_seeds={2: os.urandom(32)}, eta_seed=os.urandom(32),
                              sigma_eta=0.0, sigma_delta=1.0)
        w_hat, _ = mp_server(layers, seed, additive_scale=output_scale(layers))
        return float(eta.grads[0].std()), float(np.std(delta)), torch.cat([w.reshape(-1) for w in w_hat])

    eta, delta, w_hat = draws()
    with audit_adapter("mpddp").faults["halve-noise"].plant(lambda: None):
        eta_f, delta_f, w_hat_f = draws()
    assert eta_f == pytest.approx(eta / 2, rel=0.05) and delta_f == pytest.approx(delta / 2, rel=0.05)
    assert torch.equal(w_hat, w_hat_f)  # the secret R and W-hat: the same draw from the same seed


def test_cancelfl_audit_with_a_fault_uses_its_self_tests_trials():
    """``cancelfl audit --fault F`` audits with the canaries its self-test row is known to catch the fault with."""
    from server.audit_spec import audit_adapter, federation

    for method in ("cdp", "nadp"):
        for t in audit_adapter(method).self_tests:
            assert t.trials and federation(method, t.view, fault=t.fault)["trials"] == t.trials
    assert federation("cdp", "model")["trials"] != federation("cdp", "model", fault="halve-noise")["trials"]
