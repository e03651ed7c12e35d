"""The ServerApp's federation check (server/federation.py) through the real ClientApp's ``query.federation``."""

from __future__ import annotations

import pytest

from client.app import app as client_app
from protocols.config import RunConfig
from server.federation import FederationMismatch, check_federation
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
