"""Signed consistency check (protocols/consistency.py, client/consistency.py, strategies/recovery.py).

* split lie against real nadp clients: ``t`` of k's neighbours told "k received" reveal k's self-mask shares,
  the others told "k dropped" sign that outcome and are asked for their pair seeds with k; with the check they
  refuse (too few signatures), so exactly k's residual and all its pair noise stay once the self-mask is removed;
  with the check disabled (the same lying server, no signatures) they reveal, and k keeps only its pairs with the
  first group, well below its floor (the test can fail);
* a client signs one outcome per round and answers only that one; forged, relabelled, replayed or too few
  signatures are refused;
* honest rounds with dropouts still cancel (mpddp here; nadp and niss in tests/test_masking.py);
* the thresholds: ``t + s > d + c`` and ``s <= d`` wherever the present floor admits a neighbourhood.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from client import recovery as client_recovery
from client.app import app as client_app
from client.env import ClientEnv
from client.identity import node_identity
from client.records import to_record
from client.recovery import RecoveryStore, handle_recover
from protocols.config import RunConfig
from protocols.consistency import SignedOutcome, consistency_statement, outcome_digest
from protocols.graphs import present_floor
from protocols.masking import mask_parameters, mask_threshold, rebuild_seed, signatures_needed
from protocols.pairwise import pairwise_noise
from protocols.prg import gaussian
from protocols.task.models import build_model, get_weights
from protocols.wire.consistency import CONSISTENCY_RECORD, ConsistencyReply, ConsistencyRequest, SignedOutcomes
from protocols.wire.recovery import SELF_MASK_RECORD, RecoveryReply, RecoveryRequest, SelfMaskShares
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.stages import close_round
from tests import test_masking
from tests.consistency_setup import recover, sign, signed
from tests.test_masking import _forwarded, _round, _stripped_noise

pinned = test_masking.pinned  # the fixture: deterministic residual seeds


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


# ----------------------------------------------------------------------------------- the split lie
def _shares_of(rep, k: int) -> list[bytes]:
    return [s for x, s in zip(rep.mask_peers, rep.mask_shares, strict=True) if x == k]


@pytest.mark.parametrize("check", [True, False])
def test_split_lie_leaves_the_target_its_floor_noise(pinned, monkeypatch, check):
    """nadp, 10 real clients (d = 9, c = 1: t = 6, s = 5): 6 neighbours told "k received", 3 told "k dropped"."""
    if not check:  # main's behaviour before the check: pair seeds go out without signatures
        monkeypatch.setattr(client_recovery, "unsigned", lambda *_a, **_k: ("", set()))
    grid, strategy, msgs, replies = _round(10, hidden="32")
    st = strategy._state
    graph = st.keys.neighbours
    ids = [m.metadata.dst_node_id for m in msgs]
    k = ids[0]
    nbrs = sorted(graph[k])
    t = mask_threshold(len(nbrs), 0.1)
    assert (len(nbrs), t, signatures_needed(len(nbrs), len(nbrs), 0.1)) == (9, 6, 5)
    a, b = nbrs[:t], nbrs[t:]
    everyone, others = list(graph), [n for n in graph if n != k]
    # group a: the outcome "everyone received" (signed: the server may run the phase anyway), then k's shares
    a_sigs = sign(grid, a, everyone)
    shares = []
    for j in a:
        rep = recover(grid, j, everyone, [], forwarded=_forwarded(replies, j, graph))
        assert not rep.refused and not rep.peers
        shares += _shares_of(rep, k)
    # group b: the outcome "k dropped"; group a will not sign it any more (each signed or answered another)
    b_replies = sign(grid, others, others, [k])
    assert all("already" in b_replies[j].refused for j in a)
    sigs = signed(b_replies)
    assert sorted(e.node for e in sigs.entries) == b
    # what else the server can put in: a's signatures of the other outcome (replayed), and forgeries under a's names
    replayed = [SignedOutcome(j, r.name, r.signature) for j, r in a_sigs.items()]
    forged = [SignedOutcome(j, r.name, bytes(64)) for j, r in a_sigs.items()]
    seeds = {}
    for j in b:
        for extra in ([], replayed, forged):
            rep = recover(grid, j, others, [k], forwarded=_forwarded(replies, j, graph),
                          signatures=SignedOutcomes(sigs.entries + tuple(extra)))
            if check:  # k's pair stays secret (named kept, no material); the rest of the answer goes out
                assert not rep.refused and rep.kept == (k,) and rep.by_peer()[k] == b"", rep.refused
            else:
                assert not rep.refused
                seeds[j] = rep.by_peer()[k]
    commit = SelfMaskShares.from_config(replies[k].content[SELF_MASK_RECORD]).commitment
    seed = rebuild_seed(shares, t, commit)
    assert seed is not None  # the server does hold k's self-mask (t shares from group a) ...
    left = _stripped_noise(grid, strategy, msgs, replies, pinned, k, seeds)
    left -= SelfMaskShares.from_config(replies[k].content[SELF_MASK_RECORD]).std * gaussian(seed, len(left))
    # ... so what stays is k's residual plus its pair noise with every neighbour whose seed stayed secret
    alloc, lam, w = st.allocation, st.plan.lam, st.allocation.weights[k]
    stds = alloc.counteracting_stds(k)
    secret = [j for j in nbrs if j not in seeds]
    own = RecoveryStore.load(ClientEnv.from_context(grid.contexts[k])).material
    expected = (gaussian(pinned[0], left.size, alloc.residual_std[k])
                + lam * pairwise_noise(k, {j: own[j] for j in secret}, left.size, scale={j: stds[j] for j in secret})) / w
    assert np.linalg.norm(left - expected) <= 1e-9 * np.linalg.norm(expected)
    floor = alloc.uplink_std(k, lam)
    kept = math.sqrt(alloc.residual_std[k] ** 2 + lam**2 * sum(stds[j] ** 2 for j in secret)) / w
    if check:  # nothing stripped: the whole upload noise (2,410 coordinates: the sample std is within ~5 %)
        assert secret == nbrs and kept == pytest.approx(floor, rel=1e-9)
        assert np.std(left) >= 0.9 * floor, (np.std(left), floor)
    else:  # the attack works: only the residual and the pairs with group a are left
        assert secret == a and kept < 0.85 * floor
        assert np.std(left) == pytest.approx(kept, rel=0.05)


# ----------------------------------------------------------------------------------- the client's rules
@pytest.fixture
def six():
    """A 6-client nadp round, everyone uploaded; no colluders assumed: d = 5, t = 3, s = 3."""
    grid, strategy, msgs, replies = _round(6, mask_corruption_rate=0.0)
    return grid, strategy._state.keys.neighbours, replies


def test_a_client_signs_one_outcome_per_round_and_answers_only_that_one(six):
    grid, graph, replies = six
    ids = sorted(graph)
    me, k = ids[0], ids[-1]
    rest = ids[:-1]
    first = sign(grid, [me], rest, [k])[me]
    assert not first.refused and len(first.signature) == 64
    assert sign(grid, [me], rest, [k])[me] == first  # the same outcome again: the same signature
    other = sign(grid, [me], [n for n in rest if n != ids[1]], [ids[1], k])[me]
    assert "already signed a different outcome" in other.refused
    # the other outcome, with enough valid signatures of it from the others: refused all the same
    others = [n for n in rest if n != ids[1]]
    sigs = signed(sign(grid, others[1:], others, [ids[1], k]))
    rep = recover(grid, me, others, [ids[1], k], forwarded=_forwarded(replies, me, graph), signatures=sigs)
    assert "differs from the one this node signed" in rep.refused and not rep.material
    # a client that answered an outcome without drops (self-mask shares only) will not sign one with drops
    j = ids[1]
    assert not recover(grid, j, ids, [], forwarded=_forwarded(replies, j, graph)).refused
    assert "already answered" in sign(grid, [j], rest, [k])[j].refused


def test_too_few_or_forged_signatures_keep_the_pair_secret(six):
    """A dropped neighbour short of valid signatures: its pair material stays secret (kept), the rest answered."""
    grid, graph, replies = six
    ids = sorted(graph)
    me, k = ids[1], ids[-1]
    rest = ids[:-1]
    got = sign(grid, rest, rest, [k])
    assert not any(r.refused for r in got.values())
    need = signatures_needed(len(graph[k]), len(graph[k]), 0.0)
    assert need == 3

    def ask(entries) -> str:
        """Why k's pair stays secret ("" when it went out)."""
        rep = recover(grid, me, rest, [k], forwarded=_forwarded(replies, me, graph),
                      signatures=SignedOutcomes(tuple(entries)))
        assert not rep.refused and rep.mask_peers, rep.refused  # the self-mask shares of the received go out
        return "too few valid signatures" if rep.kept == (k,) and rep.by_peer()[k] == b"" else ""

    good = signed(got).entries
    mine = [e for e in good if e.node == me]
    peers = [e for e in good if e.node != me]
    assert "too few valid signatures" in ask(mine + peers[:need - 2])  # this node counts itself: need - 1 present
    flipped = SignedOutcome(peers[0].node, peers[0].name, bytes([peers[0].signature[0] ^ 1]) + peers[0].signature[1:])
    assert "too few valid signatures" in ask([*peers[1:need - 1], flipped])
    relabelled = SignedOutcome(peers[0].node, peers[1].name, peers[0].signature)  # another node's name
    assert "too few valid signatures" in ask([*peers[1:need - 1], relabelled])
    # a signature made by a node's own key for another round is not one of this round
    env = ClientEnv.from_context(grid.contexts[peers[0].node])
    ident = node_identity(env)
    stale = ident.identity.sign(consistency_statement(run_id=int(env.context.run_id), round_num=2, name=ident.name,
                                                      node_id=peers[0].node, digest=outcome_digest(1, rest, [k], [])))
    assert "too few valid signatures" in ask([*peers[1:need - 1], SignedOutcome(peers[0].node, ident.name, stale)])
    content = RecordDict({"config": ConfigRecord(RecoveryRequest(1, tuple(rest), (k,), (), _forwarded(replies, me,
                                                                                                  graph)).to_config()),
                          CONSISTENCY_RECORD: ConfigRecord({"signers": ["x"]})})
    out = handle_recover(Message(content, me, "query.recover"), ClientEnv.from_context(grid.contexts[me]))
    assert "malformed signatures" in RecoveryReply.from_config(out.content["config"]).refused
    rep = recover(grid, me, rest, [k], forwarded=_forwarded(replies, me, graph), signatures=SignedOutcomes(tuple(good)))
    assert not rep.refused and rep.peers == (k,) and len(rep.material[0]) == 32


