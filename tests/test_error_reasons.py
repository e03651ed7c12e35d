"""What a failing client tells the server: a public refusal's text, else the exception's class only.

Flower sends a failing ClientApp's exception text back to the server in the error reply
(``flwr/supernode/runtime/run_clientapp.py``: ``str(type(ex)) + ":<'" + str(ex) + "'>"``; the simulation engine
the same).  An error raised after the noise is drawn whose text names a value of the upload handed that value to
the server, uncharged (the fixed-point codec named the noisy sum's first coordinate, which held only a share of the
noise).  These tests drive the real ClientApp.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

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


def _ldp_messages(grid) -> list:
    cfg = RunConfig.from_mapping({**app_defaults(), **RAW})
    strategy = build_strategy(cfg)
    weights = get_weights(build_model(cfg.model, (64,), 10, cfg.hidden_sizes, cfg.seed))
    return list(strategy.configure_train(1, to_record(weights, strategy.wire_dtype),
                                         ConfigRecord(TrainIns(1).to_config()), grid))


def test_a_library_clients_loading_errors_reach_the_server_without_their_text() -> None:
    """``attach``: the user's loader and the data checks run under the same seal as the method's handler.

    Measured without it: the reasons named the node's file path (a loader's ``FileNotFoundError``) and its
    dataset size (``client data: 400 samples and 399 labels``).
    """
    from flwr.clientapp import ClientApp

    from client.api import attach
    from tests.test_library_api import TinyNet

    def missing(context):
        raise FileNotFoundError(f"/home/alice/hospital-{context.node_config['partition-id']}/records.npz")

    def uneven(context):
        return TinyNet(), np.zeros((400, 64), np.float32), np.zeros(399, np.int64)

    for load, secret in ((missing, "/home/alice"), (uneven, "399")):
        grid = LocalGrid(attach(ClientApp(), load), 2, {})
        replies = list(grid.send_and_receive(_ldp_messages(grid)))
        assert len(replies) == 2
        for r in replies:
            assert r.has_error() and WITHHELD in r.error.reason and secret not in r.error.reason, r.error.reason


def test_the_stock_apps_node_config_errors_reach_the_server_without_local_text() -> None:
    """Node-config parsing and the pinned-app check run under the seal; a public refusal names no local path.

    Measured without it: a malformed ``partition-id`` sent its value, the pinned-app refusal the folder the app is
    installed in (``/home/<user>/...``), and the federation query its ``int()`` error.
    """
    from pathlib import Path

    import client
    from protocols.node_config import TRUSTED_FAB
    from protocols.wire.federation import ACTION

    root = str(Path(client.__file__).resolve().parent.parent)
    grid = LocalGrid(client_app, 2, {**app_defaults(), **RAW, "model": "json:loads"},
                     node_config={TRUSTED_FAB: "a" * 64})
    for r in grid.send_and_receive(_ldp_messages(grid)):
        said = r.error.reason.split("\nTraceback")[0]  # LocalGrid adds the traceback of this test's own code
        assert r.has_error() and "outside this node's pinned app" in said and root not in said, said
    grid = LocalGrid(client_app, 2, {**app_defaults(), **RAW}, node_config={"partition-id": "ward-7/alice"})
    msgs = [*_ldp_messages(grid), *(Message(RecordDict(), n, f"query.{ACTION}") for n in grid.node_ids)]
    replies = list(grid.send_and_receive(msgs))
    assert len(replies) == 4
    for r in replies:
        assert r.has_error() and f"ValueError {WITHHELD}" in r.error.reason and "alice" not in r.error.reason
