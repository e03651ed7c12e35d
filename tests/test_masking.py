"""Double masking of the pairwise uploads (protocols/masking.py, client/recovery.py, strategies/recovery.py).

* Shamir t-of-n (protocols/secret_sharing.py): any t shares give the seed, t - 1 do not;
* the self-mask comes off exactly: the nadp aggregate equals the survivors' ``w_i + n_i / p_i`` (1e-9),
  driven through the real clients;
* recovery lie against the real clients: a server that holds client k's upload and tells every neighbour of
  k "k dropped" gets k's pair seeds but no share of k's self-mask; what it can strip leaves at least k's
  floor upload noise (and the same attack without double masking leaves far less: the test can fail);
  (the lying server collects the neighbours' signatures of its one outcome first, :mod:`tests.consistency_setup`;
  the split lie is in ``tests/test_consistency.py``);
* the per-peer rule: after revealing one kind of material of a peer, a client refuses the other;
* a second dropout during recovery (a survivor silent in the unmasking phase) does not fail the round:
  its self-mask is rebuilt from t shares and its pair noise with the dropped stays as extra noise.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from client.app import app as client_app
from client.env import ClientEnv
from client.methods import nadp as nadp_client
from client.records import to_record
from client.recovery import RecoveryStore
from protocols.arrays import flatten
from protocols.config import RunConfig
from protocols.masking import mask_parameters, mask_threshold, rebuild_seed, unmaskable
from protocols.pairwise import pairwise_noise
from protocols.prg import gaussian
from protocols.secret_sharing import shamir_combine, shamir_split
from protocols.task.models import build_model, get_weights
from protocols.wire.arrays import from_record
from protocols.wire.recovery import SELF_MASK_RECORD, RecoveryReply, SelfMaskShares
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.nadp import NadpStrategy
from strategies.stages import close_round
from tests.consistency_setup import recover, sign, signed

#: The niss attacks measure what is left against the nodes' noiseless-update diagnostic.
pytestmark = pytest.mark.usefixtures("niss_diagnostics")

NADP_FAST = {"local-epochs": 1, "batch-size": 1000, "lr": 4.0, "clip": 1.0, "hidden": ""}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture
def pinned(monkeypatch):
    """Deterministic residual seeds (the test recomputes each client's noise-free part)."""
    used: list[bytes] = []

    def fake() -> bytes:
        used.append(hashlib.sha256(f"residual-{len(used)}".encode()).digest())
        return used[-1]

    monkeypatch.setattr(nadp_client, "residual_seed", fake)
    return used


# ----------------------------------------------------------------------------------- primitives
def test_shamir_any_t_shares_rebuild_and_fewer_do_not():
    secret = os.urandom(32)
    shares = shamir_split(secret, 6, 4)
    for subset in itertools.combinations(shares, 4):
        assert shamir_combine(subset) == secret
    for subset in itertools.combinations(shares, 3):
        with pytest.raises(ValueError):
            shamir_combine(subset)  # too few: the length and tag do not match (odds 2^-64)
    assert shamir_combine(shamir_split(b"\x00\x01", 3, 1)[:1]) == b"\x00\x01"


def test_shamir_mixed_or_too_few_shares_never_pass_as_a_secret():
    """2,000 wrong combinations (a length prefix alone lets about 1 in 500 through): every one is refused."""
    for _ in range(1_000):
        a, b = shamir_split(os.urandom(32), 5, 3), shamir_split(os.urandom(32), 5, 3)
        for wrong in ((a[0], a[1], b[2]), (a[3], a[4])):
            with pytest.raises(ValueError):
                shamir_combine(wrong)


def test_threshold_is_a_majority_beyond_the_colluders():
    for d in range(1, 40):
        for rate in (0.0, 0.1, 0.3):
            t = mask_threshold(d, rate)
            c = -(-int(round(rate * d * 1e9)) // 10**9)
            assert t <= d and (t == d or 2 * t > d + c) and t > min(c, d - 1)
    p = mask_parameters(20, 0.1, 0.1)
    assert p.threshold == 12 and 0 < p.p_exposed < 1e-6 and 0 < p.p_unrecoverable < 1e-2
    # a node with fewer than t aggregated neighbours is left out, and that may leave a neighbour short too
    graph = {1: [2, 3], 2: [1, 3], 3: [1, 2, 4], 4: [3]}
    assert unmaskable(graph, {1, 2, 3, 4}, dict.fromkeys(graph, 1)) == {1, 2, 3, 4}
    assert unmaskable(graph, {1, 3, 4}, {1: 2, 2: 2, 3: 2, 4: 1}) == set()


def test_the_self_mask_line_is_a_detail_unless_the_colluders_reach_the_threshold(monkeypatch):
    """Flower's log gets it once per run: DEBUG by default, INFO with --verbose, WARNING when t <= c."""
    logged: list[int] = []
    monkeypatch.setattr("strategies.recovery.log", lambda level, *args: logged.append(level))
    cfg = RunConfig.from_mapping({**app_defaults(), "method": "nadp", "num-clients": 10})
    complete = {n: [m for m in range(10) if m != n] for n in range(10)}
    quiet, verbose, sparse = NadpStrategy(cfg), NadpStrategy(cfg), NadpStrategy(cfg)
    verbose.verbose = True
    quiet.announce_masking(complete)
    quiet.announce_masking(complete)
    verbose.announce_masking(complete)
    sparse.announce_masking({0: [1], 1: [0]})  # one neighbour: t <= c = 1
    assert logged == [logging.DEBUG, logging.INFO, logging.WARNING]
    assert not mask_parameters(9, 0.1, 0.1).colluders_rebuild and mask_parameters(1, 0.1, 0.1).colluders_rebuild


# ----------------------------------------------------------------------------------- a round of real clients
def _round(n: int, pinned_seeds: list[bytes] | None = None, **extra):
    raw = {**app_defaults(), "method": "nadp", "num-clients": n, **NADP_FAST,
           **{k.replace("_", "-"): v for k, v in extra.items()}}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NadpStrategy(cfg)
    arrays = to_record(get_weights(build_model(cfg.model, (1, 8, 8), 10, cfg.hidden_sizes, cfg.seed)), np.float64)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    return grid, strategy, msgs, replies


def _clean(grid, strategy, msg, seed) -> np.ndarray:
    """``w_i + n_i / p_i`` of the client of ``msg`` (recomputed; pinned residual ``seed``)."""
    node = msg.metadata.dst_node_id
    env = ClientEnv.from_context(grid.contexts[node])
    w = flatten(nadp_client.record_level_training(msg, env)[1])
    st = strategy._state
    return w + gaussian(seed, len(w), st.allocation.residual_std[node]) / st.weights[node]


def _ask(grid, node, received, dropped, forwarded=None, excluded=(), signatures=None) -> RecoveryReply:
    return recover(grid, node, received, dropped, forwarded=forwarded, excluded=excluded, signatures=signatures)


def _forwarded(replies, node, neighbours) -> dict[int, bytes]:
    out = {}
    for x in neighbours[node]:
        if SELF_MASK_RECORD in replies[x].content:
            out[x] = SelfMaskShares.from_config(replies[x].content[SELF_MASK_RECORD]).sealed[node]
    return out


def test_self_masked_aggregate_is_exact(pinned):
    """With 2 of 8 dropped: every kept self-mask is rebuilt and removed, aggregate == survivors' average to 1e-9."""
    grid, strategy, msgs, replies = _round(8)
    gone = {msgs[2].metadata.dst_node_id, msgs[5].metadata.dst_node_id}
    agg = flatten(from_record(close_round(strategy, grid, strategy._state, [r for n, r in replies.items() if n not in gone])[0]))
    st = strategy._state
    expected, weight = np.zeros_like(agg), 0.0
    for msg, seed in zip(msgs, pinned, strict=True):
        node = msg.metadata.dst_node_id
        if node not in gone:
            expected += st.weights[node] * _clean(grid, strategy, msg, seed)
            weight += st.weights[node]
        upload = flatten(from_record(replies[node].content["arrays"]))
        assert SELF_MASK_RECORD in replies[node].content and np.all(np.isfinite(upload))
    expected /= weight
    assert np.linalg.norm(agg - expected) <= 1e-9 * np.linalg.norm(expected)
    report = strategy.round_report()
    assert report["self_masks_removed"] == 6 and report["unmask_silent"] == 0 and report["recovery"] == 1
    assert report["consistency_signatures"] == 6  # the survivors signed the outcome before revealing pair seeds
    assert report["unmask_bytes_per_client"] > 0


def _stripped_noise(grid, strategy, msgs, replies, pinned, target, pair_seeds: dict[int, bytes]) -> np.ndarray:
    """What a server knowing ``target``'s training result and these pair seeds cannot remove from its upload."""
    st = strategy._state
    msg = next(m for m in msgs if m.metadata.dst_node_id == target)
    i = [m.metadata.dst_node_id for m in msgs].index(target)
    env = ClientEnv.from_context(grid.contexts[target])
    w = flatten(nadp_client.record_level_training(msg, env)[1])
    upload = flatten(from_record(replies[target].content["arrays"]))
    stds = st.allocation.counteracting_stds(target)
    pairs = pairwise_noise(target, pair_seeds, len(w), scale={j: stds[j] for j in pair_seeds}) if pair_seeds else 0.0
    left = upload - w - st.plan.lam * pairs / st.weights[target]
    assert pinned[i]  # the residual seed was drawn (the floor compares against the whole upload noise)
    return left


@pytest.mark.parametrize("self_mask", [True, False])
def test_recovery_lie_leaves_the_target_its_floor_noise(pinned, self_mask):
    """The server keeps k's upload and tells every neighbour of k "k dropped"."""
    grid, strategy, msgs, replies = _round(10, self_mask=self_mask)
    st = strategy._state
    graph = st.keys.neighbours
    k = msgs[0].metadata.dst_node_id
    others = [n for n in graph if n != k]
    sigs = signed(sign(grid, others, others, [k]))  # one consistent lie: every survivor signs it
    seeds, shares_of_k = {}, []
    for j in graph[k]:
        rep = _ask(grid, j, others, [k], _forwarded(replies, j, graph) if self_mask else None, signatures=sigs)
        assert not rep.refused and k in rep.peers
        seeds[j] = rep.by_peer()[k]  # the pair seed of (j, k)
        store = RecoveryStore.load(ClientEnv.from_context(grid.contexts[j]))
        assert not self_mask or (k in store.revealed_pair and k not in store.revealed_mask)
        shares_of_k += [s for x, s in zip(rep.mask_peers, rep.mask_shares, strict=True) if x == k]
        # having revealed its pair seed with k, the neighbour refuses k's self-mask share afterwards
        again = _ask(grid, j, list(graph), [], _forwarded(replies, j, graph) if self_mask else None)
        assert again.refused
    left = _stripped_noise(grid, strategy, msgs, replies, pinned, k, seeds)
    floor = st.allocation.uplink_std(k, st.plan.lam)
    assert floor >= st.plan.sigma_up * (1 - 1e-12)
    if self_mask:
        assert shares_of_k == []
        commit = SelfMaskShares.from_config(replies[k].content[SELF_MASK_RECORD]).commitment
        assert rebuild_seed(shares_of_k, mask_threshold(len(graph[k]), 0.1), commit) is None
        # the sample std of n draws has relative sd 1/sqrt(2n): 5 of them below the floor never happens by chance
        assert np.std(left) >= floor * (1 - 5 / np.sqrt(2 * left.size)), (np.std(left), floor)
    else:  # the attack works without double masking: only the residual noise is left
        assert np.std(left) < 0.5 * floor, (np.std(left), floor)


def test_second_dropout_during_recovery_does_not_fail_the_round(pinned):
    """One client drops before uploading, one survivor goes silent in the unmasking phase: the round goes on."""
    grid, strategy, msgs, replies = _round(10)
    st = strategy._state
    ids = [m.metadata.dst_node_id for m in msgs]
    first = ids[3]
    second = next(n for n in st.keys.neighbours[first] if n != ids[0])
    grid.offline.add(second)  # answers the train message, then is gone for the recovery phase
    agg = flatten(from_record(close_round(strategy, grid, strategy._state, [r for n, r in replies.items() if n != first])[0]))
    report = strategy.round_report()
    assert report["unmask_silent"] == 1 and report["self_masks_removed"] == 9 and report["kept_pairs"] == 1
    expected, weight = np.zeros_like(agg), 0.0
    for msg, seed in zip(msgs, pinned, strict=True):
        node = msg.metadata.dst_node_id
        if node != first:
            expected += st.weights[node] * _clean(grid, strategy, msg, seed)
            weight += st.weights[node]
    expected /= weight
    # what is left is the silent survivor's pair noise with the first dropout: lam n_ij, no self-mask
    left = (agg - expected) * weight
    pair_std = st.plan.lam * st.allocation.counteracting_stds(second)[first]
    assert np.std(left) == pytest.approx(pair_std, rel=0.1)


# ----------------------------------------------------------------------------------- mpddp
@pytest.mark.parametrize("self_mask", [True, False])
def test_mpddp_recovery_lie_leaves_the_target_its_upload_noise(self_mask):
    """mpddp, 8 real clients: all of k's neighbours told "k dropped" reveal their Delta seeds with k, no mask share."""
    from protocols.mpddp import (
        clipped_client_gradients,
        delta_variance,
        eta_variance,
        mask_reference,
        one_hot,
        pairwise_delta,
    )
    from protocols.mpddp import flatten as mp_flatten
    from protocols.wire.mpddp import PerturbedModel, upload_from_record
    from strategies.mpddp import MpddpStrategy

    n = 8
    raw = {**app_defaults(), "method": "mpddp", "num-clients": n, "dataset": "digits", "hidden": "16",
           "mpddp-side-dtype": "float64", "self-mask": self_mask}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), MpddpStrategy(cfg)
    arrays = to_record(get_weights(build_model("mlp", (1, 8, 8), 10, cfg.hidden_sizes, cfg.seed)), np.float64)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    st = strategy._state
    graph = st.keys.neighbours
    k = msgs[0].metadata.dst_node_id
    others = [x for x in graph if x != k]
    sigs = signed(sign(grid, others, others, [k]))
    seeds, shares = {}, []
    for j in graph[k]:
        rep = _ask(grid, j, others, [k], _forwarded(replies, j, graph) if self_mask else None, signatures=sigs)
        assert not rep.refused
        seeds[j] = rep.by_peer()[k]
        shares += [s for x, s in zip(rep.mask_peers, rep.mask_shares, strict=True) if x == k]
    env = ClientEnv.from_context(grid.contexts[k])
    received = PerturbedModel.from_record(msgs[0].content["arrays"]).matrices
    w_hat = [torch.from_numpy(m).double() for m in received]
    x = torch.from_numpy(np.asarray(env.x).reshape(len(env.x), -1)).double()
    y = one_hot(torch.from_numpy(np.asarray(env.y)), env.num_classes, torch.float64)
    grad = mp_flatten(clipped_client_gradients(w_hat, x, y, cfg.clip, rho=mask_reference(received[-1]))[0].grads)
    upload = mp_flatten(upload_from_record(replies[k].content["arrays"], len(cfg.hidden_sizes) + 1).grads)
    left = upload - grad - pairwise_delta(grad.size, own_id=k, pair_seeds=seeds, sigma_delta=st.noise.sigma_delta)
    eta_var = eta_variance(st.noise.sigma_eta, cfg.mpddp_eta)
    eta_std = math.sqrt(eta_var)
    upload_std = math.sqrt(eta_var + len(graph[k]) * delta_variance(st.noise.sigma_delta))
    if self_mask:
        assert shares == []
        assert np.std(left) >= 0.95 * upload_std, (np.std(left), upload_std)
    else:  # without double masking only eta is left
        assert np.std(left) == pytest.approx(eta_std, rel=0.1)
        assert eta_std < 0.5 * upload_std


# ----------------------------------------------------------------------------------- niss
def _niss_round(n: int, **extra):
    """One niss round of ``n`` real clients on digits (seed encoding, noiseless updates in the diagnostic record)."""
    from protocols.task.data import dataset_for
    from strategies.niss import NissStrategy

    raw = {**app_defaults(), "method": "niss", "num-clients": n, "niss-share-encoding": "seed",
           "cancellation-check": True, **{k.replace("_", "-"): v for k, v in extra.items()}}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    grid, strategy = LocalGrid(client_app, n, raw), NissStrategy(cfg)
    arrays = to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)),
                       np.float64)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    return grid, strategy, msgs, replies


