"""NADP-FL's card: its options, regime, guarantee and registry entry (formulas: :mod:`protocols.nadp`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from protocols.methods.common import MODEL, RECORD_STEP, ROUND_GOALS
from protocols.methods.pairwise import PairwiseOptions
from protocols.methods.registry import register, register_variant
from protocols.methods.spec import Guarantee, MethodSpec
from protocols.options import ConfigError, MethodOptions, option

KEYS = "client.pairwise_phase:handle_keys"
RECOVER = "client.recovery:handle_recover"  # dropout recovery of the pairwise noise (strategies.recovery)
CONSISTENCY = "client.consistency:handle_consistency"  # signed outcome before pair material is revealed
#: nadp's epsilon_uplink is the joint view of all uploads without colluding clients; lambda (Eq. 8) keeps each
#: upload's marginal noise against a nadp-tau share of colluding peers, not the joint view (``cancelfl audit
#: --colluders`` measures the difference).
#: ``nadp-variant``: NADP-FL, or the paper's LDP-FL comparator (same training, no cancellation).
VARIANTS: tuple[str, ...] = ("nadp", "record-ldp")
SERVER_NO_COLLUSION = ("the server and eavesdroppers, no colluding client (nadp-tau's lambda protects each upload "
                       "seen alone against a tau share of colluding peers, not the joint view)")


@dataclass(frozen=True)
class NadpOptions(MethodOptions):
    """NADP-FL's compensation factor lambda (Eq. 8) and its LDP-FL comparator variant."""

    prefix = "nadp"
    title = "NADP-FL"

    lambda_: float = option(0.0, "compensation factor; 0 = derive from nadp-tau", low=0.0)
    tau: float = option(0.5, "tolerated collusion rate for lambda (Eq. 8)", low=0.0, high=1.0, high_open=True,
                        trust="at-least")
    variant: str = option("nadp", "\"record-ldp\" = the paper's LDP-FL comparator (same training, no cancellation)",
                          choices=VARIANTS)

    def assumed(self, key: str, cfg: Any) -> float:
        """``nadp-tau`` with an explicit ``nadp-lambda``: not comparable here (``math.inf``).

        The client checks that lambda per round against Eq. 8's for the node's tau
        (:func:`client.methods.nadp.round_floor`).
        """
        return math.inf if key == "nadp-tau" and self.lambda_ > 0 else super().assumed(key, cfg)

    def validate(self) -> None:
        if 0.0 < self.lambda_ < 1.0:
            raise ConfigError(f"run-config 'nadp-lambda' = {self.lambda_} must be 0 (derive from nadp-tau) "
                              "or >= 1 (a smaller factor would undercut sigma_up)")


register(MethodSpec("nadp", "strategies.nadp:NadpStrategy", "client.methods.nadp:train",
                    queries={"keys": KEYS, "consistency": CONSISTENCY, "recover": RECOVER}, family="pairwise", paper="NADP-FL",
                    options=(PairwiseOptions, NadpOptions), regime=RECORD_STEP,
                    privacy=Guarantee("record", SERVER_NO_COLLUSION, MODEL), min_per_round=2, sparse_graph=True,
                    recovery_charge="client.methods.nadp:price_recovery",
                    audit="server.audits.nadp:NadpAudit", **ROUND_GOALS))
# The NADP paper's LDP-FL comparator (Lemma 3): NADP's training and sensitivity, no cancellation.
register_variant("nadp-record-ldp", "nadp", {"nadp-variant": "record-ldp"})
# nadp on a sparser pairing graph (~8 neighbours instead of ~16): half the pairwise streams per client.
register_variant("nadp-4out", "nadp", {"graph": "n-out", "n-out": 4})
