"""Plain ``flwr run .`` as a new Flower user types it: fresh FLWR_HOME, Flower's default local federation.

Flower creates ``$FLWR_HOME/config.toml`` with the ``:local:`` connection and starts a detached
simulation-mode SuperLink with 2 SuperNodes.  Flower's per-run environment is on (as for a new user) and
uv runs offline with an empty cache: it must install nothing (pyproject ``[tool.uv] exclude-dependencies``).
The app's ``num-clients = "auto"`` takes the 2 SuperNodes and trains; a ``num-clients`` the user set stops
the run within seconds with one line naming the fix.  The second run reuses the SuperLink the first one
started, as Flower does; the test stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from server.defaults import APP_DIR
from server.flower_commands import BIN, flower_env
from server.processes import free_port
from tests.processes import pid_gone

slow = [pytest.mark.slow, pytest.mark.deployment]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _processes_of(flwr_home: Path) -> list[int]:
    """Pids of the processes whose environment names ``flwr_home`` (those this test started)."""
    mine = f"FLWR_HOME={flwr_home}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if mine in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


def _stop(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.time() + 10
        while time.time() < deadline and not all(pid_gone(p) for p in pids):
            time.sleep(0.2)


@pytest.fixture(scope="module")
def flwr_home(tmp_path_factory):
    """A fresh FLWR_HOME and Flower's environment for it (own local SuperLink ports, uv offline, empty cache)."""
    home = tmp_path_factory.mktemp("flwr") / "flwr-home"
    env = flower_env(home)
    env.update(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()), FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
               UV_OFFLINE="1", UV_CACHE_DIR=str(home.parent / "uv-cache"))
    env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", None)
    yield home, env
    _stop(_processes_of(home))
    assert not _processes_of(home)


def _flwr_run(home: Path, env: dict[str, str], run_config: str) -> str:
    """``flwr run . --stream --run-config <run_config>``; its output (it exits 0 once the run is submitted)."""
    proc = subprocess.run([str(BIN / "flwr"), "run", ".", "--stream", "--run-config", run_config], cwd=APP_DIR,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=420)
    if "Failed to start local SuperLink within" in proc.stdout:  # Flower's fixed 15 s start limit, on a busy machine
        proc = subprocess.run([str(BIN / "flwr"), "run", ".", "--stream", "--run-config", run_config],
                              cwd=APP_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def test_every_dependency_is_excluded_from_flowers_per_run_environment():
    project = tomllib.loads((APP_DIR / "pyproject.toml").read_text())
    deps = list(project["project"]["dependencies"])
    for extra in project["project"]["optional-dependencies"].values():
        deps += extra
    names = {_NAME.match(d).group(0).lower().replace("_", "-") for d in deps}
    excluded = set(project["tool"]["uv"]["exclude-dependencies"])
    assert names <= excluded, f"add to [tool.uv] exclude-dependencies: {sorted(names - excluded)}"
    assert "index" not in project["tool"].get("uv", {}), "the per-run environment uses no package index"


@pytest.mark.slow
@pytest.mark.deployment
def test_plain_flwr_run_trains_on_the_default_federation(flwr_home, tmp_path):
    home, env = flwr_home
    out_dir = tmp_path / "run"
    out = _flwr_run(home, env, f'num-rounds=1 train-subset=400 test-subset=200 out-dir="{out_dir}"')
    assert (home / "config.toml").is_file() and ":local:" in (home / "config.toml").read_text()
    assert "No additional application dependencies needed installation." in out, out[-3000:]
    assert "cancelfl: num-clients = 2, the federation's nodes" in out, out[-3000:]
    assert "round 1/1" in out and "done: final accuracy" in out, out[-3000:]
    assert (out_dir / "model.npz").is_file()
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["config"]["num-clients"] == 2
    # The last line names the SuperLink `flwr run` left running, and it is that SuperLink.
    hint = re.search(r"Flower's local SuperLink \(pid (\d+), 127\.0\.0\.1:(\d+)\).*stop it with: kill (\d+)", out)
    assert hint, out[-3000:]
    pid = int(hint.group(1))
    assert hint.group(2) == env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] and int(hint.group(3)) == pid
    assert pid in _processes_of(home) and b"flower-superlink" in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.slow
@pytest.mark.deployment
def test_a_num_clients_the_federation_lacks_stops_with_a_one_line_fix(flwr_home, tmp_path):
    home, env = flwr_home
    out_dir = tmp_path / "run"
    out = _flwr_run(home, env, f'num-clients=5 num-rounds=1 out-dir="{out_dir}"')
    fix = [line for line in out.splitlines() if "cancelfl: the federation's SuperNodes were started for 2" in line]
    assert fix, out[-3000:]
    assert "flwr run . --stream --federation-config 'num-supernodes=5'" in fix[0]
    assert "flwr run . --stream --run-config 'num-clients=2'" in fix[0]
    assert "round 1/" not in out
    assert "FederationMismatch" in json.loads((out_dir / "error.json").read_text())["error"]
