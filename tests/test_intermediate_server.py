"""DDP-SA intermediate aggregation servers: gRPC servicer, subprocess cluster, failures."""

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

from client.intermediate import (
    IntermediateServerClient,
    PartialSumUnavailableError,
    SharePushError,
    push_shares,
    reconstruct_decoded,
    reconstruct_sum,
    share_and_push,
    wait_until_healthy,
)
from protocols.ddpsa import ldp_noisy_mean
from protocols.secret_sharing import FixedPointCodec, encode_and_share, ring_sum
from server.intermediate import IntermediateAggregatorServicer, create_server, start_intermediate_servers
from tests.processes import pid_gone

REPO = Path(__file__).resolve().parents[1]


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


# ------------------------------------------------------------------ in-process servicer
@pytest.fixture
def local_server() -> Iterator[tuple[IntermediateAggregatorServicer, IntermediateServerClient]]:
    servicer = IntermediateAggregatorServicer(server_id="t", keep_rounds=2, min_clients=2)
    server, port = create_server("127.0.0.1", 0, servicer=servicer, max_workers=4)
    client = IntermediateServerClient(f"127.0.0.1:{port}", timeout=5.0)
    try:
        yield servicer, client
    finally:
        client.close()
        server.stop(grace=None)


def _code(exc_info: pytest.ExceptionInfo[grpc.RpcError]) -> grpc.StatusCode:
    return exc_info.value.code()  # type: ignore[attr-defined]


def test_partial_sum_and_idempotent_push(local_server) -> None:
    servicer, client = local_server
    rng = np.random.default_rng(0)
    shares = {c: rng.integers(0, 2**64, size=100, dtype=np.uint64) for c in (11, 12, 13)}
    for c, s in shares.items():
        reply = client.push_share("run", 1, c, s)
        assert not reply.duplicate
    assert reply.clients_received == 3
    assert client.push_share("run", 1, 11, shares[11]).duplicate  # identical retry is fine
    # The partial sum covers exactly the expected set (client 13 is ignored here).
    got = client.get_partial_sum("run", 1, [12, 11])
    np.testing.assert_array_equal(got, ring_sum([shares[11], shares[12]]))
    np.testing.assert_array_equal(client.get_partial_sum("run", 1, [11, 12]), got)  # cached retry
    health = client.health()
    assert health.status == "SERVING" and health.server_id == "t" and health.pid == os.getpid()
    assert health.active_rounds == 1


def test_servicer_rejects_bad_requests_with_clear_status(local_server) -> None:
    _, client = local_server
    s = np.arange(10, dtype=np.uint64)
    client.push_share("run", 1, 1, s)
    with pytest.raises(grpc.RpcError) as e:
        client.push_share("run", 1, 1, s + np.uint64(1))
    assert _code(e) == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as e:
        client.push_share("run", 1, 2, np.arange(11, dtype=np.uint64))
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT and "length" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.push_share("", 1, 2, s)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        client.get_partial_sum("run", 1, [1, 2, 3])
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION and "missing shares from expected clients [2, 3]" in (
        e.value.details()
    )
    with pytest.raises(grpc.RpcError) as e:  # a one-client "sum" would expose a share
        client.get_partial_sum("run", 1, [1])
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION and "min_clients" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.get_partial_sum("run", 9, [1, 2])
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION


