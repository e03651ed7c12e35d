"""A malicious server's recovery requests, driven through the real client handlers (in-process grid).

* Flower 1.42's SuperNode runs each message's ClientApp as its own task, on a copy of the node's ``Context.state``
  taken when the task starts, and keeps the copy the last task pushes back: two messages delivered together are
  answered on the same state.  A node asked to answer "k received" in one and to sign and answer "k dropped" in the
  other reveals its share of k's self-mask in one reply and its pair seed with k in the other, unless the round's
  outcome is pinned where every task sees it (the node's ledger).
* Two tasks answering the same outcome on copies of one state both see it unanswered: each charged the recovery's
  top-up, an over-count of the node's epsilon, unless the charge is recorded per round and outcome in the ledger.
"""

from __future__ import annotations

import copy

import pytest

from tests.consistency_setup import recover, sign, signed
from tests.test_masking import _forwarded, _round
from tests.test_recovery_ledger import DELTA, _ledger, _lie


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_two_tasks_of_one_node_on_copies_of_its_state_answer_one_outcome_of_a_round():
    grid, strategy, _msgs, replies = _round(8)
    graph = strategy._state.keys.neighbours
    k = sorted(graph)[0]
    j = graph[k][0]
    everyone, others = sorted(graph), [x for x in graph if x != k]
    copied = copy.deepcopy(grid.contexts[j])  # task 2's copy of j's state, taken before task 1 pushes back
    first = recover(grid, j, everyone, [], forwarded=_forwarded(replies, j, graph))
    assert not first.refused and k in first.mask_peers  # task 1: j's share of k's self-mask is out
    grid.contexts[j] = copied
    signatures = sign(grid, others, others, [k])  # task 2 (j's copy): "k dropped", signed by all of k's other neighbours
    second = recover(grid, j, others, [k], forwarded=_forwarded(replies, j, graph), signatures=signed(signatures))
    assert second.refused and not second.by_peer().get(k)  # not also the pair seed of (j, k)
    assert "another outcome of round 1" in signatures[j].refused


def test_two_tasks_of_one_node_on_copies_of_its_state_charge_a_recovery_once():
    """A signed false-dropout outcome answered by two tasks on copies of k's state: both answer, k's ledger is charged once."""
    grid, _st, replies, graph, k, received, dropped = _lie()
    before = _ledger(grid, k).spent(DELTA)["uplink/record"]
    signatures = signed(sign(grid, received, received, dropped))
    copied = copy.deepcopy(grid.contexts[k])  # task 2's copy of k's state, taken before task 1 pushes back
    first = recover(grid, k, received, dropped, forwarded=_forwarded(replies, k, graph), signatures=signatures)
    assert not first.refused and sorted(first.peers) == dropped
    once = _ledger(grid, k).spent(DELTA)
    assert once["uplink/record"] > before  # the lie strips noise: the answer tops the ledger up
    grid.contexts[k] = copied
    second = recover(grid, k, received, dropped, forwarded=_forwarded(replies, k, graph), signatures=signatures)
    assert not second.refused and sorted(second.peers) == dropped
    assert _ledger(grid, k).spent(DELTA) == once
