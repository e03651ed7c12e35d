"""NISS end to end through the real message path (in-process LocalGrid, digits).

* tau = 0: the summed uploads equal the noiseless weighted sum (recomputed here by
  re-running each client's per-example-clipped training) to 1e-9 relative, while every
  single upload carries its own noise of std sigma_k = z p_k 2 C lr / n_k (record level,
  one full-batch step) plus the shares it received.
* tau > 0: the measured aggregate noise variance matches Theorem 2 within 10 %.
* A tampered, dropped, redirected or replayed relayed payload: its receiver uploads
  nothing and names the sender; the round goes on without it, its shares removed
  exactly by the dropout recovery (never a silently wrong model).
* The ``seed`` and ``vector`` encodings give bit-identical aggregates for the same
  seeds; share-phase dropouts re-run the share phase, train-phase dropouts are
  recovered (strategies.recovery), a second dropout during recovery fails the round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord

from client import recovery as recovery_client
from client.app import app as client_app
from client.data import client_partition, dataset_for
from client.env import ClientEnv, local_training, record_level_training
from client.messages.niss import AuthFailures, Diagnostic, NissMetrics, RelayedInbox, ShareRequest
from client.messages.recovery import SELF_MASK_RECORD, SelfMaskShares
from client.methods import niss as niss_client
from client.models import build_model, get_weights
from client.wire import from_record, to_record
from protocols import niss as niss_math
from protocols.arrays import flatten
from protocols.clipping import clip_l2
from protocols.config import RunConfig
from protocols.privacy import (
    analytic_gaussian_epsilon,
    analytic_gaussian_sigma,
    calibrate_noise_multiplier,
    gaussian_epsilon,
    record_sensitivity,
)
from protocols.relay_crypto import RelayAuthError, open_sealed, seal
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.base import RoundFailed
from strategies.niss import NissStrategy
from strategies.stages import close_round

#: 5 clients on digits in niss's regime (linear model, one full-batch per-example-clipped step per round).
FAST = {"num-clients": 5, "method": "niss"}


def _sigmas(cfg: RunConfig, rounds: int | None = None) -> np.ndarray:
    """Every client's sigma_k = z p_k 2 C lr / n_k (record level, one full-batch step), p_k = n_k / N: z 2 C lr / N."""
    z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, rounds or cfg.num_rounds)
    m = cfg.num_clients
    sizes = [len(client_partition(cfg, i, m)[1]) for i in range(m)]
    total = sum(sizes)
    return np.array([z * (n / total) * 2 * cfg.clip * cfg.lr / n for n in sizes])


def _setup(grid_cls=LocalGrid, **overrides):
    raw = {**app_defaults(), **FAST, **{k.replace("_", "-"): v for k, v in overrides.items()}}
    cfg = RunConfig.from_mapping(raw)
    grid = grid_cls(client_app, cfg.num_clients, raw)
    ds = dataset_for(cfg)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
    return cfg, grid, NissStrategy(cfg), to_record(get_weights(model), np.float64)


def _round(grid, strategy, rnd, arrays):
    msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"round": rnd}), grid))
    replies = list(grid.send_and_receive(msgs))
    return msgs, replies


def _flat(record) -> np.ndarray:
    return flatten(from_record(record))


