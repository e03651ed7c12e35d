"""The shared key-exchange phase through real Flower messages (in-process grid).

A minimal pairwise-masking method is assembled from the production pieces
(`run_key_phase`, `handle_keys`, `pair_seeds`, `pairwise_noise`): every client
uploads only its pairwise mask, so the server's sum must cancel exactly.
Bad input (malformed key, silent node) must leave that client out of the
round, never corrupt the sum.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

from client.env import ClientEnv, reply
from client.pairwise_phase import handle_keys, pair_seeds
from protocols.pairwise import pairwise_noise
from server.config import RunConfig
from server.local_grid import LocalGrid
from strategies.base import CancelStrategy, RoundFailed, from_record, split_replies, to_record
from strategies.pairwise_phase import run_key_phase

SIZE = 10_000
BAD_KEY_NODES: set[int] = set()


def _client_app() -> ClientApp:
    app = ClientApp()

    @app.query("keys")
    def keys(msg: Message, context) -> Message:
        out = handle_keys(msg, ClientEnv.from_context(context))
        if context.node_id in BAD_KEY_NODES:  # a broken client: truncated public key
            out.content["config"]["public-key"] = out.content["config"]["public-key"][:31]
        return out

    @app.train()
    def train(msg: Message, context) -> Message:
        env = ClientEnv.from_context(context)
        mask = pairwise_noise(env.node_id, pair_seeds(msg, env, "test-mask"), SIZE, scale=3.0)
        return reply(msg, to_record({"mask": mask}), 1)

    return app


class MaskSum(CancelStrategy):
    """Sums the uploaded masks (what a pairwise method's aggregate adds to the model)."""

    def configure_train(self, server_round, arrays, config, grid):
        nodes = self.sample_nodes(grid, server_round)
        self.key_round = run_key_phase(self, grid, server_round, nodes)
        return self.make_messages(self.key_round.participants, lambda n: RecordDict(
            {"arrays": arrays, "config": ConfigRecord({"round": server_round, **self.key_round.peer_config(n)})}))

    def aggregate_train(self, server_round, replies):
        good, _ = split_replies(replies)
        masks = [from_record(r.content["arrays"])["mask"] for r in good]
        self.total = np.sum(masks, axis=0)
        self.scale = math.sqrt(sum(float(m @ m) for m in masks))
        return None, None


def _round(num_clients: int, *, graph: str = "complete", offline: int = 0) -> tuple[MaskSum, LocalGrid]:
    cfg = RunConfig(num_clients=num_clients, graph=graph, n_out=3)
    grid = LocalGrid(_client_app(), num_clients, cfg.to_mapping())
    grid.offline = set(grid.node_ids[:offline])
    strategy = MaskSum(cfg)
    msgs = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
    strategy.aggregate_train(1, grid.send_and_receive(msgs))
    return strategy, grid


@pytest.mark.parametrize("graph", ["complete", "n-out"])
def test_masks_cancel_through_messages(graph):
    strategy, _ = _round(12, graph=graph)
    assert strategy.scale > 0
    assert np.linalg.norm(strategy.total) / strategy.scale < 1e-12


def test_malformed_key_client_is_left_out():
    BAD_KEY_NODES.clear()
    cfg_nodes = LocalGrid(_client_app(), 6, RunConfig(num_clients=6).to_mapping()).node_ids
    BAD_KEY_NODES.add(cfg_nodes[2])
    try:
        strategy, _ = _round(6)
    finally:
        BAD_KEY_NODES.clear()
    assert cfg_nodes[2] in strategy.key_round.dropped and len(strategy.key_round.participants) == 5
    assert np.linalg.norm(strategy.total) / strategy.scale < 1e-12


def test_silent_client_is_left_out():
    strategy, grid = _round(6, offline=2)
    assert set(strategy.key_round.dropped) == set(grid.node_ids[:2])
    assert np.linalg.norm(strategy.total) / strategy.scale < 1e-12


def test_too_few_keys_fails_clearly():
    with pytest.raises(RoundFailed, match="at least 2 clients"):
        _round(3, offline=2)
