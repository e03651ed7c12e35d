"""Authenticated key agreement: node identities, the roster, signed X25519 keys and consistent views.

The attacks drive the project's real client code (the ClientApp on an in-process grid whose nodes have
real identities made as ``cancelfl keys`` makes them) with a malicious subclass of the real strategy:
the server substitutes its own X25519 keys (it could then read every pair seed and NISS share), strips
the signatures, passes off a node of its own, or shows one client a participant set the others do not
share.  Every client that is handed such a key refuses, naming the node, and the round is refused.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from client.app import app as client_app
from client.env import ClientEnv
from client.identity import node_identity
from client.ledger import ClientLedger, ledger_dir
from client.methods.ddpsa import train as ddpsa_train
from client.pairwise_phase import pair_seeds
from client.records import to_record
from client.recovery import RecoveryStore
from protocols.config import ConfigError, RunConfig
from protocols.floor import FloorViolation
from protocols.graphs import present_graph, roster_round
from protocols.identity import (
    DerivedRoster,
    IdentityError,
    Roster,
    derived_identity,
    generate_identity,
    identity_from_pem,
    key_statement,
    roster_digest,
    roster_round_seed,
    settings_digest,
    verify_key,
    view_digest,
)
from protocols.keyagreement import agree, derive_pair_seed, generate_keypair
from protocols.niss import aggregation_weights
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.common import TrainIns, merge_configs
from protocols.wire.ddpsa import DdpsaRound
from protocols.wire.keys import PeerKeys
from protocols.wire.nadp import NadpPlan
from protocols.wire.niss import ShareRequest
from server.defaults import app_defaults
from server.launch import main as cancelfl
from server.local_grid import LocalGrid
from strategies.base import RoundFailed
from strategies.key_phase import KeyPhase, KeyRound
from strategies.mpddp import MpddpStrategy
from strategies.nadp import NadpStrategy
from strategies.niss import NissStrategy
from strategies.stages import close_round

STRATEGIES = {"nadp": NadpStrategy, "niss": NissStrategy, "mpddp": MpddpStrategy}
N = 4


# ------------------------------------------------------------------ pure crypto and the command
def _statement_args(**over):
    args = {"run_id": 7, "key_epoch": 2, "name": "node-0", "node_id": 123, "x25519_public": b"k" * 32}
    return {**args, **over}


def test_signature_binds_run_epoch_name_node_and_key():
    me = generate_identity("node-0")
    roster = Roster({"node-0": me.public_bytes, "node-1": generate_identity("node-1").public_bytes})
    sig = me.sign(key_statement(**_statement_args()))
    verify_key(roster, signature=sig, **_statement_args())
    for field, value in (("run_id", 8), ("key_epoch", 3), ("node_id", 124), ("x25519_public", b"j" * 32)):
        with pytest.raises(IdentityError, match="node .*wrong signature"):
            verify_key(roster, signature=sig, **_statement_args(**{field: value}))
    with pytest.raises(IdentityError, match="'node-1'.*wrong signature"):  # signed by another identity
        verify_key(roster, signature=sig, **_statement_args(name="node-1"))
    with pytest.raises(IdentityError, match="node 123 .*unknown node"):
        verify_key(roster, signature=sig, **_statement_args(name="node-9"))
    with pytest.raises(IdentityError, match="node 123 .*unsigned"):
        verify_key(roster, signature=b"", **_statement_args())
    with pytest.raises(IdentityError, match="wrong signature"):
        verify_key(roster, signature=sig[:63], **_statement_args())
    with pytest.raises(IdentityError, match="wrong signature"):  # one bit off, after the valid one was checked
        verify_key(roster, signature=bytes([sig[0] ^ 1]) + sig[1:], **_statement_args())
    verify_key(roster, signature=sig, **_statement_args())  # and again (a verification is kept per process)


def test_roster_parsing_rejects_malformed_files():
    a, b = generate_identity("a"), generate_identity("b")
    roster = Roster({"a": a.public_bytes, "b": b.public_bytes})
    assert Roster.from_json(roster.to_json()) == roster
    bad = [
        "not json",
        json.dumps({"nodes": {"a": a.public_bytes.hex()}}),  # no format
        json.dumps({"format": "cancelfl-roster/v1", "nodes": {}}),
        json.dumps({"format": "cancelfl-roster/v1", "nodes": {"a": "zz"}}),
        json.dumps({"format": "cancelfl-roster/v1", "nodes": {"a": a.public_bytes.hex()[:-2]}}),
        json.dumps({"format": "cancelfl-roster/v1", "nodes": {"a": a.public_bytes.hex(), "b": a.public_bytes.hex()}}),
    ]
    for text in bad:
        with pytest.raises(IdentityError):
            Roster.from_json(text)
    with pytest.raises(IdentityError, match="not in the roster"):
        identity_from_pem(generate_identity("c").private_pem(), roster)


def test_keys_command_makes_identities_and_roster(tmp_path, capsys):
    keys = tmp_path / "keys"
    assert cancelfl(["keys", "gen", "--out", str(keys), "--node", "alice", "--node", "bob"]) == 0
    assert (keys / "alice.key").stat().st_mode & 0o077 == 0  # private key readable by its owner only
    assert cancelfl(["keys", "gen", "--out", str(keys), "--node", "alice"]) == 2  # never overwritten silently
    assert "exists already" in capsys.readouterr().err
    roster_file = tmp_path / "roster.json"
    assert cancelfl(["keys", "roster", "--out", str(roster_file), str(keys / "alice.pub"), str(keys / "bob.pub")]) == 0
    roster = Roster.load(roster_file)
    alice = identity_from_pem((keys / "alice.key").read_bytes(), roster)
    assert alice.name == "alice" and roster["alice"] == alice.public_bytes and set(roster) == {"alice", "bob"}
    assert cancelfl(["keys", "roster", "--out", str(roster_file), str(keys / "alice.pub"), str(keys / "alice.pub")]) == 2


def test_view_digest_covers_every_part_of_the_view():
    base = {"run_id": 1, "round_num": 2, "key_epoch": 0, "graph": "complete", "n_out": 4, "graph_seed": b"g" * 32,
            "participants": [5, 3, 9]}
    d = view_digest(**base)
    assert view_digest(**{**base, "participants": [9, 5, 3]}) == d  # order does not matter
    for change in ({"run_id": 2}, {"round_num": 3}, {"key_epoch": 1}, {"graph": "n-out"}, {"n_out": 5},
                   {"graph_seed": b"h" * 32}, {"participants": [5, 3]}, {"participants": [5, 3, 9, 11]},
                   {"names": ["a", "b", "c"]}):
        assert view_digest(**{**base, **change}) != d
    named = view_digest(**{**base, "names": ["a", "b", "c"]})
    assert view_digest(**{**base, "participants": [9, 3, 5], "names": ["c", "b", "a"]}) == named  # same pairs
    assert view_digest(**{**base, "names": ["b", "a", "c"]}) != named  # ids swapped between names


def test_nodes_without_identity_use_the_marked_simulation_identity_unless_required():
    raw = {**app_defaults(), "method": "nadp", "num-clients": 3}
    grid = LocalGrid(client_app, 3, raw, identities=False)
    env = ClientEnv.from_context(grid.contexts[grid.node_ids[1]])
    me = node_identity(env)
    assert me.derived and me.name == "partition-1" and isinstance(me.roster, DerivedRoster)
    assert me.roster["partition-2"] == derived_identity(42, "partition-2").public_bytes
    grid.contexts[grid.node_ids[1]].node_config["require-identity"] = True
    with pytest.raises(ConfigError, match="require-identity"):
        node_identity(ClientEnv.from_context(grid.contexts[grid.node_ids[1]]))
    real = LocalGrid(client_app, 3, raw)
    assert node_identity(ClientEnv.from_context(real.contexts[real.node_ids[2]])).name == "node-2"


# ------------------------------------------------------------------ malicious strategies
class _Tamper(KeyPhase):
    """A key phase whose directory the server rewrites before relaying it (``how`` picks the attack)."""

    def __init__(self, cfg: RunConfig, how: str) -> None:
        super().__init__(cfg)
        self.how = how
        self.attacker = generate_identity("node-99")  # an identity the server made itself: not in the roster

    def run(self, strategy, grid, server_round, nodes) -> KeyRound:
        kr = super().run(strategy, grid, server_round, nodes)
        self.fake = {n: generate_keypair() for n in kr.participants}  # the server knows their private halves
        fake = {n: kp.public_bytes for n, kp in self.fake.items()}
        if self.how == "derived":  # signed with the simulation identities the run seed gives every name
            sign = {n: (name, derived_identity(self.cfg.seed, name).sign(key_statement(
                run_id=grid.run.run_id, key_epoch=kr.key_epoch, name=name, node_id=n, x25519_public=fake[n])))
                for n, (name, _) in kr.signed_by.items()}
            self.real = dict(kr.public_keys)
            return dataclasses.replace(kr, public_keys=fake, signed_by=sign)
        if self.how == "substitute":  # the server's keys under the victims' real names and signatures
            return dataclasses.replace(kr, public_keys=fake)
        if self.how == "unsigned":
            return dataclasses.replace(kr, public_keys=fake, signed_by={})
        if self.how == "unknown":  # keys properly signed, but by the server's own identity
            sign = {n: ("node-99", self.attacker.sign(key_statement(
                run_id=grid.run.run_id, key_epoch=kr.key_epoch, name="node-99", node_id=n, x25519_public=fake[n])))
                for n in kr.participants}
            return dataclasses.replace(kr, public_keys=fake, signed_by=sign)
        raise AssertionError(self.how)


class _RecordingGrid(LocalGrid):
    """Keeps every error reply (any phase) so that the test can read why clients refused."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent += messages
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.errors += [r.error.reason for r in replies if r.has_error()]
        self.replies += replies
        return replies


