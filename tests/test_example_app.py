"""examples/nadp_breast_cancer: a user's own Flower app on the library API, run as its README says.

The app writes its settings once (pyproject [tool.flwr.app.config]); the ClientApp holds none and gets them
from the strategy's messages, so ``flwr.simulation.run_simulation`` (no run config) runs nadp end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from protocols.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "nadp_breast_cancer"


@pytest.fixture(scope="module")
def example_modules():
    """The example's package on sys.path (as `flwr run` / run.py put it)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        from nadp_app import client_app, task
        yield client_app, task
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.mark.slow
def test_run_simulation_runs_the_example_with_settings_from_the_strategy(tmp_path):
    """`python run.py` completes every round with nadp (the clients never see a run config)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLE / "run.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["rounds_completed"] == 3 and summary["config"]["method"] == "nadp", summary
    assert 0 < summary["epsilon"] <= 8.0 + 1e-9
    assert "does not handle phase" not in out and "with valid keys, got 0" not in out


def test_client_method_mismatch_stops_the_run_naming_the_fix(example_modules, tmp_path):
    """A ClientApp whose run config names another method than the strategy's: the run stops before round 1 ends."""
    from server.local_grid import LocalGrid
    from strategies import NadpStrategy

    client_app, task = example_modules
    strategy = NadpStrategy(**task.settings({}), out_dir=str(tmp_path / "run"))
    grid = LocalGrid(client_app.app, strategy.cfg.num_clients, {"method": "fedavg"})
    with pytest.raises(ConfigError, match='method=.nadp.'):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()))


def test_a_strategy_given_another_methods_settings_is_refused_naming_the_fix(example_modules):
    """The ServerApp's NadpStrategy built from a run config that says method="ldp": refused before any round."""
    from strategies import NadpStrategy

    _, task = example_modules
    with pytest.raises(ConfigError, match="drop 'method'.*LocalDPStrategy"):
        NadpStrategy(**{**task.settings({}), "method": "ldp"})
    assert NadpStrategy(**{**task.settings({}), "method": "nadp"}).cfg.method == "nadp"


def test_a_message_without_settings_and_no_run_config_is_refused_naming_the_fix(example_modules):
    """protect() with neither the strategy's settings nor a run-config method: ConfigError that says what to do."""
    from client.api import protect

    _, task = example_modules
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                      run_config={})
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=1, message_type="train")
    x, y = task.partition(0, 2)
    with pytest.raises(ConfigError, match="NadpStrategy"):
        protect(msg, context, task.Net(), x, y)
