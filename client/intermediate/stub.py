"""Client-side helpers for DDP-SA intermediate servers (plain grpcio, no Flower).

* ClientApps call :func:`push_shares` (or :func:`share_and_push`) to send share ``j`` of
  their encoded noisy update to intermediate server ``j``.
* The parameter server calls :func:`reconstruct_sum` (or :func:`reconstruct_decoded`):
  it fetches all ``m`` partial sums and adds them mod 2^64.  Additive sharing is
  full-threshold, so a single unavailable server fails the round with
  :class:`PartialSumUnavailableError` (no silent partial reconstruction).

All RPCs to the ``m`` servers are issued concurrently (gRPC futures) and fail fast:
a server that is down yields ``UNAVAILABLE`` immediately instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from numpy.typing import ArrayLike, NDArray

from client.intermediate import intermediate_pb2 as pb2
from client.intermediate import intermediate_pb2_grpc as pb2_grpc
from protocols.secret_sharing import (
    FixedPointCodec,
    encode_and_share,
    from_wire,
    ring_sum,
    to_wire,
)

DEFAULT_TIMEOUT_S = 30.0
# Shares are 8 bytes per model parameter; gRPC's 4 MiB default is too small for CNNs.
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024


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
    """The parameter server did not obtain all m partial sums for a round.

    Full-threshold additive sharing needs every server, so the round cannot be
    reconstructed; ``failures`` says which servers failed and why.
    """


def _failure(index: int, address: str, exc: BaseException) -> ServerFailure:
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return ServerFailure(index, address, exc.code(), exc.details() or "")
    return ServerFailure(index, address, None, f"{type(exc).__name__}: {exc}")


class IntermediateServerClient:
    """A channel + stub to one intermediate server; use as a context manager."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                # Never route loopback/cluster traffic through an HTTP proxy from env.
                ("grpc.enable_http_proxy", 0),
            ],
        )
        self.stub = pb2_grpc.IntermediateAggregatorStub(self._channel)

    def push_share(self, run_id: str, round_num: int, client_id: int, share: ArrayLike) -> pb2.PushShareReply:
        """Send one uint64 share; raises ``grpc.RpcError`` on failure."""
        return self.push_share_future(run_id, round_num, client_id, share).result()

    def push_share_future(self, run_id: str, round_num: int, client_id: int, share: ArrayLike) -> grpc.Future:
        """Asynchronous :meth:`push_share`."""
        data = to_wire(np.asarray(share))
        req = pb2.PushShareRequest(
            run_id=str(run_id),
            round=int(round_num),
            client_id=int(client_id),
            share=data,
            length=len(data) // 8,
        )
        return self.stub.PushShare.future(req, timeout=self.timeout)

    def get_partial_sum_future(self, run_id: str, round_num: int, expected_clients: Sequence[int]) -> grpc.Future:
        """Asynchronous partial-sum request; result is a ``GetPartialSumReply``."""
        req = pb2.GetPartialSumRequest(
            run_id=str(run_id),
            round=int(round_num),
            expected_clients=[int(c) for c in expected_clients],
        )
        return self.stub.GetPartialSum.future(req, timeout=self.timeout)

    def get_partial_sum(self, run_id: str, round_num: int, expected_clients: Sequence[int]) -> NDArray[np.uint64]:
        """Return this server's ring sum over ``expected_clients`` (``grpc.RpcError`` on failure)."""
        reply = self.get_partial_sum_future(run_id, round_num, expected_clients).result()
        return from_wire(reply.partial_sum, reply.length)

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


