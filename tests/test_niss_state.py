"""niss's one-time round state when a handler which raises leaves the node's Context unsaved.

``client.methods.niss.train`` deletes the round's share state from ``Context.state`` before it trains; when the
handler then raises, Flower's simulation runtime keeps the Context as it was, state included (its deployment
runtime saves the Context the handler changed, the easier case).  The shares stay used at most once
anyway: the ledger records the round before any upload leaves and refuses it again (:func:`client.floor.release`),
and the state, its seeds and its payloads' AAD are bound to their round.
"""

from __future__ import annotations

import copy

import pytest
from flwr.app import ConfigRecord, Message

from client.methods import niss as niss_client
from server.local_grid import LocalGrid
from tests.niss_setup import niss_setup


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class FlowerGrid(LocalGrid):
    """LocalGrid with Flower's simulation semantics: a node whose handler raised keeps its Context from before the message."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        before = {m.metadata.dst_node_id: copy.deepcopy(self.contexts[m.metadata.dst_node_id].state) for m in messages}
        replies = list(super().send_and_receive(messages, timeout=timeout))
        for r in replies:
            if r.has_error():
                self.contexts[r.metadata.src_node_id].state = before[r.metadata.src_node_id]
        return replies


def _again(msg: Message, **config) -> Message:
    content = copy.deepcopy(msg.content)
    for key, value in config.items():
        content["config"][key] = value
    return Message(content, msg.metadata.dst_node_id, "train")


def _fail(*_args, **_kwargs) -> None:
    raise TypeError("after the release")


def _uploads(replies) -> int:
    return sum(1 for r in replies if not r.has_error() and r.has_content() and "arrays" in r.content)


def test_a_train_that_raised_leaves_its_state_but_the_shares_are_released_once(monkeypatch):
    _, grid, strategy, arrays = niss_setup(FlowerGrid)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
    msg, other = msgs[0], msgs[1]
    k = msg.metadata.dst_node_id
    # raises after the deletion (weight changed between phases): the state stays, nothing was released
    [r] = grid.send_and_receive([_again(msg, **{"niss-weight": float(msg.content["config"]["niss-weight"]) / 2})])
    assert r.has_error() and niss_client.STATE_KEY in grid.contexts[k].state
    # the round's genuine message: one upload; the same again, or its inbox as the next round's: none
    assert _uploads(grid.send_and_receive([_again(msg)])) == 1
    [r] = grid.send_and_receive([_again(msg)])
    assert r.has_error() and "a round not trained before" in r.error.reason
    [r] = grid.send_and_receive([_again(msg, round=2)])
    assert _uploads([r]) == 0 and "niss-auth-failed" in r.content["config"]  # round-1 payloads do not open in round 2
    # raises after the ledger recorded the round: the state stays, the upload never left, and the round is not redone
    with monkeypatch.context() as m:
        m.setattr(niss_client, "remember", _fail)
        [r] = grid.send_and_receive([_again(other)])
    assert r.has_error() and niss_client.STATE_KEY in grid.contexts[other.metadata.dst_node_id].state
    [r] = grid.send_and_receive([_again(other)])
    assert r.has_error() and "a round not trained before" in r.error.reason
