"""Dropout recovery of the pairwise noise (strategies/recovery.py, client/recovery.py).

* acceptance: in-process, run-config ``fault-drop-rate = 0.2`` (2 of the 10 sampled clients drop after the
  key / share phase every round): nadp, niss and mpddp finish every round with the cancellation residual
  <= 1e-9 relative, and the accountant is charged with the noise really left (the run's budget guard,
  :mod:`strategies.run.budget`, is off where a test needs every round of an over-charged run:
  tests/test_budget_cap.py tests it);
* exactness through the real client code: the recovered nadp aggregate equals the survivors' weighted
  average of ``w_i + n_i / p_i`` (pinned residual seeds);
* a lying server (an outside caller driving the real client handler) gets refusals: a peer named both
  received and dropped, a peer reported received earlier and dropped now, an own upload left out;
* a survivor whose every neighbour holding its noise dropped keeps that noise instead of revealing it;
* messages round-trip; the fault injection is deterministic from (seed, round).
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from client.app import app as client_app
from client.env import ClientEnv
from client.methods import nadp as nadp_client
from client.records import to_record
from client.recovery import RecoveryStore, answer, check_request
from protocols.arrays import flatten
from protocols.config import ConfigError, RunConfig
from protocols.prg import gaussian
from protocols.wire.arrays import from_record
from protocols.wire.recovery import NissPairMaterial, RecoveryReply, RecoveryRequest
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.nadp import NadpStrategy
from strategies.run.faults import fault_drops
from strategies.stages import close_round
from tests.consistency_setup import recover, sign, signed

#: nadp: one full-batch step per round on a linear model (its paper's regime, fast).
NADP_FAST = {"local-epochs": 1, "batch-size": 1000, "lr": 4.0, "clip": 1.0, "hidden": ""}
#: niss: tau = 0 (the shares cancel exactly, so the residual is measurable), one share per neighbour.
NISS_EXACT = {"niss-tau": 0.0, "local-epochs": 1}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture
def no_budget_guard(monkeypatch):
    """Every round runs as calibrated, even when dropouts made the earlier ones cost more (no stop, no raise)."""
    from strategies.run.budget import BudgetGuard

    monkeypatch.setattr(BudgetGuard, "before_round", lambda self, rnd: None)


# ----------------------------------------------------------------------------------- acceptance
#: Accuracy tolerance of a run with dropouts against the same run without (fresh DP noise each run): about 3 sd of
#: the difference of two runs' final accuracies at these settings (README, "Dropout recovery").
ACCURACY_TOLERANCE = {"nadp": 0.12, "niss": 0.08, "mpddp": 0.1}


@pytest.mark.parametrize(("method", "extra"), [("nadp", {**NADP_FAST, "epsilon": 8.0}), ("niss", NISS_EXACT),
                                               ("mpddp", {"dataset": "breast-cancer", "hidden": "16", "epsilon": 32.0,
                                                          # the regime's Adam step, 10 rounds: 3 plain-SGD rounds at
                                                          # xi 1.0 oscillated (0.64 vs 0.95 seen)
                                                          "num-rounds": 10})])
def test_twenty_percent_dropping_every_round_is_recovered_exactly(run_inprocess, tmp_path, method, extra,
                                                                   no_budget_guard, request):
    if method == "niss":
        request.getfixturevalue("niss_diagnostics")  # the niss residual is measured from its clients' diagnostic probes
    common = {"method": method, "num_clients": 10, "num_rounds": 3, "seed": 7,
              **{k.replace("-", "_"): v for k, v in extra.items()}}
    plain, _ = run_inprocess(out_dir=str(tmp_path / "plain"), **common)
    summary, rows = run_inprocess(cancellation_check=True, fault_drop_rate=0.2, **common)
    assert len(rows) == common["num_rounds"]
    for r in rows:
        assert not r["failed"]
        assert r["dropped"] == 2 and r["recovery"] == 1 and r["recovered_pairs"] > 0
        assert r["consistency_signatures"] == 8  # every survivor signed the round's outcome
        assert r["cancellation_residual"] <= 1e-9, r["cancellation_residual"]
        assert r.get("uncancelled_noise_norm", 0.0) == 0.0 and r.get("kept_pairs", 0) == 0
        assert r["recovery_bytes_per_survivor"] > 0
    assert summary["failed_rounds"] == []
    # niss-tau = 0 (exact cancellation, to measure the residual): the uploads' sum is noiseless, no guarantee
    assert summary["epsilon"] is None if method == "niss" else math.isfinite(summary["epsilon"])
    gap = abs(summary["final_accuracy"] - plain["final_accuracy"])
    assert gap <= ACCURACY_TOLERANCE[method], (summary["final_accuracy"], plain["final_accuracy"])
    print(method, "accuracy with dropouts", summary["final_accuracy"], "without", plain["final_accuracy"])


def test_recovery_charges_the_accountant_with_the_noise_left(run_inprocess, no_budget_guard):
    """Same seed with and without dropouts: the survivors' joint view keeps less noise, so epsilon is larger.

    Default tau (tau = 0 has no uplink guarantee to charge): the account stage recomputes the joint-view factors
    over the survivors (protocols.niss_joint.survivor_factors).
    """
    common = {"num_clients": 10, "num_rounds": 2, "seed": 3, "local_epochs": 1}
    plain, _ = run_inprocess(method="niss", fault_drop_rate=0.0, **common)
    dropped, rows = run_inprocess(method="niss", fault_drop_rate=0.2, **common)
    assert dropped["epsilon"] > plain["epsilon"] * 1.01
    assert all(r["uplink_noise_multiplier_after_recovery"] < plain["method_parameters"]["noise_multiplier"]
               for r in rows)


def test_mpddp_recovery_charges_exactly_the_survivors_theta(run_inprocess, no_budget_guard):
    """Record-level mpddp, 2 of 10 dropping every round: the survivors' Theorem 10 theta is 10/8 of the plan's.

    Gaussian RDP is additive in 1/z^2, so the run must report exactly the epsilon of ``num-rounds`` releases at
    multiplier z sqrt(8/10).  (A theta computed from the absolute sigmas, while the plan's is per unit
    sensitivity, would charge a record-level run theta / sens^2: epsilon ~8 here instead of 1.2.)
    """
    from protocols.privacy import GaussianEvent, RdpAccountant

    summary, rows = run_inprocess(method="mpddp", num_clients=10, num_rounds=3, seed=5, epsilon=1.0,
                                  fault_drop_rate=0.2)
    assert all(r["dropped"] == 2 and r["recovery"] == 1 for r in rows)
    z = summary["method_parameters"]["noise_multiplier"]
    theta = summary["method_parameters"]["theta_round"]
    assert all(r["theta_after_recovery"] == pytest.approx(theta * 10 / 8, rel=1e-9) for r in rows)
    expected = RdpAccountant([GaussianEvent(z * math.sqrt(8 / 10), 1.0, 3)]).epsilon(summary["config"]["delta"])
    assert summary["epsilon"] == pytest.approx(expected, rel=1e-6)
    assert 1.0 < summary["epsilon"] < 1.3
    assert summary["privacy"]["over_target"] is True


def test_a_run_that_ends_above_its_epsilon_target_says_so(tmp_path, no_budget_guard):
    """A run the budget guard does not hold (here: turned off) may end above its target: it warns and records it."""
    from server.launch import run_inprocess

    common = {"method": "mpddp", "num-clients": 10, "num-rounds": 2, "seed": 5, "epsilon": 1.0}
    lines: list[str] = []
    plain = run_inprocess({**common, "out-dir": str(tmp_path / "plain")}, progress=lines.append)
    assert plain["epsilon"] <= 1.0 and plain["privacy"]["over_target"] is False
    assert not any("above the run's target" in s for s in lines)
    dropped = run_inprocess({**common, "fault-drop-rate": 0.2, "out-dir": str(tmp_path / "dropped")},
                            progress=lines.append)
    assert dropped["epsilon"] > 1.0 and dropped["privacy"]["over_target"] is True
    warnings = [s for s in lines if "above the run's target 1" in s]
    assert len(warnings) == 1 and warnings[0].startswith("warning: round ")  # once, at the round it happened
    assert "ended above its epsilon target" in (tmp_path / "dropped" / "report.md").read_text()
    assert "ended above its epsilon target" not in (tmp_path / "plain" / "report.md").read_text()


def test_a_round_with_no_unmaskable_upload_names_the_key_that_sets_the_threshold(tmp_path, unplanned_dropouts):
    """More than half of every client's neighbours dropped: the failure says what t needs and which key sets it.

    The dropouts are real ones (a run-config ``fault-drop-rate`` that leaves no round unmaskable is refused at start).
    """
    from server.launch import run_inprocess

    unplanned_dropouts(0.5)
    summary = run_inprocess({"method": "nadp", "num-clients": 7, "num-rounds": 1, "epsilon": 8.0, **NADP_FAST,
                             "out-dir": str(tmp_path)})
    assert summary["failed_rounds"]
    failure = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["failure"]
    assert "no upload can be unmasked" in failure and "3 of 7 uploads arrived" in failure
    assert "a client with 6 neighbours needs 4 of them kept (4 at rate 0)" in failure
    assert "run-config 'mask-corruption-rate' = 0.1; 0 needs the fewest" in failure


def test_fault_injection_is_deterministic_and_validated(task_identity):
    msgs = [Message(RecordDict({"config": ConfigRecord({"round": 4})}), 1000 + n, "train") for n in range(10)]
    picks = [fault_drops(msgs, 0.3, seed=5) for _ in range(2)]
    assert picks[0] == picks[1] and picks[0][0] == 4 and len(picks[0][1]) == 3
    assert fault_drops(msgs, 0.3, seed=6)[1] != picks[0][1] or fault_drops(msgs, 0.3, seed=7)[1] != picks[0][1]
    assert fault_drops([Message(m.content, m.metadata.dst_node_id, "query.keys") for m in msgs], 0.3, seed=5)[1] == set()
    with pytest.raises(ConfigError, match="fault-drop-rate"):
        RunConfig.from_mapping({**app_defaults(), "fault-drop-rate": 1.0})


def test_metered_grid_withholds_the_chosen_train_messages_on_any_grid(task_identity):
    """The round loop's grid injects fault-drop-rate, so every engine drops: the inner grid never sees them."""
    from strategies.run.loop import MeteredGrid

    class Inner:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
            self.seen += [m.metadata.dst_node_id for m in messages]
            return []

    msgs = [Message(RecordDict({"config": ConfigRecord({"round": 2})}), 1000 + n, "train") for n in range(10)]
    inner = Inner()
    grid = MeteredGrid(inner, fault_rate=0.2, seed=3)
    grid.send_and_receive(msgs)
    _, drop = fault_drops(msgs, 0.2, seed=3)
    assert grid.fault_dropped == {2: drop} and len(drop) == 2
    assert sorted(inner.seen) == sorted(set(range(1000, 1010)) - drop) and len(grid.sent) == 10
    keys = [Message(m.content, m.metadata.dst_node_id, "query.keys") for m in msgs]
    grid.send_and_receive(keys)
    assert len(inner.seen) == 8 + 10  # other phases are never withheld


