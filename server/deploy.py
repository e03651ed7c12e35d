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
file; all are stopped on exit (also on error or Ctrl-C; :mod:`server.processes`).  This is the same
topology as ``docker/docker-compose.yml``, without containers.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from protocols.config import ConfigError, RunConfig
from protocols.identity import Roster
from protocols.methods import local_services
from protocols.tls import CertificateAuthority
from server.defaults import app_defaults, check_flower_keys
from server.flower_commands import BIN, flower_env, submit, superlink_cmd, write_connection
from server.intermediate.launcher import IntermediateServerCluster, local_intermediate_servers, start_intermediate_servers
from server.keys import make_identities, node_name
from server.node_auth import SUPERLINK_FLAG, make_auth_keys, node_flag, register_supernodes
from server.processes import Processes, free_port, wait_for_port, workspace
from server.supernode import WORK_DIR_ENV, warm_count
from strategies.run.checkpoint import IDENTITY_DIR, clear_outputs, ledger_dir, resolve_out_dir, run_outcome

__all__ = ["INTERMEDIATE_IDLE_MB", "SUPERNODE_IDLE_MB", "LocalCluster", "available_memory_mb", "check_capacity",
           "check_service_capacity", "make_certificates",
           "run_deployment", "run_simulation", "run_simulations"]

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


