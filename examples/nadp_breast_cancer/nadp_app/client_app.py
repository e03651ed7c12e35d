"""The ClientApp: cancelfl's handlers on the app's model and this node's partition.

It holds no method settings: the strategy sends them in every message (client.api).
"""

from __future__ import annotations

from flwr.app import Context
from flwr.clientapp import ClientApp

from client.api import attach
from nadp_app.task import Net, partition


def load(context: Context):
    """A fresh model and this node's data (simulation sets partition-id / num-partitions)."""
    x, y = partition(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    return Net(), x, y


app = attach(ClientApp(), load)
