"""A node's trust assumptions against a run config that assumes less, driving the real client code.

The colluding fractions and thresholds a client's noise is sized for come from the run config, the server's choice.
A node pins the ones it requires in its node config (a node whose policy asks for a guarantee gets the documented
defaults), and refuses a round, a key, share or recovery query alike, whose run config assumes a weaker adversary:
before any charge and before any material leaves (:func:`client.floor.check_trust`).

Measured without the check:

* ddpsa: ``ddpsa-collude-frac = 0`` while one of 10 participants colludes: each share is ``1/10`` of the round's
  Laplace, the sum the colluder subtracts its own from holds a ``Gamma(0.9, b)`` difference: epsilon 3.53 where
  every ledger charges 1 (650 coordinates).
* ddpsa: ``ddpsa-threshold = 2`` with 5 servers: any 2 colluding intermediate servers rebuild a client's own noisy
  sum (its ``1/n'`` share of the noise), where the default needs 4.
* niss: ``niss-rho = 0``: the joint-view floor covers no colluding neighbour: scale 1.14 instead of 1.44 at
  rho = 1/2 (5 clients, complete graph, tau 0.447), every sigma_k 0.79 of what 2 colluding neighbours need.
* nadp: ``nadp-tau = 0`` or an explicit ``nadp-lambda = 1``: lambda 1, no upload keeps sigma_up against a colluder.
* pairwise: ``mask-corruption-rate = 0``: the self-mask threshold and the present floor assume no colluding
  neighbour.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message

from client.app import app as client_app
from client.ledger import ClientLedger, ledger_dir
from client.records import to_record
from protocols.config import RunConfig
from protocols.ddpsa import gamma_difference_epsilon, honest_participants
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from server.defaults import app_defaults
from strategies.ddpsa import DdpsaStrategy
from strategies.nadp import NadpStrategy
from strategies.niss import NissStrategy
from tests.test_ddpsa_method import LINEAR, _initial, _served, credentials  # noqa: F401 (fixture)
from tests.test_ddpsa_noise import noise_seen  # noqa: F401 (fixture)
from tests.test_malicious_views import _Recording

STRATEGIES = {"nadp": NadpStrategy, "niss": NissStrategy}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _spent(ctx) -> list[int]:
    with ClientLedger.open(ledger_dir(ctx.node_config), ctx.node_config["partition-id"], write=False) as led:
        return list(led.rounds(ctx.run_id))


def _grid(method: str, n: int, run: dict):
    raw = {**app_defaults(), "method": method, "num-clients": n, "num-rounds": 2, "hidden": "", "local-epochs": 1,
           "batch-size": 1000, **run}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    model = to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)),
                      np.float64)
    return _Recording(client_app, n, raw), STRATEGIES[method](cfg), model


def _pairwise_round(method: str, n: int, run: dict, pin: dict, tmp_path) -> tuple[list, list]:
    """Node k's key, share and train messages of a round under the run config ``run``, sent again with ``pin``.

    ``pin`` is added to k's node config first.  Returns k's replies to them and the rounds its ledger records.
    """
    grid, strategy, model = _grid(method, n, run)
    train = list(strategy.configure_train(1, model, ConfigRecord({"round": 1}), grid))
    k = train[0].metadata.dst_node_id
    ctx = grid.contexts[k]
    ctx.node_config.update({"ledger-dir": str(tmp_path), **pin})
    mine = [m for m in [*grid.sent, train[0]] if m.metadata.dst_node_id == k]
    assert {m.metadata.message_type for m in mine} >= {"query.keys", "train"}
    replies = list(grid.send_and_receive([Message(copy.deepcopy(m.content), k, m.metadata.message_type)
                                          for m in mine]))
    return replies, _spent(ctx)


@pytest.mark.parametrize(("method", "run", "pin", "key"), [
    ("niss", {"niss-rho": 0.0}, {"niss-rho": 0.5}, "niss-rho"),
    ("niss", {"niss-rho": 0.25}, {"max-epsilon-per-run": 10.0}, "niss-rho"),  # a policy: the default 1/2
    ("nadp", {"nadp-tau": 0.1}, {"nadp-tau": 0.5}, "nadp-tau"),
    ("nadp", {"mask-corruption-rate": 0.0}, {"mask-corruption-rate": 0.1}, "mask-corruption-rate"),
    ("niss", {"mask-corruption-rate": 0.0}, {"lifetime-epsilon": 50.0}, "mask-corruption-rate"),
])
def test_a_run_config_assuming_fewer_colluders_than_the_node_is_refused_before_anything_leaves(
        method, run, pin, key, tmp_path) -> None:
    """Every key, share and train message of the node is refused, naming the key; its ledger records nothing."""
    replies, spent = _pairwise_round(method, 5, run, pin, tmp_path)
    for r in replies:
        assert r.has_error(), "a run config assuming fewer colluders than the node's was answered"
        assert "privacy floor" in r.error.reason and key in r.error.reason, r.error.reason
    assert spent == []


@pytest.mark.parametrize(("method", "run", "pin"), [
    ("niss", {"niss-rho": 0.75}, {"niss-rho": 0.5, "max-epsilon-per-run": 10.0}),  # stronger than the node's
    ("nadp", {"mask-corruption-rate": 0.0}, {"mask-corruption-rate": 0.0, "max-epsilon-per-run": 10.0}),
])
def test_a_run_config_assuming_at_least_the_nodes_colluders_is_answered(method, run, pin, tmp_path) -> None:
    """A stronger run config, or nodes that pin a weaker value than the default: every node trains and pairs."""
    grid, strategy, model = _grid(method, 5, run)
    for ctx in grid.contexts.values():
        ctx.node_config.update({"ledger-dir": str(tmp_path), **pin})
    replies = list(grid.send_and_receive(strategy.configure_train(1, model, ConfigRecord({"round": 1}), grid)))
    assert len(replies) == 5 and not any(r.has_error() for r in replies)
    assert all(_spent(ctx) == [1] for ctx in grid.contexts.values())


def test_an_explicit_nadp_lambda_below_eq8_for_the_nodes_tau_is_refused(tmp_path) -> None:
    """``nadp-lambda = 1`` (no compensation) bypasses ``nadp-tau``: refused against Eq. 8 for the node's tau."""
    replies, spent = _pairwise_round("nadp", 6, {"nadp-lambda": 1.0}, {"nadp-tau": 0.3}, tmp_path)
    assert not replies[0].has_error()  # the key phase: lambda is a round's, checked with the round's sizes
    assert replies[-1].has_error() and "nadp-lambda" in replies[-1].error.reason, replies[-1].error.reason
    assert "nadp-tau = 0.3" in replies[-1].error.reason
    assert spent == []


