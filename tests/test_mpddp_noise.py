"""DDP_Client noise: R o eta ~ N(0, sigma_eta^2), R o Delta ~ N(0, sigma_Delta^2), Delta cancels on an n-out graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from protocols import prg
from protocols.graphs import n_out_graph
from protocols.mpddp import (
    add_cdp_noise,
    aggregate,
    client_gradients,
    clipped_mean,
    ddp_client,
    delta_variance,
    draw_secret,
    eta_noise,
    eta_variance,
    flatten,
    forward_mlp,
    mp_server,
    mse_loss,
    naive_client,
    one_hot,
    pairwise_delta,
    recover,
    recover_blocks,
    sample_dn,
    unflatten,
)
from protocols.mpddp.samplers import dn_unit_sampler
from protocols.pairwise import pairwise_noise, residual_norm

# KS acceptance: p > 1e-3 with fixed seeds (deterministic); negative controls: p < 1e-6.
DIMS = [40, 50, 45, 10]  # L = 3: layer 1 R = r_i (DN*(1)), layer 2 R = r_i s_j (DN*(2)^2), layer 3 R = s_j (DN*(1))
DRAWS = 60


def seed(label: str) -> bytes:
    return prg.derive_subseed(bytes(32), label)


def independent_entries(block: np.ndarray, layer: int, last: bool) -> np.ndarray:
    """Entries of one R o noise block that share no r_i / s_j factor (so they are i.i.d.)."""
    if last:
        return block[0]  # R_ij = s_j: one row, distinct columns
    return np.diagonal(block)  # distinct rows (and columns) -> distinct r_i (and s_j)


def collect(noise_fn, draws: int = DRAWS) -> list[np.ndarray]:
    """Per original layer, pooled independent entries of R o noise over `draws` fresh secrets."""
    pooled: list[list[np.ndarray]] = [[], [], []]
    for d in range(draws):
        secret = draw_secret(DIMS, seed(f"secret{d}"))
        blocks = secret.trainable_R()
        size = sum(b.numel() for b in blocks)
        noise = unflatten(noise_fn(d, size), blocks)
        for li, (rm, nz) in enumerate(zip(blocks, noise, strict=True)):
            prod = (rm * nz).numpy()
            pooled[li].append(independent_entries(prod, li, li == len(blocks) - 1))
    return [np.concatenate(p) for p in pooled]


def test_recovered_eta_is_gaussian_per_layer() -> None:
    sigma_eta = 0.3
    samples = collect(lambda d, size: sample_dn(seed(f"eta{d}"), size, sigma_eta))
    for li, x in enumerate(samples):
        assert x.size > 500
        assert stats.kstest(x, "norm", args=(0.0, sigma_eta)).pvalue > 1e-3, f"layer {li + 1}"


def test_recovered_delta_is_gaussian_per_layer() -> None:
    sigma_delta = 7.0
    samples = collect(lambda d, size: pairwise_noise(1, {2: seed(f"pair{d}")}, size, sampler=dn_unit_sampler, scale=sigma_delta))
    for li, x in enumerate(samples):
        assert stats.kstest(x, "norm", args=(0.0, sigma_delta)).pvalue > 1e-3, f"layer {li + 1}"


def test_naive_gaussian_eta_is_not_gaussian_after_recovery() -> None:
    """Negative control (MP-DP-Naive): plain N(0, sigma^2) noise becomes R o eta, rejected by the same test."""
    samples = collect(lambda d, size: prg.gaussian(seed(f"g{d}"), size, 1.0), draws=4 * DRAWS)
    assert all(stats.kstest(x, "norm", args=(0.0, 1.0)).pvalue < 1e-6 for x in samples)


def _setup(num_clients: int, dims: list[int]):
    gen = torch.Generator().manual_seed(11)
    layers = [
        (
            torch.randn(dims[i + 1], dims[i], generator=gen, dtype=torch.float64) / dims[i] ** 0.5,
            0.1 * torch.randn(dims[i + 1], generator=gen, dtype=torch.float64),
        )
        for i in range(len(dims) - 1)
    ]
    batches = []
    for _ in range(num_clients):
        x = torch.randn(6, dims[0], generator=gen, dtype=torch.float64)
        batches.append((x, one_hot(torch.randint(0, dims[-1], (6,), generator=gen), dims[-1])))
    return layers, batches


def _true_mean(layers, batches):
    acc = None
    for x, y in batches:
        ps = [t.clone().requires_grad_(True) for wb in layers for t in wb]
        g = torch.autograd.grad(mse_loss(forward_mlp([(ps[2 * i], ps[2 * i + 1]) for i in range(len(layers))], x), y), ps)
        acc = list(g) if acc is None else [a + b for a, b in zip(acc, g, strict=True)]
    return [a / len(batches) for a in acc]


def _pair_seeds(graph: dict[int, list[int]], rnd: int) -> dict[int, dict[int, bytes]]:
    return {k: {v: seed(f"pair/{rnd}/{min(k, v)}/{max(k, v)}") for v in nbrs} for k, nbrs in graph.items()}


def test_delta_cancels_on_n_out_graph() -> None:
    """Acceptance: sum of pairwise Delta over an n-out graph cancels; recovery is exact with eta off."""
    num_clients, dims = 12, [8, 10, 6, 4]
    layers, batches = _setup(num_clients, dims)
    ids = list(range(100, 100 + num_clients))
    graph = n_out_graph(ids, 3, seed("graph"))
    seeds = _pair_seeds(graph, 0)
    w_hat, secret = mp_server(layers, seed("round0"))
    clean = [client_gradients(w_hat, x, y) for x, y in batches]
    sigma_delta = 50.0
    outs = [
        ddp_client(u, own_id=k, pair_seeds=seeds[k], eta_seed=seed(f"eta{k}"), sigma_eta=0.0, sigma_delta=sigma_delta)
        for k, u in zip(ids, clean, strict=True)
    ]
    noisy = [n for n, _ in outs]
    added = [flatten(n.grads) - flatten(c.grads) for n, c in zip(noisy, clean, strict=True)]
    assert min(float(np.abs(a).max()) for a in added) > 10.0  # each client's upload is heavily masked
    assert residual_norm(added) < 1e-9
    # With eta off, the returned pairwise part is exactly what was added (the probe sees all of it).
    assert all(np.allclose(a, d, rtol=0, atol=1e-9) for a, (_, d) in zip(added, outs, strict=True))
    rec = flatten(recover_blocks(aggregate(noisy), secret))
    want = flatten(recover_blocks(aggregate(clean), secret))
    assert np.linalg.norm(rec - want) / np.linalg.norm(want) < 1e-9
    true = flatten([t for t in _true_mean(layers, batches)])
    got = flatten([t for wb in recover(aggregate(noisy), secret) for t in wb])
    assert np.linalg.norm(got - true) / np.linalg.norm(true) < 1e-6


def test_eta_survives_as_R_o_mean_eta() -> None:
    """Eq. (22): recovered aggregate = true mean + R o mean_k(eta_k) (Delta's gone)."""
    num_clients, dims = 5, [6, 7, 3]
    layers, batches = _setup(num_clients, dims)
    ids = list(range(num_clients))
    seeds = _pair_seeds({k: [v for v in ids if v != k] for k in ids}, 1)  # complete graph
    w_hat, secret = mp_server(layers, seed("round1"))
    clean = [client_gradients(w_hat, x, y) for x, y in batches]
    size = flatten(clean[0].grads).size
    outs = [
        ddp_client(u, own_id=k, pair_seeds=seeds[k], eta_seed=seed(f"e{k}"), sigma_eta=0.2, sigma_delta=20.0)
        for k, u in zip(ids, clean, strict=True)
    ]
    noisy = [n for n, _ in outs]
    mean_eta = sum(sample_dn(seed(f"e{k}"), size, 0.2) for k in ids) / num_clients
    expected = flatten(recover_blocks(aggregate(clean), secret)) + flatten(secret.trainable_R()) * mean_eta
    got = flatten(recover_blocks(aggregate(noisy), secret))
    assert np.allclose(got, expected, rtol=0, atol=1e-9)
    # Each upload = gradient + its returned Delta part + eta_k (DN(sigma_eta, 1) from its private seed).
    for k, c, (n, delta) in zip(ids, clean, outs, strict=True):
        assert float(np.abs(delta).max()) > 1.0
        eta = flatten(n.grads) - flatten(c.grads) - delta
        assert np.allclose(eta, sample_dn(seed(f"e{k}"), size, 0.2), rtol=0, atol=1e-9)
    # No neighbours: no pairwise part at all, only eta.
    alone, delta0 = ddp_client(clean[0], own_id=0, pair_seeds={}, eta_seed=seed("e0"), sigma_eta=0.2, sigma_delta=5.0)
    assert not delta0.any()
    assert np.array_equal(flatten(alone.grads), flatten(clean[0].grads) + sample_dn(seed("e0"), size, 0.2))


def test_ablation_helpers() -> None:
    num_clients, dims = 3, [6, 7, 3]
    layers, batches = _setup(num_clients, dims)
    w_hat, secret = mp_server(layers, seed("round2"))
    clean = [client_gradients(w_hat, x, y) for x, y in batches]
    # MP-DP-Naive: recovered noise is exactly R o mean(gaussian eta).
    naive = [naive_client(u, eta_seed=seed(f"n{k}"), sigma=0.5) for k, u in enumerate(clean)]
    size = flatten(clean[0].grads).size
    mean_eta = sum(prg.gaussian(seed(f"n{k}"), size, 0.5) for k in range(num_clients)) / num_clients
    got = flatten(recover_blocks(aggregate(naive), secret)) - flatten(recover_blocks(aggregate(clean), secret))
    assert np.allclose(got, flatten(secret.trainable_R()) * mean_eta, rtol=0, atol=1e-9)
    # MP-CDP: server adds N(0, sigma^2) to the recovered true mean.
    grads = recover(aggregate(clean), secret)
    noisy = add_cdp_noise(grads, seed=seed("cdp"), sigma=0.01)
    diff = flatten([t for wb in noisy for t in wb]) - flatten([t for wb in grads for t in wb])
    assert np.allclose(diff, prg.gaussian(seed("cdp"), diff.size, 0.01), rtol=0, atol=1e-15)
    assert [tuple(w.shape) for w, _ in noisy] == [tuple(w.shape) for w, _ in layers]
    # MP-CDP's clipping: every recovered per-client gradient scaled to norm <= clip before the mean.
    per_client = [recover(u, secret) for u in clean]
    flat = [flatten([t for wb in g for t in wb]) for g in per_client]
    norms = [float(np.linalg.norm(f)) for f in flat]
    clip = 0.5 * min(norms)  # every client is clipped
    mean, got_norms = clipped_mean(per_client, clip)
    assert got_norms == pytest.approx(norms)
    want = sum(f * (clip / n) for f, n in zip(flat, norms, strict=True)) / num_clients
    assert np.allclose(flatten([t for wb in mean for t in wb]), want, rtol=1e-12, atol=0)
    assert [tuple(w.shape) for w, _ in mean] == [tuple(w.shape) for w, _ in layers]
    unclipped, _ = clipped_mean(per_client, 10 * max(norms))
    assert np.allclose(flatten([t for wb in unclipped for t in wb]), sum(flat) / num_clients, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("eta", "variance", "kurtosis"), [("gaussian", 0.09, 0.0), ("uniform", 2 * 0.09 / 3, -1.2)])
def test_eta_distribution_and_variance(eta: str, variance: float, kurtosis: float) -> None:
    """``eta="gaussian"``: N(0, sigma^2) (Gaussian given R); ``"uniform"``: DN(sigma, 1), variance 2 sigma^2 / 3."""
    x = eta_noise(seed(f"eta-{eta}"), 200_000, 0.3, eta)
    assert eta_variance(0.3, eta) == pytest.approx(variance, rel=1e-12)
    assert float(x.var()) == pytest.approx(variance, rel=0.02)
    assert float(stats.kurtosis(x)) == pytest.approx(kurtosis, abs=0.05)
    if eta == "uniform":
        assert float(np.abs(x).max()) <= np.sqrt(2) * 0.3
    else:
        assert stats.kstest(x / 0.3, "norm").pvalue > 1e-3
    # The client's upload carries exactly this eta (its pairwise part is returned apart).
    layers, batches = _setup(2, [6, 7, 3])
    w_hat, _secret = mp_server(layers, seed("round1"))
    clean = client_gradients(w_hat, *batches[0])
    noisy, delta = ddp_client(clean, own_id=0, pair_seeds={1: seed("pair")}, eta_seed=seed("e"), sigma_eta=0.3,
                              sigma_delta=2.0, eta=eta)
    size = flatten(clean.grads).size
    got = flatten(noisy.grads) - flatten(clean.grads) - delta
    assert np.allclose(got, eta_noise(seed("e"), size, 0.3, eta), rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="eta must be"):
        eta_noise(seed("e"), 3, 0.3, "laplace")


def test_delta_variance_is_one_pairs_variance_and_the_pair_cancels():
    """Delta_{k,v} per entry has variance 2 sigma^2 / 3 (DN(sigma, 1)); the pair's two ends sum to zero exactly."""
    seed, sigma = bytes(range(32)), 0.7
    d01 = pairwise_delta(200_000, own_id=0, pair_seeds={1: seed}, sigma_delta=sigma)
    d10 = pairwise_delta(200_000, own_id=1, pair_seeds={0: seed}, sigma_delta=sigma)
    assert np.array_equal(d01, -d10)
    assert float(np.var(d01)) == pytest.approx(delta_variance(sigma), rel=0.02)
    with pytest.raises(ValueError):
        delta_variance(-1.0)