def _one_round(method: str, make_strategy, identities: bool = True, node_config: dict | None = None, **over):
    raw = {**app_defaults(), "method": method, "num-clients": N, **over}
    cfg = RunConfig.from_mapping(raw)
    grid = _RecordingGrid(client_app, N, raw, identities=identities, node_config=node_config)
    strategy = make_strategy(cfg)
    ds = dataset_for(cfg)
    arrays = to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes,
                                               cfg.seed)), strategy.wire_dtype)
    grid.errors, grid.replies, grid.sent = [], [], []
    try:
        msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
        close_round(strategy, grid, strategy._state, list(grid.send_and_receive(msgs)))
    except RoundFailed as err:
        return grid, strategy, err
    return grid, strategy, None


def _tampering(method: str, how: str):
    def make(cfg):
        strategy = STRATEGIES[method](cfg)
        strategy.keys = _Tamper(cfg, how)
        return strategy
    return make


@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_key_substitution_is_detected_and_the_round_refused(method):
    """The server relays its own X25519 keys under the real names and signatures: every client refuses."""
    grid, _, failure = _one_round(method, _tampering(method, "substitute"))
    assert isinstance(failure, RoundFailed)  # (niss refuses already in the share phase)
    refusals = grid.errors
    assert len(refusals) >= N  # every client refused (niss: in the share phase, also after its re-graphs)
    named = {int(r.split("node ")[1].split(" ")[0]) for r in refusals if "wrong signature" in r}
    assert named <= set(grid.node_ids) and named  # the message names a real node
    assert all("IdentityError" in r and "wrong signature" in r for r in refusals)