# ------------------------------------------------------------------------ exactness (nadp, pinned)
def test_recovered_nadp_aggregate_is_the_survivors_average(monkeypatch):
    """Through the real client handler: after recovery the aggregate is sum_S p_i (w_i + n_i/p_i) / P_S."""
    used: list[bytes] = []

    def fake() -> bytes:
        used.append(hashlib.sha256(f"residual-{len(used)}".encode()).digest())
        return used[-1]

    monkeypatch.setattr(nadp_client, "residual_seed", fake)
    n = 6
    # no colluders assumed: self-mask threshold t = 3 of 5, so 2 of 6 may drop (t = 4 at the default rate)
    raw = {**app_defaults(), "method": "nadp", "num-clients": n, "partitioning": "size-skew", **NADP_FAST,
           "mask-corruption-rate": 0.0}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NadpStrategy(cfg)
    from protocols.task.models import build_model, get_weights

    arrays = to_record(get_weights(build_model(cfg.model, (1, 8, 8), 10, cfg.hidden_sizes, cfg.seed)), np.float64)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
    gone = {msgs[1].metadata.dst_node_id, msgs[4].metadata.dst_node_id}
    replies = [r for r in grid.send_and_receive(msgs) if r.metadata.src_node_id not in gone]
    agg = flatten(from_record(close_round(strategy, grid, strategy._state, replies)[0]))
    st = strategy._state
    expected, weight = np.zeros_like(agg), 0.0
    for msg, seed in zip(msgs, used, strict=True):
        node = msg.metadata.dst_node_id
        if node in gone:
            continue
        env = ClientEnv.from_context(grid.contexts[node])
        w = flatten(nadp_client.record_level_training(msg, env)[1])
        p = st.weights[node]
        expected += p * (w + gaussian(seed, len(w), st.allocation.residual_std[node]) / p)
        weight += p
    expected /= weight
    assert np.linalg.norm(agg - expected) <= 1e-9 * np.linalg.norm(expected)
    assert strategy.round_report()["recovered_pairs"] == 2 * (n - 2)


