"""Smoke tests of ``python -m server.benchmark`` (tiny digits runs; the real grids are in the report)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from server import benchmark


def _rows(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_grid_records_results_refusals_and_skips(tmp_path):
    out = tmp_path / "grid"
    benchmark.main(["grid", "--dataset", "digits", "--train-subset", "0", "--test-subset", "200",
                    "--methods", "fedavg,ldp,cdp,nosuch", "--epsilons", "1,4", "--clients", "4", "--rounds", "2",
                    "--hidden", "8", "--method-set", "cdp:delta=2.0", "--out", str(out)])
    rows = _rows(out / "results.csv")
    assert [(r["name"], float(r["epsilon"])) for r in rows] == [("fedavg", 1.0), ("ldp", 1.0), ("ldp", 4.0),
                                                                 ("cdp", 1.0), ("cdp", 4.0)]
    fedavg, ldp1, ldp4, cdp1, _ = rows
    assert fedavg["status"] == "ok" and float(fedavg["final_accuracy"]) > 0.1
    assert math.isinf(float(fedavg["epsilon_reported"]))
    # the ldp baseline spends exactly its configured budget over the run
    assert float(ldp1["epsilon_reported"]) == pytest.approx(1.0, rel=0.02)
    assert float(ldp4["epsilon_reported"]) == pytest.approx(4.0, rel=0.02)
    assert float(ldp1["bytes_up"]) > float(fedavg["bytes_up"])  # float64 noisy upload vs float32 model
    assert float(fedavg["client_s"]) > 0 and float(fedavg["server_s"]) >= 0
    assert float(fedavg["deployed_s_x_fedavg"]) == pytest.approx(1.0)
    assert cdp1["status"].startswith("refused") and "delta" in cdp1["status"]
    md = (out / "results.md").read_text()
    assert "skipped nosuch" in md and "python -m server.benchmark" in md
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 0 and (out / "round_time.png").stat().st_size > 0


def test_attacks_dlg_separates_no_dp_from_dp_and_mia_runs(tmp_path):
    out = tmp_path / "attacks"
    benchmark.main(["attacks", "--dataset", "digits", "--test-subset", "100", "--methods", "fedavg,ldp",
                    "--dlg-clients", "4", "--dlg-restarts", "1", "--dlg-iterations", "100", "--hidden", "16",
                    "--mia-clients", "4", "--mia-train-subset", "100", "--mia-rounds", "2", "--mia-local-epochs", "2",
                    "--mia-hidden", "16", "--out", str(out)])
    dlg = {r["name"]: r for r in _rows(out / "dlg.csv")}
    assert float(dlg["fedavg"]["ssim_best"]) > 0.95 and dlg["fedavg"]["reconstructed"] == "True"
    assert float(dlg["fedavg"]["grad_cosine"]) > 0.9999
    assert float(dlg["ldp"]["ssim_best"]) < 0.5 and dlg["ldp"]["reconstructed"] == "False"
    mia = {r["name"]: r for r in _rows(out / "membership.csv")}
    for r in mia.values():
        assert r["status"] == "ok" and 0.0 <= float(r["mia_received_acc"]) <= 1.0
    assert (out / "dlg_reconstructions.png").stat().st_size > 0


def test_overhead_measures_secaggplus_reference(tmp_path):
    out = tmp_path / "overhead"
    benchmark.main(["overhead", "--dataset", "digits", "--train-subset", "0", "--test-subset", "100",
                    "--methods", "fedavg", "--clients", "4", "--rounds", "2", "--hidden", "8",
                    "--secagg-shares", "all", "--out", str(out)])
    rows = {r["name"]: r for r in _rows(out / "overhead.csv")}
    sa = rows["secagg+ (shares=4)"]
    assert sa["status"] == "ok", sa["status"]
    assert float(sa["client_s"]) > 0 and float(sa["bytes_up"]) > 0
    # SecAgg+ sends keys, encrypted shares and masked vectors on top of the model
    assert float(sa["bytes_per_client_round"]) > float(rows["fedavg"]["bytes_per_client_round"])


def test_parse_method_sets_and_unknown_method_is_skipped():
    assert benchmark.parse_method_sets(["mpddp:n-out=8", 'mpddp:graph="n-out"', "ldp:clip=2.0"]) == {
        "mpddp": {"n-out": 8, "graph": "n-out"}, "ldp": {"clip": 2.0}}
    notes: list[str] = []
    assert benchmark.resolve_methods("fedavg,nosuch", notes=notes) == ["fedavg"]
    assert notes and "nosuch" in notes[0]


def test_median_over_repeats_takes_medians_per_method():
    raw = [
        {"name": "fedavg", "clients": 10, "status": "ok", "round_s": 1.0, "round_s_x_fedavg": 1.0, "repeat": 0},
        {"name": "nadp", "clients": 10, "status": "ok", "round_s": 1.5, "round_s_x_fedavg": 1.5, "repeat": 0},
        {"name": "fedavg", "clients": 10, "status": "ok", "round_s": 2.0, "round_s_x_fedavg": 1.0, "repeat": 1},
        {"name": "nadp", "clients": 10, "status": "failed 1/3 rounds", "round_s": 2.4, "round_s_x_fedavg": 1.2,
         "repeat": 1},
        {"name": "nadp", "clients": 10, "status": "ok", "round_s": math.nan, "round_s_x_fedavg": 1.3, "repeat": 2},
    ]
    rows = {r["name"]: r for r in benchmark.median_over_repeats(raw)}
    assert list(rows) == ["fedavg", "nadp"] and "repeat" not in rows["nadp"]
    assert rows["fedavg"]["round_s"] == 1.5 and rows["nadp"]["round_s"] == pytest.approx(1.95)  # nan ignored
    assert rows["nadp"]["round_s_x_fedavg"] == pytest.approx(1.3)  # median of per-repeat ratios
    assert rows["nadp"]["status"] == "failed 1/3 rounds" and rows["nadp"]["clients"] == 10
