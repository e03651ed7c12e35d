"""How much the configured privacy noise outweighs what the clipped updates can say: the noise check.

A method's strategy states, for one round, the expected L2 norm of the DP noise its published
aggregate carries and the largest norm the signal in that aggregate can have given the clipping
(:class:`NoiseEstimate`).  Over ``T`` rounds independent noise adds up to ``sqrt(T)`` times the
per-round norm while the signal adds up to at most ``T`` times its bound (every round's update
pointing the same way), so the *run ratio* ``noise sqrt(T) / (signal T)`` is an optimistic measure:
above 1 the noise left in the model exceeds everything the updates could have moved it, and the
model cannot be expected to learn.  The runner warns with the ratio and writes it to summary.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["WARN_RATIO", "NoiseEstimate", "gaussian_norm"]

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
