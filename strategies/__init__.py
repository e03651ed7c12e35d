"""cancelfl's Flower strategies: the public server-side API.

One Flower ``Strategy`` per method, each constructible from keyword arguments (run-config keys as
Python names) and runnable with ``Strategy.start()`` in your own ServerApp::

    from strategies import NadpStrategy

    strategy = NadpStrategy(epsilon=1.0, clip=1.0, num_clients=10, local_epochs=1, batch_size=1000, lr=2.0)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=20)
    print(strategy.privacy_report(20))  # epsilon spent: upload (server's view) and published model

The client side is :mod:`client.api` (``attach`` / ``protect``).  Classes are imported lazily from
the method registry (:mod:`protocols.methods`), so importing this package loads no method.
"""

from __future__ import annotations

import importlib

from protocols.methods import METHODS

#: Public class name -> its module, for every registered method's strategy.
STRATEGY_CLASSES: dict[str, str] = {spec.strategy.split(":")[1]: spec.strategy.split(":")[0] for spec in METHODS.values()
                                    if isinstance(spec.strategy, str)}

__all__ = ["CancelStrategy", "RoundFailed", "build_strategy", "strategy_class", *sorted(STRATEGY_CLASSES)]


def __getattr__(name: str) -> object:
    """Import a strategy class (or the base / factory) on first use."""
    if name in STRATEGY_CLASSES:
        return getattr(importlib.import_module(STRATEGY_CLASSES[name]), name)
    if name in ("CancelStrategy", "RoundFailed"):
        return getattr(importlib.import_module("strategies.base"), name)
    if name in ("build_strategy", "strategy_class"):
        return getattr(importlib.import_module("strategies.registry"), name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
