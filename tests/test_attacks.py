"""Attacks used by the benchmark: SSIM, gradient inversion (DLG/iDLG + analytic), membership inference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.adversary.dlg import infer_label, invert, param_gradient
from benchmarks.adversary.membership import auc, loss_threshold_attack, per_sample_loss
from benchmarks.adversary.ssim import ssim
from protocols.task.data import load_dataset
from protocols.task.models import build_model


# ------------------------------------------------------------------------------ SSIM
def _image(seed: int = 0, side: int = 16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side]
    return np.sin(xx / 3.0) + np.cos(yy / 4.0) + 0.3 * rng.standard_normal((side, side))


def test_ssim_identical_is_one_and_symmetric():
    a, b = _image(0), _image(1)
    assert ssim(a, a, data_range=4.0) == pytest.approx(1.0, abs=1e-12)
    assert ssim(a, b, data_range=4.0) == pytest.approx(ssim(b, a, data_range=4.0), abs=1e-12)
    assert ssim(a, b, data_range=4.0) < 0.9


def test_ssim_full_uniform_window_equals_global_formula():
    """One window covering the image = Wang et al.'s formula on global (sample) statistics."""
    a, b = _image(2, 8), _image(3, 8)
    L = 5.0
    c1, c2 = (0.01 * L) ** 2, (0.03 * L) ** 2
    ma, mb = a.mean(), b.mean()
    va, vb = a.var(ddof=1), b.var(ddof=1)
    cov = np.sum((a - ma) * (b - mb)) / (a.size - 1)
    expected = (2 * ma * mb + c1) * (2 * cov + c2) / ((ma**2 + mb**2 + c1) * (va + vb + c2))
    assert ssim(a, b, data_range=L, win_size=8, sigma=None) == pytest.approx(expected, rel=1e-12)


def test_ssim_constant_images_reduce_to_luminance_term():
    a, b = np.full((10, 10), 0.2), np.full((10, 10), 0.7)
    c1 = 0.01**2
    assert ssim(a, b, data_range=1.0) == pytest.approx((2 * 0.2 * 0.7 + c1) / (0.2**2 + 0.7**2 + c1), rel=1e-12)


def test_ssim_decreases_with_noise_and_rejects_bad_input():
    a = _image(4, 28)
    rng = np.random.default_rng(5)
    scores = [ssim(a, a + s * rng.standard_normal(a.shape), data_range=4.0) for s in (0.05, 0.3, 1.0, 3.0)]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0.9 and scores[-1] < 0.2
    with pytest.raises(ValueError):
        ssim(a, a[:-1], data_range=1.0)
    with pytest.raises(ValueError):
        ssim(a, a, data_range=0.0)


# ----------------------------------------------------------------- gradient inversion
@pytest.fixture(scope="module")
def digits_target():
    torch.manual_seed(0)
    ds = load_dataset("digits")
    model = build_model("mlp", ds.input_shape, ds.num_classes, (32,), seed=1).double()
    x, y = ds.x_train[3], int(ds.y_train[3])
    g = [t.detach().numpy() for t in param_gradient(model, torch.as_tensor(x[None]).double(), torch.tensor([y]),
                                                    loss="ce", num_classes=10)]
    return model, x, y, g, (float(ds.x_train.min()), float(ds.x_train.max()))


def test_dlg_reconstructs_a_clean_one_sample_gradient(digits_target):
    model, x, y, g, vr = digits_target
    assert infer_label(model, g) == y
    rep = invert(model, g, truth=x, label_true=y, num_classes=10, value_range=vr, restarts=1, iterations=150,
                 matches=("l2",))
    dlg = [c for c in rep.candidates if c.variant == "dlg-l2"][0]
    assert dlg.ssim > 0.95 and dlg.mse < 1e-3  # L-BFGS DLG alone recovers the image
    analytic = [c for c in rep.candidates if c.variant == "analytic"][0]
    assert analytic.mse < 1e-20  # exact: dW1[i] / db1[i] = x


def test_dlg_fails_on_a_heavily_noised_gradient(digits_target):
    model, x, y, g, vr = digits_target
    rng = np.random.default_rng(0)
    norm = np.sqrt(sum(float(np.sum(a**2)) for a in g))
    noisy = [a + 10 * norm / np.sqrt(a.size) * rng.standard_normal(a.shape) for a in g]  # DP-like noise
    rep = invert(model, noisy, truth=x, label_true=y, num_classes=10, value_range=vr, restarts=1, iterations=150)
    assert rep.best.ssim < 0.3  # even the best of every start and variant is no reconstruction


def test_label_inference_for_squared_loss(digits_target):
    model, x, y, _, _ = digits_target
    g = [t.detach().numpy() for t in param_gradient(model, torch.as_tensor(x[None]).double(), torch.tensor([y]),
                                                    loss="mse", num_classes=10)]
    assert infer_label(model, g) == y