# ----------------------------------------------------------------------------- tau = 0
@pytest.mark.parametrize("graph", ["complete", "n-out"])
def test_tau_zero_aggregate_equals_noiseless(graph):
    cfg, grid, strategy, arrays = _setup(niss_tau=0.0, graph=graph, n_out=1, cancellation_check=True)
    assert cfg.privacy_unit == "record" and cfg.batch_size >= 1000 and cfg.local_epochs == 1
    msgs, replies = _round(grid, strategy, 1, arrays)
    agg, _ = close_round(strategy, grid, strategy._state, replies)
    # Re-run every client's training without noise: p_k * w_k (per-example-clipped full-batch step).
    expected = np.zeros_like(_flat(arrays))
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
        np.testing.assert_allclose(_flat(Diagnostic.from_content(reply.content).update), clean, rtol=0, atol=1e-12)
        # ... while the upload itself is noisy: own shares of std sigma_k = z p_k 2 C lr / n_k (Lemma 1) plus the
        # shares received (their variance is reported in the cancellation-check mode)
        figures = NissMetrics.from_metrics(reply.content["metrics"])
        sigma = figures.sigma
        assert sigma == pytest.approx(z * p * 2 * cfg.clip * cfg.lr / len(env.y), rel=1e-12)
        assert sigma == pytest.approx(z * p * record_sensitivity(cfg, len(env.y)), rel=1e-12)
        noise = _flat(reply.content["arrays"]) - clean
        # double masking (self-mask = true by default): plus a self-mask of std sigma_k, removed by the server
        mask_std = SelfMaskShares.from_config(reply.content[SELF_MASK_RECORD]).std
        assert mask_std == sigma
        assert np.std(noise) == pytest.approx(math.sqrt(sigma**2 + mask_std**2 + figures.received_var), rel=0.12)
        # one share per neighbour
        assert figures.shares == len(strategy._state.keys.neighbours[node])
        # the paper's data-size weight: every sigma_k is the central z 2 C lr / N (protocols.niss.aggregation_weights)
        assert p == pytest.approx(len(env.y) / total, rel=1e-12)
        assert sigma == pytest.approx(z * 2 * cfg.clip * cfg.lr / total, rel=1e-12)
    err = np.linalg.norm(_flat(agg) - expected) / np.linalg.norm(expected)
    assert err <= 1e-9
    rep = strategy.round_report()
    assert rep["theorem2_variance"] == 0.0 and rep["aggregate_error_rel"] <= 1e-9
    assert rep["cancellation_residual"] <= 1e-9


def test_client_level_unit_keeps_the_clipped_update_calibration():
    """privacy-unit = "client": local training, update clipped to clip, sigma_k = z p_k clip."""
    cfg, grid, strategy, arrays = _setup(niss_tau=0.0, privacy_unit="client", cancellation_check=True)
    msgs, replies = _round(grid, strategy, 1, arrays)
    agg, _ = close_round(strategy, grid, strategy._state, replies)
    z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, cfg.num_rounds)
    expected = np.zeros_like(_flat(arrays))
    for msg, reply in zip(msgs, replies, strict=True):
        env = ClientEnv.from_context(grid.contexts[msg.metadata.dst_node_id])
        glob, local, _ = local_training(msg, env)
        clipped, _ = clip_l2(flatten(local) - flatten(glob), cfg.clip)
        expected += (flatten(glob) + clipped) / cfg.num_clients
        assert NissMetrics.from_metrics(reply.content["metrics"]).sigma == pytest.approx(z / cfg.num_clients * cfg.clip,
                                                                                          rel=1e-12)
    assert np.linalg.norm(_flat(agg) - expected) <= 1e-9 * np.linalg.norm(expected)
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
    thm2 = float(np.sum(_sigmas(cfg) ** 2)) * tau**2  # sum_k sigma_k^2 tau^2, sigma_k = z p_k 2 C lr / n_k
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
    cfg = RunConfig.from_mapping({**app_defaults(), **FAST, "num-rounds": 2, "epsilon": 5.0})
    assert rows[0]["theorem2_variance"] == pytest.approx(float(np.sum(_sigmas(cfg) ** 2)) * 0.5, rel=1e-9)
    # uplink epsilon: RDP composition of the per-round Gaussian; the whole budget is spent at the end
    assert rows[0]["epsilon"] == pytest.approx(gaussian_epsilon(z, 1.0, 1, 1e-5), rel=1e-9)
    assert summary["epsilon"] == pytest.approx(5.0, rel=0.02)
    assert rows[-1]["epsilon_downlink"] is not None  # tau > 0 protects the global model too
    assert summary["epsilon_downlink"] <= 5.0  # tau (Theorem 3) above the model's own need: within the target
    # per-round analytic Gaussian view: one round of noise multiplier z costs less than the total
    assert 0 < params["epsilon_round_analytic"] < 5.0
    cfg0 = RunConfig.from_mapping({**app_defaults(), **FAST, "niss-tau": 0.0})
    assert NissStrategy(cfg0).privacy_report(1)["epsilon_downlink"] == math.inf  # tau = 0: noise cancels


