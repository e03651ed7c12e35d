"""The ServerApp's federation check (server/federation.py) through the real ClientApp's ``query.federation``."""

from __future__ import annotations

import pytest

from client.app import app as client_app
from client.env import ClientEnv
from protocols.config import RunConfig
from server.federation import FederationMismatch, check_federation, fit_federation
from server.local_grid import LocalGrid


class CountingGrid(LocalGrid):
    """The in-process grid (not Flower's simulation grid: the check asks the nodes), counting messages."""

    sent = 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent += len(messages)
        return super().send_and_receive(messages, timeout=timeout)


def test_nodes_started_for_another_num_clients_stop_the_run_naming_the_fix():
    cfg = RunConfig.from_mapping({"num-clients": 10})
    grid = CountingGrid(client_app, 2, cfg.to_mapping())  # 2 nodes whose node config says num-partitions=2
    with pytest.raises(FederationMismatch) as err:
        check_federation(grid, cfg)
    assert "--federation-config 'num-supernodes=10'" in str(err.value)
    assert "--run-config 'num-clients=2'" in str(err.value)
    assert grid.sent == 2


def test_the_expected_federation_passes_without_a_message():
    cfg = RunConfig.from_mapping({"num-clients": 3})
    grid = CountingGrid(client_app, 3, cfg.to_mapping())
    assert check_federation(grid, cfg) == [] and grid.sent == 0
    # Nodes of a 3-node federation, one still registering: asked, and they agree with num-clients.
    grid.node_ids = grid.node_ids[:2]
    infos = check_federation(grid, cfg)
    assert [i.num_partitions for i in infos] == [3, 3] and grid.sent == 2


def test_num_clients_auto_takes_the_federation_size_on_server_and_clients_alike():
    raw = {"method": "nadp", "num-clients": "auto"}
    cfg = RunConfig.from_mapping(raw)
    assert cfg.num_clients == 10  # the regime's value, which a 2-node federation cannot serve
    grid = CountingGrid(client_app, 2, raw)
    fitted = fit_federation(grid, cfg, raw)
    assert fitted.num_clients == 2 and fitted.clients_per_round == 2 and grid.sent == 2
    # Each client derives the same settings from its node config's num-partitions (client.env).
    for nid in grid.node_ids:
        env = ClientEnv.from_context(grid.contexts[nid])
        assert env.cfg == fitted and env.num_partitions == 2
    # A federation of the regime's size is run as it is, without a message.
    grid = CountingGrid(client_app, 10, raw)
    assert fit_federation(grid, cfg, raw) is cfg and grid.sent == 0


def test_a_num_clients_the_user_set_is_never_replaced():
    raw = {"method": "nadp", "num-clients": 10}
    cfg = RunConfig.from_mapping(raw)
    grid = CountingGrid(client_app, 2, raw)
    with pytest.raises(FederationMismatch, match="num-supernodes=10") as err:
        fit_federation(grid, cfg, raw)
    assert "\n" not in str(err.value)  # one line: what is wrong and the two commands that fix it
    env = ClientEnv.from_context(grid.contexts[grid.node_ids[0]])
    assert env.cfg.num_clients == 10


def test_a_federation_too_small_for_the_method_names_the_fix():
    raw = {"method": "nadp"}  # needs 2 clients per round; Flower's simulation started with 1 SuperNode
    cfg = RunConfig.from_mapping(raw)
    grid = CountingGrid(client_app, 1, raw)
    with pytest.raises(FederationMismatch) as err:
        fit_federation(grid, cfg, raw)
    msg = str(err.value)
    assert "needs at least 2 clients per round" in msg and "--federation-config 'num-supernodes=10'" in msg
    assert "\n" not in msg


def test_nodes_that_disagree_on_the_federation_size_stop_an_auto_run():
    raw = {"method": "nadp"}
    cfg = RunConfig.from_mapping(raw)
    grid = CountingGrid(client_app, 3, raw)
    grid.contexts[grid.node_ids[0]].node_config["num-partitions"] = 4  # one node started for another federation
    with pytest.raises(FederationMismatch, match=r"disagree: num-partitions \[3, 4\]"):
        fit_federation(grid, cfg, raw)
