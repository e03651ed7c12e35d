"""Run-config rules between keys (:meth:`protocols.config.RunConfig.validate` applies them) and the testing aid's count.

:func:`fault_withheld` is the one formula for what run-config ``fault-drop-rate`` withholds: the server's grid
(:mod:`strategies.run.faults`) draws that many nodes, and a method card refuses a rate its rounds cannot survive.
"""

from __future__ import annotations

from typing import Any

from protocols.options import ConfigError


def fault_withheld(rate: float, nodes: int) -> int:
    """Train messages of ``nodes`` that ``fault-drop-rate`` = ``rate`` withholds: ``round(rate n)``, at least one kept."""
    return max(min(int(round(rate * nodes)), int(nodes) - 1), 0)


def check_counts(cfg: Any) -> None:
    """The data subsets are >= 0 (0 = all), ``min-clients`` at most ``num-clients`` (or 2); ``ConfigError`` naming them.

    A round waits for ``min-clients`` connected nodes; a federation of ``num-clients`` never has more.
    """
    for key in ("train-subset", "test-subset"):
        if getattr(cfg, key.replace("-", "_")) < 0:
            raise ConfigError(f"run-config '{key}' must be an integer >= 0 (0 = all)")
    # The default 2 caps to a 1-client federation's one node; any other value above num-clients is refused.
    if cfg.min_clients > max(cfg.num_clients, 2):
        raise ConfigError(f"run-config 'min-clients' = {cfg.min_clients} is above 'num-clients' = {cfg.num_clients}: "
                          "a round cannot wait for more nodes than the federation has; set 'min-clients' <= "
                          f"{cfg.num_clients}")
