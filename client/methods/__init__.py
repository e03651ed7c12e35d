"""Client-side logic of every method, looked up in the method registry (:mod:`protocols.methods`).

Handlers are ``fn(msg: Message, env: ClientEnv) -> Message``, named in the registry as
``"module:function"`` so that a process imports only the method it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from protocols.methods import method_spec, query_actions

__all__ = ["query_actions", "query_handler", "train_handler"]


def _load(spec: str) -> Callable:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def train_handler(method: str) -> Callable:
    """The train handler of ``method`` (ValueError if the method is unknown)."""
    return _load(method_spec(method).train)


def query_handler(method: str, action: str) -> Callable:
    """The handler of phase ``query.<action>`` for ``method``."""
    queries = method_spec(method).queries
    if action not in queries:
        raise ValueError(f"method {method!r} does not handle phase 'query.{action}'")
    return _load(queries[action])