def _fitting(count: int, each_mb: float, available_mb: float | None) -> tuple[float, int | None]:
    """(the available MB, how many processes of ``each_mb`` fit there; None when ``count`` fit or it is unknown)."""
    available_mb = available_memory_mb() if available_mb is None else available_mb
    if available_mb is None or count * each_mb <= available_mb:
        return available_mb or 0.0, None
    return available_mb, int(available_mb // each_mb)


def check_capacity(num_supernodes: int, available_mb: float | None = None) -> None:
    """Refuse a local deployment whose idle SuperNodes alone exceed this machine's available memory.

    Raises:
        ConfigError: naming ``--supernodes`` / ``num-clients`` and how many fit, when ``num_supernodes`` x
            :data:`SUPERNODE_IDLE_MB` exceeds ``available_mb`` (default: :func:`available_memory_mb`; no check
            where that is unknown).
    """
    available_mb, most = _fitting(num_supernodes, SUPERNODE_IDLE_MB, available_mb)
    if most is None:
        return
    raise ConfigError(f"--supernodes / run-config 'num-clients' = {num_supernodes}: {num_supernodes} SuperNode processes "
                      f"need at least {num_supernodes * SUPERNODE_IDLE_MB / 1024:.1f} GB ({SUPERNODE_IDLE_MB} MB each, "
                      f"idle), this machine has {available_mb / 1024:.1f} GB available; at most {most} fit here (use "
                      "`cancelfl run` for more simulated clients)")


#: Resident memory of one idle DDP-SA intermediate server (``python -m server.intermediate``) in MB (about 67).
INTERMEDIATE_IDLE_MB = 70


def check_service_capacity(count: int, available_mb: float | None = None) -> None:
    """Refuse more DDP-SA intermediate servers to start here than this machine's available memory holds.

    ``count``: the servers ``cancelfl`` starts for the run (:func:`protocols.methods.local_services`), one process
    each on every engine.

    Raises:
        ConfigError: naming ``ddpsa-num-servers`` and how many fit, when ``count`` x :data:`INTERMEDIATE_IDLE_MB`
            exceeds ``available_mb`` (default: :func:`available_memory_mb`; no check where that is unknown).
    """
    available_mb, most = _fitting(count, INTERMEDIATE_IDLE_MB, available_mb)
    if most is None:
        return
    raise ConfigError(f"run-config 'ddpsa-num-servers' = {count}: cancelfl starts that many intermediate server "
                      f"processes on this machine ({INTERMEDIATE_IDLE_MB} MB each, idle), which has "
                      f"{available_mb / 1024:.1f} GB available; at most {most} fit here: lower 'ddpsa-num-servers' or "
                      "name servers that run elsewhere in 'ddpsa-servers'")


def _final_check(out_dir: str, code: int) -> int:
    """Exit code of a submitted run, judged from its folder (``flwr run`` exits 0 even when the ServerApp crashed)."""
    code, message = run_outcome(out_dir, code)
    print(f"cancelfl: {message}", file=sys.stderr if code else sys.stdout)
    return code


def _absolute_out_dir(overrides: dict, defaults: dict, keep: Sequence[str] = ()) -> dict:
    """The ServerApp runs in another working directory: pass out-dir (and data-dir) as absolute paths.

    out-dir ``""`` becomes a fresh ``runs/<time>-<method>`` here, so the launcher knows where to look; an
    earlier run's outputs in the folder are removed before the run starts (kept when resuming), so they
    can never be taken for this run's.  ``keep``: folders the launcher made there for this run (its nodes'
    identities and ledgers), left in place.
    """
    out = dict(overrides)
    cfg = resolve_out_dir(RunConfig.from_mapping({**defaults, **out}))
    out["out-dir"] = cfg.out_dir
    if not cfg.resume:
        clear_outputs(cfg.out_dir, keep=keep)
    data_dir = out.get("data-dir", defaults.get("data-dir", ""))
    if data_dir:
        out["data-dir"] = str(Path(data_dir).resolve())
    return out


def run_simulation(overrides: dict, *, keep_workdir: str | None = None, client_cpus: int = 1,
                   verbose: bool = False, notes_shown: bool = False) -> int:
    """Run through a private simulation-mode SuperLink; returns a process exit code.

    ``client_cpus`` = 1 by default: a ClientApp's work here is small enough that one thread is fastest
    (Ray sets OMP_NUM_THREADS to the CPUs it reserves), and one CPU per ClientApp lets as many run at
    once as there are cores; Flower's default of 2 runs one at a time on a 2-core machine.
    ``verbose``: detailed round lines and Flower's start-up messages; ``notes_shown``: the caller has shown the
    run's start notes, the ServerApp does not log them again (:func:`flower_env`).
    """
    return run_simulations([overrides], keep_workdir=keep_workdir, client_cpus=client_cpus, verbose=verbose,
                           notes_shown=notes_shown)[0]


def run_simulations(runs: list[dict], *, keep_workdir: str | None = None, client_cpus: int = 1,
                    verbose: bool = False, notes_shown: bool = False) -> list[int]:
    """Several runs one after another on one private simulation-mode SuperLink (started once); exit codes.

    Every run must have the same ``num-clients`` (the simulated SuperNodes, ``flwr run --federation-config``).
    ``notes_shown``: as for :func:`run_simulation`, for every run.
    """
    defaults = app_defaults()
    cfgs = [RunConfig.from_mapping({**defaults, **o}) for o in runs]
    for o in runs:
        check_flower_keys(o)
    if len({c.num_clients for c in cfgs}) != 1:
        raise ValueError("run_simulations: every run needs the same num-clients (one simulated federation)")
    runs = [_absolute_out_dir(o, defaults) for o in runs]
    codes: list[int] = []
    with workspace(keep_workdir) as work:
        env = flower_env(work / "flwr-home", verbose=verbose, notes_shown=notes_shown)
        if len(runs) == 1 and not os.environ.get("CANCELFL_LEDGER_DIR"):
            # The simulated clients' privacy ledgers in the run folder (not the throwaway FLWR_HOME): a resumed
            # run continues them (client.ledger reads $CANCELFL_LEDGER_DIR).
            env["CANCELFL_LEDGER_DIR"] = str(ledger_dir(runs[0]["out-dir"]))
        procs = Processes(work, env)
        try:
            print(f"cancelfl: starting a SuperLink and {cfgs[0].num_clients} simulated clients (Ray); the first "
                  "round waits for Ray's workers (tens of seconds) ...", flush=True)
            port = free_port()
            procs.start("superlink", superlink_cmd(port, work, simulation=True, tls=None))
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


#: Longest folder the SuperNodes' work folders are made in: their socket paths (``cancelfl-supernode-XXXXXXXX/
#: superexec.wake``, 44 bytes more) must fit a Unix socket address (107 bytes).
NODES_DIR_MAX = 60


class LocalCluster:
    """A SuperLink, N SuperNodes and (optionally) DDP-SA intermediate servers as OS processes on loopback.

    Use as a context manager; :meth:`submit` runs the app against it (several
    runs may share one cluster).  Every process is stopped on exit; ``pids``
    lists them so callers (tests) can check that none survived.
    """

    def __init__(self, num_supernodes: int, *, tls: bool = False, intermediate_servers: int = 0,
                 keep_workdir: str | None = None, ledger_dir: str | None = None, identity_dir: str | None = None,
                 node_config: dict[str, str] | None = None, verbose: bool = False, notes_shown: bool = False) -> None:
        self.verbose, self.notes_shown = verbose, notes_shown  # :func:`flower_env`
        #: more node-config keys for every SuperNode (e.g. ``trusted-fab``, a policy)
        self.node_config = dict(node_config or {})
        self.num_supernodes, self.tls, self.n_intermediate = num_supernodes, tls, intermediate_servers
        #: node-config ``ledger-dir`` of every SuperNode (None: under each node's FLWR_HOME, thrown away on exit)
        self.ledger_dir = ledger_dir
        #: where the nodes' identities and roster are kept (reused when already there); None: the work folder
        self.identity_dir = identity_dir
        self._ws = workspace(keep_workdir)
        self.intermediate: list[str] = []
        self._servers: IntermediateServerCluster | None = None
        self.pids: list[int] = []
        self._cleanup: list[Path] = []

    def __enter__(self) -> LocalCluster:
        self.work = self._ws.__enter__()
        self.env = flower_env(self.work / "flwr-home", verbose=self.verbose, notes_shown=self.notes_shown)
        # Each SuperNode's work folder (server.supernode) holds its Unix sockets, whose paths fit in 107 bytes.
        self.nodes_dir = self.work / "supernodes"
        if len(str(self.nodes_dir)) > NODES_DIR_MAX:
            self.nodes_dir = Path(tempfile.mkdtemp(prefix="cancelfl-nodes-"))
            self._cleanup.append(self.nodes_dir)
        self.nodes_dir.mkdir(exist_ok=True)
        self.env[WORK_DIR_ENV] = str(self.nodes_dir)
        self.procs = Processes(self.work, self.env)
        print(f"cancelfl: starting a SuperLink and {self.num_supernodes} SuperNodes (processes on 127.0.0.1, "
              f"{'TLS' if self.tls else 'plain HTTP: --tls for TLS'}) ...", flush=True)
        try:
            ca = CertificateAuthority("cancelfl-ca")  # the deployment's CA: SuperLink (--tls) and DDP-SA servers
            certs = make_certificates(self.work / "certs", ca) if self.tls else None
            port = free_port()  # Flower 1.41 serves the Runtime, Control and Fleet APIs on one HTTP port
            # With TLS only registered SuperNodes join (Flower's node authentication, server/node_auth.py).
            self.procs.start("superlink", superlink_cmd(port, self.work, simulation=False, tls=certs)
                             + ([SUPERLINK_FLAG] if certs else []))
            wait_for_port(port, procs=self.procs)
            #: the SuperLink's Fleet API address, for SuperNodes
            self.address = f"127.0.0.1:{port}"
            self.connection = write_connection(self.work / "flwr-home", self.address,
                                               root_cert=certs["ca"] if certs else None)
            names = [node_name(i) for i in range(self.num_supernodes)]
            auth = make_auth_keys(self.work / "node-auth", names) if certs else {}
            if auth:
                register_supernodes(BIN / "flwr", self.env, self.connection, {n: pub for n, (_, pub) in auth.items()})
            # Node identities as `cancelfl keys gen` + `cancelfl keys roster` make them; each node's config points
            # at its own private key and the roster (require-identity: no silent fall-back to derived identities).
            keys, self.roster = node_identities(Path(self.identity_dir) if self.identity_dir else self.work / "identities",
                                                names)
            if self.n_intermediate:
                self._servers = start_intermediate_servers(self.n_intermediate, self.roster, ca=ca)
                self.intermediate = self._servers.addresses
            for i in range(self.num_supernodes):
                node_config = (f'partition-id={i} num-partitions={self.num_supernodes} identity-key="{keys[node_name(i)]}" '
                               f'roster="{self.roster}" require-identity=true')
                if self.ledger_dir:
                    node_config += f' ledger-dir="{self.ledger_dir}"'
                node_config += "".join(f' {key}="{value}"' for key, value in self.node_config.items())
                # Flower's SuperNode with a warm ClientApp process and short polls (server/supernode.py).
                node = [sys.executable, "-m", "server.supernode", "--superlink", f"127.0.0.1:{port}",
                        "--host", "127.0.0.1", "--port", str(free_port()), "--node-config", node_config]
                node += ["--root-certificates", str(certs["ca"]), *node_flag(auth[names[i]][0])] if certs else ["--insecure"]
                self.procs.start(f"supernode-{i}", node)
            self.pids = [p.pid for _, p in self.procs.procs] + (self._servers.pids if self._servers else [])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wait_warm(self, timeout: float = 300.0) -> float:
        """Wait until every SuperNode's warm ClientApp has imported its libraries; returns the seconds waited.

        Until then a message's ClientApp is a fresh interpreter (seconds of imports) and the preloads compete for
        the CPU with the run.  Returns at once with ``CANCELFL_WARM_CLIENTAPP=0``.

        Raises:
            RuntimeError: a process of the cluster exited, or ``timeout`` seconds passed.
        """
        t0 = time.monotonic()
        if self.env.get("CANCELFL_WARM_CLIENTAPP", "1") == "0":
            return 0.0
        while warm_count(self.nodes_dir) < self.num_supernodes:
            self.procs.check_alive()
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{warm_count(self.nodes_dir)} of {self.num_supernodes} SuperNodes have a warm "
                                   f"ClientApp after {timeout:.0f} s")
            time.sleep(0.2)
        return time.monotonic() - t0

    def submit(self, overrides: dict, *, timeout: float = 1800) -> int:
        """Run the app with run-config ``overrides``; returns 0 when ``summary.json`` was written."""
        defaults = app_defaults()
        own = [d for d in (self.identity_dir, self.ledger_dir) if d]  # made for this run, not an earlier run's
        overrides = {**_absolute_out_dir(overrides, defaults, keep=own), "num-clients": self.num_supernodes}
        cfg = RunConfig.from_mapping({**defaults, **overrides})
        check_flower_keys(overrides)
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
        for folder in self._cleanup:
            shutil.rmtree(folder, ignore_errors=True)
        self._ws.__exit__(*exc)


