"""The launcher's contract after start, end to end.

Honest exit codes, fresh run folders, checkpoints and resume with continuous epsilon, and no process left
behind.  Refusals before any process starts: tests/test_launch_refusals.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from protocols.config import RunConfig
from server.launch import main, run_inprocess
from server.processes import LAUNCH_MARK, Processes, marked_pids
from strategies.base import CancelStrategy, RoundFailed
from strategies.run.checkpoint import CHECKPOINT_JSON, LEDGER_DIR, ResumeError, fresh_run_folder, load_checkpoint
from tests.conftest import ROOT, Crash, crash_after, read_metrics
from tests.processes import pid_gone

#: A small, fast federation (in-process: a few seconds).
FAST = {"num-clients": 4, "local-epochs": 1, "hidden": "", "dataset": "digits", "train-subset": 400, "test-subset": 200}


def _same(a: list, b: list) -> bool:
    """Equal lists of epsilons (None = no guarantee) up to float round-off."""
    return len(a) == len(b) and all(x == y if x is None or y is None else x == pytest.approx(y, rel=1e-12)
                                    for x, y in zip(a, b, strict=True))


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


# ------------------------------------------------------------------ run folders and exits
def test_default_runs_get_fresh_folders_and_latest_points_at_the_newest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "runs" / "latest"
    old.mkdir(parents=True)
    (old / "summary.json").write_text("{}")  # a real folder named latest: kept, renamed
    a, b = fresh_run_folder("nadp"), fresh_run_folder("nadp")
    assert a != b and a.is_dir() and b.is_dir()
    assert (tmp_path / "runs" / "latest").resolve() == b.resolve()
    assert any((p / "summary.json").is_file() for p in (tmp_path / "runs").glob("*-latest"))


def test_earlier_outputs_are_refused_or_replaced(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"final_accuracy": 0.99}')
    code, err = _cli(capsys, "run", "--run-config", f'out-dir="{out}"')
    assert code == 2 and "earlier run's outputs" in err and "--overwrite" in err
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] == 0.99


def test_crash_gives_nonzero_exit_and_no_stale_summary(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"final_accuracy": 0.99}')

    def crash(*_a, **_k):
        raise RuntimeError("injected ServerApp crash")

    monkeypatch.setattr("server.runner.evaluate", crash)
    code, err = _cli(capsys, "run", "--overwrite", "--run-config", f'num-rounds=2 out-dir="{out}"')
    assert code == 1 and "injected ServerApp crash" in err
    assert not (out / "summary.json").exists()


def test_no_successful_round_exits_nonzero(tmp_path, capsys, monkeypatch):
    def fail(self, state):
        raise RoundFailed(f"round {state.round}: injected failure")

    monkeypatch.setattr(CancelStrategy, "aggregate", fail)
    out = tmp_path / "run"
    code, err = _cli(capsys, "run", "--run-config", f'num-rounds=2 num-clients=3 out-dir="{out}"')
    assert code == 1 and "no round succeeded" in err and "injected failure" in err, err


def test_a_failed_round_prints_one_line_without_the_kept_models_accuracy(tmp_path, monkeypatch):
    """Round 2 fails: its console line says FAILED and why, with the epsilon, not an accuracy as if it trained."""
    inner = CancelStrategy.aggregate

    def fail_round_2(self, state):
        if state.round == 2:
            raise RoundFailed("round 2: injected failure")
        return inner(self, state)

    monkeypatch.setattr(CancelStrategy, "aggregate", fail_round_2)
    lines: list[str] = []
    run_inprocess({**FAST, "method": "ldp", "num-rounds": 2, "out-dir": str(tmp_path)}, progress=lines.append)
    (line,) = [x for x in lines if x.startswith("round 2/2")]
    assert line.startswith("round 2/2  FAILED: round 2: injected failure  eps ") and " acc " not in line, line


def test_a_diverged_run_reports_the_saved_model(tmp_path):
    """A learning rate of 1e30 diverges in round 1: summary's final figures are those of model.npz (round 0), evaluated anew."""
    from protocols.task.data import dataset_for
    from protocols.task.models import load_npz_model
    from protocols.task.training import evaluate

    out = tmp_path / "diverged"
    lines: list[str] = []
    run_inprocess({"method": "nadp", "num-rounds": 2, "dataset": "breast-cancer", "num-clients": 3, "lr": 1e30,
                   "out-dir": str(out)}, progress=lines.append)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_for"] == "divergence" and summary["model_round"] == 0
    (stop,) = [x for x in lines if "STOPPED" in x]
    assert "lower run-config 'lr' than 1e+30" in stop and "'divergence-factor' = 0" in stop, stop
    model, _ = load_npz_model(out / "model.npz")
    ds = dataset_for(RunConfig.from_mapping(summary["config"]))
    loss, acc = evaluate(model, ds.x_test, ds.y_test)
    assert summary["final_accuracy"] == pytest.approx(acc) and summary["final_loss"] == pytest.approx(loss)
    assert summary["final_loss"] == pytest.approx(summary["initial_loss"])  # round 0: the initial model
    assert summary["learning_check"]["final_accuracy"] == summary["final_accuracy"]
    assert f"done: final accuracy {acc:.4f}," in lines[-1], lines[-1]
    (row,) = read_metrics(out)  # what happened: the diverged round stays in the metrics
    assert row["test_loss"] > 100 * summary["initial_loss"] and row["test_accuracy"] != pytest.approx(acc)


