"""DDP-SA's privacy-loss-distribution accounting (ddpsa-composition = "pld"): calibration, charges, dropouts."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dp_pld

from protocols.ddpsa import gamma_difference_epsilon
from protocols.privacy import (
    DpCompositionAccountant,
    DpEvent,
    LaplaceEvent,
    PldAccountant,
    accountant_from_state,
    per_round_epsilons,
)
from protocols.privacy.pld import laplace_pld_scale, pld_epsilon
from tests.test_ddpsa_method import UNREACHED, _setup, credentials  # noqa: F401 (autouse fixture)

EPS, DELTA = 1.0, 1e-5


def _dp_accounting_epsilon(epsilons, delta: float = DELTA) -> float:
    """dp-accounting's own PLD accountant over Laplace releases of the given epsilons (sensitivity 1)."""
    acc = dp_accounting.pld.PLDAccountant()
    for e in epsilons:
        acc.compose(dp_accounting.LaplaceDpEvent(1.0 / e))
    return acc.get_epsilon(delta)


def test_pld_epsilon_matches_dp_accounting_on_a_known_case() -> None:
    """Ten Laplace releases of epsilon 0.1 at delta 1e-5: dp-accounting's figure (just under basic's 1.0)."""
    ours = pld_epsilon([(0.1, True, 10)], DELTA)
    assert ours == pytest.approx(_dp_accounting_epsilon([0.1] * 10), rel=1e-3)
    assert ours < 1.0
    assert PldAccountant([LaplaceEvent(0.1, count=10)]).epsilon(DELTA) == pytest.approx(ours, rel=1e-12)
    # A pure-DP release of unknown shape is charged more than the Laplace release of the same epsilon.
    assert pld_epsilon([(0.1, False, 10)], DELTA) > ours


@pytest.mark.parametrize(("rounds", "allocation"), [(1, "uniform"), (4, "uniform"), (30, "uniform"),
                                                    (12, "exponential")])
def test_pld_schedule_meets_the_budget_and_never_noises_more_than_basic(rounds: int, allocation: str) -> None:
    pld = per_round_epsilons(EPS, DELTA, rounds, allocation=allocation, alpha=0.9, composition="pld")
    basic = per_round_epsilons(EPS, DELTA, rounds, allocation=allocation, alpha=0.9, composition="basic")
    assert pld.composition == "pld" and pld.spent.delta == DELTA
    assert pld.spent.epsilon <= EPS
    # dp-accounting's own accountant (or basic composition, the cap of the PLD figure) certifies the schedule.
    assert min(_dp_accounting_epsilon(pld.epsilons), float(np.sum(pld.epsilons))) <= EPS * (1 + 1e-9)
    # The Laplace scale per round (clip / eps_t) is never larger than basic composition's.
    assert np.all(pld.epsilons >= basic.epsilons * (1 - 1e-12))
    np.testing.assert_allclose(pld.epsilons / pld.epsilons[0], basic.epsilons / basic.epsilons[0], rtol=1e-12)
    if rounds == 1:  # one release stays pure epsilon-DP
        assert pld.epsilons[0] == EPS
    # Tight: 1% more per round would exceed the budget (unless basic composition already certifies it).
    if pld.epsilons[0] > basic.epsilons[0] * 1.001:
        assert pld_epsilon([(float(e) * 1.01, True, 1) for e in pld.epsilons], DELTA) > EPS


def test_pld_wins_over_many_rounds() -> None:
    """30 rounds at (1, 1e-5): PLD certifies about 1.5x basic's per-round epsilon (noise scale 2/3)."""
    pld = per_round_epsilons(EPS, DELTA, 30, composition="pld")
    assert pld.epsilons[0] > 1.4 * EPS / 30
    assert _dp_accounting_epsilon(pld.epsilons) <= EPS * (1 + 1e-6)
    assert laplace_pld_scale([1.0] * 30, EPS, DELTA) == pytest.approx(pld.epsilons[0])


def test_one_coordinate_shift_is_the_worst_case_of_a_laplace_vector() -> None:
    """An L1 shift spread over coordinates leaks less (every epsilon) than the same shift on one coordinate."""
    one = dp_pld.from_laplace_mechanism(1.0, sensitivity=1.0)
    for parts in ([0.5, 0.5], [0.2, 0.8], [0.1] * 10):
        spread = None
        for f in parts:
            p = dp_pld.from_laplace_mechanism(1.0, sensitivity=f)
            spread = p if spread is None else spread.compose(p)
        for e in (0.0, 0.1, 0.5, 0.9):
            assert spread.get_delta_for_epsilon(e) <= one.get_delta_for_epsilon(e)


def test_pld_accountant_round_trips_and_refuses_approximate_events() -> None:
    acc = PldAccountant([LaplaceEvent(0.2, count=3), DpEvent(0.3, 0.0)])
    again = accountant_from_state(acc.to_state())
    assert isinstance(again, PldAccountant) and again.epsilon(DELTA) == acc.epsilon(DELTA)
    with pytest.raises(ValueError, match="pure-DP"):
        acc.compose(DpEvent(0.3, 1e-6))
    assert PldAccountant().epsilon(DELTA) == 0.0


def test_dropout_rounds_are_charged_the_noise_present_never_below_the_nominal() -> None:
    """Missing shares: the round is a pure-DP release of the Gamma-difference epsilon, above the Laplace round."""
    _, _, s = _setup(num_clients=10, num_rounds=4, ddpsa_collude_frac=0.1, ddpsa_composition="pld", ddpsa_servers=UNREACHED)
    assert s.schedule.composition == "pld" and isinstance(s.privacy.uplink, PldAccountant)
    _, _, nominal = _setup(num_clients=10, num_rounds=4, ddpsa_collude_frac=0.1, ddpsa_composition="pld",
                          ddpsa_servers=UNREACHED)
    eps_t = s.epsilon_of_round(1)
    charges = [s.round_charge(t, 10, pushed, 650) for t, pushed in ((1, 10), (2, 9), (3, 8), (4, 10))]
    assert charges[0] == charges[3] == eps_t
    assert charges[1] == pytest.approx(gamma_difference_epsilon(8 / 9, eps_t, 650))
    assert eps_t < charges[1] < charges[2] < math.inf
    for t, charge in enumerate(charges, 1):
        s.release_round(t, charge)
        nominal.release_round(t)
        assert s.privacy_report(t)["epsilon"] >= nominal.privacy_report(t)["epsilon"]
    assert [type(e) for e in s.privacy.uplink.events] == [LaplaceEvent, DpEvent, DpEvent, LaplaceEvent]
    assert nominal.privacy_report(4)["epsilon"] <= EPS
    assert s.privacy_report(4)["epsilon"] > nominal.privacy_report(4)["epsilon"]
    with pytest.raises(ValueError, match="below"):
        s.release_round(1, eps_t / 2)


def test_basic_composition_keeps_the_papers_figures() -> None:
    """ddpsa-composition = "basic": eps_t = epsilon / T and the ledger sums them (Theorem 2 (1))."""
    _, _, s = _setup(num_rounds=4, ddpsa_composition="basic", ddpsa_servers=UNREACHED)
    assert isinstance(s.privacy.uplink, DpCompositionAccountant)
    assert s.epsilon_of_round(1) == pytest.approx(EPS / 4, rel=1e-12)
