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

_BASE = ("CancelStrategy", "RoundFailed")
_FACTORY = ("build_strategy", "strategy_class")


def _strategy_classes() -> dict[str, str]:
    """Public class name -> its module, for every registered method whose strategy is named by import path."""
    from protocols.methods import METHODS

    return {spec.strategy.split(":")[1]: spec.strategy.split(":")[0] for spec in METHODS.values()
            if isinstance(spec.strategy, str)}


def __getattr__(name: str) -> object:
    """Import a strategy class (or the base / factory) on first use.

    ``STRATEGY_CLASSES`` and ``__all__`` are read from the registry when used: a card of your own may import this
    package while the package is being imported.
    """
    if name in _BASE:
        return getattr(importlib.import_module("strategies.base"), name)
    if name in _FACTORY:
        return getattr(importlib.import_module("strategies.registry"), name)
    if name == "STRATEGY_CLASSES":
        return _strategy_classes()
    if name == "__all__":
        return [*_BASE, *_FACTORY, *sorted(_strategy_classes())]
    classes = _strategy_classes()
    if name in classes:
        return getattr(importlib.import_module(classes[name]), name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
