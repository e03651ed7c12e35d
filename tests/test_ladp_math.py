"""Tests for protocols.ladp.

KL privacy estimate, layer selection, Theorem 3 constant, per-layer sigma, noise
application and the comparison with full LDP.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from scipy.special import rel_entr, softmax

from protocols import ladp
from protocols.privacy import analytic_gaussian_sigma, gaussian_delta

# Delta_f = 8: Theorem 2 at the paper's Sec. VII-A setting (the client passes the record-level bound instead).
TRAIN = dict(sensitivity=ladp.sensitivity(lr=0.1, local_steps=2, grad_clip=20.0))


# ------------------------------------------------------------------ KL estimate
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 2, 3, 3)])
def test_kl_matches_scipy_rel_entr(scale: float, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng([int(scale * 100), *shape])
    a = rng.normal(size=shape) * scale
    b = a + rng.normal(size=shape) * scale * 0.3
    expected = float(np.sum(rel_entr(softmax(a.ravel()), softmax(b.ravel()))))
    got = ladp.softmax_kl(a, b)
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert got > 0


def test_kl_properties_and_stability() -> None:
    a = np.array([[1.0, 2.0], [3.0, -1.0]])
    assert ladp.softmax_kl(a, a) == 0.0
    assert ladp.softmax_kl(a, a + 123.0) == pytest.approx(0.0, abs=1e-12)  # shift invariance
    b = a * 2
    assert ladp.softmax_kl(a, b) != pytest.approx(ladp.softmax_kl(b, a))  # direction matters
    # Hand value: softmax([0,0]) = (1/2, 1/2), softmax([0, ln 3]) = (1/4, 3/4).
    assert ladp.softmax_kl(np.zeros(2), np.array([0.0, math.log(3)])) == pytest.approx(0.5 * math.log(4 / 3), rel=1e-14)
    # Huge weights would overflow a naive exp(); softmax probabilities underflowing to 0
    # make rel_entr infinite; the log-domain estimate stays exact (KL = 1005 / (1 + e^-1))
    big = np.array([1000.0, 999.0, -5.0])
    assert np.isinf(np.sum(rel_entr(softmax(big), softmax(big[::-1]))))
    kl = ladp.softmax_kl(big, big[::-1].copy())
    p = softmax(big)
    lp = big - 1000.0 - math.log1p(math.exp(-1.0))
    lq = big[::-1] - 1000.0 - math.log1p(math.exp(-1.0))
    assert kl == pytest.approx(float(np.sum(p * (lp - lq))), rel=1e-12)
    assert kl == pytest.approx(1005 / (1 + math.exp(-1)), rel=1e-12)
    assert ladp.privacy_estimate(big, big[::-1].copy(), kl_cap=0.5) == 0.5
    with pytest.raises(ValueError):
        ladp.softmax_kl(np.zeros(3), np.zeros(4))


# ------------------------------------------------------------------ layer selection
def test_layer_selection_threshold() -> None:
    local = {"a": np.array([3.0, 4.0]), "b": np.array([0.3, 0.4]), "c": np.array([6.0, 8.0])}
    glob = {k: v + 0.5 for k, v in local.items()}
    kw = dict(epsilon=0.5, delta=1e-5, kl_cap=1.0, **TRAIN)
    plan = ladp.plan_layer_noise(local, glob, norm_threshold=5.0, **kw)  # ||a|| == 5 exactly
    assert [plan[k].selected for k in "abc"] == [True, False, True]
    assert plan["b"].sigma == 0.0 and plan["b"].kl is None
    assert plan["a"].norm == 5.0 and plan["a"].sigma > 0
    plan = ladp.plan_layer_noise(local, glob, norm_threshold=np.nextafter(5.0, 6.0), **kw)
    assert [plan[k].selected for k in "abc"] == [False, False, True]
    plan = ladp.plan_layer_noise(local, glob, norm_threshold=0.0, **kw)
    assert all(p.selected for p in plan.values())


# ------------------------------------------------------------------ sigma formula
def test_sensitivity() -> None:
    assert ladp.sensitivity(0.1, 2, 20.0) == pytest.approx(8.0)
    for bad in [(0.0, 2, 1.0), (0.1, 0, 1.0), (0.1, 1.5, 1.0), (0.1, 2, -1.0)]:
        with pytest.raises(ValueError):
            ladp.sensitivity(*bad)
    local = {"w": np.ones(3)}
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            ladp.plan_layer_noise(local, local, epsilon=0.5, delta=1e-5, sensitivity=bad, norm_threshold=0.0,
                                  kl_cap=1.0)


def test_record_level_sensitivity_replaces_theorem2() -> None:
    """One full-batch per-example-clipped step: Delta_f = 2 G_c eta / N_i, N_i times below Theorem 2's 2 eta E G_c."""
    from types import SimpleNamespace

    from protocols.privacy import record_sensitivity

    cfg = SimpleNamespace(clip=1.0, lr=4.0, local_epochs=1, batch_size=1_000_000, adjacency="replace-one")
    for n in (1, 144, 600):
        sens = record_sensitivity(cfg, n)
        assert sens == pytest.approx(2 * 1.0 * 4.0 / n, rel=1e-12)
        assert sens == pytest.approx(ladp.sensitivity(4.0, 1, 1.0) / n, rel=1e-12)
        plan = ladp.plan_layer_noise({"w": np.arange(3.0)}, {"w": np.zeros(3)}, epsilon=0.5, delta=1e-5,
                                     sensitivity=sens, norm_threshold=0.0, kl_cap=1e-9)
        # P = B (the KL is far above the cap): sigma = c0 Delta_f / eps with the record-level Delta_f.
        assert plan["w"].sigma == pytest.approx(ladp.theorem3_c0_corrected(0.5, 1e-5) * sens / 0.5, rel=1e-12)


