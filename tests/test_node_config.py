"""A misspelt node-config key is refused, driving the real ClientApp and the SuperNode launcher.

A node's protection rests on keys its operator writes in its node config; a key the node does not read is ignored.
Measured without the check: an ldp node whose operator wrote ``max-epsilon-per-rnu = 1`` (or ``max_epsilon_per_run``,
``lifetime_epsilon``, ``Max-Epsilon-Per-Run``) trained in a run asking ``epsilon = 8`` and its ledger charged
epsilon 3.90 for the first of three rounds, where ``max-epsilon-per-run = 1`` refuses the run outright; a misspelt
trust key (``ddpsa-colude-frac``) leaves the node accepting any colluding fraction the run config assumes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common.config import parse_config_args

from client.ledger import ClientLedger, ledger_dir
from protocols.methods import Guarantee, MethodSpec, register
from protocols.node_config import NodeConfigError, check_node_config, intended_key, known_keys
from protocols.options import MethodOptions, option
from protocols.wire.federation import ACTION as FEDERATION
from strategies.registry import build_strategy
from tests.test_privacy_floor import setup, train_round

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _rounds(ctx: Context) -> list[int]:
    with ClientLedger.open(ledger_dir(ctx.node_config), ctx.node_config["partition-id"], write=False) as led:
        return list(led.rounds(ctx.run_id))


def _train(node_config: dict, **run) -> tuple[list[Message], list[list[int]]]:
    """One ldp round under ``run`` on nodes holding ``node_config``: the replies and each node's recorded rounds."""
    cfg, grid = setup("ldp", node_config=node_config, **run)
    replies = train_round(build_strategy(cfg), cfg, grid)
    return replies, [_rounds(ctx) for ctx in grid.contexts.values()]


@pytest.mark.parametrize(("key", "intended"), [
    ("max-epsilon-per-rnu", "max-epsilon-per-run"),
    ("max_epsilon_per_run", "max-epsilon-per-run"),
    ("Max-Epsilon-Per-Run", "max-epsilon-per-run"),
    ("lifetime_epsilon", "lifetime-epsilon"),
    ("lifetime-epsilom", "lifetime-epsilon"),
])
def test_a_misspelt_policy_key_is_refused_before_training(key, intended) -> None:
    """Every node refuses, naming the key and the intended one; no ledger records a release."""
    replies, rounds = _train({key: 1.0}, epsilon=8.0)
    assert replies
    for r in replies:
        assert r.has_error(), "a node with a misspelt policy key trained"
        assert f"'{key}'" in r.error.reason and f"did you mean '{intended}'" in r.error.reason, r.error.reason
    assert rounds == [[]] * len(rounds)


def test_the_correct_policy_key_refuses_the_run_and_admits_one_within_it() -> None:
    replies, _ = _train({"max-epsilon-per-run": 1.0}, epsilon=8.0)
    assert all(r.has_error() and "privacy floor" in r.error.reason for r in replies)
    replies, rounds = _train({"max-epsilon-per-run": 1.0}, epsilon=1.0)
    assert replies and not any(r.has_error() for r in replies)
    assert [1] in rounds


def test_keys_of_ones_own_clientapp_are_left_alone() -> None:
    """Unknown keys that are no near miss (a user's own ClientApp may read them) pass; the node trains."""
    replies, rounds = _train({"my-app-flag": True, "data-path": "/data", "max-data": 100}, epsilon=1.0)
    assert replies and not any(r.has_error() for r in replies)
    assert [1] in rounds


@pytest.mark.parametrize(("key", "intended"), [("ddpsa-colude-frac", "ddpsa-collude-frac"), ("nadp_tau", "nadp-tau"),
                                               ("niss-roh", "niss-rho"), ("partition_id", "partition-id")])
def test_a_misspelt_builtin_key_is_refused_by_every_handler(key, intended) -> None:
    """A train message and the federation query alike are refused (whatever the run's method)."""
    replies, _ = _train({key: 0.3})
    assert replies and all(r.has_error() and f"did you mean '{intended}'" in r.error.reason for r in replies)
    cfg, grid = setup("ldp", node_config={key: 0.3})
    [reply] = grid.send_and_receive([Message(RecordDict(), grid.node_ids[0], f"query.{FEDERATION}")])
    assert reply.has_error() and f"did you mean '{intended}'" in reply.error.reason, reply


@pytest.mark.parametrize("key", ["epsilon", "ddpsa-dropout-frac", "num-rounds"])
def test_a_run_config_key_that_no_node_sets_is_refused(key) -> None:
    """``epsilon = 1`` in a node config bounds nothing: refused, naming the node's policy keys instead."""
    replies, rounds = _train({key: 1}, epsilon=8.0)
    assert replies and all(r.has_error() and "is a run-config key" in r.error.reason
                           and "max-epsilon-per-run" in r.error.reason for r in replies)
    assert not any(rounds)


