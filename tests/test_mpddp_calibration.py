"""Calibration by Theorems 10/11 (Eq. 23): correct sigmas where covered, ValueError where not."""

from __future__ import annotations

import math

import pytest

from protocols.mpddp import (
    calibrate,
    calibrate_cdp,
    calibrate_ldp,
    max_theta,
    satisfies_eq23,
    sigmas_for_theta,
    theta_complete,
    theta_for_noise_multiplier,
    theta_n_out,
)


@pytest.mark.parametrize(("eps", "delta"), [(0.1, 1e-5), (1.0, 1e-5), (3.0, 1e-6), (8.0, 0.1), (2.0, 0.9)])
def test_max_theta_is_the_boundary_of_eq23(eps: float, delta: float) -> None:
    th = max_theta(eps, delta)
    assert th > 0
    assert satisfies_eq23(eps, delta, th)
    assert satisfies_eq23(eps, delta, 0.5 * th)
    assert not satisfies_eq23(eps, delta, th * (1 + 1e-6))


def test_complete_graph_theorem10() -> None:
    """Paper's K = n = 5 setting is a complete graph: covered by Theorem 10."""
    cal = calibrate(1.0, 1e-5, 5, n_out=5)
    assert cal.graph == "complete" and cal.delta_theorem == 1e-5
    assert math.isclose(theta_complete(cal.sigma_eta, cal.sigma_delta, 5), cal.theta_max, rel_tol=1e-12)
    assert satisfies_eq23(1.0, 1e-5, cal.theta)
    assert calibrate(1.0, 1e-5, 5).sigma_eta == cal.sigma_eta  # n_out=None means complete


def test_n_out_graph_theorem11() -> None:
    cal = calibrate(1.0, 1e-5, 100, n_out=70)
    assert cal.graph == "n_out" and math.isclose(cal.delta_theorem, 1e-5 / 3)
    assert math.isclose(theta_n_out(cal.sigma_eta, cal.sigma_delta, 100, 70), cal.theta_max, rel_tol=1e-12)
    assert satisfies_eq23(1.0, cal.delta_theorem, cal.theta)
    assert cal.sigma_delta > cal.sigma_eta  # pairwise noise carries most of the local protection


def test_sigma_eta_approaches_cdp_level() -> None:
    """eta_share -> 1: aggregate noise sigma_eta / sqrt(K) approaches the CDP sigma on the mean."""
    k = 100
    z = max_theta(2.0, 1e-5) ** -0.5  # the one-round (Eq. 23) noise multiplier
    cdp = calibrate_cdp(z, k)
    cal = calibrate(2.0, 1e-5, k, eta_share=0.999)
    assert math.isclose(cal.aggregate_noise_std, cdp, rel_tol=1e-3)
    assert calibrate(2.0, 1e-5, k, eta_share=0.5).sigma_eta > cal.sigma_eta
    assert calibrate_ldp(z) == pytest.approx(cdp * k)
    assert calibrate_cdp(z, k, sensitivity=3.0) == pytest.approx(3 * cdp)
    assert calibrate_ldp(z, sensitivity=3.0) == pytest.approx(3 * cdp * k)


def test_noise_multiplier_route_matches_theorem10() -> None:
    """A noise multiplier z from an accountant -> theta = 1/z^2 -> sigmas: the same sigmas as the Eq. (23) route at that theta."""
    k, z = 30, 1.7
    theta = theta_for_noise_multiplier(z)
    assert theta == pytest.approx(1 / z**2)
    se, sd = sigmas_for_theta(theta, k, eta_share=0.9)
    assert theta_complete(se, sd, k) == pytest.approx(theta)
    # Round trip with the one-round calibration: its theta_max gives back its own sigmas.
    cal = calibrate(1.0, 1e-5, k)
    round_trip = sigmas_for_theta(theta_for_noise_multiplier(cal.theta_max**-0.5), k)
    assert round_trip == pytest.approx((cal.sigma_eta, cal.sigma_delta))
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="noise_multiplier"):
            theta_for_noise_multiplier(bad)
    with pytest.raises(ValueError, match="num_clients"):
        calibrate_cdp(z, 0)


