"""The DDP-SA intermediate-server wire protocol and its gRPC client (plain grpcio, never Flower).

Shared by both sides of DDP-SA: ClientApps push their signed shares with :func:`share_and_push`, the
parameter server (``strategies.ddpsa``) registers each round with :func:`register_run` and fetches
partial sums with :func:`reconstruct_sum`, and the servers themselves (``server.intermediate``)
implement the service defined in ``intermediate.proto`` (generated stubs ``intermediate_pb2*.py``)
and check the signed statements of :mod:`protocols.wire.intermediate.auth`.
"""

from protocols.wire.intermediate.auth import AccessPolicy
from protocols.wire.intermediate.stub import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    IntermediateAggregationError,
    IntermediateServerClient,
    IntermediateServers,
    PartialSumUnavailableError,
    ServerFailure,
    SharePushError,
    ShareTerms,
    abort_round,
    check_shares,
    fetch_partial_sums,
    push_shares,
    reconstruct_decoded,
    reconstruct_sum,
    register_run,
    share_and_push,
    wait_until_healthy,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT_S",
    "AccessPolicy",
    "IntermediateAggregationError",
    "IntermediateServerClient",
    "IntermediateServers",
    "PartialSumUnavailableError",
    "ServerFailure",
    "SharePushError",
    "ShareTerms",
    "abort_round",
    "check_shares",
    "fetch_partial_sums",
    "push_shares",
    "reconstruct_decoded",
    "reconstruct_sum",
    "register_run",
    "share_and_push",
    "wait_until_healthy",
]
