"""Settings a run adjusts, or that make it far more costly than intended: warned about at start, never silent."""

from __future__ import annotations

from protocols.config import RunConfig
from protocols.methods import ignored_settings, method_spec


def adjustments(cfg: RunConfig) -> list[str]:
    """One sentence per adjusted or costly setting, naming the key (printed by the launcher and the ServerApp)."""
    notes = []
    k = cfg.clients_per_round
    if cfg.graph == "n-out" and cfg.n_out >= k - 1:
        notes.append(f"run-config 'n-out' = {cfg.n_out} >= clients per round - 1 = {k - 1}: the n-out graph "
                     "would connect every pair anyway, so every round uses the complete graph")
    ignored = ignored_settings(cfg)
    if ignored:
        trains = ", ".join(f"'{k}' = {v}" for k, v in method_spec(cfg.method).fixed.items())
        notes.append(f"method {cfg.method!r} does not read run-config "
                     + ", ".join(f"'{k}' = {v}" for k, v in ignored.items())
                     + f": each round its clients compute one gradient over all their records ({trains}); "
                     "the values given are ignored")
    return notes
