"""The library client (:mod:`client.api`) against a server that changes its settings within a run.

The api client takes its settings from the strategy's messages; a run's first message pins them (in the node's
ledger, which every message sees, even two delivered together on copies of one ``Context.state``), and a
diagnostic only the client's own run config may turn on (``cancellation-check``) is refused when only the
server's settings record asks for it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from client.api import attach, pinned
from client.ledger import ClientLedger, ledger_dir
from client.records import to_record
from protocols.config import ConfigError, RunConfig
from protocols.wire.niss import Diagnostic
from protocols.wire.settings import KEY, MISMATCH, settings_config, settings_of
from server.defaults import app_defaults
from server.local_grid import LocalGrid

FEATURES, CLASSES = 8, 3


class Net(nn.Module):
    """A user's model (one linear layer on synthetic features)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _load(context: Context) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(int(context.node_config["partition-id"]))
    return Net(), rng.normal(size=(40, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, 40)


def _arrays() -> object:
    return to_record({k: v.detach().numpy() for k, v in Net().state_dict().items()}, np.float64)


def _settings(**changes: object) -> RunConfig:
    raw = {**app_defaults(), "method": "ldp", "num-clients": 2, "num-rounds": 2, "epsilon": 1.0}
    return RunConfig.from_mapping({**raw, **{k.replace("_", "-"): v for k, v in changes.items()}})


def _train(strategy: object, grid: LocalGrid, rnd: int) -> Message:
    """Round ``rnd``'s train message for the grid's first node, and its reply."""
    msgs = list(strategy.configure_train(rnd, _arrays(), ConfigRecord({"round": rnd}), grid))
    return list(grid.send_and_receive(msgs[:1]))[0]


def test_api_client_refuses_num_rounds_announced_anew_each_round():
    """A server announcing num-rounds = r in round r (epsilon 1 each time): round 2 is refused, the ledger stays <= 1."""
    from strategies.baselines import LocalDPStrategy

    grid = LocalGrid(attach(ClientApp(), _load), 2, {"method": "ldp"}, node_config={"max-epsilon-per-run": 1.0})
    first = _train(LocalDPStrategy(_settings(num_rounds=1)), grid, 1)
    assert not first.has_error(), first.error.reason if first.has_error() else ""
    reply = _train(LocalDPStrategy(_settings(num_rounds=2)), grid, 2)
    assert reply.has_error()
    assert MISMATCH in reply.error.reason and "num-rounds: 1 -> 2" in reply.error.reason
    ctx = grid.contexts[grid.node_ids[0]]
    with ClientLedger.open(ledger_dir(ctx.node_config), 0, write=False) as led:
        assert led.rounds(ctx.run_id) == [1]
        assert max(led.spent(1e-5).values()) <= 1.0


def test_api_client_keeps_acting_on_the_settings_it_pinned():
    """The same settings in every round are accepted; a later message with another epsilon is refused, named."""
    from strategies.baselines import LocalDPStrategy

    grid = LocalGrid(attach(ClientApp(), _load), 2, {"method": "ldp"})
    strategy = LocalDPStrategy(_settings())
    assert not _train(strategy, grid, 1).has_error()
    assert not _train(strategy, grid, 2).has_error()
    grid3 = LocalGrid(attach(ClientApp(), _load), 2, {"method": "ldp"})
    assert not _train(strategy, grid3, 1).has_error()
    reply = _train(LocalDPStrategy(_settings(epsilon=0.5, clip=2.0)), grid3, 2)
    assert reply.has_error() and "epsilon: 1.0 -> 0.5" in reply.error.reason and "clip: " in reply.error.reason


def test_two_tasks_of_one_node_on_copies_of_its_state_act_on_one_runs_settings():
    """Two first messages of a run delivered together, each on a copy of the node's Context: one settings per run.

    The second's settings (num-rounds 2 where the first pinned 1) are refused, as the ledger's pin says; nothing more
    is charged.
    """
    from strategies.baselines import LocalDPStrategy

    grid = LocalGrid(attach(ClientApp(), _load), 2, {"method": "ldp"})
    node = grid.node_ids[0]
    copied = copy.deepcopy(grid.contexts[node])  # task 2's copy of the state, taken before task 1 pushes back
    first = _train(LocalDPStrategy(_settings(num_rounds=1)), grid, 1)
    assert not first.has_error(), first.error.reason if first.has_error() else ""
    grid.contexts[node] = copied
    reply = _train(LocalDPStrategy(_settings(num_rounds=2)), grid, 2)
    assert reply.has_error() and MISMATCH in reply.error.reason and "another message of the run" in reply.error.reason
    with ClientLedger.open(ledger_dir(copied.node_config), 0, write=False) as led:
        assert led.rounds(copied.run_id) == [1]


def test_pinned_settings_per_run(tmp_path):
    """pinned(): the first settings of a run are kept; other ones are refused naming the keys; a new run re-pins."""
    ctx = Context(run_id=7, node_id=1, node_config={"ledger-dir": str(tmp_path)}, state=RecordDict(), run_config={})
    assert pinned(ctx, _settings()).num_rounds == 2
    assert pinned(ctx, _settings()).num_rounds == 2
    with pytest.raises(ConfigError, match=r"num-rounds: 2 -> 5"):
        pinned(ctx, _settings(num_rounds=5))
    ctx.run_id = 8
    assert pinned(ctx, _settings(num_rounds=5)).num_rounds == 5


def test_settings_of_takes_cancellation_check_only_from_the_clients_run_config():
    """A cancellation-check only the server's settings record turns on is refused; the client's own config allows it."""
    content = {KEY: settings_config(_settings(method="niss", cancellation_check=True))}
    for own in ({"method": "niss"}, {}, {"cancellation-check": False}, {"cancellation-check": "false"}):
        with pytest.raises(ConfigError, match="cancellation-check"):
            settings_of(content, own)
    for own in ({"cancellation-check": True}, {"method": "niss", "cancellation-check": "true"}):
        assert settings_of(content, own).cancellation_check
    assert not settings_of({KEY: settings_config(_settings(method="niss"))}, {"method": "niss"}).cancellation_check


def _niss_round(client_run_config: dict) -> list[Message]:
    """One niss round (server with cancellation-check) to api clients with ``client_run_config``: every reply."""
    from strategies.niss import NissStrategy

    grid = LocalGrid(attach(ClientApp(), _load), 4, client_run_config)
    seen: list[Message] = []
    deliver = grid.send_and_receive

    def recording(messages, *, timeout=None):
        replies = list(deliver(messages, timeout=timeout))
        seen.extend(replies)
        return replies

    grid.send_and_receive = recording
    strategy = NissStrategy(_settings(method="niss", num_clients=4, num_rounds=1, cancellation_check=True,
                                      mask_corruption_rate=0.0))
    try:
        grid.send_and_receive(list(strategy.configure_train(1, _arrays(), ConfigRecord({"round": 1}), grid)))
    except ConfigError as err:
        assert MISMATCH in str(err) and "cancellation-check" in str(err)
    return seen


def test_api_client_sends_no_diagnostic_a_server_alone_switches_on(niss_diagnostics):
    """A niss strategy with cancellation-check, clients without: no reply carries the noiseless update; opted in, they do.

    The nodes allow the diagnostic (CANCELFL_DIAGNOSTICS), so only the client's own run config decides here.
    """
    replies = _niss_round({"method": "niss"})
    assert replies and not any(Diagnostic.from_content(r.content) is not None for r in replies if not r.has_error())
    assert any(r.has_error() and "cancellation-check" in r.error.reason for r in replies)
    opted_in = _niss_round({"method": "niss", "cancellation-check": True})
    assert sum(Diagnostic.from_content(r.content) is not None for r in opted_in if not r.has_error()) == 4


def test_api_client_refuses_settings_that_override_its_own_run_config(tmp_path):
    """A ClientApp whose run config sets epsilon = 1: a strategy sending 50 (noise std 0.22 instead of 5.7) is refused.

    Nothing is trained or charged; the keys the client leaves out, leaves "auto" or the ServerApp resolves for
    itself (out-dir, round-timeout) stay the strategy's, and a value written as text compares as resolved.
    """
    from strategies.baselines import LocalDPStrategy

    own = {"method": "ldp", "epsilon": 1.0, "num-rounds": 2, "privacy-unit": "client"}
    grid = LocalGrid(attach(ClientApp(), _load), 2, own, node_config={"ledger-dir": str(tmp_path)})
    reply = _train(LocalDPStrategy(_settings(epsilon=50.0, privacy_unit="client")), grid, 1)
    assert reply.has_error() and MISMATCH in reply.error.reason
    assert "epsilon: strategy 50.0 -> this ClientApp 1.0" in reply.error.reason
    with ClientLedger.open(tmp_path, 0, write=False) as led:
        assert led.spent(1e-5) == {} and led.rounds(grid.contexts[grid.node_ids[0]].run_id) == []
    sent = _settings(privacy_unit="client", out_dir=str(tmp_path), round_timeout=5.0)
    content = {KEY: settings_config(sent)}
    same = {**own, "epsilon": "1.0", "out-dir": "", "round-timeout": 600.0, "graph": "auto", "device": "cpu"}
    assert settings_of(content, same) == sent
    for key, value in (("clip", 0.5), ("privacy-unit", "record"), ("num-rounds", 5), ("adjacency", "replace-one")):
        with pytest.raises(ConfigError, match=f"{MISMATCH}.*{key}: strategy"):
            settings_of(content, {**own, key: value})


def test_two_nodes_on_one_ledger_file_are_refused_before_any_release(tmp_path):
    """Two library nodes left at the default partition id under one ledger folder: the second one is refused.

    Sharing the file, they would share one privacy account, the round pins and niss's share secret.
    """
    first = Context(run_id=7, node_id=1, node_config={"ledger-dir": str(tmp_path)}, state=RecordDict(), run_config={})
    other = Context(run_id=7, node_id=2, node_config={"ledger-dir": str(tmp_path)}, state=RecordDict(), run_config={})
    assert pinned(first, _settings()).num_rounds == 2
    with pytest.raises(ConfigError, match=r"already serves node 1 in run 7.*'partition-id' or 'ledger-dir'"):
        pinned(other, _settings())
    apart = {"ledger-dir": str(tmp_path), "partition-id": 1}
    assert pinned(Context(run_id=7, node_id=2, node_config=apart, state=RecordDict(), run_config={}), _settings())
