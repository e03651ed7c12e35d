"""Issue 16's attacks on the DDP-SA intermediate servers, by an outside caller against the real server processes.

The attacker ("mallory") is a participant: it holds a roster identity of its own, the run id and the
servers' CA certificate (everything a participant receives), but not the parameter server's key.
Each attack must fail while the honest round it targets still reconstructs exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization

from protocols.identity import Identity, Roster, generate_identity
from protocols.secret_sharing import FixedPointCodec, encode_and_share
from protocols.wire.intermediate import (
    IntermediateServerClient,
    IntermediateServers,
    PartialSumUnavailableError,
    SharePushError,
    ShareTerms,
    check_shares,
    intermediate_pb2,
    reconstruct_sum,
    register_run,
    share_and_push,
)
from protocols.wire.intermediate import auth as wire_auth
from protocols.wire.intermediate import intermediate_pb2_grpc as pb2_grpc
from server.intermediate import IntermediateServerCluster, start_intermediate_servers
from tests.processes import pid_gone

HONEST = ["victim", "alice", "bob"]
#: The round's participants: the honest clients and mallory.
PARTICIPANTS = [*HONEST, "mallory"]
D = 1000  # model size of the attacked run
RUN = "run-under-attack"
CODEC = FixedPointCodec(frac_bits=24, max_clients=16)


@pytest.fixture(scope="module")
def ids() -> dict[str, Identity]:
    return {n: generate_identity(n) for n in [*HONEST, "mallory"]}


@pytest.fixture(scope="module")
def cluster(ids) -> Iterator[IntermediateServerCluster]:
    roster = Roster({n: i.public_bytes for n, i in ids.items()})
    with start_intermediate_servers(3, roster) as c:
        yield c
    assert all(pid_gone(p) for p in c.pids)


@pytest.fixture(scope="module")
def server_signer(cluster) -> Identity:
    key = serialization.load_pem_private_key(cluster.server_key_file.read_bytes(), password=None)
    return Identity("parameter-server", key)  # type: ignore[arg-type]


def _code(e: pytest.ExceptionInfo) -> grpc.StatusCode:
    return e.value.code()


def _honest_round(cluster, ids, signer, rnd: int, run: str = RUN) -> dict[str, np.ndarray]:
    """Open round ``rnd`` and push every honest client's update; returns the updates."""
    servers = cluster.servers
    assert register_run(servers, run, rnd, D, 4, signer, participants=PARTICIPANTS) == []
    rng = np.random.default_rng(rnd)
    updates = {n: rng.normal(size=D) for n in HONEST}
    for n, u in updates.items():
        share_and_push(u, CODEC, servers, run, rnd, ids[n])
    return updates


def _assert_reconstructs(cluster, signer, rnd: int, updates: dict[str, np.ndarray], run: str = RUN) -> None:
    total = CODEC.decode(reconstruct_sum(cluster.servers, run, rnd, sorted(updates), signer))
    np.testing.assert_allclose(total, np.sum(list(updates.values()), axis=0), atol=len(updates) * CODEC.resolution)


def _each(cluster) -> Iterator[IntermediateServerClient]:
    for a in cluster.addresses:
        with IntermediateServerClient(a, cluster.servers.ca, timeout=10) as c:
            yield c


def test_fake_client_partial_sum_attack_fails(cluster, ids, server_signer) -> None:
    """Push a zero share as client 999, ask for the partial sum of {victim, 999}: refused everywhere."""
    updates = _honest_round(cluster, ids, server_signer, 1)
    fake = Identity("999", generate_identity("999").private)  # a key the roster does not hold
    zero = encode_and_share(np.zeros(D), 3, CODEC)
    for j, c in enumerate(_each(cluster)):
        with pytest.raises(grpc.RpcError) as e:
            c.push_share(RUN, 1, fake, zero[j])
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
        for asker in (ids["mallory"], fake):  # a participant's signature does not open partial sums
            with pytest.raises(grpc.RpcError) as e:
                c.get_partial_sum(RUN, 1, ["victim", "999"], asker)
            assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:  # nor does no signature at all
            c.stub.GetPartialSum(intermediate_pb2.GetPartialSumRequest(run_id=RUN, round=1,
                                                                       expected_clients=["victim", "mallory"]))
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
    # The round was neither sealed nor poisoned: the parameter server still gets the exact sum.
    _assert_reconstructs(cluster, server_signer, 1, updates)


