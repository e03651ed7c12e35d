"""The DDP-SA intermediate-server wire protocol and its gRPC client (plain grpcio, never Flower).

Shared by both sides of DDP-SA: ClientApps push their shares with :func:`share_and_push`, the
parameter server (``strategies.ddpsa``) fetches partial sums with :func:`reconstruct_sum`, and the
servers themselves (``server.intermediate``) implement the service defined in ``intermediate.proto``
(generated stubs ``intermediate_pb2*.py``).
"""

from client.intermediate.stub import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    IntermediateAggregationError,
    IntermediateServerClient,
    PartialSumUnavailableError,
    ServerFailure,
    SharePushError,
    fetch_partial_sums,
    push_shares,
    reconstruct_decoded,
    reconstruct_sum,
    share_and_push,
    wait_until_healthy,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT_S",
    "IntermediateAggregationError",
    "IntermediateServerClient",
    "PartialSumUnavailableError",
    "ServerFailure",
    "SharePushError",
    "fetch_partial_sums",
    "push_shares",
    "reconstruct_decoded",
    "reconstruct_sum",
    "share_and_push",
    "wait_until_healthy",
]