def test_default_tau_gives_the_model_the_uploads_epsilon(run_inprocess):
    """Default tau (from the round's sizes, 287-288 records here): the published model's epsilon is the target."""
    summary, rows = run_inprocess(**FAST, num_rounds=2)
    cfg = RunConfig.from_mapping({**app_defaults(), **FAST, "num-rounds": 2})
    sig = _sigmas(cfg)
    tau = summary["method_parameters"]["tau"]
    assert tau == pytest.approx(sig.max() / math.sqrt(np.sum(sig**2)), rel=1e-9)  # sizes_tau
    assert tau == pytest.approx(1 / math.sqrt(cfg.num_clients), rel=1e-12)  # data-size weights: equal sigma_k
    assert tau >= 1 / math.sqrt(cfg.num_clients)
    assert rows[0]["theorem2_variance"] == pytest.approx(float(np.sum(sig**2)) * tau**2, rel=1e-9)
    assert summary["epsilon_uplink"] <= cfg.epsilon and summary["epsilon_uplink"] == pytest.approx(cfg.epsilon, rel=1e-3)
    assert summary["epsilon_downlink"] == pytest.approx(summary["epsilon_uplink"], rel=1e-6)
    assert summary["privacy"]["unit"] == "record"


def test_a_wrong_size_for_the_client_is_refused():
    """The share request's size list must name this client's own dataset size (it derives tau from the list)."""
    cfg, grid, strategy, arrays = _setup()

    class Liar(NissStrategy):
        def exchange(self, grid, nodes, content_fn, action):
            if action != "shares":
                return super().exchange(grid, nodes, content_fn, action)

            def content(node, inner=content_fn):
                rec = inner(node)
                req = ShareRequest.from_config(rec["config"])
                sizes = {n: v + 1 for n, v in req.sizes.items()}
                rec["config"] = dataclasses.replace(req, sizes=sizes).to_config()
                return rec
            replies, errors = super().exchange(grid, nodes, content, action)
            self.errors += errors
            return replies, errors

    liar = Liar(cfg)
    liar.errors = []
    with pytest.raises(RoundFailed, match="share exchange did not complete"):
        _round(grid, liar, 1, arrays)
    assert liar.errors and all("examples" in e for e in liar.errors)


class _ShareLiar(NissStrategy):
    """A server that rewrites the share request of its ``victims`` with ``rewrite(node, request)``."""

    victims: tuple[int, ...] = ()

    def rewrite(self, node: int, req: ShareRequest) -> ShareRequest:
        raise NotImplementedError

    def exchange(self, grid, nodes, content_fn, action):
        if action != "shares":
            return super().exchange(grid, nodes, content_fn, action)

        def content(node, inner=content_fn):
            rec = inner(node)
            if node in self.victims:
                rec["config"] = self.rewrite(node, ShareRequest.from_config(rec["config"])).to_config()
            return rec
        replies, errors = super().exchange(grid, nodes, content, action)
        self.errors += errors
        return replies, errors


