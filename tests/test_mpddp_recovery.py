"""MP_Server expansion/perturbation, client gradients + Psi/Phi, exact server recovery (noise off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocols import prg
from protocols.mpddp import (
    ClientUpload,
    aggregate,
    client_gradients,
    client_gradients_autograd,
    clipped_client_gradients,
    draw_secret,
    expand,
    forward_expanded,
    forward_mlp,
    mp_server,
    mse_loss,
    mu_server,
    one_hot,
    per_example_grad_norms,
    perturb,
    recover,
    relative_distance,
)
from protocols.server_optimizers import make_server_optimizer

DIMS = [[5, 7, 3], [6, 8, 9, 4], [10, 12, 7, 9, 5], [20, 16, 10]]


def rand_mlp(
    dims: list[int], gen: torch.Generator, dtype: torch.dtype = torch.float64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            torch.randn(dims[i + 1], dims[i], generator=gen, dtype=dtype) / dims[i] ** 0.5,
            0.1 * torch.randn(dims[i + 1], generator=gen, dtype=dtype),
        )
        for i in range(len(dims) - 1)
    ]


def rand_batch(dims: list[int], n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, dims[0], generator=gen, dtype=torch.float64)
    y = one_hot(torch.randint(0, dims[-1], (n,), generator=gen), dims[-1])
    return x, y


def true_grads(layers, x, y):
    """Plain autograd on the unexpanded MLP with the paper's MSE loss."""
    params = [(w.clone().requires_grad_(True), b.clone().requires_grad_(True)) for w, b in layers]
    flat = [t for p in params for t in p]
    g = torch.autograd.grad(mse_loss(forward_mlp(params, x), y), flat)
    return [(g[2 * i], g[2 * i + 1]) for i in range(len(layers))]


def max_rel_err(got, want) -> float:
    return max(float((a - b).norm() / b.norm()) for gp, wp in zip(got, want, strict=True) for a, b in zip(gp, wp, strict=True))


def seed(label: str) -> bytes:
    return prg.derive_subseed(bytes(32), label)


