"""NADP-FL's own calibration (Lemma 1, Eq. 3): the paper's figures a run reports beside its RDP accountant.

* Sensitivity (Lemma 1): ``2 C / |D_i|`` for a client's mean of per-example clipped gradients (replace-one);
  uplink ``Delta_up = 2C/|D_min|`` over the sampled clients, downlink ``Delta_down = 2C/|D|``, both scaled by
  ``lr * local_steps`` so the noise goes on model parameters (with lr decay the initial lr is conservative).
* Eq. 3 (Lemma 2 with ``Q = 2T``: an uplink and a downlink per round):
  ``sigma_up / Delta_up = sigma_down / Delta_down = sqrt(4 T ln(1/delta)) / eps``; the formulas are
  :func:`protocols.privacy.composition.lemma2_sigma` and :func:`~protocols.privacy.composition.lemma2_epsilon`.
* The paper's Lemma 2 drops ``rho`` from the moments-accountant bound, so its epsilon is an under-estimate; the
  RDP accountant's epsilon (the strategy's ledger, :func:`protocols.floor.nadp_round_noise`) is the guarantee.
  ``sampling_rate`` optionally replaces T by ``qT`` (the paper's heuristic for LDP, Lemma 3).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from protocols.nadp_allocation import normalize_weights
from protocols.privacy import calibrate_noise_multiplier, lemma2_sigma, local_sgd_sensitivity

__all__ = [
    "NadpSigmas",
    "calibrate_from_sensitivities",
    "calibrate_sigmas",
    "eq3_multiplier",
    "local_sgd_sensitivity",
    "rdp_multiplier",
    "sensitivity",
]


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def _effective_rounds(rounds: int, sampling_rate: float | None) -> float:
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if sampling_rate is None:
        return float(rounds)
    q = float(sampling_rate)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {q}")
    return q * rounds


def _sizes(dataset_sizes: Mapping[int, int] | Iterable[int]) -> list[float]:
    vals = list(dataset_sizes.values()) if isinstance(dataset_sizes, Mapping) else list(dataset_sizes)
    if not vals:
        raise ValueError("dataset_sizes must not be empty")
    return [_positive("dataset size", v) for v in vals]


def sensitivity(clip: float, dataset_size: float, *, lr: float = 1.0, local_steps: int = 1) -> float:
    """L2 sensitivity ``2 * C * lr * local_steps / |D|`` of a model update (Lemma 1)."""
    if local_steps < 1:
        raise ValueError(f"local_steps must be >= 1, got {local_steps}")
    return 2.0 * _positive("clip", clip) * _positive("lr", lr) * local_steps / _positive("dataset_size", dataset_size)


def rdp_multiplier(epsilon: float, delta: float, rounds: int) -> float:
    """The noise multiplier z of every view a run reports (aggregate, server's joint view, record-ldp's upload).

    The RDP noise multiplier of ``rounds`` unsampled Gaussian releases at (epsilon, delta)
    (:func:`protocols.privacy.calibrate_noise_multiplier`, no sampling amplification), in place of Eq. 3's.
    """
    return calibrate_noise_multiplier(epsilon, delta, 1.0, rounds)


def eq3_multiplier(epsilon: float, delta: float, rounds: int) -> float:
    """Eq. 3's sigma per unit sensitivity, ``sqrt(4 T ln(1/delta)) / eps`` (Lemma 2 over ``2T`` queries)."""
    return lemma2_sigma(1.0, epsilon, delta, 2.0 * rounds)


def calibrate_from_sensitivities(
    epsilon: float,
    delta: float,
    rounds: int,
    sensitivities: Mapping[int, float],
    weights: Mapping[int, float],
) -> NadpSigmas:
    """Eq. 3 with per-client sensitivities: ``sigma = Delta sqrt(4T ln(1/delta)) / eps`` per phase.

    ``Delta_up = max_i Delta_i`` (one upload) and ``Delta_down = max_i p_i
    Delta_i`` (the weighted aggregate), ``p_i`` from ``weights`` (sizes). With
    ``Delta_i = 2C lr / |D_i|`` this is exactly :func:`calibrate_sigmas`
    (``2C lr/|D_min|`` and ``2C lr/|D|``).
    """
    if set(sensitivities) != set(weights):
        raise ValueError("sensitivities and weights must have the same client ids")
    p = normalize_weights(weights)
    sens = {c: _positive("sensitivity", sensitivities[c]) for c in p}
    return _eq3(max(sens.values()), max(p[c] * sens[c] for c in p), epsilon, delta, _effective_rounds(rounds, None))


def _eq3(d_up: float, d_down: float, epsilon: float, delta: float, t_eff: float) -> NadpSigmas:
    """Eq. 3: each phase's sigma for the paper's ``2T`` composed queries (T uplink + T downlink, Lemma 2)."""
    return NadpSigmas(
        sigma_up=lemma2_sigma(d_up, epsilon, delta, 2.0 * t_eff),
        sigma_down=lemma2_sigma(d_down, epsilon, delta, 2.0 * t_eff),
        sensitivity_up=d_up,
        sensitivity_down=d_down,
    )


def _phase_sensitivities(clip: float, dataset_sizes: Mapping[int, int] | Iterable[int], lr: float,
                         local_steps: int) -> tuple[float, float]:
    """Lemma 1 per phase: ``(Delta_up, Delta_down) = (2C/|D_min|, 2C/|D|)`` (times ``lr * local_steps``)."""
    sizes = _sizes(dataset_sizes)
    return (sensitivity(clip, min(sizes), lr=lr, local_steps=local_steps),
            sensitivity(clip, math.fsum(sizes), lr=lr, local_steps=local_steps))


@dataclass(frozen=True)
class NadpSigmas:
    """Per-round noise requirements of Theorem 1 (Eq. 3) and their sensitivities."""

    sigma_up: float
    sigma_down: float
    sensitivity_up: float
    sensitivity_down: float

    @property
    def noise_multiplier(self) -> float:
        """``sigma_down / Delta_down`` (equal to ``sigma_up / Delta_up`` under Eq. 3)."""
        return self.sigma_down / self.sensitivity_down


def calibrate_sigmas(
    epsilon: float,
    delta: float,
    clip: float,
    dataset_sizes: Mapping[int, int] | Iterable[int],
    rounds: int,
    *,
    lr: float = 1.0,
    local_steps: int = 1,
    sampling_rate: float | None = None,
) -> NadpSigmas:
    """Eq. 3: ``sigma_up = Delta_up sqrt(4T ln(1/delta))/eps``, same for down.

    ``dataset_sizes`` are those of the clients sampled *this round* (the paper's
    ``|D_min|`` and ``|D|`` are per sampling round).
    """
    d_up, d_down = _phase_sensitivities(clip, dataset_sizes, lr, local_steps)
    return _eq3(d_up, d_down, epsilon, delta, _effective_rounds(rounds, sampling_rate))