def _niss_clean(reply) -> np.ndarray:
    """``p_k w_k`` of a niss reply (the cancellation-check diagnostic record)."""
    from protocols.wire.niss import Diagnostic

    return flatten(from_record(Diagnostic.from_content(reply.content).update))


@pytest.mark.parametrize(("self_mask", "tau"), [(True, 0.0), (False, 0.0), (True, -1.0), (False, -1.0)])
def test_niss_recovery_lie_leaves_the_target_its_floor_noise(self_mask, tau):
    """niss, 10 real clients: the server keeps k's upload and tells every neighbour of k "k dropped".

    Each reveals its shares to k and k's shares to it (k's whole own noise).  With double masking no
    neighbour gives a share of k's self-mask (std sigma_k), so at least sigma_k stays; without it the server
    is left with only k's distortion of the shares it received (nothing at tau = 0: the exact update).
    ``tau = -1``: the default (``client_tau`` of the round's sizes).
    """
    from protocols.niss import ShareBundle, bundle_shares
    from protocols.wire.niss import NissMetrics
    from protocols.wire.recovery import NissPairMaterial

    grid, strategy, msgs, replies = _niss_round(10, self_mask=self_mask, niss_tau=tau)
    graph = strategy._state.keys.neighbours
    k = msgs[0].metadata.dst_node_id
    upload = flatten(from_record(replies[k].content["arrays"]))
    size = upload.size
    assert size >= 500  # the linear model on digits (650 coordinates): the std bounds below are many sds wide
    others = [x for x in graph if x != k]
    sigs = signed(sign(grid, others, others, [k]))
    stripped, shares_of_k = np.zeros(size), []
    for j in graph[k]:
        rep = _ask(grid, j, others, [k], _forwarded(replies, j, graph) if self_mask else None, signatures=sigs)
        assert not rep.refused and k in rep.peers
        m = NissPairMaterial.from_bytes(rep.by_peer()[k], size)
        stripped += bundle_shares(ShareBundle(k, j, m.in_count, m.in_std, m.in_seed), size).sum(axis=0)  # k's own
        stripped -= bundle_shares(ShareBundle(j, k, m.out_count, m.out_std, m.out_seed), size).sum(axis=0)  # to k
        shares_of_k += [s for x, s in zip(rep.mask_peers, rep.mask_shares, strict=True) if x == k]
        if self_mask:  # having revealed its pair material with k, the neighbour refuses k's self-mask share
            assert _ask(grid, j, list(graph), [], _forwarded(replies, j, graph)).refused
    left = upload - _niss_clean(replies[k]) - stripped
    floor = NissMetrics.from_metrics(replies[k].content["metrics"]).sigma
    assert floor > 0
    if self_mask:
        assert shares_of_k == []
        commit = SelfMaskShares.from_config(replies[k].content[SELF_MASK_RECORD]).commitment
        assert rebuild_seed(shares_of_k, mask_threshold(len(graph[k]), 0.1), commit) is None
        # the self-mask alone has std floor: over the model's 650 coordinates the sample std is within ~3 % of it
        assert np.std(left) >= 0.85 * floor, (np.std(left), floor)
    else:  # the attack works without double masking
        assert SELF_MASK_RECORD not in replies[k].content
        assert np.std(left) < 0.5 * floor, (np.std(left), floor)
        if tau == 0.0:
            assert np.linalg.norm(left) <= 1e-9 * np.linalg.norm(upload)  # the exact update p_k w_k


