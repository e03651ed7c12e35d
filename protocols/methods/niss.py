"""NISS's card: its options, regime, guarantee and registry entry (formulas: :mod:`protocols.niss`)."""

from __future__ import annotations

from dataclasses import dataclass

from protocols.methods.common import MODEL, RECORD_STEP, ROUND_GOALS
from protocols.methods.nadp import CONSISTENCY, KEYS, RECOVER
from protocols.methods.pairwise import PairwiseOptions
from protocols.methods.registry import register
from protocols.methods.spec import PRIVACY_UNITS, Guarantee, MethodSpec
from protocols.options import ConfigError, MethodOptions, option

SERVER_NISS = "the server and eavesdroppers, colluding with at most a niss-rho share of a client's neighbours"
#: The uploads' second figure: the same adversary with none of the client's neighbours colluding.
SERVER_NISS_ALONE = "the server and eavesdroppers, with no neighbour of the client colluding"


@dataclass(frozen=True)
class NissOptions(MethodOptions):
    """NISS's share distortion tau and tolerated collusion rho (Theorem 3), and how a share travels."""

    prefix = "niss"
    title = "NISS"

    tau: float = option(-1.0, "distortion std; < 0 = max(Theorem 3 for niss-rho, 1/sqrt(clients per round))")
    rho: float = option(0.5, "tolerated colluding fraction (Theorem 3)", low=0.0, high=1.0, trust="at-least")
    share_encoding: str = option("seed", "a share travels as an encrypted 32-byte seed, or as the vector itself",
                                 choices=("seed", "vector"))

    def validate(self) -> None:
        """A ``niss-tau`` in ``(0, MIN_TAU)``: no client could compute its floor reliably (:data:`MIN_TAU`)."""
        from protocols.niss import MIN_TAU  # on use: it imports the run config

        if 0 < self.tau < MIN_TAU:
            raise ConfigError(f"run-config 'niss-tau' = {self.tau!r} must be < 0 (auto), 0 or at least {MIN_TAU:g}: "
                              "below, the joint view's noise factors cannot be computed reliably")


register(MethodSpec("niss", "strategies.niss:NissStrategy", "client.methods.niss:train",
                    queries={"keys": KEYS, "shares": "client.methods.niss:handle_shares", "consistency": CONSISTENCY,
                             "recover": RECOVER},
                    family="pairwise", paper="NISS", options=(PairwiseOptions, NissOptions), regime=RECORD_STEP,
                    privacy=Guarantee("record", SERVER_NISS, MODEL, SERVER_NISS_ALONE), units=PRIVACY_UNITS, min_per_round=2,
                    sparse_graph=True, recovery_charge="client.methods.niss:price_recovery",
                    audit="server.audits.niss:NissAudit", **ROUND_GOALS))