def test_sigma_matches_hand_computation() -> None:
    eps, delta, cap = 0.5, 1e-5, 0.2
    local = {"w": np.zeros(2)}
    glob = {"w": np.array([0.0, math.log(3)])}
    kl = 0.5 * math.log(4 / 3)  # 0.1438 < cap
    plan = ladp.plan_layer_noise(local, glob, epsilon=eps, delta=delta, norm_threshold=0.0, kl_cap=cap, **TRAIN)
    # corrected Theorem 3: L = sqrt(ln(2/(pi d^2))) = 4.6039..., c0 = (L + sqrt(L^2 + 2e))/2
    big_l = math.sqrt(math.log(2 / (math.pi * 1e-10)))
    c0 = (big_l + math.sqrt(big_l**2 + 1.0)) / 2
    assert c0 == pytest.approx(4.80329, abs=1e-5)
    expected = c0 * cap * 8.0 / (eps * kl)
    assert plan["w"].kl == pytest.approx(kl, rel=1e-13)
    assert plan["w"].sigma == pytest.approx(expected, rel=1e-12)
    # KL above the cap: P = B, sigma = c0 * Delta_f / eps (cap cancels).
    plan = ladp.plan_layer_noise(local, glob, epsilon=eps, delta=delta, norm_threshold=0.0, kl_cap=0.01, **TRAIN)
    assert plan["w"].privacy == 0.01
    assert plan["w"].sigma == pytest.approx(c0 * 8.0 / eps, rel=1e-12)


def test_paper_constant_verbatim() -> None:
    # delta <= sqrt(2/(pi e^4)) ~ 0.108: first branch of Eq. (11).
    l2 = math.log(2 / (math.pi * 0.02**2))
    assert ladp.theorem3_c0_paper(0.2, 0.02) == pytest.approx((math.sqrt(l2) + math.sqrt(l2 + 1.6)) / 4, rel=1e-14)
    assert ladp.theorem3_c(0.2, 0.02, 3.0, "paper") == pytest.approx(3.0 * (math.sqrt(l2) + math.sqrt(l2 + 1.6)) / 4, rel=1e-14)
    assert ladp.theorem3_c0_paper(0.2, 0.3) == pytest.approx((1 + math.sqrt(1.4)) / 2, rel=1e-14)


def test_theorem3_constant_privacy() -> None:
    """With P = B (least noise) sigma = c0 Delta/eps; check the exact Gaussian delta."""
    for delta in [1e-9, 1e-5, 1e-3, 0.02, 0.1, 0.3, 0.7]:
        for eps in [0.05, 0.2, 0.5, 0.99, 2.0, 8.0]:
            c0 = ladp.theorem3_c(eps, delta, 1.0, "corrected")
            assert gaussian_delta(c0 / eps, eps) <= delta
            c0_an = ladp.theorem3_c(eps, delta, 1.0, "analytic")
            assert c0_an <= c0 * (1 + 1e-12)
            assert gaussian_delta(c0_an / eps, eps) == pytest.approx(delta, rel=1e-6)
    # The paper's Eq. (11) is not (eps, delta)-DP: exact delta 5.6e-4 >> 1e-5.
    c0_paper = ladp.theorem3_c0_paper(0.5, 1e-5)
    assert gaussian_delta(c0_paper / 0.5, 0.5) > 50 * 1e-5


