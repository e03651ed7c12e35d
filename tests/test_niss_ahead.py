"""NISS asks for round r+1's shares with round r's train message (strategies.niss_shares).

Through the real message path (in-process LocalGrid, 5 clients): no ``query.shares`` phase while the view stays
the same, the shares relayed still cancel exactly, and every change of the view or scale asks again in a
``query.shares`` phase.
"""

from __future__ import annotations

import pytest

from client.pairwise_phase import participants_of
from protocols.wire.niss import AHEAD_RECORD
from server.local_grid import LocalGrid
from strategies.stages import run_round
from tests.niss_setup import niss_setup

#: The aggregate-noise figures these tests check come from the nodes' noiseless-update diagnostic.
pytestmark = pytest.mark.usefixtures("niss_diagnostics")


class CountingGrid(LocalGrid):
    """LocalGrid that logs (round, message type) per message; ``drop`` = (node, type) it drops once."""

    rnd: int = 0
    drop: tuple[int, str] | None = None
    strip_ahead: bool = False

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.__dict__.setdefault("log", [])
        self.log += [(self.rnd, m.metadata.message_type) for m in messages]
        if self.drop is not None:
            kept = [m for m in messages if (m.metadata.dst_node_id, m.metadata.message_type) != self.drop]
            if len(kept) < len(messages):
                self.drop = None
            messages = kept
        replies = list(super().send_and_receive(messages, timeout=timeout))
        if self.strip_ahead:  # the ahead replies are lost on the way (the clients made them all the same)
            for r in replies:
                if not r.has_error() and AHEAD_RECORD in r.content:
                    del r.content[AHEAD_RECORD]
        return replies

    def phases(self, rnd: int) -> list[str]:
        return [t for r, t in self.log if r == rnd]


def _rounds(grid, strategy, arrays, rounds, before=None):
    reports = []
    for rnd in rounds:
        grid.rnd = rnd
        if before is not None:
            before(rnd)
        arrays, _ = run_round(strategy, grid, rnd, arrays)
        reports.append(strategy.round_report())
    return reports


def test_later_rounds_need_no_share_phase_and_their_shares_cancel():
    cfg, grid, strategy, arrays = niss_setup(CountingGrid, niss_tau=0.0, cancellation_check=True, num_rounds=3)
    reps = _rounds(grid, strategy, arrays, [1, 2, 3])
    assert grid.phases(1).count("query.shares") == cfg.num_clients
    for rnd, rep in zip([2, 3], reps[1:], strict=True):
        assert "query.shares" not in grid.phases(rnd)
        assert rep["shares_ahead"] == rep["participants"] == cfg.num_clients
    assert reps[0]["shares_ahead"] == 0
    for rep in reps:  # the relayed shares cancel in the sum (tau = 0): the aggregate is the noiseless one
        assert rep["aggregate_error_rel"] <= 1e-9
    # the last round asks for nothing ahead
    assert strategy._ahead is None


def test_a_dropout_asks_every_participant_again():
    """A node that misses round 1's train message is re-keyed in round 2: another view, so a full share phase."""
    cfg, grid, strategy, arrays = niss_setup(CountingGrid, niss_tau=0.0, cancellation_check=True, num_rounds=3)
    victim = grid.node_ids[1]
    grid.drop = (victim, "train")
    reps = _rounds(grid, strategy, arrays, [1, 2])
    assert reps[0]["dropped"] == 1 and reps[0]["recovery"] == 1
    assert grid.phases(2).count("query.shares") == cfg.num_clients and reps[1]["shares_ahead"] == 0
    assert reps[1]["aggregate_error_rel"] <= 1e-9


