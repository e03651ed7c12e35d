"""protocols.privacy: mechanisms, events, accountants (against dp-accounting and closed forms), state round trips."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant as DpRdpAccountant
from scipy import integrate, stats

from protocols.privacy import (
    RDP_ORDERS,
    DpCompositionAccountant,
    DpEvent,
    GaussianEvent,
    GdpAccountant,
    LaplaceEvent,
    Lemma2Accountant,
    PerUnitAccountant,
    PrivacyLedger,
    RdpAccountant,
    accountant_from_state,
    advanced_composition,
    analytic_gaussian_epsilon,
    analytic_gaussian_sigma,
    calibrate_noise_multiplier,
    classic_gaussian_sigma,
    compose_advanced,
    event_from_dict,
    gaussian_delta,
    gaussian_epsilon,
    gdp_epsilon,
    joint_gaussian,
    laplace_scale,
    lemma2_epsilon,
    lemma2_sigma,
    noise_multiplier,
)

DELTA = 1e-5


def _direct(events: list[dp_accounting.DpEvent], counts: list[int], delta: float = DELTA) -> float:
    acc = DpRdpAccountant(list(RDP_ORDERS))
    for e, c in zip(events, counts, strict=True):
        acc.compose(e, c)
    return float(acc.get_epsilon(delta))


def _reloaded(acc):
    return accountant_from_state(json.loads(json.dumps(acc.to_state())))


# ------------------------------------------------------------------ Gaussian mechanism (one release)
def _hockey_stick_delta(sigma: float, eps: float, sens: float) -> float:
    """delta(eps) by direct numerical integration of max(0, p(x) - e^eps q(x))."""
    p = stats.norm(0.0, sigma)
    q = stats.norm(sens, sigma)
    # the integrand is positive exactly for x < x0 (privacy loss > eps)
    x0 = sens / 2 - eps * sigma**2 / sens
    val, _ = integrate.quad(lambda x: p.pdf(x) - math.exp(eps) * q.pdf(x), -np.inf, x0, epsabs=1e-14, epsrel=1e-10, limit=200)
    return val


def test_classic_sigma_and_validity() -> None:
    assert classic_gaussian_sigma(0.5, 1e-5, 2.0) == pytest.approx(2.0 * math.sqrt(2 * math.log(1.25e5)) / 0.5, rel=1e-14)
    with pytest.raises(ValueError):
        classic_gaussian_sigma(1.0, 1e-5, 1.0)
    for bad in [(0.0, 1e-5, 1.0), (0.5, 0.0, 1.0), (0.5, 1.0, 1.0), (0.5, 1e-5, 0.0)]:
        with pytest.raises(ValueError):
            classic_gaussian_sigma(*bad)


def test_gaussian_delta_matches_numerical_integration() -> None:
    for sigma, eps, sens in [(1.0, 0.5, 1.0), (3.0, 0.1, 2.0), (0.7, 2.0, 1.0)]:
        assert gaussian_delta(sigma, eps, sens) == pytest.approx(_hockey_stick_delta(sigma, eps, sens), rel=1e-6)


@pytest.mark.parametrize("eps", [0.01, 0.1, 0.5, 0.9, 1.0, 3.0, 10.0, 50.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 1e-2, 0.3])
def test_analytic_sigma_defining_equation(eps: float, delta: float) -> None:
    sens = 1.7
    sigma = analytic_gaussian_sigma(eps, delta, sens)
    assert gaussian_delta(sigma, eps, sens) == pytest.approx(delta, rel=1e-7)
    # minimality: slightly less noise violates (eps, delta)
    assert gaussian_delta(sigma * (1 - 1e-4), eps, sens) > delta
    if eps < 1:
        assert sigma < classic_gaussian_sigma(eps, delta, sens)


def test_analytic_sigma_both_branches() -> None:
    eps = 1.0
    delta0 = 0.5 - math.exp(eps) * stats.norm.cdf(-math.sqrt(2 * eps))
    for delta in (delta0 * 0.5, delta0 * 1.5):  # u* branch, v* branch
        sigma = analytic_gaussian_sigma(eps, delta, 1.0)
        assert gaussian_delta(sigma, eps, 1.0) == pytest.approx(delta, rel=1e-7)
    # at delta0 exactly alpha = 1, sigma = sens / sqrt(2 eps)
    assert analytic_gaussian_sigma(eps, delta0, 1.0) == pytest.approx(1 / math.sqrt(2 * eps), rel=1e-6)


@pytest.mark.parametrize("eps", [0.05, 0.7, 2.0, 9.0])
def test_analytic_epsilon_inverts_sigma(eps: float) -> None:
    sigma = analytic_gaussian_sigma(eps, DELTA, 2.5)
    assert analytic_gaussian_epsilon(sigma, DELTA, 2.5) == pytest.approx(eps, rel=1e-7)
    assert analytic_gaussian_epsilon(1e6, 0.4) == 0.0  # delta(0) already below the target


def test_analytic_epsilon_of_a_large_target() -> None:
    """A run's ledger composes its releases at any epsilon the config accepts (here 1e6 over 2 rounds, z ~ 1e-3).

    Every client charges its ledger with this after round 2: an epsilon it cannot compute fails that round mid-run.
    """
    z = calibrate_noise_multiplier(1e6, DELTA, 1.0, 2)
    eps = gdp_epsilon(z, 2, DELTA)
    assert 5e5 < eps <= 1e6
    assert analytic_gaussian_sigma(eps, DELTA, 1.0) == pytest.approx(z / math.sqrt(2), rel=1e-6)


def test_laplace_scale() -> None:
    assert laplace_scale(2.0, 0.5) == 4.0
    for bad in [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)]:
        with pytest.raises(ValueError):
            laplace_scale(*bad)


def test_lemma2_round_trip() -> None:
    s = lemma2_sigma(0.3, 1.7, 1e-6, 40)
    assert s == pytest.approx(0.3 * math.sqrt(2 * 40 * math.log(1e6)) / 1.7, rel=1e-14)
    assert lemma2_epsilon([(0.3, s, 40)], 1e-6) == pytest.approx(1.7, rel=1e-12)
    assert lemma2_epsilon([(1.0, 2.0, 10), (1.0, 0.0, 1)], 1e-5) == math.inf
    with pytest.raises(ValueError):
        lemma2_sigma(1.0, 1.0, 1.5, 3)


# ------------------------------------------------------------------ RDP (gaussian_epsilon, calibration)
def test_abadi_moments_accountant_value():
    """Abadi et al. 2016: q=0.01, sigma=4, 10k steps, delta=1e-5 gives epsilon ~1.26.

    That is the moments accountant; modern RDP conversions are slightly tighter.
    """
    eps = gaussian_epsilon(4.0, 0.01, 10_000, 1e-5)
    assert 0.95 < eps < 1.3


def test_gaussian_composition_is_exact_in_rdp():
    """T releases with sigma equal one release with sigma/sqrt(T) (RDP of the Gaussian is linear in 1/sigma^2)."""
    for steps in (4, 25):
        assert gaussian_epsilon(3.0, 1.0, steps, 1e-5) == pytest.approx(
            gaussian_epsilon(3.0 / math.sqrt(steps), 1.0, 1, 1e-5), rel=1e-9)


def test_single_gaussian_matches_classic_bound():
    """One Gaussian release: the RDP epsilon is below the classic sqrt(2 ln(1.25/delta))/sigma bound (eps<1 regime)."""
    sigma, delta = 5.0, 1e-5
    classic = math.sqrt(2 * math.log(1.25 / delta)) / sigma
    eps = gaussian_epsilon(sigma, 1.0, 1, delta)
    assert 0.5 * classic < eps < classic


@pytest.mark.parametrize(("eps", "q", "steps"), [(1.0, 1.0, 20), (1.0, 0.1, 100), (8.0, 0.5, 10)])
def test_calibration_round_trip(eps, q, steps):
    z = calibrate_noise_multiplier(eps, 1e-5, q, steps)
    assert gaussian_epsilon(z, q, steps, 1e-5) <= eps
    assert gaussian_epsilon(z * 0.99, q, steps, 1e-5) > eps


def test_noise_multiplier_is_the_unsampled_calibration():
    z = noise_multiplier(2.0, 1e-5, 30)
    assert z == calibrate_noise_multiplier(2.0, 1e-5, 1.0, 30)
    assert gaussian_epsilon(z, 1.0, 30, 1e-5) <= 2.0 < gaussian_epsilon(z * 0.999, 1.0, 30, 1e-5)


def test_amplification_and_monotonicity():
    assert gaussian_epsilon(1.0, 0.1, 10, 1e-5) < gaussian_epsilon(1.0, 1.0, 10, 1e-5)
    assert gaussian_epsilon(2.0, 1.0, 10, 1e-5) < gaussian_epsilon(1.0, 1.0, 10, 1e-5)


def test_bad_inputs():
    with pytest.raises(ValueError):
        gaussian_epsilon(0.0, 1.0, 1, 1e-5)
    with pytest.raises(ValueError):
        gaussian_epsilon(1.0, 0.0, 1, 1e-5)
    with pytest.raises(ValueError):
        calibrate_noise_multiplier(-1.0, 1e-5, 1.0, 1)
    for bad in [(-1.0,), (math.inf,), (math.nan,), (1.0, 0.0), (1.0, 1.5), (1.0, 1.0, -1)]:
        with pytest.raises(ValueError):
            GaussianEvent(*bad)
    for bad in [(0.0,), (math.inf,), (1.0, -2)]:
        with pytest.raises(ValueError):
            LaplaceEvent(*bad)
    with pytest.raises(ValueError):
        event_from_dict({"kind": "exponential", "epsilon": 1.0})
    with pytest.raises(ValueError):
        event_from_dict({"kind": "gaussian", "noise_multiplier": 1.0})
    with pytest.raises(ValueError):
        accountant_from_state({"kind": "moments"})
    with pytest.raises(ValueError):
        RdpAccountant().epsilon(0.0)


# ------------------------------------------------------------------ RdpAccountant == dp-accounting
def test_rdp_accountant_matches_dp_accounting_directly():
    gauss = dp_accounting.GaussianDpEvent
    sampled = dp_accounting.PoissonSampledDpEvent
    acc = RdpAccountant()
    assert acc.epsilon(DELTA) == 0.0 and acc.releases == 0
    for _ in range(7):
        acc.compose(GaussianEvent(1.3))
    assert acc.epsilon(DELTA) == pytest.approx(_direct([gauss(1.3)], [7]), rel=1e-12)
    acc.compose(GaussianEvent(2.0, 0.2, 30))
    acc.compose(LaplaceEvent(0.5, 2))
    acc.compose(GaussianEvent(0.9))
    want = _direct([gauss(1.3), sampled(0.2, gauss(2.0)), dp_accounting.LaplaceDpEvent(2.0), gauss(0.9)], [7, 30, 2, 1])
    assert acc.epsilon(DELTA) == pytest.approx(want, rel=1e-9)
    assert acc.epsilon(1e-3) == pytest.approx(
        _direct([gauss(1.3), sampled(0.2, gauss(2.0)), dp_accounting.LaplaceDpEvent(2.0), gauss(0.9)], [7, 30, 2, 1],
                1e-3), rel=1e-9)
    assert acc.releases == 40
    # an un-noised release spends everything
    acc.compose(GaussianEvent(0.0))
    assert acc.epsilon(DELTA) == math.inf
    assert RdpAccountant([GaussianEvent(0.0, 0.5, 10)]).epsilon(DELTA) == math.inf


def test_consecutive_equal_events_merge():
    acc = RdpAccountant()
    for e in [GaussianEvent(2.0), GaussianEvent(2.0, count=3), GaussianEvent(1.0), GaussianEvent(2.0, count=0)]:
        acc.compose(e)
    assert acc.events == (GaussianEvent(2.0, count=4), GaussianEvent(1.0))
    assert acc.epsilon(DELTA) == pytest.approx(gaussian_epsilon((4 / 4 + 1) ** -0.5, 1.0, 1, DELTA), rel=1e-12)
    with pytest.raises(TypeError):
        GdpAccountant().compose(LaplaceEvent(1.0))
    with pytest.raises(TypeError):
        DpCompositionAccountant().compose(GaussianEvent(1.0))
    with pytest.raises(ValueError):
        GdpAccountant().compose(GaussianEvent(1.0, 0.5))


def test_joint_gaussian_is_dp_accountings_composed_event():
    up, down = GaussianEvent(3.0, 0.8, 200), GaussianEvent(5.0, 0.8, 200)
    joint = joint_gaussian([up, down])
    inner = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(3.0), dp_accounting.GaussianDpEvent(5.0)])
    want = _direct([dp_accounting.PoissonSampledDpEvent(0.8, inner)], [200])
    assert RdpAccountant([joint]).epsilon(DELTA) == pytest.approx(want, rel=1e-9)
    assert RdpAccountant([joint]).epsilon(DELTA) > RdpAccountant([up]).epsilon(DELTA)
    with pytest.raises(ValueError):
        joint_gaussian([GaussianEvent(1.0, 0.5, 10), GaussianEvent(1.0, 0.4, 10)])
    assert joint_gaussian([up, GaussianEvent(0.0, 0.8, 200)]).noise_multiplier == 0.0


# ------------------------------------------------------------------ other accountants vs closed forms
@pytest.mark.parametrize("z", [0.8, 3.0, 12.0])
def test_gdp_accountant_is_exact_gaussian_composition(z: float):
    for t in (1, 5, 40):
        eps = gdp_epsilon(z, t, DELTA)
        assert eps == pytest.approx(analytic_gaussian_epsilon(z / math.sqrt(t), DELTA, 1.0), rel=1e-12)
        assert gaussian_delta(z / math.sqrt(t), eps) == pytest.approx(DELTA, rel=1e-6)  # exact, not a bound
        assert eps <= gaussian_epsilon(z, 1.0, t, DELTA)  # tighter than RDP
    assert gdp_epsilon(z, 0, DELTA) == 0.0
    assert GdpAccountant([GaussianEvent(1.0), GaussianEvent(0.0)]).epsilon(DELTA) == math.inf


def test_dp_composition_accountant_matches_closed_forms():
    eps_t = [0.3, 0.2, 0.2, 0.1]
    acc = DpCompositionAccountant([LaplaceEvent(e) for e in eps_t], composition="basic")
    assert acc.epsilon(DELTA) == pytest.approx(sum(eps_t), rel=1e-15)
    adv = DpCompositionAccountant([LaplaceEvent(e) for e in eps_t], composition="advanced")
    want = math.sqrt(2 * math.log(1 / DELTA) * sum(e * e for e in eps_t)) + sum(e * math.expm1(e) for e in eps_t)
    assert adv.epsilon(DELTA) == pytest.approx(want, rel=1e-14)
    # T identical rounds: Eq. 11 of DDP-SA (paper's example, eps_total ~= 24.09)
    uniform = DpCompositionAccountant([LaplaceEvent(0.1, 1000)], composition="advanced")
    assert uniform.epsilon(1e-4) == pytest.approx(advanced_composition(0.1, 0.0, 1000, 1e-4).epsilon, rel=1e-12)
    assert uniform.epsilon(1e-4) == pytest.approx(24.09, abs=0.01)
    best = DpCompositionAccountant([LaplaceEvent(0.1, 1000)], composition="best")
    assert best.epsilon(1e-4) == uniform.epsilon(1e-4) < 100.0  # advanced beats basic (100) over many rounds
    few = DpCompositionAccountant([LaplaceEvent(0.5, 3)], composition="best")
    assert few.epsilon(DELTA) == pytest.approx(1.5)  # basic beats advanced for tiny T
    assert DpCompositionAccountant(composition="advanced").epsilon(DELTA) == 0.0
    with pytest.raises(ValueError):
        DpCompositionAccountant(composition="fancy")  # type: ignore[arg-type]


def test_dp_events_with_delta_compose_by_the_theorems():
    """Rounds certified (eps, delta)-DP by a theorem: basic needs sum delta_t <= delta, advanced uses what is left."""
    acc = DpCompositionAccountant([DpEvent(0.1, 1e-6, 10)])
    assert acc.epsilon(1e-5) == pytest.approx(1.0, rel=1e-12)  # 10 x 1e-6 = 1e-5 (float rounding tolerated)
    assert acc.epsilon(5e-6) == math.inf  # the rounds' own deltas exceed the budget
    adv = DpCompositionAccountant([DpEvent(0.1, 1e-7, 100)], composition="advanced")
    want = compose_advanced([0.1] * 100, 1e-7, delta_prime=1e-4 - 1e-5).epsilon
    assert adv.epsilon(1e-4) == pytest.approx(want, rel=1e-12)
    assert adv.epsilon(1e-5) == math.inf  # no slack left for delta'
    with pytest.raises(TypeError):
        RdpAccountant().compose(DpEvent(1.0))
    with pytest.raises(ValueError):
        DpEvent(1.0, 1.0)


def test_lemma2_accountant_is_the_papers_composition():
    acc = Lemma2Accountant([GaussianEvent(4.0, count=10), GaussianEvent(2.0), GaussianEvent(3.0, 0.5, 4)])
    assert acc.epsilon(DELTA) == pytest.approx(
        lemma2_epsilon([(1.0, 4.0, 10), (1.0, 2.0, 1), (1.0, 3.0, 2.0)], DELTA), rel=1e-15)
    z = lemma2_sigma(1.0, 2.0, DELTA, 30)
    assert Lemma2Accountant([GaussianEvent(z, count=30)]).epsilon(DELTA) == pytest.approx(2.0, rel=1e-12)
    assert Lemma2Accountant().epsilon(DELTA) == 0.0


# ------------------------------------------------------------------ state round trips
def _filled() -> list:
    return [
        RdpAccountant([GaussianEvent(1.1, count=20), GaussianEvent(2.5, 0.3, 4), LaplaceEvent(0.7), GaussianEvent(1.7)]),
        GdpAccountant([GaussianEvent(1.1, count=3), GaussianEvent(0.6)]),
        DpCompositionAccountant([LaplaceEvent(0.2, 5), DpEvent(0.1, 1e-7)], composition="best"),
        Lemma2Accountant([GaussianEvent(3.0, 0.5, 6), GaussianEvent(2.0)]),
    ]


@pytest.mark.parametrize("index", range(4))
def test_state_round_trip_preserves_epsilon(index: int):
    acc = _filled()[index]
    back = _reloaded(acc)
    assert type(back) is type(acc)
    assert back.to_state() == acc.to_state()
    assert back.releases == acc.releases
    for delta in (1e-7, DELTA, 1e-2):
        assert back.epsilon(delta) == acc.epsilon(delta)  # bit-identical
    # composing on after a reload gives what an uninterrupted accountant gives
    ev = LaplaceEvent(0.3) if isinstance(acc, DpCompositionAccountant) else GaussianEvent(1.9)
    for a in (acc, back):
        a.compose(ev)
        a.compose(ev)
    assert back.epsilon(DELTA) == acc.epsilon(DELTA)


def test_incremental_equals_reloaded_bit_for_bit():
    """Round-by-round composition and a reload of its state run the same arithmetic."""
    acc = RdpAccountant()
    for t in range(30):
        acc.compose(GaussianEvent(1.0 + (t % 3) / 10))
        assert _reloaded(acc).epsilon(DELTA) == acc.epsilon(DELTA)


# ------------------------------------------------------------------ PerUnitAccountant
def test_per_unit_reports_the_worst_unit():
    acc = PerUnitAccountant()
    assert acc.epsilon(DELTA) == 0.0 and acc.worst(DELTA) == (None, 0.0)
    big = 2**63 + 5  # node ids are unsigned 64-bit
    acc.compose(GaussianEvent(2.0), units=[1, 2, big])
    acc.compose(GaussianEvent(1.5), units=[2])
    acc.compose(GaussianEvent(3.0), units=[big])
    eps = acc.epsilons(DELTA)
    assert set(eps) == {1, 2, big}
    assert eps[2] == pytest.approx(gaussian_epsilon((0.25 + 1 / 2.25) ** -0.5, 1.0, 1, DELTA), rel=1e-12)
    assert acc.worst(DELTA) == (2, max(eps.values()))
    assert acc.epsilon(DELTA) == eps[2] > eps[big] > eps[1]
    assert acc.releases == 2 and acc.units == (1, 2, big)
    # the fast path (ranks) and the full scan agree; sampled events force the full scan
    sampled = PerUnitAccountant()
    sampled.compose(GaussianEvent(1.0, 0.3, 50), units=[7])
    sampled.compose(GaussianEvent(1.2), units=[8])
    full = sampled.epsilons(DELTA)
    assert sampled.worst(DELTA) == max(full.items(), key=lambda kv: kv[1])
    # state round trip: same units, same epsilons, new units still start from the template
    back = _reloaded(acc)
    assert isinstance(back, PerUnitAccountant)
    assert back.epsilons(DELTA) == eps
    back.compose(GaussianEvent(0.5), units=[99])
    assert back.worst(DELTA)[0] == 99
    gdp = PerUnitAccountant(GdpAccountant())
    gdp.compose(GaussianEvent(1.0), units=[3])
    assert isinstance(_reloaded(gdp).unit(4), GdpAccountant)
    with pytest.raises(ValueError):
        PerUnitAccountant(RdpAccountant([GaussianEvent(1.0)]))


# ------------------------------------------------------------------ PrivacyLedger
def test_ledger_reports_views_headline_and_no_guarantee():
    assert PrivacyLedger(DELTA).report() == {"epsilon": math.inf, "epsilon_uplink": math.inf, "epsilon_downlink": math.inf}
    shared = RdpAccountant()
    both = PrivacyLedger(DELTA, uplink=shared, downlink=shared)
    both.compose(GaussianEvent(2.0, count=3))
    assert shared.releases == 3  # one bound for both views: composed once
    eps = gaussian_epsilon(2.0, 1.0, 3, DELTA)
    assert both.report() == {"epsilon": eps, "epsilon_uplink": eps, "epsilon_downlink": eps}
    trusted = PrivacyLedger(DELTA, downlink=RdpAccountant(), headline="downlink")  # e.g. central DP
    trusted.compose(GaussianEvent(2.0, 0.5))
    rep = trusted.report()
    assert rep["epsilon_uplink"] == math.inf and rep["epsilon"] == rep["epsilon_downlink"] < eps
    local = PrivacyLedger(DELTA, uplink=RdpAccountant(), downlink=RdpAccountant(), headline="uplink")
    local.uplink.compose(GaussianEvent(1.0))
    local.downlink.compose(GaussianEvent(3.0))
    rep = local.report()
    assert rep["epsilon"] == rep["epsilon_uplink"] > rep["epsilon_downlink"] > 0
    worst = PrivacyLedger(DELTA, uplink=local.uplink, downlink=RdpAccountant([GaussianEvent(0.5)]))
    assert worst.report()["epsilon"] == worst.report()["epsilon_downlink"] > rep["epsilon_uplink"]
    with pytest.raises(ValueError):
        PrivacyLedger(DELTA, headline="best")  # type: ignore[arg-type]


def test_ledger_per_unit_views_extras_and_state():
    ledger = PrivacyLedger(DELTA, uplink=PerUnitAccountant(), downlink=RdpAccountant(),
                           extra={"paper": Lemma2Accountant()})
    ledger.compose(GaussianEvent(1.5), units=[4, 9])
    ledger.uplink.compose(GaussianEvent(1.0), units=[9])
    ledger.extra["paper"].compose(GaussianEvent(1.5))
    with pytest.raises(ValueError):
        ledger.compose(GaussianEvent(1.5))  # a per-unit view needs the clients a release used
    rep = ledger.report()
    assert rep["epsilon_uplink"] == ledger.uplink.unit(9).epsilon(DELTA) > ledger.uplink.unit(4).epsilon(DELTA)
    assert rep["epsilon_downlink"] == pytest.approx(gaussian_epsilon(1.5, 1.0, 1, DELTA), rel=1e-12)
    assert ledger.extra_report() == {"epsilon_paper": pytest.approx(lemma2_epsilon([(1.0, 1.5, 1)], DELTA))}
    back = PrivacyLedger.from_state(json.loads(json.dumps(ledger.to_state())))
    assert back.report() == rep and back.extra_report() == ledger.extra_report()
    shared = RdpAccountant([GaussianEvent(2.0)])
    back = PrivacyLedger.from_state(json.loads(json.dumps(PrivacyLedger(DELTA, uplink=shared, downlink=shared).to_state())))
    assert back.uplink is back.downlink and back.report()["epsilon"] == shared.epsilon(DELTA)


def test_non_converged_fractional_orders_stay_out_of_the_log(caplog):
    """dp-accounting's per-order non-convergence warnings stay out of run logs.

    For a sampled Gaussian with a large multiplier it drops the fractional orders it cannot sum (epsilon stays
    a valid bound) and logs one warning per order and evaluation.
    """
    import logging

    from protocols.privacy import GaussianEvent, RdpAccountant

    with caplog.at_level(logging.WARNING):
        eps = RdpAccountant([GaussianEvent(14.0, 0.5, 3)]).epsilon(1e-5)
    assert 0 < eps < 1
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]


def test_the_multiplier_under_an_accountant_meets_its_target_there():
    """``multiplier_under``: RDP gives ``calibrate_noise_multiplier``'s z; Gaussian DP a smaller one, spent to the target."""
    from protocols.privacy import GdpAccountant, RdpAccountant, calibrate_noise_multiplier, gdp_epsilon, multiplier_under

    assert multiplier_under(RdpAccountant(), 1.0, 1e-5, 30) == calibrate_noise_multiplier(1.0, 1e-5, 1.0, 30)
    z = multiplier_under(GdpAccountant(), 1.0, 1e-5, 30)
    assert z < calibrate_noise_multiplier(1.0, 1e-5, 1.0, 30)
    assert 0.999 < gdp_epsilon(z, 30, 1e-5) <= 1.0
    used = GdpAccountant([GaussianEvent(1.0)])
    with pytest.raises(ValueError, match="empty accountant"):
        multiplier_under(used, 1.0, 1e-5, 30)