def test_invalid_inputs_refused() -> None:
    local = {"w": np.ones(3)}
    kw = dict(norm_threshold=0.0, kl_cap=1.0, **TRAIN)
    for eps, delta in [(0.0, 1e-5), (-1.0, 1e-5), (math.inf, 1e-5), (0.5, 0.0), (0.5, 1.0)]:
        with pytest.raises(ValueError):
            ladp.plan_layer_noise(local, local, epsilon=eps, delta=delta, **kw)
    with pytest.raises(ValueError):
        ladp.plan_layer_noise(local, local, epsilon=0.5, delta=1e-5, norm_threshold=0.0, kl_cap=0.0, **TRAIN)
    with pytest.raises(ValueError):
        ladp.plan_layer_noise(local, {"w": np.ones(4)}, epsilon=0.5, delta=1e-5, **kw)
    with pytest.raises(ValueError):
        ladp.plan_layer_noise(local, {"v": np.ones(3)}, epsilon=0.5, delta=1e-5, **kw)
    with pytest.raises(ValueError):
        ladp.full_ldp_plan(local, epsilon=1.0, delta=1e-5, **TRAIN)  # Theorem 1 needs eps < 1


def test_zero_kl_is_floored_not_infinite() -> None:
    local = {"w": np.ones(4)}
    plan = ladp.plan_layer_noise(local, local, epsilon=0.5, delta=1e-5, norm_threshold=0.0, kl_cap=1e-3, min_kl=1e-9, **TRAIN)
    assert plan["w"].kl == 0.0 and plan["w"].privacy == 1e-9
    assert plan["w"].sigma == pytest.approx(ladp.theorem3_c0_corrected(0.5, 1e-5) * 1e6 * 8.0 / 0.5, rel=1e-12)


