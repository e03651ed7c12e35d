"""A record whose per-example gradient or loss is not finite adds nothing to the clipped sum (every engine, every method).

A malicious server can send a model on which one record's logits overflow while the others' do not (a large bias
and the same weight on a pixel only that record has bright): that record's gradient is NaN, ``0 * NaN`` is NaN, so
the clipped sum, the noise added to it and the upload were NaN (ddpsa: the fixed-point encoding refused it, after the
ledger had recorded the round) exactly when the record is in the client's data: membership with certainty while
the ledger charged a finite epsilon.  These tests drive the real client code on neighbouring datasets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

import client.methods.ddpsa as ddpsa_client
from client.app import app as client_app
from protocols.config import RunConfig
from protocols.per_example import PerExampleClipper, clipped_grad_sum, vmap_clipped_grad_sum
from protocols.privacy import record_sensitivity
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.common import TrainIns
from protocols.wire.ddpsa import RosterName
from protocols.wire.mpddp import PerturbedModel
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.ddpsa import DdpsaState, DdpsaStrategy
from strategies.mpddp import MpcdpStrategy, MpddpStrategy
from strategies.records import to_record
from strategies.registry import build_strategy
from tests.ddpsa_setup import ddpsa_credentials

pytestmark = pytest.mark.usefixtures("one_thread")

#: ddpsa run config: softmax regression on digits, servers never reached (the pushes are captured).
DDPSA = {"method": "ddpsa", "hidden": "", "num-clients": 3, "train-subset": 400, "test-subset": 100,
         "ddpsa-servers": "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"}
MP = {"hidden": "8", "num-clients": 4, "num-rounds": 3, "train-subset": 400, "test-subset": 100, "clip": 1.0}


def _records(cfg: RunConfig, n: int = 100) -> tuple[np.ndarray, np.ndarray, int, int, float]:
    """``(x, y, target, pixel, big)``: n digits records and one of them singled out by a pixel.

    On a bias ``big`` plus weight ``big`` on ``pixel``, only ``target``'s logit overflows float32.
    """
    ds = dataset_for(cfg)
    x, y = ds.x_train[:n], ds.y_train[:n]
    flat = x.reshape(n, -1)
    for pixel in range(flat.shape[1]):
        top, second = np.sort(flat[:, pixel])[::-1][:2]
        if top > second + 0.1:
            big = float(np.finfo(np.float32).max) / (1 + (top + second) / 2)
            return x, y, int(np.argmax(flat[:, pixel])), pixel, big
    raise AssertionError("no pixel singles out one record")


def _patch_data(monkeypatch, data: list) -> None:
    """Every node's local data is ``data[0]`` (the neighbour a test sets)."""
    import protocols.task.partition_cache as cache

    monkeypatch.setattr(cache, "local_data", lambda cfg, pid, nparts, folder: data[0])


# ------------------------------------------------------------------------------------------------- ddpsa
def _ddpsa_push(raw: dict, monkeypatch, x: np.ndarray, y: np.ndarray, weights) -> list:
    """Round 1 of the real ddpsa clients on ``(x, y)`` and the crafted global model: (replies, pushed sums)."""
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    _patch_data(monkeypatch, [(x, y, ds.num_classes, ds.input_shape)])
    pushed: list[np.ndarray] = []

    def push(noisy, codec, servers, run_id, rnd, me, **_kwargs) -> int:
        codec.encode(noisy)  # what the real push does first (refuses a non-finite value)
        pushed.append(noisy.copy())
        return noisy.size

    monkeypatch.setattr(ddpsa_client, "share_and_push", push)
    monkeypatch.setattr(ddpsa_client, "preflight", lambda *a, **k: None)  # no intermediate servers here
    monkeypatch.setattr(ddpsa_client, "_noise_seed", lambda: bytes(32))  # the same noise on both neighbours
    grid = LocalGrid(client_app, cfg.num_clients, raw)
    names = {r.metadata.src_node_id: RosterName.from_content(r.content).name for r in grid.send_and_receive(
        [Message(RecordDict(), n, "query.ddpsa_identity") for n in grid.node_ids])}
    strategy = DdpsaStrategy(cfg)
    strategy._state = DdpsaState(1, list(grid.node_ids), [], names)
    config = ConfigRecord(strategy.train_config(1))
    msgs = [Message(RecordDict({"arrays": to_record(weights, np.float64), "config": config}), n, "train")
            for n in grid.node_ids]
    return [list(grid.send_and_receive(msgs)), pushed]


