"""Message parts of the baselines: local DP's noise multiplier and central DP's clipping norm.

* ``ldp`` train config: :class:`LocalDpNoise`, the noise multiplier ``z`` the server calibrated for the
  whole run.  The client's std is ``z`` times the sensitivity of its own upload, which the client computes
  itself (:func:`protocols.floor.ldp_noise_std`: ``clip`` at client level, ``2 C lr / n_k`` at record
  level with its own ``n_k``): a multiplier is the one number both units share, and it lets the client
  refuse a weaker one without trusting any size the server would have to send.
* ``cdp`` at client level (``privacy-unit = "client"``): :class:`ClippingNorm`, under the key
  Flower's ``fixedclipping_mod`` reads; the server takes the uniform mean of the k clipped updates
  that arrive, whose sensitivity is ``clip / k``.  Record-level
  ``cdp`` sends nothing extra (per-example clipping happens in training; the example-weighted mean).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocols.wire.common import read_float

_NOISE_MULTIPLIER = "noise-multiplier"
#: The config key Flower's ``fixedclipping_mod`` reads the clipping norm from (its ``KEY_CLIPPING_NORM``).
KEY_CLIPPING_NORM = "clipping_norm"


@dataclass(frozen=True)
class LocalDpNoise:
    """``train``, server -> client (``ldp``): the noise multiplier z (std / sensitivity of one upload)."""

    multiplier: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.multiplier) and self.multiplier >= 0):
            raise ValueError(f"'{_NOISE_MULTIPLIER}' must be a finite number >= 0, got {self.multiplier!r}")

    def to_config(self) -> dict[str, Any]:
        return {_NOISE_MULTIPLIER: float(self.multiplier)}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> LocalDpNoise:
        return cls(read_float(rec, _NOISE_MULTIPLIER))


@dataclass(frozen=True)
class ClippingNorm:
    """``train``, server -> client (client-level ``cdp``): the L2 norm the client clips its update to.

    Stored under Flower's own key, so Flower's ``fixedclipping_mod`` reads the same record.
    """

    clip: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"'{KEY_CLIPPING_NORM}' must be a positive finite number, got {self.clip!r}")

    def to_config(self) -> dict[str, Any]:
        return {KEY_CLIPPING_NORM: float(self.clip)}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> ClippingNorm:
        return cls(read_float(rec, KEY_CLIPPING_NORM))