def test_consistency_messages_round_trip_and_refuse_malformed_input():
    req = ConsistencyRequest(3, (5, 1, 2**64 - 1), (7,), (1,))
    assert ConsistencyRequest.from_config(req.to_config()) == req
    assert ConsistencyRequest.from_config(ConfigRecord(req.to_config())) == req
    sigs = SignedOutcomes((SignedOutcome(2, "a", bytes(64)), SignedOutcome(9, "b", b"\x01" * 64)))
    assert SignedOutcomes.from_config(ConfigRecord(sigs.to_config())) == sigs
    assert ConsistencyReply.from_config(ConsistencyReply("a", bytes(64)).to_config()) == ConsistencyReply("a", bytes(64))
    for bad in ({"received": ["1"]}, {"round": 1, "received": ["1", "1"]}, {"round": 1, "received": [1]}):
        with pytest.raises(ValueError):
            ConsistencyRequest.from_config(bad)
    with pytest.raises(ValueError):
        ConsistencyReply.from_config({"signer-name": "a", "signature": bytes(63)})
    with pytest.raises(ValueError):
        SignedOutcomes.from_config({"signers": ["1"], "signer-names": [], "signatures": []})
    assert outcome_digest(1, [1, 2], [3], []) == outcome_digest(1, [2, 1], [3], [])
    assert len({outcome_digest(1, [1, 2], [3], []), outcome_digest(1, [1], [2, 3], []),
                outcome_digest(1, [1, 2], [], [3]), outcome_digest(2, [1, 2], [3], [])}) == 4


