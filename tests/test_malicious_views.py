"""A malicious server that shows clients different views of one round, driving the real client code.

* nadp: each client gets its own plan, with the peers' sizes (or the noise scale) changed so that every plan still
  meets that client's floor.  The two ends of a pair would draw the same noise at different stds, and the server
  could weight the uploads to cancel one client's pair noise alone.  The sizes and the scale are bound into the
  pair seeds, so the two ends derive no common noise.
* niss: leaving a client's honest neighbours out of a round does not shrink the coalition its floor counts.
* niss: after the uploads, a share request for the same round with a smaller view would shrink the present
  neighbour count a revealer counts signatures against (so that a split "k dropped" outcome passes).  A share
  request for a round already trained in is refused and the round's view stays the one the upload used.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from client.app import app as client_app
from client.env import ClientEnv
from client.identity import node_identity
from client.methods.niss import handle_shares
from client.pairwise_phase import participants_of
from client.records import to_record
from client.recovery import RecoveryStore
from protocols.config import RunConfig
from protocols.floor import FloorViolation, nadp_floor, niss_floor
from protocols.graphs import roster_round_of
from protocols.masking import mask_threshold, signatures_needed
from protocols.niss import aggregation_weights, client_tau
from protocols.schedule import roster_releases
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.keys import PeerKeys
from protocols.wire.nadp import NadpPlan
from protocols.wire.niss import ShareRequest
from protocols.wire.recovery import SELF_MASK_RECORD, SelfMaskShares
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.nadp import NadpStrategy
from strategies.niss import NissStrategy
from tests.consistency_setup import recover, sign, signed


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class _Recording(LocalGrid):
    """LocalGrid that keeps every message it delivered."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent = [*getattr(self, "sent", []), *messages]
        return super().send_and_receive(messages, timeout=timeout)


def _initial(cfg: RunConfig):
    ds = dataset_for(cfg)
    return to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)),
                     np.float64)


@pytest.mark.parametrize("split", ["none", "sizes", "scale"])
def test_nadp_clients_shown_different_plans_share_no_pair_noise(split):
    k_clients = 4
    raw = {**app_defaults(), "method": "nadp", "num-clients": k_clients, "num-rounds": 3, "local-epochs": 1,
           "batch-size": 1000, "lr": 4.0, "clip": 1.0, "hidden": "", "mask-corruption-rate": 0.0}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, k_clients, raw), NadpStrategy(cfg)
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    plan0 = NadpPlan.from_config(msgs[0].content["config"])
    ids, true = list(plan0.ids), dict(plan0.sizes)
    k = ids[0]
    graph = {m: [j for j in ids if j != m] for m in ids}
    for msg in msgs:  # every plan meets its own client's floor
        m = msg.metadata.dst_node_id
        sizes = true if split != "sizes" or m == k else {
            x: true[x] if x == m else max(1, int(true[x] * (20.0 if x == k else 0.05))) for x in ids}
        scale = 1.0 if split != "scale" or m == k else 1.5
        fl = nadp_floor(cfg, sizes, m, graph, scale)
        plan = NadpPlan("nadp", plan0.ids, sizes, fl.sigmas.sigma_up, fl.sigmas.sigma_down, fl.lam, noise_scale=scale)
        msg.content["config"].update(plan.to_config())
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    assert not any(r.has_error() for r in replies.values()), [r.error.reason for r in replies.values() if r.has_error()]
    seeds = {m: RecoveryStore.load(ClientEnv.from_context(grid.contexts[m])).material for m in ids}
    shared = [seeds[k][j] == seeds[j][k] for j in ids if j != k]
    if split == "none":
        assert all(shared)  # one view: every pair draws one noise vector at both ends, and it cancels
    else:
        assert not any(shared)  # k's pair noise has no counterpart the server could weight against it