@pytest.mark.parametrize("how,reason", [("unsigned", "unsigned"), ("unknown", "unknown node, not in the roster")])
def test_unsigned_and_unknown_keys_are_refused(how, reason):
    grid, _, failure = _one_round("nadp", _tampering("nadp", how))
    assert isinstance(failure, RoundFailed) and len(grid.errors) == N and all(reason in r for r in grid.errors)


@pytest.mark.parametrize("identities", [True, False], ids=["cancelfl-keys", "simulation-derived"])
def test_honest_round_with_identities_cancels(identities):
    grid, strategy, failure = _one_round("nadp", NadpStrategy, identities, **{"cancellation-check": True})
    assert failure is None and grid.errors == [] and strategy.round_report()["cancellation_residual"] < 1e-9


def _server_seeds(grid: _RecordingGrid, keys: _Tamper, cfg: RunConfig, purpose: str) -> dict[int, dict[int, bytes]]:
    """Per train message: the pair seeds the server derives from its own keys and the view it sent."""
    out = {}
    for msg in grid.sent:
        if msg.metadata.message_type != "train":
            continue
        rec, node = msg.content["config"], msg.metadata.dst_node_id
        pk, rnd = PeerKeys.from_config(rec), TrainIns.from_config(rec).round
        view = view_digest(run_id=grid.run.run_id, round_num=rnd, key_epoch=pk.key_epoch, graph=cfg.graph, n_out=cfg.n_out,
                           graph_seed=pk.graph_seed, participants=pk.participants, names=pk.participant_names,
                           settings=settings_digest(cfg))
        context = grid.run.run_id.to_bytes(8, "big") + view + NadpPlan.from_config(rec).pair_view()
        out[node] = {p: derive_pair_seed(agree(keys.fake[p], keys.real[node]), purpose=purpose, round_num=rnd,
                                         node_a=node, node_b=p, context=context) for p in pk.peer_ids}
    return out


