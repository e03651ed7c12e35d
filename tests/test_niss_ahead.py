"""NISS asks for round r+1's shares with round r's train message (strategies.niss_shares).

Through the real message path (in-process LocalGrid, 5 clients): no ``query.shares`` phase while the view stays
the same, the shares relayed still cancel exactly, and every change of the view or scale asks again in a
``query.shares`` phase.  Against a lying server: a refused share request keeps the round's view for its recovery,
and an ahead answer that fails leaves the round uncharged.
"""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from client.ledger import ClientLedger, ledger_dir
from client.pairwise_phase import participants_of
from client.recovery import RecoveryStore
from protocols.masking import open_share, rebuild_seed
from protocols.niss import aggregation_weights
from protocols.wire.common import read_node_ids
from protocols.wire.niss import AHEAD_RECORD
from protocols.wire.recovery import SELF_MASK_RECORD, SelfMaskShares
from server.local_grid import LocalGrid
from strategies.stages import open_round, run_round, train_messages
from tests.consistency_setup import recover, sign, signed
from tests.niss_setup import niss_round, niss_setup

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


class _CapturingGrid(CountingGrid):
    """CountingGrid that keeps the last ahead record each node's train message carried."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train" and AHEAD_RECORD in m.content:
                self.__dict__.setdefault("ahead", {})[m.metadata.dst_node_id] = ConfigRecord(
                    dict(m.content[AHEAD_RECORD].items()))
        return super().send_and_receive(messages, timeout=timeout)


def _narrowed(cfg, request: ConfigRecord, me: int, keep: list[int]) -> ConfigRecord:
    """``request`` (``me``'s) over the participants ``keep`` only, its weight recomputed, at a scale below any floor."""
    rec = ConfigRecord(dict(request.items()))
    parts, peers = read_node_ids(request, "participants"), read_node_ids(request, "peer-ids")
    rec["participants"] = [str(n) for n in keep]
    rec["participant-names"] = [request["participant-names"][parts.index(n)] for n in keep]
    kept_peers = [peers.index(n) for n in keep if n in peers]
    for key in ("peer-ids", "peer-keys", "peer-names", "peer-signatures"):
        rec[key] = [request[key][i] for i in kept_peers]
    ids = read_node_ids(request, "niss-size-ids")
    sizes = {n: request["niss-sizes"][ids.index(n)] for n in keep}
    rec["niss-size-ids"], rec["niss-sizes"] = [str(n) for n in keep], [sizes[n] for n in keep]
    rec["niss-weight"] = aggregation_weights(cfg, keep, sizes)[me]
    rec["niss-noise-scale"] = 1e-6
    return rec


def test_a_refused_share_request_leaves_the_view_the_rounds_secrets_were_made_for():
    """A lying server re-asks round 2 with a view that hides two of k's neighbours, refused at its scale.

    Round 2's upload is made with the secrets of the request answered ahead (5 participants), so its recovery
    counts k's neighbours in that view: v keeps its pair material with k on two signatures (its own and a
    colluder's) where k's 4 present neighbours need 3, while b, e and the colluder hand the server k's self-mask.
    Counted in the refused view (k's neighbours v and a only), 2 signatures would do and v would reveal it too.
    """
    cfg, grid, strategy, arrays = niss_setup(_CapturingGrid, num_rounds=3)
    assert cfg.self_mask and cfg.mask_corruption_rate == 0.1
    arrays, _ = run_round(strategy, grid, 1, arrays)
    v = grid.node_ids[0]
    k, a, b, e = read_node_ids(grid.ahead[v], "peer-ids")
    env = _Env(grid, v)
    committed = participants_of(env, 2)
    assert len(committed) == 5
    lie = Message(RecordDict({"config": _narrowed(cfg, grid.ahead[v], v, [v, k, a])}), v, "query.shares")
    (refusal,) = grid.send_and_receive([lie])
    assert refusal.has_error() and "joint-view noise scale" in refusal.error.reason
    assert participants_of(env, 2) == committed
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(train_messages(strategy, open_round(
        strategy, grid, 2, arrays)))}
    assert not any(r.has_error() for r in replies.values())

    def forwarded(node):
        return {x: SelfMaskShares.from_config(replies[x].content[SELF_MASK_RECORD]).sealed[node]
                for x in grid.node_ids if x != node}

    shares = []
    for j in (b, e):  # told "everyone received": each reveals its share of k's self-mask seed
        assert not sign(grid, [j], grid.node_ids, rnd=2)[j].refused
        rep = recover(grid, j, grid.node_ids, [], forwarded=forwarded(j), rnd=2)
        shares += [s for x, s in zip(rep.mask_peers, rep.mask_shares, strict=True) if x == k]
    colluder = RecoveryStore.load(ClientEnv.from_context(grid.contexts[a]))
    shares.append(open_share(colluder.mask_keys[k], forwarded(a)[k], sender=k, receiver=a, round_num=2,
                             context=int(grid.contexts[a].run_id).to_bytes(8, "big")))
    commit = SelfMaskShares.from_config(replies[k].content[SELF_MASK_RECORD]).commitment
    assert rebuild_seed(shares, colluder.threshold, commit) is not None  # the server holds k's self-mask
    others = [n for n in grid.node_ids if n != k]
    rep = recover(grid, v, others, [k], forwarded=forwarded(v), signatures=signed(sign(grid, [v, a], others, [k], rnd=2)),
                  rnd=2)
    assert not rep.refused and rep.kept == (k,) and rep.by_peer()[k] == b""


def test_an_ahead_answer_that_fails_leaves_the_round_uncharged(monkeypatch):
    """Whatever the ahead record makes the client raise, it raises before the round is charged: no paid upload is lost."""
    from client.methods import niss as niss_client

    cfg, grid, strategy, arrays = niss_setup(CountingGrid, num_rounds=3)
    victim = grid.node_ids[2]
    honest = niss_client.answer_shares

    def failing(rec, env, **kwargs):
        if env.node_id == victim and rec["round"] == 2:
            raise TypeError("an unforeseen failure on the ahead record")
        return honest(rec, env, **kwargs)

    monkeypatch.setattr(niss_client, "answer_shares", failing)
    _msgs, replies = niss_round(grid, strategy, 1, arrays)
    (mine,) = [r for r in replies if r.metadata.src_node_id == victim]
    assert mine.has_error()
    ctx = grid.contexts[victim]
    with ClientLedger.open(ledger_dir(ctx.node_config), int(ctx.node_config["partition-id"]), write=False) as led:
        assert led.rounds(ctx.run_id) == []
    assert all(not r.has_error() for r in replies if r.metadata.src_node_id != victim)
