"""The library API, as a user of cancelfl in their own Flower app would use it.

Strategies from keyword arguments run by ``Strategy.start()``, the client-side ``attach``/``protect`` with a
model defined here (outside the model zoo), and models/datasets by import path.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from torch import nn

from client.api import attach
from protocols.config import ConfigError, RunConfig
from protocols.task.data import load_dataset
from protocols.task.models import build_model, load_npz_model, resolve_device, save_npz_model
from protocols.task.training import evaluate
from server.local_grid import LocalGrid

NUM_CLIENTS = 4


class TinyNet(nn.Module):
    """A user's model: not in protocols.task.models (different layer names and structure)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 24), nn.Tanh())
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def digits_flat() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A user's dataset loader: scikit-learn digits as flat 64-feature vectors, own split."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _client_data(context) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    x, y, _, _ = digits_flat()
    pid = int(context.node_config["partition-id"])
    return TinyNet(), x[pid::NUM_CLIENTS], y[pid::NUM_CLIENTS]


def test_nadp_trains_a_user_model_through_the_library_api(tmp_path):
    """NadpStrategy(**kwargs).start() in place of a ServerApp body, a user ClientApp with attach(), TinyNet."""
    from strategies import NadpStrategy

    strategy = NadpStrategy(epsilon=4.0, clip=1.0, num_clients=NUM_CLIENTS, num_rounds=8, local_epochs=1,
                            batch_size=1000, lr=2.0, seed=3, out_dir=str(tmp_path))
    assert strategy.cfg.method == "nadp" and strategy.cfg.epsilon == 4.0
    app = attach(ClientApp(), _client_data)
    grid = LocalGrid(app, NUM_CLIENTS, strategy.cfg.to_mapping())
    initial = ArrayRecord(TinyNet().state_dict())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=8)

    final = {k: v.numpy() for k, v in result.arrays.items()}
    assert set(final) == set(TinyNet().state_dict())
    assert all(np.isfinite(v).all() for v in final.values())
    model = TinyNet()
    model.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in final.items()})
    _, _, x_test, y_test = digits_flat()
    _, acc0 = evaluate(TinyNet(), x_test, y_test)
    _, acc = evaluate(model, x_test, y_test)
    assert acc > max(0.4, acc0 + 0.25), (acc0, acc)  # chance is 0.1; noise-free this reaches ~0.85
    report = strategy.privacy_report(8)
    assert 0 < report["epsilon_uplink"] <= 4.0 + 1e-9 and 0 < report["epsilon_downlink"] <= 4.0 + 1e-9


def test_strategies_take_keyword_arguments_and_validate_them():
    """Every registered strategy class builds from keywords; a bad key or value fails naming it."""
    import strategies

    for name in strategies.STRATEGY_CLASSES:
        cls = getattr(strategies, name)
        if name == "DdpsaStrategy":  # needs intermediate servers to connect to
            continue
        s = cls(epsilon=2.0, num_clients=6, num_rounds=3)
        assert s.cfg.epsilon == 2.0 and s.cfg.num_clients == 6 and strategies.build_strategy(s.cfg).cfg == s.cfg
    with pytest.raises(ConfigError, match="num-clientz"):
        strategies.FedAvgStrategy(num_clientz=3)
    with pytest.raises(ConfigError, match="epsilon"):
        strategies.LocalDPStrategy(epsilon=-1.0)
    # The noise is calibrated for num-rounds: start() refuses to run more rounds than that.
    with pytest.raises(ConfigError, match="num-rounds=2"):
        strategies.LocalDPStrategy(num_rounds=2).start(grid=None, initial_arrays=ArrayRecord(), num_rounds=3)
    # Your own ServerApp gets the start checks every engine applies, before the grid is touched.
    with pytest.raises(ConfigError, match="run-config 'clip' = 1e-200"):
        strategies.LocalDPStrategy(clip=1e-200).start(grid=None, initial_arrays=ArrayRecord())


