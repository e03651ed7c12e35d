"""A malicious server that shows clients different views of one round, driving the real client code.

* nadp: each client gets its own plan, with the peers' sizes (or the noise scale) changed so that every plan still
  meets that client's floor.  The two ends of a pair would draw the same noise at different stds, and the server
  could weight the uploads to cancel one client's pair noise alone.  The sizes and the scale are bound into the
  pair seeds, so the two ends derive no common noise.
* niss: leaving a client's honest neighbours out of a round does not shrink the coalition its floor counts.
* niss: after the uploads, a share request for the same round with a smaller view would shrink the present
  neighbour count a revealer counts signatures against (so that a split "k dropped" outcome passes).  A share
  request for a round already trained in is refused and the round's view stays the one the upload used.
* mpddp: each client gets its own size list (the others inflated) and the scales for it, with one common
  sigma_Delta; the sizes and scales are bound into the pair seeds, so the Deltas do not cancel.
* mpddp on an n-out graph: a server that keeps a subset of the sample and sends the scales for the whole sample is
  refused: the client's floor is for the participants the message lists.
* mpddp: a train message whose view is refused leaves the client's ledger untouched.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from client.app import app as client_app
from client.env import ClientEnv
from client.identity import node_identity
from client.ledger import ClientLedger, ledger_dir
from client.methods.niss import handle_shares
from client.pairwise_phase import participants_of
from client.records import to_record
from client.recovery import RecoveryStore
from protocols.config import RunConfig
from protocols.floor import FloorViolation, mpddp_floor, nadp_floor, niss_floor
from protocols.graphs import roster_round_of
from protocols.masking import mask_threshold, signatures_needed
from protocols.niss import aggregation_weights, client_tau
from protocols.schedule import roster_releases
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.keys import PeerKeys
from protocols.wire.mpddp import DdpNoise
from protocols.wire.nadp import NadpPlan
from protocols.wire.niss import ShareRequest
from protocols.wire.recovery import SELF_MASK_RECORD, SelfMaskShares
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.key_phase import probe_residual
from strategies.mpddp import MpddpStrategy
from strategies.nadp import NadpStrategy
from strategies.niss import NissStrategy
from strategies.validation import RoundFailed
from tests.consistency_setup import recover, sign, signed


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class _Recording(LocalGrid):
    """LocalGrid that keeps every message it delivered (``sent``) and every reply (``received``)."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent = [*getattr(self, "sent", []), *messages]
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.received = [*getattr(self, "received", []), *replies]
        return replies


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
        # too few signed "k dropped": k's pair material stays secret (named kept, nothing of it revealed)
        assert not rep.refused and rep.kept == (k,) and rep.by_peer()[k] == b"", rep


def test_niss_share_request_whose_scale_overflows_the_noise_variance_is_refused_before_any_share():
    """A ``niss-noise-scale`` far above the floor (1.4e160): each client's noise std would square to infinity.

    Every client refuses the share request with a reason naming the key, sends no share and charges nothing (the
    round fails for lack of clients).  Without the check the shares were made and sent, and each client's train
    failed later.
    """
    n = 5
    raw = {**app_defaults(), "method": "niss", "num-clients": n, "dataset": "digits"}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = _Recording(client_app, n, raw), NissStrategy(cfg)
    strategy.noise_scale = 1e160
    with pytest.raises(RoundFailed, match="share exchange"):
        list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    shares = [r for r in grid.received if r.metadata.message_type == "query.shares"]
    assert len(shares) == n
    assert all(r.has_error() and "niss-noise-scale" in r.error.reason for r in shares)
    assert all(_ledger_rounds(grid, node) == [] for node in grid.node_ids)


