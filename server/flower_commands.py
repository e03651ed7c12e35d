"""Flower's command-line tools as the launcher drives them: environment, connection, SuperLink, ``flwr run``.

:func:`flower_env` gives every Flower process a private ``FLWR_HOME``, no telemetry or update check, this
interpreter's ``bin`` first on ``PATH`` and a fresh :data:`server.processes.LAUNCH_MARK`; :func:`submit` runs
``flwr run --stream`` and echoes its output less what :func:`shown` filters.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

from protocols.start_checks import START_NOTES_SHOWN_ENV
from server.defaults import APP_DIR, flower_run_config
from server.processes import LAUNCH_MARK

__all__ = ["BIN", "RAY_START_HINT", "RAY_TIP_FILTER", "VERBOSE_ENV", "Echo",
           "flower_env", "run_config_arg", "shown", "submit", "superlink_cmd",
           "toml_value", "write_connection"]

#: Environment variable of detailed round lines (the value of :data:`strategies.run.loop.VERBOSE_ENV`; that
#: module imports Flower and torch, which the launcher loads only in the processes it starts).
VERBOSE_ENV = "CANCELFL_VERBOSE"

#: This interpreter's bin folder: the Flower commands (``flower-superlink``, ``flwr``) the launcher runs.
BIN = Path(sys.executable).parent

#: Python warning filter every launched process gets: Ray's tip that a future Ray will stop hiding GPUs from
#: actors that asked for none (a note for Ray's own users; the behaviour here is today's, unchanged).
RAY_TIP_FILTER = "ignore::FutureWarning:ray._private.worker"


def flower_env(flwr_home: Path, *, verbose: bool = False, notes_shown: bool = False) -> dict[str, str]:
    """Environment for Flower processes: private config home, no telemetry or update check.

    ``verbose``: the ServerApp prints detailed round lines (``CANCELFL_VERBOSE``, read by
    :func:`strategies.run.loop.run_rounds`) and :func:`submit` echoes Flower's own start-up messages.
    ``notes_shown``: the launcher has shown the runs' start notes, so the ServerApp does not log them again
    (:data:`protocols.start_checks.START_NOTES_SHOWN_ENV`).
    """
    env = dict(os.environ)
    env.update(FLWR_HOME=str(flwr_home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
               PYTHONUNBUFFERED="1")
    env[VERBOSE_ENV] = "1" if verbose else "0"
    env[START_NOTES_SHOWN_ENV] = "1" if notes_shown else "0"
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS", ""), RAY_TIP_FILTER) if w)
    env[LAUNCH_MARK] = uuid.uuid4().hex
    # Ray (simulation runtime) otherwise binds its GCS and workers to the host's outward IP address; this
    # switch (Ray's single-machine mode) keeps every simulation socket on 127.0.0.1.
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(APP_DIR), env.get("PYTHONPATH", "")) if p)
    # Flower's processes start each other by name (flower-superexec, flwr-clientapp): give them this
    # interpreter's bin folder first, so `.venv/bin/cancelfl` works with the venv not activated.
    env["PATH"] = os.pathsep.join(p for p in (str(BIN), env.get("PATH", "")) if p)
    return env


def toml_value(value: object) -> str:
    """Render a Python scalar as a TOML value for ``--run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_config_arg(overrides: dict) -> str:
    """``k=v`` pairs for ``flwr run --run-config``."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in overrides.items())


def write_connection(flwr_home: Path, address: str, *, root_cert: Path | None = None,
                     num_supernodes: int | None = None, client_cpus: int | None = None) -> str:
    """Write ``$FLWR_HOME/config.toml`` with one SuperLink connection named ``cancelfl``.

    ``num_supernodes`` makes it a simulation connection; ``client_cpus`` is the CPUs Ray reserves per
    ClientApp (Flower's default is 2, i.e. one ClientApp at a time on a 2-core machine).
    """
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", 'default = "cancelfl"', "", "[superlink.cancelfl]", f'address = "{address}"']
    lines.append(f'root-certificates = "{root_cert}"' if root_cert else "insecure = true")
    if num_supernodes:
        lines += ["", "[superlink.cancelfl.options]", f"num-supernodes = {num_supernodes}"]
        if client_cpus:
            lines += ["", "[superlink.cancelfl.options.backend.client-resources]", f"num-cpus = {int(client_cpus)}"]
    (flwr_home / "config.toml").write_text("\n".join(lines) + "\n")
    return "cancelfl"


def superlink_cmd(port: int, work: Path, *, simulation: bool, tls: dict[str, Path] | None) -> list[str]:
    """``flower-superlink`` on 127.0.0.1:``port``; TLS files ``cert``/``key``/``ca`` or insecure.

    Simulation: its database in ``work``.  Deployment: Flower's in-memory state (its default), which takes no
    lock: with the SQLite file, every poll, heartbeat and object push of the SuperNodes and the ServerApp is a
    write that waits for the file's lock, and on a loaded machine "database is locked" failures drop replies and
    heartbeats (the SuperLink then ends the run).  The cluster's state lives no longer than its processes anyway.
    """
    cmd = [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
           "--disable-runtime-dependency-installation"]
    cmd += ["--simulation", "--isolation", "subprocess", "--database", str(work / "state.db")] if simulation else []
    if tls:
        cmd += ["--ssl-certfile", str(tls["cert"]), "--ssl-keyfile", str(tls["key"]), "--ssl-ca-certfile", str(tls["ca"])]
    else:
        cmd.append("--insecure")
    return cmd


#: Flower output that never concerns a cancelfl user: the launcher sets the number of simulated SuperNodes
#: itself, so Flower's notice of its changed default and its advice on resizing are beside the point.
_NEVER_SHOWN = ("default simulated SuperNodes changed from", "To change federation size, use the following command",
                "flwr federation simulation-config")
#: Flower's start-up and shut-down chatter, shown with ``--verbose`` only.
_VERBOSE_ONLY = ("Using SuperLink:", "Successfully started run", "Starting logstream for run_id", "Starting Flower Simulation",
                 "Successfully installed ", "Manually terminating ClientAppActor", "simulated SuperNodes)",
                 "Start `flwr-serverapp` process")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def shown(line: str, *, verbose: bool) -> bool:
    """Whether a line of ``flwr run --stream`` output reaches the user (:data:`_NEVER_SHOWN`, :data:`_VERBOSE_ONLY`)."""
    text = _ANSI.sub("", line).strip()
    if any(s in text for s in _NEVER_SHOWN):
        return False
    if verbose:
        return True
    return bool(text) and text not in ("INFO :", "INFO:") and not any(s in text for s in _VERBOSE_ONLY)


#: Ray's report that the simulation's workers did not start in time (a busy machine), and what to do about it.
_RAY_START_FAILED = ("The current node timed out during startup", "GCS has become overloaded")
#: The line between two chained tracebacks.
_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
RAY_START_HINT = ("Ray did not start the simulated clients in time (the machine is busy): run again when it is "
                  "quieter, or use --engine inprocess (no Ray)")


class Echo:
    """Which ``flwr run --stream`` lines reach the user, line by line.

    Lines pass :func:`shown`; without ``verbose`` each Python traceback is folded to its exception line, and an
    exception line already shown is not repeated. After the stream, :meth:`notes` gives the lines to add.
    """

    def __init__(self, *, verbose: bool) -> None:
        self.verbose = verbose
        self.folded = 0
        self.hint: str | None = None
        self._in_traceback = False
        self._said: set[str] = set()

    def __call__(self, line: str) -> bool:
        """Whether ``line`` is echoed."""
        text = _ANSI.sub("", line).strip()
        if any(s in text for s in _RAY_START_FAILED):
            self.hint = RAY_START_HINT
        if not self.verbose:
            if text.endswith("Traceback (most recent call last):"):
                self._in_traceback, self.folded = True, self.folded + 1
                return False
            if text.startswith(_CHAINED):
                return False
            if self._in_traceback:
                if not text or line[:1].isspace():
                    return False
                self._in_traceback = False  # the exception line: shown once
                if text in self._said:
                    return False
                self._said.add(text)
        return shown(line, verbose=self.verbose)

    def notes(self) -> list[str]:
        """``cancelfl:`` lines for after the stream: the hint for a failure recognised, tracebacks folded."""
        out = [self.hint] if self.hint else []
        if self.folded:
            out.append("the tracebacks above are shown as their last line; --verbose shows them whole")
        return [f"cancelfl: {n}" for n in out]


def submit(work: Path, env: dict[str, str], connection: str, overrides: dict, *,
           federation_config: str | None = None, timeout: float = 3600, app_dir: Path = APP_DIR) -> int:
    """``flwr run <app_dir> <connection> --stream`` (default: this project's app); returns its exit code.

    Its output is echoed line by line as :class:`Echo` decides (tracebacks whole with ``env`` verbose).  This
    project's app gets ``overrides`` as :func:`server.defaults.flower_run_config` carries them.
    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the command is killed).
    """
    cmd = [str(BIN / "flwr"), "run", str(app_dir), connection, "--stream"]
    if app_dir == APP_DIR:  # a method's own keys this app does not declare: in its method-options
        overrides = flower_run_config(overrides)
    if overrides:
        cmd += ["--run-config", run_config_arg(overrides)]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    echo = Echo(verbose=env.get(VERBOSE_ENV) == "1")
    proc = subprocess.Popen(cmd, env=env, cwd=app_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    expired = threading.Event()
    timer = threading.Timer(timeout, lambda: (expired.set(), proc.kill()))
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if echo(line):
                sys.stdout.write(line)
                sys.stdout.flush()
        code = proc.wait()
        for note in echo.notes():
            print(note, file=sys.stderr, flush=True)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if expired.is_set():
        raise subprocess.TimeoutExpired(cmd, timeout)
    return code

