"""Start and stop ``m`` DDP-SA intermediate servers as separate OS processes.

For a loopback run the launcher makes, in a private folder that lives as long as the cluster, a
throwaway CA with one server certificate per server (:mod:`protocols.tls`) and the parameter
server's identity (``cancelfl keys gen`` layout: ``parameter-server.key`` / ``.pub``); the clients'
roster is the run's (``cancelfl keys roster`` file).  :meth:`IntermediateServerCluster.run_config`
gives the run-config keys the parameter server and the clients need (servers, CA, server key).

Each server runs ``python -m server.intermediate --port 0`` so the kernel picks a free
port (no bind race); the child reports its port through a private temp file, then the
launcher waits for ``Health`` over TLS.  :meth:`IntermediateServerCluster.stop` sends SIGTERM,
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from protocols.config import RunConfig
from protocols.identity import DerivedRoster, Roster
from protocols.methods import local_services
from protocols.node_config import ROSTER
from protocols.tls import CertificateAuthority
from protocols.wire.intermediate import IntermediateServers, wait_until_healthy
from server.intermediate.servicer import format_address
from server.keys import generate

#: Roster name of the parameter server's identity made for a loopback cluster.
PARAMETER_SERVER = "parameter-server"

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

    def __init__(self, handles: Sequence[IntermediateServerHandle], folder: Path) -> None:
        self.handles: list[IntermediateServerHandle] = list(handles)
        #: Private folder: ``ca.crt``, the servers' certificates and the parameter server's identity.
        self.folder = folder
        self._stopped = False
        atexit.register(self.stop)

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of server j at index j (pass to push/reconstruct helpers)."""
        return [h.address for h in self.handles]

    @property
    def ca_file(self) -> Path:
        """The throwaway CA certificate that signed the servers' TLS certificates."""
        return self.folder / "ca.crt"

    @property
    def server_key_file(self) -> Path:
        """The parameter server's private identity key (the only reader of partial sums)."""
        return self.folder / f"{PARAMETER_SERVER}.key"

    @property
    def servers(self) -> IntermediateServers:
        """Addresses + CA, as the clients and the parameter server use them."""
        return IntermediateServers(tuple(self.addresses), self.ca_file.read_bytes())

    def run_config(self) -> dict[str, str]:
        """The run-config keys that point a run at this cluster."""
        return {"ddpsa-servers": ",".join(self.addresses), "ddpsa-ca": str(self.ca_file),
                "ddpsa-server-key": str(self.server_key_file)}

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
        shutil.rmtree(self.folder, ignore_errors=True)
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
    roster: Path | Roster | DerivedRoster,
    *,
    host: str = "127.0.0.1",
    ca: CertificateAuthority | None = None,
    startup_timeout: float = 30.0,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> IntermediateServerCluster:
    """Start ``m`` intermediate servers on free ports of ``host`` (loopback by default).

    ``roster`` (a roster file, or a roster to write into the cluster's folder) lists the clients
    that may push.  ``ca`` issues the servers' TLS certificates (the deployment's CA, e.g. the one
    ``cancelfl deploy --tls`` made for the SuperLink); None = a throwaway CA for this cluster.
    ``extra_args`` go to every server (e.g. ``["--max-clients", "10"]``).
    Returns once every server answers ``Health``.  Use the result as a context manager
    or call ``.stop()``.

    Raises:
        IntermediateServerStartError: if a server exits early or is not healthy within
            ``startup_timeout`` seconds (all started servers are then stopped).
    """
    if m < 1:
        raise ValueError(f"need at least one intermediate server, got m={m}")
    tmpdir = Path(tempfile.mkdtemp(prefix="ddpsa-intermediate-"))
    ca = ca or CertificateAuthority("cancelfl-ddpsa-ca")
    ca.write(tmpdir)
    if not isinstance(roster, Path):
        (tmpdir / "roster.json").write_text(Roster(dict(roster)).to_json())
        roster = tmpdir / "roster.json"
    _, server_pub = generate(tmpdir, PARAMETER_SERVER, force=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    procs: list[subprocess.Popen[bytes]] = []
    handles: list[IntermediateServerHandle] = []
    try:
        for j in range(m):
            tls = ca.issue(f"intermediate-{j}", (host, "localhost")).write(tmpdir, f"intermediate-{j}")
            cmd = [
                python, "-m", "server.intermediate",
                "--host", host, "--port", "0",
                "--server-id", f"intermediate-{j}",
                "--tls-cert", str(tls["cert"]), "--tls-key", str(tls["key"]),
                "--roster", str(roster), "--server-identity", str(server_pub),
                "--port-file", str(tmpdir / f"{j}.port"),
                "--parent-pid", str(os.getpid()),
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
                wait_until_healthy(address, ca.cert_pem, timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError as exc:
                raise IntermediateServerStartError(str(exc)) from exc
            handles.append(IntermediateServerHandle(j, address, port, p))
    except BaseException:
        _terminate(procs, timeout=2.0)
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    for j in range(m):
        (tmpdir / f"{j}.port").unlink(missing_ok=True)
    return IntermediateServerCluster(handles, tmpdir)


def roster_of(node_configs: Iterable[Mapping[str, object]]) -> Path | None:
    """The one roster file the nodes' configs name (``roster``), or None when they name none.

    None means the nodes fall back to the simulation identities derived from the run seed.
    """
    named = {str(nc.get(ROSTER, "")) for nc in node_configs} - {""}
    if len(named) > 1:
        raise ValueError(f"the nodes name {len(named)} different roster files; DDP-SA servers trust one")
    return Path(named.pop()) if named else None


@contextlib.contextmanager
def local_intermediate_servers(cfg: RunConfig, roster: Path | None = None) -> Iterator[RunConfig]:
    """Yield ``cfg`` with DDP-SA intermediate servers to talk to, starting local ones if it names none.

    The one place that starts intermediate servers for a run: the in-process engine, ``cancelfl run
    --engine simulation`` and ``cancelfl deploy`` all come through here.  ``roster`` is the clients'
    roster file; None = the simulation roster derived from the run seed (the identities Flower's
    simulation gives its nodes, :class:`protocols.identity.DerivedRoster`).  Methods other than
    ``ddpsa``, and runs whose ``ddpsa-servers`` lists servers, get ``cfg`` back unchanged and nothing
    is started.  The yielded config carries ``ddpsa-servers``, ``ddpsa-ca`` and ``ddpsa-server-key``;
    the caller must hand the same servers and CA to the clients through their own configuration.
    """
    count = local_services(cfg)
    if not count:
        yield cfg
        return
    members = roster if roster is not None else DerivedRoster(cfg.seed, cfg.num_clients)
    with start_intermediate_servers(count, members) as cluster:
        log.info("DDP-SA: started %d intermediate servers %s (pids %s)", len(cluster.addresses), cluster.addresses,
                 cluster.pids)
        yield cfg.replace(**{k.replace("-", "_"): v for k, v in cluster.run_config().items()})