def test_simulation_identities_let_the_server_derive_every_pair_seed():
    """What the next tests guard against: a server knowing the run seed signs its own keys as every peer."""
    grid, strategy, _ = _one_round("nadp", _tampering("nadp", "derived"), identities=False)
    derived = _server_seeds(grid, strategy.keys, strategy.cfg, "nadp-counteract")
    assert grid.errors == [] and len(derived) == N
    for node, seeds in derived.items():  # the very seeds each client's upload carries
        assert RecoveryStore.load(ClientEnv.from_context(grid.contexts[node])).material == seeds


@pytest.mark.parametrize("method", ["nadp", "niss"])
def test_a_node_asking_for_a_guarantee_refuses_simulation_identities(method):
    """With a lifetime budget set, a node does not pair under simulation identities: nothing uploaded or charged.

    (Without the refusal the server strips all pair noise: nadp, 4 clients, one round: z 11.3 left of the 22.4
    charged, epsilon 0.30 released for the 0.14 the ledger records.)
    """
    grid, _, failure = _one_round(method, _tampering(method, "derived"), identities=False,
                                  node_config={"lifetime-epsilon": 50})
    assert isinstance(failure, RoundFailed) and len(grid.errors) >= N
    assert all("FloorViolation" in r and "identity-key" in r for r in grid.errors)
    for node in grid.node_ids:
        env = ClientEnv.from_context(grid.contexts[node])
        assert RecoveryStore.load(env) is None
        with ClientLedger.open(ledger_dir(env.context.node_config), env.partition_id, write=False) as led:
            assert led.rounds(env.context.run_id) == [] and not led.accounts


def test_a_ddpsa_node_asking_for_a_guarantee_refuses_simulation_identities():
    """Under simulation identities the server could push shares as every other listed participant."""
    raw = {**app_defaults(), "method": "ddpsa", "num-clients": 3}
    grid = LocalGrid(client_app, 3, raw, identities=False, node_config={"max-epsilon-per-run": 10})
    env = ClientEnv.from_context(grid.contexts[grid.node_ids[0]])
    plan = DdpsaRound(0.5, "distributed", ("partition-0", "partition-1"), ("127.0.0.1:1", "127.0.0.1:2"), 2, "r", 24, 10)
    msg = Message(RecordDict({"config": ConfigRecord(merge_configs(TrainIns(1).to_config(), plan.to_config()))}),
                  grid.node_ids[0], "train")
    with pytest.raises(FloorViolation, match="identity-key"):
        ddpsa_train(msg, env)