def test_a_shrunken_weight_is_refused():
    """A server that gives some clients a smaller p_k is refused.

    Less weight means less noise next to the negated shares they hold, which would expose a target's shares;
    each client computes p_k from the round's view itself.
    """
    cfg, grid, _, arrays = _setup()

    class Shrinker(_ShareLiar):
        def rewrite(self, node, req):
            return dataclasses.replace(req, weight=req.weight / 100)

    liar = Shrinker(cfg)
    liar.errors = []
    liar.victims = tuple(grid.node_ids[1:])  # everyone but the target
    with pytest.raises(RoundFailed, match="share exchange did not complete"):
        _round(grid, liar, 1, arrays)
    assert liar.errors and all("does not match the round's view" in e for e in liar.errors)


def test_sizes_shown_to_one_client_only_leave_it_keys_nobody_shares():
    """Sizes shown to one client only: its relay keys match nobody's.

    A server that inflates a peer's size in one client's view (and sends the weight that view gives) shrinks
    that client's p_k consistently, but the sizes are part of the view bound into the relay keys: the victim
    cannot open its peers' payloads nor they its, and it uploads nothing.
    """
    cfg, grid, _, arrays = _setup()

    class Inflater(_ShareLiar):
        lied: dict[int, float] = {}

        def rewrite(self, node, req):
            other = next(n for n in sorted(req.sizes) if n != node)
            sizes = {**req.sizes, other: req.sizes[other] * 100}
            self.lied[node] = niss_math.aggregation_weights(cfg, req.peers.participants, sizes)[node]
            return dataclasses.replace(req, sizes=sizes, weight=self.lied[node])

        def train_content(self, state, node, arrays):  # the same weight again with the relayed payloads
            content = super().train_content(state, node, arrays)
            if node in self.lied:
                inbox = RelayedInbox.from_config(content["config"])
                content["config"] = dataclasses.replace(inbox, weight=self.lied[node]).to_config()
            return content

    liar = Inflater(cfg)
    liar.errors = []
    victim = grid.node_ids[0]
    liar.victims = (victim,)
    _msgs, replies = _round(grid, liar, 1, arrays)
    assert not liar.errors  # the victim accepted the (self-consistent) request ...
    by_node = {r.metadata.src_node_id: r for r in replies}
    report = AuthFailures.from_config(by_node[victim].content["config"])
    assert report and "arrays" not in by_node[victim].content  # ... but its shrunken-weight upload never left it
    assert all(AuthFailures.from_config(r.content["config"]).senders == (victim,)
               for n, r in by_node.items() if n != victim)  # its peers cannot open its payloads either


# ------------------------------------------------------------------------- tampering
class TamperGrid(LocalGrid):
    """LocalGrid whose 'server' alters relayed payloads in train messages (set ``mode``)."""

    mode: str = ""
    saved: dict = {}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tampered: list[tuple[int, int]] = []  # (victim, sender of the altered payload) per tampered round

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        train = [m for m in messages if m.metadata.message_type == "train"]
        if train and self.mode:
            inboxes = [RelayedInbox.from_config(m.content["config"]) for m in train]
            first = inboxes[0]
            self.tampered.append((train[0].metadata.dst_node_id, first.from_ids[0]))
            senders, blobs = list(first.from_ids), list(first.payloads)
            if self.mode == "flip":
                b = bytearray(blobs[0])
                b[20] ^= 0x01
                blobs[0] = bytes(b)
            elif self.mode == "drop":
                senders, blobs = senders[1:], blobs[1:]
            elif self.mode == "swap":  # deliver another pair's payload under the same sender label
                blobs[0] = inboxes[1].payloads[0]
            elif self.mode == "replay" and first.round == 1:
                self.saved = {m.metadata.dst_node_id: inbox.payloads for m, inbox in zip(train, inboxes, strict=True)}
            elif self.mode == "replay":
                blobs = list(self.saved[train[0].metadata.dst_node_id])
            tampered = dataclasses.replace(first, from_ids=tuple(senders), payloads=tuple(blobs))
            train[0].content["config"] = tampered.to_config()
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.parametrize(("mode", "why"), [("flip", "authentication failed"), ("drop", "missing payload"),
                                           ("swap", "authentication failed"), ("replay", "authentication failed")])
