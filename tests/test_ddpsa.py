"""DDP-SA Laplace LDP step (Algorithm 2) and multi-round composition (Theorem 2, Eq. 12)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from protocols.ddpsa import (
    l1_clip,
    laplace_noise,
    ldp_noisy_mean,
)
from protocols.privacy import (
    advanced_composition,
    basic_composition,
    compose_advanced,
    compose_basic,
    exponential_allocation,
    l1_sensitivity,
    laplace_scale,
    per_round_epsilons,
    uniform_allocation,
)


def _seed(label: int) -> bytes:
    return bytes([label]) * 32


# ----------------------------------------------------------------------------- clipping
def test_l1_clip_bounds_norm_and_keeps_direction() -> None:
    rng = np.random.default_rng(0)
    g = rng.normal(size=(64, 5, 3)) * rng.uniform(0.01, 3.0, size=(64, 1, 1))
    g[0] = 0.0
    clip = 2.0
    out = l1_clip(g, clip)
    norms_in = np.abs(g).reshape(64, -1).sum(1)
    norms_out = np.abs(out).reshape(64, -1).sum(1)
    assert norms_out.max() <= clip * (1 + 1e-12)
    big = norms_in > clip
    assert big.any() and (~big).any()
    np.testing.assert_allclose(norms_out[big], clip, rtol=1e-12)  # clipped exactly onto the ball
    np.testing.assert_array_equal(out[~big], g[~big])  # small samples untouched
    ratio = out[big].reshape(big.sum(), -1) / g[big].reshape(big.sum(), -1)
    np.testing.assert_allclose(ratio, ratio[:, :1] * np.ones_like(ratio), rtol=1e-12)  # same direction
    with pytest.raises(ValueError):
        l1_clip(g, 0.0)


# ------------------------------------------------------------------------------ Laplace
def test_laplace_noise_passes_ks_with_scale_delta_over_eps() -> None:
    clip, eps = 0.5, 0.1
    b = laplace_scale(clip, eps)
    assert b == pytest.approx(5.0)
    x = laplace_noise(50_000, b, seed=_seed(1))
    assert stats.kstest(x, stats.laplace(scale=b).cdf).pvalue > 1e-3
    # The test has power: a 10 % wrong scale or a Gaussian of equal variance is rejected.
    assert stats.kstest(x, stats.laplace(scale=1.1 * b).cdf).pvalue < 1e-6
    assert stats.kstest(x, stats.norm(scale=math.sqrt(2) * b).cdf).pvalue < 1e-6
    # Unseeded calls use fresh CSPRNG seeds.
    assert not np.array_equal(laplace_noise(10, 1.0), laplace_noise(10, 1.0))
    np.testing.assert_array_equal(laplace_noise(10, 1.0, seed=_seed(2)), laplace_noise(10, 1.0, seed=_seed(2)))


def test_ldp_noisy_mean_is_clipped_sum_plus_laplace_over_n() -> None:
    rng = np.random.default_rng(2)
    batch, d, clip, eps = 32, 20_000, 1.0, 0.5
    g = rng.normal(size=(batch, d)) * 1e-4
    g[:4] *= 1e3  # some samples exceed the L1 threshold
    out = ldp_noisy_mean(g, clip, eps, adjacency="replace-one", seed=_seed(3))
    assert out.shape == (d,)
    residual = out * batch - l1_clip(g, clip).sum(0)
    # Replace-one adjacency (N_i is published): scale 2 Delta / eps, twice the paper's Delta / eps.
    assert stats.kstest(residual, stats.laplace(scale=2 * clip / eps).cdf).pvalue > 1e-3
    assert stats.kstest(residual, stats.laplace(scale=clip / eps).cdf).pvalue < 1e-6
    with pytest.raises(ValueError):
        ldp_noisy_mean(g, clip, 0.0, adjacency="replace-one")


def test_clipped_sum_l1_sensitivity_is_two_delta_under_replace_one() -> None:
    """Replacing one sample moves the clipped sum by at most 2 Delta in L1, and that bound is reached."""
    rng = np.random.default_rng(4)
    clip = 0.7
    assert l1_sensitivity(clip, adjacency="replace-one") == pytest.approx(2 * clip)
    g = rng.normal(size=(50, 30))
    worst = 0.0
    for _ in range(200):
        h = g.copy()
        h[rng.integers(50)] = rng.normal(size=30) * rng.uniform(0.01, 100)
        worst = max(worst, float(np.abs(l1_clip(g, clip).sum(0) - l1_clip(h, clip).sum(0)).sum()))
    assert worst <= l1_sensitivity(clip, adjacency="replace-one") * (1 + 1e-12)
    h = g.copy()
    h[0] = -g[0]  # a sample replaced by its opposite, both clipped onto the ball: exactly 2 Delta apart
    assert np.abs(l1_clip(g, clip).sum(0) - l1_clip(h, clip).sum(0)).sum() == pytest.approx(2 * clip)
    with pytest.raises(ValueError):
        l1_sensitivity(0.0, adjacency="replace-one")


# --------------------------------------------------------------------------- composition
def test_theorem2_basic_and_advanced_match_paper_example() -> None:
    b = basic_composition(0.1, 1e-6, 1000)
    assert (b.epsilon, b.delta) == pytest.approx((100.0, 1e-3))
    a = advanced_composition(0.1, 0.0, 1000, 1e-4)  # paper: eps_total ~= 24.09
    assert a.epsilon == pytest.approx(24.09, abs=5e-3)
    assert a.delta == pytest.approx(1e-4)
    # Heterogeneous forms reduce to Theorem 2 for a constant schedule.
    assert compose_advanced([0.1] * 1000, delta_prime=1e-4).epsilon == pytest.approx(a.epsilon, rel=1e-12)
    assert compose_basic([0.1] * 1000, 1e-6).epsilon == pytest.approx(100.0)


def test_eq12_exponential_allocation() -> None:
    eps = exponential_allocation(4.0, 10, 0.8)
    assert eps.sum() == pytest.approx(4.0, rel=1e-12)
    np.testing.assert_allclose(eps[1:] / eps[:-1], 0.8, rtol=1e-12)
    np.testing.assert_allclose(eps, 4.0 * 0.8 ** np.arange(10) / sum(0.8**i for i in range(10)), rtol=1e-12)
    np.testing.assert_allclose(exponential_allocation(4.0, 10, 1.0), uniform_allocation(4.0, 10))
    assert np.isfinite(exponential_allocation(1.0, 5000, 1e-3)).all()
    with pytest.raises(ValueError):
        exponential_allocation(1.0, 10, 0.0)


@pytest.mark.parametrize("allocation", ["uniform", "exponential"])
def test_per_round_epsilons_fit_total_budget(allocation: str) -> None:
    total_eps, total_delta, rounds = 10.0, 1e-5, 1000
    basic = per_round_epsilons(total_eps, total_delta, rounds, allocation=allocation, alpha=0.995)
    assert basic.composition == "basic"
    assert basic.epsilons.sum() == pytest.approx(total_eps, rel=1e-12)
    adv = per_round_epsilons(total_eps, total_delta, rounds, allocation=allocation, alpha=0.995, composition="advanced")
    assert adv.delta_prime == pytest.approx(total_delta)
    spent = compose_advanced(adv.epsilons, delta_prime=adv.delta_prime)
    assert spent.epsilon <= total_eps and spent.epsilon == pytest.approx(total_eps, rel=1e-9)
    assert adv.spent.epsilon == pytest.approx(spent.epsilon)
    np.testing.assert_allclose(adv.epsilons / adv.epsilons.sum(), basic.epsilons / total_eps, rtol=1e-12)  # same shape
    assert adv.epsilons[0] > 3 * basic.epsilons[0]  # advanced composition buys larger eps_t for long runs
    best = per_round_epsilons(total_eps, total_delta, rounds, allocation=allocation, alpha=0.995, composition="best")
    assert best.composition == "advanced"


def test_per_round_epsilons_best_uses_basic_for_short_runs_and_validates() -> None:
    best = per_round_epsilons(1.0, 1e-5, 3, composition="best")
    assert best.composition == "basic"  # advanced composition is looser for tiny T
    np.testing.assert_allclose(best.epsilons, 1.0 / 3)
    with pytest.raises(ValueError, match="delta_per_round"):
        per_round_epsilons(1.0, 1e-5, 10, delta_per_round=1e-5)
    with pytest.raises(ValueError, match="delta'"):
        per_round_epsilons(1.0, 0.0, 10, composition="advanced")
    with pytest.raises(ValueError):
        per_round_epsilons(1.0, 1e-5, 10, allocation="linear")  # type: ignore[arg-type]
