"""Plain ``flwr run .`` as a new Flower user types it: fresh FLWR_HOME, Flower's default local federation.

Flower 1.41 creates ``$FLWR_HOME/config.toml`` with the ``:local:`` connection and starts a detached
simulation-mode SuperLink with 2 SuperNodes; the app's default ``num-clients`` is 10.  The run must stop
within seconds of the ServerApp's start, naming the command that fixes it (server/federation.py).
Per-run dependency installation is off here (``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``, as the
README advises): it would build a fresh environment from the network.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from protocols.config import RunConfig
from server.defaults import APP_DIR, app_defaults
from server.flower_commands import BIN, flower_env
from server.processes import free_port
from tests.processes import pid_gone

pytestmark = [pytest.mark.slow, pytest.mark.deployment]


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


def _flwr_run(home: Path) -> tuple[str, float | None]:
    """``flwr run . --stream`` on a fresh FLWR_HOME; (output, seconds until the fix was printed or None)."""
    env = flower_env(home)
    env.update(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()), FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(BIN / "flwr"), "run", ".", "--stream"], cwd=APP_DIR, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, found_at = [], None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if found_at is None and "--federation-config 'num-supernodes=" in line:
                found_at = time.monotonic() - t0
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        _stop(_processes_of(home))
    return "".join(lines), found_at


def test_plain_flwr_run_on_the_default_federation_names_the_fix(tmp_path):
    home = tmp_path / "flwr-home"
    out, found_at = _flwr_run(home)
    if "Failed to start local SuperLink within" in out:  # Flower's fixed 15 s start limit, on a busy machine
        home = tmp_path / "flwr-home-2"
        out, found_at = _flwr_run(home)
    assert (home / "config.toml").is_file() and ":local:" in (home / "config.toml").read_text()
    assert found_at is not None, out[-3000:]
    # the app's default ("auto": 10 on the default dataset); Flower's local federation has 2 SuperNodes
    clients = RunConfig.from_mapping(app_defaults()).num_clients
    assert f"flwr run . --stream --federation-config 'num-supernodes={clients}'" in out
    assert "flwr run . --stream --run-config 'num-clients=2'" in out
    # The ServerApp stops before any round; the whole command (SuperLink and Ray start included) within 2 min.
    assert "round 1/" not in out
    assert found_at < 120, f"fix named only after {found_at:.0f} s"
    assert not _processes_of(home)
