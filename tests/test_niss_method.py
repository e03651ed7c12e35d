"""NISS end to end through the real message path (in-process LocalGrid, digits): noise, cancellation, encodings.

* tau = 0: the summed uploads equal the noiseless weighted sum (recomputed here by
  re-running each client's per-example-clipped training) to 1e-9 relative, while every
  single upload carries its own noise of std sigma_k = z p_k C lr / n_k (record level,
  one full-batch step) plus the shares it received.
* tau > 0: the measured aggregate noise variance matches Theorem 2 within 10 %.
* The ``seed`` and ``vector`` encodings give bit-identical aggregates for the same
  seeds; share count and bytes do not depend on sigma_k.

A lying or tampering server and dropouts: tests/test_niss_faults.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest

from client import recovery as recovery_client
from client.env import ClientEnv, local_training, record_level_training
from client.methods import niss as niss_client
from protocols import niss as niss_math
from protocols.adjacency import adjacency_factor
from protocols.arrays import flatten
from protocols.clipping import clip_l2
from protocols.config import RunConfig
from protocols.floor import niss_floor
from protocols.graphs import complete_graph
from protocols.privacy import (
    analytic_gaussian_epsilon,
    analytic_gaussian_sigma,
    calibrate_noise_multiplier,
    gaussian_epsilon,
    record_sensitivity,
)
from protocols.relay_crypto import RelayAuthError, open_sealed, seal
from protocols.task.data import client_partition
from protocols.wire.niss import Diagnostic, NissMetrics, RelayedInbox
from protocols.wire.recovery import SELF_MASK_RECORD, SelfMaskShares
from server.defaults import app_defaults
from strategies.niss import NissStrategy
from strategies.stages import close_round
from tests.niss_setup import FAST, flat, niss_round, niss_setup

#: The aggregate-noise figures these tests check come from the nodes' noiseless-update diagnostic.
pytestmark = pytest.mark.usefixtures("niss_diagnostics")


def _sigmas(cfg: RunConfig, rounds: int | None = None) -> np.ndarray:
    """Every client's sigma_k = z p_k 2 C lr / n_k (record level, one full-batch step), p_k = n_k / N: z 2 C lr / N."""
    z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, rounds or cfg.num_rounds)
    m = cfg.num_clients
    sizes = [len(client_partition(cfg, i, m)[1]) for i in range(m)]
    total = sum(sizes)
    return np.array([z * (n / total) * adjacency_factor(cfg.adjacency) * cfg.clip * cfg.lr / n for n in sizes])


def _scale(cfg: RunConfig, tau: float) -> float:
    """The round's joint-view scale on every sigma_k (all clients, complete graph; protocols.floor.niss_floor)."""
    m = cfg.num_clients
    sizes = {i: len(client_partition(cfg, i, m)[1]) for i in range(m)}
    return niss_floor(cfg, sizes, complete_graph(range(m)), tau).scale


# ----------------------------------------------------------------------------- tau = 0
@pytest.mark.parametrize("graph", ["complete", "n-out"])
def test_tau_zero_aggregate_equals_noiseless(graph):
    cfg, grid, strategy, arrays = niss_setup(niss_tau=0.0, graph=graph, n_out=1, cancellation_check=True)
    assert cfg.privacy_unit == "record" and cfg.batch_size >= 1000 and cfg.local_epochs == 1
    msgs, replies = niss_round(grid, strategy, 1, arrays)
    agg, _ = close_round(strategy, grid, strategy._state, replies)
    # Re-run every client's training without noise: p_k * w_k (per-example-clipped full-batch step).
    expected = np.zeros_like(flat(arrays))
    by_node = {r.metadata.src_node_id: r for r in replies}
    z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, cfg.num_rounds)
    total = sum(len(ClientEnv.from_context(grid.contexts[m.metadata.dst_node_id]).y) for m in msgs)
    for msg in msgs:
        node = msg.metadata.dst_node_id
        env = ClientEnv.from_context(grid.contexts[node])
        _, local, _, _ = record_level_training(msg, env)
        p = RelayedInbox.from_config(msg.content["config"]).weight
        clean = p * flatten(local)
        expected += clean
        reply = by_node[node]
        # the diagnostic side channel carries exactly this noiseless weighted update
        np.testing.assert_allclose(flat(Diagnostic.from_content(reply.content).update), clean, rtol=0, atol=1e-12)
        # ... while the upload itself is noisy: own shares of std sigma_k = z p_k 2 C lr / n_k (Lemma 1) plus the
        # shares received (their variance is reported in the cancellation-check mode)
        figures = NissMetrics.from_metrics(reply.content["metrics"])
        sigma = figures.sigma
        assert sigma == pytest.approx(z * p * cfg.clip * cfg.lr / len(env.y), rel=1e-12)  # zero-out: C lr / n_k
        assert sigma == pytest.approx(z * p * record_sensitivity(cfg, len(env.y)), rel=1e-12)
        noise = flat(reply.content["arrays"]) - clean
        # double masking (self-mask = true by default): plus a self-mask of std sigma_k, removed by the server
        mask_std = SelfMaskShares.from_config(reply.content[SELF_MASK_RECORD]).std
        assert mask_std == sigma
        assert np.std(noise) == pytest.approx(math.sqrt(sigma**2 + mask_std**2 + figures.received_var), rel=0.12)
        # one share per neighbour
        assert figures.shares == len(strategy._state.keys.neighbours[node])
        # the paper's data-size weight: every sigma_k is the central z 2 C lr / N (protocols.niss.aggregation_weights)
        assert p == pytest.approx(len(env.y) / total, rel=1e-12)
        assert sigma == pytest.approx(z * cfg.clip * cfg.lr / total, rel=1e-12)
    err = np.linalg.norm(flat(agg) - expected) / np.linalg.norm(expected)
    assert err <= 1e-9
    rep = strategy.round_report()
    assert rep["theorem2_variance"] == 0.0 and rep["aggregate_error_rel"] <= 1e-9
    assert rep["cancellation_residual"] <= 1e-9


