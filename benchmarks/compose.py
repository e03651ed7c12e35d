"""The docker-compose deployment on a private Docker engine, brought up and torn down from Python.

:class:`ComposeStack` is what ``tests/test_docker_compose.py`` and ``cancelfl-bench roundtime --engine compose``
start, with the scripts under ``docker/`` (the same a user or CI runs):

1. a private Docker engine (``docker/ci/start_dockerd.sh``: no bridge, no iptables; every container uses
   ``network_mode: host`` and 127.0.0.1), its data root kept in ``$CANCELFL_DOCKER_CACHE/engine`` so that the
   base and dependency layers are reused (``CANCELFL_DOCKER_FRESH=1``, or another engine holding the lock: a
   throw-away one);
2. the image, built the CI way (``docker/ci/build_image.sh``: debootstrapped base, CI stage with the host's CA
   certificates and local torch CPU wheel, then the user-facing ``docker/Dockerfile``) from the app folder;
3. TLS certificates (``docker/certs/make_certs.sh``), the node identities and roster (compose service ``keys``:
   ``cancelfl keys`` in the image), and ``docker/docker-compose.yml`` + ``docker/docker-compose.ci.yml`` + the
   override of ``docker/scale_supernodes.sh``: SuperLink, N SuperNodes (TLS to the SuperLink, each with its own
   identity key and ``require-identity=true``) and the 3 DDP-SA intermediate servers, all up until the SuperLink
   has activated N nodes;
4. runs submitted with the image's ``flwr run`` (compose service ``submit``);
5. ``docker compose down`` and the engine stopped by its PID (``docker/ci/stop_dockerd.sh``).

Environment: ``CANCELFL_DOCKER_CACHE`` (default ``~/.cache/cancelfl-docker``: base root filesystem, tools, engine
data), ``CANCELFL_DOCKER_INSTALL=1`` (install the engine first, ``docker/ci/install_engine.sh``),
``CANCELFL_DOCKER_FRESH=1``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO / "docker"
CI_DIR = DOCKER_DIR / "ci"
IMAGE = "cancelfl:ci"
#: DDP-SA intermediate servers of ``docker/docker-compose.yml`` (services ddpsa-0..2).
DDPSA_SERVERS = 3
#: Where the containers see the certificates, the ServerApp's DDP-SA identity and the output folder.
CONTAINER_CA = "/certs/ca.crt"
CONTAINER_SERVER_KEY = "/identity/parameter-server.key"
CONTAINER_OUTPUTS = "/outputs"


class DockerUnavailable(RuntimeError):
    """Docker cannot run on this machine (not root, tools missing, no kernel support); the message says why."""


class ComposeError(RuntimeError):
    """A step of bringing up or using the deployment failed; the message holds the command's output tail."""


