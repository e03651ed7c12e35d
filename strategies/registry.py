"""Method name -> strategy class, imported lazily so a run loads only its method."""

from __future__ import annotations

import importlib

from server.config import RunConfig
from strategies.base import CancelStrategy

STRATEGIES: dict[str, str] = {
    "fedavg": "strategies.baselines:FedAvgStrategy",
    "ldp": "strategies.baselines:LocalDPStrategy",
    "cdp": "strategies.baselines:CentralDPStrategy",
    "nadp": "strategies.nadp:NadpStrategy",
    "niss": "strategies.niss:NissStrategy",
    "mpddp": "strategies.mpddp:MpddpStrategy",
    "mpdp-naive": "strategies.mpddp:MpdpNaiveStrategy",
    "mpcdp": "strategies.mpddp:MpcdpStrategy",
    "ladp": "strategies.ladp:LadpStrategy",
    "ddpsa": "strategies.ddpsa:DdpsaStrategy",
}


def build_strategy(cfg: RunConfig) -> CancelStrategy:
    """Instantiate the strategy of ``cfg.method`` (clear error if it is not available)."""
    spec = STRATEGIES.get(cfg.method)
    if spec is None:
        raise ValueError(f"method {cfg.method!r} is not available; available: {', '.join(sorted(STRATEGIES))}")
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)(cfg)