def test_tampered_relay_leaves_the_victim_out_and_is_recovered(mode, why):
    """A relayed payload the server altered: the round goes on without its receiver, exactly.

    The receiver uploads nothing and names the sender (who is struck); the dropout recovery removes the shares
    the receiver exchanged.
    """
    _, grid, strategy, arrays = _setup(TamperGrid, niss_tau=0.0, cancellation_check=True)
    if mode == "replay":  # round 1 untouched (payloads recorded), round 2 gets round 1's ciphertexts
        grid.mode = "replay"
        _, replies = _round(grid, strategy, 1, arrays)
        close_round(strategy, grid, strategy._state, replies)
        rnd = 2
    else:
        grid.mode, rnd = mode, 1
    msgs, replies = _round(grid, strategy, rnd, arrays)
    victim = msgs[0].metadata.dst_node_id
    assert grid.tampered[-1][0] == victim
    new_arrays, _ = close_round(strategy, grid, strategy._state, replies)
    # the victim is the only one excluded, with the reason it reported; it gets no strike (not its fault)
    assert list(strategy.excluded) == [victim]
    assert why in strategy.excluded[victim] and "uploaded nothing" in strategy.excluded[victim]
    assert victim not in strategy.strikes.count
    rep = strategy.round_report()
    assert rep["recovery"] == 1 and rep["cancellation_residual"] <= 1e-9 and rep["aggregate_error_rel"] <= 1e-9
    assert new_arrays is not None and np.all(np.isfinite(_flat(new_arrays)))
    # the victim uploaded nothing; nobody else complained
    bad = [r for r in replies if "config" in r.content and AuthFailures.from_config(r.content["config"])]
    assert [r.metadata.src_node_id for r in bad] == [victim] and "arrays" not in bad[0].content
    # the sender(s) the victim names are struck once and keep their upload; nobody else is struck
    named = set(AuthFailures.from_config(bad[0].content["config"]).senders)
    if mode != "replay":  # one altered payload: its sender label is the one the victim names
        assert named == {grid.tampered[-1][1]}
    assert named and victim not in named and strategy.strikes.count == dict.fromkeys(named, 1)
    assert named <= strategy.uploaded and not named & set(strategy.excluded) and not strategy.strikes.banned


def test_runner_completes_tampered_rounds(tmp_path):
    """Through the runner: every round with a tampered payload completes without its victim.

    The sender the victim names is struck each round; at ``max-strikes`` rounds in a row it is left out of later
    rounds.  Every round's model comes only from the honest uploads (the noise cancels exactly).
    """
    from server.runner import run_federation

    # round 3 has 4 clients (3 neighbours each): no colluders assumed, so the self-mask threshold 2 of 3 lets one drop
    cfg, grid, strategy, _ = _setup(TamperGrid, niss_tau=0.0, num_rounds=3, max_strikes=2, mask_corruption_rate=0.0,
                                    cancellation_check=True, out_dir=str(tmp_path / "t"))
    grid.mode = "flip"
    summary = run_federation(strategy, grid, cfg, progress=lambda _s: None)
    assert summary["failed_rounds"] == [] and summary["rounds_completed"] == 3 and summary["model_round"] == 3
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and len(grid.tampered) == 3
    for row, (victim, _sender) in zip(rows, grid.tampered, strict=True):
        assert not row["failed"] and list(row["excluded"]) == [str(victim)]
        assert "authentication failed" in row["excluded"][str(victim)]
        assert row["recovery"] == 1 and row["cancellation_residual"] <= 1e-9 and row["aggregate_error_rel"] <= 1e-9
    (v1, s1), (v2, s2), (_v3, s3) = grid.tampered
    assert (v1, s1) == (v2, s2)  # the same pair is tampered while both take part
    assert rows[0]["left_out"] == [] and rows[1]["left_out"] == rows[2]["left_out"] == [str(s1)]
    assert s3 != s1 and rows[2]["clients"] == cfg.num_clients - 1  # the banned sender is no longer sampled
    assert list(strategy.strikes.banned) == [s1] and "failed 2 rounds in a row" in strategy.strikes.banned[s1]
    assert f"rejected by neighbour(s) [{v1}]" in strategy.strikes.banned[s1]