def test_client_level_unit_keeps_the_clipped_update_calibration():
    """privacy-unit = "client": local training, update clipped to clip, sigma_k = z p_k clip."""
    cfg, grid, strategy, arrays = niss_setup(niss_tau=0.0, privacy_unit="client", cancellation_check=True)
    msgs, replies = niss_round(grid, strategy, 1, arrays)
    agg, _ = close_round(strategy, grid, strategy._state, replies)
    z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, cfg.num_rounds)
    expected = np.zeros_like(flat(arrays))
    for msg, reply in zip(msgs, replies, strict=True):
        env = ClientEnv.from_context(grid.contexts[msg.metadata.dst_node_id])
        glob, local, _ = local_training(msg, env)
        clipped, _ = clip_l2(flatten(local) - flatten(glob), cfg.clip)
        expected += (flatten(glob) + clipped) / cfg.num_clients
        assert NissMetrics.from_metrics(reply.content["metrics"]).sigma == pytest.approx(z / cfg.num_clients * cfg.clip,
                                                                                          rel=1e-12)
    assert np.linalg.norm(flat(agg) - expected) <= 1e-9 * np.linalg.norm(expected)
    assert strategy.describe()["privacy_unit"] == "client"


# ------------------------------------------------------------------------- Theorem 2
def test_measured_noise_variance_matches_theorem2(run_inprocess):
    # measured_noise_variance is the mean over the D model coordinates of r^2, r = sum of the 20 products
    # n_i * e_i (one share per neighbour: 5 clients x 4; share x distortion, excess kurtosis 6/20): its relative
    # std is sqrt(2.3 / D).  The "auto" regime gives niss a linear model on digits (D = 650: a 10 % miss per round
    # ~8 %); hidden = 64 (D = 4810) makes the relative std 2.2 %, a 10 % miss a 4.6-sigma event per round and a
    # 5 % miss of the 3-round mean a 3.9-sigma one.
    tau, n = 0.5, 5
    summary, rows = run_inprocess(**FAST, niss_tau=tau, num_rounds=3, cancellation_check=True, hidden="64")
    assert summary["config"]["hidden"] == "64"
    cfg = RunConfig.from_mapping({**app_defaults(), **FAST, "num-rounds": 3, "hidden": "64"})
    # sum_k sigma_k^2 tau^2, sigma_k = c z p_k 2 C lr / n_k (c: the joint-view scale, > 1)
    thm2 = float(np.sum(_sigmas(cfg) ** 2)) * tau**2 * _scale(cfg, tau) ** 2
    assert summary["method_parameters"]["shares_per_client"] == n - 1  # one share per neighbour
    measured = []
    for row in rows:
        assert not row["failed"]
        assert row["theorem2_variance"] == pytest.approx(thm2, rel=1e-9)
        assert row["measured_noise_variance"] == pytest.approx(thm2, rel=0.10)
        measured.append(row["measured_noise_variance"])
    assert np.mean(measured) == pytest.approx(thm2, rel=0.05)


