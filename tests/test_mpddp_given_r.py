"""The MP family's model claim given R, through the real clients (in-process LocalGrid).

* The Gaussian the server adds given R is sized for the noise scale the round was planned and charged with, not
  for the scale the budget guard decides for a later round before this one aggregates (``unmask-next-round``
  aggregates a round during the next one).
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from client.app import app as client_app
from protocols.config import RunConfig
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.mpddp import DdpNoise
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.mp_server import MpRound
from strategies.mpddp import MpddpStrategy
from strategies.records import to_record


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _initial(cfg: RunConfig):
    ds = dataset_for(cfg)
    return to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)),
                     np.float64)


class _WideSecret(MpddpStrategy):
    """The production strategy with a secret whose ``||r||`` is ten times its estimate (kappa = 100)."""

    def plan(self, grid, st) -> MpRound:
        state = super().plan(grid, st)
        state.kappa = 100.0
        return state


def test_the_given_r_gaussian_is_for_the_scale_the_round_was_charged_with():
    """Round 1 planned and charged at noise scale 2; the guard then decides scale 1 for round 2 before round 1 aggregates.

    Given R the mean must carry ``2 z kappa S / K`` (the clients charged ``2 z``): the server's Gaussian plus the
    clients' eta reach it.
    """
    k = 3
    raw = {**app_defaults(), "method": "mpddp", "num-clients": k, "num-rounds": 2, "hidden": "8",
           "dataset": "digits", "self-mask": False}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, k, raw), _WideSecret(cfg)
    strategy.noise_scale = 2.0
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    replies = list(grid.send_and_receive(msgs))
    assert not any(r.has_error() for r in replies), [r.error.reason[:200] for r in replies if r.has_error()]
    strategy.noise_scale = 1.0  # the next round's decision, made before this round's deferred aggregate
    strategy.aggregate_train(1, replies)
    noise = DdpNoise.from_config(msgs[0].content["config"])
    z = strategy.planned_release(1).noise_multiplier
    target = 2.0 * z * 100.0 * strategy.record_sensitivity(min(noise.sizes)) / k
    report = strategy.round_report()
    assert report["given_r_noise_std"] ** 2 + noise.sigma_eta**2 / k >= target**2 * (1 - 1e-9)