# ------------------------------------------------------------------------- encodings
def _deterministic_seed(label: str) -> bytes:
    return hashlib.sha256(b"test/" + label.encode()).digest()


def test_seed_and_vector_encodings_identical(run_inprocess, monkeypatch, tmp_path):
    monkeypatch.setattr(niss_client, "_fresh_seed", _deterministic_seed)
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
    aad = niss_client._aad(3, 9, 1, 1, "seed")
    blob = seal(bytes(32), niss_client.encode_payload("seed", b, size), aad=aad)
    with pytest.raises(RelayAuthError):
        open_sealed(bytes(32), blob, aad=niss_client._aad(3, 9, 2, 1, "seed"))  # other round


def test_analytic_epsilon_inverts_sigma():
    for eps, delta in [(0.5, 1e-5), (3.0, 1e-4), (20.0, 1e-5)]:
        sigma = analytic_gaussian_sigma(eps, delta, 1.0)
        assert analytic_gaussian_epsilon(sigma, delta) == pytest.approx(eps, rel=1e-7)


# -------------------------------------------------------------------------- dropouts
class PhaseDropGrid(LocalGrid):
    """LocalGrid where node ``victim`` drops messages of type ``phase``."""

    victim: int = 0
    phase: str = ""

    def send_and_receive(self, messages, *, timeout=None):
        messages = [m for m in messages
                    if not (m.metadata.dst_node_id == self.victim and m.metadata.message_type == self.phase)]
        return super().send_and_receive(messages, timeout=timeout)


def test_share_phase_dropout_is_recovered():
    _, grid, strategy, arrays = _setup(PhaseDropGrid, niss_tau=0.0, cancellation_check=True)
    grid.victim, grid.phase = grid.node_ids[2], "query.shares"
    msgs, replies = _round(grid, strategy, 1, arrays)
    assert len(msgs) == 4 and grid.victim not in {m.metadata.dst_node_id for m in msgs}
    close_round(strategy, grid, strategy._state, replies)
    rep = strategy.round_report()
    assert rep["participants"] == 4 and rep["dropped"] == 1
    assert rep["aggregate_error_rel"] <= 1e-9  # the survivors' shares still cancel


def test_train_dropout_is_recovered():
    """A client that drops after the share exchange: the shares it exchanged are removed exactly.

    The survivors reveal them (strategies.recovery); the survivors' own shares still cancel.
    """
    _, grid, strategy, arrays = _setup(PhaseDropGrid, niss_tau=0.0, cancellation_check=True)
    grid.victim, grid.phase = grid.node_ids[1], "train"
    _, replies = _round(grid, strategy, 1, arrays)
    close_round(strategy, grid, strategy._state, replies)
    rep = strategy.round_report()
    assert rep["dropped"] == 1 and rep["recovery"] == 1 and rep["kept_pairs"] == 0
    assert rep["aggregate_error_rel"] <= 1e-9 and rep["cancellation_residual"] <= 1e-9


def test_train_dropout_without_recovery_fails_the_round():
    """A strategy whose recovery phase cannot reach the survivors fails the round instead of keeping the noise."""
    _, grid, strategy, arrays = _setup(PhaseDropGrid, niss_tau=0.0)
    grid.victim, grid.phase = grid.node_ids[1], "train"
    _, replies = _round(grid, strategy, 1, arrays)
    grid.victim, grid.phase = grid.node_ids[2], "query.recover"  # a second dropout, during recovery
    with pytest.raises(RoundFailed, match="did not answer"):
        close_round(strategy, grid, strategy._state, replies)
