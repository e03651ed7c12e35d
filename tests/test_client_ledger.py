"""The per-client privacy ledger (issue 16, item 4): persistent, composed with the project's accountants, enforced.

* :class:`client.ledger.ClientLedger` survives reopening, composes Gaussian/Laplace (RDP) and
  theorem-certified (epsilon, delta) rounds, and refuses to read a corrupt file as "nothing spent";
* through the real ClientApp: a node whose lifetime budget (node config ``lifetime-epsilon``)
  would be exceeded refuses to train -- in the same process, in a new run, and after a real
  process restart (a subprocess with the same ``ledger-dir``); the run's metrics show each
  client's figure (``client_epsilon``, ``client_epsilon_max``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.ledger import Account, ClientLedger
from protocols.config import RunConfig
from protocols.ddpsa import composition_accountant
from protocols.floor import ldp_noise_multiplier
from protocols.privacy import (
    DpCompositionAccountant,
    DpEvent,
    GaussianEvent,
    GdpAccountant,
    LaplaceEvent,
    RdpAccountant,
)
from server.launch import run_inprocess
from server.local_grid import LocalGrid
from tests.conftest import read_metrics
from tests.test_privacy_floor import assert_all_refused, setup, train_round

ROOT = Path(__file__).resolve().parent.parent
LDP = {"num-clients": 3, "num-rounds": 3, "epsilon": 1.0, "delta": 1e-5}


pytestmark = pytest.mark.usefixtures("one_thread")


def _run_epsilon(rounds: int) -> float:
    """What ``rounds`` ldp releases of the LDP config cost a client (exact Gaussian DP, at delta 1e-5)."""
    cfg = RunConfig(**{k.replace("-", "_"): v for k, v in LDP.items()}, method="ldp")
    acc = GdpAccountant()
    acc.compose(GaussianEvent(ldp_noise_multiplier(cfg), count=rounds))
    return acc.epsilon(1e-5)


# ------------------------------------------------------------------------------ the ledger itself
def test_ledger_persists_and_composes(tmp_path):
    with ClientLedger.open(tmp_path, 3) as led:
        led.record(11, "ldp", 1, {"uplink/client": GaussianEvent(2.0)})
        led.record(11, "ldp", 2, {"uplink/client": GaussianEvent(2.0)})
    with ClientLedger.open(tmp_path, 3, write=False) as led:  # a fresh read of the file
        assert led.rounds(11) == [1, 2] and led.rounds(12) == []
        ref = GdpAccountant()  # only unsampled Gaussians: their exact composition, below RDP's conversion
        ref.compose(GaussianEvent(2.0, count=2))
        assert ref.epsilon(1e-5) < RdpAccountant([GaussianEvent(2.0, count=2)]).epsilon(1e-5)
        assert led.spent(1e-5)["uplink/client"] == pytest.approx(ref.epsilon(1e-5), rel=1e-12)
        after = led.projected({"uplink/client": GaussianEvent(2.0)}, 1e-5)
        ref.compose(GaussianEvent(2.0))
        assert after["uplink/client"] == pytest.approx(ref.epsilon(1e-5), rel=1e-12)
        assert led.rounds(11) == [1, 2]  # projecting changes nothing
    # Laplace rounds (RDP) and certified (eps, delta) rounds (basic composition) add up at delta/2 each.
    with ClientLedger.open(tmp_path, 4) as led:
        led.record(1, "ddpsa", 1, {"uplink/record": LaplaceEvent(0.3)})
        led.record(2, "mpddp", 1, {"uplink/record": DpEvent(0.2, 1e-7)})
        rdp, dp = RdpAccountant([LaplaceEvent(0.3)]), DpCompositionAccountant([DpEvent(0.2, 1e-7)])
        assert led.spent(1e-5)["uplink/record"] == pytest.approx(rdp.epsilon(5e-6) + dp.epsilon(5e-6), rel=1e-12)
    assert json.loads(ClientLedger.file_for(tmp_path, 4).read_text())["runs"]["2"]["method"] == "mpddp"


@pytest.mark.parametrize("composition", ["basic", "advanced", "pld"])
def test_a_named_composition_is_kept_apart_and_persists(tmp_path, composition):
    """Releases composed as a method names (DDP-SA's server accountant) give that accountant's epsilon, reloaded."""
    with ClientLedger.open(tmp_path, 5) as led:
        for rnd in (1, 2, 3):
            led.record(7, "ddpsa", rnd, {"uplink/record": LaplaceEvent(0.4)}, composition_accountant(composition))
    server = composition_accountant(composition)
    server.compose(LaplaceEvent(0.4, count=3))
    with ClientLedger.open(tmp_path, 5, write=False) as led:
        assert led.spent(1e-5)["uplink/record"] == pytest.approx(server.epsilon(1e-5), rel=1e-12)
        assert led.accounts["uplink/record"].rdp.releases == 0  # not also charged as an RDP Laplace
        after = led.projected({"uplink/record": LaplaceEvent(0.4)}, 1e-5, composition_accountant(composition))
    server.compose(LaplaceEvent(0.4))
    assert after["uplink/record"] == pytest.approx(server.epsilon(1e-5), rel=1e-12)
    assert RdpAccountant([LaplaceEvent(0.4, count=3)]).epsilon(1e-5) != pytest.approx(server.epsilon(1e-5), rel=1e-3)
    with pytest.raises(ValueError, match="empty"):
        Account().compose(LaplaceEvent(0.4), server)
    old = {"version": 1, "accounts": {"uplink/record": Account().to_state()}, "runs": {}}  # before named compositions
    assert ClientLedger(tmp_path / "old.json", old).spent(1e-5) == {"uplink/record": 0.0}
    assert json.loads(ClientLedger.file_for(tmp_path, 5).read_text())["version"] == 2  # an older reader refuses it


def test_corrupt_ledger_is_not_read_as_empty(tmp_path):
    ClientLedger.file_for(tmp_path, 0).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"), ClientLedger.open(tmp_path, 0):
        pass


def test_a_run_secret_is_pinned_by_its_first_writer_in_an_owner_only_file(tmp_path):
    """The first ``make()`` is kept (mode 0600, not in the ledger JSON); a later one is ignored; runs differ."""
    first = ClientLedger.run_secret(tmp_path, 0, 7, "test", lambda: b"a" * 32)
    assert ClientLedger.run_secret(tmp_path, 0, 7, "test", lambda: pytest.fail("made again")) == first == b"a" * 32
    assert ClientLedger.run_secret(tmp_path, 0, 8, "test", lambda: b"b" * 32) == b"b" * 32
    (path,) = tmp_path.glob("client-0.run-7.test.secret")
    assert path.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob("*.json"))  # the ledger is neither read nor written for it


# ------------------------------------------------------------------------------ through the ClientApp
def test_budget_would_be_exceeded_mid_run_refused(tmp_path):
    """Lifetime between the cost of 2 and 3 rounds: rounds 1-2 train, round 3 is refused by every client."""
    budget = (_run_epsilon(2) + _run_epsilon(3)) / 2
    cfg, grid = setup("ldp", node_config={"ledger-dir": str(tmp_path), "lifetime-epsilon": budget}, **LDP)
    from strategies.registry import build_strategy

    strategy = build_strategy(cfg)
    for rnd in (1, 2):
        assert all(not r.has_error() for r in train_round(strategy, cfg, grid, rnd))
    assert_all_refused(train_round(strategy, cfg, grid, 3), "lifetime-epsilon")


@pytest.mark.parametrize("max_delta", [None, 0.5])
def test_a_per_run_budget_is_read_at_the_nodes_delta_not_a_larger_one_the_run_asks(tmp_path, max_delta):
    """A run asking ``delta = 0.5`` calibrates ldp's noise for (1, 0.5): multiplier 1.2 instead of 7.0 for 3 rounds.

    Read at 0.5 the run's spend met the node's ``max-epsilon-per-run = 1`` while one round alone costs 3.5 at the
    node's ``lifetime-delta`` (1e-5), the 3 rounds 6.6.  Without a ``max-delta`` the node reads it there and
    refuses the round before anything leaves; a node that accepts ``max-delta = 0.5`` trains.
    """
    node_config = {"ledger-dir": str(tmp_path), "max-epsilon-per-run": 1.0,
                   **({"max-delta": max_delta} if max_delta else {})}
    cfg, grid = setup("ldp", node_config=node_config, **{**LDP, "delta": 0.5})
    from strategies.registry import build_strategy

    replies = train_round(build_strategy(cfg), cfg, grid)
    if max_delta:
        assert all(not r.has_error() for r in replies)
        return
    assert_all_refused(replies, "max-epsilon-per-run")
    acc = GdpAccountant()
    acc.compose(GaussianEvent(ldp_noise_multiplier(cfg)))
    assert acc.epsilon(1e-5) > 3 and acc.epsilon(0.5) < 1  # what the refused round would have spent, and its reading
    with ClientLedger.open(tmp_path, 0, write=False) as led:
        assert not led.accounts


def test_spent_ledger_refuses_in_a_new_run_and_the_metrics_show_it(tmp_path):
    """Run 1 spends the whole lifetime budget (metrics show it per client); run 2 on the same ledger is refused."""
    ledger = tmp_path / "ledgers"
    node_config = {"ledger-dir": str(ledger), "lifetime-epsilon": _run_epsilon(3) * 1.001}

    def grid(app, n, raw):
        return LocalGrid(app, n, raw, node_config=node_config)

    base = {**LDP, "method": "ldp", "local-epochs": 1, "train-subset": 300, "test-subset": 100, "hidden": ""}
    run_inprocess({**base, "out-dir": str(tmp_path / "run1")}, progress=lambda _s: None, grid_factory=grid)
    rows = read_metrics(tmp_path / "run1")
    assert [len(r["client_epsilon"]) for r in rows] == [3, 3, 3]
    assert rows[-1]["client_epsilon_max"] == pytest.approx(_run_epsilon(3), rel=1e-9)
    assert rows[0]["client_epsilon_max"] == pytest.approx(_run_epsilon(1), rel=1e-9)
    assert sorted(p.name for p in ledger.glob("*.json")) == ["client-0.json", "client-1.json", "client-2.json"]

    cfg, grid2 = setup("ldp", node_config=node_config, **LDP)
    from strategies.registry import build_strategy

    assert_all_refused(train_round(build_strategy(cfg), cfg, grid2), "lifetime-epsilon")


def test_a_lifetime_budget_equal_to_the_runs_target_lets_ladp_finish(tmp_path):
    """LaDP's server accounts its Gaussian rounds exactly; the node's ledger must not read more (it read 1.09 at 1)."""
    node_config = {"ledger-dir": str(tmp_path / "ledgers"), "lifetime-epsilon": 1.0}

    def grid(app, n, raw):
        return LocalGrid(app, n, raw, node_config=node_config)

    cfg = {"method": "ladp", "num-clients": 3, "num-rounds": 4, "epsilon": 1.0, "train-subset": 300,
           "test-subset": 100, "out-dir": str(tmp_path / "run")}
    summary = run_inprocess(cfg, progress=lambda _s: None, grid_factory=grid)
    rows = read_metrics(tmp_path / "run")
    assert [len(r["client_epsilon"]) for r in rows] == [3, 3, 3, 3]  # no round refused
    assert rows[-1]["client_epsilon_max"] <= 1.0
    assert rows[-1]["client_epsilon_max"] == pytest.approx(summary["epsilon"], rel=1e-6)


@pytest.mark.parametrize("method", ["nadp", "niss", "ldp", "ladp", "ddpsa"])
def test_a_per_run_budget_equal_to_the_runs_target_lets_every_protected_method_finish(tmp_path, method):
    """``max-epsilon-per-run`` caps what a run spends by the node's ledger: at the run's own epsilon no round is refused."""
    node_config = {"ledger-dir": str(tmp_path / "ledgers"), "max-epsilon-per-run": 1.0}

    def grid(app, n, raw):
        return LocalGrid(app, n, raw, node_config=node_config)

    cfg = {"method": method, "num-clients": 4, "num-rounds": 3, "epsilon": 1.0, "train-subset": 300,
           "test-subset": 100, "out-dir": str(tmp_path / "run")}
    summary = run_inprocess(cfg, progress=lambda _s: None, grid_factory=grid)
    rows = read_metrics(tmp_path / "run")
    assert summary["failed_rounds"] == [] and [len(r["client_epsilon"]) for r in rows] == [4, 4, 4], rows
    assert rows[-1]["client_epsilon_max"] <= 1.0 * (1 + 1e-9)


_RESTART = """
import json, sys
sys.path.insert(0, {root!r})
from tests.test_privacy_floor import setup, train_round
from strategies.registry import build_strategy
cfg, grid = setup("ldp", node_config={node_config!r}, **{ldp!r})
replies = train_round(build_strategy(cfg), cfg, grid)
print(json.dumps([r.error.reason if r.has_error() else None for r in replies]))
"""


def test_spent_ledger_refuses_after_a_process_restart(tmp_path):
    """The same node, restarted as a new OS process with the same ledger-dir, still refuses."""
    node_config = {"ledger-dir": str(tmp_path), "lifetime-epsilon": _run_epsilon(1) * 1.001}
    cfg, grid = setup("ldp", node_config=node_config, **LDP)
    from strategies.registry import build_strategy

    assert all(not r.has_error() for r in train_round(build_strategy(cfg), cfg, grid))  # spends the budget
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    code = _RESTART.format(root=str(ROOT), node_config=node_config, ldp=LDP)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    reasons = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(reasons) == 3
    assert all(r is not None and "privacy floor" in r and "lifetime-epsilon" in r for r in reasons), reasons


@pytest.mark.parametrize("composition", ["basic", "pld"])
def test_ddpsa_client_ledgers_spend_what_the_server_reports(run_inprocess, tmp_path, composition):
    """After a DDP-SA run every client's ledger holds the epsilon the server reports (same composition both ends)."""
    from strategies.run.checkpoint import LEDGER_DIR

    summary, rows = run_inprocess(method="ddpsa", ddpsa_composition=composition, num_rounds=3, num_clients=3,
                                  hidden="", epsilon=2.0)
    assert summary["failed_rounds"] == [] and len(rows) == 3
    paths = sorted((tmp_path / "run" / LEDGER_DIR).glob("client-*.json"))
    assert len(paths) == 3
    for path in paths:
        led = ClientLedger(path, json.loads(path.read_text()))
        assert len(led.rounds(next(iter(led.runs)))) == 3  # every client released in every round
        assert led.spent(summary["config"]["delta"]) == {"uplink/record": pytest.approx(summary["epsilon"], rel=1e-9)}
    assert 1.9 <= summary["epsilon"] <= 2.0
    assert rows[-1]["client_epsilon_max"] == pytest.approx(summary["epsilon"], rel=1e-6)


@pytest.mark.parametrize("method", ["nadp", "niss"])
def test_a_refused_release_keeps_the_last_rounds_recovery_material(tmp_path, method):
    """A round the node's budget refuses leaves the pair material of the round it uploaded in for recovery."""
    from client.env import ClientEnv
    from client.recovery import RecoveryStore
    from protocols.wire.ledger import SpentReport
    from strategies.registry import build_strategy

    cfg, grid = setup(method, node_config={"ledger-dir": str(tmp_path), "lifetime-epsilon": 1e6})
    strategy = build_strategy(cfg)
    first = train_round(strategy, cfg, grid, 1)
    assert first and all(not r.has_error() for r in first)
    stores = {n: RecoveryStore.load(ClientEnv.from_context(ctx)) for n, ctx in grid.contexts.items()}
    assert all(s is not None and s.round == 1 and s.material for s in stores.values())
    for r in first:  # a budget the round already spent: the next release is refused
        spent = SpentReport.from_metrics(r.content["metrics"]).epsilon
        grid.contexts[r.metadata.src_node_id].node_config["lifetime-epsilon"] = spent * 1.0001
    assert_all_refused(train_round(strategy, cfg, grid, 2), "lifetime-epsilon")
    for n, ctx in grid.contexts.items():
        kept = RecoveryStore.load(ClientEnv.from_context(ctx))
        assert kept is not None and kept.round == 1 and kept.material == stores[n].material


def test_a_client_level_run_spends_the_record_budget_too(tmp_path):
    """Record-level then client-level ldp runs on one ledger: the record account holds both.

    A record moves the clipped update by up to twice the client-level sensitivity, so the client-level run is
    charged per record at z/2 and stops at the lifetime budget (each account held one run's epsilon, 0.91).
    """
    budget = 1.5  # above either run's own epsilon (1), below what the two together cost a record
    node_config = {"ledger-dir": str(tmp_path), "lifetime-epsilon": budget}
    from strategies.registry import build_strategy

    for unit, ok_rounds in (("record", (1, 2, 3)), ("client", (1,))):
        cfg, grid = setup("ldp", node_config=node_config, **LDP, **{"privacy-unit": unit})
        strategy = build_strategy(cfg)
        for rnd in ok_rounds:
            assert all(not r.has_error() for r in train_round(strategy, cfg, grid, rnd))
    assert_all_refused(train_round(strategy, cfg, grid, 2), "lifetime-epsilon (uplink/record)")
    z = ldp_noise_multiplier(cfg)
    released = GdpAccountant([GaussianEvent(z, count=3), GaussianEvent(z / 2)])
    with ClientLedger.open(tmp_path, 0, write=False) as led:
        assert led.spent(1e-5)["uplink/record"] == pytest.approx(released.epsilon(1e-5), rel=1e-12)
        assert led.spent(1e-5)["uplink/client"] == pytest.approx(_run_epsilon(1), rel=1e-12)


def test_per_record_charges_twice_the_sensitivity():
    from protocols.privacy import at_sensitivity, per_record

    assert per_record(GaussianEvent(4.0, count=3)) == GaussianEvent(2.0, count=3)
    assert per_record(LaplaceEvent(0.3)) == LaplaceEvent(0.6)
    grouped = per_record(DpEvent(0.5, 1e-6))
    assert isinstance(grouped, DpEvent) and grouped.epsilon == 1.0
    assert grouped.delta == pytest.approx(2 * math.exp(0.5) * 1e-6, rel=1e-12)
    assert per_record(DpEvent(5.0, 0.01)) == GaussianEvent(0.0)  # group privacy leaves no delta below 1
    with pytest.raises(ValueError):
        at_sensitivity(DpEvent(0.5), 1.5)


def test_a_run_recorded_without_per_run_accounts_is_bounded_by_the_node_accounts(tmp_path):
    """A run begun under a ledger without per-run accounts: its own spend is read as the node's (never as zero)."""
    path = ClientLedger.file_for(tmp_path, 0)
    led = ClientLedger(path)
    led.record(7, "nadp", 1, {"uplink/record": GaussianEvent(2.0)})
    old = led.to_state()
    del old["runs"]["7"]["accounts"]  # as the ledger wrote it before per-run accounts
    path.write_text(json.dumps(old))
    with ClientLedger.open(tmp_path, 0) as reread:
        spent = reread.spent(1e-5)["uplink/record"]
        assert reread.projected_run(7, {}, 1e-5)["uplink/record"] == pytest.approx(spent)
        assert reread.run_accounts(8) == {}  # a run the node has not trained in starts empty
        reread.charge(7, {"uplink/record": GaussianEvent(2.0)})
    with ClientLedger.open(tmp_path, 0, write=False) as after:
        assert after.projected_run(7, {}, 1e-5)["uplink/record"] == pytest.approx(after.spent(1e-5)["uplink/record"])