@pytest.mark.parametrize("dims", DIMS)
def test_expansion_preserves_function(dims: list[int]) -> None:
    """Theorem 4 / Eq. (12): the 2L-1 layer model with identity transitional layers computes the same output."""
    gen = torch.Generator().manual_seed(1)
    layers = rand_mlp(dims, gen)
    x, _ = rand_batch(dims, 16, gen)
    torch.testing.assert_close(forward_expanded(expand(layers), x), forward_mlp(layers, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dims", DIMS)
def test_theorem12_perturbed_output(dims: list[int]) -> None:
    """y^(2L-1) = y + alpha r with alpha = sum of the final layer's (perturbed) input."""
    gen = torch.Generator().manual_seed(2)
    layers = rand_mlp(dims, gen)
    x, _ = rand_batch(dims, 16, gen)
    w_hat, secret = mp_server(layers, seed(f"t12{dims}"))
    out, last_in = forward_expanded(w_hat, x, return_last_input=True)
    expected = forward_mlp(layers, x) + last_in.sum(1, keepdim=True) * secret.r_vec
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dims", DIMS)
def test_noise_free_recovery_equals_true_gradient(dims: list[int]) -> None:
    """Acceptance: Eq. (22) on the aggregate of K clients == plain autograd mean gradient (1e-6 relative)."""
    gen = torch.Generator().manual_seed(3)
    layers = rand_mlp(dims, gen)
    batches = [rand_batch(dims, 8 + 5 * k, gen) for k in range(4)]
    w_hat, secret = mp_server(layers, seed(f"rec{dims}"))
    uploads = [client_gradients(w_hat, x, y) for x, y in batches]
    rec = recover(aggregate(uploads), secret)
    per_client = [true_grads(layers, x, y) for x, y in batches]
    want = [tuple(sum(c[i][j] for c in per_client) / len(batches) for j in range(2)) for i in range(len(layers))]
    err = max_rel_err(rec, want)
    assert err < 1e-6, err
    # Single client too (per-client recovery is exactly what the server could do without DP noise).
    assert max_rel_err(recover(uploads[0], secret), per_client[0]) < 1e-6


def test_correction_terms_are_needed() -> None:
    """Without -r^T Psi + v Phi the recovery is wrong: the test above cannot pass by accident."""
    dims = DIMS[1]
    gen = torch.Generator().manual_seed(4)
    layers = rand_mlp(dims, gen)
    x, y = rand_batch(dims, 12, gen)
    w_hat, secret = mp_server(layers, seed("corr"))
    up = client_gradients(w_hat, x, y)
    blind = ClientUpload(up.grads, tuple(torch.zeros_like(p) for p in up.psi), tuple(torch.zeros_like(p) for p in up.phi))
    assert max_rel_err(recover(blind, secret), true_grads(layers, x, y)) > 0.1


def test_mu_server_update_matches_plain_sgd() -> None:
    dims = DIMS[2]
    gen = torch.Generator().manual_seed(5)
    layers = rand_mlp(dims, gen)
    batches = [rand_batch(dims, 10, gen) for _ in range(3)]
    w_hat, secret = mp_server(layers, seed("mu"))
    new_layers, _ = mu_server(layers, aggregate([client_gradients(w_hat, x, y) for x, y in batches]), secret,
                              make_server_optimizer("sgd", 0.1))
    per_client = [true_grads(layers, x, y) for x, y in batches]
    mean = [tuple(sum(c[i][j] for c in per_client) / 3 for j in range(2)) for i in range(len(layers))]
    want = [(w - 0.1 * gw, b - 0.1 * gb) for (w, b), (gw, gb) in zip(layers, mean, strict=True)]  # the paper's xi
    for (w, b), (ww, wb) in zip(new_layers, want, strict=True):
        torch.testing.assert_close(w, ww, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(b, wb, rtol=1e-9, atol=1e-12)


def test_perturbed_model_is_far_from_true() -> None:
    """What a client receives is far from the true model (relative distance; printed for the report)."""
    dims = [784, 100, 10]
    gen = torch.Generator().manual_seed(6)
    layers = rand_mlp(dims, gen)
    w_hat, _ = mp_server(layers, seed("far"))
    dist = relative_distance(layers, w_hat)
    print(f"relative distance (784-100-10): {dist}")
    assert abs(dist["row_cosine"][0] - 1.0) < 1e-12  # layer 1 rows keep their direction (paper-level leak)
    assert dist["overall"] > 0.5
    assert min(dist["per_layer"]) > 0.3
    assert relative_distance(layers, expand(layers))["overall"] == 0.0


def test_secret_is_seeded_and_fresh() -> None:
    dims = DIMS[1]
    a, b, c = draw_secret(dims, seed("s1")), draw_secret(dims, seed("s1")), draw_secret(dims, seed("s2"))
    assert all(torch.equal(x, y) for x, y in zip(a.R, b.R, strict=True))
    assert not torch.equal(a.R[0], c.R[0])
    assert all(bool((v > 0).all()) for v in (*a.r, *a.s))  # ReLU needs positive multipliers


def test_upload_wire_roundtrip_and_validation() -> None:
    dims = DIMS[0]
    gen = torch.Generator().manual_seed(7)
    layers = rand_mlp(dims, gen)
    x, y = rand_batch(dims, 4, gen)
    w_hat, secret = mp_server(layers, seed("wire"))
    up = client_gradients([m.numpy() for m in w_hat], x, y)  # as received from the wire
    arrays = up.to_arrays()
    assert len(arrays) == 3 * len(layers) and all(a.dtype == np.float64 for a in arrays)
    assert arrays[len(layers)].shape == (dims[-1], dims[1], dims[0] + 1)  # Psi of layer 1: (n_L, n_1, n_0 + 1)
    back = ClientUpload.from_arrays(arrays)
    assert all(torch.equal(p, q) for p, q in zip(back.psi, up.psi, strict=True))
    with pytest.raises(ValueError):
        mp_server(layers[:1], seed("x"))  # L = 1 is not covered by Eq. (14)
    with pytest.raises(ValueError):
        perturb(rand_mlp([5, 6, 3], gen), secret)  # secret drawn for other dims


def test_float32_recovery_error_is_reported() -> None:
    """Informational: float32 clients lose accuracy in the Psi/Phi cancellation; float64 is required."""
    dims = [30, 20, 10]
    gen = torch.Generator().manual_seed(8)
    layers = rand_mlp(dims, gen)
    x, y = rand_batch(dims, 32, gen)
    w_hat, secret = mp_server(layers, seed("f32"))
    up32 = client_gradients([m.float() for m in w_hat], x.float(), y.float())
    up64 = ClientUpload(*(tuple(t.double() for t in part) for part in (up32.grads, up32.psi, up32.phi)))
    err32 = max_rel_err(recover(up64, secret), true_grads(layers, x, y))
    print(f"float32 client recovery relative error: {err32:.2e}")
    assert err32 < 1e-1


@pytest.mark.parametrize("dims", [*DIMS, [784, 32, 10]])
def test_batched_backprop_matches_autograd(dims: list[int]) -> None:
    """client_gradients' hand-written batched backward == n_L + 2 autograd passes (round-off only)."""
    gen = torch.Generator().manual_seed(9)
    layers = rand_mlp(dims, gen)
    x, y = rand_batch(dims, 17, gen)
    x[0] = 0.0  # a sample with exact zeros in the first pre-activations' inputs
    w_hat, _ = mp_server(layers, seed(f"bp{dims}"))
    got, want = client_gradients(w_hat, x, y), client_gradients_autograd(w_hat, x, y)
    for part_got, part_want in zip((got.grads, got.psi, got.phi), (want.grads, want.psi, want.phi), strict=True):
        for a, b in zip(part_got, part_want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1e-300) + 1e-300
    assert any(float(p.abs().max()) > 0 for p in got.psi)  # not trivially zero
    with pytest.raises(ValueError):
        client_gradients(w_hat, x[:0], y[:0])


@pytest.mark.parametrize("dims", [DIMS[1], [20, 16, 10]])
def test_clipped_gradients_weight_each_example_by_its_clip_scale(dims: list[int]) -> None:
    """Per-example norms equal single-example autograd gradients' norms; the clipped upload is their weighted sum.

    Weights min(1, C / ||g_b||) / B on the autograd reference's per-example grad, Psi and Phi.
    """
    gen = torch.Generator().manual_seed(10)
    layers = rand_mlp(dims, gen)
    x, y = rand_batch(dims, 9, gen)
    w_hat, _ = mp_server(layers, seed(f"clip{dims}"))
    singles = [client_gradients_autograd(w_hat, x[b:b + 1], y[b:b + 1]) for b in range(9)]
    want_norms = torch.stack([torch.sqrt(sum((g * g).sum() for g in s.grads)) for s in singles])
    norms = per_example_grad_norms(w_hat, x, y)
    assert float((norms - want_norms).abs().max()) <= 1e-12 * float(want_norms.max())
    clip = float(want_norms.median())
    weights = torch.clamp(clip / want_norms, max=1.0) / 9
    got, frac = clipped_client_gradients(w_hat, x, y, clip)
    assert frac == float((want_norms > clip).double().mean()) and 0 < frac < 1
    for name in ("grads", "psi", "phi"):
        for i, a in enumerate(getattr(got, name)):
            b = sum(wb * getattr(s, name)[i] for wb, s in zip(weights, singles, strict=True))
            assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1e-300) + 1e-300


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_psi_spectral_bound_is_an_upper_bound_within_n_to_the_eighth(dtype):
    """The clip's sigma_max(Psi_b) term: never below the largest eigenvalue, at most n^(1/8) times it.

    Random Gram matrices of every rank (1 = the bound is exact, full rank with equal eigenvalues = the worst case),
    scaled from 1e-30 to 1e30; zero, non-finite and overflowing ones.  Reference: float64 ``eigvalsh``.
    """
    from protocols.mpddp.gradients import _top_eigenvalue_bound

    gen = torch.Generator().manual_seed(7)
    n, cases = 10, []
    for rank in (1, 2, 5, 10, 30):
        f = torch.randn(200, n, rank, generator=gen, dtype=torch.float64)
        cases.append(f @ f.transpose(1, 2))
    cases.append(torch.eye(n, dtype=torch.float64).expand(3, n, n) * 2.5)
    for scale in (1e-30, 1e-10, 1.0, 1e15, 1e30):
        for gram in cases:
            g = (gram * scale).to(dtype)
            exact = torch.linalg.eigvalsh(g.double())[:, -1]
            bound = _top_eigenvalue_bound(g).double()
            assert (bound >= exact).all(), (scale, float((bound / exact).min()))
            assert (bound <= exact * n ** 0.125 * (1 + 1e-4)).all()
    assert _top_eigenvalue_bound(torch.zeros(2, n, n, dtype=dtype)).eq(0).all()
    odd = torch.eye(n, dtype=dtype).repeat(3, 1, 1)
    odd[0, 1, 1], odd[1, 2, 3], odd[2, 0, 0] = float("nan"), float("inf"), torch.finfo(dtype).max
    odd[2, 1, 1] = torch.finfo(dtype).max  # the trace overflows
    assert torch.isinf(_top_eigenvalue_bound(odd)).all()
