"""The app under Flower's own simulation runtime (SuperLink in simulation mode + ``flwr run``).

A full round with the key-exchange phase (NADP) must complete there exactly as
in-process: the same strategy and ClientApp, but every message crosses the
SuperLink and ClientApps run in Ray workers.
"""

from __future__ import annotations

import json

import pytest

from server.deploy import run_simulation
from tests.conftest import read_metrics

pytestmark = [pytest.mark.slow]


def test_nadp_round_with_key_exchange_in_flower_simulation(tmp_path):
    out = tmp_path / "sim"
    # One full-batch local step per round on a linear model (the paper's setting): learns in 2 rounds.
    code = run_simulation({"method": "nadp", "num-rounds": 2, "num-clients": 5, "epsilon": 8.0, "hidden": "",
                           "local-epochs": 1, "batch-size": 1000, "lr": 4.0,
                           "cancellation-check": True, "out-dir": str(out)})
    assert code == 0
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2] and not any(r["failed"] for r in rows)
    assert max(r["cancellation_residual"] for r in rows) < 1e-9
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] > 0.2


def test_serverapp_crash_exits_nonzero_without_stale_summary_or_processes(tmp_path, capsys):
    """``flwr run`` exits 0 when the ServerApp crashes: the launcher must still fail, with the reason.

    mpddp with a CNN passes the run-config checks but its strategy refuses it inside the ServerApp
    (``cancelfl run`` would refuse it before starting anything; the library call does not check).
    An earlier run's summary.json in out-dir must not be taken for this run's; every process started
    for the run (SuperLink, its SuperExec in its own session, the ServerApp, Ray) must be gone.
    """
    from server.processes import pids_with_env
    from strategies.run.checkpoint import read_error

    out = tmp_path / "crash"
    out.mkdir()
    (out / "summary.json").write_text('{"final_accuracy": 0.99}')
    work = tmp_path / "work"
    code = run_simulation({"method": "mpddp", "model": "cnn", "num-clients": 2, "num-rounds": 1, "out-dir": str(out)},
                          keep_workdir=str(work))
    assert code == 1
    assert not (out / "summary.json").exists()
    assert "supports only model = 'mlp'" in read_error(out)
    assert "the run failed" in capsys.readouterr().err
    assert pids_with_env("FLWR_HOME", str(work / "flwr-home")) == []