# ------------------------------------------------------------------ checkpoint and resume
@pytest.mark.parametrize("overrides", [
    {"method": "nadp", "sample-rate": 0.5, "batch-size": 1000, "lr": 2.0},  # per-client accounts, sampling
    {"method": "mpddp", "dataset": "breast-cancer", "hidden": "8"},  # given-R account, the server's Adam moments
], ids=["nadp", "mpddp"])
def test_resume_after_crash_continues_rounds_and_epsilon(tmp_path, capsys, overrides):
    cfg = {**FAST, "num-rounds": 4, **overrides}
    run_inprocess({**cfg, "out-dir": str(tmp_path / "whole")}, progress=lambda _s: None)
    whole = read_metrics(tmp_path / "whole")
    out = tmp_path / "crashed"
    with pytest.raises(Crash):
        run_inprocess({**cfg, "out-dir": str(out)}, progress=crash_after(2))
    assert load_checkpoint(out).round == 2 and not (out / "summary.json").exists()
    code, _ = _cli(capsys, "run", "--resume", str(out))
    assert code == 0
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["resumed_after_round"] == 2 and not rows[2]["recharged_round"]
    # Every account, incl. extras (nadp's paper/marginal views); mpddp's given-R one depends on the random secret R.
    keys = [k for k in whole[-1] if k.startswith("epsilon") and k != "epsilon_given_R"]
    assert len(keys) >= 3
    for key in keys:
        assert _same([r.get(key) for r in rows], [r.get(key) for r in whole]), (key, rows, whole)
    # The clients' own ledgers (in the run folder) continue too: their lifetime figure is not reset by the crash.
    assert (out / LEDGER_DIR).is_dir()
    assert _same([r.get("client_epsilon_max") for r in rows], [r.get("client_epsilon_max") for r in whole])
    summary = json.loads((out / "summary.json").read_text())
    assert _same([summary["epsilon"]], [json.loads((tmp_path / "whole" / "summary.json").read_text())["epsilon"]])
    if overrides["method"] == "mpddp":  # the resumed server continued the crashed run's Adam, not a fresh one
        assert load_checkpoint(out).strategy_state["optimizer"]["t"] == 4


def test_resume_refuses_a_changed_run_config(tmp_path, capsys):
    out = tmp_path / "r"
    with pytest.raises(Crash):
        run_inprocess({**FAST, "method": "ldp", "num-rounds": 3, "out-dir": str(out)}, progress=crash_after(1))
    code, err = _cli(capsys, "run", "--resume", str(out), "--run-config", "epsilon=8.0")
    assert code == 2 and "epsilon" in err and "cannot change" in err
    code, err = _cli(capsys, "run", "--resume", str(tmp_path / "nothing"))
    assert code == 2 and "does not exist" in err


