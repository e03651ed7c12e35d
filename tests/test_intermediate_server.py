"""DDP-SA intermediate aggregation servers: gRPC servicer (TLS, signed access), subprocess cluster, failures.

The attacks of issue 16 on these servers are in ``tests/test_intermediate_attacks.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from protocols.ddpsa import ldp_noisy_mean
from protocols.identity import Identity, Roster, generate_identity, public_identity_json
from protocols.secret_sharing import FixedPointCodec, encode_and_share, ring_sum
from protocols.tls import CertificateAuthority
from protocols.wire.intermediate import (
    AccessPolicy,
    IntermediateServerClient,
    IntermediateServers,
    PartialSumUnavailableError,
    SharePushError,
    ShareTerms,
    abort_round,
    push_shares,
    reconstruct_decoded,
    reconstruct_sum,
    register_run,
    share_and_push,
    wait_until_healthy,
)
from server.intermediate import IntermediateAggregatorServicer, create_server, start_intermediate_servers
from server.intermediate.servicer import Limits
from tests.processes import pid_gone

REPO = Path(__file__).resolve().parents[1]
CLIENTS = ["c11", "c12", "c13"]


def _children_running_intermediate() -> list[int]:
    """Live child processes of this test process that run an intermediate server."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(")")[-1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"server.intermediate" in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def ids() -> dict[str, Identity]:
    """Roster clients plus the parameter server's identity (key "server")."""
    return {n: generate_identity(n) for n in [*CLIENTS, "c14", "server"]}


def _roster(ids: dict[str, Identity]) -> Roster:
    return Roster({n: i.public_bytes for n, i in ids.items() if n != "server"})


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority("test-ca")


# ------------------------------------------------------------------ in-process servicer
@pytest.fixture
def local_server(ids, ca) -> Iterator[tuple[IntermediateAggregatorServicer, IntermediateServerClient]]:
    policy = AccessPolicy(_roster(ids), ids["server"].public_bytes)
    servicer = IntermediateAggregatorServicer(policy, server_id="t", limits=Limits(keep_rounds=2, min_clients=2))
    cert = ca.issue("t")
    server, port = create_server(servicer, certificate=cert.cert_pem, private_key=cert.key_pem, max_workers=4)
    client = IntermediateServerClient(f"127.0.0.1:{port}", ca.cert_pem, timeout=5.0)
    try:
        yield servicer, client
    finally:
        client.close()
        server.stop(grace=None)


def _code(exc_info: pytest.ExceptionInfo[grpc.RpcError]) -> grpc.StatusCode:
    return exc_info.value.code()  # type: ignore[attr-defined]


def _open(client: IntermediateServerClient, ids, rnd: int, length: int = 100, run: str = "run") -> None:
    client.register_run_future(run, rnd, length, 4, ids["server"], participants=[*CLIENTS, "c14"]).result()


def test_partial_sum_idempotent_push_and_signed_status(local_server, ids) -> None:
    servicer, client = local_server
    _open(client, ids, 1)
    rng = np.random.default_rng(0)
    shares = {c: rng.integers(0, 2**64, size=100, dtype=np.uint64) for c in CLIENTS}
    for c, s in shares.items():
        reply = client.push_share("run", 1, ids[c], s)
        assert not reply.duplicate
    assert reply.clients_received == 3
    assert client.push_share("run", 1, ids["c11"], shares["c11"]).duplicate  # identical retry is fine
    with pytest.raises(grpc.RpcError) as e:
        client.push_share("run", 1, ids["c11"], shares["c12"])  # a different share under the same name
    assert _code(e) == grpc.StatusCode.ALREADY_EXISTS
    # The partial sum covers exactly the expected set (c13 is ignored here).
    got = client.get_partial_sum("run", 1, ["c12", "c11"], ids["server"])
    np.testing.assert_array_equal(got, ring_sum([shares["c11"], shares["c12"]]))
    np.testing.assert_array_equal(client.get_partial_sum("run", 1, ["c11", "c12"], ids["server"]), got)  # cached
    status = client.status(ids["server"])
    assert status.server_id == "t" and status.pid == os.getpid() and status.active_rounds == 1
    assert status.stored_bytes == 800  # the shares were dropped, the 100-word partial sum is kept
    assert servicer.stored_bytes() == 800
    with pytest.raises(grpc.RpcError) as e:
        client.status(ids["c11"])  # a client learns nothing
    assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
    assert client.health().status == "SERVING"