@dataclass(frozen=True)
class PluggedOptions(MethodOptions):
    prefix = "plugged"
    title = "plugged"
    colluders: float = option(0.2, "colluding fraction the noise covers", low=0.0, high=1.0, trust="at-least")


def test_a_plugin_methods_trust_key_counts_once_registered() -> None:
    """A misspelt trust key of a registered plugin card is refused; unregistered, the same key is a user's own."""
    typo = {"plugged-coluders": 0.5}
    spec = MethodSpec("plugged", "strategies.baselines:LocalDPStrategy", "client.methods.baselines:train_ldp",
                      options=(PluggedOptions,), privacy=Guarantee("record", "the server", "anyone"))
    with register(spec):
        assert "plugged-colluders" in known_keys()
        replies, rounds = _train(typo, epsilon=1.0)
        assert replies and all(r.has_error() and "did you mean 'plugged-colluders'" in r.error.reason
                               for r in replies)
        assert rounds == [[]] * len(rounds)
    assert "plugged-colluders" not in known_keys()
    replies, _ = _train(typo, epsilon=1.0)
    assert replies and not any(r.has_error() for r in replies)


def test_the_library_api_refuses_a_misspelt_key() -> None:
    """:func:`client.api.client_env` (a ClientApp of your own) checks the node config too."""
    from torch import nn

    from client.api import client_env

    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2, "lifetime_epsilon": 1.0},
                  state=RecordDict(), run_config={"method": "ldp"})
    with pytest.raises(NodeConfigError, match="did you mean 'lifetime-epsilon'"):
        client_env(ctx, nn.Linear(2, 2), np.zeros((2, 2)), np.zeros(2))


def test_near_misses() -> None:
    known = known_keys()
    assert intended_key("max-epsilon-per-run", known) is None
    assert intended_key("MAX_DELTA", known) == "max-delta"
    assert intended_key("mask-corruption-rat", known) == "mask-corruption-rate"
    for own in ("my-app-flag", "data-path", "data-dir", "dataset", "batch-size", "num-workers", "seed", "max-data",
                "model-path", "cache-dir", "device", "epsilon"):
        assert intended_key(own, known) is None, own
    check_node_config({"partition-id": 0, "num-partitions": 3, "my-app-flag": True})


# ----------------------------------------------------------------------------------------- launchers
def test_cancelfl_supernode_refuses_a_misspelt_key_before_starting_anything(monkeypatch) -> None:
    import server.supernode as supernode

    def started(*_a, **_k):
        raise AssertionError("cancelfl-supernode started something")

    monkeypatch.setattr(supernode, "start_clientapps", started)
    monkeypatch.setattr(supernode, "tune_supernode", started)
    for flag in (["--node-config", "partition-id=0 num-partitions=2 max-epsilon-per-rnu=1"],
                 ["--node-config=partition-id=0 num-partitions=2 max-epsilon-per-rnu=1"]):
        with pytest.raises(SystemExit, match="'max-epsilon-per-rnu'.*did you mean 'max-epsilon-per-run'"):
            supernode.main(["--insecure", "--superlink", "127.0.0.1:1", *flag])
    supernode.check_node_config_arg(["--insecure", "--node-config", "partition-id=0 num-partitions=2 my-app-flag=1"])


def _shipped_node_configs() -> list[tuple[str, str]]:
    """(file, node config) of every ``--node-config`` the repository ships (compose files, scripts, docs)."""
    out = []
    files = [*ROOT.glob("docker/*.yml"), *ROOT.glob("docker/*.sh"), *ROOT.glob("docs/**/*.md"), ROOT / "README.md"]
    for path in files:
        for m in re.finditer(r"--node-config[= ]'?([^'\n]*)", path.read_text()):
            text = re.sub(r"\$\{[^}]*:-(\w+)\}", r"\1", m.group(1))  # compose defaults
            text = re.sub(r"\$\w+", "1", text)  # the scale script's loop variables
            if "..." not in text:  # a placeholder in prose
                out.append((str(path.relative_to(ROOT)), text))
    return out


def test_every_node_config_the_repository_ships_holds_only_keys_cancelfl_reads() -> None:
    shipped = _shipped_node_configs()
    assert any(f.startswith("docker/docker-compose") for f, _ in shipped)
    known = known_keys()
    for where, text in shipped:
        keys = set(parse_config_args([text]))
        assert keys and keys <= known, (where, keys - known)