def test_niss_share_request_for_a_trained_round_is_refused_and_its_view_kept():
    n = 10
    raw = {**app_defaults(), "method": "niss", "num-clients": n, "niss-share-encoding": "seed", "self-mask": True}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = _Recording(client_app, n, raw), NissStrategy(cfg)
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    assert not any(r.has_error() for r in replies.values())
    graph = strategy._state.keys.neighbours
    k = msgs[0].metadata.dst_node_id
    nbrs = sorted(graph[k])
    t = mask_threshold(len(nbrs), cfg.mask_corruption_rate)
    assert signatures_needed(len(nbrs), len(nbrs), cfg.mask_corruption_rate) > len(nbrs) - t
    group_a, group_b = nbrs[:t], nbrs[t:]  # told "everyone received" (enough to rebuild k's self-mask) / "k dropped"
    others = [x for x in graph if x != k]
    sign(grid, group_a, list(graph))
    sigs = signed(sign(grid, others, others, [k]))  # group a refuses to sign the conflicting outcome
    assert len(sigs.entries) < signatures_needed(len(nbrs), len(nbrs), cfg.mask_corruption_rate)
    requests = {m.metadata.dst_node_id: ShareRequest.from_config(m.content["config"])
                for m in grid.sent if m.metadata.message_type == "query.shares"}
    for j in group_b:
        env = ClientEnv.from_context(grid.contexts[j])
        before = participants_of(env, 1)
        req, keep = requests[j], {k, *group_b}
        pk, names = req.peers, dict(zip(req.peers.participants, req.peers.participant_names, strict=True))
        idx = [i for i, p in enumerate(pk.peer_ids) if p in keep]
        parts = tuple(p for p in pk.participants if p in keep)
        smaller = PeerKeys(tuple(pk.peer_ids[i] for i in idx), tuple(pk.peer_keys[i] for i in idx), pk.key_epoch,
                           pk.graph_seed, pk.probe_seed, tuple(pk.peer_names[i] for i in idx),
                           tuple(pk.peer_signatures[i] for i in idx), parts, tuple(names[p] for p in parts))
        sizes = {p: req.sizes[p] for p in parts}
        again = ShareRequest(1, aggregation_weights(cfg, parts, sizes)[j], smaller, sizes, 50.0)
        with pytest.raises(FloorViolation, match="round"):
            handle_shares(Message(RecordDict({"config": ConfigRecord(again.to_config())}), j, "query.shares"), env)
        assert participants_of(env, 1) == before  # the view the upload used
        forwarded = {x: SelfMaskShares.from_config(replies[x].content[SELF_MASK_RECORD]).sealed[j]
                     for x in graph[j] if SELF_MASK_RECORD in replies[x].content}
        rep = recover(grid, j, others, [k], forwarded=forwarded, signatures=sigs)
        assert rep.refused and "signature" in rep.refused, rep.refused  # too few signed "k dropped"


def test_niss_leaving_honest_neighbours_out_does_not_shrink_the_coalition_a_client_is_protected_against():
    """niss-rho covers floor(rho * d) colluders of a client's d roster neighbours, however many are present.

    A server that keeps only two colluders present (the present floor allows it) and offers the scale rho
    counted on the present degree needs (one colluder) is refused: the client counts from its roster degree.
    """
    n = 10
    raw = {**app_defaults(), "method": "niss", "num-clients": n, "num-rounds": 3, "niss-share-encoding": "seed"}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = _Recording(client_app, n, raw), NissStrategy(cfg)
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    list(grid.send_and_receive(msgs))
    k = msgs[0].metadata.dst_node_id
    req = next(ShareRequest.from_config(m.content["config"]) for m in grid.sent
               if m.metadata.message_type == "query.shares" and m.metadata.dst_node_id == k)
    pk, env = req.peers, ClientEnv.from_context(grid.contexts[k])
    names = dict(zip(pk.participants, pk.participant_names, strict=True))
    keep = {k, *pk.peer_ids[:2]}  # k and two of its nine neighbours: the server's colluders
    rr = roster_round_of(cfg, node_identity(env).roster, 2)
    parts = tuple(p for p in pk.participants if p in keep)
    idx = [i for i, p in enumerate(pk.peer_ids) if p in keep]
    smaller = PeerKeys(tuple(pk.peer_ids[i] for i in idx), tuple(pk.peer_keys[i] for i in idx), pk.key_epoch, rr.seed,
                       None, tuple(pk.peer_names[i] for i in idx), tuple(pk.peer_signatures[i] for i in idx), parts,
                       tuple(names[p] for p in parts))
    sizes = {p: req.sizes[p] for p in parts}
    graph = {p: [q for q in parts if q != p] for p in parts}
    tau, releases = client_tau(cfg, sizes), roster_releases(cfg, node_identity(env).roster)
    present = niss_floor(cfg, sizes, graph, tau, None, releases).scale  # colluders counted on the present degree
    roster = niss_floor(cfg, sizes, graph, tau, None, releases, degrees=dict.fromkeys(parts, n - 1)).scale
    assert roster > present * 1.1  # both present neighbours may collude: more noise
    weight = aggregation_weights(cfg, parts, sizes)[k]
    for scale, accepted in ((present, False), (roster, True)):
        msg = Message(RecordDict({"config": ConfigRecord(ShareRequest(2, weight, smaller, sizes, scale).to_config())}),
                      k, "query.shares")
        if accepted:
            handle_shares(msg, env)
        else:
            with pytest.raises(FloorViolation, match="joint-view noise scale"):
                handle_shares(msg, env)


