"""Tests for the Flower-free NADP-FL math (protocols.nadp*)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from protocols.nadp import (
    accountant_events,
    calibrate_sigmas,
    compensation_factor,
    dropout_residual,
    epsilon_from_sigmas,
    ldp_local_sigma,
    local_sgd_sensitivity,
    nadp_aggregate,
    nadp_upload,
    normalize_weights,
    round_plan,
    sensitivity,
    upload_noise_scales,
)
from protocols.privacy import RDP_ORDERS, GaussianEvent, RdpAccountant, joint_gaussian, lemma2_epsilon, lemma2_sigma

# ---------------------------------------------------------------- Table 3 (Eq. 8)

# Paper Table 3: rows (|D_max|/|D_min|)^2, K; columns tau = 0.1 .. 0.5.
TABLE3 = {
    (1.0, 25): [1.0565, 1.1239, 1.2060, 1.3093, 1.4446],
    (1.0, 50): [1.0553, 1.1209, 1.2005, 1.2999, 1.4289],
    (1.0, 100): [1.0547, 1.1194, 1.1978, 1.2954, 1.4214],
    (1.0, None): [1.0541, 1.1180, 1.1952, 1.2910, 1.4142],
    (1.5, 25): [1.3029, 1.3860, 1.4873, 1.6147, 1.7815],
    (1.5, 50): [1.2968, 1.3775, 1.4753, 1.5974, 1.7559],
    (1.5, 100): [1.2939, 1.3733, 1.4695, 1.5892, 1.7438],
    (1.5, None): [1.2910, 1.3693, 1.4639, 1.5811, 1.7321],
    (2.0, 25): [1.5097, 1.6059, 1.7233, 1.8708, 2.0642],
    (2.0, 50): [1.5000, 1.5933, 1.7064, 1.8476, 2.0310],
    (2.0, 100): [1.4953, 1.5871, 1.6983, 1.8365, 2.0152],
    (2.0, None): [1.4907, 1.5811, 1.6903, 1.8257, 2.0000],
}


@pytest.mark.parametrize(("row", "values"), list(TABLE3.items()))
def test_table3_reproduced(row: tuple[float, int | None], values: list[float]) -> None:
    ratio_sq, k = row
    for tau, expected in zip([0.1, 0.2, 0.3, 0.4, 0.5], values, strict=True):
        lam = compensation_factor(tau, k=k, size_ratio=math.sqrt(ratio_sq))
        assert round(lam, 4) == pytest.approx(expected, abs=1e-12), (row, tau, lam)


def test_compensation_factor_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        compensation_factor(1.0, k=10)
    with pytest.raises(ValueError):
        compensation_factor(0.9, k=10)  # (1-tau)k - 1 = 0
    with pytest.raises(ValueError):
        compensation_factor(0.1, k=10, size_ratio=0.5)


# ---------------------------------------------------------------- allocation


def _weight_vectors() -> list[tuple[str, dict[int, float]]]:
    rng = np.random.default_rng(20240601)
    cases: list[tuple[str, dict[int, float]]] = []
    for k in (2, 3, 50, 500):
        ids = rng.choice(10**9, size=k, replace=False)  # arbitrary, unsorted node ids
        cases.append(
            (f"uniform-int-{k}", {int(i): int(s) for i, s in zip(ids, rng.integers(50, 101, size=k), strict=True)})
        )
        cases.append(
            (f"dirichlet0.1-{k}", {int(i): float(s) + 1e-9 for i, s in zip(ids, rng.dirichlet([0.1] * k), strict=True)})
        )
        cases.append(
            (f"lognormal3-{k}", {int(i): float(s) for i, s in zip(ids, rng.lognormal(0.0, 3.0, size=k), strict=True)})
        )
        giant = {int(i): 1.0 for i in ids}
        giant[int(ids[0])] = 1e6  # one client holds almost everything
        cases.append((f"giant-{k}", giant))
        cases.append((f"equal-{k}", {int(i): 7.0 for i in ids}))
    return cases


WEIGHT_CASES = _weight_vectors()


def _check_allocation(weights: dict[int, float], sigma_up: float, sigma_down: float) -> None:
    alloc = upload_noise_scales(weights, sigma_up, sigma_down)
    p = normalize_weights(weights)
    k = len(p)
    assert alloc.client_ids == tuple(sorted(p))
    assert all(t >= 0.0 for t in alloc.theta)
    assert all(s >= 0.0 for s in alloc.residual_std.values())
    # downlink: aggregate residual std is exactly sigma_down
    assert alloc.aggregate_std == pytest.approx(sigma_down, rel=1e-12, abs=0.0)
    # uplink: every marginal upload std >= sigma_up; all but at most one
    # (the adjusted second-largest beta) meet it with equality unless clamped
    over = 0
    for c in alloc.client_ids:
        std = alloc.uplink_std(c)
        assert std >= sigma_up * (1 - 1e-12), (c, std, sigma_up)
        if alloc.demand[c] > 0 and std > sigma_up * (1 + 1e-9):
            over += 1
    assert over <= 1
    # pair matrix: symmetric, non-negative, row sums = per-client totals
    if k <= 50:
        mat = alloc.pair_matrix()
        assert np.array_equal(mat, mat.T)
        assert (mat >= 0).all()
        totals = np.array([alloc.pair_variance_total(c) for c in alloc.client_ids])
        np.testing.assert_allclose(mat.sum(axis=1), totals, rtol=1e-12, atol=1e-300)
        # both ends read the identical float for their shared pair
        for a in alloc.client_ids[:5]:
            sa = alloc.counteracting_stds(a)
            for b, s in sa.items():
                assert alloc.counteracting_stds(b)[a] == s


@pytest.mark.parametrize(("name", "weights"), WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_allocation_paper_calibration(name: str, weights: dict[int, float]) -> None:
    """sigma_up / sigma_down = |D| / |D_min| as in Eq. 3."""
    p = normalize_weights(weights)
    sigma_down = 0.37
    _check_allocation(weights, sigma_down / min(p.values()), sigma_down)


@pytest.mark.parametrize(("name", "weights"), WEIGHT_CASES[::3], ids=[c[0] for c in WEIGHT_CASES[::3]])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 3.0, 1e4])
def test_allocation_arbitrary_sigma_pairs(name: str, weights: dict[int, float], ratio: float) -> None:
    _check_allocation(weights, ratio * 2.0, 2.0)
    _check_allocation(weights, 1.5, 0.0)  # no downlink noise at all


def test_allocation_matches_closed_forms() -> None:
    # equal sizes: every pair gets sigma_down^2 / k (beta = (1 - 1/k) sigma_down^2)
    k, sd = 10, 1.3
    alloc = upload_noise_scales({i: 5 for i in range(k)}, k * sd, sd)
    np.testing.assert_allclose(alloc.theta, sd * sd / k, rtol=1e-12)
    # k = 3 with theta recursion: theta_1 = beta_1/2, theta_2 = beta_3 - theta_1
    alloc = upload_noise_scales({1: 1, 2: 2, 3: 3}, 6.0, 1.0)  # p = 1/6, 2/6, 3/6
    betas = sorted(p * p * 36 - p for p in (1 / 6, 2 / 6, 3 / 6))
    assert alloc.theta == pytest.approx((betas[0] / 2, betas[2] - betas[0] / 2), rel=1e-12)
    # k = 2: the single pair must carry the larger demand
    alloc = upload_noise_scales({4: 1, 9: 3}, 4.0, 1.0)
    assert alloc.theta == pytest.approx((0.75**2 * 16 - 0.75,), rel=1e-12)


def test_allocation_deterministic_and_order_independent() -> None:
    rng = np.random.default_rng(7)
    ids = [int(i) for i in rng.choice(10**6, 40, replace=False)]
    sizes = [int(s) for s in rng.integers(100, 200, 40)]
    a = upload_noise_scales(dict(zip(ids, sizes, strict=True)), 3.0, 0.2)
    b = upload_noise_scales(dict(zip(reversed(ids), reversed(sizes), strict=True)), 3.0, 0.2)
    assert a.theta == b.theta and a.order == b.order and dict(a.weights) == dict(b.weights)
    assert all(a.counteracting_stds(c) == b.counteracting_stds(c) for c in ids)


def test_allocation_infeasible_and_invalid() -> None:
    with pytest.raises(ValueError, match="only one client"):
        upload_noise_scales({3: 10}, 2.0, 1.0)
    single = upload_noise_scales({3: 10}, 1.0, 1.0)  # sigma_up == sigma_down is fine
    assert single.theta == () and single.uplink_std(3) == pytest.approx(1.0)
    for bad in ({}, {1: 0}, {1: -2, 2: 3}, {1: float("nan"), 2: 1}):
        with pytest.raises(ValueError):
            upload_noise_scales(bad, 1.0, 1.0)
    with pytest.raises(ValueError):
        upload_noise_scales({1: 1, 2: 1}, -1.0, 1.0)
    with pytest.raises(ValueError):
        upload_noise_scales({1: 1, 2: 1}, 1.0, float("inf"))
    with pytest.raises(ValueError):
        upload_noise_scales({"a": 1, "b": 1}, 1.0, 1.0)  # type: ignore[dict-item]


def test_compensation_factor_bounds_exact_collusion_lambda() -> None:
    """Eq. 8 (with |D_max|/|D_min| <= sqrt 2) dominates the exact per-round lambda."""
    rng = np.random.default_rng(11)
    for k in (10, 25, 60):
        for _ in range(5):
            sizes = {i: float(s) for i, s in enumerate(rng.uniform(100, 100 * math.sqrt(2), size=k))}
            p = normalize_weights(sizes)
            alloc = upload_noise_scales(sizes, 1.0 / min(p.values()), 1.0)
            ratio = max(sizes.values()) / min(sizes.values())
            for tau in (0.1, 0.3, 0.5):
                exact = alloc.min_compensation_factor(int(math.floor(tau * k)))
                bound = compensation_factor(tau, k=k, size_ratio=ratio)
                assert 1.0 <= exact <= bound * (1 + 1e-12), (k, tau, exact, bound)
    assert alloc.min_compensation_factor(k - 1) == math.inf


def test_min_compensation_factor_brute_force() -> None:
    """Exhaustive check over all colluder sets: lam is sufficient and tight."""
    sizes = {2: 40, 5: 55, 9: 47, 13: 70, 21: 41, 34: 66}
    p = normalize_weights(sizes)
    alloc = upload_noise_scales(sizes, 1.0 / min(p.values()), 1.0)
    mat = alloc.pair_matrix()
    ids = alloc.client_ids
    for n_col in (1, 2, 3):
        lam = alloc.min_compensation_factor(n_col)
        worst_margin = math.inf
        for i_idx, cid in enumerate(ids):
            need = p[cid] ** 2 * alloc.sigma_up**2
            others = [j for j in range(len(ids)) if j != i_idx]
            for colluders in itertools.combinations(others, n_col):
                rest = sum(mat[i_idx, j] for j in others if j not in colluders)
                kept = alloc.residual_std[cid] ** 2 + lam * lam * rest
                worst_margin = min(worst_margin, kept / need)
        assert worst_margin == pytest.approx(1.0, rel=1e-9) or (lam == 1.0 and worst_margin >= 1.0)


# ---------------------------------------------------------------- upload / cancellation


def _plan(sizes, *, epsilon, delta, clip, rounds, lr=1.0, graph=None, calibration="eq3"):
    """round_plan with Lemma 1 sensitivities (one full-batch step of per-example clipped SGD)."""
    sens = {c: local_sgd_sensitivity(clip, n, lr=lr) for c, n in sizes.items()}
    return round_plan(sizes, sens, epsilon, delta, rounds, graph=graph, calibration=calibration)


@pytest.mark.parametrize("graph_kind", ["complete", "n-out"])
def test_rdp_calibration_spends_the_budget_in_both_views(graph_kind) -> None:
    """round_plan's default spends the budget: the aggregate gets exactly the RDP multiplier of T releases.

    The server's joint view of the uploads gets at least that; Eq. 3 leaves budget unspent and noise in the model.
    """
    from protocols.graphs import round_graph
    from protocols.nadp import JOINT_SLACK
    from protocols.privacy import calibrate_noise_multiplier, gaussian_epsilon

    rng = np.random.default_rng(3)
    ids = list(range(1, 41))
    sizes = {c: int(s) for c, s in zip(ids, rng.integers(100, 300, size=len(ids)), strict=True)}
    graph = round_graph(graph_kind, 4, ids, bytes(32))
    sens = {c: local_sgd_sensitivity(1.0, n, lr=4.0) for c, n in sizes.items()}
    sig, alloc = round_plan(sizes, sens, 1.0, 1e-5, 30, graph=graph)
    p = alloc.weights
    z_down = alloc.aggregate_std / max(p[c] * sens[c] for c in ids)
    joint = alloc.joint_uplink_std(1.0)
    z_up = min(joint[c] / sens[c] for c in ids)
    target = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 30)
    assert min(z_down, z_up) == pytest.approx(target, rel=1e-9)
    assert z_down <= target / (1 - JOINT_SLACK) * (1 + 1e-9)  # the model carries (almost) no extra noise
    assert gaussian_epsilon(min(z_down, z_up), 1.0, 30, 1e-5) <= 1.0
    eq3, _ = round_plan(sizes, sens, 1.0, 1e-5, 30, graph=graph, calibration="eq3")
    assert sig.sigma_down < 0.75 * eq3.sigma_down  # Eq. 3 puts > 1.3x more noise into the model


def test_round_plan_is_eq3_with_lemma1_and_follows_the_graph() -> None:
    """One full-batch step: per-client sensitivities give exactly Eq. 3; a sparse graph switches the allocation."""
    from protocols.graphs import complete_graph, n_out_graph

    sizes = {5: 40, 9: 55, 14: 31, 20: 70, 33: 48, 41: 62}
    sig, alloc = _plan(sizes, epsilon=1.5, delta=1e-5, clip=2.0, rounds=30, lr=0.5)
    ref = calibrate_sigmas(1.5, 1e-5, 2.0, sizes, 30, lr=0.5)
    assert sig.sigma_up == pytest.approx(ref.sigma_up, rel=1e-12)
    assert sig.sigma_down == pytest.approx(ref.sigma_down, rel=1e-12)
    assert alloc == upload_noise_scales(sizes, sig.sigma_up, sig.sigma_down) and alloc.pair_table is None
    _, dense = _plan(sizes, epsilon=1.5, delta=1e-5, clip=2.0, rounds=30, lr=0.5, graph=complete_graph(sorted(sizes)))
    assert dense == alloc  # a complete graph is Algorithm 2
    graph = n_out_graph(sorted(sizes), 1, bytes(32))
    assert any(len(nb) < len(sizes) - 1 for nb in graph.values())
    _, sparse = _plan(sizes, epsilon=1.5, delta=1e-5, clip=2.0, rounds=30, lr=0.5, graph=graph)
    assert sparse.pair_table is not None
    assert all(sorted(sparse.pair_table[c]) == graph[c] for c in sizes)
    # sensitivities drive the calibration: doubling one client's doubles sigma_up when it is the largest
    sens = {c: local_sgd_sensitivity(2.0, n, lr=0.5) for c, n in sizes.items()}
    worst = max(sens, key=sens.get)
    sig2, _ = round_plan(sizes, {**sens, worst: 2 * sens[worst]}, 1.5, 1e-5, 30, calibration="eq3")
    assert sig2.sigma_up == pytest.approx(2 * sig.sigma_up, rel=1e-12)


def _explicit_round(k: int, dim: int, lam: float, seed: int):
    rng = np.random.default_rng(seed)
    ids = sorted(int(i) for i in rng.choice(10**6, size=k, replace=False))
    sizes = {c: int(s) for c, s in zip(ids, rng.integers(20, 400, size=k), strict=True)}
    _, alloc = _plan(sizes, epsilon=2.0, delta=1e-5, clip=10.0, rounds=200, lr=0.1)
    models = {c: rng.normal(0.0, 1.0, size=dim) for c in ids}
    residuals = {c: alloc.residual_std[c] * rng.standard_normal(dim) for c in ids}
    pair = {}  # one shared vector per unordered pair, i.e. n_ij == n_ji
    for a_idx, a in enumerate(ids):
        for b in ids[a_idx + 1 :]:
            pair[(a, b)] = alloc.counteracting_std(a, b) * rng.standard_normal(dim)
    csum = {}
    for c in ids:  # sum_{j>i} n_ij - sum_{j<i} n_ij (the pairwise engine's convention)
        acc = np.zeros(dim)
        for j in ids:
            if j != c:
                acc += pair[(min(c, j), max(c, j))] * (1.0 if c < j else -1.0)
        csum[c] = acc
    uploads = {c: nadp_upload(models[c], alloc.weights[c], residuals[c], csum[c], lam) for c in ids}
    return alloc, models, residuals, pair, csum, uploads


@pytest.mark.parametrize(("k", "lam"), [(2, 1.0), (7, 1.3), (30, 2.0)])
def test_weighted_aggregate_cancels_counteracting_noise(k: int, lam: float) -> None:
    alloc, models, residuals, _, _, uploads = _explicit_round(k, 2000, lam, seed=k)
    p = alloc.weights
    agg = nadp_aggregate(uploads, p)
    expected = sum(p[c] * (models[c] + residuals[c] / p[c]) for c in alloc.client_ids)
    rel = np.linalg.norm(agg - expected) / np.linalg.norm(expected)
    assert rel < 1e-9
    # the counteracting noise was large: an upload is far from w_i + n_i/p_i
    c0 = alloc.client_ids[0]
    assert np.linalg.norm(uploads[c0] - models[c0] - residuals[c0] / p[c0]) > 1e3 * rel * np.linalg.norm(expected)


def test_mismatched_pair_scale_does_not_cancel() -> None:
    """If one end uses a different scale for n_ij, the pair survives aggregation."""
    alloc, models, residuals, pair, csum, uploads = _explicit_round(4, 500, 1.0, seed=3)
    a, b = alloc.client_ids[:2]
    p = alloc.weights
    bad = csum[b] - 0.1 * pair[(a, b)] * (1.0 if b < a else -1.0)  # b scales n_ab by 0.9
    uploads[b] = nadp_upload(models[b], p[b], residuals[b], bad, 1.0)
    expected = sum(p[c] * (models[c] + residuals[c] / p[c]) for c in alloc.client_ids)
    err = nadp_aggregate(uploads, p) - expected
    np.testing.assert_allclose(err, 0.1 * pair[(a, b)], rtol=1e-7, atol=1e-9)


def test_upload_noise_std_matches_allocation() -> None:
    """Empirical std of (upload - w) equals the allocated uplink std (>= sigma_up)."""
    lam = 1.2
    alloc, models, _, _, _, uploads = _explicit_round(6, 100_000, lam, seed=5)
    for c in alloc.client_ids:
        emp = float(np.std(uploads[c] - models[c]))
        assert emp == pytest.approx(alloc.uplink_std(c, lam), rel=0.02)
        assert alloc.uplink_std(c, lam) >= alloc.sigma_up * (1 - 1e-12)


def test_with_shared_pairwise_engine_if_available() -> None:
    pairwise = pytest.importorskip("protocols.pairwise")
    prg = pytest.importorskip("protocols.prg")
    ids = [3, 11, 42, 77, 1000]
    sizes = {3: 120, 11: 60, 42: 300, 77: 90, 1000: 150}
    _, alloc = _plan(sizes, epsilon=1.0, delta=1e-5, clip=1.0, rounds=50)
    dim = 1000
    seeds = {(a, b): bytes([a % 256, b % 256]) * 16 for a in ids for b in ids if a < b}
    rng = np.random.default_rng(0)
    models = {c: rng.normal(size=dim) for c in ids}
    uploads, residuals = {}, {}
    for c in ids:
        peer_seeds = {j: seeds[(min(c, j), max(c, j))] for j in ids if j != c}
        cs = pairwise.pairwise_noise(c, peer_seeds, dim, scale=alloc.counteracting_stds(c))
        residuals[c] = prg.gaussian(bytes([c % 256]) * 32, dim, sigma=alloc.residual_std[c])
        uploads[c] = nadp_upload(models[c], alloc.weights[c], residuals[c], cs, 1.5)
    p = alloc.weights
    expected = sum(p[c] * models[c] + residuals[c] for c in ids)
    agg = nadp_aggregate(uploads, p)
    assert np.linalg.norm(agg - expected) / np.linalg.norm(expected) < 1e-9


def test_nadp_upload_validation() -> None:
    z = np.zeros(3)
    with pytest.raises(ValueError):
        nadp_upload(z, 0.0, z, z)
    with pytest.raises(ValueError):
        nadp_upload(z, 0.5, z, z, lam=0.5)
    with pytest.raises(ValueError):
        nadp_upload(z, 0.5, np.zeros(4), z)
    out = nadp_upload(np.ones(3), 0.25, np.full(3, 1.0), np.full(3, 2.0), lam=1.5)
    np.testing.assert_allclose(out, 1.0 + (1.0 + 3.0) / 0.25)


# ---------------------------------------------------------------- dropout


def test_dropout_residual_matches_explicit_noise() -> None:
    lam = 1.4
    alloc, models, _, _, _, uploads = _explicit_round(12, 200_000, lam, seed=9)
    dropped = set(alloc.client_ids[1::4])
    survivors = [c for c in alloc.client_ids if c not in dropped]
    desc = dropout_residual(alloc, survivors, lam)
    p = alloc.weights
    ps = sum(p[c] for c in survivors)
    agg = nadp_aggregate({c: uploads[c] for c in survivors}, p) / ps
    clean = sum(p[c] * models[c] for c in survivors) / ps
    assert float(np.std(agg - clean)) == pytest.approx(desc.total_std, rel=0.02)
    assert desc.uncancelled_pairs == len(survivors) * len(dropped)
    assert desc.total_std**2 == pytest.approx(desc.residual_std**2 + desc.uncancelled_std**2)
    full = dropout_residual(alloc, alloc.client_ids, lam)
    assert full.uncancelled_std == 0.0 and full.residual_std == pytest.approx(alloc.sigma_down)


def test_dropout_equal_sizes_closed_form() -> None:
    k, d, sd, lam = 20, 3, 0.5, 1.2
    alloc = upload_noise_scales({i: 1 for i in range(k)}, k * sd, sd)
    desc = dropout_residual(alloc, range(d, k), lam, renormalize=False)
    assert desc.uncancelled_std**2 == pytest.approx(lam**2 * d * (k - d) / k * sd**2, rel=1e-12)


# ---------------------------------------------------------------- calibration / accounting


def test_eq3_values() -> None:
    sizes = {1: 600, 2: 1200, 3: 900}
    sig = calibrate_sigmas(2.0, 1e-5, 10.0, sizes, 200, lr=0.1)
    c = math.sqrt(4 * 200 * math.log(1e5)) / 2.0
    assert sig.sigma_up == pytest.approx(2 * 10.0 * 0.1 / 600 * c, rel=1e-14)
    assert sig.sigma_down == pytest.approx(2 * 10.0 * 0.1 / 2700 * c, rel=1e-14)
    assert sig.noise_multiplier == pytest.approx(sig.sigma_up / sig.sensitivity_up, rel=1e-14)
    # Theorem 1 redundancy claim: sigma_server^2 (LDP, Lemma 3) / sigma_down^2 = q^2 N / 2 ... >= 1
    q, n = 0.8, 100
    ldp = ldp_local_sigma(2.0, 1e-5, 10.0, 600, 200, q, lr=0.1)
    assert ldp / sig.sigma_up == pytest.approx(math.sqrt(q / 2), rel=1e-14)  # Thm 1, equal sizes, kappa=0
    assert q * q * n / 2 > 1


@pytest.mark.parametrize("sampling_rate", [None, 0.3])
def test_calibration_round_trip(sampling_rate: float | None) -> None:
    sizes = [50, 75, 200, 61]
    for eps in (0.5, 1.0, 3.0, 8.0):
        sig = calibrate_sigmas(eps, 1e-5, 1.5, sizes, 120, lr=0.05, local_steps=3, sampling_rate=sampling_rate)
        back = epsilon_from_sigmas(
            sig.sigma_up, sig.sigma_down, 1e-5, 1.5, sizes, 120, lr=0.05, local_steps=3, sampling_rate=sampling_rate
        )
        assert back == pytest.approx(eps, rel=1e-12)
        sig2 = calibrate_sigmas(back, 1e-5, 1.5, sizes, 120, lr=0.05, local_steps=3, sampling_rate=sampling_rate)
        assert sig2.sigma_up == pytest.approx(sig.sigma_up, rel=1e-12)
        assert sig2.sigma_down == pytest.approx(sig.sigma_down, rel=1e-12)
    # single-query Lemma 2 round trip, and composition of mixed ratios
    s = lemma2_sigma(0.3, 1.7, 1e-6, 40)
    assert lemma2_epsilon([(0.3, s, 40)], 1e-6) == pytest.approx(1.7, rel=1e-12)
    assert lemma2_epsilon([(1.0, 2.0, 10), (1.0, 0.0, 1)], 1e-5) == math.inf
    assert sensitivity(10.0, 500, lr=0.1, local_steps=2) == pytest.approx(0.008)


def test_accountant_events_and_rdp_epsilon() -> None:
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant as DpRdpAccountant

    sizes = {i: 100 + 7 * i for i in range(20)}
    sig, alloc = _plan(sizes, epsilon=2.0, delta=1e-5, clip=10.0, rounds=200, lr=0.1)
    specs = accountant_events(alloc, sig.sensitivity_down, sampling_rate=0.8, steps=200)
    # with lam = 1 and Eq. 3, both phases have multiplier sqrt(4T ln(1/delta))/eps
    z = sig.noise_multiplier
    assert specs["uplink"].noise_multiplier == pytest.approx(z, rel=1e-9)
    assert specs["downlink"].noise_multiplier == pytest.approx(z, rel=1e-12)
    # server's joint view: never better than the aggregate alone, not better than one upload
    assert specs["uplink_joint"].noise_multiplier <= min(specs["uplink"].noise_multiplier, z) * (1 + 1e-9)
    lam_specs = accountant_events(alloc, sig.sensitivity_down, sampling_rate=0.8, steps=200, lam=1.5)
    assert lam_specs["uplink"].noise_multiplier > specs["uplink"].noise_multiplier
    assert lam_specs["downlink"] == specs["downlink"]  # lam costs no downlink noise
    # the RDP accountant equals a direct dp_accounting computation (same orders)
    eps_up = RdpAccountant([specs["uplink"]]).epsilon(1e-5)
    acc = DpRdpAccountant(list(RDP_ORDERS))
    acc.compose(dp_event.PoissonSampledDpEvent(0.8, dp_event.GaussianDpEvent(specs["uplink"].noise_multiplier)), 200)
    assert eps_up == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    both = RdpAccountant([joint_gaussian([specs["uplink"], specs["downlink"]])]).epsilon(1e-5)
    assert both > eps_up
    # one Poisson event with two Gaussians (dp_accounting's composed event) == the joint Gaussian (1/z^2 summed)
    direct = DpRdpAccountant(list(RDP_ORDERS))
    inner = dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(specs[k].noise_multiplier) for k in ("uplink", "downlink")])
    direct.compose(dp_event.PoissonSampledDpEvent(0.8, inner), 200)
    assert both == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    with pytest.raises(ValueError):
        joint_gaussian([GaussianEvent(1.0, 0.5, 10), GaussianEvent(1.0, 0.4, 10)])
    assert RdpAccountant([GaussianEvent(0.0, 0.5, 10)]).epsilon(1e-5) == math.inf


def test_joint_view_equal_sizes_closed_form() -> None:
    """Equal sizes, Eq. 3: effective joint std^2 = k (1 + lam^2 k) / (1 + lam^2) * sigma_down^2."""
    k, sd = 12, 0.7
    alloc = upload_noise_scales({i: 3 for i in range(k)}, k * sd, sd)
    for lam in (1.0, 1.7, 10.0):
        joint = alloc.joint_uplink_std(lam)
        want = math.sqrt(k * (1 + lam * lam * k) / (1 + lam * lam)) * sd
        for c in range(k):
            assert joint[c] == pytest.approx(want, rel=1e-10)
            assert alloc.uplink_std(c, lam) == pytest.approx(math.sqrt(k * (1 + lam * lam * (k - 1))) * sd, rel=1e-12)


# ---------------------------------------------------------------- sparse (n-out) pairing
SPARSE_CASES = [c for c in WEIGHT_CASES if len(c[1]) == 50]


@pytest.mark.parametrize(("name", "weights"), SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
def test_graph_allocation_meets_every_demand(name: str, weights: dict[int, float]) -> None:
    from protocols.graphs import n_out_graph

    ids = sorted(weights)
    graph = n_out_graph(ids, 2, b"g" * 32)
    p = normalize_weights(weights)
    alloc = upload_noise_scales(weights, 0.37 / min(p.values()), 0.37, graph=graph)
    assert alloc.pair_table is not None and alloc.aggregate_std == pytest.approx(0.37, rel=1e-12)
    for c in ids:
        assert alloc.uplink_std(c) >= alloc.sigma_up * (1 - 1e-12)
        assert sorted(alloc.counteracting_stds(c)) == sorted(graph[c])  # pairs only with neighbours
        for j, s in alloc.counteracting_stds(c).items():
            assert alloc.counteracting_stds(j)[c] == s  # both ends: the identical float
    mat = alloc.pair_matrix()
    assert np.array_equal(mat, mat.T) and (mat >= 0).all()
    # the worst-case collusion factor is finite while colluders < the smallest degree
    assert math.isfinite(alloc.min_compensation_factor(1))


def test_graph_allocation_rejects_bad_graphs() -> None:
    w = {1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}
    with pytest.raises(ValueError, match="symmetric"):
        upload_noise_scales(w, 5.0, 1.0, graph={1: [2], 2: [3], 3: [2], 4: []})
    with pytest.raises(ValueError, match="exactly the sampled"):
        upload_noise_scales(w, 5.0, 1.0, graph={1: [2], 2: [1]})
    with pytest.raises(ValueError, match="no neighbour"):
        upload_noise_scales(w, 5.0, 1.0, graph={1: [2, 3], 2: [1, 3], 3: [1, 2], 4: []})