def test_servicer_rejects_bad_requests_with_clear_status(local_server, ids) -> None:
    _, client = local_server
    _open(client, ids, 1, length=3)
    ok = np.arange(3, dtype=np.uint64)
    client.push_share("run", 1, ids["c11"], ok)
    client.push_share("run", 1, ids["c12"], ok)
    cases = [
        (lambda: client.push_share("run", 1, ids["c13"], np.arange(4, dtype=np.uint64)),
         grpc.StatusCode.INVALID_ARGUMENT, "this run's shares have 24"),
        (lambda: client.push_share("run", 2, ids["c13"], ok), grpc.StatusCode.FAILED_PRECONDITION, "round not open"),
        (lambda: client.push_share("other", 1, ids["c13"], ok), grpc.StatusCode.NOT_FOUND, "not registered"),
        (lambda: client.get_partial_sum("run", 1, ["c11"], ids["server"]), grpc.StatusCode.FAILED_PRECONDITION,
         "min_clients=2"),
        (lambda: client.get_partial_sum("run", 1, ["c11", "c13"], ids["server"]), grpc.StatusCode.FAILED_PRECONDITION,
         "missing shares from expected clients ['c13']"),
        (lambda: client.register_run_future("run", 1, 4, 4, ids["server"], participants=CLIENTS).result(),
         grpc.StatusCode.FAILED_PRECONDITION, "another length"),
        (lambda: client.register_run_future("big", 1, 10**8, 4, ids["server"], participants=CLIENTS).result(),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "shares up to"),
    ]
    for call, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert _code(e) == code and words in e.value.details(), e.value.details()  # type: ignore[attr-defined]


def test_check_share_answers_as_the_push_would_and_stores_nothing(local_server, ids) -> None:
    """A push's pre-flight: the code of each refusal is the push's own, an accepted one stores nothing."""
    servicer, client = local_server
    client.register_run_future("run", 1, 4, 4, ids["server"], participants=CLIENTS).result()
    share = np.arange(4, dtype=np.uint64)
    shown, other = ShareTerms(tuple(CLIENTS), 3), ShareTerms(("c11", "c12", "c14"), 3)
    cases = [  # (signer, run, round, length, terms, code)
        (ids["c11"], "run", 1, 4, shown, None),
        (ids["c11"], "run", 1, 4, None, None),
        (Identity("c11", ids["c14"].private), "run", 1, 4, shown, grpc.StatusCode.UNAUTHENTICATED),
        (ids["c11"], "other", 1, 4, shown, grpc.StatusCode.NOT_FOUND),
        (ids["c11"], "run", 1, 5, shown, grpc.StatusCode.INVALID_ARGUMENT),
        (ids["c11"], "run", 2, 4, shown, grpc.StatusCode.FAILED_PRECONDITION),
        (ids["c14"], "run", 1, 4, None, grpc.StatusCode.PERMISSION_DENIED),
        (ids["c11"], "run", 1, 4, other, grpc.StatusCode.FAILED_PRECONDITION),
    ]
    for signer, run, rnd, length, terms, code in cases:
        if code is None:
            client.check_share_future(run, rnd, signer, length, terms).result()
            continue
        with pytest.raises(grpc.RpcError) as check:
            client.check_share_future(run, rnd, signer, length, terms).result()
        with pytest.raises(grpc.RpcError) as push:  # the push it stands for
            client.push_share(run, rnd, signer, np.arange(length, dtype=np.uint64), terms)
        assert _code(check) == _code(push) == code, (signer.name, run, rnd, length)
    assert servicer.stored_bytes() == 0
    client.push_share("run", 1, ids["c11"], share, shown)
    with pytest.raises(grpc.RpcError) as e:  # a second, fresh share would be refused
        client.check_share_future("run", 1, ids["c11"], 4, shown).result()
    assert _code(e) == grpc.StatusCode.ALREADY_EXISTS
    client.abort_round("run", 1, ids["server"])
    with pytest.raises(grpc.RpcError, match="already released or aborted"):
        client.check_share_future("run", 1, ids["c13"], 4, shown).result()