# ----------------------------------------------------------------------------------- thresholds
def test_signatures_and_mask_shares_cannot_both_be_had():
    """``t + s > d + c`` always; ``s <= d`` (an honest round can recover) wherever the present floor admits ``d``."""
    for rate in (0.0, 0.1, 0.25, 0.45):
        for roster_degree in range(2, 40):
            c = math.ceil(rate * roster_degree - 1e-12)
            for d in range(present_floor(roster_degree, rate), roster_degree + 1):
                t, s = mask_threshold(d, rate), signatures_needed(d, roster_degree, rate)
                assert t + s > d + c and t > c and s <= d, (rate, roster_degree, d, t, s)
    p = mask_parameters(20, 0.1, 0.1)
    assert (p.threshold, p.signatures) == (12, 11) and "11 signed outcomes" in p.describe()


# ----------------------------------------------------------------------------------- honest rounds
def test_mpddp_round_with_a_dropout_signs_once_and_cancels():
    """mpddp, 8 real clients, one dropping before its upload: the survivors sign, reveal, and the noise cancels."""
    from strategies.mpddp import MpddpStrategy

    n = 8
    raw = {**app_defaults(), "method": "mpddp", "num-clients": n, "dataset": "digits", "hidden": "16",
           "mpddp-side-dtype": "float64", "cancellation-check": True}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), MpddpStrategy(cfg)
    arrays = to_record(get_weights(build_model("mlp", (1, 8, 8), 10, cfg.hidden_sizes, cfg.seed)), np.float64)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
    gone = msgs[2].metadata.dst_node_id
    replies = [r for r in grid.send_and_receive(msgs) if r.metadata.src_node_id != gone]
    assert close_round(strategy, grid, strategy._state, replies)[0] is not None
    report = strategy.round_report()
    assert report["consistency_signatures"] == n - 1 and report["recovered_pairs"] == n - 1
    assert report["cancellation_residual"] <= 1e-9, report["cancellation_residual"]
