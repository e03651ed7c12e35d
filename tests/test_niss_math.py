"""Tests for protocols.niss.

Share planning/assignment, exact cancellation with tau = 0, Theorem 2 variance,
Theorem 3 tau (the Gaussian mechanisms are tested in tests/test_privacy.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols import niss, prg
from protocols.config import RunConfig
from protocols.privacy import calibrate_noise_multiplier, noise_multiplier, record_sensitivity
from server.defaults import app_defaults


# ------------------------------------------------------------------ shares
def test_plan_shares_one_per_neighbour() -> None:
    """The share count is the neighbour count whatever sigma_k; the shares' variances add up to sigma_k^2 exactly."""
    for sigma in (1e-3, 0.1, 2.0, 52.6, 1e4):
        for m in (1, 4, 9, 99):
            plan = niss.plan_shares(sigma, m)
            assert plan.num_shares == m * niss.SHARES_PER_NEIGHBOUR
            assert plan.num_shares * plan.share_std**2 == pytest.approx(sigma**2, rel=1e-14)
    for bad in ((0.0, 3), (math.inf, 3), (-1.0, 3), (1.0, 0)):
        with pytest.raises(ValueError):
            niss.plan_shares(*bad)


def _cfg(**kw) -> RunConfig:
    return RunConfig.from_mapping({**app_defaults(), "method": "niss", **kw})


def test_record_level_sigma_and_bounded_share_count() -> None:
    """sigma_k = z p_k C lr / n_k (one full-batch step, zero-out); the share count = the neighbour count."""
    cfg = _cfg()
    assert (cfg.privacy_unit, cfg.lr, cfg.clip, cfg.local_epochs, cfg.num_rounds) == ("record", 4.0, 1.0, 1, 30)
    z = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 30)
    assert niss.client_sigma(cfg, 0.1, 144) == pytest.approx(z * 0.1 * 1.0 * 4.0 / 144, rel=1e-12)
    assert niss.upload_sensitivity(cfg, 0.1, 144) == pytest.approx(0.1 * record_sensitivity(cfg, 144))
    for degree in (1, 4, 9, 99):
        assert niss.client_plan(cfg, 0.1, 144, degree).num_shares == degree
    client = _cfg(**{"privacy-unit": "client"})
    assert niss.client_sigma(client, 0.1, 144) == pytest.approx(noise_multiplier(1.0, 1e-5, 30) * 0.1 * client.clip)
    assert niss.client_sigma(client, 0.1, 144) == niss.client_sigma(client, 0.1, 5)  # no record count at client level


def test_default_tau_protects_the_model_like_the_uploads() -> None:
    """Default tau = max_k Delta_k / sqrt(sum Delta_j^2) makes the worst record's downlink multiplier z; never below 1/sqrt(m)."""
    cfg = _cfg()
    z = noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
    m = cfg.clients_per_round
    assert niss.client_tau(cfg) == pytest.approx(1 / math.sqrt(m))
    # Unequal sizes (a Dirichlet partition): data-size weights give every record the central sensitivity
    # 2 C lr / N for one full-batch step, so the sigmas are equal and 1/sqrt(m) already protects the model.
    sizes = dict(enumerate([12, 30, 144, 500, 144, 80, 144, 143, 300, 90]))
    weights = niss.aggregation_weights(cfg, list(sizes), sizes)
    assert math.fsum(weights.values()) == pytest.approx(1.0, rel=1e-15)
    assert weights[3] == pytest.approx(500 / sum(sizes.values()), rel=1e-15)
    sigmas = [niss.client_sigma(cfg, weights[n], sizes[n]) for n in sizes]
    assert max(sigmas) == pytest.approx(min(sigmas), rel=1e-12)
    assert niss.client_tau(cfg, sizes) == pytest.approx(1 / math.sqrt(m), rel=1e-12)
    assert niss.downlink_multiplier(1 / math.sqrt(m), sigmas, z) == pytest.approx(z, rel=1e-12)
    # Multi-step local training: a record's sensitivity no longer shrinks like 1/n_k, the sigmas differ and tau rises.
    mini = _cfg(**{"batch-size": 32, "local-epochs": 2})
    weights = niss.aggregation_weights(mini, list(sizes), sizes)
    sigmas = [niss.client_sigma(mini, weights[n], sizes[n]) for n in sizes]
    tau = niss.client_tau(mini, sizes)
    assert tau > 1 / math.sqrt(m)
    assert niss.downlink_multiplier(tau, sigmas, z) == pytest.approx(z, rel=1e-12)
    assert niss.downlink_multiplier(1 / math.sqrt(m), sigmas, z) < z  # the plain 1/sqrt(m) falls short
    assert niss.client_tau(cfg, dict.fromkeys(range(1000), 10**6)) == pytest.approx(1 / math.sqrt(m))  # never lower
    assert niss.client_tau(_cfg(**{"niss-rho": 1.0}), sizes) == 1.0  # Theorem 3 wins
    assert niss.client_tau(_cfg(**{"niss-tau": 0.0}), sizes) == 0.0  # explicit


