"""How much the configured privacy noise outweighs what the clipped updates can say: the noise check.

A strategy states for one round the expected L2 norm of the noise in its published aggregate and the largest norm
the clipped signal can have (:class:`NoiseEstimate`).  Over ``T`` rounds noise adds up to ``sqrt(T)`` times its
per-round norm and the signal to at most ``T`` times its bound, so the run ratio ``noise sqrt(T) / (signal T)``
is optimistic: above 1 the model cannot be expected to learn, and the runner warns.

Where the released signal is far below the clip bound (the MP family clips perturbed gradients; DDP-SA bounds the
L1 norm) the runner also measures it: each released aggregate ``A_t = s_t + n_t`` carries noise of known power
``P_t``, so ``||A_t||^2 - P_t`` estimates ``||s_t||^2`` without bias (:class:`MeasuredSignal`; post-processing,
no privacy cost).  Parameter-space norms do not say how much noise moves the model's outputs, so whether a run
learned is judged by its test accuracy (:func:`strategies.run.notes.learning_check`), which quotes these figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["WARN_RATIO", "MeasuredSignal", "NoiseEstimate", "Release", "gaussian_norm"]

#: Run ratio above which the runner warns.
WARN_RATIO = 1.0


def gaussian_norm(std: float, dim: int) -> float:
    """Expected L2 norm (to within 1/(4 dim)) of a ``dim``-vector of independent N(0, std^2) entries: ``std sqrt(dim)``."""
    return float(std) * math.sqrt(max(int(dim), 0))


@dataclass(frozen=True)
class NoiseEstimate:
    """One round's expected noise norm in the aggregate and the clip-bounded signal norm, and the run's rounds."""

    noise_norm: float  # expected L2 norm of the DP noise in one round's aggregate (model or gradient space)
    signal_norm: float  # largest L2 norm the round's signal can have in the same space (from the clipping)
    rounds: int
    space: str = "model update"  # what the two norms measure ("model update", "gradient")

    @property
    def round_ratio(self) -> float:
        """Noise / signal of one round."""
        return self.noise_norm / self.signal_norm if self.signal_norm > 0 else math.inf

    @property
    def run_ratio(self) -> float:
        """Noise accumulated over the run / the most signal the run can carry: ``round_ratio / sqrt(T)``."""
        return self.round_ratio / math.sqrt(max(self.rounds, 1))

    @property
    def dwarfs(self) -> bool:
        """True when the run ratio exceeds :data:`WARN_RATIO`."""
        return self.run_ratio > WARN_RATIO

    def as_dict(self) -> dict[str, float | int | str]:
        """For summary.json."""
        return {"noise_norm_per_round": self.noise_norm, "signal_norm_bound_per_round": self.signal_norm,
                "rounds": self.rounds, "space": self.space, "round_ratio": self.round_ratio,
                "run_ratio": self.run_ratio}

    def message(self) -> str:
        """The warning: by how much the noise dwarfs the signal, and what changes it."""
        return (f"the configured privacy noise dwarfs the signal: expected noise norm in each round's aggregate "
                f"{self.noise_norm:.3g} vs clip-bounded {self.space} norm {self.signal_norm:.3g} ({self.round_ratio:.3g}x); "
                f"over {self.rounds} round(s) the noise left in the model is {self.run_ratio:.3g}x the most the updates "
                "can move it, so expect little learning. A larger 'epsilon', more clients per round, a smaller model "
                "or (record-level methods) more data per client reduce it")


#: Var(||n||^2) <= NOISE_KURTOSIS P^2 / d_eff for the noises used here (2 for a Gaussian, 5 for one Laplace
#: per coordinate; sums of several clients' Laplace noise lie in between): the conservative value.
NOISE_KURTOSIS = 5.0


@dataclass(frozen=True)
class Release:
    """One round's released aggregate and what the strategy knows of the DP noise in it.

    ``noise_power``: E||n||^2 of that noise (drawn independently of the round's signal).  ``effective_dim``:
    (sum_i v_i)^2 / sum_i v_i^2 over the coordinates' noise variances v_i (the vector's size for i.i.d. noise;
    smaller where a recovery rescales the noise, as MP_Server's R does), which sets how precisely
    ``||A||^2 - noise_power`` estimates the signal's power.
    """

    vector: np.ndarray
    noise_power: float
    effective_dim: float | None = None


@dataclass
class MeasuredSignal:
    """The signal the released aggregates actually carried, estimated against their known noise.

    ``add`` one :class:`Release` per successful round.  ``round_ratio`` = RMS noise norm / RMS signal norm
    per round; ``run_ratio`` = round_ratio / sqrt(T) (T = the run's planned rounds), the a-priori check's
    formula with the measured signal in place of the clip bound (still optimistic: it assumes every round's
    signal points the same way);
    ``run_ratio_at_least`` uses a 3-sigma upper estimate of the signal (the noise is at least that dominant).
    """

    planned_rounds: int = 1  # T of the run: the ratio is projected to the whole run, as the a-priori one
    space: str = "model update"
    rounds: int = 0
    noise_power: float = 0.0  # sum_t E||n_t||^2
    excess_power: float = 0.0  # sum_t (||A_t||^2 - E||n_t||^2): unbiased for sum_t ||s_t||^2
    variance: float = 0.0  # of excess_power (noise self-term plus signal-noise cross term)

    def add(self, release: Release) -> None:
        """Account one round's release."""
        a = np.asarray(release.vector, dtype=np.float64).ravel()
        p = float(release.noise_power)
        if not (math.isfinite(p) and p >= 0) or not np.all(np.isfinite(a)):
            return  # a failed or non-finite round is not a measurement
        d = float(release.effective_dim or a.size)
        excess = float(a @ a) - p
        self.rounds += 1
        self.noise_power += p
        self.excess_power += excess
        self.variance += NOISE_KURTOSIS * p * p / d + 4.0 * max(excess, 0.0) * p / d

    @property
    def noise_rms(self) -> float:
        """RMS per-round noise norm."""
        return math.sqrt(self.noise_power / self.rounds) if self.rounds else 0.0

    def _signal_rms(self, excess: float) -> float:
        return math.sqrt(max(excess, 0.0) / self.rounds) if self.rounds else 0.0

    @property
    def signal_rms(self) -> float:
        """RMS per-round signal norm (0 when the estimate is not above the noise)."""
        return self._signal_rms(self.excess_power)

    def _ratio(self, signal: float) -> float:
        if not self.rounds:
            return math.nan
        return self.noise_rms / signal / math.sqrt(max(self.planned_rounds, 1)) if signal > 0 else math.inf

    @property
    def run_ratio(self) -> float:
        """Measured run ratio: noise sqrt(T) / (signal T) with the measured RMS norms."""
        return self._ratio(self.signal_rms)

    @property
    def run_ratio_at_least(self) -> float:
        """The run ratio with a 3-sigma upper estimate of the signal: the noise is at least this dominant."""
        return self._ratio(self._signal_rms(self.excess_power + 3.0 * math.sqrt(self.variance)))

    def as_dict(self) -> dict[str, float | int | str | None]:
        """For summary.json (a ratio is null when no signal is measurable above the noise: unbounded)."""
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None
        return {"rounds": self.rounds, "planned_rounds": self.planned_rounds, "space": self.space,
                "noise_norm_rms": self.noise_rms, "signal_norm_rms": self.signal_rms, "run_ratio": finite(self.run_ratio),
                "run_ratio_at_least": finite(self.run_ratio_at_least)}

    def describe(self) -> str:
        """One line: what the released aggregates carried (quoted by the learning check's warning)."""
        if not self.rounds:
            return "no released aggregate was measured"
        if self.signal_rms <= 0:
            return (f"measured over {self.rounds} round(s), the released {self.space}s carried noise of RMS norm "
                    f"{self.noise_rms:.3g} and no signal measurable above it")
        return (f"measured over {self.rounds} round(s), the released {self.space}s carried noise of RMS norm "
                f"{self.noise_rms:.3g} against a signal of RMS norm ~{self.signal_rms:.3g} "
                f"({self.noise_rms / self.signal_rms:.3g}x per round)")