@pytest.mark.slow
def test_killed_process_resumes_with_continuous_epsilon(tmp_path, capsys):
    """``cancelfl run`` killed with SIGKILL mid-run, then ``--resume``: every planned round once.

    Epsilon is never reset: equal to an uninterrupted run's up to the kill.  A round killed after its train
    messages went out is charged again; the rounds after it get more noise, so the run still ends within
    its target (strategies/run/budget.py).
    """
    cfg = {**FAST, "method": "ldp", "num-rounds": 12, "divergence-factor": 0.0, "train-subset": 200}
    text = " ".join(f"{k}={json.dumps(v)}" for k, v in cfg.items())
    out = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "server.launch", "run", "--run-config", f'{text} out-dir="{out}"'],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:  # the live run replaces its model file after naming the new one: a read may race it
            if (out / CHECKPOINT_JSON).is_file() and load_checkpoint(out).round >= 2:
                break
        except ResumeError:
            pass
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    k = load_checkpoint(out).round
    assert 2 <= k < 12, "the run was not killed mid-way"
    assert main(["run", "--resume", str(out)]) == 0
    rows = read_metrics(out)
    run_inprocess({**cfg, "out-dir": str(tmp_path / "whole")}, progress=lambda _s: None)
    ref = read_metrics(tmp_path / "whole")
    assert [r["round"] for r in rows] == list(range(1, 13))
    eps = [r["epsilon"] for r in rows]
    assert eps == sorted(eps)
    assert _same(eps[:k], [r["epsilon"] for r in ref[:k]])
    if not rows[k]["recharged_round"]:  # killed between rounds: exactly the uninterrupted accounts
        assert _same(eps, [r["epsilon"] for r in ref])
    else:  # the killed round counts twice: dearer than the uninterrupted run's, the rest with raised noise
        assert eps[k] > ref[k]["epsilon"] * (1 + 1e-9)
        assert rows[k]["noise_scale"] > 1.0  # (later rounds go back to 1 once the reserve held back covers them)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epsilon"] <= summary["privacy"]["target_epsilon"] and not summary["privacy"]["over_target"]
    capsys.readouterr()


def test_strategy_state_round_trips_for_every_method():
    from protocols.methods import METHOD_NAMES
    from strategies.registry import build_strategy

    for method in METHOD_NAMES:
        if method == "ddpsa":
            continue  # needs its servers' credentials to be built; same ledger-only state as the base
        cfg = RunConfig.from_mapping({**FAST, "method": method, "hidden": "8", "dataset": "breast-cancer"})
        a, b = build_strategy(cfg), build_strategy(cfg)
        state = json.loads(json.dumps(a.state_dict()))
        b.load_state(state)
        assert b.state_dict() == state, method
        assert b.privacy.report() == a.privacy.report(), method


