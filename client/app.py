"""The cancelfl ClientApp: dispatches each message to the configured method's client logic."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from client.env import ClientEnv
from client.methods import query_actions, query_handler, train_handler
from protocols.wire.common import UNMASK_RECORD
from protocols.wire.federation import ACTION as FEDERATION
from protocols.wire.federation import FederationInfo

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training + the method's upload protection."""
    from client.floor import admit, withhold_unprotected  # the train phase's: queries do not load the accounting

    env = ClientEnv.from_context(context)
    carried = None
    if UNMASK_RECORD in msg.content:  # the previous round's unmasking (run-config unmask-next-round)
        from client.recovery import answer_carried

        carried = answer_carried(msg.content[UNMASK_RECORD], env)  # before the train handler replaces it
    admit(msg, env)  # the node's privacy floor and ledger: refuses before any work (client.floor)
    reply = withhold_unprotected(train_handler(env.cfg.method)(msg, env), env)
    if carried is not None and not reply.has_error():
        reply.content[UNMASK_RECORD] = carried
    return reply


def _register_query(action: str) -> None:
    @app.query(action)
    def _handle(msg: Message, context: Context) -> Message:
        env = ClientEnv.from_context(context)
        return query_handler(env.cfg.method, action)(msg, env)


for _action in sorted(query_actions()):
    _register_query(_action)


@app.query(FEDERATION)
def federation(msg: Message, context: Context) -> Message:
    """What this node's node config says about the federation (the ServerApp's check, :mod:`server.federation`)."""
    info = FederationInfo.from_node_config(context.node_config)
    return Message(RecordDict({"config": ConfigRecord(info.to_config())}), reply_to=msg)