@pytest.mark.parametrize("allowed", [False, True])
def test_niss_cancellation_check_sends_no_noiseless_update_unless_the_node_allows_it(monkeypatch, allowed):
    """``cancellation-check`` comes with the run config: on its word alone a niss client sends only its probe.

    Never its noiseless update; a node whose operator allows the diagnostic sends it and charges that round's
    upload as un-noised.
    """
    from protocols.wire.ledger import SpentReport
    from protocols.wire.niss import DIAGNOSTICS_ENV, Diagnostic

    monkeypatch.delenv(DIAGNOSTICS_ENV, raising=False)
    if allowed:
        monkeypatch.setenv(DIAGNOSTICS_ENV, "1")
    n = 4
    raw = {**app_defaults(), "method": "niss", "num-clients": n, "cancellation-check": True}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NissStrategy(cfg)
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    replies = list(grid.send_and_receive(msgs))
    assert replies and not any(r.has_error() for r in replies)
    for r in replies:
        spent = SpentReport.from_metrics(r.content["metrics"]).epsilon
        assert (Diagnostic.from_content(r.content) is not None) == allowed
        assert np.isfinite(spent) != allowed  # the diagnostic round is charged as un-noised
        assert "probe" in " ".join(r.content["metrics"].keys())  # the cancellation probe is sent either way


def test_nadp_record_ldp_refuses_a_round_outside_its_public_schedule():
    """A server asking a record-ldp client in every round gets refusals outside its public schedule.

    Its noise is calibrated for the most rounds the schedule samples any client in; with plans that meet its floor
    the client still trains only in its own rounds, and its ledger stays within the run's epsilon.
    """
    import copy

    from protocols.schedule import roster_participations
    from protocols.wire.common import TrainIns
    from protocols.wire.ledger import SpentReport

    n, rounds = 10, 10
    raw = {**app_defaults(), "method": "nadp", "nadp-variant": "record-ldp", "num-clients": n, "sample-rate": 0.2,
           "num-rounds": rounds, "epsilon": 1.0, "hidden": "", "local-epochs": 1, "batch-size": 1000}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NadpStrategy(cfg)
    template = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))[0]
    node = grid.node_ids[0]
    env = ClientEnv.from_context(grid.contexts[node])
    roster, name = node_identity(env).roster, node_identity(env).name
    releases = roster_releases(cfg, roster)
    plan0 = NadpPlan.from_config(template.content["config"])
    sizes = {**plan0.sizes, node: len(env.y)}
    ids = tuple(sorted(sizes))
    stds = {i: nadp_floor(cfg, sizes, i, None, 1.0, releases).ldp_std for i in ids}
    accepted, spent = 0, 0.0
    for rnd in range(1, rounds + 1):
        content = copy.deepcopy(template.content)
        content["config"].update({**TrainIns(rnd).to_config(),
                                  **NadpPlan("record-ldp", ids, sizes, 0.0, 0.0, 1.0, stds).to_config()})
        rep = grid.send_and_receive([Message(content, node, "train")])[0]
        if rep.has_error():
            assert "public sample" in rep.error.reason, rep.error.reason
        else:
            accepted += 1
            spent = SpentReport.from_metrics(rep.content["metrics"]).epsilon
    assert accepted == roster_participations(cfg, roster, 1, rounds)[name] < rounds
    assert spent <= cfg.epsilon * (1 + 1e-9)


def test_a_node_policy_refuses_any_release_without_a_guarantee(monkeypatch):
    """A node asking for a guarantee (``max-epsilon-per-run``) refuses a round whose upload would leave it none.

    Whatever made it so: here the noiseless-update diagnostic its process allows; ladp's bare layers alike.
    """
    from protocols.wire.niss import DIAGNOSTICS_ENV

    monkeypatch.setenv(DIAGNOSTICS_ENV, "1")
    n = 4
    raw = {**app_defaults(), "method": "niss", "num-clients": n, "cancellation-check": True}
    cfg = RunConfig.from_mapping(raw)
    grid = LocalGrid(client_app, n, raw, node_config={"max-epsilon-per-run": 1.0})
    msgs = list(NissStrategy(cfg).configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    replies = list(grid.send_and_receive(msgs))
    assert replies and all(r.has_error() and "'finite'" in r.error.reason for r in replies)
