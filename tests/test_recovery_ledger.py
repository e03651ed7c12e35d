"""A node's ledger charges what its dropout-recovery answer strips (client/recovery_ledger.py), before it reveals.

* in-process runs with dropouts (nadp, niss, mpddp): every client that uploaded in every round holds, per account,
  at least the server's figure for it (the same conversion: RDP), not just the upload's charge;
* a consistent, signed false-dropout outcome (d - t neighbours of one nadp client named dropped, every upload kept)
  raises that client's ledger to the server formula's multiplier of the survivors' joint view, once however often
  the same request is asked;
* a node whose ``lifetime-epsilon`` is just above its upload charge refuses that recovery: nothing revealed.
* a recovery refused past ``max-epsilon-per-run`` is refused in the next Flower run of the run series too (its
  ``Context.state`` carries over): it would be charged to that run instead.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord

from client.app import app as client_app
from client.env import ClientEnv
from client.ledger import ClientLedger, ledger_dir
from client.records import to_record
from protocols.config import RunConfig
from protocols.masking import mask_threshold
from protocols.nadp_recovery import survivor_uplink_stds
from protocols.privacy import GaussianEvent, GdpAccountant
from protocols.privacy.budget import RoundBudget
from protocols.task.models import build_model, get_weights
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.nadp import NadpStrategy
from strategies.niss import NissStrategy
from strategies.run.budget import BudgetGuard
from strategies.run.checkpoint import LEDGER_DIR
from tests import test_masking
from tests.consistency_setup import recover, sign_and_recover
from tests.test_masking import NADP_FAST, _forwarded, _round

pinned = test_masking.pinned  # the fixture: deterministic residual seeds
DELTA = 1e-5


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


# ----------------------------------------------------------------------------------- whole runs
@pytest.mark.parametrize("method", ["nadp", "niss", "mpddp"])
def test_survivors_ledgers_hold_the_servers_charge_after_dropouts(run_inprocess, tmp_path, monkeypatch, method):
    """10 clients, 2 rounds, 2 dropping each round (guard off): each survivor's ledger >= the server's figure."""
    import strategies.registry as registry

    built = []
    build = registry.build_strategy
    monkeypatch.setattr(registry, "build_strategy", lambda cfg: built.append(build(cfg)) or built[-1])
    monkeypatch.setattr(BudgetGuard, "_plan", lambda self, shares, rnd: RoundBudget())
    summary, rows = run_inprocess(method=method, num_clients=10, num_rounds=2, seed=7, epsilon=1.0,
                                  fault_drop_rate=0.2)
    assert summary["failed_rounds"] == [] and all(r["dropped"] == 2 and r["recovery"] == 1 for r in rows)
    server = built[-1].privacy
    figures = {name: acc for name, acc in server.accounts() if name in ("uplink", "downlink")}
    checked = 0
    for path in sorted((tmp_path / "run" / LEDGER_DIR).glob("client-*.json")):
        led = ClientLedger(path, json.loads(path.read_text()))
        if len(led.rounds(next(iter(led.runs)))) < 2:
            continue  # dropped once: the server charged a round it never released
        node = _node_of(path)
        for name, acc in figures.items():
            key = f"{name}/record"
            if key not in led.accounts or node not in acc.units:
                continue
            mine, theirs = led.accounts[key].rdp.epsilon(DELTA), acc.unit(node).epsilon(DELTA)
            assert mine >= theirs * (1 - 1e-9), (method, path.name, key, mine, theirs)
            checked += 1
    assert checked >= 6  # six clients uploaded in both rounds, each with one or two accounts


def _node_of(ledger_file) -> int:
    """The LocalGrid node id of the partition whose ledger is ``ledger_file`` (``client-<partition>.json``)."""
    from server.local_grid import LocalGrid

    return 1_000_003 * (int(ledger_file.stem.split("-")[1]) + LocalGrid.node_id_offset)


def _ledger_vs_server(path_dir, server, delta: float, rounds: int = 0) -> list[tuple[str, str, float, float]]:
    """(ledger, account, client RDP epsilon, server's unit epsilon) of every node account the server also holds.

    ``rounds``: only nodes that trained in that many rounds (the server charges a dropped node at release too).
    """
    figures = {name: acc for name, acc in server.accounts() if name in ("uplink", "downlink")}
    out = []
    for path in sorted(path_dir.glob("client-*.json")):
        led = ClientLedger(path, json.loads(path.read_text()))
        if rounds and len(led.rounds(int(next(iter(led.runs))))) < rounds:
            continue
        node = _node_of(path)
        for name, acc in figures.items():
            key = f"{name}/record"
            if key in led.accounts and node in acc.units:
                out.append((path.name, key, led.accounts[key].rdp.epsilon(delta), acc.unit(node).epsilon(delta)))
    return out


def _client_above_server(path_dir, server, delta: float) -> list[tuple[str, str, float, float]]:
    """The rows of :func:`_ledger_vs_server` where a node's ledger is above the server's figure."""
    return [r for r in _ledger_vs_server(path_dir, server, delta) if r[2] > r[3] * (1 + 1e-9) + 1e-12]


def _run(run_inprocess, monkeypatch, method: str, *, silence: int = 0, **overrides):
    """An in-process run of ``method`` on digits, 10 % dropping; returns (summary, rows, the strategy, silenced).

    ``silence``: in the first round with dropouts, that many survivors without a dropped neighbour (or any, when
    the graph is complete) do not answer the unmasking request (a further dropout, after the others revealed).
    """
    import strategies.registry as registry
    from strategies.base import CancelStrategy

    built, silenced = [], []
    build = registry.build_strategy
    monkeypatch.setattr(registry, "build_strategy", lambda cfg: built.append(build(cfg)) or built[-1])
    exchange = CancelStrategy.exchange

    def lossy(self, grid, nodes, content_fn, action):
        replies, errors = exchange(self, grid, nodes, content_fn, action)
        st = self._state
        if silence and not silenced and action == "recover" and st is not None and st.dropped:
            nbrs = st.keys.neighbours
            quiet = [n for n in sorted(replies) if not set(nbrs.get(n, ())) & set(st.dropped)] or sorted(replies)[1:]
            silenced.extend(quiet[:silence])
            for n in silenced:
                replies.pop(n)
        return replies, errors

    monkeypatch.setattr(CancelStrategy, "exchange", lossy)
    extra = {"local-epochs": 1, "batch-size": 1000, "lr": 4.0, "clip": 1.0, "hidden": ""} if method == "nadp" else {}
    summary, rows = run_inprocess(method=method, **{**extra, "num_clients": 10, "num_rounds": 6, "seed": 2,
                                                     "epsilon": 1.0, "fault_drop_rate": 0.1, "dataset": "digits",
                                                     "train_subset": 600, "test_subset": 200, **overrides})
    return summary, rows, built[-1], silenced


@pytest.mark.parametrize("method", ["nadp", "niss"])
def test_a_neighbourhood_short_of_signatures_keeps_its_pairs_and_the_round_completes(run_inprocess, tmp_path,
                                                                                      monkeypatch, method):
    """n-out 2, 10 % dropping: a dropped node whose neighbours cannot sign enough keeps its pairs secret.

    Each survivor next to it withholds only that pair (named kept, its noise stays in the aggregate) and answers
    the rest, so the round completes; a whole refusal had withheld the survivor's self-mask shares too and failed
    round 6 after the others revealed their pair material.  Every node's ledger holds at least the server's figure.
    """
    summary, rows, strategy, _ = _run(run_inprocess, monkeypatch, method, graph="n-out", n_out=2)
    assert not any("self-masks cannot be removed" in f for f in summary["failed_rounds"]), summary["failed_rounds"]
    assert any(r.get("kept_pairs") for r in rows), rows  # some pair stayed secret, its noise in the model
    # A recovery in the last round costs what no later round can absorb: the summary says when it crossed.
    assert summary["epsilon"] <= 1.0 or summary["privacy"]["over_target"], summary["privacy"]
    pairs = _ledger_vs_server(tmp_path / "run" / LEDGER_DIR, strategy.privacy, summary["config"]["delta"], rounds=6)
    assert pairs and all(mine >= theirs * (1 - 1e-9) for _f, _k, mine, theirs in pairs), pairs


@pytest.mark.parametrize("method", ["nadp", "niss"])
def test_a_recovery_that_fails_after_its_answers_is_charged_on_both_ends(run_inprocess, tmp_path, monkeypatch, method):
    """Complete graph: 4 survivors fall silent after the others revealed their pairs with the dropped node.

    The kept uploads' self-masks then miss shares and the round fails; the server charges the uploads what the
    answers strip, as the answering clients' ledgers do (niss's read 1.0017 against the server's 0.971 without it).
    No model is published in the failed round, so a client's downlink charge for it is an over-count the server
    does not share.
    """
    summary, _rows, strategy, silenced = _run(run_inprocess, monkeypatch, method, silence=4, graph="complete")
    assert len(silenced) == 4
    assert any("self-masks cannot be removed" in f for f in summary["failed_rounds"]), summary["failed_rounds"]
    above = _client_above_server(tmp_path / "run" / LEDGER_DIR, strategy.privacy, summary["config"]["delta"])
    assert [row for row in above if row[1].startswith("uplink/")] == [], above


# ----------------------------------------------------------------------------------- the targeted lie
def _ledger(grid, node: int) -> ClientLedger:
    env = ClientEnv.from_context(grid.contexts[node])
    with ClientLedger.open(ledger_dir(env.context.node_config), env.partition_id, write=False) as led:
        return led


def _lie(n: int = 10):
    """A masked nadp round of ``n`` and the outcome naming d - t of its first client's neighbours dropped."""
    grid, strategy, msgs, replies = _round(n, hidden="32")
    st = strategy._state
    graph = st.keys.neighbours
    k = msgs[0].metadata.dst_node_id
    nbrs = sorted(graph[k])
    t = mask_threshold(len(nbrs), 0.1)
    dropped = nbrs[t:]
    received = [x for x in graph if x not in dropped]
    return grid, st, replies, graph, k, received, dropped


def _ask(grid, replies, graph, k, received, dropped):
    return sign_and_recover(grid, k, received, dropped, forwarded=_forwarded(replies, k, graph),
                            signers=[x for x in received if x != k])


def test_a_false_dropout_outcome_is_charged_as_the_server_formula(pinned):
    grid, st, replies, graph, k, received, dropped = _lie()
    assert (len(graph[k]), len(dropped)) == (9, 3)
    charged = _ledger(grid, k).accounts["uplink/record"].rdp.events
    assert len(charged) == 1
    z_up = charged[0].noise_multiplier
    joint, _ = survivor_uplink_stds(st.allocation, st.plan.lam, sorted(received), True)
    z_after = joint[k] / st.sensitivity[k]
    assert z_after < 0.9 * z_up  # the lie strips a real part of the joint view's noise (22.2 -> 18.6 here)
    for _ in range(2):  # the same request again: answered, charged once
        rep = _ask(grid, replies, graph, k, received, dropped)
        assert not rep.refused and sorted(rep.peers) == dropped
        led = _ledger(grid, k)
        want = GdpAccountant([GaussianEvent(z_after)]).epsilon(DELTA)
        assert led.spent(DELTA)["uplink/record"] == pytest.approx(want, rel=1e-9)
        assert led.accounts["uplink/record"].rdp.epsilon_rank() == pytest.approx(z_after**-2, rel=1e-12)
        assert led.rounds(next(iter(led.runs))) == [1]


def test_a_recovery_past_the_lifetime_budget_is_refused(pinned):
    grid, st, replies, graph, k, received, dropped = _lie()
    before = _ledger(grid, k).spent(DELTA)
    grid.contexts[k].node_config["lifetime-epsilon"] = max(before.values()) * 1.001
    rep = _ask(grid, replies, graph, k, received, dropped)
    assert rep.refused and "lifetime-epsilon" in rep.refused and not rep.peers and not rep.material
    assert _ledger(grid, k).spent(DELTA) == before  # nothing charged
    # the honest outcome (every upload aggregated) costs nothing more: answered within the same budget
    grid, st, replies, graph, k, _received, _dropped = _lie()
    grid.contexts[k].node_config["lifetime-epsilon"] = max(_ledger(grid, k).spent(DELTA).values()) * 1.001
    rep = _ask(grid, replies, graph, k, list(graph), [])
    assert not rep.refused, rep.refused


def _spend_run_to(grid, node: int, target: float) -> None:
    """Charge ``node``'s current run (not a new round) until its ``uplink/record`` epsilon is just below ``target``."""
    env = ClientEnv.from_context(grid.contexts[node])
    with ClientLedger.open(ledger_dir(env.context.node_config), env.partition_id) as led:
        run = int(next(iter(led.runs)))
        lo, hi = 1e-3, 1e6  # noise multiplier of the extra release: bisect on the run's epsilon
        for _ in range(200):
            mid = (lo * hi) ** 0.5
            eps = led.projected_run(run, {"uplink/record": GaussianEvent(mid)}, DELTA)["uplink/record"]
            lo, hi = (mid, hi) if eps > target else (lo, mid)
        led.charge(run, {"uplink/record": GaussianEvent(hi)})


def test_a_recovery_past_the_per_run_budget_is_refused(pinned):
    """``max-epsilon-per-run`` caps what the run really spends, recovery top-ups included, not only its config."""
    grid, st, replies, graph, k, received, dropped = _lie()
    cap = ClientEnv.from_context(grid.contexts[k]).cfg.epsilon
    grid.contexts[k].node_config["max-epsilon-per-run"] = cap
    _spend_run_to(grid, k, cap * 0.999)
    before = _ledger(grid, k).spent(DELTA)
    rep = _ask(grid, replies, graph, k, received, dropped)
    assert rep.refused and "max-epsilon-per-run" in rep.refused and not rep.peers and not rep.material
    assert _ledger(grid, k).spent(DELTA) == before  # nothing charged
    # the honest outcome costs nothing more: answered
    grid, st, replies, graph, k, _received, _dropped = _lie()
    grid.contexts[k].node_config["max-epsilon-per-run"] = cap
    _spend_run_to(grid, k, cap * 0.999)
    rep = _ask(grid, replies, graph, k, list(graph), [])
    assert not rep.refused, rep.refused


def test_a_round_is_not_recovered_in_another_run_of_the_run_series(pinned):
    """Flower carries ``Context.state`` into the next run of a run series (a new run id): the store stays its run's."""
    grid, st, replies, graph, k, received, dropped = _lie()
    cap = ClientEnv.from_context(grid.contexts[k]).cfg.epsilon
    grid.contexts[k].node_config["max-epsilon-per-run"] = cap
    _spend_run_to(grid, k, cap * 0.999)
    assert "max-epsilon-per-run" in _ask(grid, replies, graph, k, received, dropped).refused
    before = _ledger(grid, k).spent(DELTA)
    for context in grid.contexts.values():
        context.run_id += 1  # the server starts the next run of the series: every node's state carries over
    # Else answered there: the 3 pair seeds out, run 1's round charged to run 2 (run 1 at 1.005 > its cap of 1).
    rep = _ask(grid, replies, graph, k, received, dropped)
    assert rep.refused and "of run" in rep.refused and not rep.peers and not rep.material
    assert _ledger(grid, k).spent(DELTA) == before  # nothing charged



# ----------------------------------------------------------------------------------- without double masking
def _unmasked_round(n: int, node_config: dict | None = None):
    """Round 1 of ``n`` real nadp clients with ``self-mask = false`` (``node_config``: every node's)."""
    raw = {**app_defaults(), "method": "nadp", "num-clients": n, **NADP_FAST, "hidden": "32", "self-mask": False}
    cfg = RunConfig.from_mapping(raw)
    grid, strategy = LocalGrid(client_app, n, raw, node_config=node_config), NadpStrategy(cfg)
    arrays = to_record(get_weights(build_model(cfg.model, (1, 8, 8), 10, cfg.hidden_sizes, cfg.seed)), np.float64)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
    return grid, strategy, msgs, {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}


def test_without_double_masking_an_excluded_upload_loses_its_pair_noise_unless_the_node_refuses(pinned, tmp_path):
    """``self-mask = false``: naming k excluded has every neighbour reveal its pair seed with k (k is not asked).

    k's held upload keeps its residual alone (multiplier 7.1 here against the 22.2 its ledger charged: epsilon
    0.50 against 0.14), and no answer of k's tops its ledger up.  A node whose policy asks for a guarantee
    refuses such a round before anything leaves it (nadp in the train phase; niss in the share phase).
    """
    grid, strategy, msgs, _replies = _unmasked_round(10)
    st = strategy._state
    graph, k = st.keys.neighbours, msgs[0].metadata.dst_node_id
    for j in graph[k]:
        rep = recover(grid, j, list(graph), [], excluded=[k])
        assert not rep.refused and k in rep.peers  # the pair seed with k goes out
    left = st.allocation.residual_std[k] / st.weights[k] / st.sensitivity[k]
    (charged,) = _ledger(grid, k).accounts["uplink/record"].rdp.events
    assert left < 0.5 * charged.noise_multiplier  # the ledger charged three times the noise left
    _grid, _strategy, _msgs, replies = _unmasked_round(10, {"ledger-dir": str(tmp_path), "lifetime-epsilon": 50.0})
    assert replies and all(r.has_error() and "self-mask" in r.error.reason for r in replies.values())


def test_a_niss_node_asking_for_a_guarantee_refuses_the_share_phase_without_double_masking(monkeypatch, tmp_path):
    from tests.niss_setup import FAST
    from tests.test_niss_joint import _share_phase_errors

    raw = {**app_defaults(), **FAST, "num-clients": 4, "self-mask": False}
    cfg = RunConfig.from_mapping(raw)
    grid = LocalGrid(client_app, 4, raw, node_config={"ledger-dir": str(tmp_path), "max-epsilon-per-run": 10.0})
    model = build_model(cfg.model, (1, 8, 8), 10, cfg.hidden_sizes, cfg.seed)
    errors = _share_phase_errors(monkeypatch, grid, NissStrategy(cfg), to_record(get_weights(model), np.float64))
    assert errors and all("self-mask" in e for e in errors)