# ----------------------------------------------------------------------------------- lying server
def _uploaded_client(n: int = 4):
    """A 4-client nadp round where every client uploaded; returns (grid, participants, one client's node id).

    No colluders assumed, so the self-mask threshold is 2 of 3 neighbours: one may drop.
    """
    raw = {**app_defaults(), "method": "nadp", "num-clients": n, **NADP_FAST, "mask-corruption-rate": 0.0}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw), NadpStrategy(cfg)
    from protocols.task.models import build_model, get_weights

    arrays = to_record(get_weights(build_model(cfg.model, (1, 8, 8), 10, cfg.hidden_sizes, cfg.seed)), np.float64)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
    replies = list(grid.send_and_receive(msgs))
    assert len(replies) == n
    return grid, sorted(strategy._state.participants)


def _ask(grid: LocalGrid, node: int, received, dropped, signatures=None, rnd: int = 1) -> RecoveryReply:
    return recover(grid, node, received, dropped, signatures=signatures, rnd=rnd)


def test_lying_server_is_refused():
    grid, ids = _uploaded_client()
    me, peer = ids[0], ids[1]
    # the peer's upload arrived (it is in the received set) and the server also claims it dropped
    rep = _ask(grid, me, ids, [peer])
    assert rep.refused and "both received and dropped" in rep.refused and not rep.material
    # the server hides the peer's upload from the received set, but this client's own upload is left out too
    rep = _ask(grid, me, [n for n in ids if n != me], [me])
    assert "not in the received set" in rep.refused
    # a neighbour in neither set
    rep = _ask(grid, me, [me], [peer])
    assert "neither received nor dropped" in rep.refused
    # an honest request first (nobody dropped but the last; its surviving neighbours signed that outcome), then
    # a lie that the peer reported received dropped
    assert "signed no outcome" in _ask(grid, me, ids[:3], ids[3:]).refused  # unsigned: refused
    sigs = signed(sign(grid, ids[:3], ids[:3], ids[3:]))
    honest = _ask(grid, me, ids[:3], ids[3:], sigs)
    assert not honest.refused and honest.peers == (ids[3],) and len(honest.material[0]) == 32
    assert _ask(grid, me, ids[:3], ids[3:], sigs) == honest  # the same request is answered identically
    lie = _ask(grid, me, [n for n in ids[:3] if n != peer], [peer, ids[3]])
    assert "already answered" in lie.refused and str(peer) in lie.refused and not lie.material
    # material of another round was never kept
    assert "no pair material of round 2" in _ask(grid, ids[2], ids[:3], ids[3:], rnd=2).refused