def test_ddpsa_a_record_with_an_overflowing_gradient_adds_nothing(tmp_path, monkeypatch) -> None:
    """With and without the target record: both rounds upload, finite, the same sums (the target adds exactly 0).

    Measured without the rule: every client holding the target failed its push (``cannot fixed-point encode
    non-finite value nan``: 650 of 650 coordinates NaN, after its ledger recorded the round); without the target,
    it pushed.
    """
    raw = {**app_defaults(), **DDPSA, **ddpsa_credentials(tmp_path)}
    cfg = RunConfig.from_mapping(raw)
    x, y, target, pixel, big = _records(cfg)
    weights = get_weights(build_model(cfg.model, dataset_for(cfg).input_shape, 10, cfg.hidden_sizes, cfg.seed))
    w, b = list(weights)
    weights[w][0, pixel], weights[b][0] = big, big
    rest = np.delete(np.arange(len(y)), target)
    outcomes = []
    for xs, ys in ((x, y), (x[rest], y[rest])):
        replies, pushed = _ddpsa_push(raw, monkeypatch, xs, ys, weights)
        assert not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
        assert len(pushed) == cfg.num_clients and all(np.isfinite(p).all() for p in pushed)
        assert all(np.isfinite(r.content["metrics"]["train_loss"]) for r in replies)
        outcomes.append(pushed[0])
    np.testing.assert_allclose(outcomes[0], outcomes[1], rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------------------- mpddp
def _overflowing(strategy_cls, big: float, pixel: int, sent: list):
    """The method's strategy sending W-hat with hidden unit 0 = ``big (1 + x_pixel)`` (scaled back down after it).

    The first W-hat crafted goes into ``sent``; later rounds send it again (the same model to both neighbours).
    """

    class Overflowing(strategy_cls):
        def plan(self, grid, st):
            state = super().plan(grid, st)
            if not sent:
                mats = [m.copy() for m in PerturbedModel.from_record(state.model).matrices]
                mats[0][0, :] = 0.0
                mats[0][0, pixel] = mats[0][0, -1] = big  # the last column multiplies the constant-1 unit
                mats[1][:, 0] *= 1e2 / big  # the other records' unit 0 stays moderate
                sent.append(to_record(PerturbedModel(tuple(mats)).to_arrays(), np.float64))
            state.model = sent[0]
            return state

    return Overflowing


@pytest.mark.parametrize(("method", "side"), [("mpddp", "float32"), ("mpcdp", "float64")])
def test_mpddp_a_record_with_an_overflowing_gradient_adds_nothing(method, side, monkeypatch) -> None:
    """The real mpddp / mpcdp clients on W-hat crafted to overflow one record: finite uploads on both neighbours.

    mpcdp (no client noise): the record adds exactly 0, so ``n_k`` times the uploaded mean gradient is the same.
    Measured without the rule: every client holding the target failed (``linalg.eigh ... failed to converge``: the
    clip's Psi norm of its NaN Gram matrix), every client without it uploaded.
    """
    raw = {**app_defaults(), **MP, "method": method, "mpddp-side-dtype": side}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    x, y, target, pixel, _ = _records(cfg)
    big = float(np.finfo(side).max) / (1 + float(np.sort(x.reshape(len(y), -1)[:, pixel])[-2:].mean()))
    rest = np.delete(np.arange(len(y)), target)
    data: list = []
    _patch_data(monkeypatch, data)
    sums: list[np.ndarray] = []
    sent: list = []
    for xs, ys in ((x, y), (x[rest], y[rest])):
        data[:] = [(xs, ys, ds.num_classes, ds.input_shape)]
        grid = LocalGrid(client_app, cfg.num_clients, raw)
        strategy = _overflowing({"mpddp": MpddpStrategy, "mpcdp": MpcdpStrategy}[method], big, pixel, sent)(cfg)
        model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
        arrays = to_record(get_weights(model), strategy.wire_dtype)
        msgs = list(strategy.configure_train(1, arrays, ConfigRecord(TrainIns(1).to_config()), grid))
        replies = list(grid.send_and_receive(msgs))
        assert replies and not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
        uploads = [np.concatenate([np.asarray(a.numpy(), np.float64).ravel() for a in r.content["arrays"].values()])
                   for r in replies]
        assert all(np.isfinite(u).all() for u in uploads)
        grads = sum(np.asarray(a.numpy()).size for a in list(replies[0].content["arrays"].values())[:2])
        sums.append(uploads[0][:grads] * len(ys))
    if method == "mpcdp":
        np.testing.assert_allclose(sums[0], sums[1], rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------- record level
def _first_round_replies(cfg: RunConfig, raw: dict, ds, weights: dict | None = None) -> list:
    """Round 1 of ``cfg``'s strategy through the real ClientApps; none failed.

    From ``weights`` (sent in float64), else from the seeded initial model (in the strategy's wire dtype).
    """
    grid = LocalGrid(client_app, cfg.num_clients, raw)
    strategy = build_strategy(cfg)
    if weights is None:
        model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
        record = to_record(get_weights(model), strategy.wire_dtype)
    else:
        record = to_record(weights, np.float64)
    msgs = list(strategy.configure_train(1, record, ConfigRecord(TrainIns(1).to_config()), grid))
    replies = list(grid.send_and_receive(msgs))
    assert replies and not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
    return replies


@pytest.mark.parametrize("method", ["ldp", "cdp", "nadp"])
def test_record_level_training_drops_a_record_with_a_non_finite_feature(method, monkeypatch) -> None:
    """A record with a NaN feature (a missing value): the uploads and the loss stay finite on both neighbours.

    The received model's norm is capped (:func:`protocols.privacy.largest_trainable_norm`), so on the built-in models
    a server cannot make one record overflow; a record of the node's own data can be non-finite.  Measured without
    the rule: the upload of every client holding it was NaN (and its train loss).
    """
    raw = {**app_defaults(), "method": method, "num-clients": 4, "num-rounds": 3, "local-epochs": 1,
           "batch-size": 32, "hidden": "", "train-subset": 400, "test-subset": 100}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    x, y = ds.x_train[:100].copy(), ds.y_train[:100]
    x[7, 0, 4, 4] = np.nan
    _patch_data(monkeypatch, [(x, y, ds.num_classes, ds.input_shape)])
    for r in _first_round_replies(cfg, raw, ds):
        assert all(np.isfinite(a.numpy()).all() for a in r.content["arrays"].values())
        assert np.isfinite(r.content["metrics"]["train_loss"])


# ------------------------------------------------------------------------------------------- the engines
class _Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.fc = torch.nn.Linear(2 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class _Sequence(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.reshape(len(x), 8, 8)).sum(1)


class _Tanh(torch.nn.Module):  # a parameter outside a supported layer: the vmap path
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)
        self.gain = torch.nn.Parameter(torch.ones(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1)) * self.gain


@pytest.mark.parametrize("make", [lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)),
                                  _Conv, _Sequence, _Tanh])
