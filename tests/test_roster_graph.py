"""The pairing graph follows the roster, not the participant list a server announces.

Attack on the earlier rule (graph seed = hash of the announced participants): a malicious server leaves
honest nodes out of a round, which re-draws the graph, and retries until colluders are most of a target's
neighbours.  Here the graph is the roster's (:func:`protocols.graphs.roster_round`) restricted to whoever is
present; the tests drive the real client code (pair seeds, the ClientApp on an in-process grid with real
identities) with views a malicious server builds, and check that no omission, however often retried,
gives the colluders a neighbour of the target the roster graph does not give them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from client.app import app as client_app
from client.env import ClientEnv
from client.identity import node_identity
from client.pairwise_phase import pair_seeds
from client.records import to_record
from protocols.config import RunConfig
from protocols.graphs import present_floor, present_graph, roster_round, roster_round_of, roster_sample, round_graph
from protocols.identity import IdentityError, Roster, generate_identity, roster_digest, roster_round_seed
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.common import TrainIns, merge_configs
from protocols.wire.keys import PeerKeys
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.base import RoundFailed
from strategies.key_phase import KeyPhase, KeyRound
from strategies.mpddp import MpddpStrategy
from strategies.nadp import NadpStrategy
from strategies.niss import NissStrategy
from strategies.stages import run_round

STRATEGIES = {"nadp": NadpStrategy, "niss": NissStrategy, "mpddp": MpddpStrategy}


class _RecordingGrid(LocalGrid):
    """Keeps the reason of every error reply (any phase)."""

    errors: list[str]

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.errors = getattr(self, "errors", []) + [r.error.reason for r in replies if r.has_error()]
        return replies


def _raw(method: str, n: int, **over) -> dict:
    return {**app_defaults(), "method": method, "num-clients": n, "graph": "n-out", "n-out": 2, **over}


def _keyed(method: str, n: int, **over) -> tuple[LocalGrid, NadpStrategy, KeyRound]:
    """A real key phase (signed keys from the real client handler) over every node of an in-process grid."""
    raw = _raw(method, n, **over)
    grid = LocalGrid(client_app, n, raw)
    strategy = STRATEGIES[method](RunConfig.from_mapping(raw))
    return grid, strategy, strategy.keys.run(strategy, grid, 1, list(grid.node_ids))


def _seeds(grid: LocalGrid, node: int, peers: PeerKeys, rnd: int = 1) -> dict[int, bytes]:
    """The real client's pair seeds for the view ``peers`` (raises when it refuses the view)."""
    msg = Message(RecordDict({"config": ConfigRecord(merge_configs(TrainIns(rnd).to_config(), peers.to_config()))}), node,
                  "train")
    return pair_seeds(msg, ClientEnv.from_context(grid.contexts[node]), "test")


def _roster(grid: LocalGrid, node: int):
    return node_identity(ClientEnv.from_context(grid.contexts[node])).roster


def _view(kr: KeyRound, node: int, participants: list[int], neighbours: list[int], seed: bytes) -> PeerKeys:
    """The view a server shows ``node``: ``participants`` (with their signed names), ``neighbours``' signed keys."""
    pk = kr.peer_keys(node, neighbours)
    return dataclasses.replace(pk, graph_seed=seed, participants=tuple(participants),
                               participant_names=tuple(kr.signed_by[p][0] for p in participants))


# ------------------------------------------------------------------ the attack, through the real client
def test_omitting_honest_nodes_and_retrying_cannot_steer_a_targets_neighbours():
    """16 nodes, n-out 2; 4 colluders outside the target's roster neighbourhood; 300 omission retries.

    Under the earlier rule (graph re-drawn over the announced participants) some retries give the
    colluders most of the target's neighbours: the attack is real.  The real client refuses every such
    view (it rebuilds the roster's graph); the only views it accepts are the roster graph restricted to the
    announced nodes, where the colluders hold exactly as many of its neighbours as the roster gives them: none.
    """
    grid, strategy, kr = _keyed("nadp", 16)
    assert kr.participants == sorted(grid.node_ids)  # everyone present: the roster graph itself
    target = kr.participants[0]
    roster_nbrs = set(kr.neighbours[target])
    colluders = set(sorted(set(kr.participants) - roster_nbrs - {target})[:4])
    honest = sorted(set(kr.participants) - colluders - {target})
    rng = random.Random(20261125)
    old_rule_wins, accepted = 0, []
    for _ in range(300):
        announced = sorted({target, *colluders, *(h for h in honest if rng.random() > 0.3)})
        # the earlier rule: the graph (and its seed) follow the announced participant list
        seed = hashlib.sha256(b"participants" + b"".join(p.to_bytes(8, "big") for p in announced)).digest()
        old = round_graph("n-out", 2, announced, seed)[target]
        if 2 * len(colluders & set(old)) > len(old):
            old_rule_wins += 1
        for shown_seed in (seed, kr.graph_seed):  # its own seed, or the roster's seed with the re-drawn peers
            if set(old) != roster_nbrs & set(announced):
                with pytest.raises(ValueError, match="graph seed is not the one|pairing graph"):
                    _seeds(grid, target, _view(kr, target, announced, old, shown_seed))
        # what the server can still do: the roster graph restricted to the announced nodes
        restricted = strategy.keys.regraph(kr, announced)
        if target in restricted.participants:
            got = _seeds(grid, target, restricted.peer_keys(target))
            accepted.append(set(got))
    assert old_rule_wins > 0  # the attack works against a graph drawn over the announced participants
    assert accepted and all(got <= roster_nbrs and not got & colluders for got in accepted)