def test_niss_leaving_honest_neighbours_out_does_not_shrink_the_coalition_a_client_is_protected_against():
    """niss-rho covers floor(rho * d) colluders of a client's d roster neighbours, however many are present.

    A server that keeps only three colluders present (the present floor allows it) and offers the scale rho
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
    keep = {k, *pk.peer_ids[:3]}  # k and three of its nine neighbours: the server's colluders
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
    """``cancellation-check`` comes with the run config: on its word alone a niss client sends no diagnostic.

    Neither its noiseless update nor its probe (the projection of its upload's noise on the round's public
    direction: with ``self-mask = false`` the upload's projection less the probe is ``p_k <d, w_k>`` exactly); a
    node whose operator allows the diagnostics sends them and charges that round's upload as un-noised.
    """
    from protocols.arrays import flatten
    from protocols.prg import gaussian
    from protocols.wire.arrays import from_record
    from protocols.wire.keys import MaskProbe, probe_value
    from protocols.wire.ledger import SpentReport
    from protocols.wire.niss import DIAGNOSTICS_ENV, Diagnostic

    monkeypatch.delenv(DIAGNOSTICS_ENV, raising=False)
    if allowed:
        monkeypatch.setenv(DIAGNOSTICS_ENV, "1")
    n = 4
    raw = {**app_defaults(), "method": "niss", "num-clients": n, "cancellation-check": True, "self-mask": False}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NissStrategy(cfg)
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    replies = list(grid.send_and_receive(msgs))
    assert replies and not any(r.has_error() for r in replies)
    for msg, r in zip(msgs, replies, strict=True):
        spent = SpentReport.from_metrics(r.content["metrics"]).epsilon
        assert (Diagnostic.from_content(r.content) is not None) == allowed
        assert np.isfinite(spent) != allowed  # the diagnostic round is charged as un-noised
        probe = probe_value(r.content["metrics"])
        assert (probe is not None) == allowed
        if allowed:  # what the probe strips: the noise along its direction, to the last bit of round-off
            d = gaussian(MaskProbe.from_config(msg.content["config"]).seed, len(flatten(from_record(r.content["arrays"]))))
            clean = flatten(from_record(Diagnostic.from_content(r.content).update))
            assert np.dot(d, flatten(from_record(r.content["arrays"]))) - probe == pytest.approx(np.dot(d, clean), rel=1e-9)


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


def _ledger_rounds(grid: LocalGrid, node: int) -> list[int]:
    ctx = grid.contexts[node]
    with ClientLedger.open(ledger_dir(ctx.node_config), ctx.node_config["partition-id"], write=False) as led:
        return list(led.rounds(ctx.run_id))


@pytest.mark.parametrize("split", ["none", "sizes"])
def test_mpddp_clients_shown_different_sizes_share_no_pair_noise(split):
    """Each client sees its own size true and the others' at least the largest, and the scales for that list.

    Its eta is then calibrated for its own record sensitivity, not the smallest participant's; one common
    sigma_Delta would keep the Deltas cancelling.  Bound into the pair seeds, the lists leave no pair shared.
    """
    k_clients = 4
    raw = {**app_defaults(), "method": "mpddp", "num-clients": k_clients, "num-rounds": 1, "hidden": "16",
           "partitioning": "size-skew", "cancellation-check": True, "mask-corruption-rate": 0.0}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, k_clients, raw), MpddpStrategy(cfg)
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    parts = PeerKeys.from_config(msgs[0].content["config"]).participants
    true = dict(zip(parts, DdpNoise.from_config(msgs[0].content["config"]).sizes, strict=True))
    assert len(set(true.values())) > 1
    big = max(true.values())
    views = {j: tuple(true[p] if split == "none" or p == j else big for p in parts) for j in parts}
    releases = roster_releases(cfg, node_identity(ClientEnv.from_context(grid.contexts[parts[0]])).roster)
    floors = {j: mpddp_floor(cfg, k_clients, min(views[j]), releases=releases) for j in parts}
    common_delta = max(f[1] for f in floors.values())
    for msg in msgs:  # every plan meets its own client's floor
        j = msg.metadata.dst_node_id
        msg.content["config"].update(DdpNoise(floors[j][0], common_delta, views[j]).to_config())
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    assert not any(r.has_error() for r in replies.values()), [r.error.reason for r in replies.values() if r.has_error()]
    seeds = {m: RecoveryStore.load(ClientEnv.from_context(grid.contexts[m])).material for m in parts}
    shared = [seeds[a][b] == seeds[b][a] for a in parts for b in seeds[a]]
    residual = probe_residual(replies.values())
    if split == "none":
        assert all(shared) and residual < 1e-9  # one view: the Deltas cancel
    else:
        assert shared and not any(shared) and residual > 1e-3  # no Delta the server could count on cancelling


def test_mpddp_n_out_floor_is_for_the_participants_listed():
    """Theorem 11's scales grow as K shrinks and need K above a minimum (81 of 100 here).

    A server that keeps 81 of the 100 sampled clients with the K = 100 scales is refused (the floor for K = 81
    is higher), and so is one that keeps 30 (outside the theorem); the scales for K = 81 are accepted.
    """
    n, n_out = 100, 68
    raw = {**app_defaults(), "method": "mpddp", "num-clients": n, "num-rounds": 1, "epsilon": 1.0, "delta": 1e-5,
           "graph": "n-out", "n-out": n_out, "hidden": "16", "dataset": "digits"}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), MpddpStrategy(cfg)
    msgs = {m.metadata.dst_node_id: m
            for m in strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid)}
    kr = strategy._state.keys
    full = DdpNoise.from_config(next(iter(msgs.values())).content["config"])
    assert len(kr.participants) == n
    names = {x: kr.signed_by[x][0] for x in kr.participants}

    def dense_subset(size: int) -> list[int]:  # keeps every member above its present floor
        keep = set(kr.participants)
        while len(keep) > size:
            kept = {names[x] for x in keep}
            degree = {x: sum(m in kept for m in kr.roster_round.neighbours(names[x])) for x in keep}
            keep.remove(min(keep, key=lambda x: (degree[x], x)))
        return sorted(keep)

    def send(size: int, noise_for: int) -> list[Message]:
        sub = strategy.keys.regraph(kr, dense_subset(size))
        assert len(sub.participants) == size
        sizes = tuple(int(kr.num_examples[x]) for x in sub.participants)
        se, sd, _ = mpddp_floor(cfg, noise_for, min(sizes), releases=strategy.keys.releases())
        out = []
        for x in sub.participants[:3]:
            conf = ConfigRecord({**msgs[x].content["config"], **sub.peer_keys(x).to_config(),
                                 **DdpNoise(se, sd, sizes).to_config()})
            out.append(Message(RecordDict({"arrays": msgs[x].content["arrays"], "config": conf}), x, "train"))
        return list(grid.send_and_receive(out))

    assert mpddp_floor(cfg, n, min(full.sizes), releases=strategy.keys.releases())[0] == pytest.approx(full.sigma_eta)
    for size, why in ((81, "mpddp-sigma-eta"), (30, "participants")):
        replies = send(size, noise_for=n)
        assert replies and all(r.has_error() and why in r.error.reason for r in replies), \
            [r.error.reason[:200] if r.has_error() else "accepted" for r in replies]
        assert not any(_ledger_rounds(grid, r.metadata.src_node_id) for r in replies)
    replies = send(81, noise_for=81)
    assert not any(r.has_error() for r in replies), [r.error.reason[:200] for r in replies if r.has_error()]


def test_mpddp_a_refused_view_does_not_spend_the_round():
    """A train message with a graph seed of the server's choosing is refused before the ledger records the round."""
    k_clients = 3
    raw = {**app_defaults(), "method": "mpddp", "num-clients": k_clients, "num-rounds": 2, "hidden": "16",
           "mask-corruption-rate": 0.0}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, k_clients, raw), MpddpStrategy(cfg)
    msg = next(iter(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid)))
    node = msg.metadata.dst_node_id
    pk = PeerKeys.from_config(msg.content["config"])
    msg.content["config"].update(dataclasses.replace(pk, graph_seed=bytes(32)).to_config())
    rep = grid.send_and_receive([msg])[0]
    assert rep.has_error() and "graph seed" in rep.error.reason
    assert _ledger_rounds(grid, node) == []
    again = [m for m in strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid)
             if m.metadata.dst_node_id == node]
    rep = grid.send_and_receive(again)[0]
    assert not rep.has_error(), rep.error.reason
    assert _ledger_rounds(grid, node) == [1]