@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 3e38])
def test_every_engine_drops_a_non_finite_record(make, norm, poison) -> None:
    """A record with a non-finite (or overflowing) feature: the clipped sum equals the sum without it, loss 0."""
    torch.manual_seed(0)
    model = make()
    x, y = torch.rand(12, 1, 8, 8), torch.randint(0, 10, (12,))
    x[5, 0, 3, 3] = poison
    y[5] = 0
    rest = torch.arange(12) != 5
    for engine in (clipped_grad_sum, vmap_clipped_grad_sum):
        got, ref = engine(model, x, y, 0.5, norm=norm), engine(model, x[rest], y[rest], 0.5, norm=norm)
        for g, r in zip(got.grads, ref.grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        assert float(got.losses[5]) == 0.0 and torch.isfinite(got.losses).all()
        assert got.clipped == ref.clipped + 1  # the dropped record counts as clipped
    with PerExampleClipper(model, 0.5, norm=norm) as clipper:
        step = clipper.descend(x, y, 0.1)
    assert all(torch.isfinite(p).all() for p in model.parameters()) and torch.isfinite(step.losses).all()


def test_mpddp_refuses_a_w_hat_not_finite_in_its_compute_dtype() -> None:
    """Such a W-hat makes every example's terms NaN (``0 * inf``): refused whatever the data."""
    from protocols.mpddp import clipped_client_gradients

    mats = [torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64),
            torch.randn(2, 5, dtype=torch.float64)]
    x, y = torch.rand(6, 3, dtype=torch.float64), torch.eye(2, dtype=torch.float64)[torch.tensor([0, 1] * 3)]
    clipped_client_gradients(mats, x, y, 1.0, rho=1.0)
    mats[1][0, 0] = 1e39  # finite in float64, inf in float32
    clipped_client_gradients(mats, x, y, 1.0, rho=1.0)
    with pytest.raises(ValueError, match="not finite in torch.float32"):
        clipped_client_gradients([m.float() for m in mats], x.float(), y.float(), 1.0, rho=1.0)


