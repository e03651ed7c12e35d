"""Message parts of the baselines: local DP's noise std and central DP's clipping norm and uniform weight.

* ``ldp`` train config: :class:`LocalDpNoise` (std of the Gaussian noise the client adds
  to its clipped update, calibrated by the server for the whole run).
* ``cdp`` train config: :class:`ClippingNorm`, under the key Flower's
  ``fixedclipping_mod`` reads; the reply's metrics carry :func:`uniform_weight`, the
  weight Flower's ``FedAvg`` averages by (:data:`UNIFORM_WEIGHT_KEY`, its ``weighted_by_key``):
  central DP needs the uniform mean, whose sensitivity is ``clip / m``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from client.messages.common import read_float

_NOISE_STD = "noise-std"
#: Name of the reply metric Flower's ``FedAvg(weighted_by_key=...)`` weighs central DP's uploads by.
UNIFORM_WEIGHT_KEY = "dp_weight"


@dataclass(frozen=True)
class LocalDpNoise:
    """``train``, server -> client (``ldp``): the std of the client's Gaussian noise (noise multiplier x clip)."""

    std: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.std) and self.std >= 0):
            raise ValueError(f"'{_NOISE_STD}' must be a finite number >= 0, got {self.std!r}")

    def to_config(self) -> ConfigRecord:
        return ConfigRecord({_NOISE_STD: float(self.std)})

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> LocalDpNoise:
        return cls(read_float(rec, _NOISE_STD))


@dataclass(frozen=True)
class ClippingNorm:
    """``train``, server -> client (``cdp``): the L2 norm Flower's ``fixedclipping_mod`` clips the update to.

    Encoder only: the reader is Flower's mod, which looks the norm up under Flower's own key.
    """

    clip: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"'{KEY_CLIPPING_NORM}' must be a positive finite number, got {self.clip!r}")

    def to_config(self) -> ConfigRecord:
        return ConfigRecord({KEY_CLIPPING_NORM: float(self.clip)})


def uniform_weight() -> dict[str, float]:
    """The ``cdp`` reply metric giving every upload weight 1 (merge into the reply's metrics)."""
    return {UNIFORM_WEIGHT_KEY: 1.0}
