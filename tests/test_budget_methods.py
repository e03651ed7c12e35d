"""The budget guard of niss, ladp, cdp (more noise), ddpsa and mpddp on an n-out graph (stops): epsilon is a hard cap.

Stops project a round with the method's planned release (``planned_release``: ddpsa's decaying eps_t), and
also with the dearest round so far once a round cost more than planned.
"""

from __future__ import annotations

import pytest

from protocols.config import RunConfig
from protocols.privacy import DpCompositionAccountant, DpEvent, LaplaceEvent, PrivacyLedger
from protocols.privacy.budget import RoundBudget
from strategies.base import RoundState
from strategies.mpddp import MpddpStrategy
from strategies.run.budget import BudgetGuard
from tests.test_budget_cap import DROPS


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_niss_raises_its_noise_instead_of_stopping(run_inprocess):
    """20 % drop every round: niss used to stop before round 3 (0.92 spent); now it raises sigma_k and ends <= 1."""
    summary, rows = run_inprocess(method="niss", **DROPS)
    assert summary["stopped"] is None and summary["failed_rounds"] == [] and len(rows) == 3
    assert all(r["dropped"] == 2 and r["recovery"] == 1 for r in rows)
    assert "noise_scale" not in rows[0] and all(r["noise_scale"] > 1.0 for r in rows[1:])
    # The clients multiplied their own sigma_k by the announced scale (their reports, not the server's figure).
    assert rows[1]["upload_noise_std"] == pytest.approx(rows[0]["upload_noise_std"] * rows[1]["noise_scale"], rel=0.05)
    assert summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]


@pytest.mark.parametrize(("method", "noise_key"), [("ladp", "total_noise_norm"), ("cdp", "model_noise_std")])
def test_a_raised_scale_reaches_the_noise_and_the_charge(run_inprocess, tmp_path, monkeypatch, method, noise_key):
    """Rounds 2 and 3 asked for 1.5x the noise: the noise added grows 1.5x and the run is charged less."""
    common = {"method": method, "num-clients": 4, "num-rounds": 3, "seed": 3, "epsilon": 1.0}
    plain, ref = run_inprocess(**common, out_dir=str(tmp_path / "plain"))
    monkeypatch.setattr(BudgetGuard, "_plan", lambda self, shares, rnd: RoundBudget(1.5 if rnd > 1 else 1.0, None, rnd > 1))
    raised, rows = run_inprocess(**common, out_dir=str(tmp_path / "raised"))
    assert raised["stopped"] is None and len(rows) == 3 and rows[1]["noise_scale"] == 1.5
    assert rows[0][noise_key] == pytest.approx(ref[0][noise_key], rel=0.2)
    assert rows[1][noise_key] == pytest.approx(1.5 * rows[0][noise_key], rel=0.2)
    assert raised["epsilon"] < 0.8 * plain["epsilon"]  # two of three releases at 1.5x the multiplier


def test_ddpsa_aborts_a_round_with_dropouts_within_the_budget(run_inprocess, unplanned_dropouts):
    """Distributed noise, 2 of 10 drop unplanned: no share is summed without all its client was shown; nothing crosses.

    (A planned ``fault-drop-rate`` its rounds cannot survive is refused at start.)
    """
    unplanned_dropouts(DROPS["fault-drop-rate"])
    summary, rows = run_inprocess(method="ddpsa", **{k: v for k, v in DROPS.items() if k != "fault-drop-rate"})
    assert summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]
    assert len(summary["failed_rounds"]) == 3
    assert all("summed only with at least 10 of the participants" in f for f in summary["failed_rounds"])


def test_mpddp_on_an_n_out_graph_stops_before_the_round_that_would_cross():
    """Theorem 11 rounds compose basically: after recoveries that cost more, the guard stops before crossing."""
    cfg = RunConfig.from_mapping({"method": "mpddp", "graph": "n-out", "n-out": 95, "num-clients": 100,
                                  "num-rounds": 10, "epsilon": 1.0})
    strategy = MpddpStrategy(cfg)
    guard = BudgetGuard(cfg, strategy, cfg.num_rounds)
    stopped = None
    for rnd in range(1, 11):
        stopped = guard.before_round(rnd)
        if stopped is not None:
            break
        strategy.charge_release(RoundState(rnd, [1, 2, 3]))
        strategy.privacy.downlink.compose(DpEvent(0.05), units=[1, 2, 3])  # a recovery left less noise: its shortfall
        guard.after_round()
    assert stopped is not None and "round 7 would take the run past its target epsilon 1" in stopped, stopped
    assert strategy.privacy.report()["epsilon"] == pytest.approx(6 * 0.15)  # six rounds of 0.1 + 0.05
    back = BudgetGuard(cfg, strategy, cfg.num_rounds)  # the checkpointed guard stops the resumed run the same way
    back.load_state(guard.to_state())
    assert back.before_round(7) is not None


