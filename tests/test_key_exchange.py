"""The shared key-exchange phase through real Flower messages (in-process grid).

A minimal pairwise-masking method is assembled from the production pieces
(the round template, `KeyPhase`, `handle_keys`, `pair_seeds`, `pairwise_noise`): every client
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
from client.records import to_record
from protocols.config import RunConfig
from protocols.pairwise import pairwise_noise
from protocols.wire.arrays import from_record
from protocols.wire.common import TrainIns, merge_configs
from protocols.wire.keys import KeyReply, KeyRequest, MaskProbe, PeerKeys, probe_metric, probe_value
from server.local_grid import LocalGrid
from strategies.base import CancelStrategy, RoundFailed
from strategies.key_phase import KeyPhase
from strategies.stages import close_round

SIZE = 10_000
BAD_KEY_NODES: set[int] = set()
KEY_CALLS: list[tuple[int, int]] = []  # (round, node) of every query.keys a client answered


def _client_app() -> ClientApp:
    app = ClientApp()

    @app.query("keys")
    def keys(msg: Message, context) -> Message:
        out = handle_keys(msg, ClientEnv.from_context(context))
        KEY_CALLS.append((KeyRequest.from_config(msg.content["config"]).round, context.node_id))
        if context.node_id in BAD_KEY_NODES:  # a broken client: truncated public key
            sent = KeyReply.from_config(out.content["config"])
            out.content["config"] = ConfigRecord(KeyReply(sent.public_key[:31], sent.num_examples).to_config())
        return out

    @app.train()
    def train(msg: Message, context) -> Message:
        env = ClientEnv.from_context(context)
        mask = pairwise_noise(env.node_id, pair_seeds(msg, env, "test-mask"), SIZE, scale=3.0)
        return reply(msg, to_record({"mask": mask}), 1)

    return app


class MaskSum(CancelStrategy):
    """Sums the uploaded masks (what a pairwise method's aggregate adds to the model)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.keys = KeyPhase(cfg)

    def exchange_keys(self, grid, st):
        self.key_round = st.keys = self.keys.run(self, grid, st.round, st.participants)
        st.participants = list(self.key_round.participants)

    def train_content(self, state, node, arrays):
        return RecordDict({"arrays": arrays, "config": ConfigRecord(merge_configs(
            TrainIns(state.round).to_config(), state.keys.peer_keys(node).to_config()))})

    def aggregate(self, state):
        by_node = state.replies
        self.failed = sorted(set(state.participants) - set(by_node))
        masks = [from_record(r.content["arrays"])["mask"] for r in by_node.values()]
        self.total = np.sum(masks, axis=0)
        self.scale = math.sqrt(sum(float(m @ m) for m in masks))
        return None


def _round(num_clients: int, *, graph: str = "complete", offline: int = 0) -> tuple[MaskSum, LocalGrid]:
    cfg = RunConfig.of(num_clients=num_clients, graph=graph, n_out=3)
    grid = LocalGrid(_client_app(), num_clients, cfg.to_mapping())
    grid.offline = set(grid.node_ids[:offline])
    strategy = MaskSum(cfg)
    msgs = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
    close_round(strategy, grid, strategy._state, grid.send_and_receive(msgs))
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


def _rounds(num_clients: int, rounds: int, *, key_rotation: int, lose_state_after: dict[int, int] | None = None):
    """Run ``rounds`` rounds on one grid; yields (strategy, grid) after each round."""
    cfg = RunConfig.of(num_clients=num_clients, key_rotation=key_rotation)
    grid = LocalGrid(_client_app(), num_clients, cfg.to_mapping())
    strategy = MaskSum(cfg)
    for rnd in range(1, rounds + 1):
        msgs = strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid)
        close_round(strategy, grid, strategy._state, grid.send_and_receive(msgs))
        yield strategy, grid
        for idx in (lose_state_after or {}).get(rnd, []):  # e.g. a SuperNode restarted and lost Context.state
            grid.contexts[grid.node_ids[idx]].state = RecordDict()


