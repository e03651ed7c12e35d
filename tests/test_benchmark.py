"""Smoke tests of ``cancelfl-bench`` (tiny digits runs; the real grids are in the README)."""

from __future__ import annotations

import argparse
import csv
import math
import pkgutil
from pathlib import Path

import pytest

import benchmarks
from benchmarks import cli, mpddp, nadp, overhead
from benchmarks.common import VARIANTS, method_config, parse_method_sets, resolve_methods
from protocols.config import RunConfig
from protocols.methods import METHOD_NAMES, METHODS
from server.defaults import app_defaults


def _rows(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_grid_records_results_refusals_and_skips(tmp_path):
    out = tmp_path / "grid"
    argv = ["grid", "--dataset", "digits", "--train-subset", "0", "--test-subset", "200", "--methods",
            "fedavg,ldp,cdp,nosuch", "--epsilons", "1,4", "--clients", "4", "--rounds", "2", "--hidden", "16",
            "--batch-size", "16", "--method-set", "cdp:delta=2.0", "ldp:privacy-unit=\"client\"", "--out", str(out)]
    assert cli.main(argv) == 0
    rows = _rows(out / "results.csv")
    assert [(r["name"], float(r["epsilon"])) for r in rows] == [("fedavg", 1.0), ("ldp", 1.0), ("ldp", 4.0),
                                                                 ("cdp", 1.0), ("cdp", 4.0)]
    fedavg, ldp1, ldp4, cdp1, _ = rows
    # two rounds of mini-batch SGD learn digits far above chance (0.1); client-level ldp's noise at epsilon 1
    # destroys that (record-level ldp with 16-example batches would stop on divergence: many steps, each record
    # moving every later one, make its sensitivity 2 C lr (1/b + steps - 1))
    assert fedavg["status"] == "ok" and float(fedavg["final_accuracy"]) > 0.5
    assert float(ldp1["final_accuracy"]) < float(fedavg["final_accuracy"]) - 0.3
    assert math.isinf(float(fedavg["epsilon_reported"]))
    # the ldp baseline spends exactly its configured budget over the run
    assert float(ldp1["epsilon_reported"]) == pytest.approx(1.0, rel=0.02)
    assert float(ldp4["epsilon_reported"]) == pytest.approx(4.0, rel=0.02)
    assert float(ldp1["bytes_up"]) > float(fedavg["bytes_up"])  # float64 noisy upload vs float32 model
    assert float(fedavg["client_s"]) > 0 and float(fedavg["server_s"]) >= 0
    assert float(fedavg["deployed_s_x_fedavg"]) == pytest.approx(1.0)
    assert cdp1["status"].startswith("refused") and "delta" in cdp1["status"]
    md = (out / "results.md").read_text()
    assert "skipped nosuch" in md and "Command: `cancelfl-bench grid --dataset digits " in md
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 0 and (out / "round_time.png").stat().st_size > 0


def test_attacks_dlg_separates_no_dp_from_dp_and_mia_detects_fedavg_members(tmp_path):
    out = tmp_path / "attacks"
    cli.main(["attacks", "--dataset", "digits", "--test-subset", "100", "--methods", "fedavg,ldp", "--epsilons", "1",
              "--dlg-clients", "4", "--dlg-restarts", "1", "--dlg-iterations", "100", "--hidden", "16", "--lr", "0.5",
              "--mia-clients", "4", "--mia-train-subset", "100", "--mia-rounds", "3", "--mia-local-epochs", "20",
              "--mia-hidden", "16", "--out", str(out)])
    dlg = {r["name"]: r for r in _rows(out / "dlg.csv")}
    assert float(dlg["fedavg"]["ssim_best"]) > 0.95 and dlg["fedavg"]["reconstructed"] == "True"
    assert float(dlg["fedavg"]["grad_cosine"]) > 0.9999
    assert float(dlg["ldp"]["ssim_best"]) < 0.5 and dlg["ldp"]["reconstructed"] == "False"
    mia = {r["name"]: r for r in _rows(out / "membership.csv")}
    fedavg, ldp = mia["fedavg"], mia["ldp"]
    assert fedavg["status"] == "ok" and ldp["status"] == "ok"
    assert fedavg["model_attacked"] == "global model sent to clients"
    # 20 local epochs on 25 samples per client overfit: members have the lower loss and the attack sees it
    assert float(fedavg["final_accuracy"]) > 0.5
    assert float(fedavg["member_loss"]) < float(fedavg["nonmember_loss"]) and float(fedavg["train_test_gap"]) > 0.1
    assert float(fedavg["mia_final_auc"]) > 0.55 and float(fedavg["mia_received_auc"]) > 0.55
    assert float(ldp["final_accuracy"]) < float(fedavg["final_accuracy"]) - 0.3
    assert (out / "dlg_reconstructions.png").stat().st_size > 0


def test_overhead_measures_secaggplus_reference(tmp_path):
    out = tmp_path / "overhead"
    cli.main(["overhead", "--dataset", "digits", "--train-subset", "0", "--test-subset", "100",
              "--methods", "fedavg", "--clients", "4", "--rounds", "2", "--hidden", "8",
              "--secagg-shares", "all", "--out", str(out)])
    rows = {r["name"]: r for r in _rows(out / "overhead.csv")}
    sa = rows["secagg+ (shares=4)"]
    assert sa["status"] == "ok", sa["status"]
    assert float(sa["client_s"]) > 0 and float(sa["bytes_up"]) > 0
    # SecAgg+ sends keys, encrypted shares and masked vectors on top of the model
    assert float(sa["bytes_per_client_round"]) > float(rows["fedavg"]["bytes_per_client_round"])


def test_method_lists_come_from_the_registry():
    notes: list[str] = []
    assert resolve_methods("all", notes=notes) == [*METHOD_NAMES, *VARIANTS] and not notes
    assert resolve_methods("fedavg,nosuch,nadp-4out", notes=notes) == ["fedavg", "nadp-4out"]
    assert len(notes) == 1 and "nosuch" in notes[0]
    assert set(mpddp.METHODS) == {m for m, spec in METHODS.items() if spec.family == "mpddp"} != set()
    # nadp's record-level comparator is the variant declared once in common
    args = argparse.Namespace(dataset="digits", train_subset=0, hidden="", sample_rate=0.8, num_rounds=3,
                              batch_size=100, lr=1.0, clip=1.0, delta=1e-5)
    cfg = nadp.run_config("record-ldp", args, 10, 1.0, 42, Path("x"))
    assert cfg["method"] == "nadp" and cfg["nadp-variant"] == "record-ldp"
    assert nadp.run_config("ldp", args, 10, 1.0, 42, Path("x"))["method"] == "ldp"


@pytest.mark.parametrize("name", [*METHOD_NAMES, *VARIANTS])
def test_every_benchmark_method_config_is_a_valid_run_config(name):
    """A variant (or family default) naming a run-config key that no longer exists fails here, not mid-benchmark."""
    method, extra = method_config(name)
    cfg = RunConfig.from_mapping({**app_defaults(), **extra, "method": method})
    assert cfg.method == method
    assert {k: cfg.to_mapping()[k] for k in extra} == extra


def test_benchmarks_take_the_reference_arm_and_the_roles_from_the_cards():
    from benchmarks.common import private, reference, with_reference
    from benchmarks.roundtime import _intermediate_servers
    from protocols.methods.mpddp import ABLATION

    assert reference() == "fedavg" and not private("fedavg") and private("ldp") and private("nadp-record-ldp")
    assert with_reference(["ldp"]) == ["fedavg", "ldp"] and with_reference(["ldp", "fedavg"]) == ["ldp", "fedavg"]
    # the deployment cluster starts what the methods' cards ask for (ddpsa: ddpsa-num-servers), none otherwise
    base = {"dataset": "digits"}
    assert _intermediate_servers(["fedavg", "ldp"], 4, 1.0, base, {}) == 0
    assert _intermediate_servers(["fedavg", "ddpsa"], 4, 1.0, base, {}) == 3
    assert _intermediate_servers(["ddpsa"], 4, 1.0, base, {"ddpsa": {"ddpsa-num-servers": 4}}) == 4
    assert [ABLATION.method, ABLATION.naive, ABLATION.trusted] == list(mpddp.METHODS)


def test_cli_registers_every_benchmark_module_and_parses_its_defaults():
    # reproduce: a tool; roundtrace: the breakdown of roundtime --trace; secagg_app: cost's SecAgg+ Flower app;
    # compose: the docker-compose deployment of roundtime --engine compose and the docker test
    helpers = {"cli", "common", "runs", "secagg", "secagg_app", "__main__", "adversary", "reproduce", "roundtrace",
               "compose"}
    modules = {m.name for m in pkgutil.iter_modules(benchmarks.__path__)} - helpers
    assert {path.rsplit(".", 1)[1] for path in cli.BENCHMARKS.values()} == modules
    parser = cli.build_parser()
    for name in cli.BENCHMARKS:
        module = cli.module(name)
        assert callable(module.run) and module.HELP
        assert cli.summary(name) == (module.HELP, module.__doc__)  # the listing read without importing
        assert parser.parse_args([name]).benchmark == name
    for name in ("all", *cli.ALL):
        assert parser.parse_args([name]).benchmark == name


def test_parse_method_sets():
    assert parse_method_sets(["mpddp:n-out=8", 'mpddp:graph="n-out"', "ldp:clip=2.0"]) == {
        "mpddp": {"n-out": 8, "graph": "n-out"}, "ldp": {"clip": 2.0}}


def test_median_over_repeats_takes_medians_per_method():
    raw = [
        {"name": "fedavg", "clients": 10, "status": "ok", "round_s": 1.0, "round_s_x_fedavg": 1.0, "repeat": 0},
        {"name": "nadp", "clients": 10, "status": "ok", "round_s": 1.5, "round_s_x_fedavg": 1.5, "repeat": 0},
        {"name": "fedavg", "clients": 10, "status": "ok", "round_s": 2.0, "round_s_x_fedavg": 1.0, "repeat": 1},
        {"name": "nadp", "clients": 10, "status": "failed 1/3 rounds", "round_s": 2.4, "round_s_x_fedavg": 1.2,
         "repeat": 1},
        {"name": "nadp", "clients": 10, "status": "ok", "round_s": math.nan, "round_s_x_fedavg": 1.3, "repeat": 2},
    ]
    rows = {r["name"]: r for r in overhead.median_over_repeats(raw)}
    assert list(rows) == ["fedavg", "nadp"] and "repeat" not in rows["nadp"]
    assert rows["fedavg"]["round_s"] == 1.5 and rows["nadp"]["round_s"] == pytest.approx(1.95)  # nan ignored
    assert rows["nadp"]["round_s_x_fedavg"] == pytest.approx(1.3)  # median of per-repeat ratios
    assert rows["nadp"]["status"] == "failed 1/3 rounds" and rows["nadp"]["clients"] == 10


def test_recovery_benchmark_measures_recovery_and_secaggplus_unmask(tmp_path):
    """cancelfl-bench recovery at 8 clients, 25 % dropping: every row recovers; the bytes grow with the dropped."""
    out = tmp_path / "recovery"
    status = cli.main(["recovery", "--clients", "8", "--dropouts", "0.25", "--methods", "nadp,mpddp", "--hidden", "8",
                       "--out", str(out)])
    rows = {r["name"]: r for r in _rows(out / "recovery.csv")}
    assert status == 0 and len(rows) == 3, rows
    for name, r in rows.items():
        assert r["status"] == "ok" and int(r["dropped"]) == 2 and int(r["survivors"]) == 6, (name, r)
        assert float(r["client_s"]) > 0 and float(r["bytes_up"]) > 0
    # nadp and mpddp: one 32-byte pair seed per dropped neighbour (2 here), plus framing
    assert float(rows["cancelfl nadp"]["bytes_up"]) >= 64 and float(rows["cancelfl nadp"]["pairs"]) == 12


def _table(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_compare_tables_names_every_figure_that_moved(tmp_path):
    from benchmarks.reproduce import compare_tables

    base = [{"name": "fedavg", "status": "ok", "x": 1.0}, {"name": "nadp", "status": "ok", "x": 1.1}]
    _table(tmp_path / "a.csv", base)
    _table(tmp_path / "same.csv", [{**r, "x": r["x"] * 1.05} for r in base])
    assert compare_tables(tmp_path / "a.csv", tmp_path / "same.csv", {"status": 0.0, "x": 0.15}, None, ("name",)) == []
    _table(tmp_path / "moved.csv", [base[0], {"name": "nadp", "status": "failed", "x": 1.5}])
    problems = compare_tables(tmp_path / "a.csv", tmp_path / "moved.csv", {"status": 0.0, "x": 0.15}, None, ("name",))
    assert len(problems) == 2 and "nadp status" in problems[0] and "nadp x: recorded 1.1, now 1.5" in problems[1]
    _table(tmp_path / "gone.csv", [base[0]])
    assert compare_tables(tmp_path / "a.csv", tmp_path / "gone.csv", {"x": 0.15}, None, ("name",)) == [
        "a.csv: row 'nadp' is gone"]


def test_reproduce_reruns_the_recorded_command_and_fails_on_a_figure_that_no_longer_holds(tmp_path, capsys,
                                                                                         monkeypatch):
    """A recorded roundtime result, one figure tampered: the rerun reproduces the rest and names only that one."""
    import json

    for name in cli.MEASURED_ENV:
        monkeypatch.delenv(name, raising=False)

    out = tmp_path / "roundtime"
    argv = ["roundtime", "--methods", "fedavg,ldp", "--clients", "3", "--dataset", "digits", "--rounds", "2",
            "--repeats", "1", "--test-subset", "100", "--out", str(out)]
    assert cli.main(argv) == 0
    assert json.loads((out / "record.json").read_text())["command"] == "cancelfl-bench " + " ".join(argv)
    with (out / "roundtime.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    rows[1]["bytes_per_client_round"] = str(float(rows[1]["bytes_per_client_round"]) / 1000)  # ldp's bytes: planted
    _table(out / "roundtime.csv", rows)
    capsys.readouterr()
    # Timing ratios of one timed round on a shared, loaded machine move by several times: a tolerance of 50x for
    # every column still tells them from the planted figure (now 1000x the record); the status must match exactly.
    assert cli.main(["reproduce", str(out), "--tolerance", "50"]) == 1
    err = capsys.readouterr().err
    assert "NOT REPRODUCED" in err and "ldp bytes_per_client_round" in err and "(1 figure(s))" in err, err


def test_a_record_carries_the_measured_environment_and_reproduce_sets_it_again(tmp_path, monkeypatch):
    from benchmarks.reproduce import _rerun_argv

    for name in cli.MEASURED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CANCELFL_DATA_CACHE", "off")
    monkeypatch.setenv("CANCELFL_TRACE", str(tmp_path / "t.jsonl"))  # where output goes, not what is measured
    out = tmp_path / "grid"
    argv = ["grid", "--methods", "fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "1",
            "--epsilons", "1", "--test-subset", "100", "--out", str(out)]
    import json

    assert cli.main(argv) == 0
    command = json.loads((out / "record.json").read_text())["command"]
    assert command == "CANCELFL_DATA_CACHE=off cancelfl-bench " + " ".join(argv)
    env, rerun = _rerun_argv(command, tmp_path / "again")
    assert env == {"CANCELFL_DATA_CACHE": "off"}
    assert rerun == [*argv[:-1], str(tmp_path / "again")]


def test_scale_drops_clients_and_reports_per_client_memory_server_time_and_neighbours(tmp_path):
    """cancelfl-bench scale, in-process, 6 clients, 1/6 dropping: one client withheld per round, nadp recovers."""
    import json

    out = tmp_path / "scale"
    status = cli.main(["scale", "--clients", "6", "--dropouts", "0.17", "--methods", "fedavg,nadp", "--hidden", "8",
                       "--out", str(out)])
    rows = {(r["name"], float(r["dropouts"])): r for r in _rows(out / "scale.csv")}
    assert status == 0 and set(rows) == {("fedavg", 0.17), ("nadp", 0.17)}, rows
    for key, r in rows.items():
        assert r["status"] == "ok", (key, r["status"])
        for col in ("client_s", "server_s", "peak_rss_mb", "bytes_down", "bytes_up"):
            assert float(r[col]) > 0, (key, col, r[col])
    assert float(rows[("nadp", 0.17)]["neighbours"]) == 5  # 8-out on 6 clients: everyone is a neighbour (key phase)
    assert math.isnan(float(rows[("fedavg", 0.17)]["neighbours"]))  # no pairing
    fedavg = [json.loads(line) for line in (out / "runs" / "fedavg-k6-d0.17" / "metrics.jsonl").open()]
    assert [m["clients"] for m in fedavg] == [5, 5]  # the withheld client sent nothing
    nadp_rounds = [json.loads(line) for line in (out / "runs" / "nadp-k6-d0.17" / "metrics.jsonl").open()]
    assert all(m["dropped"] == 1 and m["recovery"] == 1 and not m["failed"] for m in nadp_rounds)  # noise recovered


def test_defaults_method_set_reaches_only_its_method(tmp_path, monkeypatch):
    """``--method-set ddpsa:KEY=VALUE`` adds the key to ddpsa's runs only; keys the benchmark sets are refused."""
    import server.launch
    from benchmarks import defaults

    seen: dict[str, dict] = {}

    def fake(raw, progress=None):
        seen[raw["method"]] = raw
        raise RuntimeError("not run")

    monkeypatch.setattr(server.launch, "run_inprocess", fake)
    parser = cli.build_parser()
    args = parser.parse_args(["defaults", "--datasets", "digits", "--methods", "ddpsa,cdp", "--out", str(tmp_path),
                              "--method-set", 'ddpsa:ddpsa-noise="gaussian"', "ddpsa:num-rounds=3"])
    assert defaults.run(args) == 1  # failed runs: a rule is unchecked
    assert seen["ddpsa"]["ddpsa-noise"] == "gaussian" and seen["ddpsa"]["num-rounds"] == 3
    assert "ddpsa-noise" not in seen["cdp"] and "num-rounds" not in seen["cdp"]
    bad = parser.parse_args(["defaults", "--out", str(tmp_path), "--method-set", "ddpsa:seed=1"])
    with pytest.raises(SystemExit, match="method-set"):
        defaults.run(bad)