def test_a_full_round_with_honest_nodes_left_out_keeps_the_roster_graph_and_cancels():
    """The server leaves two connected honest nodes out of the round (the ClientApp on an in-process grid).

    The clients accept: every participant's neighbours are its roster neighbours among the participants
    (nothing re-drawn), and the pairwise noise cancels.
    """
    n = 10
    raw = _raw("nadp", n, **{"cancellation-check": True})
    cfg = RunConfig.from_mapping(raw)
    grid = _RecordingGrid(client_app, n, raw)
    left_out = set(grid.node_ids[3:5])

    class Omitting(KeyPhase):
        def run(self, strategy, grid, server_round, nodes):
            self.last = super().run(strategy, grid, server_round, [x for x in nodes if x not in left_out])
            return self.last

    strategy = NadpStrategy(cfg)
    strategy.keys = Omitting(cfg)
    ds = dataset_for(cfg)
    arrays = to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes,
                                               cfg.seed)), strategy.wire_dtype)
    run_round(strategy, grid, 1, arrays)
    assert grid.errors == []
    assert strategy.round_report()["cancellation_residual"] < 1e-9
    kr = strategy.keys.last
    assert not set(kr.participants) & left_out
    rr = roster_round_of(cfg, _roster(grid, grid.node_ids[0]), 1)
    id_of = {name: node for node, (name, _) in kr.signed_by.items()}
    for node in kr.participants:
        roster_row = {id_of[m] for m in rr.neighbours(kr.signed_by[node][0]) if m in id_of}
        assert set(kr.neighbours[node]) == roster_row


def test_offline_nodes_are_absent_neighbours_and_the_round_completes():
    """Nodes that never answer are left out at the key phase; the rest train under the roster graph."""
    n = 8
    raw = _raw("mpddp", n, graph="complete", **{"cancellation-check": True})
    cfg = RunConfig.from_mapping(raw)
    grid = _RecordingGrid(client_app, n, raw)
    grid.offline = {grid.node_ids[1]}
    strategy = MpddpStrategy(cfg)
    ds = dataset_for(cfg)
    arrays = to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes,
                                               cfg.seed)), strategy.wire_dtype)
    run_round(strategy, grid, 1, arrays)
    assert grid.errors == []
    assert grid.node_ids[1] not in strategy.sampled
    assert strategy.round_report()["cancellation_residual"] < 1e-9


# ------------------------------------------------------------------ what the client refuses
def test_a_participant_outside_the_public_sample_is_refused():
    """sample-rate 0.5: the sample is the roster's public draw; swapping in an unsampled node is refused."""
    grid, strategy, kr = _keyed("nadp", 8, **{"sample-rate": 0.5, "graph": "complete"})
    rr = strategy.keys.roster_round(1)
    assert len(rr.sample) == 4 and sorted(kr.signed_by[p][0] for p in kr.participants) == list(rr.sample)
    assert strategy.sampled == kr.participants
    target = kr.participants[0]
    assert _seeds(grid, target, kr.peer_keys(target))  # the honest view
    outsider = next(n for n, e in strategy.keys.directory.items() if e.name not in rr.sample)
    kr.signed_by[outsider] = (strategy.keys.directory[outsider].name, strategy.keys.directory[outsider].signature)
    kr.public_keys[outsider] = strategy.keys.directory[outsider].public_key
    swapped = [p for p in kr.participants if p != kr.participants[-1]] + [outsider]
    with pytest.raises(ValueError, match="not in the round's public sample"):
        _seeds(grid, target, _view(kr, target, sorted(swapped), [p for p in swapped if p != target], kr.graph_seed))


def test_too_few_present_neighbours_are_refused():
    """Complete graph over 8: 7 roster neighbours need at least ``present_floor(7, 0.1)`` = 2 present."""
    grid, strategy, kr = _keyed("nadp", 8, graph="complete")
    target, other = kr.participants[:2]
    assert present_floor(7, strategy.cfg.mask_corruption_rate) == 2
    with pytest.raises(ValueError, match="it needs at least 2"):
        _seeds(grid, target, _view(kr, target, [target, other], [other], kr.graph_seed))
    third = kr.participants[2]
    assert set(_seeds(grid, target, _view(kr, target, [target, other, third], [other, third], kr.graph_seed))) \
        == {other, third}


