"""DDP-SA Laplace LDP step (Algorithm 2) and multi-round composition (Theorem 2, Eq. 12)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from protocols.composition import (
    advanced_composition,
    basic_composition,
    compose_advanced,
    compose_basic,
    exponential_allocation,
    per_round_epsilons,
    uniform_allocation,
)
from protocols.ddpsa import (
    l1_clip,
    l1_clip_torch,
    laplace_noise,
    laplace_scale,
    ldp_noisy_mean,
    ldp_noisy_mean_torch,
    per_sample_gradients,
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


def test_l1_clip_torch_matches_numpy_over_all_parameters() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(16, 4, 3)), rng.normal(size=(16, 7))
    clip = 3.0
    ta, tb = l1_clip_torch([torch.from_numpy(a), torch.from_numpy(b)], clip)
    flat = np.concatenate([a.reshape(16, -1), b], axis=1)
    ref = l1_clip(flat, clip)
    np.testing.assert_allclose(np.concatenate([ta.numpy().reshape(16, -1), tb.numpy()], axis=1), ref, rtol=1e-12)
    f32 = l1_clip_torch([torch.from_numpy(a).float()], clip)[0]
    assert f32.dtype == torch.float32


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
    out = ldp_noisy_mean(g, clip, eps, seed=_seed(3))
    assert out.shape == (d,)
    residual = out * batch - l1_clip(g, clip).sum(0)
    assert stats.kstest(residual, stats.laplace(scale=clip / eps).cdf).pvalue > 1e-3
    with pytest.raises(ValueError):
        ldp_noisy_mean(g, clip, 0.0)


def test_ldp_noisy_mean_torch_matches_definition() -> None:
    rng = np.random.default_rng(3)
    shapes = [(50, 40), (40,), (3, 50, 40)]
    grads = [torch.from_numpy(rng.normal(size=(8, *s))).float() for s in shapes]
    clip, eps = 2.0, 1.0
    out = ldp_noisy_mean_torch(grads, clip, eps, seed=_seed(4))
    assert [o.shape for o in out] == [torch.Size(s) for s in shapes]
    assert all(o.dtype == torch.float32 for o in out)
    clipped = l1_clip_torch(grads, clip)
    residual = torch.cat([(o.double() * 8 - c.double().sum(0)).reshape(-1) for o, c in zip(out, clipped, strict=True)])
    assert stats.kstest(residual.numpy(), stats.laplace(scale=clip / eps).cdf).pvalue > 1e-3


def test_per_sample_gradients_match_loop() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1])
    loss_fn = torch.nn.CrossEntropyLoss()
    psg = per_sample_gradients(model, loss_fn, x, y)
    assert [t.shape[1:] for t in psg] == [p.shape for p in model.parameters()]
    for i in range(5):
        model.zero_grad()
        loss_fn(model(x[i : i + 1]), y[i : i + 1]).backward()
        for t, p in zip(psg, model.parameters(), strict=True):
            torch.testing.assert_close(t[i], p.grad)


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