def test_aggregation_weights_need_every_size_at_record_level() -> None:
    cfg = _cfg()
    with pytest.raises(ValueError, match="no dataset size"):
        niss.aggregation_weights(cfg, [1, 2, 3], {1: 10, 2: 20})
    client = _cfg(**{"privacy-unit": "client"})
    assert niss.aggregation_weights(client, [1, 2, 3], {}) == {1: 1 / 3, 2: 1 / 3, 3: 1 / 3}
    assert niss.sizes_digest({1: 10, 2: 20}) != niss.sizes_digest({1: 10, 2: 21})
    assert niss.sizes_digest({2: 20, 1: 10}) == niss.sizes_digest({1: 10, 2: 20})


def test_outgoing_bundles_one_per_neighbour() -> None:
    plan = niss.plan_shares(2.0, 4)
    seeds = {n: bytes([n] * 32) for n in (9, 3, 5, 7)}
    bundles = niss.make_outgoing_bundles(1, plan, [9, 3, 5, 7], seeds)
    assert [b.receiver for b in bundles] == [3, 5, 7, 9] and all(b.count == 1 for b in bundles)
    assert sum(b.count * b.share_std**2 for b in bundles) == pytest.approx(4.0, rel=1e-14)
    assert len({b.seed for b in bundles}) == 4  # independent shares per receiver
    with pytest.raises(ValueError, match="duplicates"):
        niss.make_outgoing_bundles(1, plan, [3, 3, 5, 7], seeds)
    with pytest.raises(ValueError, match="own neighbour"):
        niss.make_outgoing_bundles(3, plan, [3, 5, 7, 9], seeds)
    with pytest.raises(ValueError, match="per neighbour"):
        niss.make_outgoing_bundles(1, plan, [3, 5, 7], seeds)


def _random_graph(rng: np.random.Generator, n: int, p: float) -> dict[int, list[int]]:
    """Symmetric random neighbour lists, every node with >= 1 neighbour."""
    adj = {i: set() for i in range(n)}
    for i in range(n):
        for j in range(i + 1, n):
            if rng.random() < p:
                adj[i].add(j)
                adj[j].add(i)
        if not adj[i]:
            j = (i + 1) % n
            adj[i].add(j)
            adj[j].add(i)
    return {i: sorted(v) for i, v in adj.items()}


def _pair_seed(round_seed: bytes, a: int, b: int) -> bytes:
    lo, hi = min(a, b), max(a, b)
    return prg.derive_subseed(round_seed, f"pair/{lo}/{hi}")


def _simulate_round(
    rng: np.random.Generator,
    round_seed: bytes,
    params: np.ndarray,
    weights: np.ndarray,
    sigma_ks: np.ndarray,
    taus: np.ndarray,
) -> tuple[np.ndarray, list[niss.ShareBundle], list[np.ndarray]]:
    """One NISS round for all clients; returns (aggregate, all bundles, uploads)."""
    n, size = params.shape
    graph = _random_graph(rng, n, 0.25)
    outgoing: dict[int, list[niss.ShareBundle]] = {}
    for k in range(n):
        plan = niss.plan_shares(float(sigma_ks[k]), len(graph[k]))
        seeds = {j: _pair_seed(round_seed, k, j) for j in graph[k]}
        outgoing[k] = niss.make_outgoing_bundles(k, plan, graph[k], seeds)
    all_bundles = [b for bs in outgoing.values() for b in bs]
    uploads = []
    for k in range(n):
        incoming = [b for b in all_bundles if b.receiver == k]
        own = niss.sender_noise(outgoing[k], size)
        recv = niss.receiver_noise(incoming, size, float(taus[k]), rng)
        uploads.append(niss.client_upload(np.zeros(size), params[k], float(weights[k]), own, recv))
    return np.sum(uploads, axis=0), all_bundles, uploads


