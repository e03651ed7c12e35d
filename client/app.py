"""The cancelfl ClientApp: dispatches each message to the configured method's client logic."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from client.env import ClientEnv
from client.errors import sealed
from client.methods import query_actions, query_phase, train_phase
from protocols.node_config import check_node_config
from protocols.wire.federation import ACTION as FEDERATION
from protocols.wire.federation import FederationInfo

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training + the method's upload protection (:func:`client.methods.train_phase`).

    Every handler reads its node config and run config under :func:`client.errors.sealed`, as the phase does.
    """
    with sealed("train"):
        return train_phase(msg, ClientEnv.from_context(context))


def _register_query(action: str) -> None:
    @app.query(action)
    def _handle(msg: Message, context: Context) -> Message:
        with sealed(f"query.{action}"):
            return query_phase(msg, ClientEnv.from_context(context), action)


for _action in sorted(query_actions()):
    _register_query(_action)


@app.query(FEDERATION)
def federation(msg: Message, context: Context) -> Message:
    """What this node's node config says about the federation (the ServerApp's check, :mod:`server.federation`)."""
    with sealed(f"query.{FEDERATION}"):
        check_node_config(context.node_config)
        info = FederationInfo.from_node_config(context.node_config)
    return Message(RecordDict({"config": ConfigRecord(info.to_config())}), reply_to=msg)
