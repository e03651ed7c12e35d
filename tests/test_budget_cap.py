"""Epsilon is a hard cap (protocols/privacy/budget.py, strategies/run/budget.py).

* the budget math: the precision budget is the RDP accountant's, a re-planned round fits, top-ups are exact;
* real in-process runs: dropouts every round end at or below the target (nadp and mpddp raise the later
  rounds' noise; niss, which cannot, stops before the round that would cross, exit status 1);
* a clean run is unchanged by the guard (same noise, same epsilon);
* SIGKILL between the train replies and aggregation, then ``--resume``: the server's epsilon equals the
  largest of the clients' own ledgers and stays within the target;
* the client's floor takes more noise than its calibration, never less.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.ledger import ClientLedger
from protocols.config import RunConfig
from protocols.floor import FloorViolation, nadp_floor
from protocols.nadp import round_plan
from protocols.privacy import GaussianEvent, GdpAccountant, Lemma2Accountant, PerUnitAccountant, PrivacyLedger, RdpAccountant
from protocols.privacy.budget import (
    MAX_NOISE_SCALE,
    RESERVE,
    budget_shares,
    empty_like,
    plan_round,
    precision,
    precision_budget,
    top_up,
    unit_precisions,
)
from protocols.privacy.calibration import calibrate_noise_multiplier
from server.launch import main
from strategies.run.budget import BudgetGuard
from strategies.run.checkpoint import LEDGER_DIR, load_checkpoint
from tests.conftest import ROOT, read_metrics

#: nadp: one full-batch step per round on a linear model (its paper's regime, fast).
NADP_FAST = {"method": "nadp", "local-epochs": 1, "batch-size": 1000, "lr": 4.0, "clip": 1.0, "hidden": ""}
DROPS = {"num-clients": 10, "num-rounds": 3, "seed": 7, "epsilon": 1.0, "fault-drop-rate": 0.2}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


# ------------------------------------------------------------------------------------------------ budget math
@pytest.mark.parametrize(("epsilon", "delta", "rounds"), [(1.0, 1e-5, 3), (8.0, 1e-5, 20), (0.5, 1e-6, 1)])
def test_precision_budget_is_the_rdp_accountants_limit(epsilon, delta, rounds):
    total = precision_budget(epsilon, delta)
    assert RdpAccountant([GaussianEvent(total**-0.5)]).epsilon(delta) <= epsilon
    assert RdpAccountant([GaussianEvent((total * (1 + 1e-9)) ** -0.5)]).epsilon(delta) > epsilon * (1 - 1e-6)
    z = calibrate_noise_multiplier(epsilon, delta, 1.0, rounds)  # a run's calibration fits its budget
    assert rounds / z**2 <= total * (1 + 1e-9)
    exact = precision_budget(epsilon, delta, "gdp")  # each account against its own conversion: GDP is tighter
    assert GdpAccountant([GaussianEvent(exact**-0.5)]).epsilon(delta) <= epsilon < GdpAccountant(
        [GaussianEvent((exact * (1 + 1e-9)) ** -0.5)]).epsilon(delta) * (1 + 1e-6)
    assert exact > total
    paper = precision_budget(epsilon, delta, "lemma2")
    assert Lemma2Accountant([GaussianEvent(paper**-0.5)]).epsilon(delta) == pytest.approx(epsilon, rel=1e-12)


def test_budget_shares_read_the_headline_views_each_in_its_own_conversion():
    gdp = GdpAccountant([GaussianEvent(3.0)])
    led = PrivacyLedger(1e-5, uplink=gdp, downlink=RdpAccountant([GaussianEvent(1.0)]), headline="uplink")
    shares = budget_shares(led, 1.0)
    assert list(shares) == [("uplink", None)]  # the downlink is not the headline: it does not limit the run
    assert shares[("uplink", None)] == pytest.approx(precision(gdp) / precision_budget(1.0, 1e-5, "gdp"), rel=1e-12)
    led.headline = "worst"
    assert set(budget_shares(led, 1.0)) == {("uplink", None), ("downlink", None)}
    assert budget_shares(PrivacyLedger(1e-5, uplink=RdpAccountant([GaussianEvent(2.0, 0.5)])), 1.0) is None  # sampled


def test_plan_round_keeps_a_clean_run_and_spreads_what_is_left():
    total, rounds = 1.0, 4
    # As calibrated: never scaled, never stopped.
    for r in range(1, rounds + 1):
        assert plan_round(total, (r - 1) * total / rounds, total / rounds, rounds - r + 1, scalable=True).scale == 1.0
    # Round 1 cost 1.25x its plan: rounds 2..4 share (1 - RESERVE) of what is left, each as dear as round 1.
    dearest, spent = 1.25 * total / rounds, 1.25 * total / rounds
    for left in (3, 2, 1):
        b = plan_round(total, spent, dearest, left, scalable=True)
        assert b.stop is None and b.scale > 1.0 and b.replanned
        cost = dearest / b.scale**2
        assert cost == pytest.approx((1 - RESERVE) * (total - spent) / left, rel=1e-12)
        spent += cost
    assert spent <= total
    # A method that cannot raise its noise runs while the next round fits, then stops before the one that would cross.
    assert plan_round(total, 0.5, 0.3, 3, scalable=False).stop is None
    stop = plan_round(total, 0.8, 0.3, 2, scalable=False).stop
    assert stop is not None and "30.0% of the budget" in stop
    # No budget left, or more than MAX_NOISE_SCALE needed: stop.
    assert plan_round(total, total, 0.25, 1, scalable=True).stop == "no budget is left"
    tiny = (1 - 1e-4) * total
    far = plan_round(total, tiny, 0.25, 1, scalable=True)
    assert far.stop is not None and f"{MAX_NOISE_SCALE:g}x" in far.stop


def test_top_up_charges_exactly_the_noise_really_left():
    """Planned charge + top-up = the real charge, per unit and for the paper's (Lemma 2) account."""
    def ledger():
        return PrivacyLedger(1e-5, uplink=PerUnitAccountant(), downlink=PerUnitAccountant(),
                             extra={"paper": Lemma2Accountant()})

    def charge(led, z_up, z_down, units):
        for u in units:
            led.uplink.compose(GaussianEvent(z_up[u]), units=[u])
        led.downlink.compose(GaussianEvent(z_down), units=units)
        led.extra["paper"].compose(GaussianEvent(z_down))

    plan_up, real_up = {1: 3.0, 2: 3.5, 3: 4.0}, {1: 2.5, 2: 3.5}
    live, want = ledger(), ledger()
    charge(live, plan_up, 3.0, [1, 2, 3])  # at release: everyone as planned
    planned, real = empty_like(live), empty_like(live)
    charge(planned, plan_up, 3.0, [1, 2, 3])
    charge(real, real_up, 2.6, [1, 2])  # after dropouts: the survivors' noise left
    top_up(live, planned, real)
    charge(want, real_up, 2.6, [1, 2])
    want.uplink.compose(GaussianEvent(4.0), units=[3])  # the dropped unit keeps its planned charge
    want.downlink.compose(GaussianEvent(3.0), units=[3])
    got, exp = unit_precisions(live), unit_precisions(want)
    assert got.keys() == exp.keys() and all(got[k] == pytest.approx(exp[k], rel=1e-12) for k in got)
    assert precision(live.extra["paper"]) == pytest.approx(precision(want.extra["paper"]), rel=1e-12)
    assert live.report()["epsilon"] == pytest.approx(want.report()["epsilon"], rel=1e-9)