# ---------------------------------------------------------------- membership inference
def test_membership_attack_separates_and_guesses():
    rng = np.random.default_rng(0)
    members, non = rng.exponential(0.05, 2000), rng.exponential(1.0, 2000)
    res = loss_threshold_attack(members, non, seed=1)
    assert res.accuracy > 0.85 and res.auc > 0.9 and res.yeom_accuracy > 0.7
    same = loss_threshold_attack(rng.exponential(1.0, 2000), rng.exponential(1.0, 2000), seed=1)
    assert abs(same.accuracy - 0.5) < 0.05 and abs(same.auc - 0.5) < 0.05


def test_auc_exact_values():
    assert auc(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 1.0
    assert auc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 0.0
    assert auc(np.array([1.0, 1.0]), np.array([1.0, 1.0])) == 0.5
    assert auc(np.array([0.0, 2.0]), np.array([1.0, 3.0])) == 0.75


def test_per_sample_loss_matches_cross_entropy(digits_target):
    model, *_ = digits_target
    ds = load_dataset("digits")
    losses = per_sample_loss(lambda t: model(t.double()), ds.x_test[:50], ds.y_test[:50])
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(torch.as_tensor(ds.x_test[:50]).double()),
                                                torch.as_tensor(ds.y_test[:50]))
    assert losses.mean() == pytest.approx(float(ref), rel=1e-9)


# ------------------------------------------------------------- uplink on the real code path
def test_uplink_capture_recovers_fedavg_gradient_exactly(tmp_path):
    from benchmarks.adversary.uplink import attacker_view, capture_first_round, true_gradient

    cap = capture_first_round({"method": "fedavg", "num-clients": 6, "hidden": "16", "out-dir": str(tmp_path)})
    assert cap.x.shape == (1, 8, 8)
    g_hat, g = attacker_view(cap).gradient, true_gradient(cap)
    for k in g:  # float32 upload: exact up to rounding / lr
        np.testing.assert_allclose(g_hat[k], g[k], atol=2e-5)


def test_mpcdp_server_recovers_one_clients_exact_gradient(tmp_path):
    """The MP server knows R: recovering ONE noise-free upload gives that client's exact gradient."""
    from benchmarks.adversary.uplink import attacker_view, capture_first_round, true_gradient

    # float64 side information: exact recovery (the float32 default rounds Psi/Phi, recovery error ~1e-4)
    # (clip 1e3: no example is clipped, so the upload is the client's true mean gradient)
    cap = capture_first_round({"method": "mpcdp", "num-clients": 4, "hidden": "16", "mpddp-side-dtype": "float64",
                               "clip": 1e3, "out-dir": str(tmp_path / "f64")})
    view, g = attacker_view(cap), true_gradient(cap)
    assert view.noise_scale is None  # no client-side noise to weight
    for k in g:
        np.testing.assert_allclose(view.gradient[k], g[k], rtol=1e-8, atol=1e-10)
    # the default float32 side information leaks the same gradient up to float32 rounding
    cap = capture_first_round({"method": "mpcdp", "num-clients": 4, "hidden": "16", "clip": 1e3,
                               "out-dir": str(tmp_path / "f32")})
    assert cap.cfg.mpddp_side_dtype == "float32"
    view, g = attacker_view(cap), true_gradient(cap)
    for k in g:
        np.testing.assert_allclose(view.gradient[k], g[k], rtol=0, atol=1e-3 * float(np.max(np.abs(g[k]))))


def test_every_auditable_method_declares_its_uplink_view_on_its_adapter():
    """The attacker's view of an upload comes from the method's own adapter.

    A method without an adapter (only one without DP) gets the default: the upload read as a plain local model.
    """
    from benchmarks.adversary.uplink import adapter_of, training_loss
    from protocols.methods import METHODS
    from server.audit_adapter import AuditAdapter

    for name, spec in METHODS.items():
        adapter = adapter_of(name)
        if spec.audit is None:
            assert type(adapter) is AuditAdapter and not spec.units, name
        else:
            assert type(adapter).gradient_view is not AuditAdapter.gradient_view, name
    assert {m for m in METHODS if training_loss(m) == "mse"} == {m for m, s in METHODS.items() if s.family == "mpddp"}


def test_membership_attack_on_a_diverged_model_is_guessing():
    """NaN losses (a model that blew up) count as large losses: no signal, accuracy 0.5, not 0."""
    nan = np.full(100, np.nan)
    res = loss_threshold_attack(nan, nan, seed=0)
    assert res.accuracy == 0.5 and res.auc == 0.5 and res.yeom_accuracy == 0.5
