"""Run the app on Flower's real runtime: a private SuperLink (+ SuperNodes) as OS processes.

* :func:`run_simulation` -- a SuperLink in simulation mode (Ray backend spawns
  the ClientApps), submitted with ``flwr run``.
* :func:`run_deployment` -- a SuperLink and N ``flower-supernode`` processes on
  127.0.0.1, each with its own ``partition-id``, optionally with TLS, plus the
  DDP-SA intermediate servers when the method is ``ddpsa`` (started by
  :mod:`server.intermediate.launcher`, the one place that starts them).

Every process gets a free loopback port, a private ``FLWR_HOME`` and its own log
file; all are stopped on exit (also on error or Ctrl-C).  This is the same
topology as ``docker/docker-compose.yml``, without containers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from protocols.config import RunConfig
from server.defaults import APP_DIR, app_defaults
from server.intermediate.launcher import IntermediateServerCluster, start_intermediate_servers

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: private config home, no telemetry or update check."""
    env = dict(os.environ)
    env.update(FLWR_HOME=str(flwr_home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
               PYTHONUNBUFFERED="1")
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
    """Start background processes with log files; stop them all (TERM, then KILL) on close."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, env
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        """Start ``cmd`` in its own process group, logging to ``<workdir>/<name>.log``."""
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=APP_DIR,
                                start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        """Raise with the log tail if a started process already exited."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail}")

    def close(self) -> None:
        """Stop every process group started here."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 10
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


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


def submit(work: Path, env: dict[str, str], connection: str, overrides: dict, *,
           federation_config: str | None = None, timeout: float = 3600) -> int:
    """``flwr run <app> <connection> --stream``; returns its exit code (its output is echoed)."""
    cmd = [str(BIN / "flwr"), "run", str(APP_DIR), connection, "--stream"]
    if overrides:
        cmd += ["--run-config", run_config_arg(overrides)]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    return subprocess.run(cmd, env=env, cwd=APP_DIR, timeout=timeout, check=False).returncode


def _final_check(out_dir: str, code: int) -> int:
    summary = Path(out_dir) / "summary.json"
    if code != 0 or not summary.is_file():
        print(f"cancelfl: the run did not finish (flwr exit code {code}, {summary} "
              f"{'present' if summary.is_file() else 'missing'})", file=sys.stderr)
        return code or 1
    print(f"cancelfl: run finished, summary at {summary}")
    return 0


def _absolute_out_dir(overrides: dict, defaults: dict) -> dict:
    """The ServerApp runs in another working directory: pass out-dir (and data-dir) as absolute paths."""
    out = dict(overrides)
    for key in ("out-dir", "data-dir"):
        val = out.get(key, defaults.get(key, ""))
        if val:
            out[key] = str(Path(val).resolve())
    return out


def run_simulation(overrides: dict, *, keep_workdir: str | None = None, client_cpus: int = 1) -> int:
    """Run through a private simulation-mode SuperLink; returns a process exit code.

    ``client_cpus`` = 1 by default: a ClientApp's work here is small enough that one thread is fastest
    (Ray sets OMP_NUM_THREADS to the CPUs it reserves), and one CPU per ClientApp lets as many run at
    once as there are cores; Flower's default of 2 runs one at a time on a 2-core machine.
    """
    return run_simulations([overrides], keep_workdir=keep_workdir, client_cpus=client_cpus)[0]


def run_simulations(runs: list[dict], *, keep_workdir: str | None = None, client_cpus: int = 1) -> list[int]:
    """Several runs one after another on one private simulation-mode SuperLink (started once); exit codes.

    Every run must have the same ``num-clients`` (the simulated SuperNodes of the connection).
    """
    defaults = app_defaults()
    cfgs = [RunConfig.from_mapping({**defaults, **o}) for o in runs]
    if len({c.num_clients for c in cfgs}) != 1:
        raise ValueError("run_simulations: every run needs the same num-clients (one simulated federation)")
    runs = [_absolute_out_dir(o, defaults) for o in runs]
    codes: list[int] = []
    with workspace(keep_workdir) as work:
        env = flower_env(work / "flwr-home")
        procs = Processes(work, env)
        try:
            port = free_port()
            procs.start("superlink", _superlink_cmd(port, work, simulation=True, tls=None))
            wait_for_port(port, procs=procs)
            conn = write_connection(work / "flwr-home", f"127.0.0.1:{port}", num_supernodes=cfgs[0].num_clients,
                                    client_cpus=client_cpus)
            for cfg, overrides in zip(cfgs, runs, strict=True):
                code = submit(work, env, conn, overrides)
                codes.append(_final_check(overrides.get("out-dir", str(Path(cfg.out_dir).resolve())), code))
        finally:
            procs.close()
    return codes


class LocalCluster:
    """A SuperLink, N SuperNodes and (optionally) DDP-SA intermediate servers as OS processes on loopback.

    Use as a context manager; :meth:`submit` runs the app against it (several
    runs may share one cluster).  Every process is stopped on exit; ``pids``
    lists them so callers (tests) can check that none survived.
    """

    def __init__(self, num_supernodes: int, *, tls: bool = False, intermediate_servers: int = 0,
                 keep_workdir: str | None = None) -> None:
        self.num_supernodes, self.tls, self.n_intermediate = num_supernodes, tls, intermediate_servers
        self._ws = workspace(keep_workdir)
        self.intermediate: list[str] = []
        self._servers: IntermediateServerCluster | None = None
        self.pids: list[int] = []

    def __enter__(self) -> LocalCluster:
        self.work = self._ws.__enter__()
        self.env = flower_env(self.work / "flwr-home")
        self.procs = Processes(self.work, self.env)
        try:
            certs = make_certificates(self.work / "certs") if self.tls else None
            port = free_port()  # Flower 1.41 serves the Runtime, Control and Fleet APIs on one HTTP port
            self.procs.start("superlink", _superlink_cmd(port, self.work, simulation=False, tls=certs))
            wait_for_port(port, procs=self.procs)
            if self.n_intermediate:
                self._servers = start_intermediate_servers(self.n_intermediate)
                self.intermediate = self._servers.addresses
            for i in range(self.num_supernodes):
                node = [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{port}",
                        "--host", "127.0.0.1", "--port", str(free_port()),
                        "--node-config", f"partition-id={i} num-partitions={self.num_supernodes}"]
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
        if cfg.method == "ddpsa" and not cfg.ddpsa_servers:
            if len(self.intermediate) < cfg.ddpsa_num_servers:
                raise ValueError(f"ddpsa needs {cfg.ddpsa_num_servers} intermediate servers; "
                                 f"the cluster has {len(self.intermediate)}")
            overrides["ddpsa-servers"] = ",".join(self.intermediate[:cfg.ddpsa_num_servers])
        out_dir = overrides.get("out-dir") or str(Path(cfg.out_dir).resolve())
        overrides["out-dir"] = out_dir
        self.procs.check_alive()
        return _final_check(out_dir, submit(self.work, self.env, self.connection, overrides, timeout=timeout))

    def __exit__(self, *exc) -> None:
        self.procs.close()
        if self._servers:
            self._servers.stop()
        self._ws.__exit__(*exc)


def run_deployment(overrides: dict, *, num_supernodes: int = 4, tls: bool = False,
                   keep_workdir: str | None = None) -> int:
    """SuperLink + ``num_supernodes`` SuperNodes as separate processes on loopback; returns an exit code."""
    cfg = RunConfig.from_mapping({**app_defaults(), **overrides})
    n_inter = cfg.ddpsa_num_servers if cfg.method == "ddpsa" and not cfg.ddpsa_servers else 0
    with LocalCluster(num_supernodes, tls=tls, intermediate_servers=n_inter, keep_workdir=keep_workdir) as cluster:
        return cluster.submit(overrides)


def make_certificates(folder: Path) -> dict[str, Path]:
    """A self-signed CA and a SuperLink certificate for 127.0.0.1/localhost (``cryptography``)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def _name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("cancelfl-ca")).issuer_name(_name("cancelfl-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder().subject_name(_name("superlink")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths
