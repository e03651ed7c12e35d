"""DDP-SA intermediate aggregation servers: plain grpcio service (never imports flwr).

* :mod:`.servicer` -- the gRPC servicer and :func:`create_server`.
* ``python -m server.intermediate --host 127.0.0.1 --port P`` -- run one server process.
* :mod:`.client` -- :func:`push_shares` (ClientApps), :func:`reconstruct_sum` (parameter
  server), :class:`PartialSumUnavailableError` when any of the m servers is missing.
* :mod:`.launcher` -- :func:`start_intermediate_servers` (m subprocesses on free ports).
"""

from server.intermediate.client import (
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
from server.intermediate.launcher import (
    IntermediateServerCluster,
    IntermediateServerHandle,
    IntermediateServerStartError,
    start_intermediate_servers,
)
from server.intermediate.servicer import IntermediateAggregatorServicer, create_server

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "IntermediateAggregationError",
    "IntermediateAggregatorServicer",
    "IntermediateServerClient",
    "IntermediateServerCluster",
    "IntermediateServerHandle",
    "IntermediateServerStartError",
    "PartialSumUnavailableError",
    "ServerFailure",
    "SharePushError",
    "create_server",
    "fetch_partial_sums",
    "push_shares",
    "reconstruct_decoded",
    "reconstruct_sum",
    "share_and_push",
    "start_intermediate_servers",
    "wait_until_healthy",
]
