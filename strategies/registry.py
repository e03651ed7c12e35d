"""Method name -> strategy instance, from the method registry (:mod:`protocols.methods`)."""

from __future__ import annotations

from protocols.config import RunConfig
from protocols.methods import method_spec
from strategies.base import CancelStrategy


def strategy_class(method: str) -> type[CancelStrategy]:
    """The strategy class of ``method`` (imported lazily; ValueError if unknown)."""
    return method_spec(method).load(method_spec(method).strategy)


def build_strategy(cfg: RunConfig) -> CancelStrategy:
    """Instantiate the strategy of ``cfg.method``."""
    return strategy_class(cfg.method)(cfg)
