"""Settings a run adjusts, or that make it far more costly than intended: warned about at start, never silent.

Separate from :mod:`protocols.config` because it needs method math (NISS's share count) that itself
reads the run config.
"""

from __future__ import annotations

import math

from protocols.config import RunConfig
from protocols.niss import client_sigma

#: NISS noise shares per client and round above which the run warns (time and bytes grow with the count).
MAX_NISS_SHARES_WARN = 10_000
#: Records per client assumed for the record-level NISS share count (sigma_k^2 scales with 1 / records^2); the
#: real count is the clients' (reported each round as ``shares_per_client``).
NISS_RECORDS_FOR_WARN = 100


def adjustments(cfg: RunConfig) -> list[str]:
    """One sentence per adjusted or costly setting, naming the key (printed by the launcher and the ServerApp)."""
    notes = []
    k = cfg.clients_per_round
    if cfg.graph == "n-out" and cfg.n_out >= k - 1:
        notes.append(f"run-config 'n-out' = {cfg.n_out} >= clients per round - 1 = {k - 1}: the n-out graph "
                     "would connect every pair anyway, so every round uses the complete graph")
    if cfg.method == "niss" and k >= 1:
        sigma2 = client_sigma(cfg, 1.0 / k, NISS_RECORDS_FOR_WARN) ** 2
        shares = math.ceil(sigma2 / cfg.niss_unit_variance * (1.0 - 1e-12))
        who = "each client" if cfg.privacy_unit == "client" else f"a client of {NISS_RECORDS_FOR_WARN} records"
        if shares > MAX_NISS_SHARES_WARN:
            notes.append(f"run-config 'niss-unit-variance' = {cfg.niss_unit_variance:g} makes {who} send "
                         f"about {shares:,} noise shares per round (> {MAX_NISS_SHARES_WARN:,}; time and bytes grow "
                         f"with it); a unit variance of {sigma2 / 100:.3g} gives 100")
    return notes