# --------------------------------------------------------------------------------------- client level
@pytest.mark.parametrize("method", ["ldp", "cdp"])
def test_client_level_update_that_diverged_is_clipped_to_zero(method, monkeypatch) -> None:
    """Client-level training on a model on which one record's logits overflow: finite uploads on both neighbours.

    The update is clipped by :func:`protocols.clipping.clip_l2` (client-level ldp, cdp, niss), which kept NaN: a
    NaN update passes any scaling and any noise.  Measured without the rule (ldp, ``privacy-unit = "client"``):
    every client holding the target record uploaded 650 of 650 coordinates NaN, every client without it a finite
    upload, while the ledger charged the round's finite epsilon (1.07): membership with certainty.
    """
    raw = {**app_defaults(), "method": method, "privacy-unit": "client", "num-clients": 2, "num-rounds": 3,
           "local-epochs": 1, "batch-size": 32, "hidden": "", "train-subset": 400, "test-subset": 100}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    x, y, target, pixel, big = _records(cfg)
    weights = get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed))
    w, b = list(weights)
    weights[w][0, pixel], weights[b][0] = big, big
    rest = np.delete(np.arange(len(y)), target)
    data: list = []
    _patch_data(monkeypatch, data)
    for xs, ys in ((x, y), (x[rest], y[rest])):
        data[:] = [(xs, ys, ds.num_classes, ds.input_shape)]
        for r in _first_round_replies(cfg, raw, ds, weights):
            assert all(np.isfinite(a.numpy()).all() for a in r.content["arrays"].values())