# ------------------------------------------------------------------ consistent views
def _split_view(kr: KeyRound, victim: int) -> KeyRound:
    """The view the server shows ``victim``: one other participant left out (the victim's own checks pass)."""
    gone = next(n for n in kr.participants if n != victim)
    keep = [n for n in kr.participants if n != gone]
    return KeyPhase(RunConfig()).regraph(kr, keep)  # the graph seed of the split view, as a client recomputes it


class _SplitNiss(NissStrategy):
    """Shows the lowest node a participant set the others do not share, in the share phase."""

    victim: int | None = None

    def exchange(self, grid, nodes, content_fn, action):
        if self.victim is None and action == "shares":
            self.victim = min(nodes)
        if action == "shares" and self.victim in nodes:
            victim = self.victim

            def content(node, inner=content_fn):
                rec = inner(node)
                if node != victim:
                    return rec
                req = ShareRequest.from_config(rec["config"])
                view = _split_view(self.keys.last, victim)
                peers = dataclasses.replace(view.peer_keys(victim), probe_seed=None)
                # sizes and weight of the split view itself: the victim's own checks pass
                sizes = {n: req.sizes[n] for n in view.participants}
                weight = aggregation_weights(self.cfg, view.participants, sizes)[victim]
                return RecordDict({"config": ConfigRecord(ShareRequest(req.round, weight, peers, sizes).to_config())})
            return super().exchange(grid, nodes, content, action)
        return super().exchange(grid, nodes, content_fn, action)


class _RememberingKeys(KeyPhase):
    def run(self, strategy, grid, server_round, nodes):
        self.last = super().run(strategy, grid, server_round, nodes)
        return self.last


def test_inconsistent_view_is_refused_by_niss():
    """The lowest node is shown a participant set the others do not share, in the share phase.

    Its shares follow its own view (neighbours, relay keys bound to that view), which no other client shares:
    the server's check of the share reply against the round's graph, or the receivers' relay authentication,
    refuses them, and the split node is left out; the rest re-graph under one consistent view (whose graph
    seed the server cannot pick, so a "split" of the same participants is the honest view again). The split
    node never uploads.
    """
    def make(cfg):
        s = _SplitNiss(cfg)
        s.keys = _RememberingKeys(cfg)
        return s
    grid, strategy, failure = _one_round("niss", make)
    victim = strategy.victim
    uploaders = {r.metadata.src_node_id for r in grid.replies
                 if r.metadata.message_type == "train" and not r.has_error() and "arrays" in r.content}
    assert victim is not None and victim not in uploaders
    # the others completed the round among themselves, with a consistent view
    assert failure is None
    assert uploaders == set(strategy.keys.last.participants) - {victim}
    assert strategy.round_report()["participants"] == len(uploaders)


def _graph_cfg(graph: str = "complete", n_out: int = 2) -> RunConfig:
    """The run config of :func:`_keyed_round`'s graph rule (for rebuilding a graph as the server would)."""
    return RunConfig.from_mapping({**app_defaults(), "method": "nadp", "graph": graph, "n-out": n_out})


def _keyed_round(method: str = "mpddp", n: int = 5, graph: str = "auto", n_out: int = 4):
    """A real key phase (signed keys from the real client handler) on an in-process grid."""
    raw = {**app_defaults(), "method": method, "num-clients": n, "graph": graph, "n-out": n_out}
    cfg = RunConfig.from_mapping(raw)
    grid = LocalGrid(client_app, n, raw)
    strategy = STRATEGIES[method](cfg)
    return grid, strategy.keys.run(strategy, grid, 1, list(grid.node_ids))


