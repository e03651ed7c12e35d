"""LaDP-FL's card: its options, regime, guarantee and registry entry (formulas: :mod:`protocols.ladp`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocols.methods.common import MODEL, RECORD_STEP, ROUND_GOALS, SERVER
from protocols.methods.registry import register
from protocols.methods.spec import Guarantee, MethodSpec
from protocols.options import ConfigError, MethodOptions, option

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


def check_client_sizes(cfg: Any, sizes: Sequence[int]) -> None:
    """Refuse at start the settings where a client's float32 upload cannot keep its noise: it would refuse every round.

    A client of ``n`` records noises a layer with std at least ``z Delta_f`` (``z``: :func:`protocols.ladp.round_multiplier`,
    ``Delta_f``: :func:`protocols.privacy.record_sensitivity` of ``n``); its uploaded entries reach at least what
    local training moves them (:func:`protocols.privacy.record_training_movement`).  Where the float32 grid there is
    coarser than that std over :data:`protocols.ladp.ROUNDING_MARGIN` even for a model of zeros, the client's rule
    (:func:`protocols.ladp.check_upload_grid`) refuses every round: the run is refused naming the largest epsilon
    that passes for that client.

    Raises:
        ConfigError: naming 'epsilon' and 'num-clients'.
    """
    import numpy as np

    from protocols import ladp
    from protocols.privacy import gdp_epsilon, record_sensitivity, record_training_movement

    z = ladp.round_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
    for n in sorted(set(sizes), reverse=True):
        sens, movement = record_sensitivity(cfg, n), record_training_movement(cfg, n)
        if _keeps(z * sens, movement):
            continue
        need = ladp.ROUNDING_MARGIN * float(np.spacing(np.float32(movement)))
        while not _keeps(need, movement):
            need *= 1.01
        most = gdp_epsilon(need / sens, cfg.num_rounds, cfg.delta)
        shown = 10.0 ** math.floor(math.log10(most) - 1)
        raise ConfigError(f"method 'ladp' cannot keep its noise in the float32 upload of a client with {n} records: "
                          f"at run-config 'epsilon' = {cfg.epsilon:g} its noise std {z * sens:.3g} is below the "
                          f"float32 grid of the values local training reaches ({movement:.3g}) over "
                          f"{ladp.ROUNDING_MARGIN:g}, so it would refuse every round; lower 'epsilon' to at most "
                          f"{math.floor(most / shown) * shown:g} or raise 'num-clients' (fewer records per client)")


def _keeps(sigma: float, movement: float) -> bool:
    """Whether a float32 upload of a zero model moved by ``movement`` keeps noise of std ``sigma`` (the client's rule)."""
    import numpy as np

    from protocols import ladp

    plan = {"w": ladp.LayerNoise(selected=True, norm=0.0, kl=None, privacy=None, sigma=sigma)}
    try:
        ladp.check_upload_grid({"w": np.zeros(1)}, plan, movement, np.float32)
    except ValueError:
        return False
    return True


register(MethodSpec("ladp", "strategies.ladp:LadpStrategy", "client.methods.ladp:train", family="ladp",
                    paper="LaDP-FL", options=(LadpOptions,), regime=LADP_REGIME,
                    privacy=Guarantee("record", SERVER, MODEL),
                    audit="server.audits.ladp:LadpAudit", size_check=check_client_sizes,
                    start_notes=start_notes, **ROUND_GOALS))
