"""Client-side logic of every method, looked up in the method registry (:mod:`protocols.methods`).

Handlers are ``fn(msg: Message, env: ClientEnv) -> Message``, named in the registry as objects or
``"module:function"`` strings (so that a process imports only the method it runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from protocols.methods import MethodSpec, method_spec, query_actions

if TYPE_CHECKING:
    from flwr.app import Message

    from client.env import ClientEnv

__all__ = ["query_actions", "query_handler", "query_phase", "train_handler", "train_phase"]


def train_handler(method: str) -> Callable:
    """The train handler of ``method`` (ValueError if the method is unknown)."""
    return MethodSpec.load(method_spec(method).train)


def query_handler(method: str, action: str) -> Callable:
    """The handler of phase ``query.<action>`` for ``method``."""
    from protocols.wire.common import ViewError

    queries = method_spec(method).queries
    if action not in queries:
        raise ViewError(f"method {method!r} does not handle phase 'query.{action}'")
    return MethodSpec.load(queries[action])


def query_phase(msg: Message, env: ClientEnv, action: str) -> Message:
    """The reply to a ``query.<action>`` message.

    The node's trust assumptions admit the run config (:func:`client.floor.check_trust`), then the method's handler
    answers; an exception reaches the server with its text only if it is a public refusal
    (:func:`client.errors.sealed`).
    """
    from client.errors import sealed
    from client.floor import check_trust

    with sealed(f"query.{action}"):
        check_trust(env)
        return query_handler(env.cfg.method, action)(msg, env)


def train_phase(msg: Message, env: ClientEnv) -> Message:
    """The reply to a ``train`` message, as every ClientApp (stock or :mod:`client.api`) gives it.

    The node's trust assumptions admit the run config first (:func:`client.floor.check_trust`).
    The previous round's unmasking the message carries (run-config ``unmask-next-round``) is answered next
    (before the train handler replaces that round's material), then the node's floor and ledger admit the round
    (:func:`client.floor.admit`), the method's handler trains and protects the upload, and the noiseless metrics
    a guarantee-asking node withholds are dropped; the carried answer rides on a reply without error.  An exception
    reaches the server with its text only if it is a public refusal (:func:`client.errors.sealed`).
    """
    from client.errors import sealed
    from client.floor import admit, check_trust, withhold_unprotected
    from protocols.wire.common import UNMASK_RECORD

    with sealed("train"):
        check_trust(env)
        carried = None
        if UNMASK_RECORD in msg.content:
            from client.recovery import answer_carried

            carried = answer_carried(msg.content[UNMASK_RECORD], env)
        admit(msg, env)
        reply = withhold_unprotected(train_handler(env.cfg.method)(msg, env), env)
    if carried is not None and not reply.has_error():
        reply.content[UNMASK_RECORD] = carried
    return reply