def test_reveal_that_would_strip_all_own_noise_keeps_it():
    store = RecoveryStore(3, {5: b"a" * 32, 6: b"b" * 32}, {5: 1.0, 6: 2.0}, {5: b"x", 6: b"y"}, {5: 0.5, 6: 0.25})
    assert check_request(store, RecoveryRequest(3, (1,), (5, 6)), 1) == ""
    kept = answer(store, {5, 6})
    assert kept.kept == (5, 6) and kept.material == (b"x", b"y") and kept.kept_probe == pytest.approx(0.75)
    some = answer(store, {5})
    assert not some.kept and some.material == (b"a" * 32,)


# ----------------------------------------------------------------------------------- messages
def test_messages_round_trip():
    req = RecoveryRequest(2, (2**64 - 1, 3), (7,))
    assert RecoveryRequest.from_config(req.to_config()) == req
    for rep in (RecoveryReply((7,), (b"s" * 32,)), RecoveryReply(refused="no"), RecoveryReply(),
                RecoveryReply((7, 8), (b"", b"q"), kept=(7, 8), kept_probe=-1.5)):
        assert RecoveryReply.from_config(rep.to_config()) == rep
    with pytest.raises(ValueError):
        RecoveryReply.from_config({"recovery-peers": ["1"], "recovery-material": []})
    vec = np.arange(5, dtype=np.float64)
    for m in (NissPairMaterial(1, 0.5, b"o" * 32, 1, 0.25, in_seed=b"i" * 32),
              NissPairMaterial(0, 0.5, None, 1, 0.25, in_vector=vec)):
        back = NissPairMaterial.from_bytes(m.to_bytes(), 5)
        assert (back.out_count, back.out_seed, back.in_count, back.in_seed) == (m.out_count, m.out_seed, m.in_count,
                                                                                 m.in_seed)
        assert (back.in_vector is None) == (m.in_vector is None)
    with pytest.raises(ValueError):
        NissPairMaterial.from_bytes(b"junk" * 20, 5)
    with pytest.raises(ValueError, match="at most 1 share"):  # one share per neighbour and direction
        NissPairMaterial.from_bytes(NissPairMaterial(2, 0.5, b"o" * 32, 1, 0.25, in_seed=b"i" * 32).to_bytes(), 5)