@pytest.mark.parametrize("composition", ["basic", "pld"])
def test_ddpsa_runs_its_decaying_schedule_to_the_end(run_inprocess, composition):
    """Exponential eps_t: round 1 is the dearest, yet the planned rounds fit (projecting the dearest would stop round 3)."""
    summary, rows = run_inprocess(method="ddpsa", dataset="breast-cancer", num_clients=3, num_rounds=3,
                                  ddpsa_allocation="exponential", ddpsa_composition=composition, epsilon=2.0)
    assert summary["stopped"] is None and summary["failed_rounds"] == [] and len(rows) == 3
    steps = [b["epsilon"] - a["epsilon"] for a, b in zip([{"epsilon": 0.0}, *rows], rows, strict=False)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]  # a decaying schedule
    assert summary["epsilon"] <= 2.0 * (1 + 1e-9) and not summary["privacy"]["over_target"]


class _Planned:
    """A method whose rounds are pure-DP releases of a decaying plan (what the guard sees of ddpsa)."""

    def __init__(self, plan: list[float]) -> None:
        self.plan = plan
        spent = DpCompositionAccountant(composition="basic")
        self.privacy = PrivacyLedger(1e-5, uplink=spent, downlink=spent)

    def planned_release(self, rnd: int) -> LaplaceEvent:
        return LaplaceEvent(self.plan[rnd - 1])


def _guarded(plan: list[float]) -> tuple[_Planned, BudgetGuard]:
    cfg = RunConfig.from_mapping({"method": "ddpsa", "num-clients": 3, "num-rounds": len(plan), "epsilon": 2.0})
    strategy = _Planned(plan)
    return strategy, BudgetGuard(cfg, strategy, len(plan))


def test_a_decaying_plan_runs_out_and_a_round_dearer_than_planned_stops_it():
    """Plan 1.0 + 0.6 + 0.4 = 2: run as planned it ends at 2; round 1 at 1.3 stops it before round 2 (named)."""
    strategy, guard = _guarded([1.0, 0.6, 0.4])
    for rnd in (1, 2, 3):
        assert guard.before_round(rnd) is None
        strategy.privacy.compose(LaplaceEvent(strategy.plan[rnd - 1]))
        guard.after_round()
    assert strategy.privacy.report()["epsilon"] == pytest.approx(2.0) and guard.dearer == []
    strategy, guard = _guarded([1.0, 0.6, 0.4])
    assert guard.before_round(1) is None
    strategy.privacy.compose(DpEvent(1.3))  # fewer noise shares were summed than the plan assumed
    guard.after_round()
    stop = guard.before_round(2)
    assert stop is not None and "round 2 would take the run past its target epsilon 2" in stop, stop
    assert "a round like the dearest so far would bring it to 2.6" in stop and "round 1 cost more than planned" in stop
    assert "resume" not in stop


def test_a_round_charged_again_after_a_resume_is_named_as_such():
    """Killed after round 2's charge; the resumed guard sees the charge and names round 2, not dropouts."""
    strategy, guard = _guarded([1.0, 0.6, 0.4])
    assert guard.before_round(1) is None
    strategy.privacy.compose(LaplaceEvent(1.0))
    guard.after_round()
    assert guard.before_round(2) is None
    strategy.privacy.compose(LaplaceEvent(0.6))  # the pending checkpoint holds this charge and the guard's state
    back = BudgetGuard(RunConfig.from_mapping({"method": "ddpsa", "num-rounds": 3, "epsilon": 2.0}), strategy, 3)
    back.load_state(guard.to_state())
    stop = back.before_round(2)
    assert stop is not None and "round 2's planned release would bring it to 2.2" in stop, stop
    assert "round 2 was charged again after a resume" in stop and "cost more than planned" not in stop
