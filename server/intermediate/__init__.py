"""DDP-SA intermediate aggregation servers: plain grpcio service (never imports flwr).

* :mod:`.servicer` -- the gRPC servicer and :func:`create_server`.
* ``python -m server.intermediate --host 127.0.0.1 --port P`` -- run one server process.
* :mod:`.launcher` -- :func:`start_intermediate_servers` (m subprocesses on free ports), the one
  place that starts local intermediate servers.

The wire protocol and the gRPC client used by ClientApps and the parameter server live one level
down, in :mod:`protocols.wire.intermediate`.
"""

from server.intermediate.launcher import (
    IntermediateServerCluster,
    IntermediateServerHandle,
    IntermediateServerStartError,
    start_intermediate_servers,
)
from server.intermediate.servicer import IntermediateAggregatorServicer, create_server

__all__ = [
    "IntermediateAggregatorServicer",
    "IntermediateServerCluster",
    "IntermediateServerHandle",
    "IntermediateServerStartError",
    "create_server",
    "start_intermediate_servers",
]
