"""Unmasking in the next round's train messages (run-config ``unmask-next-round``; strategies/pipelined.py).

Driven through the real nadp clients (tests/test_masking.py's harness):

* a deferred round sends no ``query.recover``; its update, unmasked from the next round's train replies, is the
  survivors' exact weighted average minus the model it trained from (1e-9), and reaches the model one round later;
* a client gone in the next round is silent: its self-mask is rebuilt from its neighbours' shares;
* a round with a dropout and the last round are unmasked at once;
* the carried request obeys query.recover's rules: a server that got a neighbour's pair seed of k (telling it
  "k dropped") and then carries an "everyone received" request in a train message gets no share of k's self-mask;
* a whole in-process run sends ``query.recover`` only in its last round.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from client.env import ClientEnv
from client.methods import nadp as nadp_client
from client.recovery import RecoveryStore
from protocols.arrays import flatten
from protocols.prg import gaussian
from protocols.wire.arrays import from_record
from protocols.wire.common import UNMASK_RECORD
from protocols.wire.recovery import RecoveryReply, RecoveryRequest
from strategies import stages
from strategies.stages import close_round
from tests.consistency_setup import sign, signed
from tests.test_masking import _ask, _forwarded, _round, pinned  # noqa: F401 - pinned is a fixture


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _types(grid) -> list[str]:
    """Record the message type of everything the grid delivers."""
    seen: list[str] = []
    send = grid.send_and_receive

    def recording(messages, **kw):
        messages = list(messages)
        seen.extend(m.metadata.message_type for m in messages)
        return send(messages, **kw)

    grid.send_and_receive = recording
    return seen


def _expected_update(grid, st, msgs, seeds, model, survivors) -> np.ndarray:
    """The survivors' ``sum p_i (w_i + n_i / p_i) / sum p_i`` minus ``model``, recomputed (pinned residual seeds)."""
    acc, weight = None, 0.0
    for msg, seed in zip(msgs, seeds, strict=True):
        node = msg.metadata.dst_node_id
        if node not in survivors:
            continue
        env = ClientEnv.from_context(grid.contexts[node])
        w = flatten(nadp_client.record_level_training(msg, env)[1])
        clean = w + gaussian(seed, len(w), st.allocation.residual_std[node]) / st.weights[node]
        acc = st.weights[node] * clean if acc is None else acc + st.weights[node] * clean
        weight += st.weights[node]
    return acc / weight - flatten(from_record(model))


def _capture_updates(monkeypatch) -> list:
    """Every earlier-round update the round driver adds to a model."""
    got: list = []
    real = stages.with_update

    def spy(arrays, update):
        got.append(update)
        return real(arrays, update)

    monkeypatch.setattr(stages, "with_update", spy)
    return got


def _next_round(strategy, grid, rnd, arrays, offline=()):
    grid.offline |= set(offline)
    msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"round": rnd}), grid))
    replies = grid.send_and_receive(msgs)
    return msgs, close_round(strategy, grid, strategy._state, replies)[0]


def test_a_deferred_round_is_unmasked_exactly_from_the_next_train_replies(pinned, monkeypatch):  # noqa: F811
    n = 8
    grid, strategy, msgs, replies = _round(n, unmask_next_round=True, num_rounds=3)
    seen = _types(grid)
    updates = _capture_updates(monkeypatch)
    st1, model1 = strategy._state, strategy.round_model
    out1 = close_round(strategy, grid, st1, list(replies.values()))[0]
    assert st1.deferred and strategy.pending_unmask is not None and seen == []
    assert all(np.array_equal(a.numpy(), model1[k].numpy()) for k, a in out1.items())  # no update yet
    seeds1 = list(pinned[:n])
    msgs2, out2 = _next_round(strategy, grid, 2, out1)
    assert all(UNMASK_RECORD in m.content for m in msgs2)
    assert "query.recover" not in seen and strategy._state.deferred  # round 2 waits for round 3 in turn
    expected = _expected_update(grid, st1, msgs, seeds1, model1, set(replies))
    assert np.linalg.norm(flatten_update(updates[-1], model1) - expected) <= 1e-9 * np.linalg.norm(expected)
    got = flatten(from_record(out2)) - flatten(from_record(out1))
    assert np.linalg.norm(got - expected) <= 1e-6 * np.linalg.norm(expected)  # the wire dtype's round-off
    report = strategy.round_report()
    assert report["self_masks_removed"] == n and report["unmask_silent"] == 0
    _, _out3 = _next_round(strategy, grid, 3, out2)  # the last round: unmasked at once
    assert seen.count("query.recover") == n and strategy.pending_unmask is None


def flatten_update(update: dict, like) -> np.ndarray:
    """An update (entry name -> array) flattened in the model's entry order."""
    return np.concatenate([np.asarray(update[k], dtype=np.float64).ravel() for k in like.keys()])


def test_a_client_gone_in_the_next_round_is_unmasked_from_its_neighbours_shares(pinned, monkeypatch):  # noqa: F811
    n = 8
    grid, strategy, msgs, replies = _round(n, unmask_next_round=True, num_rounds=3)
    updates = _capture_updates(monkeypatch)
    st1, model1 = strategy._state, strategy.round_model
    out1 = close_round(strategy, grid, st1, list(replies.values()))[0]
    seeds1 = list(pinned[:n])
    gone = msgs[3].metadata.dst_node_id
    seen = _types(grid)
    _next_round(strategy, grid, 2, out1, offline=[gone])
    # round 2 has a dropout: it is unmasked at once (consistency, then query.recover), not deferred
    assert not strategy._state.deferred and "query.recover" in seen and "query.consistency" in seen
    expected = _expected_update(grid, st1, msgs, seeds1, model1, set(replies))  # gone uploaded in round 1
    assert np.linalg.norm(flatten_update(updates[-1], model1) - expected) <= 1e-9 * np.linalg.norm(expected)


def test_the_last_round_and_a_round_with_a_dropout_are_unmasked_at_once(pinned):  # noqa: F811
    grid, strategy, msgs, replies = _round(8, unmask_next_round=True, num_rounds=1)
    seen = _types(grid)
    close_round(strategy, grid, strategy._state, list(replies.values()))
    assert not strategy._state.deferred and seen.count("query.recover") == 8 and strategy.pending_unmask is None
    grid, strategy, msgs, replies = _round(8, unmask_next_round=True, num_rounds=3)
    seen = _types(grid)
    gone = msgs[0].metadata.dst_node_id
    close_round(strategy, grid, strategy._state, [r for n, r in replies.items() if n != gone])
    assert not strategy._state.deferred and "query.recover" in seen and strategy.pending_unmask is None


def test_a_carried_request_cannot_get_the_self_mask_of_a_peer_whose_pair_seed_went_out(pinned):  # noqa: F811
    """Malicious server: "k dropped" to k's neighbour j (pair seed out), then "all received" carried in a train message."""
    grid, strategy, msgs, replies = _round(8, unmask_next_round=True, num_rounds=3)
    st = strategy._state
    graph = st.keys.neighbours
    k = msgs[0].metadata.dst_node_id
    j = graph[k][0]
    others = [x for x in graph if x != k]
    sigs = signed(sign(grid, others, others, [k]))
    lie = _ask(grid, j, others, [k], _forwarded(replies, j, graph), signatures=sigs)
    assert not lie.refused and k in lie.peers  # the pair seed of (j, k) is out
    # the next round's train message for j carries the honest-looking request for round 1 with k's sealed share
    carried = RecordDict({"config": ConfigRecord(RecoveryRequest(1, tuple(sorted(graph)), (), (),
                                                                 _forwarded(replies, j, graph)).to_config())})
    train = next(m for m in strategy.configure_train(2, strategy.round_model, ConfigRecord({"round": 2}), grid)
                 if m.metadata.dst_node_id == j)
    train.content[UNMASK_RECORD] = carried["config"]
    reply = grid.send_and_receive([train])[0]
    assert not reply.has_error()
    answer = RecoveryReply.from_config(reply.content[UNMASK_RECORD])
    assert answer.refused and k not in answer.mask_peers
    store = RecoveryStore.load(ClientEnv.from_context(grid.contexts[j]))
    assert store.round == 2  # j trained round 2 after refusing: round 1's material is gone for good


def test_a_carried_request_for_a_round_the_client_did_not_upload_in_is_refused(pinned):  # noqa: F811
    grid, strategy, msgs, replies = _round(6, unmask_next_round=True, num_rounds=3)
    j = msgs[1].metadata.dst_node_id
    train = next(m for m in strategy.configure_train(2, strategy.round_model, ConfigRecord({"round": 2}), grid)
                 if m.metadata.dst_node_id == j)
    train.content[UNMASK_RECORD] = ConfigRecord(RecoveryRequest(7, tuple(sorted(replies)), (), ()).to_config())
    answer = RecoveryReply.from_config(grid.send_and_receive([train])[0].content[UNMASK_RECORD])
    assert answer.refused and "round 7" in answer.refused


def test_an_in_process_run_sends_query_recover_only_in_its_last_round(tmp_path):
    from server.launch import main

    out = tmp_path / "run"
    rc = main(["run", "--run-config", f'method="nadp" num-rounds=4 unmask-next-round=true out-dir="{out}"'])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    phases = [sorted(r["phase_time_s"]) for r in rows]
    assert ["query.recover" in p for p in phases] == [False, False, False, True]
    assert rows[0]["test_accuracy"] < 0.3  # round 1 publishes the start model: its update comes with round 2
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2  # every later round's update arrived
    assert all(r["uncancelled_noise_std"] == 0 for r in rows[1:])


def test_unmask_next_round_without_double_masking_or_with_sampling_is_refused_before_round_one():
    from protocols.config import ConfigError, RunConfig
    from server.defaults import app_defaults

    base = {**app_defaults(), "method": "nadp", "num-clients": 10, "unmask-next-round": True}
    RunConfig.from_mapping(base).validate()
    with pytest.raises(ConfigError, match="self-mask"):
        RunConfig.from_mapping({**base, "self-mask": False}).validate()
    with pytest.raises(ConfigError, match="sample-rate"):
        RunConfig.from_mapping({**base, "sample-rate": 0.5}).validate()