def push_shares(
    addresses: Sequence[str],
    run_id: str,
    round_num: int,
    client_id: int,
    shares: Sequence[ArrayLike],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Send ``shares[j]`` to ``addresses[j]`` for every j, concurrently.

    Raises:
        ValueError: if the numbers of shares and servers differ.
        SharePushError: listing every server that rejected or did not receive its share.
    """
    if len(shares) != len(addresses):
        raise ValueError(f"{len(shares)} shares for {len(addresses)} intermediate servers")
    clients = [IntermediateServerClient(a, timeout=timeout) for a in addresses]
    try:
        futs = [c.push_share_future(run_id, round_num, client_id, s) for c, s in zip(clients, shares, strict=True)]
        failures = []
        for j, f in enumerate(futs):
            try:
                f.result()
            except grpc.RpcError as exc:
                failures.append(_failure(j, addresses[j], exc))
    finally:
        for c in clients:
            c.close()
    if failures:
        raise SharePushError(
            f"client {client_id} could not push its share for run {run_id!r} round "
            f"{round_num} to {len(failures)} of {len(addresses)} intermediate server(s): "
            + "; ".join(map(str, failures)),
            failures,
        )


def share_and_push(
    values: ArrayLike,
    codec: FixedPointCodec,
    addresses: Sequence[str],
    run_id: str,
    round_num: int,
    client_id: int,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> int:
    """Encode, secret-share and push a client's update; return the vector length.

    ``values`` is flattened to a float vector, encoded with ``codec`` and split into
    ``len(addresses)`` shares with fresh CSPRNG randomness.
    """
    flat = np.asarray(values, dtype=np.float64).ravel()
    shares = encode_and_share(flat, len(addresses), codec)
    push_shares(addresses, run_id, round_num, client_id, shares, timeout=timeout)
    return flat.size


def fetch_partial_sums(
    addresses: Sequence[str],
    run_id: str,
    round_num: int,
    expected_clients: Sequence[int],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[NDArray[np.uint64]]:
    """Fetch every server's partial sum over ``expected_clients`` (concurrently).

    Raises:
        PartialSumUnavailableError: if any server is unreachable, reports missing
            shares, or returns a partial sum of inconsistent length.
    """
    if not addresses:
        raise ValueError("no intermediate server addresses given")
    clients = [IntermediateServerClient(a, timeout=timeout) for a in addresses]
    sums: list[NDArray[np.uint64] | None] = [None] * len(addresses)
    failures: list[ServerFailure] = []
    try:
        futs = [c.get_partial_sum_future(run_id, round_num, expected_clients) for c in clients]
        for j, f in enumerate(futs):
            try:
                reply = f.result()
                sums[j] = from_wire(reply.partial_sum, reply.length)
            except grpc.RpcError as exc:
                failures.append(_failure(j, addresses[j], exc))
            except ValueError as exc:  # malformed reply
                failures.append(_failure(j, addresses[j], exc))
    finally:
        for c in clients:
            c.close()
    lengths = {s.size for s in sums if s is not None}
    if not failures and len(lengths) > 1:
        failures = [
            ServerFailure(j, addresses[j], None, f"partial sum length {s.size}")
            for j, s in enumerate(sums)
            if s is not None
        ]
    if failures:
        raise PartialSumUnavailableError(
            f"cannot reconstruct run {run_id!r} round {round_num}: "
            f"{len(failures)} of {len(addresses)} intermediate server(s) did not provide a "
            "valid partial sum (additive sharing needs all m): " + "; ".join(map(str, failures)),
            failures,
        )
    return [s for s in sums if s is not None]


def reconstruct_sum(
    addresses: Sequence[str],
    run_id: str,
    round_num: int,
    expected_clients: Sequence[int],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> NDArray[np.uint64]:
    """Ring sum (mod 2^64) of all clients' secrets = sum of all m partial sums.

    Raises:
        PartialSumUnavailableError: see :func:`fetch_partial_sums`.
    """
    return ring_sum(fetch_partial_sums(addresses, run_id, round_num, expected_clients, timeout=timeout))


def reconstruct_decoded(
    addresses: Sequence[str],
    run_id: str,
    round_num: int,
    expected_clients: Sequence[int],
    codec: FixedPointCodec,
    *,
    mean: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> NDArray[np.float64]:
    """:func:`reconstruct_sum` decoded with ``codec`` (divided by #clients if ``mean``)."""
    total = reconstruct_sum(addresses, run_id, round_num, expected_clients, timeout=timeout)
    if mean:
        return codec.decode_mean(total, len(expected_clients))
    return codec.decode(total)


def wait_until_healthy(address: str, *, timeout: float = 30.0) -> pb2.HealthReply:
    """Poll ``Health`` until the server answers or ``timeout`` elapses.

    Raises:
        TimeoutError: if the server did not become healthy in time.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    with IntermediateServerClient(address) as client:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"intermediate server {address} not healthy after {timeout:.1f}s: {last}")
            try:
                return client.health(timeout=min(2.0, remaining))
            except grpc.RpcError as exc:
                last = exc
                time.sleep(0.05)