def test_an_excluded_client_reveals_no_pair_material_of_its_own():
    """A client told it is excluded answers with its neighbours' self-mask shares at most, never its pair material.

    Sparse graph (nadp, n-out 2, 14 clients): the server rebuilds k's self-mask from its neighbours ("everyone
    received"), then tells k itself it is excluded and its neighbours dropped, an outcome k's non-neighbours sign.
    Its pair noise stays in the upload the server holds.
    """
    from protocols.masking import rebuild_seed

    n = 14
    raw = {**app_defaults(), "method": "nadp", "num-clients": n, "local-epochs": 1, "batch-size": 1000, "lr": 4.0,
           "clip": 1.0, "hidden": "", "graph": "n-out", "n-out": 2}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NadpStrategy(cfg)
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    assert not any(r.has_error() for r in replies.values())
    graph = {v: sorted(nbrs) for v, nbrs in strategy._state.keys.neighbours.items()}
    nodes, rate = sorted(graph), cfg.mask_corruption_rate

    def signable(k: int) -> bool:  # every neighbour of k has enough signers outside k's neighbourhood
        outside = set(nodes) - set(graph[k])
        return all(len(outside & set(graph[j])) >= signatures_needed(len(graph[j]), len(graph[j]), rate)
                   for j in graph[k])

    k = next(v for v in nodes if signable(v))
    near = graph[k]

    def forwarded(node: int) -> dict:
        return {x: SelfMaskShares.from_config(replies[x].content[SELF_MASK_RECORD]).sealed[node] for x in graph[node]}

    shares = []
    for j in near:  # outcome 1, to k's neighbours: everyone received
        rep = recover(grid, j, nodes, [], forwarded=forwarded(j))
        assert not rep.refused, rep.refused
        shares += [s for x, s in zip(rep.mask_peers, rep.mask_shares, strict=True) if x == k]
    commitment = SelfMaskShares.from_config(replies[k].content[SELF_MASK_RECORD]).commitment
    assert rebuild_seed(shares, mask_threshold(len(near), rate), commitment) is not None
    received = [v for v in nodes if v not in near]  # outcome 2: k excluded, its neighbours dropped
    sigs = signed(sign(grid, received, received, near, [k]))
    rep = recover(grid, k, received, near, excluded=[k], forwarded=forwarded(k), signatures=sigs)
    assert not rep.refused and rep.peers == () and rep.material == (), rep  # no pair seed of its own goes out