def test_round_is_sealed_after_release_and_abort_releases_nothing(local_server, ids) -> None:
    _, client = local_server
    _open(client, ids, 1, length=4)
    for c in CLIENTS:
        client.push_share("run", 1, ids[c], np.full(4, 1, dtype=np.uint64))
    client.get_partial_sum("run", 1, CLIENTS[:2], ids["server"])
    for call in (lambda: client.get_partial_sum("run", 1, CLIENTS, ids["server"]),
                 lambda: client.push_share("run", 1, ids["c14"], np.zeros(4, dtype=np.uint64))):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION
    _open(client, ids, 2, length=4)
    for c in CLIENTS:
        client.push_share("run", 2, ids[c], np.full(4, 2, dtype=np.uint64))
    assert client.abort_round("run", 2, ids["server"]).shares_dropped == 3
    with pytest.raises(grpc.RpcError, match="aborted"):
        client.get_partial_sum("run", 2, CLIENTS, ids["server"])


def test_old_rounds_are_dropped(local_server, ids) -> None:
    servicer, client = local_server
    for rnd in (1, 2, 3):
        _open(client, ids, rnd, length=2)
        for c in CLIENTS[:2]:
            client.push_share("run", rnd, ids[c], np.full(2, rnd, dtype=np.uint64))
    assert servicer.active_rounds() == 2  # keep_rounds=2: round 1 was dropped
    assert servicer.stored_bytes() == 2 * 2 * 16
    with pytest.raises(grpc.RpcError) as e:
        client.get_partial_sum("run", 1, CLIENTS[:2], ids["server"])
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION
    np.testing.assert_array_equal(client.get_partial_sum("run", 3, CLIENTS[:2], ids["server"]), [6, 6])


