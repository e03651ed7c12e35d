"""Theorem 3 samplers: DN*(m)^m x DN(sigma, n)^n products are N(0, sigma^2); truncation error; seeding."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import special, stats

from protocols import prg
from protocols.mpddp import samplers as S
from protocols.pairwise import pairwise_noise

MASTER = bytes(range(32))
# KS acceptance uses p > 1e-3 with fixed seeds (deterministic); negative controls need p < 1e-6.


def seed(label: str) -> bytes:
    return prg.derive_subseed(MASTER, label)


@pytest.mark.parametrize(
    ("m", "n", "size", "terms"),
    [(1, 1, 20000, 100), (2, 1, 20000, 100), (1, 2, 20000, 100), (2, 2, 20000, 100), (3, 1, 4000, 30)],
)
def test_product_is_gaussian(m: int, n: int, size: int, terms: int) -> None:
    sigma = 2.5
    prod = np.ones(size)
    for i in range(m):
        prod *= S.sample_dn_star(seed(f"x{m}{n}{i}"), size, m, terms=terms)
    for j in range(n):
        prod *= S.sample_dn(seed(f"y{m}{n}{j}"), size, sigma, n)
    assert stats.kstest(prod, "norm", args=(0.0, sigma)).pvalue > 1e-3
    assert abs(prod.std() / sigma - 1.0) < 0.05


def test_server_magnitudes_keep_product_gaussian() -> None:
    """r, s are drawn as |DN*| (positive, for ReLU); the sign of eta alone keeps the product N(0, sigma^2)."""
    size = 20000
    prod = (
        S.sample_dn_star(seed("r"), size, 2, signed=False)
        * S.sample_dn_star(seed("s"), size, 2, signed=False)
        * S.sample_dn(seed("eta"), size, 0.7)
    )
    assert stats.kstest(prod, "norm", args=(0.0, 0.7)).pvalue > 1e-3


def test_negative_control_plain_gaussian_times_dn_star_is_not_gaussian() -> None:
    """MP-DP-Naive's problem (Sec. 3.3.2): R o N(0, sigma^2) is not N(0, sigma^2); the KS test sees it."""
    size = 20000
    prod = S.sample_dn_star(seed("r"), size, 1, signed=False) * prg.gaussian(seed("g"), size, 1.0)
    assert stats.kstest(prod, "norm", args=(0.0, 1.0)).pvalue < 1e-6


def test_dn_one_is_symmetric_uniform() -> None:
    sigma = 3.0
    x = S.sample_dn(seed("u"), 50000, sigma)
    bound = np.sqrt(2.0) * sigma
    assert np.all(np.abs(x) < bound)
    assert stats.kstest(x, "uniform", args=(-bound, 2 * bound)).pvalue > 1e-3


def test_dn_star_one_closed_form_matches_theorem3_series() -> None:
    """|DN*(1)| = sqrt(Gamma(3/2)) equals the series of Theorem 3 in law (two-sample KS and cf)."""
    closed = np.log(S.sample_dn_star(seed("c"), 20000, 1, signed=False))
    series = S._series_log_magnitude(seed("s1"), 20000, 1, 100)
    assert stats.ks_2samp(closed, series).pvalue > 1e-3
    assert S.dn_star_cf_error(1, 100) < 1e-6


@pytest.mark.parametrize("m", [2, 3])
def test_truncation_error_documented_bound(m: int) -> None:
    """The compensated truncation is ~N^-3 accurate in cf; plain truncation would be ~N^-1."""
    err_100 = S.dn_star_cf_error(m, 100)
    assert err_100 < 5e-6 if m == 3 else err_100 < 1e-6
    assert S.dn_star_cf_error(m, 200) < err_100 / 6  # cubic convergence
    assert S.dn_star_cf_error(m, 100, compensate=False) > 1e-3  # the tail term matters


def test_series_log_moments_match_exact_cumulants() -> None:
    m = 2
    lx = np.log(S.sample_dn_star(seed("mom"), 40000, m, signed=False))
    mean, var = special.digamma(1.5) / (2 * m), special.polygamma(1, 1.5) / (4 * m)
    assert abs(lx.mean() - mean) < 4 * np.sqrt(var / lx.size)
    assert abs(lx.var() / var - 1) < 0.03


def test_seeded_and_deterministic() -> None:
    a = S.sample_dn_star(seed("d"), 100, 2)
    assert np.array_equal(a, S.sample_dn_star(seed("d"), 100, 2))
    assert not np.array_equal(a, S.sample_dn_star(seed("e"), 100, 2))
    assert np.array_equal(S.dn_unit_sampler(seed("d"), 64), S.dn_sampler(1.0)(seed("d"), 64))
    with pytest.raises(ValueError):
        S.sample_dn(b"short", 3, 1.0)


def test_dn_sampler_as_pairwise_sampler_cancels() -> None:
    """Delta_{k,v} = -Delta_{v,k} through the shared pairwise engine: the pair sums to exactly zero."""
    s = seed("pair")
    a = pairwise_noise(3, {7: s}, 1000, sampler=S.dn_unit_sampler, scale=4.0)
    b = pairwise_noise(7, {3: s}, 1000, sampler=S.dn_unit_sampler, scale=4.0)
    assert np.array_equal(a, -b)
    assert np.all(np.abs(a) < 4.0 * np.sqrt(2.0))