@pytest.mark.parametrize("allowed", [False, True])
def test_a_node_asking_for_a_guarantee_sends_no_noise_probe_nor_noiseless_metrics(monkeypatch, tmp_path, allowed):
    """A node with a policy sends no noise probe unless its operator allows it, and no noiseless training metrics.

    nadp with ``cancellation-check`` from the run config: the probe's projection strips the pair noise along the
    public direction; the training loss and clipped fraction are noiseless statistics of the node's data.  A node
    without a policy sends both.
    """
    from protocols.wire.common import PEAK_RSS_MB
    from protocols.wire.keys import probe_value
    from protocols.wire.niss import DIAGNOSTICS_ENV

    monkeypatch.delenv(DIAGNOSTICS_ENV, raising=False)
    if allowed:
        monkeypatch.setenv(DIAGNOSTICS_ENV, "1")
    n = 4
    raw = {**app_defaults(), "method": "nadp", "num-clients": n, "cancellation-check": True, "hidden": "",
           "local-epochs": 1, "batch-size": 1000, "train-subset": 400}
    cfg = RunConfig.from_mapping(raw)
    for policy in ({}, {"ledger-dir": str(tmp_path), "lifetime-epsilon": 50.0}):
        grid, strategy = LocalGrid(client_app, n, raw, node_config=policy), NadpStrategy(cfg)
        msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
        replies = list(grid.send_and_receive(msgs))
        assert replies and not any(r.has_error() for r in replies)
        for r in replies:
            metrics = r.content["metrics"]
            assert (probe_value(metrics) is not None) == (not policy or allowed)
            assert ("train_loss" in metrics and "clipped_fraction" in metrics) == (not policy)
            assert (PEAK_RSS_MB in metrics) == (not policy)  # a process's peak memory on the node's data