def test_round_is_sealed_after_release(local_server) -> None:
    _, client = local_server
    for c in (1, 2, 3):
        client.push_share("run", 5, c, np.full(4, c, dtype=np.uint64))
    np.testing.assert_array_equal(client.get_partial_sum("run", 5, [1, 2, 3]), np.full(4, 6, dtype=np.uint64))
    for call in (
        lambda: client.get_partial_sum("run", 5, [1, 2]),  # difference would reveal client 3
        lambda: client.push_share("run", 5, 4, np.zeros(4, dtype=np.uint64)),  # late share
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION


def test_old_rounds_are_dropped(local_server) -> None:
    servicer, client = local_server
    for rnd in (1, 2, 3):
        for c in (1, 2):
            client.push_share("run", rnd, c, np.full(3, rnd, dtype=np.uint64))
    assert servicer.active_rounds() == 2  # keep_rounds=2: round 1 was dropped
    with pytest.raises(grpc.RpcError) as e:
        client.get_partial_sum("run", 1, [1, 2])
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION and "dropped" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.push_share("run", 1, 3, np.zeros(3, dtype=np.uint64))
    assert "stale" in e.value.details()
    np.testing.assert_array_equal(client.get_partial_sum("run", 2, [1, 2]), np.full(3, 4, dtype=np.uint64))


# ------------------------------------------------------------- subprocess end-to-end
def test_end_to_end_three_server_processes_four_clients() -> None:
    m, n_clients, d = 3, 4, 5000
    codec = FixedPointCodec(frac_bits=32, max_clients=64)
    rng = np.random.default_rng(7)
    cluster = start_intermediate_servers(m)
    pids = cluster.pids
    try:
        assert len(set(pids)) == m and os.getpid() not in pids
        assert all(a.startswith("127.0.0.1:") for a in cluster.addresses)
        for j, addr in enumerate(cluster.addresses):
            h = wait_until_healthy(addr, timeout=5)
            assert h.pid == pids[j] and h.server_id == f"intermediate-{j}"

        # Round 1: each client runs the DDP-SA LDP step and pushes shares.
        clients = [101, 202, 303, 404]
        updates = []
        for i, cid in enumerate(clients):
            per_sample = rng.normal(size=(16, d))
            upd = ldp_noisy_mean(per_sample, clip=5.0, epsilon=1.0, seed=bytes([i]) * 32)
            updates.append(upd)
            assert share_and_push(upd, codec, cluster.addresses, "run-A", 1, cid) == d
        total = reconstruct_sum(cluster.addresses, "run-A", 1, clients)
        exact = sum(codec.encode(u).view(np.int64).astype(object) for u in updates)
        assert np.array_equal(total.view(np.int64).astype(object), exact)  # bit-exact ring sum
        err = np.abs(codec.decode(total) - np.sum(updates, axis=0)).max()
        assert err <= n_clients * 2.0**-codec.frac_bits
        mean = reconstruct_decoded(cluster.addresses, "run-A", 1, clients, codec, mean=True)
        np.testing.assert_allclose(mean, np.mean(updates, axis=0), atol=2.0**-codec.frac_bits)

        # A client that skipped server #2: the round fails with the missing client named.
        for cid in clients[:3]:
            share_and_push(rng.normal(size=d), codec, cluster.addresses, "run-A", 2, cid)
        shares = encode_and_share(rng.normal(size=d), m, codec)
        push_shares(cluster.addresses[:2], "run-A", 2, clients[3], shares[:2])
        with pytest.raises(PartialSumUnavailableError, match="404") as e:
            reconstruct_sum(cluster.addresses, "run-A", 2, clients)
        assert [f.server_index for f in e.value.failures] == [2]
        assert e.value.failures[0].code == grpc.StatusCode.FAILED_PRECONDITION

        # Round 3: all shares delivered, then server #1 dies -> reconstruction fails clearly.
        for cid in clients:
            share_and_push(rng.normal(size=d), codec, cluster.addresses, "run-A", 3, cid)
        cluster.handles[1].process.send_signal(signal.SIGKILL)
        cluster.handles[1].process.wait(timeout=10)
        with pytest.raises(PartialSumUnavailableError, match="UNAVAILABLE") as e:
            reconstruct_sum(cluster.addresses, "run-A", 3, clients, timeout=5)
        assert [f.server_index for f in e.value.failures] == [1]
        assert e.value.failures[0].code == grpc.StatusCode.UNAVAILABLE
        assert cluster.addresses[1] in str(e.value)
        # Round 4: pushing to the dead server fails too, naming only that server.
        with pytest.raises(SharePushError) as pe:
            share_and_push(rng.normal(size=d), codec, cluster.addresses, "run-A", 4, clients[0], timeout=5)
        assert [f.server_index for f in pe.value.failures] == [1]
    finally:
        cluster.stop()
    assert all(h.process.returncode is not None for h in cluster.handles)
    assert all(pid_gone(p) for p in pids)
    assert _children_running_intermediate() == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_explicit_port_graceful_sigterm_and_no_port_sharing() -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "server.intermediate", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(cmd + ["--server-id", "cli"], cwd=REPO, env=env, stderr=subprocess.PIPE)
    try:
        assert wait_until_healthy(f"127.0.0.1:{port}", timeout=30).server_id == "cli"
        # A second server on the same port must fail (SO_REUSEPORT disabled), not share it.
        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=30)
        assert second.returncode != 0 and b"cannot bind" in second.stderr
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=15) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        first.stderr.close()  # type: ignore[union-attr]


def test_servers_exit_when_owner_process_dies(tmp_path: Path) -> None:
    """An owner killed with SIGKILL cannot run cleanup; its servers must still exit."""
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import time
        from server.intermediate import start_intermediate_servers
        c = start_intermediate_servers(2)
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


def test_modules_do_not_import_flwr() -> None:
    code = (
        "import sys, client.intermediate, server.intermediate, server.intermediate.__main__, protocols.secret_sharing, "
        "protocols.ddpsa, protocols.privacy; "
        "bad = sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.')); "
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
