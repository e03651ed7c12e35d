"""The round as explicit stages (strategies.stages), driven on the real client code through LocalGrid.

Properties: the driver calls keys -> plan -> train -> recover -> aggregate -> account in order and hands each
stage that talks to clients the grid it was given (recovery included: no strategy keeps the grid); the release
is charged before the train messages leave; the account stage runs when aggregation fails; Flower's
``aggregate_train`` (which gets no grid) refuses a round that needs a recovery phase instead of skipping it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.app import app as client_app
from client.records import to_record
from protocols.config import RunConfig
from protocols.task.models import build_model, get_weights
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.base import RoundFailed
from strategies.mpddp import MpdpNaiveStrategy
from strategies.nadp import NadpStrategy
from strategies.niss import NissStrategy
from strategies.stages import run_round

FAST = {"local-epochs": 1, "batch-size": 1000, "lr": 4.0, "clip": 1.0, "hidden": ""}
GRID_STAGES = {"exchange_keys", "plan", "recover"}


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class PhaseGrid(LocalGrid):
    """LocalGrid that records the message type of every phase and can drop one node's train reply."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.phases: list[str] = []
        self.drop_train: int | None = None

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages:
            self.phases.append(messages[0].metadata.message_type)
        if messages and messages[0].metadata.message_type == "train" and self.drop_train is not None:
            messages = [m for m in messages if m.metadata.dst_node_id != self.drop_train]
        return super().send_and_receive(messages, timeout=timeout)


def recording(cls):
    """``cls`` with every stage call recorded as (stage, grid it got or None)."""

    class Recording(cls):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.calls: list[tuple[str, object]] = []

        def exchange_keys(self, grid, st):
            self.calls.append(("exchange_keys", grid))
            return super().exchange_keys(grid, st)

        def plan(self, grid, st):
            self.calls.append(("plan", grid))
            return super().plan(grid, st)

        def charge_release(self, st):
            self.calls.append(("charge_release", None))
            return super().charge_release(st)

        def recover(self, grid, st):
            self.calls.append(("recover", grid))
            return super().recover(grid, st)

        def aggregate(self, st):
            self.calls.append(("aggregate", None))
            return super().aggregate(st)

        def account(self, st):
            self.calls.append(("account", None))
            return super().account(st)

    return Recording


def _setup(cls, method: str, n: int = 5, grid_cls=PhaseGrid, **overrides):
    raw = {**app_defaults(), "method": method, "num-clients": n, **FAST,
           **{k.replace("_", "-"): v for k, v in overrides.items()}}
    cfg = RunConfig.from_mapping(raw)
    grid = grid_cls(client_app, n, raw)
    model = build_model(cfg.model, (1, 8, 8), 10, cfg.hidden_sizes, cfg.seed)
    return cfg, grid, recording(cls)(cfg), to_record(get_weights(model), np.float64)


@pytest.mark.parametrize("cls", [NadpStrategy, NissStrategy])
def test_stages_run_in_order_and_the_recover_stage_gets_the_grid(cls, request):
    """A dropout after the plan: keys, plan (niss: shares), train, recovery through the grid the driver was given."""
    method = "nadp" if cls is NadpStrategy else "niss"
    if method == "niss":
        request.getfixturevalue("niss_diagnostics")  # the niss residual is measured from its clients' diagnostic probes
    cfg, grid, strategy, arrays = _setup(cls, method, self_mask=False, cancellation_check=True, niss_tau=0.0)
    grid.drop_train = grid.node_ids[1]
    new, _ = run_round(strategy, grid, 1, arrays)
    assert new is not None
    assert [name for name, _ in strategy.calls] == ["exchange_keys", "plan", "charge_release", "recover",
                                                     "aggregate", "account"]
    assert all(g is grid for name, g in strategy.calls if name in GRID_STAGES)
    expected = ["query.keys", *(["query.shares"] if method == "niss" else []), "train", "query.recover"]
    assert grid.phases == expected
    rep = strategy.round_report()
    assert rep["dropped"] == 1 and rep["recovery"] == 1 and rep["cancellation_residual"] <= 1e-9
    assert not any(hasattr(strategy, name) for name in ("grid", "_grid"))


def test_release_is_charged_before_the_train_messages_leave():
    """The niss strategy composes its planned release in the train stage: the ledger holds it when ``before_send`` runs."""
    _, grid, strategy, arrays = _setup(NissStrategy, "niss")
    seen = []
    run_round(strategy, grid, 1, arrays, before_send=lambda: seen.append((strategy.privacy.report()["epsilon"],
                                                                           list(grid.phases))))
    (eps, phases), = seen
    assert eps > 0 and np.isfinite(eps) and "train" not in phases
    assert strategy.privacy.report()["epsilon"] == pytest.approx(eps)  # no dropout: nothing more charged


def test_the_account_stage_runs_when_aggregation_fails(monkeypatch):
    """mpdp-naive's given-R account composes the round whose aggregate raised (its uploads reached the server)."""
    _, grid, strategy, arrays = _setup(MpdpNaiveStrategy, "mpdp-naive", hidden="8", model="mlp")

    def broken(self, state, records):
        raise ValueError("injected")

    monkeypatch.setattr(MpdpNaiveStrategy, "update", broken)
    before = strategy._given_r_epsilon()
    with pytest.raises(RoundFailed, match="injected"):
        run_round(strategy, grid, 1, arrays)
    assert [name for name, _ in strategy.calls][-2:] == ["aggregate", "account"]
    assert strategy._given_r_epsilon() > before


def test_flower_aggregate_train_refuses_a_round_that_needs_recovery():
    """Flower's two-call API gets no grid for the recover stage: a double-masked round fails, naming why."""
    _, grid, strategy, arrays = _setup(NadpStrategy, "nadp", self_mask=True)
    msgs = list(strategy.configure_train(1, arrays, None, grid))
    replies = list(grid.send_and_receive(msgs))
    with pytest.raises(RoundFailed, match="needs the grid"):
        strategy.aggregate_train(1, replies)
    assert "query.recover" not in grid.phases
