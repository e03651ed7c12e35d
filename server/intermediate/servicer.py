"""gRPC servicer of a DDP-SA intermediate aggregation server (plain grpcio, no Flower).

One intermediate server S_j receives one share per client and round and hands the parameter server the sum of
the shares of an agreed client set (Wei et al., Algorithm 2): mod 2^64 for additive shares, mod
p = 2^64 - 59 for Shamir shares (elements >= p are refused).  Beyond the paper's semi-honest model:

* TLS only (:func:`create_server`); every request but ``Health`` is signed (:mod:`protocols.wire.intermediate.auth`):
  pushes by the roster client they name, ``RegisterRun``/``GetPartialSum``/``AbortRound``/``Status`` by the
  parameter server; other callers get ``UNAUTHENTICATED``;
* pushes are taken only for registered runs, opened rounds and that round's registered participants; unknown
  run ids and future rounds create no state; at most ``max_runs`` runs, the least recently used evicted only
  after ``run_idle_s`` idle seconds;
* size caps (``max_message_bytes``, ``max_share_bytes``, ``max_clients``, ``max_run_bytes``,
  ``max_stored_bytes``) answer ``RESOURCE_EXHAUSTED``;
* a push carrying its client's terms (:class:`protocols.wire.intermediate.ShareTerms`, signed with it) is taken
  only when the round was registered for exactly the participants the client was shown, and its share enters no
  partial sum over fewer clients than it asks (a distributed noise share is only private summed with the others);
* ``CheckShare``, a push's pre-flight signed as the push is, answers by the same rule without the share: a client asks
  it before it charges the round;
* a partial sum covers at least ``min_clients`` clients and the first ``GetPartialSum`` or ``AbortRound`` seals
  the round: same client set on retry, late pushes refused, individual shares discarded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from protocols.secret_sharing import VECTOR_PRIME, field_sum, from_wire, ring_sum, to_wire
from protocols.wire.intermediate import auth
from protocols.wire.intermediate import intermediate_pb2 as pb2
from protocols.wire.intermediate import intermediate_pb2_grpc as pb2_grpc
from protocols.wire.intermediate.stub import DEFAULT_MAX_MESSAGE_BYTES

__all__ = [
    "DEFAULT_KEEP_ROUNDS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_RUNS",
    "DEFAULT_MIN_CLIENTS",
    "IntermediateAggregatorServicer",
    "Limits",
    "create_server",
    "format_address",
]

log = logging.getLogger(__name__)

DEFAULT_KEEP_ROUNDS = 2
DEFAULT_MAX_RUNS = 8
DEFAULT_MIN_CLIENTS = 2


@dataclass(frozen=True)
class Limits:
    """What one intermediate server accepts (all enforced before anything is stored)."""

    keep_rounds: int = DEFAULT_KEEP_ROUNDS
    min_clients: int = DEFAULT_MIN_CLIENTS
    max_runs: int = DEFAULT_MAX_RUNS
    max_clients: int = 1000  # clients per round of one run
    max_share_bytes: int = DEFAULT_MAX_MESSAGE_BYTES - 4096  # one share (8 bytes per model parameter)
    max_run_bytes: int = 1 << 30  # max_clients x share bytes x keep_rounds of one run
    max_stored_bytes: int = 2 << 30  # every share and partial sum held by this server
    run_idle_s: float = 600.0  # a run idle this long may be evicted by a new registration

    def __post_init__(self) -> None:
        if min(self.keep_rounds, self.min_clients, self.max_runs, self.max_clients, self.max_share_bytes,
               self.max_run_bytes, self.max_stored_bytes) < 1 or self.run_idle_s < 0:
            raise ValueError(f"every intermediate-server limit must be >= 1 (run_idle_s >= 0): {self}")


@dataclass
class _RoundState:
    participants: frozenset[str] | None = None  # None: not opened by RegisterRun (aborted before)
    shares: dict[str, bytes] = field(default_factory=dict)
    min_summed: dict[str, int] = field(default_factory=dict)  # client -> fewest clients its share may be summed with
    sealed_clients: tuple[str, ...] | None = None
    partial_sum: bytes | None = None  # None when sealed by AbortRound

    def held_bytes(self) -> int:
        return sum(map(len, self.shares.values())) + len(self.partial_sum or b"")


@dataclass
class _RunState:
    length: int
    max_clients: int
    last_used: float
    prime_field: bool = False
    latest_round: int = -1
    rounds: dict[int, _RoundState] = field(default_factory=dict)


class IntermediateAggregatorServicer(pb2_grpc.IntermediateAggregatorServicer):
    """Thread-safe in-memory share store + ring-sum aggregator, with signed access."""

    def __init__(self, policy: auth.AccessPolicy, *, server_id: str = "", limits: Limits | None = None) -> None:
        self.policy = policy
        self.server_id = server_id
        self.limits = limits or Limits()
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, _RunState] = OrderedDict()
        self._stored = 0

    # ------------------------------------------------------------------ helpers
    def _oldest_kept(self, run: _RunState) -> int:
        return run.latest_round - self.limits.keep_rounds + 1

    def _drop_round(self, run: _RunState, rnd: int) -> None:
        self._stored -= run.rounds.pop(rnd).held_bytes()

    def _require_server(self, context: grpc.ServicerContext, signature: bytes, statement: bytes, what: str) -> None:
        if not self.policy.is_server(signature, statement):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{what}: not signed by the parameter server")

    def _run(self, run_id: str, context: grpc.ServicerContext) -> _RunState:
        run = self._runs.get(run_id)
        if run is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "run is not registered with this server")
        run.last_used = time.monotonic()
        self._runs.move_to_end(run_id)
        return run

    def _client_signed(self, request: pb2.PushShareRequest | pb2.CheckShareRequest, statement: bytes,
                       context: grpc.ServicerContext, rpc: str) -> str:
        """Abort unless a roster client signed ``statement`` under the name it gives; the request's tag for errors."""
        if not self.policy.client_may_push(request.client, request.signature, statement):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{rpc}: not signed by a roster client under the name it gives")
        return f"run {request.run_id!r} round {request.round} client {request.client!r}"

    def _admit(self, request: pb2.PushShareRequest | pb2.CheckShareRequest, context: grpc.ServicerContext,
               tag: str) -> tuple[_RunState, _RoundState]:
        """What a push of ``request.length`` elements by ``request.client`` under its terms must meet (under the lock).

        The one rule of :meth:`PushShare` and its pre-flight :meth:`CheckShare`: a registered run of that length, an
        open and unsealed round registered for exactly the participants the client was shown, it among them.
        """
        run = self._run(request.run_id, context)
        if request.length != run.length:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{tag}: share has {8 * request.length} bytes, this run's shares have {8 * run.length}")
        if not self._oldest_kept(run) <= request.round <= run.latest_round:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{tag}: round not open (open: {max(self._oldest_kept(run), 0)}..{run.latest_round})")
        state = run.rounds.get(request.round)
        if state is not None and state.sealed_clients is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{tag}: this round was already released or aborted; late shares are rejected")
        if state is None or state.participants is None or request.client not in state.participants:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{tag}: not one of the participants the parameter server registered for this round")
        if request.participants_digest and request.participants_digest != auth.participants_digest(
                state.participants):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{tag}: the round was registered for other participants than the client was shown; "
                          "its share is only summed with the participants it was shown")
        if request.min_summed > len(state.participants):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{tag}: asks to be summed with {request.min_summed} clients; the round has "
                          f"{len(state.participants)} participants")
        return run, state

    def active_rounds(self) -> int:
        """Return the number of (run, round) states currently held."""
        with self._lock:
            return sum(len(r.rounds) for r in self._runs.values())

    def stored_bytes(self) -> int:
        """Bytes of shares and partial sums currently held."""
        with self._lock:
            return self._stored

    # --------------------------------------------------------------------- RPCs
    def RegisterRun(  # noqa: N802 (gRPC method name)
        self, request: pb2.RegisterRunRequest, context: grpc.ServicerContext
    ) -> pb2.RegisterRunReply:
        """Register a run (share length, client cap, share field) and open round ``request.round`` for its participants."""
        participants = tuple(sorted(request.participants))
        statement = auth.register_statement(request.run_id, request.round, request.length, request.max_clients,
                                            request.prime_field, participants)
        self._require_server(context, request.signature, statement, "RegisterRun")
        lim, share_bytes = self.limits, 8 * request.length
        if not request.run_id or request.length == 0 or request.max_clients < lim.min_clients:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"run_id, length > 0 and max_clients >= {lim.min_clients} are required")
        if (len(set(participants)) != len(participants) or not lim.min_clients <= len(participants)
                or len(participants) > request.max_clients):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a round needs {lim.min_clients}..max_clients={request.max_clients} distinct participants, "
                          f"got {len(participants)}")
        if share_bytes > lim.max_share_bytes or request.max_clients > lim.max_clients:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"a run may have shares up to {lim.max_share_bytes} bytes and up to {lim.max_clients} "
                          f"clients per round; asked {share_bytes} bytes and {request.max_clients} clients")
        if share_bytes * request.max_clients * lim.keep_rounds > lim.max_run_bytes:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{request.max_clients} clients x {share_bytes} bytes x {lim.keep_rounds} rounds exceeds "
                          f"this server's {lim.max_run_bytes} bytes per run")
        with self._lock:
            now = time.monotonic()
            run = self._runs.get(request.run_id)
            if run is not None:
                if (run.length, run.max_clients, run.prime_field) != (request.length, request.max_clients,
                                                                      request.prime_field):
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  "run already registered with another length, client cap or share field")
            else:
                if len(self._runs) >= lim.max_runs:
                    oldest_id, oldest = next(iter(self._runs.items()))
                    if now - oldest.last_used < lim.run_idle_s:
                        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"this server holds {lim.max_runs} active runs; none idle for {lim.run_idle_s:.0f} s")
                    for rnd in list(oldest.rounds):
                        self._drop_round(oldest, rnd)
                    del self._runs[oldest_id]
                    log.info("evicted idle run %r", oldest_id)
                run = self._runs[request.run_id] = _RunState(int(request.length), int(request.max_clients), now,
                                                             bool(request.prime_field))
            if request.round < self._oldest_kept(run):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"round {request.round} was already dropped")
            opened = run.rounds.get(request.round)
            if opened is not None and opened.participants is not None and opened.participants != set(participants):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"round {request.round} is already open for other participants")
            if opened is None:
                run.rounds[request.round] = _RoundState(frozenset(participants))
            if request.round > run.latest_round:
                run.latest_round = int(request.round)
                for r in [r for r in run.rounds if r < self._oldest_kept(run)]:
                    self._drop_round(run, r)
            run.last_used = now
            self._runs.move_to_end(request.run_id)
            return pb2.RegisterRunReply(server_id=self.server_id, active_runs=len(self._runs))

    def PushShare(  # noqa: N802 (gRPC method name)
        self, request: pb2.PushShareRequest, context: grpc.ServicerContext
    ) -> pb2.PushShareReply:
        """Store the signing client's share for (run_id, round); identical retries are no-ops."""
        statement = auth.push_statement(request.run_id, request.round, request.client, request.share,
                                        request.participants_digest, request.min_summed)
        tag = self._client_signed(request, statement, context, "PushShare")
        with self._lock:
            run, state = self._admit(request, context, tag)
            if len(request.share) != 8 * run.length:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{tag}: share has {len(request.share)} bytes, this run's shares have {8 * run.length}")
            if run.prime_field and (from_wire(request.share, run.length) >= VECTOR_PRIME).any():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{tag}: a Shamir share element is not below p")
            existing = state.shares.get(request.client)
            if existing is not None:
                if existing != request.share or state.min_summed[request.client] != request.min_summed:
                    context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{tag}: a different share was already stored")
                return pb2.PushShareReply(clients_received=len(state.shares), duplicate=True)
            # (at most the round's participants push: the run's client cap bounds them at registration)
            if self._stored + len(request.share) > self.limits.max_stored_bytes:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{tag}: this server's storage cap is reached")
            state.shares[request.client] = bytes(request.share)
            state.min_summed[request.client] = int(request.min_summed)
            self._stored += len(request.share)
            return pb2.PushShareReply(clients_received=len(state.shares), duplicate=False)

    def CheckShare(  # noqa: N802 (gRPC method name)
        self, request: pb2.CheckShareRequest, context: grpc.ServicerContext
    ) -> pb2.CheckShareReply:
        """A push's pre-flight: aborts as :meth:`PushShare` would on a fresh share of ``length`` elements; stores nothing.

        A client asks it before it charges its round: a round no push could enter is refused before it is paid for.
        """
        statement = auth.check_statement(request.run_id, request.round, request.client, request.length,
                                         request.participants_digest, request.min_summed)
        tag = self._client_signed(request, statement, context, "CheckShare")
        with self._lock:
            _, state = self._admit(request, context, tag)
            if request.client in state.shares:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{tag}: a different share was already stored")
            if self._stored + 8 * request.length > self.limits.max_stored_bytes:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{tag}: this server's storage cap is reached")
            return pb2.CheckShareReply()

    def GetPartialSum(  # noqa: N802 (gRPC method name)
        self, request: pb2.GetPartialSumRequest, context: grpc.ServicerContext
    ) -> pb2.GetPartialSumReply:
        """Ring sum of the shares of exactly ``expected_clients`` (seals the round)."""
        expected = tuple(sorted(request.expected_clients))
        statement = auth.partial_sum_statement(request.run_id, request.round, expected)
        self._require_server(context, request.signature, statement, "GetPartialSum")
        tag = f"run {request.run_id!r} round {request.round}"
        if not expected or len(set(expected)) != len(expected):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{tag}: expected clients must be non-empty and distinct")
        if len(expected) < self.limits.min_clients:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{tag}: {len(expected)} expected client(s) is below this server's "
                          f"min_clients={self.limits.min_clients}; a partial sum over so few clients "
                          "would expose individual shares")
        with self._lock:
            run = self._run(request.run_id, context)
            if request.round < self._oldest_kept(run):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{tag}: round was dropped (latest {run.latest_round}, keeping {self.limits.keep_rounds})")
            state = run.rounds.get(request.round)
            if state is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{tag}: missing shares from all expected clients {list(expected)} "
                              "(no share received for this round)")
            if state.sealed_clients is not None:
                if state.partial_sum is None:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{tag}: the round was aborted")
                if state.sealed_clients != expected:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{tag}: partial sum already released for client set {list(state.sealed_clients)}; "
                                  "refusing a different set (differences of partial sums would leak individual shares)")
            else:
                missing = [c for c in expected if c not in state.shares]
                if missing:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{tag}: missing shares from expected clients {missing} (received from "
                                  f"{sorted(state.shares)})")
                least = max(state.min_summed[c] for c in expected)
                if len(expected) < least:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{tag}: a share in the set may only be summed with at least {least} clients, the "
                                  f"participants it was shown; refusing a partial sum over {len(expected)}")
                add = field_sum if run.prime_field else ring_sum
                total = to_wire(add([from_wire(state.shares[c], run.length) for c in expected]))
                self._stored += len(total) - state.held_bytes()
                state.partial_sum, state.sealed_clients = total, expected
                state.shares.clear()  # individual shares are no longer needed
                state.min_summed.clear()
            assert state.partial_sum is not None
            return pb2.GetPartialSumReply(partial_sum=state.partial_sum, length=run.length, num_clients=len(expected))

    def AbortRound(  # noqa: N802 (gRPC method name)
        self, request: pb2.AbortRoundRequest, context: grpc.ServicerContext
    ) -> pb2.AbortRoundReply:
        """Seal a round without releasing it: its shares are dropped and no partial sum is ever given."""
        self._require_server(context, request.signature, auth.abort_statement(request.run_id, request.round),
                             "AbortRound")
        with self._lock:
            run = self._run(request.run_id, context)
            state = run.rounds.setdefault(request.round, _RoundState())
            dropped = len(state.shares)
            self._stored -= state.held_bytes()
            state.shares.clear()
            state.min_summed.clear()
            state.partial_sum, state.sealed_clients = None, ()
            return pb2.AbortRoundReply(shares_dropped=dropped)

    def Status(  # noqa: N802 (gRPC method name)
        self, request: pb2.StatusRequest, context: grpc.ServicerContext
    ) -> pb2.StatusReply:
        """Held runs, rounds, bytes and the process id -- for the parameter server only."""
        self._require_server(context, request.signature, auth.status_statement(request.nonce), "Status")
        with self._lock:
            rounds = sum(len(r.rounds) for r in self._runs.values())
            return pb2.StatusReply(server_id=self.server_id, active_runs=len(self._runs), active_rounds=rounds,
                                   stored_bytes=self._stored, pid=os.getpid())

    def Health(  # noqa: N802 (gRPC method name)
        self, request: pb2.HealthRequest, context: grpc.ServicerContext
    ) -> pb2.HealthReply:
        """Liveness for anyone: ``SERVING`` and nothing else."""
        return pb2.HealthReply(status="SERVING")


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets for IPv6 literals."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def create_server(
    servicer: IntermediateAggregatorServicer,
    *,
    certificate: bytes,
    private_key: bytes,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 8,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[grpc.Server, int]:
    """Create and start a TLS gRPC server with the servicer; returns ``(server, bound_port)``.

    ``certificate``/``private_key`` are PEM (a server certificate from the deployment's CA).
    ``port=0`` binds a free ephemeral port (race-free).  SO_REUSEPORT is disabled so a
    second server on an explicit, already used port fails instead of silently sharing it.
    Messages above ``max_message_bytes`` are refused by gRPC before they reach the servicer.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=4 * max_workers,
    )
    pb2_grpc.add_IntermediateAggregatorServicer_to_server(servicer, server)
    address = format_address(host, port)
    credentials = grpc.ssl_server_credentials([(private_key, certificate)])
    try:
        bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpcio raises when the bind fails
        raise OSError(f"cannot bind intermediate server to {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind intermediate server to {address}")
    server.start()
    return server, bound