def run_deployment(overrides: dict, *, num_supernodes: int = 4, tls: bool = False,
                   keep_workdir: str | None = None, verbose: bool = False, notes_shown: bool = False) -> int:
    """SuperLink + ``num_supernodes`` SuperNodes as separate processes on loopback; returns an exit code.

    ``verbose``: detailed round lines and Flower's start-up messages; ``notes_shown``: the caller has shown the
    run's start notes, the ServerApp does not log them again (:func:`flower_env`).
    """
    defaults = app_defaults()
    overrides = _absolute_out_dir(overrides, defaults)  # an earlier run's outputs go before this run's nodes start
    cfg = RunConfig.from_mapping({**defaults, **overrides})
    n_inter = local_services(cfg)
    # The nodes' privacy ledgers and identities in the run folder, so that `cancelfl deploy --resume` continues
    # them: the resumed nodes are the same roster, hence the same public schedule and accounts.
    ledgers = str(ledger_dir(cfg.out_dir))
    identities = str(Path(cfg.out_dir) / IDENTITY_DIR)
    with LocalCluster(num_supernodes, tls=tls, intermediate_servers=n_inter, keep_workdir=keep_workdir,
                      ledger_dir=ledgers, identity_dir=identities, verbose=verbose, notes_shown=notes_shown) as cluster:
        return cluster.submit(overrides)


def node_identities(folder: Path, names: list[str]) -> tuple[dict[str, Path], Path]:
    """``(name -> private key path, roster path)`` of ``names`` in ``folder``: kept ones, else new ones.

    A resumed deployment finds its nodes' identities there; otherwise :func:`server.keys.make_identities`.
    """
    keys = {name: folder / f"{name}.key" for name in names}
    roster = folder / "roster.json"
    if roster.is_file() and all(k.is_file() for k in keys.values()) and set(Roster.load(roster)) == set(names):
        return keys, roster
    return make_identities(folder, names)


def make_certificates(folder: Path, ca: CertificateAuthority | None = None) -> dict[str, Path]:
    """A SuperLink certificate for 127.0.0.1/localhost from ``ca`` (None: a new self-signed CA, :mod:`protocols.tls`)."""
    ca = ca or CertificateAuthority("cancelfl-ca")
    return {"ca": ca.write(folder), **ca.issue("superlink").write(folder, "server")}