def test_round_without_dropouts_reports_no_recovery(run_inprocess):
    _, rows = run_inprocess(method="nadp", num_clients=4, num_rounds=1,
                            **{k.replace("-", "_"): v for k, v in NADP_FAST.items()})
    assert rows[0]["recovery"] == 0 and rows[0]["dropped"] == 0


@pytest.mark.parametrize(("tau", "encoding"), [(0.0, "seed"), (0.7, "seed"), (0.7, "vector")])
def test_niss_material_expands_to_exactly_what_the_survivor_added(tau, encoding):
    """The server's expansion of a NISS survivor's revealed material is exactly what its upload added.

    strategies.niss.pair_contribution = own shares to the dropped peer + the distorted shares received from it.
    """
    from client.methods import niss as niss_client
    from protocols import niss as niss_math
    from strategies.niss import pair_contribution

    me, size = 5, 40
    seed = lambda label: hashlib.sha256(label.encode()).digest()  # noqa: E731
    # one share per neighbour and direction; no share of this client's went to peer 8 (out_count 0)
    out = [niss_math.ShareBundle(me, 7, 1, 0.4, seed("o7")), niss_math.ShareBundle(me, 9, 1, 0.5, seed("o9"))]
    bundles = {p: niss_math.ShareBundle(p, me, 1, std, seed(f"i{p}")) for p, std in ((7, 0.3), (8, 0.2), (9, 0.6))}
    incoming = [(p, b, -niss_math.bundle_shares(b, size) if encoding == "vector" else None)
                for p, b in sorted(bundles.items())]
    stored = niss_client._Stored(1, 0.25, 1.0, encoding, [7, 8, 9], {}, out)
    private = seed("private")
    partials = niss_client._received(incoming, size, tau, private)
    material, noise, partial, _, protect, _, _ = niss_client._recovery_material(stored, incoming, partials, size, tau,
                                                                            private)
    assert noise == {7: pytest.approx(0.16), 8: 0.0, 9: pytest.approx(0.25)}
    for peer in (7, 8, 9):
        own = niss_math.sender_noise([b for b in out if b.receiver == peer], size)
        m = NissPairMaterial.from_bytes(material[peer], size)
        assert np.allclose(pair_contribution(m, me, peer, size, tau), own + partials[peer], rtol=0, atol=1e-12)
        kept = NissPairMaterial.from_bytes(partial[peer], size)  # own shares kept secret: only the received part
        assert kept.out_seed is None
        assert np.allclose(pair_contribution(kept, me, peer, size, tau), partials[peer], rtol=0, atol=1e-12)
        shielded = NissPairMaterial.from_bytes(protect[peer], size)  # the peer's upload is held: its shares stay
        assert shielded.in_kept and np.allclose(pair_contribution(shielded, me, peer, size, tau), own, rtol=0, atol=0)
    if encoding == "seed":  # seeds, not vectors, travel: 32-byte bundle seed (+ 32-byte distortion seed if tau > 0)
        assert len(material[7]) <= 128


def test_a_held_upload_keeps_its_own_noise():
    """A peer the server names excluded (its upload is held): only the protecting material is revealed for it."""
    store = RecoveryStore(3, {5: b"full5", 6: b"full6", 7: b"full7"}, {5: 1.0, 6: 1.0, 7: 1.0},
                          protect={5: b"mine5"}, protect_probe={5: 0.5}, shield={5: b"none5"})
    reply = answer(store, {6}, {5})
    assert reply.material == (b"mine5", b"full6") and reply.kept == (5,) and reply.kept_probe == 0.5
    # excluded must be received; this node must not be excluded itself
    assert "not received" in check_request(store, RecoveryRequest(3, (1, 6, 7), (), (5,)), 1)
    assert "excluded" in check_request(store, RecoveryRequest(3, (1, 5, 6, 7), (), (1,)), 1)
    # every neighbour holding this node's noise gone: neither noise is revealed for the held peer
    both = answer(store, {6, 7}, {5})
    assert both.material == (b"none5", b"", b"") and set(both.kept) == {5, 6, 7}
