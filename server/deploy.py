"""Run the app on Flower's real runtime: a private SuperLink (+ SuperNodes) as OS processes.

* :func:`run_simulation` -- a SuperLink in simulation mode (Ray backend spawns
  the ClientApps), submitted with ``flwr run``.
* :func:`run_deployment` -- a SuperLink and N ``flower-supernode`` processes on
  127.0.0.1, each with its own ``partition-id`` and its own Ed25519 identity
  (made as ``cancelfl keys`` makes them; node config ``identity-key``,
  ``roster``, ``require-identity``), optionally with TLS, plus the
  DDP-SA intermediate servers when the method is ``ddpsa`` (started by
  :mod:`server.intermediate.launcher`, the one place that starts them).

Every process gets a free loopback port, a private ``FLWR_HOME`` and its own log
file; all are stopped on exit (also on error or Ctrl-C).  This is the same
topology as ``docker/docker-compose.yml``, without containers.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from protocols.config import ConfigError, RunConfig
from protocols.methods import local_services
from protocols.tls import CertificateAuthority
from server.defaults import APP_DIR, app_defaults
from server.intermediate.launcher import IntermediateServerCluster, local_intermediate_servers, start_intermediate_servers
from server.keys import make_identities
from strategies.run.checkpoint import clear_outputs, ledger_dir, resolve_out_dir, run_outcome

#: Environment variable of detailed round lines (the value of :data:`strategies.run.loop.VERBOSE_ENV`; that
#: module imports Flower and torch, which the launcher loads only in the processes it starts).
VERBOSE_ENV = "CANCELFL_VERBOSE"

BIN = Path(sys.executable).parent
#: Environment variable every process of one launch inherits (a fresh id per workspace): how the launcher
#: finds and stops the descendants that left their process group.
LAUNCH_MARK = "CANCELFL_LAUNCH_ID"


#: Private (anonymous) memory of one idle ``cancelfl-supernode`` in MB, Flower 1.41: the SuperNode about 95, its warm
#: ClientApp process with torch imported about 415, its SuperExec about 90.  Training adds to it, so this is a
#: lower bound of what each SuperNode needs.
SUPERNODE_IDLE_MB = 600


def available_memory_mb() -> float | None:
    """``MemAvailable`` of ``/proc/meminfo`` in MB (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_capacity(num_supernodes: int, available_mb: float | None = None) -> None:
    """Refuse a local deployment whose idle SuperNodes alone exceed this machine's available memory.

    Raises:
        ConfigError: naming ``--supernodes`` / ``num-clients`` and how many fit, when ``num_supernodes`` x
            :data:`SUPERNODE_IDLE_MB` exceeds ``available_mb`` (default: :func:`available_memory_mb`; no check
            where that is unknown).
    """
    available_mb = available_memory_mb() if available_mb is None else available_mb
    if available_mb is None or num_supernodes * SUPERNODE_IDLE_MB <= available_mb:
        return
    most = int(available_mb // SUPERNODE_IDLE_MB)
    raise ConfigError(f"--supernodes / run-config 'num-clients' = {num_supernodes}: {num_supernodes} SuperNode processes "
                      f"need at least {num_supernodes * SUPERNODE_IDLE_MB / 1024:.1f} GB ({SUPERNODE_IDLE_MB} MB each, "
                      f"idle), this machine has {available_mb / 1024:.1f} GB available; at most {most} fit here (use "
                      "`cancelfl run` for more simulated clients)")


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Python warning filter every launched process gets: Ray's tip that a future Ray will stop hiding GPUs from
#: actors that asked for none (a note for Ray's own users; the behaviour here is today's, unchanged).
RAY_TIP_FILTER = "ignore::FutureWarning:ray._private.worker"


def flower_env(flwr_home: Path, *, verbose: bool = False) -> dict[str, str]:
    """Environment for Flower processes: private config home, no telemetry or update check.

    ``verbose``: the ServerApp prints detailed round lines (``CANCELFL_VERBOSE``, read by
    :func:`strategies.run.loop.run_rounds`) and :func:`submit` echoes Flower's own start-up messages.
    """
    env = dict(os.environ)
    env.update(FLWR_HOME=str(flwr_home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
               PYTHONUNBUFFERED="1")
    env[VERBOSE_ENV] = "1" if verbose else "0"
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


class Processes:
    """Start background processes with log files; stop them and all their descendants on close.

    Each process leads its own process group (``start_new_session``); Flower's children of a SuperNode
    (``flower-superexec``, ``flwr-clientapp``) stay in it, so the group is signalled also when its leader
    already died (a killed SuperNode leaves them running otherwise).  Descendants that left the group
    (the SuperLink starts ``flower-superexec`` in a new session, Ray starts its own daemons) are found by
    the launch mark every one of them inherits in its environment (:data:`LAUNCH_MARK`, Linux ``/proc``).
    """

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, env
        self.mark = env.get(LAUNCH_MARK, "")
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: list = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        """Start ``cmd`` in its own process group, logging to ``<workdir>/<name>.log``."""
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=APP_DIR,
                                start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        """Raise with the log tail if a started process already exited."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail}")

    def descendants(self) -> list[int]:
        """Live processes (other than this one) started by this launch, found by their launch mark."""
        return marked_pids(self.mark) if self.mark else []

    def _signal(self, sig: int) -> None:
        marked = self.descendants()
        groups = set()
        for pid in marked:
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(pid))
        for _, proc in self.procs:
            # A reaped leader's group is signalled only while a marked member is in it (its pid may be reused).
            if proc.poll() is None or proc.pid in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
        for pid in marked:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def close(self, grace: float = 10.0) -> None:
        """Stop every process started here and all their descendants: TERM, up to ``grace`` s, then KILL."""
        self._signal(signal.SIGTERM)
        deadline = time.time() + grace
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.time()))
        while self.descendants() and time.time() < deadline:
            time.sleep(0.2)
        self._signal(signal.SIGKILL)
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        end = time.time() + 5
        while self.descendants() and time.time() < end:  # SIGKILL is asynchronous
            time.sleep(0.05)
        for log in self._logs:
            log.close()
        self._logs.clear()


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the launcher dies, even by SIGKILL (no cleanup ran)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def marked_pids(mark: str) -> list[int]:
    """Pids of live processes whose environment holds ``LAUNCH_MARK=mark`` (empty where there is no /proc)."""
    return pids_with_env(LAUNCH_MARK, mark)


def pids_with_env(name: str, value: str) -> list[int]:
    """Pids of live processes (not this one) whose environment holds ``name=value`` (empty without /proc)."""
    needle = f"{name}={value}".encode()
    me, pids = os.getpid(), []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()  # empty for zombies: they are gone already
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def wait_for_port(port: int, timeout: float = 60.0, procs: Processes | None = None) -> None:
    """Wait until something listens on 127.0.0.1:``port``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if procs:
            procs.check_alive()
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


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


@contextlib.contextmanager
def workspace(keep: str | None = None) -> Iterator[Path]:
    """A temporary folder for FLWR_HOME, databases and logs (kept if ``keep`` is given)."""
    path = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="cancelfl-"))
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def _superlink_cmd(port: int, work: Path, *, simulation: bool, tls: dict[str, Path] | None) -> list[str]:
    cmd = [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
           "--disable-runtime-dependency-installation", "--database", str(work / "state.db")]
    cmd += ["--simulation", "--isolation", "subprocess"] if simulation else []
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


def submit(work: Path, env: dict[str, str], connection: str, overrides: dict, *,
           federation_config: str | None = None, timeout: float = 3600) -> int:
    """``flwr run <app> <connection> --stream``; returns its exit code.

    Its output is echoed line by line, less what :func:`shown` filters (more with ``env`` verbose).
    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the command is killed).
    """
    cmd = [str(BIN / "flwr"), "run", str(APP_DIR), connection, "--stream"]
    if overrides:
        cmd += ["--run-config", run_config_arg(overrides)]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    verbose = env.get(VERBOSE_ENV) == "1"
    proc = subprocess.Popen(cmd, env=env, cwd=APP_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    expired = threading.Event()
    timer = threading.Timer(timeout, lambda: (expired.set(), proc.kill()))
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if shown(line, verbose=verbose):
                sys.stdout.write(line)
                sys.stdout.flush()
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if expired.is_set():
        raise subprocess.TimeoutExpired(cmd, timeout)
    return code


def _final_check(out_dir: str, code: int) -> int:
    """Exit code of a submitted run, judged from its folder (``flwr run`` exits 0 even when the ServerApp crashed)."""
    code, message = run_outcome(out_dir, code)
    print(f"cancelfl: {message}", file=sys.stderr if code else sys.stdout)
    return code


def _absolute_out_dir(overrides: dict, defaults: dict) -> dict:
    """The ServerApp runs in another working directory: pass out-dir (and data-dir) as absolute paths.

    out-dir ``""`` becomes a fresh ``runs/<time>-<method>`` here, so the launcher knows where to look; an
    earlier run's outputs in the folder are removed before the run starts (kept when resuming), so they
    can never be taken for this run's.
    """
    out = dict(overrides)
    cfg = resolve_out_dir(RunConfig.from_mapping({**defaults, **out}))
    out["out-dir"] = cfg.out_dir
    if not cfg.resume:
        clear_outputs(cfg.out_dir)
    data_dir = out.get("data-dir", defaults.get("data-dir", ""))
    if data_dir:
        out["data-dir"] = str(Path(data_dir).resolve())
    return out


def run_simulation(overrides: dict, *, keep_workdir: str | None = None, client_cpus: int = 1,
                   verbose: bool = False) -> int:
    """Run through a private simulation-mode SuperLink; returns a process exit code.

    ``client_cpus`` = 1 by default: a ClientApp's work here is small enough that one thread is fastest
    (Ray sets OMP_NUM_THREADS to the CPUs it reserves), and one CPU per ClientApp lets as many run at
    once as there are cores; Flower's default of 2 runs one at a time on a 2-core machine.
    ``verbose``: detailed round lines and Flower's start-up messages (:func:`flower_env`).
    """
    return run_simulations([overrides], keep_workdir=keep_workdir, client_cpus=client_cpus, verbose=verbose)[0]


def run_simulations(runs: list[dict], *, keep_workdir: str | None = None, client_cpus: int = 1,
                    verbose: bool = False) -> list[int]:
    """Several runs one after another on one private simulation-mode SuperLink (started once); exit codes.

    Every run must have the same ``num-clients`` (the simulated SuperNodes, ``flwr run --federation-config``).
    """
    defaults = app_defaults()
    cfgs = [RunConfig.from_mapping({**defaults, **o}) for o in runs]
    if len({c.num_clients for c in cfgs}) != 1:
        raise ValueError("run_simulations: every run needs the same num-clients (one simulated federation)")
    runs = [_absolute_out_dir(o, defaults) for o in runs]
    codes: list[int] = []
    with workspace(keep_workdir) as work:
        env = flower_env(work / "flwr-home", verbose=verbose)
        if len(runs) == 1 and not os.environ.get("CANCELFL_LEDGER_DIR"):
            # The simulated clients' privacy ledgers in the run folder (not the throwaway FLWR_HOME): a resumed
            # run continues them (client.ledger reads $CANCELFL_LEDGER_DIR).
            env["CANCELFL_LEDGER_DIR"] = str(ledger_dir(runs[0]["out-dir"]))
        procs = Processes(work, env)
        try:
            print(f"cancelfl: starting a SuperLink and {cfgs[0].num_clients} simulated clients (Ray); the first "
                  "round waits for Ray's workers (tens of seconds) ...", flush=True)
            port = free_port()
            procs.start("superlink", _superlink_cmd(port, work, simulation=True, tls=None))
            wait_for_port(port, procs=procs)
            conn = write_connection(work / "flwr-home", f"127.0.0.1:{port}")
            federation = f"num-supernodes={cfgs[0].num_clients} client-resources-num-cpus={int(client_cpus)}"
            for cfg, overrides in zip(cfgs, runs, strict=True):
                # DDP-SA: servers trusting the simulation's (seed-derived) identities, named in the run config
                # that both the ServerApp and the clients read.
                with local_intermediate_servers(cfg) as started:
                    if started is not cfg:
                        overrides = {**overrides, **_ddpsa_keys(started)}
                    codes.append(_final_check(overrides["out-dir"], submit(work, env, conn, overrides,
                                                                           federation_config=federation)))
        finally:
            procs.close()
    return codes


def _ddpsa_keys(cfg: RunConfig) -> dict[str, str]:
    """The run-config keys that point a DDP-SA run at its intermediate servers."""
    return {"ddpsa-servers": cfg.ddpsa_servers, "ddpsa-ca": cfg.ddpsa_ca, "ddpsa-server-key": cfg.ddpsa_server_key}


class LocalCluster:
    """A SuperLink, N SuperNodes and (optionally) DDP-SA intermediate servers as OS processes on loopback.

    Use as a context manager; :meth:`submit` runs the app against it (several
    runs may share one cluster).  Every process is stopped on exit; ``pids``
    lists them so callers (tests) can check that none survived.
    """

    def __init__(self, num_supernodes: int, *, tls: bool = False, intermediate_servers: int = 0,
                 keep_workdir: str | None = None, ledger_dir: str | None = None, verbose: bool = False) -> None:
        self.verbose = verbose
        self.num_supernodes, self.tls, self.n_intermediate = num_supernodes, tls, intermediate_servers
        #: node-config ``ledger-dir`` of every SuperNode (None: under each node's FLWR_HOME, thrown away on exit)
        self.ledger_dir = ledger_dir
        self._ws = workspace(keep_workdir)
        self.intermediate: list[str] = []
        self._servers: IntermediateServerCluster | None = None
        self.pids: list[int] = []

    def __enter__(self) -> LocalCluster:
        self.work = self._ws.__enter__()
        self.env = flower_env(self.work / "flwr-home", verbose=self.verbose)
        self.procs = Processes(self.work, self.env)
        print(f"cancelfl: starting a SuperLink and {self.num_supernodes} SuperNodes (processes on 127.0.0.1) ...",
              flush=True)
        try:
            ca = CertificateAuthority("cancelfl-ca")  # the deployment's CA: SuperLink (--tls) and DDP-SA servers
            certs = make_certificates(self.work / "certs", ca) if self.tls else None
            port = free_port()  # Flower 1.41 serves the Runtime, Control and Fleet APIs on one HTTP port
            self.procs.start("superlink", _superlink_cmd(port, self.work, simulation=False, tls=certs))
            wait_for_port(port, procs=self.procs)
            # Node identities as `cancelfl keys gen` + `cancelfl keys roster` make them; each node's config points
            # at its own private key and the roster (require-identity: no silent fall-back to derived identities).
            keys, self.roster = make_identities(self.work / "identities",
                                                [f"node-{i}" for i in range(self.num_supernodes)])
            if self.n_intermediate:
                self._servers = start_intermediate_servers(self.n_intermediate, self.roster, ca=ca)
                self.intermediate = self._servers.addresses
            for i in range(self.num_supernodes):
                node_config = (f'partition-id={i} num-partitions={self.num_supernodes} identity-key="{keys[f"node-{i}"]}" '
                               f'roster="{self.roster}" require-identity=true')
                if self.ledger_dir:
                    node_config += f' ledger-dir="{self.ledger_dir}"'
                # Flower's SuperNode with a warm ClientApp process and short polls (server/supernode.py).
                node = [sys.executable, "-m", "server.supernode", "--superlink", f"127.0.0.1:{port}",
                        "--host", "127.0.0.1", "--port", str(free_port()), "--node-config", node_config]
                node += ["--root-certificates", str(certs["ca"])] if certs else ["--insecure"]
                self.procs.start(f"supernode-{i}", node)
            self.connection = write_connection(self.work / "flwr-home", f"127.0.0.1:{port}",
                                               root_cert=certs["ca"] if certs else None)
            self.pids = [p.pid for _, p in self.procs.procs] + (self._servers.pids if self._servers else [])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def submit(self, overrides: dict, *, timeout: float = 1800) -> int:
        """Run the app with run-config ``overrides``; returns 0 when ``summary.json`` was written."""
        defaults = app_defaults()
        overrides = {**_absolute_out_dir(overrides, defaults), "num-clients": self.num_supernodes}
        cfg = RunConfig.from_mapping({**defaults, **overrides})
        if need := local_services(cfg):
            if len(self.intermediate) < need:
                raise ValueError(f"{cfg.method} needs {need} intermediate servers; "
                                 f"the cluster has {len(self.intermediate)}")
            assert self._servers is not None
            overrides.update(self._servers.run_config())
            overrides["ddpsa-servers"] = ",".join(self.intermediate[:need])
        self.procs.check_alive()
        return _final_check(overrides["out-dir"], submit(self.work, self.env, self.connection, overrides,
                                                         timeout=timeout))

    def __exit__(self, *exc) -> None:
        self.procs.close()
        if self._servers:
            self._servers.stop()
        self._ws.__exit__(*exc)


def run_deployment(overrides: dict, *, num_supernodes: int = 4, tls: bool = False,
                   keep_workdir: str | None = None, verbose: bool = False) -> int:
    """SuperLink + ``num_supernodes`` SuperNodes as separate processes on loopback; returns an exit code.

    ``verbose``: detailed round lines and Flower's start-up messages (:func:`flower_env`).
    """
    cfg = RunConfig.from_mapping({**app_defaults(), **overrides})
    n_inter = local_services(cfg)
    # The nodes' privacy ledgers in the run folder, so that `cancelfl deploy --resume` continues them.
    ledgers = str(ledger_dir(cfg.out_dir)) if cfg.out_dir else None
    with LocalCluster(num_supernodes, tls=tls, intermediate_servers=n_inter, keep_workdir=keep_workdir,
                      ledger_dir=ledgers, verbose=verbose) as cluster:
        return cluster.submit(overrides)


def make_certificates(folder: Path, ca: CertificateAuthority | None = None) -> dict[str, Path]:
    """A SuperLink certificate for 127.0.0.1/localhost from ``ca`` (None: a new self-signed CA, :mod:`protocols.tls`)."""
    ca = ca or CertificateAuthority("cancelfl-ca")
    return {"ca": ca.write(folder), **ca.issue("superlink").write(folder, "server")}
