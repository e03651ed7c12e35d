"""gRPC servicer of a DDP-SA intermediate aggregation server (plain grpcio, no Flower).

One intermediate server S_j receives exactly one additive share per client and round,
and hands the parameter server the ring sum (mod 2^64) of the shares of an agreed client
set (Wei et al., Algorithm 2, "for each server S_j").

State is in memory, keyed by ``(run_id, round)``; only the ``keep_rounds`` most recent
rounds per run and the ``max_runs`` most recently used runs are kept.

Defence in depth beyond the paper's semi-honest model: a curious parameter server could
ask every server for the "partial sum" of a *single* client, or for two client sets that
differ in one client, and so reconstruct an individual (noisy) update.  Therefore:

* a partial sum must cover at least ``min_clients`` clients (default 2), and
* the first successful ``GetPartialSum`` *seals* the round: later calls must name the
  same client set (an idempotent retry gets the cached sum), late pushes are rejected,
  and the individual shares are discarded.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from client.intermediate import intermediate_pb2 as pb2
from client.intermediate import intermediate_pb2_grpc as pb2_grpc
from client.intermediate.stub import DEFAULT_MAX_MESSAGE_BYTES
from protocols.secret_sharing import from_wire, ring_sum, to_wire

__all__ = [
    "DEFAULT_KEEP_ROUNDS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_RUNS",
    "DEFAULT_MIN_CLIENTS",
    "IntermediateAggregatorServicer",
    "create_server",
    "format_address",
]

log = logging.getLogger(__name__)

DEFAULT_KEEP_ROUNDS = 2
DEFAULT_MAX_RUNS = 8
DEFAULT_MIN_CLIENTS = 2


@dataclass
class _RoundState:
    length: int
    shares: dict[int, bytes] = field(default_factory=dict)
    sealed_clients: tuple[int, ...] | None = None
    partial_sum: bytes | None = None


@dataclass
class _RunState:
    latest_round: int = -1
    rounds: dict[int, _RoundState] = field(default_factory=dict)


class IntermediateAggregatorServicer(pb2_grpc.IntermediateAggregatorServicer):
    """Thread-safe in-memory share store + ring-sum aggregator."""

    def __init__(
        self,
        *,
        server_id: str = "",
        keep_rounds: int = DEFAULT_KEEP_ROUNDS,
        min_clients: int = DEFAULT_MIN_CLIENTS,
        max_runs: int = DEFAULT_MAX_RUNS,
    ) -> None:
        if keep_rounds < 1 or min_clients < 1 or max_runs < 1:
            raise ValueError("keep_rounds, min_clients and max_runs must all be >= 1")
        self.server_id = server_id
        self.keep_rounds = keep_rounds
        self.min_clients = min_clients
        self.max_runs = max_runs
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, _RunState] = OrderedDict()

    # ------------------------------------------------------------------ helpers
    def _oldest_kept(self, run: _RunState) -> int:
        return run.latest_round - self.keep_rounds + 1

    def _touch_run(self, run_id: str) -> _RunState:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _RunState()
            while len(self._runs) > self.max_runs:
                evicted, _ = self._runs.popitem(last=False)
                log.info("evicted state of least recently used run %r", evicted)
        self._runs.move_to_end(run_id)
        return run

    def active_rounds(self) -> int:
        """Return the number of (run, round) states currently held."""
        with self._lock:
            return sum(len(r.rounds) for r in self._runs.values())

    # --------------------------------------------------------------------- RPCs
    def PushShare(  # noqa: N802 (gRPC method name)
        self, request: pb2.PushShareRequest, context: grpc.ServicerContext
    ) -> pb2.PushShareReply:
        """Store one client's share for (run_id, round); identical retries are no-ops."""
        tag = f"run {request.run_id!r} round {request.round} client {request.client_id}"
        if not request.run_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id must be non-empty")
        if request.length == 0 or len(request.share) != 8 * request.length:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{tag}: share has {len(request.share)} bytes, expected 8 * length (length={request.length} > 0)",
            )
        with self._lock:
            run = self._touch_run(request.run_id)
            if request.round < self._oldest_kept(run):
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{tag}: stale round (latest {run.latest_round}, keeping {self.keep_rounds} round(s))",
                )
            if request.round > run.latest_round:
                run.latest_round = request.round
                for r in [r for r in run.rounds if r < self._oldest_kept(run)]:
                    del run.rounds[r]
            state = run.rounds.get(request.round)
            if state is None:
                state = run.rounds[request.round] = _RoundState(length=request.length)
            if state.sealed_clients is not None:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{tag}: partial sum of this round was already released; late shares are rejected",
                )
            if state.length != request.length:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{tag}: vector length {request.length} differs from this round's length {state.length}",
                )
            existing = state.shares.get(request.client_id)
            if existing is not None:
                if existing != request.share:
                    context.abort(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"{tag}: a different share was already stored for this client",
                    )
                return pb2.PushShareReply(clients_received=len(state.shares), duplicate=True)
            state.shares[request.client_id] = bytes(request.share)
            return pb2.PushShareReply(clients_received=len(state.shares), duplicate=False)

    def GetPartialSum(  # noqa: N802 (gRPC method name)
        self, request: pb2.GetPartialSumRequest, context: grpc.ServicerContext
    ) -> pb2.GetPartialSumReply:
        """Ring sum of the shares of exactly ``expected_clients`` (seals the round)."""
        tag = f"run {request.run_id!r} round {request.round}"
        expected = tuple(sorted(request.expected_clients))
        if not request.run_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id must be non-empty")
        if not expected:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{tag}: no expected clients")
        if len(set(expected)) != len(expected):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{tag}: duplicate expected client ids")
        if len(expected) < self.min_clients:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{tag}: {len(expected)} expected client(s) is below this server's "
                f"min_clients={self.min_clients}; a partial sum over so few clients "
                "would expose individual shares",
            )
        with self._lock:
            run = self._runs.get(request.run_id)
            if run is not None and request.round < self._oldest_kept(run):
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{tag}: round was dropped (latest {run.latest_round}, keeping {self.keep_rounds} round(s))",
                )
            state = None if run is None else run.rounds.get(request.round)
            if state is None:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{tag}: missing shares from all expected clients {list(expected)} "
                    "(no share received for this round)",
                )
            if state.sealed_clients is not None:
                if state.sealed_clients != expected:
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{tag}: partial sum already released for client set "
                        f"{list(state.sealed_clients)}; refusing a different set "
                        "(differences of partial sums would leak individual shares)",
                    )
            else:
                missing = [c for c in expected if c not in state.shares]
                if missing:
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{tag}: missing shares from expected clients {missing} (received from {sorted(state.shares)})",
                    )
                total = ring_sum([from_wire(state.shares[c], state.length) for c in expected])
                state.partial_sum = to_wire(total)
                state.sealed_clients = expected
                state.shares.clear()  # individual shares are no longer needed
                self._runs.move_to_end(request.run_id)
            assert state.partial_sum is not None
            return pb2.GetPartialSumReply(partial_sum=state.partial_sum, length=state.length, num_clients=len(expected))

    def Health(  # noqa: N802 (gRPC method name)
        self, request: pb2.HealthRequest, context: grpc.ServicerContext
    ) -> pb2.HealthReply:
        """Liveness probe: status, server id, number of held rounds, process id."""
        return pb2.HealthReply(
            status="SERVING",
            server_id=self.server_id,
            active_rounds=self.active_rounds(),
            pid=os.getpid(),
        )


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets for IPv6 literals."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def create_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    servicer: IntermediateAggregatorServicer | None = None,
    max_workers: int = 8,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[grpc.Server, int]:
    """Create and start a gRPC server with the servicer; returns ``(server, bound_port)``.

    ``port=0`` binds a free ephemeral port (race-free).  SO_REUSEPORT is disabled so a
    second server on an explicit, already used port fails instead of silently sharing it.
    Transport is insecure (no TLS), as in the paper's model where confidentiality comes
    from the secret sharing itself; deploy on a trusted network or add TLS.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb2_grpc.add_IntermediateAggregatorServicer_to_server(servicer or IntermediateAggregatorServicer(), server)
    address = format_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises when the bind fails
        raise OSError(f"cannot bind intermediate server to {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind intermediate server to {address}")
    server.start()
    return server, bound
