"""What a deployment keeps on disk: the nodes' identities where the run needs them, private keys private.

No process is started: :class:`server.deploy.LocalCluster` is entered without its SuperLink and SuperNodes,
so ``run_deployment`` runs its real order (run folder, identities, submit) up to ``flwr run``.
"""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from server import deploy
from server.keys import generate, node_name
from strategies.run.checkpoint import IDENTITY_DIR, LEDGER_DIR


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def processless_cluster(monkeypatch, tmp_path):
    """LocalCluster whose enter makes only the nodes' identities; ``flwr run`` records what the nodes would find."""
    seen: list[dict[str, bool]] = []

    def enter(self):
        self.work, self.env, self.connection, self._servers, self.intermediate = tmp_path / "work", {}, "c", None, []
        self.procs = SimpleNamespace(check_alive=lambda: None, close=lambda: None)
        self.keys, self.roster = deploy.node_identities(Path(self.identity_dir),
                                                        [node_name(i) for i in range(self.num_supernodes)])
        return self

    def submit(work, env, connection, overrides, **_):
        # What every SuperNode's node config names must exist when the run's first message reaches it.
        seen.append({str(p): Path(p).is_file() for p in (*seen_cluster[0].keys.values(), seen_cluster[0].roster)})
        return 0

    seen_cluster: list = []
    original_init = deploy.LocalCluster.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen_cluster.append(self)

    monkeypatch.setattr(deploy.LocalCluster, "__init__", init)
    monkeypatch.setattr(deploy.LocalCluster, "__enter__", enter)
    monkeypatch.setattr(deploy.LocalCluster, "__exit__", lambda self, *exc: None)
    monkeypatch.setattr(deploy, "submit", submit)
    monkeypatch.setattr(deploy, "_final_check", lambda out_dir, code: code)
    return seen


def test_deployed_nodes_find_their_identities_when_the_run_starts(processless_cluster, tmp_path):
    """The run folder's identities are made for this run: the submit step must not clear them as stale outputs."""
    out = tmp_path / "run"
    code = deploy.run_deployment({"method": "nadp", "num-clients": 3, "out-dir": str(out)}, num_supernodes=3)
    assert code == 0
    [found] = processless_cluster
    assert found and all(found.values()), f"missing when the run started: {[p for p, ok in found.items() if not ok]}"
    for i in range(3):
        assert _mode(out / IDENTITY_DIR / f"{node_name(i)}.key") == 0o600


def test_a_fresh_deployment_replaces_an_earlier_runs_identities_and_ledgers(processless_cluster, tmp_path):
    out = tmp_path / "run"
    (out / LEDGER_DIR).mkdir(parents=True)
    (out / LEDGER_DIR / "client-0.json").write_text("{}")  # an earlier run's spend: not this run's
    old_key, _ = generate(out / IDENTITY_DIR, node_name(0))
    old_pem = old_key.read_bytes()
    deploy.run_deployment({"method": "nadp", "num-clients": 2, "out-dir": str(out)}, num_supernodes=2)
    assert not (out / LEDGER_DIR / "client-0.json").exists()
    assert (out / IDENTITY_DIR / f"{node_name(0)}.key").read_bytes() != old_pem


def test_the_server_starting_a_fresh_run_leaves_the_nodes_identities_and_ledgers(tmp_path):
    """The ServerApp starts after the launcher's nodes: their folders in the run folder are this run's."""
    from protocols.config import RunConfig
    from server.defaults import app_defaults
    from strategies.run.checkpoint import start_run_folder

    out = tmp_path / "run"
    key, _ = generate(out / IDENTITY_DIR, node_name(0))
    (out / LEDGER_DIR).mkdir()
    (out / "metrics.jsonl").write_text("{}\n")  # an earlier run's output
    start_run_folder(RunConfig.from_mapping({**app_defaults(), "out-dir": str(out)}))
    assert key.is_file() and (out / LEDGER_DIR).is_dir() and not (out / "metrics.jsonl").exists()


def test_an_inprocess_run_does_not_continue_an_earlier_runs_ledgers_in_its_folder(tmp_path):
    """The in-process launcher clears an earlier run's client ledgers before its clients exist."""
    from server.launch import run_inprocess

    out = tmp_path / "run"
    (out / LEDGER_DIR).mkdir(parents=True)
    (out / LEDGER_DIR / "client-0.json").write_text('{"version": 99}')  # an earlier run's, unreadable here
    summary = run_inprocess({"method": "ldp", "num-clients": 2, "num-rounds": 1, "dataset": "digits",
                             "train-subset": 200, "test-subset": 100, "out-dir": str(out)}, progress=lambda *_: None)
    assert summary["rounds_completed"] == 1
    assert '"version": 2' in (out / LEDGER_DIR / "client-0.json").read_text()