def test_id_squatting_fails(cluster, ids, server_signer) -> None:
    """A share pushed under an honest client's name (signed by the squatter) is refused; the owner still pushes."""
    servers = cluster.servers
    assert register_run(servers, RUN, 2, D, 4, server_signer, participants=PARTICIPANTS) == []
    squatter = Identity("alice", ids["mallory"].private)
    poison = encode_and_share(np.full(D, 1e6), 3, CODEC)
    for j, c in enumerate(_each(cluster)):
        with pytest.raises(grpc.RpcError) as e:
            c.push_share(RUN, 2, squatter, poison[j])
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
    rng = np.random.default_rng(2)
    updates = {n: rng.normal(size=D) for n in HONEST}
    for n, u in updates.items():
        share_and_push(u, CODEC, servers, RUN, 2, ids[n])  # alice is not rejected as a duplicate
    _assert_reconstructs(cluster, server_signer, 2, updates)


def test_run_eviction_fails(cluster, ids, server_signer) -> None:
    """Junk run ids create no state and evict nothing (20 of them; a server holds at most 8 runs)."""
    updates = _honest_round(cluster, ids, server_signer, 3)
    share = np.zeros(D, dtype=np.uint64)
    for k in range(20):
        for c in _each(cluster):
            with pytest.raises(grpc.RpcError) as e:
                c.push_share(f"junk-{k}", 1, ids["mallory"], share)
            assert _code(e) == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as e:  # only the parameter server registers runs
                c.register_run_future(f"junk-{k}", 1, D, 4, ids["mallory"], participants=PARTICIPANTS).result()
            assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
    for c in _each(cluster):
        assert c.status(server_signer).active_runs == 1
    _assert_reconstructs(cluster, server_signer, 3, updates)


