"""Client-side helpers for DDP-SA intermediate servers (plain grpcio, no Flower).

The ``m`` servers are an :class:`IntermediateServers` (addresses in share order + the deployment's CA): every
channel is TLS verified against that CA and every request is signed (:mod:`protocols.wire.intermediate.auth`).

* ClientApps call :func:`push_shares` (or :func:`share_and_push`): share ``j`` to server ``j``, with the
  client's :class:`ShareTerms` (the participants it was shown, the fewest clients its share may be summed with);
  :func:`check_shares` before, to learn whether the servers would take them.
* The parameter server calls :func:`register_run` before each round (naming its participants) and
  :func:`reconstruct_sum` (or :func:`reconstruct_decoded`) after it.  Additive sharing (``threshold`` None) needs
  every server; Shamir (``threshold = t``) needs any ``t`` (:func:`protocols.secret_sharing.shamir_reconstruct_vector`).
  Too few partial sums raise :class:`PartialSumUnavailableError`; :func:`abort_round` then seals the round.

RPCs to the ``m`` servers run concurrently and fail fast (a server that is down answers ``UNAVAILABLE``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from numpy.typing import ArrayLike, NDArray

from protocols.secret_sharing import (
    FixedPointCodec,
    encode_and_share,
    from_wire,
    ring_sum,
    shamir_reconstruct_vector,
    to_wire,
)
from protocols.wire.intermediate import auth
from protocols.wire.intermediate import intermediate_pb2 as pb2
from protocols.wire.intermediate import intermediate_pb2_grpc as pb2_grpc

DEFAULT_TIMEOUT_S = 30.0
# Shares are 8 bytes per model parameter (4M parameters fit); gRPC's 4 MiB default is too small for CNNs.
DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class IntermediateServers:
    """The ``m`` intermediate servers of a deployment.

    ``addresses[j]`` gets share ``j``; ``ca`` (PEM) is the certificate of the CA that signed their TLS
    certificates.
    """

    addresses: tuple[str, ...]
    ca: bytes

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("no intermediate server addresses given")
        if b"BEGIN CERTIFICATE" not in self.ca:
            raise ValueError("the intermediate servers' CA must be a PEM certificate")

    @classmethod
    def load(cls, addresses: Sequence[str], ca_file: str) -> IntermediateServers:
        """Addresses plus the CA certificate read from ``ca_file``."""
        with open(ca_file, "rb") as f:
            return cls(tuple(addresses), f.read())

    def __len__(self) -> int:
        return len(self.addresses)


@dataclass(frozen=True)
class ShareTerms:
    """What a client's push asks every intermediate server to hold its share to (signed with the push).

    ``participants``: the round's participants the client was shown (the server refuses the push unless it
    registered exactly them); ``min_summed``: the fewest clients a partial sum holding the share may cover.
    """

    participants: tuple[str, ...]
    min_summed: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_summed <= len(self.participants):
            raise ValueError(f"min_summed must be in 1..{len(self.participants)}, got {self.min_summed!r}")

    @property
    def digest(self) -> bytes:
        """:func:`auth.participants_digest` of the participants."""
        return auth.participants_digest(self.participants)


@dataclass(frozen=True)
class ServerFailure:
    """One failed RPC to intermediate server ``server_index`` at ``address``."""

    server_index: int
    address: str
    code: grpc.StatusCode | None
    details: str

    def __str__(self) -> str:
        code = self.code.name if self.code is not None else "ERROR"
        return f"server #{self.server_index} ({self.address}): {code}: {self.details}"


class IntermediateAggregationError(RuntimeError):
    """Base class for DDP-SA intermediate-server failures.

    Attributes:
        failures: one :class:`ServerFailure` per server that failed.
    """

    def __init__(self, message: str, failures: Sequence[ServerFailure] = ()) -> None:
        super().__init__(message)
        self.failures: list[ServerFailure] = list(failures)


class SharePushError(IntermediateAggregationError):
    """A client could not deliver its share to one or more intermediate servers."""


class PartialSumUnavailableError(IntermediateAggregationError):
    """The parameter server did not obtain enough partial sums for a round (all m, or t of a Shamir sharing).

    ``failures`` says which servers failed and why.
    """


def _failure(index: int, address: str, exc: BaseException) -> ServerFailure:
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return ServerFailure(index, address, exc.code(), exc.details() or "")
    return ServerFailure(index, address, None, f"{type(exc).__name__}: {exc}")


class IntermediateServerClient:
    """A TLS channel + stub to one intermediate server; use as a context manager."""

    def __init__(
        self,
        address: str,
        ca: bytes,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.secure_channel(
            address,
            grpc.ssl_channel_credentials(root_certificates=ca),
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                # Never route loopback/cluster traffic through an HTTP proxy from env.
                ("grpc.enable_http_proxy", 0),
            ],
        )
        self.stub = pb2_grpc.IntermediateAggregatorStub(self._channel)

    def register_run_future(self, run_id: str, round_num: int, length: int, max_clients: int,
                            signer: auth.Signer, *, participants: Sequence[str], prime_field: bool = False
                            ) -> grpc.Future:
        """Register ``run_id`` and open ``round_num`` for ``participants`` (parameter server's ``signer``).

        ``prime_field``: Shamir shares in Z_p (else additive shares in Z_2^64).  A ``RegisterRunReply``.
        """
        names = sorted(str(p) for p in participants)
        sig = signer.sign(auth.register_statement(run_id, round_num, length, max_clients, prime_field, names))
        req = pb2.RegisterRunRequest(run_id=run_id, round=int(round_num), length=int(length),
                                     max_clients=int(max_clients), signature=sig, prime_field=bool(prime_field),
                                     participants=names)
        return self.stub.RegisterRun.future(req, timeout=self.timeout)

    def push_share(self, run_id: str, round_num: int, signer: auth.Signer, share: ArrayLike,
                   terms: ShareTerms | None = None) -> pb2.PushShareReply:
        """Send one uint64 share under ``signer``'s roster name; raises ``grpc.RpcError`` on failure."""
        return self.push_share_future(run_id, round_num, signer, share, terms).result()

    def push_share_future(self, run_id: str, round_num: int, signer: auth.Signer, share: ArrayLike,
                          terms: ShareTerms | None = None) -> grpc.Future:
        """Asynchronous :meth:`push_share`; ``terms``: what the server must hold the share to (None: nothing)."""
        data = to_wire(np.asarray(share))
        digest, least = (b"", 0) if terms is None else (terms.digest, terms.min_summed)
        sig = signer.sign(auth.push_statement(run_id, round_num, signer.name, data, digest, least))
        req = pb2.PushShareRequest(run_id=str(run_id), round=int(round_num), client=signer.name, share=data,
                                   length=len(data) // 8, signature=sig, participants_digest=digest,
                                   min_summed=least)
        return self.stub.PushShare.future(req, timeout=self.timeout)

    def check_share_future(self, run_id: str, round_num: int, signer: auth.Signer, length: int,
                           terms: ShareTerms | None = None) -> grpc.Future:
        """Asynchronous pre-flight of :meth:`push_share_future` for a share of ``length`` elements (``CheckShareReply``)."""
        digest, least = (b"", 0) if terms is None else (terms.digest, terms.min_summed)
        sig = signer.sign(auth.check_statement(run_id, round_num, signer.name, length, digest, least))
        req = pb2.CheckShareRequest(run_id=str(run_id), round=int(round_num), client=signer.name, length=int(length),
                                    signature=sig, participants_digest=digest, min_summed=least)
        return self.stub.CheckShare.future(req, timeout=self.timeout)

    def get_partial_sum_future(self, run_id: str, round_num: int, expected_clients: Sequence[str],
                               signer: auth.Signer) -> grpc.Future:
        """Asynchronous partial-sum request (parameter server's ``signer``); a ``GetPartialSumReply``."""
        clients = sorted(str(c) for c in expected_clients)
        sig = signer.sign(auth.partial_sum_statement(run_id, round_num, clients))
        req = pb2.GetPartialSumRequest(run_id=str(run_id), round=int(round_num), expected_clients=clients,
                                       signature=sig)
        return self.stub.GetPartialSum.future(req, timeout=self.timeout)

    def get_partial_sum(self, run_id: str, round_num: int, expected_clients: Sequence[str],
                        signer: auth.Signer) -> NDArray[np.uint64]:
        """Return this server's ring sum over ``expected_clients`` (``grpc.RpcError`` on failure)."""
        reply = self.get_partial_sum_future(run_id, round_num, expected_clients, signer).result()
        return from_wire(reply.partial_sum, reply.length)

    def abort_round(self, run_id: str, round_num: int, signer: auth.Signer) -> pb2.AbortRoundReply:
        """Seal a round unreleased (parameter server's ``signer``)."""
        req = pb2.AbortRoundRequest(run_id=run_id, round=int(round_num),
                                    signature=signer.sign(auth.abort_statement(run_id, round_num)))
        return self.stub.AbortRound(req, timeout=self.timeout)

    def status(self, signer: auth.Signer) -> pb2.StatusReply:
        """Held runs, rounds, bytes and pid (parameter server's ``signer``)."""
        nonce = os.urandom(16).hex()
        req = pb2.StatusRequest(nonce=nonce, signature=signer.sign(auth.status_statement(nonce)))
        return self.stub.Status(req, timeout=self.timeout)

    def health(self, timeout: float | None = None) -> pb2.HealthReply:
        """Health RPC; raises ``grpc.RpcError`` if the server does not answer."""
        return self.stub.Health(pb2.HealthRequest(), timeout=self.timeout if timeout is None else timeout)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> IntermediateServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Open clients by (address, CA, timeout), most recently used last: a process that pushes or collects every round
#: (a simulation worker running many ClientApps, the parameter server) keeps its TLS connections.
_OPEN: OrderedDict[tuple[str, bytes, float], IntermediateServerClient] = OrderedDict()
_OPEN_KEPT = 16
_OPEN_LOCK = threading.Lock()


def _client(address: str, ca: bytes, timeout: float) -> IntermediateServerClient:
    """A kept client for ``address`` (gRPC channels are thread-safe and reconnect by themselves)."""
    key = (address, bytes(ca), float(timeout))
    with _OPEN_LOCK:
        client = _OPEN.get(key)
        if client is None:
            client = _OPEN[key] = IntermediateServerClient(address, ca, timeout=timeout)
            while len(_OPEN) > _OPEN_KEPT:
                _OPEN.popitem(last=False)[1].close()
        _OPEN.move_to_end(key)
        return client


def _gather(servers: IntermediateServers, call, timeout: float) -> tuple[list, list[ServerFailure]]:
    """Run ``call(client) -> Future`` on every server concurrently; (results or None, failures)."""
    clients = [_client(a, servers.ca, timeout) for a in servers.addresses]
    results: list = [None] * len(clients)
    failures: list[ServerFailure] = []
    futs = [call(j, c) for j, c in enumerate(clients)]
    for j, f in enumerate(futs):
        try:
            results[j] = f.result()
        except grpc.RpcError as exc:
            failures.append(_failure(j, servers.addresses[j], exc))
            _forget(clients[j])  # the next call opens a fresh channel (no reconnect backoff after an outage)
    return results, failures


def _forget(client: IntermediateServerClient) -> None:
    """Drop a kept client and close its channel."""
    with _OPEN_LOCK:
        for key in [k for k, c in _OPEN.items() if c is client]:
            del _OPEN[key]
    client.close()


def register_run(servers: IntermediateServers, run_id: str, round_num: int, length: int, max_clients: int,
                 signer: auth.Signer, *, participants: Sequence[str], prime_field: bool = False,
                 timeout: float = DEFAULT_TIMEOUT_S) -> list[ServerFailure]:
    """Register ``run_id`` and open ``round_num`` for ``participants`` on every server; the failures (empty: all)."""
    _, failures = _gather(
        servers, lambda _j, c: c.register_run_future(run_id, round_num, length, max_clients, signer,
                                                     participants=participants, prime_field=prime_field), timeout)
    return failures


def abort_round(servers: IntermediateServers, run_id: str, round_num: int, signer: auth.Signer, *,
                timeout: float = 5.0) -> list[ServerFailure]:
    """Best effort: seal ``round_num`` unreleased on every server it reaches; the failures."""
    failures = []
    for j, address in enumerate(servers.addresses):
        with IntermediateServerClient(address, servers.ca, timeout=timeout) as c:
            try:
                c.abort_round(run_id, round_num, signer)
            except grpc.RpcError as exc:
                failures.append(_failure(j, address, exc))
    return failures


def push_shares(
    servers: IntermediateServers,
    run_id: str,
    round_num: int,
    signer: auth.Signer,
    shares: Sequence[ArrayLike],
    *,
    threshold: int | None = None,
    terms: ShareTerms | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[ServerFailure]:
    """Send ``shares[j]`` to server ``j`` for every j, concurrently, signed by ``signer`` (with ``terms``).

    Returns the servers that did not take their share: none for additive shares (``threshold`` None),
    at most ``m - threshold`` for Shamir shares.

    Raises:
        ValueError: if the numbers of shares and servers differ.
        SharePushError: listing every server that rejected or did not receive its share, when more failed.
    """
    if len(shares) != len(servers):
        raise ValueError(f"{len(shares)} shares for {len(servers)} intermediate servers")
    _, failures = _gather(servers, lambda j, c: c.push_share_future(run_id, round_num, signer, shares[j], terms),
                          timeout)
    _require(servers, failures, threshold, f"client {signer.name!r} could not push its share for run {run_id!r} "
                                           f"round {round_num} to")
    return failures


def check_shares(servers: IntermediateServers, run_id: str, round_num: int, signer: auth.Signer, length: int, *,
                 threshold: int | None = None, terms: ShareTerms | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> list[ServerFailure]:
    """Whether :func:`push_shares` of a share of ``length`` elements would succeed: one concurrent ``CheckShare`` each.

    A client asks before it charges its round; nothing is stored.  Returns the servers that would not take a share,
    as :func:`push_shares` does.

    Raises:
        SharePushError: more servers refuse (or do not answer) than :func:`push_shares` tolerates.
    """
    _, failures = _gather(servers, lambda _j, c: c.check_share_future(run_id, round_num, signer, length, terms),
                          timeout)
    _require(servers, failures, threshold, f"client {signer.name!r}: its share for run {run_id!r} round {round_num} "
                                           "would be refused by")
    return failures


def _require(servers: IntermediateServers, failures: list[ServerFailure], threshold: int | None, what: str) -> None:
    """Raise :class:`SharePushError` unless all servers (``threshold`` None) or ``threshold`` of them took a share."""
    if len(servers) - len(failures) < (len(servers) if threshold is None else threshold):
        raise SharePushError(f"{what} {len(failures)} of {len(servers)} intermediate server(s): "
                             + "; ".join(map(str, failures)), failures)


def share_and_push(
    values: ArrayLike,
    codec: FixedPointCodec,
    servers: IntermediateServers,
    run_id: str,
    round_num: int,
    signer: auth.Signer,
    *,
    threshold: int | None = None,
    terms: ShareTerms | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> int:
    """Encode, secret-share and push a client's update; return the vector length.

    ``values`` is flattened to a float vector, encoded with ``codec`` and split into
    ``len(servers)`` shares with fresh CSPRNG randomness: additive (``threshold`` None) or Shamir
    (any ``threshold`` reconstruct; the push succeeds when that many servers took their share).
    ``terms``: :class:`ShareTerms` every server holds the shares to.
    """
    flat = np.asarray(values, dtype=np.float64).ravel()
    shares = encode_and_share(flat, len(servers), codec, threshold=threshold)
    push_shares(servers, run_id, round_num, signer, shares, threshold=threshold, terms=terms, timeout=timeout)
    return flat.size


def fetch_partial_sums(
    servers: IntermediateServers,
    run_id: str,
    round_num: int,
    expected_clients: Sequence[str],
    signer: auth.Signer,
    *,
    threshold: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> dict[int, NDArray[np.uint64]]:
    """Every answering server's partial sum over ``expected_clients`` by server index (parameter server's ``signer``).

    Raises:
        PartialSumUnavailableError: fewer than ``threshold`` (None: all m) servers gave a valid partial sum
            (unreachable, missing shares, malformed), or the partial sums differ in length.
    """
    replies, failures = _gather(
        servers, lambda _j, c: c.get_partial_sum_future(run_id, round_num, expected_clients, signer), timeout)
    sums: dict[int, NDArray[np.uint64]] = {}
    for j, reply in enumerate(replies):
        if reply is not None:
            try:
                sums[j] = from_wire(reply.partial_sum, reply.length)
            except ValueError as exc:  # malformed reply
                failures.append(_failure(j, servers.addresses[j], exc))
    lengths = {s.size for s in sums.values()}
    if len(lengths) > 1:
        failures += [ServerFailure(j, servers.addresses[j], None, f"partial sum length {s.size}")
                     for j, s in sums.items()]
        sums = {}
    need = len(servers) if threshold is None else threshold
    if len(sums) < need:
        scheme = "additive sharing needs all m" if threshold is None else f"Shamir sharing needs {threshold}"
        raise PartialSumUnavailableError(
            f"cannot reconstruct run {run_id!r} round {round_num}: "
            f"{len(failures)} of {len(servers)} intermediate server(s) did not provide a "
            f"valid partial sum ({scheme}): " + "; ".join(map(str, sorted(failures, key=str))),
            failures,
        )
    return sums


def reconstruct_sum(
    servers: IntermediateServers,
    run_id: str,
    round_num: int,
    expected_clients: Sequence[str],
    signer: auth.Signer,
    *,
    threshold: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> NDArray[np.uint64]:
    """Ring sum (mod 2^64) of all clients' secrets, from all m partial sums or any ``threshold`` Shamir ones.

    Raises:
        PartialSumUnavailableError: see :func:`fetch_partial_sums`.
    """
    sums = fetch_partial_sums(servers, run_id, round_num, expected_clients, signer, threshold=threshold,
                              timeout=timeout)
    if threshold is None:
        return ring_sum(list(sums.values()))
    return shamir_reconstruct_vector(sums)


def reconstruct_decoded(
    servers: IntermediateServers,
    run_id: str,
    round_num: int,
    expected_clients: Sequence[str],
    signer: auth.Signer,
    codec: FixedPointCodec,
    *,
    mean: bool = False,
    threshold: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> NDArray[np.float64]:
    """:func:`reconstruct_sum` decoded with ``codec`` (divided by #clients if ``mean``)."""
    total = reconstruct_sum(servers, run_id, round_num, expected_clients, signer, threshold=threshold,
                            timeout=timeout)
    if mean:
        return codec.decode_mean(total, len(expected_clients))
    return codec.decode(total)


def wait_until_healthy(address: str, ca: bytes, *, timeout: float = 30.0) -> pb2.HealthReply:
    """Poll ``Health`` (over TLS, verifying the server against ``ca``) until it answers or ``timeout`` elapses.

    Raises:
        TimeoutError: if the server did not become healthy in time.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    with IntermediateServerClient(address, ca) as client:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"intermediate server {address} not healthy after {timeout:.1f}s: {last}")
            try:
                return client.health(timeout=min(2.0, remaining))
            except grpc.RpcError as exc:
                last = exc
                time.sleep(0.05)
