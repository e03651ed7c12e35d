"""NISS's joint view: the server's best linear combination of all uploads leaves every client its charged variance.

* One real round (10 clients, n-out graph, the real client handlers, deterministic seeds): the uploads' noise
  (upload minus the diagnostic noiseless ``p_k w_k``) gives an empirical covariance over the model's
  coordinates; the best linear unbiased view of each client keeps at least ``(z Delta f_k)^2``, and matches
  :func:`protocols.niss_joint.joint_factors`.  The same round calibrated per upload only (scale 1) does not.
* The complete graph's closed form matches a dense inverse; the structured path matches it on n-out graphs.
* Colluders (``niss-rho``): the factors equal the worst of every set of ``floor(rho d_k)`` neighbours, each
  computed from an explicit latent model of the shares and distortions with the colluders' material removed
  (independent of the module's formula); the old no-colluder scale leaves a colluded view under its charge.
* A client refuses a share request whose noise scale is under the round's joint-view floor; tau = 0 is no
  uplink guarantee (epsilon inf) and a node whose policy asks for one refuses it.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest

from client.app import app as client_app
from client.methods import niss as niss_client
from protocols import floor as floor_math
from protocols.config import RunConfig
from protocols.floor import FloorViolation, NissFloor, niss_floor
from protocols.graphs import complete_graph, n_out_graph
from protocols.niss import upload_sensitivity
from protocols.niss_joint import colluder_count, joint_covariance, joint_factors, joint_scale, share_variances
from protocols.privacy import noise_multiplier
from protocols.wire.niss import Diagnostic, NissMetrics, RelayedInbox
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies import niss_shares as niss_strategy  # the share phase computes the joint-view scale
from tests.niss_setup import FAST, flat, niss_round, niss_setup

#: The aggregate-noise figures these tests check come from the nodes' noiseless-update diagnostic.
pytestmark = pytest.mark.usefixtures("niss_diagnostics")


def _seed(label: str) -> bytes:
    return hashlib.sha256(b"joint/" + label.encode()).digest()


def _round_noise(monkeypatch, *, per_upload_only: bool):
    """One real round: (noise matrix clients x D, charged variances, the round's graph, tau, reported sigmas, rho)."""
    monkeypatch.setattr(niss_client, "_fresh_seed", _seed)
    if per_upload_only:  # joint-view scale 1: every sigma calibrated for its upload alone
        unscaled = lambda *a, **k: NissFloor(1.0, {})  # noqa: E731
        monkeypatch.setattr(niss_client, "niss_floor", unscaled)
        monkeypatch.setattr(niss_strategy, "niss_floor", unscaled)
    cfg, grid, strategy, arrays = niss_setup(num_clients=10, graph="n-out", n_out=2, self_mask=False,
                                             cancellation_check=True, hidden="64")
    msgs, replies = niss_round(grid, strategy, 1, arrays)
    z = noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
    nodes = sorted(r.metadata.src_node_id for r in replies)
    by_node = {r.metadata.src_node_id: r for r in replies}
    weights = {m.metadata.dst_node_id: RelayedInbox.from_config(m.content["config"]).weight for m in msgs}
    noise, charged, sigmas = [], [], {}
    for n in nodes:
        r = by_node[n]
        noise.append(flat(r.content["arrays"]) - flat(Diagnostic.from_content(r.content).update))
        size = int(r.content["metrics"]["num-examples"])
        charged.append((z * upload_sensitivity(cfg, weights[n], size)) ** 2)
        sigmas[n] = NissMetrics.from_metrics(r.content["metrics"]).sigma
    graph = strategy._state.keys.neighbours
    assert graph != complete_graph(nodes)  # a sparse round graph
    return np.array(noise), np.array(charged), graph, strategy._state.tau, sigmas, cfg.niss_rho


def _blue_variances(noise: np.ndarray) -> np.ndarray:
    """``1 / (Sigma^-1)_kk`` of the empirical covariance (zero-mean noise, i.i.d. over the coordinates)."""
    cov = noise @ noise.T / noise.shape[1]
    return 1.0 / np.diag(np.linalg.inv(cov))


def test_joint_view_keeps_the_charged_variance_and_per_upload_calibration_does_not(monkeypatch):
    # D = 4810 coordinates: the estimate of 1 / (Sigma^-1)_kk has relative std ~sqrt(2 / D) = 2 %.
    noise, charged, graph, tau, sigmas, rho = _round_noise(monkeypatch, per_upload_only=False)
    assert noise.shape[1] > 4000 and tau > 0 and rho > 0
    ratio = _blue_variances(noise) / charged
    assert ratio.min() >= 0.92  # every client keeps its charged variance (more: the scale covers colluders)
    def expected(f: dict[int, float]) -> np.ndarray:  # at the reported (scaled) sigmas
        return np.array([f[n] * sigmas[n] ** 2 for n in sorted(f)]) / charged

    np.testing.assert_allclose(ratio, expected(joint_factors(sigmas, graph, tau)), rtol=0.1)
    # The worst-off client's view given its worst rho share of colluding neighbours keeps exactly its charge.
    assert expected(joint_factors(sigmas, graph, tau, rho=rho)).min() == pytest.approx(1.0, rel=1e-9)
    assert expected(joint_factors(sigmas, graph, tau)).min() > 1.05

    with monkeypatch.context() as mp:
        old, charged_old, *_ = _round_noise(mp, per_upload_only=True)
    np.testing.assert_allclose(charged_old, charged, rtol=1e-12)
    old_ratio = _blue_variances(old) / charged
    assert old_ratio.min() < 0.8  # calibrated per upload only, the joint view beats the claim


@pytest.mark.parametrize("n,tau", [(2, 0.7), (10, 1 / math.sqrt(10)), (37, 0.2), (100, 0.1)])
def test_complete_graph_closed_form_matches_a_dense_inverse(n, tau):
    rng = np.random.default_rng(n)
    graph = complete_graph(range(n))
    sigmas = {k: float(rng.uniform(0.3, 3.0)) for k in graph}
    fast = joint_factors(sigmas, graph, tau)
    dense = np.diag(np.linalg.inv(joint_covariance(share_variances(sigmas, graph), graph, tau)))
    np.testing.assert_allclose([fast[k] for k in range(n)], [1 / (d * sigmas[k] ** 2) for k, d in enumerate(dense)],
                               rtol=1e-9)


def test_equal_sigmas_on_a_complete_graph_give_the_known_factors():
    """``f = (2 + tau^2 + 2/m) / (1 + 2/(m tau^2))`` (m = n - 1 neighbours, equal sigmas): 0.72 at 10 clients."""
    for n in (4, 10, 100):
        m, tau = n - 1, 1 / math.sqrt(n)
        f = joint_factors(dict.fromkeys(range(n), 1.0), complete_graph(range(n)), tau)
        assert f[0] == pytest.approx((2 + tau**2 + 2 / m) / (1 + 2 / (m * tau**2)), rel=1e-12)
    assert joint_scale(f) == pytest.approx(1 / math.sqrt(f[0]), rel=1e-12) and joint_scale(f) > 1


def test_n_out_factors_match_a_dense_inverse_and_extra_noise_only_helps():
    graph = n_out_graph(range(60), 3, _seed("graph"))
    rng = np.random.default_rng(3)
    sigmas = {k: float(rng.uniform(0.5, 2.0)) for k in graph}
    f = joint_factors(sigmas, graph, 0.3)
    inv = np.linalg.inv(joint_covariance(share_variances(sigmas, graph), graph, 0.3))
    np.testing.assert_allclose([f[k] for k in range(60)], [1 / (inv[k, k] * sigmas[k] ** 2) for k in range(60)],
                               rtol=1e-9)
    more = joint_factors(sigmas, graph, 0.3, extra=dict.fromkeys(graph, 0.1))
    assert all(more[k] > f[k] for k in graph)
    assert set(joint_factors(sigmas, graph, 0.0).values()) == {0.0}  # tau = 0: the sum is noiseless
    with pytest.raises(ValueError, match="niss-tau = 0"):
        joint_scale(joint_factors(sigmas, graph, 0.0))


def test_niss_floor_refuses_a_smaller_scale():
    cfg = RunConfig.from_mapping({**app_defaults(), "method": "niss", "num-clients": 10})
    sizes = {k: 100 + 7 * k for k in range(10)}
    graph = n_out_graph(range(10), 2, _seed("floor"))
    fl = niss_floor(cfg, sizes, graph, 0.3)
    assert fl.scale > 1
    niss_floor(cfg, sizes, graph, 0.3, offered=fl.scale * 1.5)  # more noise: accepted
    with pytest.raises(FloorViolation, match="joint-view noise scale"):
        niss_floor(cfg, sizes, graph, 0.3, offered=fl.scale * 0.99)
    assert floor_math.niss_floor(cfg, sizes, graph, 0.0).scale == 1.0  # tau = 0: no guarantee to scale for


def _share_phase_errors(monkeypatch, grid, strategy, arrays) -> list[str]:
    """Run round 1 until the share phase gives up; the clients' error reasons."""
    errors: list[str] = []
    orig = LocalGrid.send_and_receive

    def record(self, messages, *a, **k):
        replies = list(orig(self, messages, *a, **k))
        errors.extend(r.error.reason for r in replies if r.has_error())
        return replies

    monkeypatch.setattr(LocalGrid, "send_and_receive", record)
    with pytest.raises(Exception, match="share exchange did not complete"):
        niss_round(grid, strategy, 1, arrays)
    return errors


def test_client_refuses_a_share_request_below_the_joint_view_scale(monkeypatch):
    monkeypatch.setattr(niss_client, "_fresh_seed", _seed)
    cfg, grid, strategy, arrays = niss_setup(num_clients=6, self_mask=False)
    real = niss_floor
    monkeypatch.setattr(niss_strategy, "niss_floor", lambda *a, **k: NissFloor(0.9 * real(*a, **k).scale, {}))
    errors = _share_phase_errors(monkeypatch, grid, strategy, arrays)
    assert errors and all("joint-view noise scale" in e for e in errors)


def test_tau_zero_has_no_uplink_guarantee_and_a_node_requiring_one_refuses(monkeypatch):
    cfg, _, strategy, arrays = niss_setup(num_clients=4, niss_tau=0.0)
    assert strategy.privacy_report(1)["epsilon_uplink"] == math.inf
    raw = {**app_defaults(), **FAST, "num-clients": 4, "niss-tau": 0.0}
    grid = LocalGrid(client_app, 4, raw, node_config={"max-epsilon-per-run": 10.0})
    errors = _share_phase_errors(monkeypatch, grid, strategy, arrays)
    assert errors and all("niss-tau" in e for e in errors)


def _latent_model(sigmas: dict[int, float], graph: dict[int, list[int]], tau: float):
    """The uploads' noise from the shares and distortions themselves: (coefficients, variances, sender, receiver, share?).

    Latent per directed pair ``i -> j``: the share ``n`` (variance ``sigma_i^2 / d_i``, +1 in upload i, -1 in upload
    j) and ``(s_j - 1) n`` (variance ``tau^2 sigma_i^2 / d_i``, -1 in upload j, j's secret).
    """
    n = len(graph)
    rows = []
    for i in graph:
        u = sigmas[i] ** 2 / len(graph[i])
        for j in graph[i]:
            rows.append((np.eye(n)[i] - np.eye(n)[j], u, i, j, True))
            rows.append((-np.eye(n)[j], tau * tau * u, i, j, False))
    b, var, src, dst, share = (np.array(x) for x in zip(*rows, strict=True))
    return b.T, var, src, dst, share


def _latent_precision(model, colluders: set[int], k: int) -> float:
    """``(Sigma_C^-1)_kk`` of the latent model given the colluders ``C``.

    A colluder reveals every share it sent or received and its own distortions; only the honest uploads carry
    unknown noise.
    """
    b, var, src, dst, share = model
    bad = np.isin(dst, list(colluders)) | (share & np.isin(src, list(colluders)))
    honest = [h for h in range(b.shape[0]) if h not in colluders]
    bh = b[np.ix_(honest, ~bad)]
    return float(np.linalg.inv(bh @ np.diag(var[~bad]) @ bh.T)[honest.index(k), honest.index(k)])


@pytest.mark.parametrize("complete", [True, False])
def test_colluder_factors_are_the_worst_of_every_colluding_set(complete):
    rng = np.random.default_rng(41 + complete)
    cases = 0
    while cases < 12:
        n = int(rng.integers(4, 8))
        if complete:
            graph = complete_graph(range(n))
        else:
            a = np.triu(rng.random((n, n)) < 0.5, 1)
            a = a | a.T
            graph = {i: [j for j in range(n) if a[i, j]] for i in range(n)}
            if min(map(len, graph.values())) == 0 or all(len(v) == n - 1 for v in graph.values()):
                continue
        cases += 1
        sigmas = {i: float(rng.lognormal(0.0, 0.7)) for i in range(n)}  # unequal share variances
        tau, rho = float(rng.choice([0.1, 0.5, 1.0])), float(rng.choice([0.3, 0.5, 0.8]))
        f, model = joint_factors(sigmas, graph, tau, rho=rho), _latent_model(sigmas, graph, tau)
        for k in graph:
            sets = itertools.combinations(graph[k], colluder_count(rho, len(graph[k])))
            worst = max(_latent_precision(model, set(c), k) for c in sets)
            assert f[k] == pytest.approx(1 / (worst * sigmas[k] ** 2), rel=1e-7), (n, k, tau, rho)
        assert all(f[k] <= g for k, g in joint_factors(sigmas, graph, tau).items())  # colluders only help the server


def test_the_no_colluder_scale_leaves_a_colluded_view_under_its_charge():
    """Planted fault: the scale for no colluders, on a round whose claim covers one (4 clients, rho 1/2)."""
    graph, tau = complete_graph(range(4)), 0.5
    sigmas = dict.fromkeys(graph, 1.0)
    old = joint_scale(joint_factors(sigmas, graph, tau))
    colluded = joint_factors(sigmas, graph, tau, rho=0.5)
    assert colluder_count(0.5, 3) == 1
    assert min(colluded.values()) * old**2 < 0.8  # SNR ratio 1 / sqrt(0.77) = 1.14 over the claim
    assert min(colluded.values()) * joint_scale(colluded) ** 2 == pytest.approx(1.0, rel=1e-12)
    assert joint_scale(colluded) == pytest.approx(1.2766, abs=1e-4)


def test_factors_are_computed_once_per_round_view_and_never_reused_for_another():
    """The server and the clients sharing a process get one computation per view; any changed input recomputes."""
    from protocols import niss_joint
    from protocols.graphs import n_out_graph

    graph = n_out_graph(list(range(30)), 3, b"s" * 32)
    sigmas = {k: 1.0 + (k % 7) / 10 for k in graph}
    first = niss_joint.joint_factors(sigmas, graph, 0.8, rho=0.5)
    again = niss_joint.joint_factors(dict(sigmas), {k: list(reversed(v)) for k, v in graph.items()}, 0.8, rho=0.5)
    assert again == first
    again[0] = -1.0  # a caller's copy: the kept factors do not change
    assert niss_joint.joint_factors(sigmas, graph, 0.8, rho=0.5) == first
    changed = {**sigmas, 5: sigmas[5] * 3}
    fresh = niss_joint._joint_factors(changed, graph, 0.8, None, None, 0.5, None)
    assert niss_joint.joint_factors(changed, graph, 0.8, rho=0.5) == fresh != first
    assert niss_joint.joint_factors(sigmas, graph, 0.8, rho=0.0) == niss_joint._joint_factors(
        sigmas, graph, 0.8, None, None, 0.0, None) != first