# ------------------------------------------------------------------------------------------------ real runs
@pytest.mark.parametrize(("method", "scale_key"), [("nadp", "sigma_down"), ("mpddp", "sigma_eta")])
def test_dropouts_every_round_end_within_the_target(run_inprocess, tmp_path, method, scale_key):
    """20 % of the participants drop after the noise was fixed, every round: epsilon <= 1 (1.12 / 1.13 before)."""
    extra = NADP_FAST if method == "nadp" else {"method": method}
    summary, rows = run_inprocess(**extra, **DROPS, cancellation_check=True)
    assert summary["stopped"] is None and summary["failed_rounds"] == [] and len(rows) == 3
    assert all(r["dropped"] == 2 and r["recovery"] == 1 for r in rows)
    assert all(r["cancellation_residual"] <= 1e-9 for r in rows)  # both ends of every pair drew the raised noise
    assert summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]
    assert "noise_scale" not in rows[0]  # round 1 is planned as calibrated
    assert all(r["noise_scale"] > 1.0 for r in rows[1:])  # then the noise rises
    # What the clients were told and used: the announced sigmas grew by exactly the scale.
    assert rows[1][scale_key] == pytest.approx(rows[0][scale_key] * rows[1]["noise_scale"], rel=0.05)


@pytest.mark.parametrize("method", ["niss"])
def test_a_run_that_cannot_hold_its_budget_stops_before_crossing(tmp_path, capsys, monkeypatch, method):
    """A method that cannot raise its noise (niss, told so): with 20 % dropping every round it stops, exit 1."""
    from strategies.niss import NissStrategy

    monkeypatch.setattr(NissStrategy, "scales_noise", False)
    out = tmp_path / "run"
    text = " ".join(f"{k}={json.dumps(v)}" for k, v in {"method": method, **DROPS}.items())
    code = main(["run", "--run-config", f'{text} out-dir="{out}"'])
    err = capsys.readouterr().err
    assert code == 1 and "privacy budget" in err, err
    summary = json.loads((out / "summary.json").read_text())
    done = summary["rounds_completed"]
    assert summary["stopped_for"] == "privacy budget" and 1 <= done < 3
    for needle in (f"round {done + 1} would take the run past its target epsilon 1", "epsilon spent so far",
                   "clients dropped"):
        assert needle in summary["stopped"], summary["stopped"]
    assert summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]
    assert all(r["epsilon"] <= 1.0 for r in read_metrics(out))


