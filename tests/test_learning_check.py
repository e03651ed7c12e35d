"""The learning check and the measured signal: a run that ends at chance says so, with what its rounds carried.

The a-priori noise check trusts the clip bound as the round's signal.  The MP family clips *perturbed*
gradients, so its recovered signal is far below that bound and mpcdp could end at chance on digits at
epsilon 1 without a word.  These tests drive the real runner.
"""

from __future__ import annotations

import numpy as np
import pytest

from protocols.privacy.signal import MeasuredSignal, Release
from strategies.run.notes import ABOVE_CHANCE, chance_level, learning_check


def test_the_measured_signal_recovers_a_known_signal_under_known_noise():
    rng = np.random.default_rng(7)
    d, rounds, signal_norm, noise_std = 4000, 40, 1.0, 0.2  # noise norm ~12.6 per round: 12.6x the signal
    direction = rng.standard_normal(d)
    direction *= signal_norm / np.linalg.norm(direction)
    m = MeasuredSignal(planned_rounds=rounds)
    for _ in range(rounds):
        m.add(Release(direction + rng.normal(0.0, noise_std, d), noise_std ** 2 * d))
    assert m.signal_rms == pytest.approx(signal_norm, rel=0.25)
    assert m.noise_rms == pytest.approx(noise_std * np.sqrt(d))
    assert m.run_ratio == pytest.approx(m.noise_rms / m.signal_rms / np.sqrt(rounds))
    assert m.run_ratio_at_least < m.run_ratio

    pure_noise = MeasuredSignal(planned_rounds=rounds)
    for _ in range(rounds):
        pure_noise.add(Release(rng.normal(0.0, noise_std, d), noise_std ** 2 * d))
    assert pure_noise.signal_rms < 0.5 * signal_norm  # nothing there: at most the estimator's spread
    assert pure_noise.run_ratio_at_least > 1.0  # even the 3-sigma upper estimate leaves the noise dominant


def test_a_non_finite_release_is_not_a_measurement():
    m = MeasuredSignal()
    m.add(Release(np.array([np.nan, 1.0]), 1.0))
    m.add(Release(np.ones(2), float("inf")))
    assert m.rounds == 0 and m.as_dict()["run_ratio"] is None


def test_learning_check_reads_the_outcome_against_the_most_frequent_class():
    assert chance_level([0, 1, 1, 1]) == 0.75
    info, warning = learning_check(0.75 + ABOVE_CHANCE, 0.75, MeasuredSignal())
    assert info["learned"] and warning is None
    info, warning = learning_check(0.78, 0.75, MeasuredSignal())
    assert not info["learned"] and "not clearly better than chance" in warning


def test_a_run_that_does_not_learn_warns_and_says_so_in_its_summary(tmp_path):
    from server.launch import run_inprocess

    lines: list[str] = []
    # a vanishing lr: the seeded random MLP stays what it was at the start (0.106 on digits, no DP noise)
    summary = run_inprocess({"method": "fedavg", "num-clients": 3, "num-rounds": 1, "local-epochs": 1, "lr": 1e-9,
                             "hidden": "8", "out-dir": str(tmp_path / "run")}, progress=lines.append)
    check = summary["learning_check"]
    assert check["learned"] is False and check["final_accuracy"] < check["chance"] + ABOVE_CHANCE
    assert any(s.startswith("warning: the published model is not clearly better than chance") for s in lines)
    assert "**fedavg did not learn**" in (tmp_path / "run" / "report.md").read_text()  # the run's report says it too


def test_the_mp_familys_released_signal_is_measured_far_below_its_clip_bound(tmp_path):
    """The recovered gradient mpcdp's server steps with is far shorter than the clip bound (1) says."""
    from server.launch import run_inprocess

    lines: list[str] = []
    summary = run_inprocess({"method": "mpcdp", "num-clients": 5, "num-rounds": 6, "out-dir": str(tmp_path / "run")},
                            progress=lines.append)
    measured = summary["noise_check"]["measured"]
    assert measured["space"] == "gradient" and measured["rounds"] == 6
    bound = summary["noise_check"]["signal_norm_bound_per_round"]
    assert measured["signal_norm_rms"] < 0.5 * bound
    assert measured["noise_norm_rms"] == pytest.approx(summary["noise_check"]["noise_norm_per_round"], rel=2.0)
    check = summary["learning_check"]
    warned = any(s.startswith("warning: the published model is not clearly better") for s in lines)
    assert warned == (not check["learned"])