def test_a_raised_scale_asks_again_and_a_repeated_request_gets_the_same_shares():
    cfg, grid, strategy, arrays = niss_setup(CountingGrid, niss_tau=0.0, cancellation_check=True, num_rounds=4)

    def raise_scale(rnd):
        strategy.noise_scale = 1.5 if rnd >= 3 else 1.0

    def seeds():
        return {n: [bytes(b) for b in grid.contexts[n].state["cancelfl-niss"]["out-seeds"]] for n in grid.node_ids}

    grid.strip_ahead = True  # round 2's ahead replies are lost: round 2 asks the same request again
    reps = _rounds(grid, strategy, arrays, [1], raise_scale)
    ahead = seeds()  # round 2's shares, made with round 1's upload
    grid.strip_ahead = False
    grid.__dict__["snapshot"] = None
    orig = grid.send_and_receive

    def snapshotting(messages, *, timeout=None):
        messages = list(messages)
        replies = orig(messages, timeout=timeout)
        if messages and messages[0].metadata.message_type == "query.shares":
            grid.snapshot = seeds()
        return replies

    grid.send_and_receive = snapshotting
    reps += _rounds(grid, strategy, arrays, [2], raise_scale)
    assert grid.phases(2).count("query.shares") == cfg.num_clients and reps[1]["shares_ahead"] == 0
    assert grid.snapshot == ahead  # the same request again: the same shares (whichever copy is relayed cancels)
    reps += _rounds(grid, strategy, arrays, [3], raise_scale)  # the guard raised the scale: round 3's ask is stale
    assert grid.phases(3).count("query.shares") == cfg.num_clients and reps[2]["shares_ahead"] == 0
    assert grid.snapshot != ahead
    reps += _rounds(grid, strategy, arrays, [4], raise_scale)
    assert "query.shares" not in grid.phases(4) and reps[3]["shares_ahead"] == cfg.num_clients
    assert all(rep["aggregate_error_rel"] <= 1e-9 for rep in reps)


def test_the_ahead_request_does_not_hide_the_rounds_own_view():
    """Round r's recovery still finds round r's checked view after round r+1's was checked with the upload."""
    _cfg, grid, strategy, arrays = niss_setup(CountingGrid, num_rounds=3)
    _rounds(grid, strategy, arrays, [1])
    node = grid.node_ids[0]
    parts = participants_of(_Env(grid, node), 1)
    assert parts is not None and node in parts
    assert participants_of(_Env(grid, node), 2) is not None  # round 2's view, checked with round 1's upload
    assert participants_of(_Env(grid, node), 3) is None


class _Env:
    """What participants_of reads of a ClientEnv: the node's context."""

    def __init__(self, grid, node):
        self.context = grid.contexts[node]


def test_a_stale_ahead_reply_is_never_relayed():
    """Ahead replies for another view are dropped from the train replies and never used."""
    _cfg, grid, strategy, arrays = niss_setup(CountingGrid, num_rounds=3)
    _rounds(grid, strategy, arrays, [1])
    assert strategy._ahead is not None and strategy._ahead.keys.round == 2
    assert len(strategy._ahead.shares) == len(strategy._ahead.keys.participants)
    strategy.keys.forget([grid.node_ids[0]])  # node re-keyed in round 2: its key, so the view, changes
    _rounds(grid, strategy, arrays, [2])
    assert grid.phases(2).count("query.keys") == 1
    assert strategy.round_report()["shares_ahead"] == 0 and grid.phases(2).count("query.shares") == 5


def test_a_refused_ahead_request_keeps_the_upload_and_only_that_client_is_asked_again():
    """A client refuses round 2's request (a shrunken weight) carried by round 1's train message.

    It still uploads in round 1; round 2 asks it alone in a ``query.shares`` phase (the others' ahead shares are used).
    """
    cfg, grid, strategy, arrays = niss_setup(CountingGrid, niss_tau=0.0, cancellation_check=True, num_rounds=3)
    victim = grid.node_ids[3]
    honest = strategy._share_request

    def lying(kr, node, weights, scale):
        if kr.round == 2 and node == victim:
            weights = {**weights, node: weights[node] / 2}
        return honest(kr, node, weights, scale)

    strategy._share_request = lying
    reps = _rounds(grid, strategy, arrays, [1])
    assert reps[0]["dropped"] == 0 and reps[0]["participants"] == cfg.num_clients
    assert victim not in strategy._ahead.shares and len(strategy._ahead.shares) == cfg.num_clients - 1
    strategy._share_request = honest
    reps += _rounds(grid, strategy, arrays, [2])
    asked = [m for r, m in grid.log if r == 2 and m == "query.shares"]
    assert len(asked) == 1 and reps[1]["shares_ahead"] == cfg.num_clients - 1
    assert reps[1]["participants"] == cfg.num_clients and reps[1]["aggregate_error_rel"] <= 1e-9


def test_checking_the_next_rounds_view_again_keeps_the_rounds_own_view():
    """A second share request for round r+1 (its view checked again) leaves round r's view for round r's recovery."""
    from client.pairwise_phase import _remember_view

    _cfg, grid, strategy, arrays = niss_setup(CountingGrid, num_rounds=3)
    _rounds(grid, strategy, arrays, [1])
    node = grid.node_ids[0]
    env = _Env(grid, node)
    own, ahead = participants_of(env, 1), participants_of(env, 2)
    assert own is not None and ahead is not None
    _remember_view(env, 2, list(ahead), list(ahead.values()))  # round 2's view checked once more
    assert participants_of(env, 1) == own and participants_of(env, 2) == ahead