# ------------------------------------------------------------- subprocess end-to-end
def test_end_to_end_three_server_processes_four_clients(ids) -> None:
    m, d = 3, 5000
    codec = FixedPointCodec(frac_bits=32, max_clients=64)
    rng = np.random.default_rng(7)
    cluster = start_intermediate_servers(m, _roster(ids))
    pids = cluster.pids
    try:
        assert len(set(pids)) == m and os.getpid() not in pids
        assert all(a.startswith("127.0.0.1:") for a in cluster.addresses)
        servers = cluster.servers
        signer = Identity("parameter-server", _load_key(cluster.server_key_file))
        for j, addr in enumerate(cluster.addresses):
            assert wait_until_healthy(addr, servers.ca, timeout=5).status == "SERVING"
            with IntermediateServerClient(addr, servers.ca) as c:
                status = c.status(signer)
            assert status.pid == pids[j] and status.server_id == f"intermediate-{j}"

        # Round 1: each client runs the DDP-SA LDP step and pushes shares.
        clients = ["c11", "c12", "c13", "c14"]
        assert register_run(servers, "run-A", 1, d, 4, signer, participants=clients) == []
        updates = []
        for i, cid in enumerate(clients):
            upd = ldp_noisy_mean(rng.normal(size=(16, d)), clip=5.0, epsilon=1.0, adjacency="replace-one",
                                 seed=bytes([i]) * 32)
            updates.append(upd)
            assert share_and_push(upd, codec, servers, "run-A", 1, ids[cid]) == d
        total = reconstruct_sum(servers, "run-A", 1, clients, signer)
        exact = sum(codec.encode(u).view(np.int64).astype(object) for u in updates)
        assert np.array_equal(total.view(np.int64).astype(object), exact)  # bit-exact ring sum
        mean = reconstruct_decoded(servers, "run-A", 1, clients, signer, codec, mean=True)
        np.testing.assert_allclose(mean, np.mean(updates, axis=0), atol=2.0**-codec.frac_bits)

        # A client that skipped server #2: the round fails with the missing client named.
        register_run(servers, "run-A", 2, d, 4, signer, participants=clients)
        for cid in clients[:3]:
            share_and_push(rng.normal(size=d), codec, servers, "run-A", 2, ids[cid])
        shares = encode_and_share(rng.normal(size=d), m, codec)
        push_shares(IntermediateServers(servers.addresses[:2], servers.ca), "run-A", 2, ids["c14"], shares[:2])
        with pytest.raises(PartialSumUnavailableError, match="c14") as e:
            reconstruct_sum(servers, "run-A", 2, clients, signer)
        assert [f.server_index for f in e.value.failures] == [2]
        assert e.value.failures[0].code == grpc.StatusCode.FAILED_PRECONDITION

        # Round 3: all shares delivered, then server #1 dies -> reconstruction fails clearly; abort seals the rest.
        register_run(servers, "run-A", 3, d, 4, signer, participants=clients)
        for cid in clients:
            share_and_push(rng.normal(size=d), codec, servers, "run-A", 3, ids[cid])
        cluster.handles[1].process.send_signal(signal.SIGKILL)
        cluster.handles[1].process.wait(timeout=10)
        with pytest.raises(PartialSumUnavailableError, match="UNAVAILABLE") as e:
            reconstruct_sum(servers, "run-A", 3, clients, signer, timeout=5)
        assert [f.server_index for f in e.value.failures] == [1]
        assert cluster.addresses[1] in str(e.value)
        assert [f.server_index for f in abort_round(servers, "run-A", 3, signer)] == [1]
        # Round 4: opening fails on the dead server only, and so does pushing.
        assert [f.server_index for f in register_run(servers, "run-A", 4, d, 4, signer, participants=clients)] == [1]
        with pytest.raises(SharePushError) as pe:
            share_and_push(rng.normal(size=d), codec, servers, "run-A", 4, ids["c11"], timeout=5)
        assert [f.server_index for f in pe.value.failures] == [1]
        # A 2-of-3 Shamir run on the same servers goes on without server #1: pushes succeed, the sum is exact.
        assert [f.server_index for f in register_run(servers, "run-B", 1, d, 4, signer, participants=clients,
                                                     prime_field=True)] == [1]
        updates = [rng.normal(size=d) for _ in clients]
        for cid, upd in zip(clients, updates, strict=True):
            assert share_and_push(upd, codec, servers, "run-B", 1, ids[cid], threshold=2, timeout=5) == d
        total = reconstruct_sum(servers, "run-B", 1, clients, signer, threshold=2, timeout=5)
        exact = sum(codec.encode(u).view(np.int64).astype(object) for u in updates)
        assert np.array_equal(total.view(np.int64).astype(object), exact)
        with pytest.raises(PartialSumUnavailableError, match="Shamir sharing needs 3"):  # 3-of-3 cannot
            reconstruct_sum(servers, "run-B", 1, clients, signer, threshold=3, timeout=5)
    finally:
        cluster.stop()
    assert all(h.process.returncode is not None for h in cluster.handles)
    assert all(pid_gone(p) for p in pids)
    assert not cluster.folder.exists()  # the throwaway CA and the server key are gone
    assert _children_running_intermediate() == []