def test_tau_zero_cancels_exactly() -> None:
    rng = np.random.default_rng(20)
    n, size = 20, 3000
    params = rng.normal(size=(n, size))
    d = rng.integers(50, 500, n)
    weights = d / d.sum()
    sigma_ks = rng.uniform(0.5, 2.0, n)
    agg, bundles, uploads = _simulate_round(rng, bytes(32), params, weights, sigma_ks, np.zeros(n))
    target = weights @ params
    assert np.linalg.norm(agg - target) <= 1e-9 * np.linalg.norm(target)
    # ... while each upload alone carries noise of variance ~ 2 sigma_k^2 (own + received
    # negated shares when the client receives as much as it sends; here: own + received)
    for k in range(n):
        recv_var = sum(b.count * b.share_std**2 for b in bundles if b.receiver == k)
        noise = uploads[k] - weights[k] * params[k]
        assert np.var(noise) == pytest.approx(sigma_ks[k] ** 2 + recv_var, rel=0.1)
    # each client sends exactly sigma_k^2 of share variance
    for k in range(n):
        sent = sum(b.count * b.share_std**2 for b in bundles if b.sender == k)
        assert sent == pytest.approx(sigma_ks[k] ** 2, rel=1e-12)


@pytest.mark.parametrize("hetero_tau", [False, True])
def test_aggregate_variance_matches_theorem2(hetero_tau: bool) -> None:
    rng = np.random.default_rng(7 + hetero_tau)
    n, size, rounds = 20, 2000, 15
    sigma_ks = rng.uniform(0.5, 1.5, n)
    taus = rng.uniform(0.2, 0.9, n) if hetero_tau else np.full(n, 0.6)
    weights = np.full(n, 1.0 / n)
    samples, predicted = [], []
    for t in range(rounds):
        params = rng.normal(size=(n, size))
        agg, bundles, _ = _simulate_round(
            rng, prg.derive_subseed(bytes(32), f"round/{t}"), params, weights, sigma_ks, taus
        )
        samples.append(agg - weights @ params)
        predicted.append(niss.exact_aggregate_variance(bundles, dict(enumerate(taus))))
    measured = float(np.var(np.concatenate(samples)))
    if hetero_tau:
        assert measured == pytest.approx(float(np.mean(predicted)), rel=0.1)
    else:
        thm2 = niss.theorem2_variance(sigma_ks, taus)
        assert np.allclose(predicted, thm2, rtol=1e-12)  # equal taus: Theorem 2 is exact
        assert measured == pytest.approx(thm2, rel=0.1)
        # and far below plain DP-FedAvg's sum sigma_k^2
        assert measured < 0.5 * float(np.sum(sigma_ks**2))


def test_receiver_noise_seeded_and_tau_zero() -> None:
    b = niss.ShareBundle(sender=1, receiver=2, count=3, share_std=0.5, seed=bytes(range(32)))
    shares = niss.bundle_shares(b, 50)
    assert shares.shape == (3, 50)
    assert np.array_equal(niss.sender_noise([b], 50), shares[0] + shares[1] + shares[2])
    assert np.allclose(niss.receiver_noise([b], 50, 0.0, bytes(32)), -shares.sum(axis=0), rtol=0, atol=1e-15)
    r1 = niss.receiver_noise([b], 50, 0.5, bytes(32))
    assert np.array_equal(r1, niss.receiver_noise([b], 50, 0.5, bytes(32)))
    assert not np.allclose(r1, -shares.sum(axis=0))
    with pytest.raises(ValueError):
        niss.receiver_noise([b], 50, -0.1, bytes(32))


# ------------------------------------------------------------------ Theorem 3
def test_tau_from_collusion() -> None:
    assert niss.tau_for_collusion(0.0) == 0.0
    assert niss.tau_for_collusion(0.5) == 0.0
    assert niss.tau_for_collusion(0.75) == pytest.approx(math.sqrt(0.5))
    assert niss.tau_for_collusion(1.0) == 1.0
    for rho in np.linspace(0, 1, 21):
        tau = niss.tau_for_collusion(rho)
        ratio = niss.collusion_variance_ratio(rho, tau)
        assert ratio >= 1 - 1e-12  # Eq. (12)
        if rho > 0.5:
            assert ratio == pytest.approx(1.0)  # minimal: tightest tau
            assert niss.collusion_variance_ratio(rho, tau * 0.99) < 1
    with pytest.raises(ValueError):
        niss.tau_for_collusion(1.5)


def test_theorem2_formula() -> None:
    assert niss.theorem2_variance([1.0, 2.0], [0.5, 0.1]) == pytest.approx(0.25 + 0.04)
    with pytest.raises(ValueError):
        niss.theorem2_variance([1.0], [0.5, 0.1])
