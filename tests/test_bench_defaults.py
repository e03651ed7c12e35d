"""``cancelfl-bench defaults``: seeds, means, acceptance on the means, --tabulate (no federated runs)."""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks import cli, defaults


def _row(dataset: str, method: str, seed: int, acc: float | None, status: str = "ok") -> dict:
    return {"dataset": dataset, "method": method, "seed": seed, "unit": "record", "final_accuracy": acc,
            "run_ratio": 0.1 * seed, "learned": acc is not None, "total_s": 2.0, "status": status}


def test_summarize_gives_mean_spread_and_names_a_failed_seed():
    rows = [_row("mnist", "ldp", 42, 0.80), _row("mnist", "ldp", 43, 0.90), _row("mnist", "ldp", 44, 0.85),
            _row("mnist", "cdp", 42, 0.9), _row("mnist", "ladp", 42, 0.8), _row("mnist", "ladp", 43, None, "failed: X")]
    by = {r["method"]: r for r in defaults.summarize(rows)}
    ldp = by["ldp"]
    assert ldp["seeds"] == 3 and ldp["final_accuracy"] == pytest.approx(0.85)
    assert ldp["sd"] == pytest.approx(0.05) and (ldp["min"], ldp["max"]) == (0.80, 0.90)
    assert ldp["run_ratio"] == pytest.approx(4.4) and ldp["status"] == "ok"
    assert by["cdp"]["sd"] is None and by["cdp"]["final_accuracy"] == 0.9
    assert by["ladp"]["final_accuracy"] is None and by["ladp"]["status"] == "seed 43: failed: X"


def test_acceptance_compares_means_not_single_seeds():
    seeds = {"mpcdp": (0.72, 0.70, 0.74), "mpddp": (0.64, 0.76, 0.69)}  # seed 42 alone: 8 points below; means: 2.3
    rows = [_row("mnist", m, 42 + i, a) for m, accs in seeds.items() for i, a in enumerate(accs)]
    assert defaults.acceptance(defaults.summarize(rows), {"mnist": 0.114}) == []
    rows = [r for r in rows if r["seed"] == 42]
    assert defaults.acceptance(defaults.summarize(rows), {"mnist": 0.114}) == [
        "mnist: mpddp 0.6400 is more than 3 points below mpcdp 0.7200"]


def test_tabulate_runs_nothing_lists_missing_runs_and_fails(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    recorded = [_row("digits", "ldp", 42, 0.7), _row("digits", "ldp", 43, 0.8), _row("digits", "cdp", 42, 0.9)]
    (runs / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recorded))
    argv = ["defaults", "--datasets", "digits", "--methods", "ldp,cdp", "--seeds", "3", "--seeded", "ldp",
            "--out", str(out), "--runs-dir", str(runs), "--tabulate"]
    assert cli.main(argv) == 1  # digits ldp seed 44 is missing
    with (out / "defaults.csv").open() as fh:
        table = {r["method"]: r for r in csv.DictReader(fh)}
    assert float(table["ldp"]["final_accuracy"]) == pytest.approx(0.75) and table["ldp"]["seeds"] == "2"
    md = (out / "defaults.md").read_text()
    assert "not run (left out of the means): digits ldp seed 44" in md
    assert "acceptance FAILED: 1 runs not recorded" in md
    with (out / "defaults-runs.csv").open() as fh:
        assert [(r["method"], r["seed"]) for r in csv.DictReader(fh)] == [("ldp", "42"), ("ldp", "43"), ("cdp", "42")]
