"""LaDP-FL's card: its options, regime, guarantee and registry entry (formulas: :mod:`protocols.ladp`)."""

from __future__ import annotations

from dataclasses import dataclass

from protocols.methods.common import MODEL, RECORD_STEP, ROUND_GOALS, SERVER
from protocols.methods.registry import register
from protocols.methods.spec import Guarantee, MethodSpec
from protocols.options import MethodOptions, option

#: ldp's regime: one full-batch step of per-example-clipped gradients per round (sensitivity 2 clip lr / N_i,
#: replacing Theorem 2's 2 lr E clip), 10 rounds on the small datasets, 20 on the large.  Every selected layer gets at
#: least the floor noise c0 Delta_f / epsilon_r, the same Gaussian release per round as ldp's (Theorem 3 with P_j <= B),
#: so the rounds, lr and clip that suit ldp suit LaDP-FL.
LADP_REGIME = {"small": {**RECORD_STEP["small"], "num-rounds": 10}, "large": {"num-rounds": 20}}


@dataclass(frozen=True)
class LadpOptions(MethodOptions):
    """LaDP-FL's layer selection R and its KL-adaptive noise (Eq. 10-12)."""

    prefix = "ladp"
    title = "LaDP-FL"

    norm_threshold: float = option(0.0, "R: layers with weight norm >= R get noise", low=0.0)
    kl_cap: float = option(1e-6, "B: cap of the KL privacy estimate (KL of whole-layer softmaxes is ~1e-7..1e-4)",
                           low=0.0, low_open=True)
    max_boost: float = option(3.0, "the most LaDP's KL-adaptive noise multiplies a layer's floor noise (P >= B / "
                                   "this); 1 = every selected layer gets the floor noise", low=1.0)


def start_notes(cfg) -> list[str]:
    """A sentence when ``ladp-norm-threshold`` (R) > 0: layers below R go up without noise (Algorithm 2's selection)."""
    r = cfg.options_of(LadpOptions).norm_threshold
    if r <= 0:
        return []
    return [f"run-config 'ladp-norm-threshold' = {r:g}: a layer whose received weights have norm below R goes up "
            "without noise, and a round with such a layer claims no guarantee (its epsilon is reported null); the "
            "run's epsilon holds only while every layer is selected (R = 0 selects every layer)"]


register(MethodSpec("ladp", "strategies.ladp:LadpStrategy", "client.methods.ladp:train", family="ladp",
                    paper="LaDP-FL", options=(LadpOptions,), regime=LADP_REGIME,
                    privacy=Guarantee("record", SERVER, MODEL),
                    audit="server.audits.ladp:LadpAudit", size_check="strategies.ladp:check_client_sizes",
                    start_notes=start_notes, **ROUND_GOALS))