def test_session_keys_skip_the_key_phase_and_seeds_change_every_round():
    KEY_CALLS.clear()
    totals = []
    for strategy, _ in _rounds(5, 3, key_rotation=0):
        assert np.linalg.norm(strategy.total) / strategy.scale < 1e-12
        totals.append(strategy.scale)
    assert sorted({r for r, _ in KEY_CALLS}) == [1] and len(KEY_CALLS) == 5  # keys only in round 1
    assert len(set(totals)) == 3  # fresh pair seeds (different masks) every round under one key pair


def test_key_rotation_rekeys_every_epoch():
    KEY_CALLS.clear()
    for strategy, _ in _rounds(4, 5, key_rotation=2):
        assert np.linalg.norm(strategy.total) / strategy.scale < 1e-12
    assert sorted({r for r, _ in KEY_CALLS}) == [1, 3, 5] and len(KEY_CALLS) == 12
    KEY_CALLS.clear()
    list(_rounds(3, 3, key_rotation=1))
    assert sorted({r for r, _ in KEY_CALLS}) == [1, 2, 3]


def test_client_that_lost_its_keys_fails_once_then_is_rekeyed():
    KEY_CALLS.clear()
    runs = list((s.failed, s.total.copy(), s.scale) for s, _ in _rounds(4, 3, key_rotation=0,
                                                                         lose_state_after={1: [2]}))
    (f1, t1, s1), (f2, _t2, _s2), (f3, t3, s3) = runs
    assert f1 == [] and len(f2) == 1 and f3 == []  # round 2: the node without keys cannot derive seeds
    assert [r for r, _ in KEY_CALLS].count(3) == 1  # round 3: only that node runs the key phase again
    assert np.linalg.norm(t1) / s1 < 1e-12 and np.linalg.norm(t3) / s3 < 1e-12


def test_key_messages_round_trip_and_reject_malformed_fields():
    """Each key-phase message decodes what it encodes; a decoder names the key it rejects."""
    req = KeyRequest(7, 3)
    assert KeyRequest.from_config(req.to_config()) == req
    with pytest.raises(ValueError, match="key-epoch"):
        KeyRequest.from_config(TrainIns(7).to_config())
    sig = b"s" * 64
    reply_ = KeyReply(bytes(range(1, 33)), 120, "node-1", sig)
    assert KeyReply.from_config(reply_.to_config()) == reply_
    assert KeyReply.from_config(KeyReply(bytes(range(1, 33)), None, "n", sig).to_config()).num_examples is None
    for bad in (KeyReply(bytes(range(1, 32)), 5, "n", sig), KeyReply(bytes(32), 5, "n", sig)):  # short, all-zero key
        with pytest.raises(ValueError, match="public-key"):
            KeyReply.from_config(bad.to_config())
    with pytest.raises(ValueError, match="num-examples"):
        KeyReply.from_config(KeyReply(bytes(range(1, 33)), 0, "n", sig).to_config())
    with pytest.raises(ValueError, match="identity-name"):  # an unsigned key reply is malformed
        KeyReply.from_config(KeyReply(bytes(range(1, 33)), 5).to_config())
    with pytest.raises(ValueError, match="key-signature"):
        KeyReply.from_config(KeyReply(bytes(range(1, 33)), 5, "n", sig[:63]).to_config())
    big = 2**64 - 1  # node ids are unsigned 64-bit: they travel as decimal strings
    peers_ = PeerKeys((big, 5), (b"a" * 32, b"b" * 32), 2, b"g" * 32, b"p" * 32, ("x", "y"), (sig, sig), (big, 5, 9))
    rec = merge_configs(TrainIns(4).to_config(), peers_.to_config())
    assert PeerKeys.from_config(rec) == peers_ and TrainIns.from_config(rec).round == 4
    assert MaskProbe.from_config(rec).seed == b"p" * 32
    assert PeerKeys.from_config(PeerKeys((5,), (b"b" * 32,), 0).to_config()).graph_seed is None
    with pytest.raises(ValueError, match="peer-keys"):
        PeerKeys.from_config(PeerKeys((big, 5), (b"a" * 32,), 2).to_config())
    with pytest.raises(ValueError, match="disagree on 'round'"):
        merge_configs(TrainIns(4).to_config(), KeyRequest(5, 0).to_config())
    assert probe_value(reply(Message(RecordDict(), 1, "train"), ArrayRecord(), 3,
                             **probe_metric(0.25)).content["metrics"]) == 0.25
