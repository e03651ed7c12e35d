"""What a failing client tells the server: a public refusal's text, else the exception's class only.

Flower sends a failing ClientApp's exception text back to the server in the error reply
(``flwr/supernode/runtime/run_clientapp.py``: ``str(type(ex)) + ":<'" + str(ex) + "'>"``; the simulation engine
the same).  An error raised after the noise is drawn whose text names a value of the upload handed that value to
the server, uncharged (the fixed-point codec named the noisy sum's first coordinate, which held only a share of the
noise).  These tests drive the real ClientApp.
"""

from __future__ import annotations

import logging

import pytest
from flwr.app import ConfigRecord

import client.methods.baselines as baselines_client
from client.app import app as client_app
from client.errors import WITHHELD, public_reason
from protocols.config import RunConfig
from protocols.floor import FloorViolation
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.common import TrainIns, ViewError
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.records import to_record
from strategies.registry import build_strategy

pytestmark = pytest.mark.usefixtures("one_thread")

RAW = {"method": "ldp", "num-clients": 2, "num-rounds": 3, "local-epochs": 1, "batch-size": 32, "hidden": "",
       "train-subset": 400, "test-subset": 100}


def _train_replies(raw: dict) -> list:
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    grid = LocalGrid(client_app, cfg.num_clients, raw)
    strategy = build_strategy(cfg)
    weights = get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed))
    msgs = list(strategy.configure_train(1, to_record(weights, strategy.wire_dtype),
                                         ConfigRecord(TrainIns(1).to_config()), grid))
    return list(grid.send_and_receive(msgs))


def test_an_error_after_the_noise_reaches_the_server_without_its_text(monkeypatch, caplog) -> None:
    """An ldp client failing after its noise is added, with an error naming its noisy upload's first coordinate.

    Measured without :func:`client.errors.sealed`: each error reply's reason carried the value (``repr`` of the
    float, 17 digits), the noisy model's coordinate the upload was about to carry.  The reply names the class
    and a fixed reason; the node's log has the text.
    """
    seen: list[float] = []

    def failing(noisy, like):  # what a range check on the noisy upload that named its value would raise
        seen.append(float(noisy[0]))
        raise ValueError(f"value {float(noisy[0])!r} at flat index 0 exceeds the range")

    monkeypatch.setattr(baselines_client, "unflatten", failing)
    with caplog.at_level(logging.ERROR):
        replies = _train_replies({**app_defaults(), **RAW})
    assert len(seen) == 2
    for r in replies:
        assert r.has_error() and f"ValueError {WITHHELD}" in r.error.reason
        assert not any(repr(v) in r.error.reason or f"{v:.6g}" in r.error.reason for v in seen)
        assert "flat index" not in r.error.reason
    assert any(repr(seen[0]) in rec.getMessage() or repr(seen[1]) in rec.getMessage() for rec in caplog.records)


def test_a_public_refusal_keeps_its_text() -> None:
    """A floor refusal or a malformed message names its key and bounds; the server sees that text as is.

    Through the real ClientApp: ``tests/test_privacy_floor.py`` and the view tests read the keys in the reasons.
    """
    floor = FloorViolation("noise-multiplier", 0.5, 1.0, "below this client's own")
    assert public_reason(floor) == str(floor) and "noise-multiplier" in public_reason(floor)
    assert public_reason(ViewError("message lacks 'round'")) == "message lacks 'round'"
    assert public_reason(ValueError("norm 3.25")) == f"ValueError {WITHHELD}"
