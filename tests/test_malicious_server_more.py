"""Further lies of a malicious server, driven through the real client handlers (in-process grid).

Each test plays a server that bends one message of the protocol and checks that the client reveals nothing that
would strip its own or a peer's noise, nor spends less than its ledger says.
"""

from __future__ import annotations

from flwr.app import ConfigRecord

from protocols.wire.common import read_node_ids
from protocols.wire.niss import AHEAD_RECORD
from protocols.wire.recovery import SELF_MASK_RECORD, SelfMaskShares
from strategies.stages import open_round, run_round, train_messages
from tests.consistency_setup import recover, sign, signed
from tests.niss_setup import niss_setup
from tests.test_niss_ahead import _CapturingGrid, _Env, _narrowed


def test_niss_a_share_request_for_the_round_being_trained_does_not_replace_its_view():
    """Round 2's train message to v carries a share request of round 2 itself, over a view hiding two of k's neighbours.

    Answered there (before round 2 is charged, so "a round already trained in" does not apply yet), it replaced the
    view round 2's recovery counts k's neighbours in: v then revealed its pair material with k on two signatures (its
    own and a colluder's) where k's 4 present neighbours need 3, while b, e and the colluder could hand the server
    k's self-mask.  The client answers a carried share request only for a later round than the one it trains in.
    """
    from client.pairwise_phase import participants_of

    cfg, grid, strategy, arrays = niss_setup(_CapturingGrid, num_rounds=3)
    assert cfg.self_mask and cfg.mask_corruption_rate == 0.1
    arrays, _ = run_round(strategy, grid, 1, arrays)
    v = grid.node_ids[0]
    k, a, _b, _e = read_node_ids(grid.ahead[v], "peer-ids")
    committed = participants_of(_Env(grid, v), 2)
    assert committed is not None and len(committed) == 5
    lie = _narrowed(cfg, grid.ahead[v], v, [v, k, a])
    lie["niss-noise-scale"] = 50.0  # at least the narrowed view's floor: the request itself is a valid one
    msgs = train_messages(strategy, open_round(strategy, grid, 2, arrays))
    for m in msgs:
        if m.metadata.dst_node_id == v:
            m.content[AHEAD_RECORD] = ConfigRecord(dict(lie.items()))
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    assert not any(r.has_error() for r in replies.values())
    assert AHEAD_RECORD not in replies[v].content  # not answered: round 2 is the round v trains in
    assert participants_of(_Env(grid, v), 2) == committed

    def forwarded(node):
        return {x: SelfMaskShares.from_config(replies[x].content[SELF_MASK_RECORD]).sealed[node]
                for x in grid.node_ids if x != node}

    others = [n for n in grid.node_ids if n != k]
    rep = recover(grid, v, others, [k], forwarded=forwarded(v), signatures=signed(sign(grid, [v, a], others, [k], rnd=2)),
                  rnd=2)
    assert not rep.refused and rep.kept == (k,) and rep.by_peer()[k] == b""