def test_monotone_and_sensitivity_scaling() -> None:
    a, b = calibrate(0.5, 1e-5, 20), calibrate(4.0, 1e-5, 20)
    assert a.sigma_eta > b.sigma_eta and a.sigma_delta > b.sigma_delta
    c = calibrate(0.5, 1e-5, 20, sensitivity=3.0)
    assert math.isclose(c.sigma_eta, 3 * a.sigma_eta) and math.isclose(c.sigma_delta, 3 * a.sigma_delta)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 1.0, "delta": 1e-5, "num_clients": 100, "n_out": 5}, "Theorem 11"),  # paper's K=100, n=5
        ({"epsilon": 1.0, "delta": 1e-5, "num_clients": 50, "n_out": 30}, "K >= 81"),
        ({"epsilon": 1.0, "delta": 1e-5, "num_clients": 100, "n_out": 40}, "4 log"),
        ({"epsilon": 1.0, "delta": 0.0, "num_clients": 10}, "delta"),
        ({"epsilon": 1.0, "delta": 1.0, "num_clients": 10}, "delta"),
        ({"epsilon": 0.0, "delta": 1e-5, "num_clients": 10}, "epsilon"),
        ({"epsilon": float("inf"), "delta": 1e-5, "num_clients": 10}, "epsilon"),
        ({"epsilon": 1.0, "delta": 1e-5, "num_clients": 1}, "num_clients"),
        ({"epsilon": 1.0, "delta": 1e-5, "num_clients": 10, "eta_share": 1.0}, "eta_share"),
        ({"epsilon": 1.0, "delta": 1e-5, "num_clients": 10, "eta_share": 0.0}, "eta_share"),
        ({"epsilon": 1.0, "delta": 1e-5, "num_clients": 10, "sensitivity": -1.0}, "sensitivity"),
    ],
)
def test_refuses_uncovered_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        calibrate(**kwargs)


# --------------------------------------------------------------------------- record level
def test_record_level_scales_are_z_times_two_clip_over_n():
    """The MP family's noise: Theorem 10 multipliers (mpddp) or z (mpdp-naive) times 2 clip / n (replace-one record)."""
    from protocols.config import RunConfig
    from protocols.floor import ETA_SHARE, mpddp_floor, mpdp_naive_sigma
    from protocols.mpddp import mp_record_sensitivity
    from protocols.privacy import gaussian_epsilon, noise_multiplier
    from server.defaults import app_defaults

    cfg = RunConfig.from_mapping({**app_defaults(), "method": "mpddp", "num-rounds": 30, "clip": 0.5, "epsilon": 1.0})
    z = noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
    assert gaussian_epsilon(z, 1.0, cfg.num_rounds, cfg.delta) <= cfg.epsilon  # the reported epsilon meets the target
    assert mp_record_sensitivity(0.5, 180, adjacency="replace-one") == pytest.approx(2 * 0.5 / 180)  # replace-one
    assert mp_record_sensitivity(0.5, 180, adjacency="zero-out") == pytest.approx(0.5 / 180)
    assert cfg.adjacency == "zero-out" and mpdp_naive_sigma(cfg, 180) == pytest.approx(z * 0.5 / 180)
    se, sd, theta = mpddp_floor(cfg, 10, 180)
    assert theta == pytest.approx(1 / z**2)
    s = 0.5 / 180  # zero-out
    assert se == pytest.approx(s * z / math.sqrt(10 * ETA_SHARE)) and sd == pytest.approx(s * z / math.sqrt(10 * (1 - ETA_SHARE)))
    # the mean's eta noise, sigma_eta / sqrt(K), covers the record sensitivity of the mean, s / K, with multiplier >= z
    assert (se / math.sqrt(10)) / (s / 10) >= z
    # the smallest participant sets the scales: half the size, twice the noise
    assert mpddp_floor(cfg, 10, 90)[0] == pytest.approx(2 * se)
    with pytest.raises(ValueError):
        mp_record_sensitivity(1.0, 0, adjacency="zero-out")