def test_tau_from_rho_and_privacy_report(run_inprocess):
    summary, rows = run_inprocess(**FAST, niss_tau=-1.0, niss_rho=0.75, num_rounds=2, epsilon=5.0)
    params = summary["method_parameters"]
    assert params["tau"] == pytest.approx(math.sqrt(0.5))  # Theorem 3: tau^2 = 2 rho - 1
    assert params["collusion_protected"] == "yes"
    z = calibrate_noise_multiplier(5.0, 1e-5, 1.0, 2)
    cfg = RunConfig.from_mapping({**app_defaults(), **FAST, "num-rounds": 2, "epsilon": 5.0, "niss-rho": 0.75})
    c2 = _scale(cfg, math.sqrt(0.5)) ** 2  # the scale covers 3 of 4 neighbours colluding
    assert rows[0]["theorem2_variance"] == pytest.approx(float(np.sum(_sigmas(cfg) ** 2)) * 0.5 * c2, rel=1e-9)
    # uplink epsilon: RDP composition of the per-round Gaussian; the whole budget is spent at the end
    assert rows[0]["epsilon"] == pytest.approx(gaussian_epsilon(z, 1.0, 1, 1e-5), rel=1e-9)
    assert summary["epsilon"] == pytest.approx(5.0, rel=0.02)
    assert rows[-1]["epsilon_downlink"] is not None  # tau > 0 protects the global model too
    assert summary["epsilon_downlink"] <= 5.0  # tau (Theorem 3) above the model's own need: within the target
    # per-round analytic Gaussian view: one round of noise multiplier z costs less than the total
    assert 0 < params["epsilon_round_analytic"] < 5.0
    cfg0 = RunConfig.from_mapping({**app_defaults(), **FAST, "niss-tau": 0.0})
    report = NissStrategy(cfg0).privacy_report(1)
    assert report["epsilon_downlink"] == report["epsilon_uplink"] == math.inf  # tau = 0: the uploads' sum is exact


def test_default_tau_gives_the_model_the_uploads_epsilon(run_inprocess):
    """Default tau (from the round's sizes, 287-288 records here): the published model's epsilon is the target."""
    summary, rows = run_inprocess(**FAST, num_rounds=2)
    cfg = RunConfig.from_mapping({**app_defaults(), **FAST, "num-rounds": 2})
    sig = _sigmas(cfg)
    tau = summary["method_parameters"]["tau"]
    assert tau == pytest.approx(sig.max() / math.sqrt(np.sum(sig**2)), rel=1e-9)  # sizes_tau
    assert tau == pytest.approx(1 / math.sqrt(cfg.num_clients), rel=1e-12)  # data-size weights: equal sigma_k
    assert tau >= 1 / math.sqrt(cfg.num_clients)
    c = _scale(cfg, tau)
    assert rows[0]["joint_view_scale"] == pytest.approx(c, rel=1e-12) and c > 1
    assert rows[0]["theorem2_variance"] == pytest.approx(float(np.sum(sig**2)) * tau**2 * c**2, rel=1e-9)
    assert summary["epsilon_uplink"] <= cfg.epsilon and summary["epsilon_uplink"] == pytest.approx(cfg.epsilon, rel=1e-3)
    assert summary["epsilon_downlink"] < 0.95 * summary["epsilon_uplink"]  # the model keeps c times the multiplier
    assert summary["privacy"]["unit"] == "record"
    # the second upload figure (no colluding neighbour) is reported beside the claim; the clients' ledgers charge the
    # claim's multiplier z per round (exact Gaussian DP of 2 releases), not the larger one without colluders
    alone = summary["privacy"]["uplink_no_colluder"]["epsilon"]
    assert alone == rows[-1]["epsilon_uplink_no_colluder"] and alone < 0.95 * summary["privacy"]["uplink"]["epsilon"]
    z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, cfg.num_rounds)
    charged = max(rows[-1]["client_epsilon"].values())
    assert charged == pytest.approx(analytic_gaussian_epsilon(z / math.sqrt(2), cfg.delta), rel=1e-3)


# ------------------------------------------------------------------------- encodings
def _deterministic_seed(label: str) -> bytes:
    return hashlib.sha256(b"test/" + label.encode()).digest()


def test_seed_and_vector_encodings_identical(run_inprocess, monkeypatch, tmp_path):
    monkeypatch.setattr(niss_client, "_fresh_seed", _deterministic_seed)
    # the shares' seeds too (they hash the relay keys, which bind the run's settings, the encoding among them)
    monkeypatch.setattr(niss_client, "share_seed", lambda env, rnd, scale, peer, _key: _deterministic_seed(
        f"{env.node_id}/{rnd}/{scale}/share/{peer}"))
    # the self-mask comes off to float rounding only; the same mask in both runs keeps them bit-identical
    monkeypatch.setattr(recovery_client, "new_mask_seed", lambda: _deterministic_seed("self-mask"))
    out = {}
    for enc in ("seed", "vector"):
        summary, rows = run_inprocess(**FAST, niss_tau=0.5, num_rounds=1, niss_share_encoding=enc,
                                      out_dir=str(tmp_path / enc))
        with np.load(tmp_path / enc / "model.npz") as data:
            out[enc] = ({k: data[k] for k in data.files}, rows)
    (w_seed, r_seed), (w_vec, r_vec) = out["seed"], out["vector"]
    for k in w_seed:
        assert np.array_equal(w_seed[k], w_vec[k])  # bit-identical
    # the vector encoding ships every share (float64) through the server, the seed encoding 45 bytes
    size = sum(v.size for v in w_seed.values())
    extra = r_vec[0]["bytes_received_per_client"] - r_seed[0]["bytes_received_per_client"]
    assert extra >= 8 * size  # at least one share vector per client
    assert r_seed[0]["bytes_received_per_client"] < r_vec[0]["bytes_received_per_client"]