# ------------------------------------------------------------------------------------------------- ddpsa
def _pushed_nothing(cluster, strategy) -> bool:
    from protocols.wire.intermediate import IntermediateServerClient

    for a in cluster.addresses:
        with IntermediateServerClient(a, cluster.servers.ca) as c:
            if c.status(strategy.signer).stored_bytes:
                return False
    return True


def _ddpsa_train(cfg, grid, cluster, pin: dict, tmp_path) -> tuple[list, DdpsaStrategy]:
    """Round 1's train messages (the strategy's identity phase on unpinned nodes), answered with ``pin``.

    Every node's node config then holds a policy, the cluster's servers and ``pin``.
    """
    strategy = DdpsaStrategy(cfg)
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    for ctx in grid.contexts.values():
        ctx.node_config.update({"ledger-dir": str(tmp_path), "max-epsilon-per-run": cfg.epsilon,
                                "ddpsa-servers": cfg.ddpsa_servers, "ddpsa-ca": cfg.ddpsa_ca, **pin})
    return list(grid.send_and_receive(msgs)), strategy


@pytest.mark.parametrize("pin", [{"ddpsa-collude-frac": 0.25}, {}])
def test_ddpsa_a_run_config_assuming_no_colluder_is_refused_before_any_push(
        noise_seen, tmp_path, pin) -> None:  # noqa: F811 (fixture)
    """The node's colluding fraction (pinned, or the default 0.1 under its policy) against ``ddpsa-collude-frac = 0``.

    Measured: with 20 participants and two colluders, the share sizing of ``collude-frac = 0`` (which leaves out
    one share, a receiving participant's own) leaves the sum the colluders subtract their own shares from a
    ``Gamma(18/19, b)`` difference, epsilon 1.93 where the ledger charged 1.
    """
    assert honest_participants(20, 0.0) == 19 and honest_participants(20, 0.1) == 18
    assert gamma_difference_epsilon(18 / 19, 1.0, 650) > 1.9
    with _served(num_clients=4, num_rounds=2, ddpsa_collude_frac=0.0, **LINEAR) as (cfg, grid, cluster):
        replies, strategy = _ddpsa_train(cfg, grid, cluster, pin, tmp_path)
        try:
            assert len(replies) == 4
            _refused_before_any_push(replies, "ddpsa-collude-frac", noise_seen, cluster, strategy, grid)
        finally:
            strategy.close()


def _refused_before_any_push(replies, key: str, drawn, cluster, strategy, grid) -> None:
    """Every client refused on its privacy floor naming ``key``: no noise drawn, no share pushed, nothing charged."""
    for r in replies:
        assert r.has_error() and "privacy floor" in r.error.reason, f"a weaker {key} was taken"
        assert key in r.error.reason, r.error.reason
    assert drawn == [] and _pushed_nothing(cluster, strategy)
    assert all(_spent(ctx) == [] for ctx in grid.contexts.values())


@pytest.mark.parametrize(("run", "pin", "refused"), [
    ({"ddpsa_threshold": 2, "ddpsa_num_servers": 5}, {}, True),  # the default: auto, 4 of 5
    ({"ddpsa_threshold": 2, "ddpsa_num_servers": 5}, {"ddpsa-threshold": 3}, True),
    ({"ddpsa_threshold": 2, "ddpsa_num_servers": 5}, {"ddpsa-threshold": 2}, False),
])
def test_ddpsa_a_sharing_threshold_below_the_nodes_is_refused(
        noise_seen, tmp_path, run, pin, refused) -> None:  # noqa: F811 (fixture)
    """5 servers pinned in the node config; a run config lowering the threshold to 2.

    Any 2 of the servers would rebuild a client's own noisy sum.  Refused against the node's threshold (default:
    auto, resolved for its own servers); a node that pins 2 takes it.
    """
    with _served(servers=5, num_clients=4, num_rounds=2, **run, **LINEAR) as (cfg, grid, cluster):
        replies, strategy = _ddpsa_train(cfg, grid, cluster, pin, tmp_path)
        try:
            if not refused:
                assert not any(r.has_error() for r in replies) and len(noise_seen) == 4
                return
            _refused_before_any_push(replies, "ddpsa-threshold", noise_seen, cluster, strategy, grid)
        finally:
            strategy.close()


@pytest.mark.parametrize("raw", ["2.9", "-1", "x"])
def test_a_pinned_integer_trust_value_must_be_a_non_negative_integer(raw):
    """``ddpsa-threshold = 2.9`` pinned is not read as 2 (weaker than written), -1 does not turn the pin off."""
    from client.floor import _pinned

    with pytest.raises(ValueError):
        _pinned(0, raw)
    assert _pinned(0, "3") == 3 and _pinned(0.1, "0.25") == 0.25