def _load_key(path: Path):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(path.read_bytes(), password=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_files(tmp_path: Path, ids, ca: CertificateAuthority) -> list[str]:
    tls = ca.issue("cli").write(tmp_path, "cli")
    (tmp_path / "roster.json").write_text(_roster(ids).to_json())
    (tmp_path / "server.pub").write_text(public_identity_json(ids["server"]))
    return ["--tls-cert", str(tls["cert"]), "--tls-key", str(tls["key"]), "--roster", str(tmp_path / "roster.json"),
            "--server-identity", str(tmp_path / "server.pub")]


def test_cli_explicit_port_graceful_sigterm_and_no_port_sharing(tmp_path, ids, ca) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "server.intermediate", "--host", "127.0.0.1", "--port", str(port),
           *_server_files(tmp_path, ids, ca)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(cmd + ["--server-id", "cli"], cwd=REPO, env=env, stderr=subprocess.PIPE)
    try:
        wait_until_healthy(f"127.0.0.1:{port}", ca.cert_pem, timeout=30)
        with IntermediateServerClient(f"127.0.0.1:{port}", ca.cert_pem) as c:
            assert c.status(ids["server"]).server_id == "cli"
        # A second server on the same port must fail (SO_REUSEPORT disabled), not share it.
        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=30)
        assert second.returncode != 0 and b"cannot bind" in second.stderr
        # Without TLS material or a roster the server does not start.
        bare = subprocess.run(cmd[:7], cwd=REPO, env=env, capture_output=True, timeout=30)
        assert bare.returncode != 0 and b"--tls-cert" in bare.stderr
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=15) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        first.stderr.close()  # type: ignore[union-attr]


def test_servers_exit_when_owner_process_dies(tmp_path: Path, ids) -> None:
    """An owner killed with SIGKILL cannot run cleanup; its servers must still exit."""
    pid_file = tmp_path / "pids"
    (tmp_path / "roster.json").write_text(_roster(ids).to_json())
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from server.intermediate import start_intermediate_servers
        c = start_intermediate_servers(2, Path({str(tmp_path / "roster.json")!r}))
        open({str(pid_file)!r}, "w").write(" ".join(map(str, c.pids)))
        time.sleep(120)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert owner.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert not any(pid_gone(p) for p in pids)
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    while not all(pid_gone(p) for p in pids):
        assert time.monotonic() < deadline, "orphaned intermediate servers still running"
        time.sleep(0.1)


def test_a_push_after_a_server_restart_reaches_the_new_server_at_once(ids, ca) -> None:
    """Kept channels (one per server and process) do not wait out gRPC's reconnect backoff after an outage."""
    policy = AccessPolicy(_roster(ids), ids["server"].public_bytes)
    cert = ca.issue("t")

    def start(port: int = 0):
        servicer = IntermediateAggregatorServicer(policy, server_id="t", limits=Limits(keep_rounds=2, min_clients=2))
        return create_server(servicer, certificate=cert.cert_pem, private_key=cert.key_pem, port=port, max_workers=4)

    server, port = start()
    servers = IntermediateServers((f"127.0.0.1:{port}",), ca.cert_pem)
    share = [np.arange(10, dtype=np.uint64)]
    assert register_run(servers, "run", 1, 10, 4, ids["server"], participants=CLIENTS, timeout=5.0) == []
    push_shares(servers, "run", 1, ids["c11"], share, timeout=5.0)
    server.stop(grace=None).wait()
    with pytest.raises(SharePushError):
        push_shares(servers, "run", 1, ids["c12"], share, timeout=5.0)
    server, _ = start(port)
    try:
        t0 = time.monotonic()
        assert register_run(servers, "run", 2, 10, 4, ids["server"], participants=CLIENTS, timeout=5.0) == []
        push_shares(servers, "run", 2, ids["c12"], share, timeout=5.0)
        assert time.monotonic() - t0 < 3.0
    finally:
        server.stop(grace=None)


def test_modules_do_not_import_flwr() -> None:
    code = (
        "import sys, protocols.wire.intermediate, server.intermediate, server.intermediate.__main__, protocols.secret_sharing, "
        "protocols.ddpsa, protocols.privacy; "
        "bad = sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.')); "
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
