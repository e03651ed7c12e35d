"""LaDP-FL message vocabulary: the layer-wise noise report a client sends with its noisy model.

The train message carries the server's public per-layer privacy estimates (:class:`PublicEstimates`:
the KL between the last two published global models; the client reads epsilon, delta, ``R``, ``B``
and the clip from its run config); the reply's metrics carry a
:class:`NoiseReport`, which the server (:mod:`strategies.ladp`) decodes to report
which layers got noise and how much, and to notice an un-noised release.  Every
metric key of that report lives here, as a private constant or prefix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocols.wire.common import read_float

_NOISED_LAYERS = "noised_layers"
_NUM_LAYERS = "num_layers"
_TOTAL_NOISE_NORM = "total_noise_norm"
_SENSITIVITY = "sensitivity"
_LOCAL_STEPS = "local_steps"
#: Per-layer figures travel as ``<prefix><layer name>``.
_NOISE_NORM = "noise_norm/"
_SIGMA = "sigma/"
_SELECTED = "selected/"
_KL = "kl/"
#: Train-config prefix of the server's public estimate of a layer (``ladp-estimate/<layer name>``).
_ESTIMATE = "ladp-estimate/"


@dataclass(frozen=True)
class PublicEstimates:
    """The train message's per-layer privacy estimates ``P_j`` (public: :func:`protocols.ladp.public_estimates`).

    Empty in round 1.  The client clamps each to ``[B / max-boost, B]``, so a server can only add noise.
    """

    layers: Mapping[str, float]

    def to_config(self) -> dict[str, Any]:
        return {_ESTIMATE + name: float(v) for name, v in self.layers.items()}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> PublicEstimates:
        """Decode (ValueError naming a key that is not a finite number >= 0)."""
        out = {}
        for key in rec:
            if key.startswith(_ESTIMATE):
                value = read_float(rec, key)
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(f"'{key}' must be a finite number >= 0, got {value!r}")
                out[key[len(_ESTIMATE):]] = value
        return cls(out)


@dataclass(frozen=True)
class LayerNoise:
    """What one layer (one ``state_dict`` tensor) got: expected noise L2 norm, ``sigma_j``, selection, public estimate."""

    noise_norm: float
    sigma: float
    selected: bool
    kl: float


@dataclass(frozen=True)
class NoiseReport:
    """``train`` reply metrics of LaDP: every layer's noise plus the round's sensitivity and step count."""

    layers: Mapping[str, LayerNoise]
    sensitivity: float
    local_steps: int

    @property
    def noised_layers(self) -> int:
        """Number of layers that got noise."""
        return sum(layer.selected for layer in self.layers.values())

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_noise_norm(self) -> float:
        """L2 norm of the whole noise vector."""
        return math.sqrt(sum(layer.noise_norm ** 2 for layer in self.layers.values()))

    @property
    def unnoised_release(self) -> bool:
        """True when some layer went up without noise (no model-level guarantee)."""
        return self.noised_layers < self.num_layers

    def noise_norms(self) -> dict[str, float]:
        """Per-layer noise norms, keyed as they appear in the metrics (``noise_norm/<layer>``)."""
        return {_NOISE_NORM + name: layer.noise_norm for name, layer in self.layers.items()}

    def to_metrics(self) -> dict[str, float]:
        """Figures to merge into the reply's metrics."""
        out = {
            _NOISED_LAYERS: float(self.noised_layers),
            _NUM_LAYERS: float(self.num_layers),
            _TOTAL_NOISE_NORM: self.total_noise_norm,
            _SENSITIVITY: float(self.sensitivity),
            _LOCAL_STEPS: float(self.local_steps),
        }
        for name, layer in self.layers.items():
            out[_NOISE_NORM + name] = float(layer.noise_norm)
            out[_SIGMA + name] = float(layer.sigma)
            out[_SELECTED + name] = float(layer.selected)
            out[_KL + name] = float(layer.kl)
        return out

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> NoiseReport:
        """Decode and check a reply's report (ValueError naming the key that is missing or inconsistent)."""
        names = [k[len(_NOISE_NORM):] for k in metrics if k.startswith(_NOISE_NORM)]
        layers = {
            name: LayerNoise(read_float(metrics, _NOISE_NORM + name), read_float(metrics, _SIGMA + name),
                             _flag(metrics, _SELECTED + name), read_float(metrics, _KL + name))
            for name in names
        }
        report = cls(layers, read_float(metrics, _SENSITIVITY), _count(metrics, _LOCAL_STEPS))
        for key, value in ((_NUM_LAYERS, report.num_layers), (_NOISED_LAYERS, report.noised_layers)):
            if _count(metrics, key) != value:
                raise ValueError(f"'{key}' = {metrics[key]} disagrees with the {value} per-layer entries")
        if not math.isclose(read_float(metrics, _TOTAL_NOISE_NORM), report.total_noise_norm, rel_tol=1e-6, abs_tol=1e-12):
            raise ValueError(f"'{_TOTAL_NOISE_NORM}' disagrees with the per-layer noise norms")
        return report


def _flag(metrics: Mapping[str, Any], key: str) -> bool:
    value = read_float(metrics, key)
    if value not in (0.0, 1.0):
        raise ValueError(f"'{key}' must be 0 or 1, got {value!r}")
    return value == 1.0


def _count(metrics: Mapping[str, Any], key: str) -> int:
    """A count sent as a metric (int, or a float holding an integer)."""
    value = read_float(metrics, key)
    if not value.is_integer() or value < 0:
        raise ValueError(f"'{key}' must be a non-negative integer, got {value!r}")
    return int(value)
