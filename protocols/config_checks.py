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


#: The integers a run-config key takes: Flower's run config carries them as 64-bit signed integers.
INT_RANGE = (-(2**63), 2**63 - 1)
#: Most rounds a run takes: at 0.1 s a round, 10^6 rounds take 28 hours; a larger count is a typo (``1e20``).
MAX_ROUNDS = 1_000_000
#: Most local epochs a round trains: 10^4 passes over a client's records take hours a round on the image datasets.
MAX_LOCAL_EPOCHS = 10_000


def check_counts(cfg: Any) -> None:
    """The data subsets are >= 0 (0 = all), ``min-clients`` at most ``num-clients`` (or 2); ``ConfigError`` naming them.

    A round waits for ``min-clients`` connected nodes; a federation of ``num-clients`` never has more.
    ``num-rounds`` is at most :data:`MAX_ROUNDS`, ``local-epochs`` at most :data:`MAX_LOCAL_EPOCHS`, and every
    integer key, a method's too, within :data:`INT_RANGE`.
    """
    for key, value, most in (("num-rounds", cfg.num_rounds, MAX_ROUNDS), ("local-epochs", cfg.local_epochs,
                                                                          MAX_LOCAL_EPOCHS)):
        if value > most:
            raise ConfigError(f"run-config '{key}' = {value} is above the most a run takes, {most:,}: lower '{key}'")
    for key, value in cfg.to_mapping().items():
        if isinstance(value, int) and not isinstance(value, bool) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
            raise ConfigError(f"run-config '{key}' = {value} must be an integer in [-2^63, 2^63 - 1] (Flower's run "
                              "config carries 64-bit integers)")
    for key in ("train-subset", "test-subset"):
        if getattr(cfg, key.replace("-", "_")) < 0:
            raise ConfigError(f"run-config '{key}' must be an integer >= 0 (0 = all)")
    # The default 2 caps to a 1-client federation's one node; any other value above num-clients is refused.
    if cfg.min_clients > max(cfg.num_clients, 2):
        raise ConfigError(f"run-config 'min-clients' = {cfg.min_clients} is above 'num-clients' = {cfg.num_clients}: "
                          "a round cannot wait for more nodes than the federation has; set 'min-clients' <= "
                          f"{cfg.num_clients}")
