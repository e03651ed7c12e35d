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


def _start_superlink(cwd: Path, env: dict[str, str], wait: float = 180.0) -> None:
    """Flower's local SuperLink started by hand on its port, as the troubleshooting page says; waits for /health."""
    import time
    import urllib.request

    from server.flower_commands import BIN

    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    subprocess.Popen([str(BIN / "flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
                      "--host", "127.0.0.1", "--port", port], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + wait
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"flower-superlink did not answer on port {port} within {wait:.0f} s")


@pytest.mark.slow
@pytest.mark.deployment
def test_flwr_run_runs_the_example_as_its_readme_says(tmp_path):
    """`flwr run . --stream --federation-config 'num-supernodes=4'` from a copy of the example, fresh FLWR_HOME.

    Flower's per-run environment is on and uv offline: the example's `[tool.uv]` table must leave it empty.
    """
    import shutil

    from server.flower_commands import BIN, flower_env
    from server.processes import free_port
    from tests.test_flwr_run import _processes_of, _stop

    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    home = tmp_path / "flwr-home"
    env = flower_env(home)
    env.update(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()), FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
               UV_OFFLINE="1", UV_CACHE_DIR=str(tmp_path / "uv-cache"))
    env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", None)
    env["PYTHONWARNINGS"] = os.environ.get("PYTHONWARNINGS", "")  # as a user has it: no filter from cancelfl's launcher
    cmd = [str(BIN / "flwr"), "run", ".", "--stream", "--federation-config", "num-supernodes=4"]
    try:
        proc = subprocess.run(cmd, cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=420)
        if "Failed to start local SuperLink within" in proc.stdout:  # Flower's fixed 15 s limit, busy machine:
            _start_superlink(app, env)  # the recipe docs/troubleshooting.md gives
            proc = subprocess.run(cmd, cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=420)
    finally:
        _stop(_processes_of(home))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "No additional application dependencies needed installation." in out, out[-3000:]
    assert "round 3/3" in out and "epsilon spent: upload" in out, out[-3000:]
    assert "FutureWarning" not in out, out[-3000:]
    summary = json.loads((app / "runs" / "latest" / "summary.json").read_text())
    assert summary["rounds_completed"] == 3 and summary["config"]["num-clients"] == 4
    assert 0 < summary["privacy"]["uplink"]["epsilon"] <= 8.0 + 1e-9