def _seeds(grid: LocalGrid, node: int, peers: PeerKeys) -> dict[int, bytes]:
    msg = Message(RecordDict({"config": ConfigRecord(merge_configs(TrainIns(1).to_config(), peers.to_config()))}), node, "train")
    return pair_seeds(msg, ClientEnv.from_context(grid.contexts[node]), "test")


def test_pair_seeds_are_bound_to_the_view():
    """Two clients shown different participant sets derive different seeds: the split buys the server nothing.

    The victim's pair noise is then derived under a view no other client holds, so no other client can
    ever reveal (e.g. in dropout recovery) a seed that removes it, and the aggregate does not cancel.
    """
    grid, kr = _keyed_round()
    victim, peer = kr.participants[0], kr.participants[-1]  # (the split view leaves out participants[1])
    honest = _seeds(grid, victim, kr.peer_keys(victim))
    assert honest[peer] == _seeds(grid, peer, kr.peer_keys(peer))[victim]  # same view: same seed
    split = _split_view(kr, victim)
    shown = _seeds(grid, victim, split.peer_keys(victim))
    assert peer in shown and shown[peer] != _seeds(grid, peer, kr.peer_keys(peer))[victim]


@pytest.mark.parametrize("graph", ["complete", "n-out"])
def test_a_graph_seed_of_the_servers_choosing_is_refused(graph):
    """The pairing graph follows from the roster and the round, not from the server.

    A server that picks the graph seed itself (e.g. trying seeds until a target's n-out neighbours are
    colluders) sends the same participants with another seed, and with it the graph that seed gives: the real
    client handler refuses before deriving any pair seed.  The honest seed is the one both sides recompute.
    """
    grid, kr = _keyed_round("nadp", n=8, graph=graph, n_out=2)
    victim = kr.participants[0]
    roster = node_identity(ClientEnv.from_context(grid.contexts[victim])).roster
    assert kr.graph_seed == roster_round_seed(roster_digest(roster), 1)
    assert _seeds(grid, victim, kr.peer_keys(victim))  # the honest view is accepted
    chosen = b"x" * 32
    rr = roster_round(graph, 2, list(roster), len(roster), chosen)
    steered = dataclasses.replace(kr, graph_seed=chosen, neighbours=present_graph(rr, {n: kr.signed_by[n][0]
                                                                                    for n in kr.participants}))
    with pytest.raises(ValueError, match="graph seed is not the one"):
        _seeds(grid, victim, steered.peer_keys(victim))


def test_inconsistent_peer_lists_are_refused():
    """A view the client can see is wrong -- peers outside the round's graph, itself left out -- is refused."""
    grid, kr = _keyed_round()
    victim = kr.participants[0]
    colluder_only = kr.peer_keys(victim, kr.neighbours[victim][:1])  # e.g. only a colluding neighbour
    with pytest.raises(ValueError, match="differs from this node's neighbours"):
        _seeds(grid, victim, colluder_only)
    pk = kr.peer_keys(victim)
    without_me = dataclasses.replace(pk, participants=pk.participants[1:], participant_names=pk.participant_names[1:])
    with pytest.raises(ValueError, match="not among the round's participants"):
        _seeds(grid, victim, without_me)
    stranger = dataclasses.replace(pk, participants=(victim, *pk.participants[2:]),
                                   participant_names=(pk.participant_names[0], *pk.participant_names[2:]))
    with pytest.raises(ValueError, match="not among the round's participants"):
        _seeds(grid, victim, stranger)
    no_view = dataclasses.replace(kr.peer_keys(victim), participants=(), participant_names=())
    with pytest.raises(ValueError, match="participant list or graph seed"):
        _seeds(grid, victim, no_view)
    twice = kr.peer_keys(victim)
    twice = dataclasses.replace(twice, peer_names=(twice.peer_names[0],) * len(twice.peer_names))
    with pytest.raises(IdentityError, match="wrong signature|claim roster identity"):
        _seeds(grid, victim, twice)