@pytest.mark.parametrize("method", ["nadp", "ldp", "niss", "mpddp"])
def test_a_clean_run_is_untouched_by_the_guard(run_inprocess, tmp_path, monkeypatch, method):
    """Without dropouts or resume: the same noise and the same epsilon, round by round, as without the guard."""
    common = {**(NADP_FAST if method == "nadp" else {"method": method}), "num-clients": 4, "num-rounds": 3, "seed": 3}
    guarded, rows = run_inprocess(**common, out_dir=str(tmp_path / "guarded"))
    monkeypatch.setattr(BudgetGuard, "before_round", lambda self, rnd: None)
    plain, ref = run_inprocess(**common, out_dir=str(tmp_path / "plain"))
    assert guarded["stopped"] is None and len(rows) == 3
    noise_keys = [k for k in ref[0] if k.startswith(("epsilon", "sigma_", "aggregate_noise", "upload_noise",
                                                       "model_noise")) and k != "epsilon_given_R"]  # random R
    assert "epsilon" in noise_keys
    for a, b in zip(rows, ref, strict=True):
        assert "noise_scale" not in a
        for k in noise_keys:
            assert a.get(k) == b.get(k), (k, a.get(k), b.get(k))
    assert guarded["epsilon"] == plain["epsilon"]


# ------------------------------------------------------------------------------------------------ crash + resume
_KILLER = """
import os, signal, sys
from strategies.run import loop
inner = loop.MeteredGrid.send_and_receive

def send_and_receive(self, messages, *, timeout=None):
    messages = list(messages)
    replies = inner(self, messages, timeout=timeout)
    if messages and messages[0].metadata.message_type == "train" and int(messages[0].content["config"]["round"]) == {k}:
        os.kill(os.getpid(), signal.SIGKILL)  # the train replies are in, aggregation has not run
    return replies

loop.MeteredGrid.send_and_receive = send_and_receive
from server.launch import main
sys.exit(main(sys.argv[1:]))
"""


def killed_after_uploads(tmp_path: Path, cfg: dict, kill_round: int) -> Path:
    """Run ``cfg`` in-process in a child killed (SIGKILL) once round ``kill_round``'s uploads are in; its out-dir."""
    text = " ".join(f"{k}={json.dumps(v)}" for k, v in cfg.items())
    out = tmp_path / "killed"
    script = tmp_path / "killer.py"
    script.write_text(_KILLER.replace("{k}", str(kill_round)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), "run", "--run-config", f'{text} out-dir="{out}"'],
                          cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    return out


def _ledger_epsilon(folder: Path, delta: float) -> float:
    """Largest epsilon over the clients' own ledgers (RDP, the server's conversion), any direction."""
    worst = 0.0
    for path in sorted(folder.glob("client-*.json")):
        led = ClientLedger(path, json.loads(path.read_text()))
        for account in led.accounts.values():
            worst = max(worst, account.rdp.epsilon(delta))
    return worst


