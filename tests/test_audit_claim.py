"""The claim an audit compares with: the run's own accounting (pure DP or not), its schedule and options, colluders.

Fast checks of the audit's bookkeeping; the audits of the real release code are in ``tests/test_audit.py``.
"""

from __future__ import annotations

import math

import pytest

from protocols.config import ConfigError
from protocols.methods import NO_COLLUDER
from protocols.privacy import DpCompositionAccountant, PldAccountant, PrivacyLedger, RdpAccountant, per_round_epsilons
from protocols.privacy.events import DpEvent, GaussianEvent, LaplaceEvent
from server.audit_release import claim_of
from server.audit_spec import CLAIMS, AuditSpec, audit_adapter

DELTA = 1e-5


def _ledger(acc) -> PrivacyLedger:
    return PrivacyLedger(DELTA, uplink=acc, downlink=acc)


def test_pure_epsilon_is_certified_only_by_accountants_of_pure_releases():
    basic = DpCompositionAccountant([LaplaceEvent(0.5), LaplaceEvent(0.25)])
    assert basic.pure_epsilon() == pytest.approx(0.75)
    assert DpCompositionAccountant([LaplaceEvent(0.5), DpEvent(0.1, 1e-7)]).pure_epsilon() is None
    assert PldAccountant([LaplaceEvent(0.5), LaplaceEvent(0.5)]).pure_epsilon() == pytest.approx(1.0)
    assert RdpAccountant([GaussianEvent(1.0)]).pure_epsilon() is None


def test_claim_is_pure_under_basic_composition_and_at_delta_under_pld():
    """The accountings of ddpsa: basic composition certifies a pure claim (delta 0); PLD its smaller figure at delta.

    The first of 100 PLD-calibrated rounds: the ledger claims a bit less than the round's Laplace epsilon, at delta,
    so the audit must compare at delta, not with a pure-DP bound.
    """
    eps_t = float(per_round_epsilons(4.0, DELTA, 100, composition="pld").epsilons[0])
    pld = PldAccountant([LaplaceEvent(eps_t)])
    eps, delta = claim_of(_ledger(pld), "upload")
    assert eps < eps_t and delta == DELTA
    eps, delta = claim_of(_ledger(DpCompositionAccountant([LaplaceEvent(eps_t)])), "model")
    assert eps == pytest.approx(eps_t) and delta == 0.0
    eps, delta = claim_of(_ledger(RdpAccountant([GaussianEvent(1.0)])), "upload")
    assert math.isfinite(eps) and delta == DELTA
    eps, _ = claim_of(PrivacyLedger(DELTA, downlink=RdpAccountant([GaussianEvent(1.0)])), "upload")
    assert math.isinf(eps)  # no uplink guarantee


def test_the_audited_run_config_takes_the_runs_schedule_and_options():
    spec = AuditSpec("ddpsa", rounds=100, settings=(("ddpsa-composition", "pld"),))
    cfg = spec.run_config()
    assert cfg["num-rounds"] == 100 and cfg["ddpsa-composition"] == "pld"
    with pytest.raises(ConfigError, match="rounds"):
        AuditSpec("ddpsa", rounds=0).validate()


def test_niss_claim_covers_colluders_up_to_its_rate():
    """niss: floor(niss-rho x 3 neighbours) colluders are inside the claim (1 at the default rho 1/2); nadp: none."""
    niss = AuditSpec("niss", colluders=2)
    niss.validate()
    assert audit_adapter("niss").tolerated_colluders(niss) == 1
    assert audit_adapter("niss").tolerated_colluders(AuditSpec("niss", settings=(("niss-rho", 1.0),))) == 3
    assert audit_adapter("nadp").tolerated_colluders(AuditSpec("nadp", colluders=1)) == 0
    with pytest.raises(ConfigError, match="colluders"):
        AuditSpec("ldp", colluders=1).validate()


def test_given_secret_is_a_model_view_of_the_mp_family_only():
    AuditSpec("mpcdp", "model", given_secret=True).validate()
    for spec in (AuditSpec("ldp", "model", given_secret=True), AuditSpec("mpcdp", "upload", given_secret=True)):
        with pytest.raises(ConfigError, match="given-secret"):
            spec.validate()


def test_niss_rows_compare_each_colluder_count_with_the_claim_for_that_view():
    """Niss uploads: 0 colluders -> the run's figure with no colluding neighbour; 1 (= floor(rho x 3)) or 2 -> the claim.

    ``claim_of`` reads the named account (and its delta); other methods keep their direction's account.
    """
    niss = audit_adapter("niss")
    assert niss.claim_account(AuditSpec("niss")) == NO_COLLUDER
    assert niss.claim_account(AuditSpec("niss", colluders=1)) == niss.claim_account(AuditSpec("niss", colluders=2)) \
        == "uplink"
    assert niss.claim_account(AuditSpec("niss", "model")) == "downlink"
    assert audit_adapter("nadp").claim_account(AuditSpec("nadp")) == "uplink"
    assert CLAIMS[NO_COLLUDER] == "uploads (no colluding neighbour)"
    ledger = PrivacyLedger(DELTA, uplink=RdpAccountant([GaussianEvent(1.0)]),
                           extra={NO_COLLUDER: RdpAccountant([GaussianEvent(1.5)])})
    alone, delta = claim_of(ledger, "upload", NO_COLLUDER)
    assert alone < claim_of(ledger, "upload")[0] and delta == DELTA
    assert math.isinf(claim_of(PrivacyLedger(DELTA), "upload", NO_COLLUDER)[0])  # no such account: no claim