def docker_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the scripts run with: ``base`` (default ``os.environ``) plus the cache folder and Flower's flags."""
    env = dict(os.environ if base is None else base)
    env.setdefault("CANCELFL_DOCKER_CACHE", str(Path.home() / ".cache" / "cancelfl-docker"))
    env.update(FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", DOCKER_BUILDKIT="0")
    return env


def run_cmd(cmd: list[str], env: dict[str, str], timeout: float, *,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with stdout and stderr together; raises ComposeError with the output's tail when it fails."""
    proc = subprocess.run(cmd, env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if check and proc.returncode != 0:
        raise ComposeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc


def free_port_block(n: int) -> int:
    """First of ``n`` consecutive ports free on 127.0.0.1 (host networking); raises RuntimeError if none is found."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65000:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no block of free ports found")


def unavailable_reason(env: dict[str, str]) -> str | None:
    """Why Docker cannot be used here (None if it can); installs the tools first when ``CANCELFL_DOCKER_INSTALL=1``."""
    if os.name != "posix" or os.geteuid() != 0:
        return "the private dockerd needs root"
    missing = [t for t in ("dockerd", "docker", "debootstrap", "openssl") if shutil.which(t) is None]
    if not (Path(env["CANCELFL_DOCKER_CACHE"]) / "tools/compose/docker-compose").exists():
        missing.append("compose plugin")
    if not missing:
        return None
    if env.get("CANCELFL_DOCKER_INSTALL") == "1":
        proc = subprocess.run(["bash", str(CI_DIR / "install_engine.sh")], env=env,
                              text=True, capture_output=True, timeout=600, check=False)
        if proc.returncode == 0:
            return None
        return f"docker/ci/install_engine.sh failed: {proc.stderr[-500:]}"
    return f"missing {', '.join(missing)}: run docker/ci/install_engine.sh (or set CANCELFL_DOCKER_INSTALL=1)"


def keep_engine_data(env: dict[str, str]):
    """Point the engine at the lasting data root if its lock is free (sets ``DOCKERD_DATA_ROOT`` in ``env``).

    Returns the open lock file (held until closed), or None: ``CANCELFL_DOCKER_FRESH=1`` or another engine holds
    the lock, and the engine takes a throw-away data root.
    """
    if env.get("CANCELFL_DOCKER_FRESH") == "1":
        return None
    cache = Path(env["CANCELFL_DOCKER_CACHE"])
    cache.mkdir(parents=True, exist_ok=True)
    fh = open(cache / "engine.lock", "w")  # noqa: SIM115 - kept open as the lock
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None
    env["DOCKERD_DATA_ROOT"] = str(cache / "engine")
    return fh


def activated_nodes(superlink_log: str) -> int:
    """How many SuperNodes the SuperLink's log says it activated."""
    return superlink_log.count("[Fleet.ActivateNode] Activated node_id=")


def container_path(host_path: str | Path, outputs: Path) -> str:
    """``host_path`` (inside the host folder ``outputs``) as the containers see it, under ``/outputs``.

    Raises ValueError for a path outside ``outputs`` (the ServerApp could not write there).
    """
    rel = Path(host_path).resolve().relative_to(outputs.resolve())  # ValueError outside
    return f"{CONTAINER_OUTPUTS}/{rel.as_posix()}" if rel.parts else CONTAINER_OUTPUTS


def compose_overrides(overrides: dict, *, outputs: Path, supernodes: int, ddpsa_addresses: list[str]) -> dict:
    """A run config of the host (``out-dir`` a host folder under ``outputs``) for the compose deployment.

    ``out-dir`` becomes its path in the SuperLink container, ``num-clients`` the SuperNode count, and a method
    that needs intermediate servers (its card's ``local_services``) gets the first ones of ``ddpsa_addresses``
    with the deployment's CA and the ServerApp's identity key.  Raises ValueError when it needs more servers
    than the deployment has, or the run config is invalid (:class:`protocols.config.ConfigError`).
    """
    from protocols.config import RunConfig
    from protocols.methods import local_services
    from server.defaults import app_defaults

    out = {**overrides, "num-clients": int(supernodes)}
    out["out-dir"] = container_path(overrides["out-dir"], outputs)
    if need := local_services(RunConfig.from_mapping({**app_defaults(), **out})):
        if need > len(ddpsa_addresses):
            raise ValueError(f"{out['method']} needs {need} intermediate servers; the compose deployment has "
                             f"{len(ddpsa_addresses)}")
        out.update({"ddpsa-servers": ",".join(ddpsa_addresses[:need]), "ddpsa-ca": CONTAINER_CA,
                    "ddpsa-server-key": CONTAINER_SERVER_KEY})
    return out


class ComposeStack:
    """SuperLink, ``supernodes`` SuperNodes and 3 DDP-SA servers in containers of a private engine (steps: module doc).

    ``up_timeout``: seconds ``compose up`` and the SuperNodes' registration may take each (a SuperNode imports
    Flower, torch and the app before it registers: minutes on a loaded machine).  Use as a context manager (or
    :meth:`start`/:meth:`stop`); :meth:`start` raises DockerUnavailable where Docker
    cannot run and ComposeError when a step fails, having stopped what it started.  Run outputs land in
    ``out_dir`` on the host (``/outputs`` in the SuperLink container).
    """

    def __init__(self, supernodes: int, *, app_dir: Path = REPO, out_dir: Path | None = None,
                 work: Path | None = None, say: Callable[[str], None] = print, image: str = IMAGE,
                 up_timeout: float = 600) -> None:
        self.supernodes = int(supernodes)
        self.up_timeout = up_timeout
        self.app_dir = Path(app_dir).resolve()
        self.work = Path(work or tempfile.mkdtemp(prefix="cancelfl-docker."))
        self.out_dir = Path(out_dir or self.work / "outputs").resolve()
        self.say = say
        self.image = image
        self.env = docker_env()
        self.compose = ["docker", "compose", "-f", str(DOCKER_DIR / "docker-compose.yml"),
                        "-f", str(DOCKER_DIR / "docker-compose.ci.yml"),
                        "-f", str(self.work / "docker-compose.supernodes.yml")]
        self.ddpsa_addresses: list[str] = []
        self.timings: dict[str, float] = {}
        self._state: Path | None = None
        self._lock = None
        self._t_all = time.monotonic()

    def __enter__(self) -> ComposeStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(keep_work=exc[0] is not None)

    def _timed(self, name: str, t0: float) -> None:
        self.timings[name] = time.monotonic() - t0

    def start(self) -> None:
        """Engine, image, certificates, identities, compose up; every SuperNode registered."""
        if not (self.app_dir / "server/app.py").exists() or not (self.app_dir / "client/app.py").exists():
            raise DockerUnavailable(f"no Flower app (server/app.py, client/app.py) in {self.app_dir}")
        if reason := unavailable_reason(self.env):
            raise DockerUnavailable(reason)
        try:
            self._start()
        except DockerUnavailable:
            self.stop()
            raise
        except BaseException:
            self.stop(keep_work=True)
            raise

    def _start(self) -> None:
        env = self.env
        # Short path: containerd's unix sockets live under it (108-byte limit).
        self._state = Path(tempfile.mkdtemp(prefix="cfl-dk.", dir="/tmp"))
        self._lock = keep_engine_data(env)
        t0 = time.monotonic()
        proc = subprocess.run(["bash", str(CI_DIR / "start_dockerd.sh"), str(self._state)],
                              env=env, text=True, capture_output=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise DockerUnavailable(f"cannot start dockerd: {proc.stderr.strip()[-600:]}")
        for line in proc.stdout.splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
        self._timed("dockerd start", t0)
        self.say(f"dockerd pid {env['DOCKERD_PID']} on {env['DOCKER_HOST']}")

        t0 = time.monotonic()
        run_cmd(["bash", str(CI_DIR / "make_base_image.sh")], env, timeout=900)
        smoke = run_cmd(["docker", "run", "--rm", "--network", "host", "--init", "cancelfl-debian-base:bookworm",
                         "python3", "-c", "print('ok')"], env, timeout=120, check=False)
        if smoke.returncode != 0:
            raise DockerUnavailable(f"containers cannot run here: {smoke.stdout[-600:]}")
        self._timed("base image", t0)

        t0 = time.monotonic()
        build = run_cmd(["bash", str(CI_DIR / "build_image.sh"), str(self.app_dir), self.image], env, timeout=1200)
        (self.work / "build.log").write_text(build.stdout)
        self._timed("image build", t0)

        # Ports: SuperLink, SuperNodes' local APIs, DDP-SA servers.
        base = free_port_block(1 + self.supernodes + DDPSA_SERVERS)
        sn_base, dd_base = base + 1, base + 1 + self.supernodes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data_dir = Path("/work/shared/data")
        env.update(
            CANCELFL_IMAGE=self.image,
            CANCELFL_SUPERLINK_PORT=str(base),
            CANCELFL_SUPERNODE_PORT_BASE=str(sn_base),
            CANCELFL_CERTS_DIR=str(self.work / "certs"),
            CANCELFL_KEYS_DIR=str(self.work / "keys"),
            CANCELFL_OUTPUT_DIR=str(self.out_dir),
            CANCELFL_DATA_DIR=str(data_dir if data_dir.is_dir() else self.work / "data"),
            CANCELFL_NUM_SUPERNODES=str(self.supernodes),
            **{f"CANCELFL_DDPSA_PORT_{i}": str(dd_base + i) for i in range(DDPSA_SERVERS)},
        )
        self.ddpsa_addresses = [f"127.0.0.1:{dd_base + i}" for i in range(DDPSA_SERVERS)]
        run_cmd(["bash", str(DOCKER_DIR / "certs/make_certs.sh"), str(self.work / "certs")], env, timeout=60)
        scale = run_cmd(["bash", str(DOCKER_DIR / "scale_supernodes.sh"), str(self.supernodes)], env, timeout=30)
        (self.work / "docker-compose.supernodes.yml").write_text(scale.stdout)
        run_cmd([*self.compose, "config", "--quiet"], env, timeout=60)
        # Node identities with `cancelfl keys` in the image: one private key per SuperNode and the roster they all
        # trust (each SuperNode mounts its own key only), and the ServerApp's DDP-SA identity (not in the roster).
        run_cmd([*self.compose, "--profile", "keys", "run", "--rm", "keys"], env, timeout=120)

        t0 = time.monotonic()
        run_cmd([*self.compose, "up", "-d", "--wait"], env, timeout=self.up_timeout)
        self.wait_for_nodes(timeout=self.up_timeout)
        self._timed("compose up (nodes registered)", t0)
        self.say(f"up: SuperLink 127.0.0.1:{base}, {self.supernodes} SuperNodes, DDP-SA servers on ports "
                 f"{dd_base}..{dd_base + DDPSA_SERVERS - 1}")

    def roster(self) -> dict:
        """The roster the ``keys`` service wrote (``{"format": ..., "nodes": {name: public key hex}}``)."""
        return json.loads((self.work / "keys" / "roster.json").read_text())

    def wait_for_nodes(self, timeout: float) -> None:
        """Wait until the SuperLink has activated every SuperNode (from its log); raises ComposeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            logs = run_cmd([*self.compose, "logs", "--no-color", "superlink"], self.env, timeout=30)
            if activated_nodes(logs.stdout) >= self.supernodes:
                return
            time.sleep(2)
        raise ComposeError(f"fewer than {self.supernodes} SuperNodes registered within {timeout} s")

    def submit_config(self, run_config: str, *, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
        """``flwr run`` of the image's app with ``run_config`` (TOML ``k=v`` pairs) through service ``submit``."""
        env = dict(self.env, CANCELFL_RUN_CONFIG=run_config)
        return run_cmd([*self.compose, "run", "--rm", "submit"], env, timeout=timeout, check=False)

    def submit(self, overrides: dict, *, timeout: float = 1800) -> int:
        """Run the app with run-config ``overrides`` (``out-dir`` a host folder under ``out_dir``).

        Returns 0 when the run's ``summary.json`` was written (as :meth:`server.deploy.LocalCluster.submit`);
        raises ValueError for a run config the deployment cannot take (:func:`compose_overrides`).
        """
        from server.defaults import flower_run_config
        from server.flower_commands import run_config_arg
        from strategies.run.checkpoint import clear_outputs, run_outcome

        host_dir = Path(overrides["out-dir"]).resolve()
        ov = compose_overrides(overrides, outputs=self.out_dir, supernodes=self.supernodes,
                               ddpsa_addresses=self.ddpsa_addresses)
        clear_outputs(str(host_dir))
        host_dir.mkdir(parents=True, exist_ok=True)
        proc = self.submit_config(run_config_arg(flower_run_config(ov)), timeout=timeout)
        (host_dir / "flwr-run.log").write_text(proc.stdout)
        code, message = run_outcome(str(host_dir), proc.returncode)
        if code:
            self.say(f"compose run {ov['method']}: {message}\n{proc.stdout[-2000:]}")
        return code

    def stop(self, *, keep_work: bool = False) -> None:
        """Logs into the work folder, compose down, the engine stopped by its PID; ``keep_work``: keep the folder."""
        state = self._state
        t0 = time.monotonic()
        if state is not None and (state / "docker.sock").exists():
            # Best effort: a slow step must not keep the engine from stopping.
            with contextlib.suppress(subprocess.TimeoutExpired):
                logs = subprocess.run([*self.compose, "logs", "--no-color", "--tail", "300"], env=self.env,
                                      text=True, capture_output=True, timeout=60, check=False)
                (self.work / "compose.log").write_text(logs.stdout + logs.stderr)
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run([*self.compose, "--profile", "submit", "down", "--remove-orphans", "--timeout", "10"],
                               env=self.env, capture_output=True, timeout=180, check=False)
        self._timed("compose down", t0)
        t0 = time.monotonic()
        if state is not None:
            try:
                subprocess.run(["bash", str(CI_DIR / "stop_dockerd.sh"), str(state)], env=self.env,
                               capture_output=True, timeout=120, check=False)
            except subprocess.TimeoutExpired:
                if pid := self.env.get("DOCKERD_PID"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)  # only the engine this stack started
            self._state = None
        if self._lock:
            self._lock.close()
            self._lock = None
        self._timed("dockerd stop", t0)
        self._timed("total", self._t_all)
        for name, secs in self.timings.items():
            self.say(f"{name:>32}: {secs:6.1f} s")
        if keep_work:
            self.say(f"logs (build, compose, flwr run) kept in {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)