def test_a_replaced_private_key_is_owner_only_even_over_a_world_readable_file(tmp_path):
    """`cancelfl keys gen --force`, a deployment's identities and TLS keys: the old file's mode is not kept."""
    from protocols.tls import CertificateAuthority

    for name in ("node-0.key", "server.key"):
        (tmp_path / name).write_text("an earlier key")
        (tmp_path / name).chmod(0o644)
    linked = tmp_path / "elsewhere.key"
    linked.hardlink_to(tmp_path / "node-0.key")
    key, _ = generate(tmp_path, "node-0", force=True)
    tls = CertificateAuthority().issue("superlink").write(tmp_path, "server")
    assert _mode(key) == 0o600 and _mode(tls["key"]) == 0o600
    assert linked.read_text() == "an earlier key"  # a hard link to the old file never receives the new key
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


#: The private keys each docker-compose service may mount (host file names): its own role's and nothing else.
COMPOSE_KEYS = {"superlink": {"server.key", "parameter-server.key"}, "submit": set(),
                **{f"ddpsa-{i}": {f"intermediate-{i}.key"} for i in range(3)},  # separate parties: a key each
                **{f"supernode-{i}": {f"node-{i}.key", f"node-{i}.auth"} for i in range(3)}}


def _compose_mounts() -> dict[str, list[str]]:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((Path(__file__).parents[1] / "docker" / "docker-compose.yml").read_text())
    return {name: [str(v).rpartition(":/")[0] for v in svc.get("volumes", [])]
            for name, svc in compose["services"].items()}


def test_each_compose_service_mounts_only_its_own_private_keys():
    """A SuperNode container holding the CA's or the SuperLink's key could impersonate the SuperLink to its peers."""
    mounts = _compose_mounts()
    assert set(mounts) - {"keys"} == set(COMPOSE_KEYS)
    for name, allowed in COMPOSE_KEYS.items():
        folders = [m for m in mounts[name] if m.endswith("/generated}")]  # CANCELFL_CERTS_DIR or _KEYS_DIR itself
        assert not folders, f"{name} mounts a whole key or certificate folder: {folders}"
        keys = {Path(m).name for m in mounts[name] if m.endswith((".key", ".auth"))}
        assert keys == allowed, f"{name} mounts private keys {sorted(keys)}, its role needs {sorted(allowed)}"


def test_supernode_auth_keys_are_what_flower_reads_and_owner_only(tmp_path, capsys):
    """`cancelfl keys auth`: a P-384 key Flower's SuperNode loads, private 0600, never overwritten silently."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from server.launch import main

    assert main(["keys", "auth", "--out", str(tmp_path), "--node", "node-0"]) == 0
    private, public = tmp_path / "node-0.auth", tmp_path / "node-0.auth-pub"
    key = load_ssh_private_key(private.read_bytes(), None)  # as flower-supernode --auth-supernode-private-key
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert load_ssh_public_key(public.read_bytes()).public_numbers() == key.public_key().public_numbers()
    line = public.read_text()  # one OpenSSH line, newline-terminated as ssh-keygen writes it
    assert line.startswith("ecdsa-sha2-nistp384 ") and line.endswith("\n") and line.count("\n") == 1
    assert _mode(private) == 0o600
    before = private.read_bytes()
    assert main(["keys", "auth", "--out", str(tmp_path), "--node", "node-0"]) == 2
    assert private.read_bytes() == before and "--force" in capsys.readouterr().err
    # several nodes, one of them existing: nothing is written (no partial set of keys)
    assert main(["keys", "auth", "--out", str(tmp_path), "--node", "node-1", "--node", "node-0"]) == 2
    assert not (tmp_path / "node-1.auth").exists() and private.read_bytes() == before


def test_compose_superlink_admits_only_registered_supernodes():
    """The compose SuperLink authenticates SuperNodes and registers their keys before it reports healthy."""
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((Path(__file__).parents[1] / "docker" / "docker-compose.yml").read_text())["services"]
    script = " ".join(services["superlink"]["command"])
    assert "--enable-supernode-auth" in script and "flwr supernode register" in script
    assert "supernodes-registered" in " ".join(services["superlink"]["healthcheck"]["test"])
    for i in range(3):
        assert "--auth-supernode-private-key=/identity/node.auth" in services[f"supernode-{i}"]["command"]


def test_a_registration_that_cannot_start_stops_the_ones_already_running(tmp_path, monkeypatch):
    """``flwr supernode register`` missing or failing to start for one node: the others are stopped, a RuntimeError."""
    import subprocess

    from server import node_auth

    started = []

    class Proc:
        def __init__(self, args, **_kw):
            if len(started) == 1:
                raise FileNotFoundError(2, "No such file or directory", args[0])
            self.killed = self.waited = False
            started.append(self)

        def kill(self):
            self.killed = True

        def communicate(self, timeout=None):
            self.waited = True
            return "", None

    monkeypatch.setattr(subprocess, "Popen", Proc)
    with pytest.raises(RuntimeError, match="supernode register"):
        node_auth.register_supernodes(tmp_path / "flwr", {}, "local", {"node-0": tmp_path / "a", "node-1": tmp_path / "b"})
    assert len(started) == 1 and started[0].killed and started[0].waited