def test_a_server_with_another_roster_is_refused():
    """A server that adds an identity of its own to the roster (a sybil) gets another graph seed: refused."""
    grid, strategy, kr = _keyed("nadp", 6)
    target = kr.participants[0]
    roster = dict(_roster(grid, target))
    sybil = Roster({**roster, "node-99": generate_identity("node-99").public_bytes})
    seed = roster_round_seed(roster_digest(sybil), 1)
    rr = roster_round("n-out", 2, list(sybil), len(sybil), seed)
    graph = present_graph(rr, {p: kr.signed_by[p][0] for p in kr.participants})
    with pytest.raises(ValueError, match="graph seed is not the one"):
        _seeds(grid, target, _view(kr, target, kr.participants, graph[target], seed))


def test_a_roster_changed_within_the_key_epoch_is_refused():
    """The node's roster file changes after it made its key pair: the graph would follow another roster."""
    grid, strategy, kr = _keyed("nadp", 5)
    target = kr.participants[0]
    path = grid.contexts[target].node_config["roster"]
    data = json.loads(open(path).read())
    data["nodes"]["node-late"] = generate_identity("node-late").public_bytes.hex()
    with open(path, "w") as f:
        f.write(json.dumps(data))
    with pytest.raises(ValueError, match="roster changed within key epoch"):
        _seeds(grid, target, kr.peer_keys(target))


def test_a_name_swapped_between_participants_is_refused():
    """The participant list must give each peer the roster name its key is signed under."""
    grid, strategy, kr = _keyed("nadp", 6, graph="complete")
    target = kr.participants[0]
    pk = kr.peer_keys(target)
    names = list(pk.participant_names)
    names[1], names[2] = names[2], names[1]
    with pytest.raises((ValueError, IdentityError), match="carries roster name|claim"):
        _seeds(grid, target, dataclasses.replace(pk, participant_names=tuple(names)))


def test_the_server_learns_the_roster_from_the_clients_and_refuses_unknown_identities():
    grid, strategy, kr = _keyed("niss", 4)
    assert strategy.keys.roster is not None and strategy.keys.roster.digest() == roster_digest(_roster(grid, kr.participants[0]))
    assert sorted(name for name, _ in kr.signed_by.values()) == sorted(strategy.keys.roster)


# ------------------------------------------------------------------ the graph functions
def test_roster_round_does_not_depend_on_who_is_present():
    names = [f"n{i}" for i in range(30)]
    seed = hashlib.sha256(b"round").digest()
    rr = roster_round("n-out", 3, names, 12, seed)
    assert rr == roster_round("n-out", 3, list(reversed(names)), 12, seed)  # order-free
    assert len(rr.sample) == 12 and set(rr.sample) <= set(names)
    assert rr.sample != roster_round("n-out", 3, names, 12, hashlib.sha256(b"other").digest()).sample
    full = present_graph(rr, {i: m for i, m in enumerate(rr.sample)})
    for drop in range(12):
        part = present_graph(rr, {i: m for i, m in enumerate(rr.sample) if i != drop})
        assert all(set(part[v]) == set(full[v]) - {drop} for v in part)  # restriction, never a re-draw
    assert all(v in full[u] for v in full for u in full[v])  # symmetric
    with pytest.raises(ValueError, match="public sample"):
        present_graph(rr, {0: next(m for m in names if m not in rr.sample)})
    with pytest.raises(ValueError, match="one roster name"):
        present_graph(rr, {0: rr.sample[0], 1: rr.sample[0]})
    assert roster_round("complete", 3, names, 40, seed).complete


def test_roster_sample_is_uniform():
    names = [f"n{i}" for i in range(6)]
    counts = dict.fromkeys(names, 0)
    trials = 3000
    for t in range(trials):
        for m in roster_sample(names, 2, hashlib.sha256(t.to_bytes(4, "big")).digest()):
            counts[m] += 1
    # each name is drawn with probability 1/3: 1000 expected, std ~26
    assert all(abs(c - trials / 3) < 130 for c in counts.values()), counts


def test_present_floor():
    assert present_floor(0, 0.1) == 0
    assert [present_floor(d, 0.1) for d in (1, 3, 7, 11, 21)] == [1, 2, 2, 3, 5]
    assert all(present_floor(d, 0.0) == 1 for d in range(1, 30))


def test_key_phase_round_failure_without_roster():
    """No client sends a roster (e.g. every node is offline): the round fails and names why."""
    raw = _raw("nadp", 3)
    grid = LocalGrid(client_app, 3, raw)
    grid.offline = set(grid.node_ids)
    strategy = NadpStrategy(RunConfig.from_mapping(raw))
    with pytest.raises(RoundFailed, match="roster"):
        strategy.keys.run(strategy, grid, 1, list(grid.node_ids))


def test_a_sparse_roster_graph_is_never_calibrated_as_complete():
    """mpddp: so few of an n-out sample present that a complete-graph calibration would apply: the round fails."""
    rr = roster_round("n-out", 2, [f"n{i}" for i in range(10)], 10, hashlib.sha256(b"r").digest())
    kr = KeyRound(1, [1, 2, 3], {}, {}, rr.seed, b"", roster_round=rr)
    with pytest.raises(RoundFailed, match="too few for the sparse graph"):
        kr.calibration_size(lambda k: 2 >= k - 1)
    assert dataclasses.replace(kr, participants=list(range(5))).calibration_size(lambda k: 2 >= k - 1) == 5