@pytest.mark.parametrize("method", ["nadp", "niss"])
def test_record_level_training_that_float32_cannot_hold_trains_in_float64(method, monkeypatch) -> None:
    """Run-config ``lr`` and ``clip`` whose steps float32 cannot hold: finite, alike uploads on both neighbours.

    ``lr = 1e40``, ``clip = 100``: one full-batch step moves a weight by up to ``lr clip``, past float32's range
    where the records' clipped gradients add up; a feature only the target record has decides whether its
    weights overflow.  The float64 upload (``w + noise``, the noise finite) carried ``inf`` exactly there: measured
    without the rule (nadp), 80 of 650 coordinates ``inf`` with the target against 76 without it, 12 coordinates
    ``inf`` in one upload only, while the ledger charged a finite epsilon.  Decided on public values
    (:func:`protocols.privacy.record_training_range`), such a training runs in float64.
    """
    raw = {**app_defaults(), "method": method, "num-clients": 5, "num-rounds": 3, "local-epochs": 1,
           "batch-size": 1000, "hidden": "", "train-subset": 500, "test-subset": 100, "lr": 1e40, "clip": 100.0}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    x, y = ds.x_train[:100].copy(), ds.y_train[:100]
    flat = x.reshape(len(y), -1)
    flat[:, 0], flat[7, 0] = 0.0, 1.0  # pixel 0: only record 7 has it
    rest = np.concatenate([np.delete(np.arange(len(y)), 7), [0]])  # replace-one: the same size
    data: list = []
    _patch_data(monkeypatch, data)
    masks = []
    for xs, ys in ((x, y), (x[rest], y[rest])):
        data[:] = [(xs, ys, ds.num_classes, ds.input_shape)]
        replies = _first_round_replies(cfg, raw, ds)
        up = [np.concatenate([np.asarray(a.numpy(), np.float64).ravel() for a in r.content["arrays"].values()])
              for r in replies]
        masks.append(np.isfinite(up[0]))
    assert masks[0].all() and masks[1].all()



@pytest.mark.parametrize(("hidden", "clip", "lr"), [("4", 1e-13, 1e15), ("", 1e-30, 1e21)])
def test_record_level_ldp_on_a_saturated_model_keeps_the_record_sensitivity(hidden, clip, lr, monkeypatch) -> None:
    """The real ldp client (noise 0) on neighbouring datasets: the uploads differ by at most the record sensitivity.

    The server's model saturates class 0 (output biases ``-gap`` on the others): a class-0 record's output delta is
    ``~e^-gap`` and its squared gradient norm rounds to 0 in float32, so it entered the step unclipped.  ``hidden``:
    a hidden unit at ``1e14`` makes the gradient ``|d| |a|`` far above the clip while ``|d|^2`` alone underflows
    (:mod:`protocols.per_example.norms`); measured without it the uploads differed by 5.3e3 times the sensitivity.
    Linear: at clip ``1e-30`` the whole squared norm (``~4e-47``) underflows float32, which then trains in float64
    (:func:`protocols.privacy.record_training_resolution`); measured without that rule, 2.1e6 times the sensitivity.
    """
    raw = {**app_defaults(), "method": "ldp", "num-clients": 2, "num-rounds": 3, "local-epochs": 1, "batch-size": 100,
           "hidden": hidden, "train-subset": 400, "test-subset": 100, "clip": clip, "lr": lr,
           "adjacency": "replace-one"}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    x, y = ds.x_train[:100], ds.y_train[:100]
    target, other = int(np.flatnonzero(y == 0)[0]), int(np.flatnonzero(y == 1)[0])
    xr, yr = x.copy(), y.copy()
    xr[target], yr[target] = x[other], 1  # replace-one: the same size
    weights = get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed))
    for w in weights.values():
        w[...] = 0.0
    *first, last = list(weights)
    if first[1:]:
        weights[first[1]][0] = 1e14  # hidden unit 0
    weights[last][1:] = -54.0 if hidden else -56.0
    monkeypatch.setattr("protocols.prg.gaussian", lambda seed, n, std: np.zeros(n))
    data: list = []
    _patch_data(monkeypatch, data)
    uploads = []
    for xs, ys in ((x, y), (xr, yr)):
        data[:] = [(xs, ys, ds.num_classes, ds.input_shape)]
        replies = _first_round_replies(cfg, raw, ds, weights)
        uploads.append(np.concatenate([np.asarray(a.numpy(), np.float64).ravel()
                                       for a in replies[0].content["arrays"].values()]))
    moved = float(np.linalg.norm(uploads[0] - uploads[1]))
    assert moved <= record_sensitivity(cfg, len(y)) * (1 + 1e-4), moved / record_sensitivity(cfg, len(y))