def test_model_and_dataset_by_import_path(tmp_path):
    """run-config model/dataset = "package.module:name" build the user's model and data (and reload from npz)."""
    cfg = RunConfig.from_mapping({"model": f"{__name__}:TinyNet", "dataset": f"{__name__}:digits_flat",
                                  "device": "auto"})
    ds = load_dataset(cfg.dataset)
    assert ds.input_shape == (64,) and ds.num_classes == 10 and len(ds.y_train) == 1400
    model = build_model(cfg.model, ds.input_shape, ds.num_classes)
    assert isinstance(model, TinyNet)
    save_npz_model(tmp_path / "model.npz", {k: v.numpy() for k, v in model.state_dict().items()},
                   {"model": cfg.model, "input_shape": [64], "num_classes": 10})
    again, _ = load_npz_model(tmp_path / "model.npz")
    assert isinstance(again, TinyNet)
    assert resolve_device("auto").type in ("cpu", "cuda") and resolve_device("cpu").type == "cpu"
    for key, bad in (("model", "not a path"), ("dataset", "mod:"), ("device", "tpu")):
        with pytest.raises(ConfigError, match=key):
            RunConfig.from_mapping({key: bad})
    with pytest.raises(ValueError, match="cannot import"):
        build_model("no_such_pkg.net:Net", (64,), 10)
    assert math.isfinite(evaluate(model, ds.x_test, ds.y_test)[0])


def test_start_in_a_users_server_app_writes_the_run_folder_and_resumes(tmp_path):
    """Strategy.start() runs the app's round loop: metrics, summary, report, checkpoint; resume continues it."""
    from flwr.app import MetricRecord

    from strategies import NadpStrategy
    from strategies.run.checkpoint import load_checkpoint

    _, _, x_test, y_test = digits_flat()

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = TinyNet()
        model.load_state_dict({k: torch.as_tensor(v.numpy()) for k, v in arrays.items()})
        loss, acc = evaluate(model, x_test, y_test)
        return MetricRecord({"loss": loss, "accuracy": acc})

    opts = dict(epsilon=4.0, clip=1.0, num_clients=NUM_CLIENTS, num_rounds=3, local_epochs=1, batch_size=1000,
                lr=2.0, seed=3, out_dir=str(tmp_path / "run"))
    app = attach(ClientApp(), _client_data)
    strategy = NadpStrategy(**opts)
    grid = LocalGrid(app, NUM_CLIENTS, strategy.cfg.to_mapping())
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(TinyNet().state_dict()), num_rounds=2,
                            evaluate_fn=evaluate_fn)
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["test_accuracy"] is not None for r in rows)
    assert sorted(result.evaluate_metrics_serverapp) == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and 0 < summary["epsilon"] <= 4.0 + 1e-9
    assert summary["learning_check"] is None  # no chance level known for a user's task: no verdict invented
    assert (out / "report.md").exists() and (out / "model.npz").exists()
    assert load_checkpoint(out).round == 2

    resumed = NadpStrategy(**{**opts, "resume": True})
    grid = LocalGrid(app, NUM_CLIENTS, resumed.cfg.to_mapping())
    resumed.start(grid=grid, initial_arrays=ArrayRecord(TinyNet().state_dict()), evaluate_fn=evaluate_fn)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[2]["resumed_after_round"] == 2
    # the resumed run continues the privacy account: round 3 spends more than round 2 had
    assert rows[2]["epsilon"] > rows[1]["epsilon"]


def test_api_client_answers_the_unmasking_a_train_message_carries(tmp_path, monkeypatch):
    """unmask-next-round through attach(): rounds 1 and 2 are unmasked from the next round's train replies.

    A library client that left the carried request unanswered lost every round but the last (its epsilon spent).
    """
    from strategies import NadpStrategy
    from tests.test_pipelined_unmasking import _capture_updates

    updates = _capture_updates(monkeypatch)
    strategy = NadpStrategy(epsilon=4.0, clip=1.0, num_clients=NUM_CLIENTS, num_rounds=3, local_epochs=1,
                            batch_size=1000, lr=2.0, seed=3, out_dir=str(tmp_path), self_mask=True,
                            unmask_next_round=True)
    grid = LocalGrid(attach(ClientApp(), _client_data), NUM_CLIENTS, {})
    strategy.start(grid=grid, initial_arrays=ArrayRecord(TinyNet().state_dict()))
    carried = [u for u in updates if u is not None]
    assert len(carried) == 2, f"{len(carried)} of rounds 1-2 unmasked from the carried answers"