@pytest.mark.parametrize("encoding", ["vector", "seed"])
def test_shares_and_bytes_do_not_depend_on_the_noise(run_inprocess, tmp_path, encoding):
    """One share per neighbour whatever sigma_k: share count and bytes are the same at sigma_k ~0.003 and ~800.

    epsilon 64 with one full-batch step against epsilon 1 with 2 local epochs of batch 32 (a ~10^5 larger
    sigma_k, which a count growing with sigma_k^2 turns into hundreds of thousands of shares); the shares still
    cancel on aggregation (tau = 0) to 1e-9 in both.
    """
    cases = {"small": {"epsilon": 64.0}, "large": {"epsilon": 1.0, "local_epochs": 2, "batch_size": 32}}
    out = {}
    for name, kw in cases.items():
        run_dir = tmp_path / f"{encoding}-{name}"
        summary, rows = run_inprocess(**FAST, num_rounds=1, niss_tau=0.0, cancellation_check=True,
                                      niss_share_encoding=encoding, out_dir=str(run_dir), **kw)
        (row,) = rows
        assert not row["failed"] and row["aggregate_error_rel"] <= 1e-9 and row["cancellation_residual"] <= 1e-9
        with np.load(run_dir / "model.npz") as data:
            size = sum(data[k].size for k in data.files)
        out[name] = (summary["method_parameters"], row, size)
    (small, row_small, size), (large, row_large, size_large) = out["small"], out["large"]
    assert size == size_large
    assert large["sigma_k"] > 1e4 * small["sigma_k"]
    assert small["shares_per_client"] == large["shares_per_client"] == FAST["num-clients"] - 1  # complete graph
    for key in ("bytes_sent_per_client", "bytes_received_per_client"):
        # identical up to a few bytes of metric encoding: far less than one share vector (8 bytes per parameter)
        assert abs(row_large[key] - row_small[key]) < 8 * size / 10, key
    if encoding == "vector":  # the share vectors travel: one per neighbour, both ways through the relay
        assert row_small["bytes_received_per_client"] >= 8 * size * (FAST["num-clients"] - 1)


def test_payload_roundtrip_and_rejection():
    b = niss_math.ShareBundle(sender=3, receiver=9, count=1, share_std=0.25, seed=bytes(range(32)))
    size = 17
    for enc in ("seed", "vector"):
        plain = niss_client.encode_payload(enc, b, size)
        got, vec = niss_client.decode_payload(plain, enc, 3, 9, size)
        assert (got.count, got.share_std) == (1, 0.25)
        if enc == "seed":
            assert got.seed == b.seed and vec is None
        else:
            assert np.array_equal(vec, -niss_math.bundle_shares(b, size))
        with pytest.raises(ValueError):
            niss_client.decode_payload(plain, "vector" if enc == "seed" else "seed", 3, 9, size)
        with pytest.raises(ValueError):
            niss_client.decode_payload(plain[:-1], enc, 3, 9, size)
        for count in (0, 2):  # one share per neighbour: any other count is refused
            other = niss_client.encode_payload(enc, dataclasses.replace(b, count=count), size)
            with pytest.raises(ValueError, match="shares"):
                niss_client.decode_payload(other, enc, 3, 9, size)
    aad = niss_client._aad(3, 9, 1, 1, "seed", 1.5)
    blob = seal(bytes(32), niss_client.encode_payload("seed", b, size), aad=aad)
    with pytest.raises(RelayAuthError):
        open_sealed(bytes(32), blob, aad=niss_client._aad(3, 9, 2, 1, "seed", 1.5))  # other round


def test_analytic_epsilon_inverts_sigma():
    for eps, delta in [(0.5, 1e-5), (3.0, 1e-4), (20.0, 1e-5)]:
        sigma = analytic_gaussian_sigma(eps, delta, 1.0)
        assert analytic_gaussian_epsilon(sigma, delta) == pytest.approx(eps, rel=1e-7)


