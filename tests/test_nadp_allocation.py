"""NADP-FL's noise allocation (protocols.nadp_allocation via protocols.nadp): Table 3, pair variances, collusion.

The allocation meets every client's uplink demand and the aggregate's downlink std exactly, on complete and
n-out graphs; Eq. 8's compensation factor bounds the exact collusion lambda.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from protocols.nadp import compensation_factor, normalize_weights, upload_noise_scales

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