def test_roster_client_outside_the_round_cannot_push_nor_fill_the_cap() -> None:
    """Round {a, b} at a cap of 2: roster client c pushes first and is refused; a and b are accepted and sum exactly."""
    ids = {n: generate_identity(n) for n in ("a", "b", "c")}
    with start_intermediate_servers(2, Roster({n: i.public_bytes for n, i in ids.items()})) as c:
        key = serialization.load_pem_private_key(c.server_key_file.read_bytes(), password=None)
        signer = Identity("parameter-server", key)  # type: ignore[arg-type]
        assert register_run(c.servers, "r", 1, 10, 2, signer, participants=["a", "b"]) == []
        with pytest.raises(SharePushError) as e:  # a zero share from outside the round, before the honest ones
            share_and_push(np.zeros(10), CODEC, c.servers, "r", 1, ids["c"])
        assert [f.code for f in e.value.failures] == [grpc.StatusCode.PERMISSION_DENIED] * 2
        assert "not one of the participants" in str(e.value)
        share_and_push(np.ones(10), CODEC, c.servers, "r", 1, ids["a"])
        share_and_push(np.full(10, 2.0), CODEC, c.servers, "r", 1, ids["b"])
        total = CODEC.decode(reconstruct_sum(c.servers, "r", 1, ["a", "b"], signer))
        np.testing.assert_allclose(total, 3.0, atol=2 * CODEC.resolution)
        with pytest.raises(PartialSumUnavailableError, match="c"):  # c's share was never stored
            reconstruct_sum(c.servers, "r", 1, ["a", "c"], signer)
        # The next round is opened for {b, c}: now c pushes and a is refused.
        assert register_run(c.servers, "r", 2, 10, 2, signer, participants=["b", "c"]) == []
        share_and_push(np.ones(10), CODEC, c.servers, "r", 2, ids["c"])
        with pytest.raises(SharePushError, match="PERMISSION_DENIED"):
            share_and_push(np.ones(10), CODEC, c.servers, "r", 2, ids["a"])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_oversized_push_fails_and_stores_nothing(cluster, ids, server_signer) -> None:
    """A 64 MiB push is refused by the transport; a large wrong-length one by the run's registered length."""
    updates = _honest_round(cluster, ids, server_signer, 4)
    address, pid = cluster.addresses[0], cluster.pids[0]
    before = _rss_mb(pid)
    with IntermediateServerClient(address, cluster.servers.ca, timeout=60, max_message_bytes=80 << 20) as c:
        huge = np.zeros((64 << 20) // 8, dtype=np.uint64)
        with pytest.raises(grpc.RpcError) as e:
            c.push_share(RUN, 4, ids["mallory"], huge)
        assert _code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:
            c.push_share(RUN, 4, ids["mallory"], np.zeros((16 << 20) // 8, dtype=np.uint64))
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
        status = c.status(server_signer)
    assert status.stored_bytes == (1 + len(HONEST)) * 8 * D  # round 3's partial sum + the honest shares of round 4
    assert _rss_mb(pid) - before < 100  # nothing of the junk was kept
    _assert_reconstructs(cluster, server_signer, 4, updates)


def test_unauthenticated_callers_learn_only_liveness(cluster, ids) -> None:
    fields = [f.name for f in intermediate_pb2.HealthReply.DESCRIPTOR.fields]
    assert fields == ["status"]  # no pid, no round counts
    with IntermediateServerClient(cluster.addresses[0], cluster.servers.ca) as c:
        assert c.health().status == "SERVING"
        with pytest.raises(grpc.RpcError) as e:
            c.status(ids["mallory"])
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
    # Plaintext is not served, and a server certificate from another CA is not trusted.
    with grpc.insecure_channel(cluster.addresses[0]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb2_grpc.IntermediateAggregatorStub(ch).Health(intermediate_pb2.HealthRequest(), timeout=5)
        assert _code(e) == grpc.StatusCode.UNAVAILABLE
    from protocols.tls import CertificateAuthority

    other = IntermediateServers(tuple(cluster.addresses), CertificateAuthority("other").cert_pem)
    with IntermediateServerClient(other.addresses[0], other.ca, timeout=5) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.health()
        assert _code(e) == grpc.StatusCode.UNAVAILABLE


def test_statements_bind_every_field() -> None:
    """A signature over one request does not verify for any changed field."""
    base = wire_auth.push_statement("r", 1, "alice", b"\x00" * 8)
    assert len({base, wire_auth.push_statement("r2", 1, "alice", b"\x00" * 8),
                wire_auth.push_statement("r", 2, "alice", b"\x00" * 8),
                wire_auth.push_statement("r", 1, "bob", b"\x00" * 8),
                wire_auth.push_statement("r", 1, "alice", b"\x01" + b"\x00" * 7),
                wire_auth.push_statement("r", 1, "alice", b"\x00" * 8, wire_auth.participants_digest(["alice"]), 1),
                wire_auth.push_statement("r", 1, "alice", b"\x00" * 8, wire_auth.participants_digest(["alice"]), 2),
                wire_auth.push_statement("r", 1, "alice", b"\x00" * 8, wire_auth.participants_digest(["bob"]), 1)}) == 8
    assert wire_auth.participants_digest(["a", "b"]) == wire_auth.participants_digest(["b", "a"])  # order-free
    assert wire_auth.partial_sum_statement("r", 1, ["b", "a"]) == wire_auth.partial_sum_statement("r", 1, ["a", "b"])
    assert wire_auth.partial_sum_statement("r", 1, ["a", "b"]) != wire_auth.partial_sum_statement("r", 1, ["ab"])
    reg = wire_auth.register_statement("r", 1, 8, 4, False, ["a", "b"])
    assert wire_auth.register_statement("r", 1, 8, 4, False, ["b", "a"]) == reg  # order-free
    assert len({reg, wire_auth.register_statement("r", 1, 8, 4, True, ["a", "b"]),
                wire_auth.register_statement("r", 1, 8, 4, False, ["a", "b", "c"]),
                wire_auth.register_statement("r", 1, 8, 4, False, ["ab"])}) == 4
    me = generate_identity("alice")
    assert wire_auth.verify_signature(me.public_bytes, me.sign(base), base)
    assert not wire_auth.verify_signature(me.public_bytes, me.sign(base), wire_auth.push_statement("r", 2, "alice",
                                                                                                    b"\x00" * 8))


def test_partial_sum_unavailable_names_servers(cluster, server_signer) -> None:
    with pytest.raises(PartialSumUnavailableError, match="not registered"):
        reconstruct_sum(cluster.servers, "never-registered", 1, ["victim", "alice"], server_signer)


def test_check_shares_tells_a_client_what_its_push_would_meet(cluster, ids, server_signer) -> None:
    """One server registered the round for others than the clients were shown: the pre-flight says so, nothing stored.

    Additive shares need all three servers: refused.  2-of-3 Shamir shares need two: taken, the third one named.
    """
    servers, shown = cluster.servers, ShareTerms(tuple(PARTICIPANTS), len(PARTICIPANTS))
    for j, c in enumerate(_each(cluster)):
        names = PARTICIPANTS if j < 2 else [*HONEST, "sybil"]
        c.register_run_future("preflight", 1, D, 4, server_signer, participants=names, prime_field=True).result()
    stored = [c.status(server_signer).stored_bytes for c in _each(cluster)]
    with pytest.raises(SharePushError, match="would be refused by 1 of 3") as e:
        check_shares(servers, "preflight", 1, ids["victim"], D, terms=shown)
    assert [(f.server_index, f.code) for f in e.value.failures] == [(2, grpc.StatusCode.FAILED_PRECONDITION)]
    assert [f.server_index for f in check_shares(servers, "preflight", 1, ids["victim"], D, threshold=2,
                                                 terms=shown)] == [2]
    with pytest.raises(SharePushError, match="would be refused by 3 of 3"):  # not the run's share length
        check_shares(servers, "preflight", 1, ids["victim"], D + 1, threshold=2, terms=shown)
    assert [c.status(server_signer).stored_bytes for c in _each(cluster)] == stored
