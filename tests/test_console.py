"""What a new user sees: the round lines (short, detailed with --verbose), the help, Flower's noise filtered."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from client.app import app as client_app
from client.env import ClientEnv
from client.identity import first_notice_of_run, node_identity
from protocols.methods import METHOD_NAMES, VARIANTS
from server.compare import DEFAULT_METHODS
from server.defaults import app_defaults
from server.flower_commands import RAY_START_HINT, Echo, shown
from server.launch import main as cancelfl
from server.launch import run_inprocess
from server.local_grid import LocalGrid

ROOT = Path(__file__).resolve().parent.parent
TINY = {"dataset": "digits", "num-clients": 2, "num-rounds": 1, "hidden": "", "local-epochs": 1, "batch-size": 1000}
SPHINX = re.compile(r":[a-z]+:`|``")
SHORT = re.compile(r"^round 1/1  acc 0\.\d{3}  eps (\d+\.\d\d/1\.00|none \(no DP\))  \d+\.\d s$")


def _round_lines(tmp_path: Path, method: str, verbose: bool) -> list[str]:
    lines: list[str] = []
    run_inprocess({**TINY, "method": method, "out-dir": str(tmp_path / f"{method}-{verbose}")},
                  progress=lines.append, verbose=verbose)
    return [line for line in lines if line.startswith("round ")]


@pytest.mark.parametrize("method", ["ldp", "fedavg"])
def test_round_line_is_short_by_default(tmp_path, method):
    (line,) = _round_lines(tmp_path, method, verbose=False)
    assert SHORT.match(line), line
    assert len(line) <= 60
    assert ("none (no DP)" in line) == (method == "fedavg")


def test_settings_that_leave_no_noise_say_so_and_print_no_epsilon(tmp_path):
    """niss-tau = 0: the shares cancel exactly, so the run has no guarantee; it says so, not an epsilon target."""
    lines: list[str] = []
    run_inprocess({**TINY, "method": "niss", "num-clients": 3, "niss-tau": 0.0, "out-dir": str(tmp_path / "t0")},
                  progress=lines.append, verbose=False)
    assert any(line.startswith("privacy: niss with these settings leaves no DP noise") for line in lines), lines
    (line,) = [line for line in lines if line.startswith("round ")]
    assert SHORT.match(line) and "eps none (no DP)" in line, line


def test_round_line_is_detailed_with_verbose(tmp_path):
    (line,) = _round_lines(tmp_path, "ldp", verbose=True)
    short, _, details = line.partition("  | ")
    assert SHORT.match(short), line
    for part in ("loss ", "eps upload ", ", model ", "clients 2", "per client"):
        assert part in details, line


def test_cancelfl_run_verbose_flag_reaches_the_round_loop(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cancelfl(["run", "--verbose", "--run-config", f'method="ldp" num-clients=2 num-rounds=1 hidden="" '
                     f'out-dir="{out}"']) == 0
    printed = capsys.readouterr().out
    (line,) = [x for x in printed.splitlines() if x.startswith("round 1/1")]
    assert "clients 2" in line and "eps upload" in line
    assert "starting 2 in-process clients" in printed  # said before the slow start-up


def _help(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = ("import sys\nfrom server.launch import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in ('torch', 'flwr', 'dp_accounting', 'ray', 'scipy') if m in sys.modules))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120, check=True).stdout


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["compare", "--help"]])
def test_help_lists_the_methods_in_plain_text_without_loading_torch(args):
    text = _help(*args)
    body, _, imported = text.rpartition("IMPORTED ")
    assert imported.strip() == "[]", imported
    for name in (*METHOD_NAMES, *VARIANTS):
        assert re.search(rf"^  {re.escape(name)}\s", body, re.M), name
    assert not SPHINX.search(body), SPHINX.search(body)


def test_run_help_gives_the_main_keys_with_their_real_defaults():
    body = _help("run", "--help")
    defaults = app_defaults()
    for key in ("method", "dataset", "num-clients", "num-rounds", "epsilon", "delta"):
        value = defaults[key]
        shown_value = f'"{value}"' if isinstance(value, str) else str(value)
        assert re.search(rf"^  {key}\s+{re.escape(shown_value)}\s", body, re.M), key


def test_compare_help_states_its_real_default_methods():
    assert f"default {DEFAULT_METHODS}" in " ".join(_help("compare", "--help").split())


def test_audit_help_lists_the_auditable_methods_and_real_defaults_without_loading_torch():
    from server.audit_spec import AuditSpec, auditable_methods

    text = _help("audit", "--help")
    body, _, imported = text.rpartition("IMPORTED ")
    assert imported.strip() == "[]", imported
    for name in auditable_methods():
        assert re.search(rf"^  {re.escape(name)}\s", body, re.M), name
    assert not re.search(r"^  fedavg\s", body, re.M)  # no claim to audit
    flat = " ".join(body.split())
    assert f"(default: {AuditSpec.epsilon})" in flat and "(default: upload)" in flat
    assert not SPHINX.search(body), SPHINX.search(body)


def test_bench_help_lists_every_benchmark_without_loading_torch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = ("import sys\nfrom benchmarks.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in ('torch', 'flwr', 'dp_accounting', 'ray') if m in sys.modules))")
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120, check=True).stdout
    body, _, imported = text.rpartition("IMPORTED ")
    assert imported.strip() == "[]", imported
    from benchmarks.cli import BENCHMARKS, summary

    for name in BENCHMARKS:
        assert name in body and summary(name)[0].split()[0] in body
    from protocols.methods import METHODS

    methods = body.split("methods (the names --methods takes):", 1)[1]
    assert all(re.search(rf"^  {re.escape(m)}\s", methods, re.M) for m in METHODS) and "cancelfl run --help" in methods
    assert not SPHINX.search(body), SPHINX.search(body)


def test_flower_notices_that_do_not_concern_the_user_are_filtered():
    never = "\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n"
    chatter = "\x1b[92mINFO \x1b[0m:      Starting logstream for run_id `123`\n"
    ours = "round 3/20  acc 0.842  eps 0.31/1.00  1.8 s\n"
    error = "\x1b[91mERROR \x1b[0m:     ServerApp raised an exception\n"
    assert not shown(never, verbose=False) and not shown(never, verbose=True)
    assert not shown(chatter, verbose=False) and shown(chatter, verbose=True)
    for line in (ours, error):
        assert shown(line, verbose=False) and shown(line, verbose=True)


def test_flower_tracebacks_fold_to_their_exception_line_and_a_busy_ray_names_the_fix():
    ray = "The current node timed out during startup. This could happen because the GCS has become overloaded."
    trace = ["\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):\n",
             '  File "vce_api.py", line 214, in run_api\n', "    backend = backend_fn()\n", "              ^^^^^^\n",
             f"Exception: {ray}\n"]
    stream = ["starting round 1 of 30 ...\n", f"\x1b[91mERROR \x1b[0m:     An exception occured!! {ray}\n", *trace,
              "\x1b[93mWARNING \x1b[0m:   Stopping Simulation Runtime.\n", *trace, "\n",
              "The above exception was the direct cause of the following exception:\n", "\n",
              "Traceback (most recent call last):\n", '  File "run_simulation.py", line 319\n',
              "RuntimeError: An error was encountered. Ending simulation.\n"]
    quiet = Echo(verbose=False)
    out = [line for line in stream if quiet(line)]
    assert out == [stream[0], stream[1], f"Exception: {ray}\n", stream[7],
                   "RuntimeError: An error was encountered. Ending simulation.\n"], out
    assert quiet.notes() == [f"cancelfl: {RAY_START_HINT}",
                             "cancelfl: the tracebacks above are shown as their last line; --verbose shows them whole"]
    loud = Echo(verbose=True)
    assert [line for line in stream if loud(line)] == [line for line in stream if shown(line, verbose=True)]
    calm = Echo(verbose=False)
    assert all(calm(line) for line in ("round 1/3  acc 0.9  eps 4.16/8.00  1.0 s\n",)) and calm.notes() == []


def test_simulation_identity_warning_is_said_once_per_run(monkeypatch):
    said: list[tuple] = []
    monkeypatch.setattr("client.identity.log", lambda *a: said.append(a))
    grid = LocalGrid(client_app, 3, {**app_defaults(), "method": "nadp", "num-clients": 3}, identities=False)
    for node in grid.node_ids:
        assert node_identity(ClientEnv.from_context(grid.contexts[node])).derived
    assert len(said) == 1 and "SIMULATION" in said[0][1]
    # Another process of the same run (a simulation's other worker) stays quiet; a new run is told again.
    run_id = grid.run.run_id
    check = f"from client.identity import first_notice_of_run as f; print(f('simulation-identity', {run_id}))"
    other = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=True).stdout
    assert other.strip() == "False"
    assert first_notice_of_run("simulation-identity", secrets.randbits(62))
