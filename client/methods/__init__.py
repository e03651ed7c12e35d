"""Client-side logic of every method, looked up by the run-config ``method``.

``TRAIN`` maps a method to its train handler and ``QUERIES`` maps a method to
its extra message phases (``query.<action>``); handlers are
``fn(msg: Message, env: ClientEnv) -> Message`` given as ``"module:function"``
so that a process imports only the method it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

TRAIN: dict[str, str] = {
    "fedavg": "client.methods.baselines:train_fedavg",
    "ldp": "client.methods.baselines:train_ldp",
    "cdp": "client.methods.baselines:train_cdp",
    "nadp": "client.methods.nadp:train",
    "niss": "client.methods.niss:train",
    "mpddp": "client.methods.mpddp:train",
    "mpdp-naive": "client.methods.mpddp:train",
    "mpcdp": "client.methods.mpddp:train",
    "ladp": "client.methods.ladp:train",
    "ddpsa": "client.methods.ddpsa:train",
}

_KEYS = "client.pairwise_phase:handle_keys"
QUERIES: dict[str, dict[str, str]] = {
    "nadp": {"keys": _KEYS},
    "niss": {"keys": _KEYS, "shares": "client.methods.niss:handle_shares"},
    "mpddp": {"keys": _KEYS},
}


def _load(spec: str) -> Callable:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def train_handler(method: str) -> Callable:
    """The train handler of ``method`` (clear error if the method has no client side)."""
    if method not in TRAIN:
        raise ValueError(f"method {method!r} has no client train handler; known: {', '.join(sorted(TRAIN))}")
    return _load(TRAIN[method])


def query_handler(method: str, action: str) -> Callable:
    """The handler of phase ``query.<action>`` for ``method``."""
    try:
        return _load(QUERIES[method][action])
    except KeyError as err:
        raise ValueError(f"method {method!r} does not handle phase 'query.{action}'") from err


def query_actions() -> set[str]:
    """Every phase name any method uses (registered once on the ClientApp)."""
    return {a for actions in QUERIES.values() for a in actions}
