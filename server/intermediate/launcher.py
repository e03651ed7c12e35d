"""Start and stop ``m`` DDP-SA intermediate servers as separate OS processes.

Each server runs ``python -m server.intermediate --port 0`` so the kernel picks a free
port (no bind race); the child reports its port through a private temp file, then the
launcher waits for ``Health``.  :meth:`IntermediateServerCluster.stop` sends SIGTERM,
waits, escalates to SIGKILL and reaps every child.  Children also watch the launcher's
pid, and the cluster registers an ``atexit`` hook, so no server outlives its owner.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from client.intermediate import wait_until_healthy
from protocols.config import RunConfig
from server.intermediate.servicer import (
    DEFAULT_KEEP_ROUNDS,
    DEFAULT_MIN_CLIENTS,
    format_address,
)

__all__ = [
    "IntermediateServerCluster",
    "IntermediateServerHandle",
    "IntermediateServerStartError",
    "start_intermediate_servers",
]

_REPO_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)


class IntermediateServerStartError(RuntimeError):
    """An intermediate server process failed to start or become healthy."""


@dataclass(frozen=True)
class IntermediateServerHandle:
    """One running intermediate server process."""

    index: int
    address: str
    port: int
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        """OS process id."""
        return self.process.pid

    def is_running(self) -> bool:
        """Return True while the process has not exited."""
        return self.process.poll() is None


class IntermediateServerCluster:
    """The ``m`` servers of one DDP-SA deployment; a context manager that stops them."""

    def __init__(self, handles: Sequence[IntermediateServerHandle]) -> None:
        self.handles: list[IntermediateServerHandle] = list(handles)
        self._stopped = False
        atexit.register(self.stop)

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of server j at index j (pass to push/reconstruct helpers)."""
        return [h.address for h in self.handles]

    @property
    def pids(self) -> list[int]:
        """Process ids of the servers."""
        return [h.pid for h in self.handles]

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate all servers (SIGTERM, then SIGKILL after ``timeout``) and reap them.

        Idempotent; safe to call on already dead servers.
        """
        if self._stopped:
            return
        _terminate([h.process for h in self.handles], timeout)
        self._stopped = True
        atexit.unregister(self.stop)

    def __enter__(self) -> IntermediateServerCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start_intermediate_servers(
    m: int,
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 30.0,
    keep_rounds: int = DEFAULT_KEEP_ROUNDS,
    min_clients: int = DEFAULT_MIN_CLIENTS,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> IntermediateServerCluster:
    """Start ``m`` intermediate servers on free ports of ``host`` (loopback by default).

    Returns once every server answers ``Health``.  Use the result as a context manager
    or call ``.stop()``.

    Raises:
        IntermediateServerStartError: if a server exits early or is not healthy within
            ``startup_timeout`` seconds (all started servers are then stopped).
    """
    if m < 1:
        raise ValueError(f"need at least one intermediate server, got m={m}")
    tmpdir = Path(tempfile.mkdtemp(prefix="ddpsa-intermediate-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    procs: list[subprocess.Popen[bytes]] = []
    handles: list[IntermediateServerHandle] = []
    try:
        for j in range(m):
            cmd = [
                python, "-m", "server.intermediate",
                "--host", host, "--port", "0",
                "--server-id", f"intermediate-{j}",
                "--port-file", str(tmpdir / f"{j}.port"),
                "--parent-pid", str(os.getpid()),
                "--keep-rounds", str(keep_rounds),
                "--min-clients", str(min_clients),
                "--log-level", "WARNING",
                *extra_args,
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(  # noqa: S603 (fixed argv, no shell)
                    cmd,
                    cwd=_REPO_ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + startup_timeout
        for j, p in enumerate(procs):
            port_file = tmpdir / f"{j}.port"
            while not port_file.exists():
                if p.poll() is not None:
                    raise IntermediateServerStartError(
                        f"intermediate server #{j} exited with code {p.returncode} before binding (see its stderr)"
                    )
                if time.monotonic() > deadline:
                    raise IntermediateServerStartError(
                        f"intermediate server #{j} did not bind within {startup_timeout}s"
                    )
                time.sleep(0.02)
            port = int(port_file.read_text(encoding="ascii").strip())
            address = format_address(host, port)
            try:
                wait_until_healthy(address, timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError as exc:
                raise IntermediateServerStartError(str(exc)) from exc
            handles.append(IntermediateServerHandle(j, address, port, p))
    except BaseException:
        _terminate(procs, timeout=2.0)
        raise
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return IntermediateServerCluster(handles)


@contextlib.contextmanager
def local_intermediate_servers(cfg: RunConfig) -> Iterator[RunConfig]:
    """Yield ``cfg`` with DDP-SA intermediate servers to talk to, starting local ones if it names none.

    The one place that starts intermediate servers for a run: the in-process engine, the ServerApp
    (simulation) and ``cancelfl deploy`` all come through here.  Methods other than ``ddpsa``, and
    runs whose ``ddpsa-servers`` lists servers, get ``cfg`` back unchanged and nothing is started.
    """
    if cfg.method != "ddpsa" or cfg.ddpsa_servers.strip():
        yield cfg
        return
    with start_intermediate_servers(cfg.ddpsa_num_servers) as cluster:
        log.info("DDP-SA: started %d intermediate servers %s (pids %s)", len(cluster.addresses), cluster.addresses,
                 cluster.pids)
        yield cfg.replace(ddpsa_servers=",".join(cluster.addresses))