# ------------------------------------------------------------------ noise application
def _model(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Toy CNN-like model: two big layers, two small-norm layers (biases, BN scale)."""
    glob = {
        "conv.weight": rng.normal(0, 0.2, (16, 1, 5, 5)),
        "conv.bias": rng.normal(0, 0.01, 16),
        "fc.weight": rng.normal(0, 0.1, (10, 400)),
        "fc.bias": rng.normal(0, 0.01, 10),
    }
    local = {k: v + rng.normal(0, 0.05, v.shape) for k, v in glob.items()}
    return {k: v.astype(np.float32) for k, v in local.items()}, glob


def test_apply_noise_distribution_and_reproducibility() -> None:
    rng = np.random.default_rng(1)
    local, glob = _model(rng)
    plan = ladp.plan_layer_noise(local, glob, epsilon=0.5, delta=1e-5, norm_threshold=1.0, kl_cap=1e-4, **TRAIN)
    assert {k for k, p in plan.items() if p.selected} == {"conv.weight", "fc.weight"}
    seed = bytes(range(32))
    noisy, report = ladp.apply_layer_noise(local, plan, seed)
    noisy2, report2 = ladp.apply_layer_noise(local, plan, seed)
    assert report == report2 and all(np.array_equal(noisy[k], noisy2[k]) for k in noisy)
    for name, layer in local.items():
        assert noisy[name].dtype == np.float32 and noisy[name].shape == layer.shape
        if not plan[name].selected:
            assert report[name] == 0.0 and np.array_equal(noisy[name], layer)
            continue
        noise = noisy[name].astype(np.float64) - layer.astype(np.float64)
        # float32 storage: compare in relative terms
        assert np.linalg.norm(noise) == pytest.approx(report[name], rel=1e-5)
        ks = stats.kstest((noise / plan[name].sigma).ravel(), "norm")
        assert ks.pvalue > 1e-3
    _, rep_gen = ladp.apply_layer_noise(local, plan, np.random.default_rng(5))
    fc = plan["fc.weight"]
    assert rep_gen["fc.weight"] == pytest.approx(fc.sigma * math.sqrt(4000), rel=0.05)


def test_ladp_adds_less_noise_than_full_ldp() -> None:
    rng = np.random.default_rng(2)
    local, glob = _model(rng)
    eps, delta = 0.5, 1e-5
    # B below every selected layer's KL, so P = B: sigma_j = c0 Delta/eps.
    kls = [ladp.softmax_kl(local[k], glob[k]) for k in ("conv.weight", "fc.weight")]
    cap = 0.5 * min(kls)
    plan = ladp.plan_layer_noise(local, glob, epsilon=eps, delta=delta, norm_threshold=1.0, kl_cap=cap, **TRAIN)
    full = ladp.full_ldp_plan(local, epsilon=eps, delta=delta, **TRAIN)
    # per layer: corrected c0 (4.80) < sqrt(2 ln(1.25/delta)) (4.84) at these eps/delta
    for name, p in plan.items():
        assert p.sigma < full[name].sigma
    e_ladp = ladp.expected_noise_sq_norm(plan, local)
    e_full = ladp.expected_noise_sq_norm(full, local)
    assert e_ladp < e_full
    _, rep_l = ladp.apply_layer_noise(local, plan, bytes(32))
    _, rep_f = ladp.apply_layer_noise(local, full, bytes(32))
    tot_l = sum(v**2 for v in rep_l.values())
    tot_f = sum(v**2 for v in rep_f.values())
    assert tot_l < tot_f
    assert tot_l == pytest.approx(e_ladp, rel=0.05) and tot_f == pytest.approx(e_full, rel=0.05)
    # Against LaDP's own constant with every layer noised, the saving is exactly the
    # skipped layers' share: LaDP never adds less noise per *selected* layer.
    full_same = ladp.full_ldp_plan(local, epsilon=eps, delta=delta, baseline="corrected", **TRAIN)
    skipped = sum(full_same[k].sigma ** 2 * local[k].size for k, p in plan.items() if not p.selected)
    assert e_ladp == pytest.approx(ladp.expected_noise_sq_norm(full_same, local) - skipped, rel=1e-12)
    # Smaller KL (more similar layers) => more noise (sigma proportional to B/P).
    plan_hi = ladp.plan_layer_noise(local, glob, epsilon=eps, delta=delta, norm_threshold=1.0, kl_cap=10.0, **TRAIN)
    ratio = plan_hi["fc.weight"].sigma / plan["fc.weight"].sigma
    assert ratio == pytest.approx(10.0 / plan_hi["fc.weight"].privacy, rel=1e-12)


def test_analytic_constant_consistency() -> None:
    eps, delta = 2.0, 1e-5
    c = ladp.theorem3_c(eps, delta, 0.3, "analytic")
    assert c == pytest.approx(0.3 * eps * analytic_gaussian_sigma(eps, delta, 1.0), rel=1e-14)


def test_noise_a_narrower_upload_dtype_would_round_away_is_refused():
    """A server-sent model with huge weights: cast to float32 after the noise is added, the noise would vanish."""
    from protocols.ladp import LayerNoise, apply_layer_noise

    plan = {"w": LayerNoise(selected=True, norm=1.0, kl=0.1, privacy=0.1, sigma=0.03)}
    seed = bytes(32)
    huge = {"w": np.full(64, 2.0 ** 24)}
    with pytest.raises(ValueError, match="round away"):
        apply_layer_noise(huge, plan, seed, upload_dtype=np.float32)
    kept, _ = apply_layer_noise(huge, plan, seed)  # float64 keeps it
    assert np.std(kept["w"] - huge["w"]) > 0.01
    small, _ = apply_layer_noise({"w": np.full(64, 3.0)}, plan, seed, upload_dtype=np.float32)
    assert small["w"].dtype == np.float32 and np.std(small["w"] - 3.0) > 0.01


def test_a_grid_refusal_names_the_training_movement_and_epsilon():
    """A zero model is refused when the training movement alone puts the upload where float32 loses the noise."""
    from protocols.ladp import LayerNoise, check_upload_grid

    plan = {"w": LayerNoise(selected=True, norm=1.0, kl=0.1, privacy=0.1, sigma=1e-9)}
    with pytest.raises(ValueError, match=r"values \(up to 0\) plus what local training may move them \(4\).*'epsilon'"):
        check_upload_grid({"w": np.zeros(8)}, plan, 4.0, np.float32)
