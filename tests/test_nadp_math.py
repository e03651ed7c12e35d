"""NADP-FL's round math (protocols.nadp): calibration, uploads whose pair noise cancels, dropout residuals, accounting.

The noise allocation itself: tests/test_nadp_allocation.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols.nadp import (
    calibrate_sigmas,
    dropout_residual,
    local_sgd_sensitivity,
    nadp_aggregate,
    nadp_upload,
    round_plan,
    sensitivity,
    upload_noise_scales,
)
from protocols.privacy import RDP_ORDERS, GaussianEvent, RdpAccountant, joint_gaussian, lemma2_epsilon, lemma2_sigma


# ---------------------------------------------------------------- upload / cancellation
def _plan(sizes, *, epsilon, delta, clip, rounds, lr=1.0, graph=None, calibration="eq3"):
    """round_plan with Lemma 1 sensitivities (one full-batch step of per-example clipped SGD)."""
    sens = {c: local_sgd_sensitivity(clip, n, lr=lr, adjacency="replace-one") for c, n in sizes.items()}
    return round_plan(sizes, sens, epsilon, delta, rounds, graph=graph, calibration=calibration)


@pytest.mark.parametrize("graph_kind", ["complete", "n-out"])
def test_rdp_calibration_spends_the_budget_in_both_views(graph_kind) -> None:
    """round_plan's default spends the budget: the aggregate gets exactly the RDP multiplier of T releases.

    The aggregate's, against a receiving participant that knows its own residual.  The server's joint view of the
    uploads gets at least that; Eq. 3 leaves budget unspent and noise in the model.
    """
    from protocols.graphs import round_graph
    from protocols.nadp import JOINT_SLACK
    from protocols.privacy import calibrate_noise_multiplier, gaussian_epsilon

    rng = np.random.default_rng(3)
    ids = list(range(1, 41))
    sizes = {c: int(s) for c, s in zip(ids, rng.integers(100, 300, size=len(ids)), strict=True)}
    graph = round_graph(graph_kind, 4, ids, bytes(32))
    sens = {c: local_sgd_sensitivity(1.0, n, lr=4.0, adjacency="replace-one") for c, n in sizes.items()}
    sig, alloc = round_plan(sizes, sens, 1.0, 1e-5, 30, graph=graph)
    p = alloc.weights
    z_down = alloc.receiver_std / max(p[c] * sens[c] for c in ids)
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
    sens = {c: local_sgd_sensitivity(2.0, n, lr=0.5, adjacency="replace-one") for c, n in sizes.items()}
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


def test_lemma2_round_trip_and_sensitivity() -> None:
    # single-query Lemma 2 round trip, and composition of mixed ratios
    s = lemma2_sigma(0.3, 1.7, 1e-6, 40)
    assert lemma2_epsilon([(0.3, s, 40)], 1e-6) == pytest.approx(1.7, rel=1e-12)
    assert lemma2_epsilon([(1.0, 2.0, 10), (1.0, 0.0, 1)], 1e-5) == math.inf
    assert sensitivity(10.0, 500, lr=0.1, local_steps=2) == pytest.approx(0.008)


def test_rdp_accountant_matches_dp_accounting_and_joint_gaussian() -> None:
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant as DpRdpAccountant

    z = math.sqrt(4 * 200 * math.log(1e5)) / 2.0  # Eq. 3's multiplier at epsilon 2 over T = 200
    specs = {"uplink": GaussianEvent(z * 1.1, 0.8, 200), "downlink": GaussianEvent(z, 0.8, 200)}
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