def test_round_event_is_the_accountants_gaussian_or_the_basic_composition_share():
    from protocols.mpddp import max_theta, round_event, round_multiplier
    from protocols.privacy import DpEvent, GaussianEvent, noise_multiplier

    z = noise_multiplier(2.0, 1e-5, 4)
    assert round_multiplier(2.0, 1e-5, 4, complete=True) == z
    assert round_event(2.0, 1e-5, 4, complete=True) == GaussianEvent(z)
    assert round_event(2.0, 1e-5, 4, complete=True, scale=1.5) == GaussianEvent(z * 1.5)
    assert round_multiplier(2.0, 1e-5, 4, complete=False) == max_theta(0.5, 1e-5 / 4) ** -0.5
    assert round_event(2.0, 1e-5, 4, complete=False, scale=3.0) == DpEvent(0.5, 1e-5 / 4)


# --------------------------------------------------------------------------- planned dropouts (dropout-rate)
@pytest.mark.parametrize(("extra", "rate"), [
    ({"num-clients": 10}, 0.1),  # Theorem 10, m = 5 of 10
    ({"num-clients": 100}, 0.05),
    ({"num-clients": 100, "graph": "n-out", "n-out": 95}, 0.1),  # Theorem 11, m = 20 of 100
    ({"num-clients": 200, "graph": "n-out", "n-out": 90, "num-rounds": 3}, 0.2),
])
def test_the_floor_keeps_the_planned_theta_after_up_to_m_dropouts(extra, rate):
    """Both sigmas times mpddp_dropout_factor: recovering up to m dropouts leaves theta_after <= the planned theta.

    The server charges a recovery a shortfall when ``theta_after`` (the same function, the survivors' count) exceeds
    the round's theta (strategies.mpddp); the plan without the rate is short by far after m dropouts.
    """
    from protocols.config import RunConfig
    from protocols.dropouts import dropout_bound, mpddp_dropout_factor
    from protocols.floor import mpddp_complete, mpddp_floor
    from protocols.mpddp import mp_record_sensitivity, theta_after
    from server.defaults import app_defaults

    def cfg_at(r: float) -> RunConfig:
        return RunConfig.from_mapping({**app_defaults(), "method": "mpddp", **extra, "dropout-rate": r})

    cfg, blind = cfg_at(rate), cfg_at(0.0)
    k = cfg.clients_per_round
    m, complete = dropout_bound(k, rate), mpddp_complete(cfg, k)
    n_out = cfg.n_out if cfg.graph == "n-out" else None
    assert m >= 1 and complete == (cfg.graph != "n-out")
    (se, sd, theta), (se0, sd0, theta0) = mpddp_floor(cfg, k, 30), mpddp_floor(blind, k, 30)
    factor = mpddp_dropout_factor(se0, sd0, k, rate, complete=complete, n_out=n_out)
    assert theta == theta0 and factor > 1  # the planned theta (the round's charge) is the calibration's
    assert se == pytest.approx(se0 * factor, rel=1e-14) and sd == pytest.approx(sd0 * factor, rel=1e-14)
    if complete:
        assert factor == pytest.approx(math.sqrt(k / (k - m)), rel=1e-11)
    sens = mp_record_sensitivity(cfg.clip, 30, adjacency=cfg.adjacency)
    for survivors in range(k - m, k):
        assert theta_after(se / sens, sd / sens, survivors, complete=complete, n_out=n_out) <= theta, survivors
    assert theta_after(se0 / sens, sd0 / sens, k - m, complete=complete, n_out=n_out) > 1.05 * theta  # without
    # the budget guard's scale on top: sigmas times it, theta over its square, the same dropouts covered
    se2, sd2, theta2 = mpddp_floor(cfg, k, 30, 1.5)
    assert se2 == pytest.approx(1.5 * se, rel=1e-14) and theta2 == pytest.approx(theta / 2.25, rel=1e-14)
    assert theta_after(se2 / sens, sd2 / sens, k - m, complete=complete, n_out=n_out) <= theta2


def test_no_dropout_rate_no_factor_and_an_uncovered_survivor_count_names_the_rate():
    from protocols.dropouts import mpddp_dropout_factor

    for complete, n_out in ((True, None), (False, 95)):
        assert mpddp_dropout_factor(0.3, 0.9, 100, 0.0, complete=complete, n_out=n_out) == 1.0
    with pytest.raises(ValueError, match="dropout-rate"):  # Theorem 11 needs n >= 7 (theta_after refuses)
        mpddp_dropout_factor(0.3, 0.9, 100, 0.1, complete=False, n_out=4)