@pytest.mark.parametrize("method", ["nadp", "ldp"])
def test_sigkill_between_train_and_aggregate_then_resume_agrees_with_the_clients(tmp_path, capsys, method):
    """Killed after round 2's uploads, before aggregation; resumed: the round is charged again on both sides."""
    cfg = {**(NADP_FAST if method == "nadp" else {"method": method}), "num-clients": 4, "num-rounds": 4, "seed": 5,
           "epsilon": 1.0, "train-subset": 400, "test-subset": 200, "dataset": "digits"}
    out = killed_after_uploads(tmp_path, cfg, 2)
    ckpt = load_checkpoint(out)
    assert ckpt.round == 1 and ckpt.pending is not None  # round 2's charge was persisted before its train phase
    ledgers = out / LEDGER_DIR
    delta = RunConfig.from_mapping(ckpt.config).delta
    pending = PrivacyLedger.from_state(ckpt.pending["strategy_state"]["privacy"])
    assert pending.report()["epsilon"] == pytest.approx(_ledger_epsilon(ledgers, delta), abs=1e-9)
    assert main(["run", "--resume", str(out)]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4] and rows[1]["recharged_round"]
    assert rows[1]["noise_scale"] > 1.0  # the recharged round left less for the rest
    assert summary["epsilon"] == pytest.approx(_ledger_epsilon(ledgers, delta), abs=1e-9)
    assert summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]


def test_a_resume_that_leaves_no_budget_stops_before_the_round(tmp_path, capsys):
    """Killed in the last round after its uploads: re-running it would cross the target, so the resume stops."""
    cfg = {**NADP_FAST, "num-clients": 4, "num-rounds": 2, "seed": 5, "epsilon": 1.0, "train-subset": 400,
           "test-subset": 200, "dataset": "digits"}
    out = killed_after_uploads(tmp_path, cfg, 2)
    assert main(["run", "--resume", str(out)]) == 1
    err = capsys.readouterr().err
    assert "privacy budget" in err and "round 2 would take the run past its target epsilon 1" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_for"] == "privacy budget" and summary["model_round"] == 1
    delta = summary["config"]["delta"]
    assert summary["epsilon"] <= 1.0
    assert _ledger_epsilon(out / LEDGER_DIR, delta) <= 1.0


# ------------------------------------------------------------------------------------------------ client floor
def test_nadp_floor_takes_more_noise_never_less():
    cfg = RunConfig.from_mapping({**NADP_FAST, "num-clients": 4, "num-rounds": 3})
    sizes = {11: 100, 12: 120, 13: 90}
    base, more = nadp_floor(cfg, sizes, 12, None), nadp_floor(cfg, sizes, 12, None, 1.5)
    assert more.sigmas.sigma_down == pytest.approx(1.5 * base.sigmas.sigma_down, rel=1e-9)
    assert more.allocation.joint_uplink_std(more.lam)[12] == pytest.approx(
        1.5 * base.allocation.joint_uplink_std(base.lam)[12], rel=1e-6)
    assert more.sensitivity == base.sensitivity  # the ledger charges the noise really added
    sig, _ = round_plan(sizes, {n: nadp_floor(cfg, sizes, n, None).sensitivity for n in sizes}, cfg.epsilon, cfg.delta,
                        cfg.num_rounds)
    assert base.sigmas.sigma_down == sig.sigma_down  # scale 1 is the run's calibration, bit for bit
    for bad in (0.999, 0.5, math.nan):
        with pytest.raises(FloorViolation, match="nadp-noise-scale"):
            nadp_floor(cfg, sizes, 12, None, bad)


def test_a_subclass_raises_noise_only_when_it_says_its_clients_do():
    """A method built on ldp's server with clients of its own is guarded by stops, not by more noise it may not add."""
    from strategies.baselines import LocalDPStrategy

    class Own(LocalDPStrategy):
        pass

    class Declared(LocalDPStrategy):
        scales_noise = True

    cfg = RunConfig.from_mapping({"method": "ldp", "num-clients": 4, "num-rounds": 3})
    assert BudgetGuard(cfg, LocalDPStrategy(cfg), 3).scalable and BudgetGuard(cfg, Declared(cfg), 3).scalable
    assert not BudgetGuard(cfg, Own(cfg), 3).scalable


def test_a_shortfall_of_rounding_only_charges_nothing_and_a_real_one_charges_exactly():
    """``charge_shortfall``: a multiplier below the plan by one ulp adds no event; a real shortfall adds the gap."""
    from strategies.recovery import charge_shortfall

    planned = 27.92492148040624
    acc = PerUnitAccountant()
    charge_shortfall(acc, planned, math.nextafter(planned, 0.0), units=[1])
    assert acc.epsilon(1e-5) == 0.0
    charge_shortfall(acc, 2.0, 1.0, units=[1])  # 1/1 - 1/4: one event of multiplier sqrt(4/3)
    ref = PerUnitAccountant()
    ref.compose(GaussianEvent(math.sqrt(4.0 / 3.0)), units=[1])
    assert acc.epsilon(1e-5) == pytest.approx(ref.epsilon(1e-5), rel=1e-12)