# ------------------------------------------------------------------ processes
def test_close_stops_groups_whose_leader_died_and_descendants_that_left(tmp_path):
    """A leader killed first leaves its group's children; a grandchild in its own session leaves the group."""
    script = tmp_path / "tree.py"
    pids = tmp_path / "pids"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{a.pid}} {{b.pid}}')\n"
        "time.sleep(300)\n")
    env = dict(os.environ, **{LAUNCH_MARK: "test-" + os.urandom(6).hex()})
    procs = Processes(tmp_path, env)
    leader = procs.start("tree", [sys.executable, str(script)])
    deadline = time.time() + 30
    while not (pids.is_file() and pids.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    children = [int(p) for p in pids.read_text().split()]
    assert sorted(marked_pids(env[LAUNCH_MARK])) == sorted([leader.pid, *children])
    os.kill(leader.pid, signal.SIGKILL)  # the leader dies first
    leader.wait()
    procs.close(grace=5)
    assert all(pid_gone(p) for p in children), "descendants left running"
    assert marked_pids(env[LAUNCH_MARK]) == []


def test_launch_module_needs_no_activated_venv():
    """Flower's processes are started from this interpreter's bin folder (``.venv/bin/cancelfl`` unactivated)."""
    from server.flower_commands import BIN, flower_env

    fenv = flower_env(Path("/tmp/x"))
    assert fenv["PATH"].split(os.pathsep)[0] == str(BIN) and (BIN / "flower-superexec").exists()
    assert LAUNCH_MARK in fenv and LAUNCH_MARK not in os.environ  # the mark goes to the children only


def test_ledger_state_keeps_an_extra_account_shared_with_a_view():
    from protocols.privacy import GaussianEvent, PrivacyLedger, RdpAccountant

    shared = RdpAccountant()
    ledger = PrivacyLedger(1e-5, downlink=shared, headline="downlink", extra={"uplink_nominal": shared})
    ledger.compose(GaussianEvent(2.0))
    back = PrivacyLedger.from_state(json.loads(json.dumps(ledger.to_state())))
    assert back.extra["uplink_nominal"] is back.downlink
    back.compose(GaussianEvent(2.0))
    assert back.extra_report()["epsilon_uplink_nominal"] == back.report()["epsilon_downlink"]


@pytest.mark.deployment
def test_killed_supernodes_children_are_stopped_with_the_cluster():
    """A SuperNode killed by SIGKILL can leave its ``flower-superexec`` running; closing the cluster stops it."""
    from server.deploy import LocalCluster

    with LocalCluster(1) as cluster:
        supernode = next(p for name, p in cluster.procs.procs if name == "supernode-0")
        deadline = time.time() + 120
        children: list[int] = []
        while not children and time.time() < deadline:
            children = [p for p in cluster.procs.descendants() if p != supernode.pid and _pgid(p) == supernode.pid
                        and "flower-superexec" in _cmdline(p)]  # the warm ClientApp process dies with its SuperNode
            time.sleep(0.5)
        assert children, "the SuperNode started no child (flower-superexec)"
        os.kill(supernode.pid, signal.SIGKILL)  # its children may outlive it (Flower's parent monitor polls)
        supernode.wait()
    assert all(pid_gone(p) for p in children)
    assert cluster.procs.descendants() == []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _model(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "model.npz") as npz:
        return {k: npz[k] for k in npz.files if not k.startswith("__")}


def test_model_ema_publishes_the_average_of_the_global_models_and_survives_resume(tmp_path, capsys):
    """model-ema: the saved model is decay * average + (1 - decay) * the latest global model.

    fedavg is deterministic given the seed, so the global models of rounds 1 and 2 are those of plain runs.
    """
    base = {**FAST, "method": "fedavg"}
    run_inprocess({**base, "num-rounds": 1, "model-ema": 0.0, "out-dir": str(tmp_path / "r1")}, progress=lambda _s: None)
    run_inprocess({**base, "num-rounds": 2, "model-ema": 0.0, "out-dir": str(tmp_path / "r2")}, progress=lambda _s: None)
    ema = run_inprocess({**base, "num-rounds": 2, "model-ema": 0.75, "out-dir": str(tmp_path / "ema")},
                        progress=lambda _s: None)
    w1, w2, got = _model(tmp_path / "r1"), _model(tmp_path / "r2"), _model(tmp_path / "ema")
    assert set(got) == set(w1) and any(not np.allclose(w1[k], w2[k]) for k in w1)
    for k in got:
        np.testing.assert_allclose(got[k], 0.75 * w1[k] + 0.25 * w2[k], rtol=1e-5, atol=1e-6)
    assert ema["config"]["model-ema"] == 0.75
    # the checkpoint keeps the global model (training goes on from it) and the published average apart
    ckpt = load_checkpoint(tmp_path / "ema")
    for k in got:
        np.testing.assert_allclose(ckpt.weights[k], w2[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ckpt.published[k], got[k], rtol=1e-6, atol=1e-7)
    # a crash after round 1 and a resume give the same published model as the uninterrupted run
    out = tmp_path / "crashed"
    with pytest.raises(Crash):
        run_inprocess({**base, "num-rounds": 2, "model-ema": 0.75, "out-dir": str(out)}, progress=crash_after(1))
    assert load_checkpoint(out).published is not None
    code, _ = _cli(capsys, "run", "--resume", str(out))
    assert code == 0
    resumed = _model(out)
    for k in got:
        np.testing.assert_allclose(resumed[k], got[k], rtol=1e-5, atol=1e-6)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