@pytest.mark.parametrize("second", [False, True])
def test_niss_dropouts_with_self_masks_cancel_and_a_second_dropout_does_not_fail_the_round(second):
    """niss, 10 real clients, tau = 0: one drops before uploading, with ``second`` a neighbour of it goes silent too.

    The second one answered the train message and is gone in the unmasking phase.  The round completes; the
    aggregate is the survivors' noiseless sum to 1e-9, plus, with ``second``, exactly the silent survivor's pair
    noise with the first dropout (kept as extra noise).
    """
    from protocols.wire.recovery import NissPairMaterial
    from strategies.niss import pair_contribution

    grid, strategy, msgs, replies = _niss_round(10, niss_tau=0.0)
    st = strategy._state
    ids = [m.metadata.dst_node_id for m in msgs]
    first = ids[3]
    silent = next(n for n in st.keys.neighbours[first] if n != ids[0])
    if second:
        grid.offline.add(silent)  # answered the train message, then gone for the unmasking phase
    agg = flatten(from_record(close_round(strategy, grid, strategy._state, [r for n, r in replies.items() if n != first])[0]))
    report = strategy.round_report()
    assert report["self_masks_removed"] == 9 and report["unmask_silent"] == int(second)
    assert report["kept_pairs"] == int(second) and report["recovery"] == 1
    assert report["consistency_signatures"] == 9 - int(second)
    survivors = [n for n in ids if n != first]
    kept_weight = math.fsum(st.weights[n] for n in survivors)
    expected = np.sum([_niss_clean(replies[n]) for n in survivors], axis=0)
    if second:  # the silent survivor's own share to `first` and the negated share received from it stay
        store = RecoveryStore.load(ClientEnv.from_context(grid.contexts[silent]))
        m = NissPairMaterial.from_bytes(store.material[first], agg.size)
        extra = pair_contribution(m, silent, first, agg.size, 0.0)
        assert np.linalg.norm(extra) > 1e-3 * np.linalg.norm(expected)
        expected += extra
    else:
        assert report["cancellation_residual"] <= 1e-9
    assert np.linalg.norm(agg * kept_weight - expected) <= 1e-9 * np.linalg.norm(expected)
