"""Client-side logic of every method, looked up in the method registry (:mod:`protocols.methods`).

Handlers are ``fn(msg: Message, env: ClientEnv) -> Message``, named in the registry as objects or
``"module:function"`` strings (so that a process imports only the method it runs).
"""

from __future__ import annotations

from collections.abc import Callable

from protocols.methods import MethodSpec, method_spec, query_actions

__all__ = ["query_actions", "query_handler", "train_handler"]


def train_handler(method: str) -> Callable:
    """The train handler of ``method`` (ValueError if the method is unknown)."""
    return MethodSpec.load(method_spec(method).train)


def query_handler(method: str, action: str) -> Callable:
    """The handler of phase ``query.<action>`` for ``method``."""
    queries = method_spec(method).queries
    if action not in queries:
        raise ValueError(f"method {method!r} does not handle phase 'query.{action}'")
    return MethodSpec.load(queries[action])
