"""Test helper: a NISS federation on the in-process grid (digits, 5 clients) and one train round through it."""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord

from client.app import app as client_app
from client.records import to_record
from protocols.arrays import flatten
from protocols.config import RunConfig
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.arrays import from_record
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.niss import NissStrategy

#: 5 clients on digits in niss's regime (linear model, one full-batch per-example-clipped step per round).
FAST = {"num-clients": 5, "method": "niss"}


def niss_setup(grid_cls=LocalGrid, **overrides):
    """``(cfg, grid, strategy, arrays)``: :data:`FAST` with ``overrides`` (snake_case keys), the initial model."""
    raw = {**app_defaults(), **FAST, **{k.replace("_", "-"): v for k, v in overrides.items()}}
    cfg = RunConfig.from_mapping(raw)
    grid = grid_cls(client_app, cfg.num_clients, raw)
    ds = dataset_for(cfg)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
    return cfg, grid, NissStrategy(cfg), to_record(get_weights(model), np.float64)


def niss_round(grid, strategy, rnd, arrays):
    """Round ``rnd``'s train messages (after the strategy's share phase) and the clients' replies."""
    msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"round": rnd}), grid))
    replies = list(grid.send_and_receive(msgs))
    return msgs, replies


def flat(record) -> np.ndarray:
    """An ArrayRecord as one flat float vector."""
    return flatten(from_record(record))

