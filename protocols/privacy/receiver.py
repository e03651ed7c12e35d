"""The published model's noise as its worst-placed receiver sees it: a participant that knows its own noise.

The model's epsilon holds against everyone who receives the model.  A participant of the round receives it and
knows the noise it put in itself (and any pair noise it shares with a peer), so from its position only the rest
protects a record of another client.  Every method whose model noise comes from the clients counts the model's
noise without the largest part any single participant knows (:func:`receiver_variance`); the papers count every
participant's noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["receiver_std", "receiver_variance"]


def receiver_variance(total: float, known: Iterable[float]) -> float:
    """Variance of the model's noise left to the worst-placed receiver.

    ``total``: the variance of all the noise in the model (in the model's own units); ``known``: per participant,
    the part of that variance it knows (its own noise, with its aggregation weight squared, plus any noise it
    shares with a peer).  With two participants or more, any of them may receive the model while another's record
    is the target: the largest known part is taken off.  With one participant its only receivers besides itself
    know none of the noise: ``total``.
    """
    parts = [float(v) for v in known]
    if any(not math.isfinite(v) or v < 0 for v in parts) or not (math.isfinite(total) and total >= 0):
        raise ValueError("receiver_variance needs finite, non-negative variances")
    if len(parts) < 2:
        return float(total)
    return max(float(total) - max(parts), 0.0)


def receiver_std(contributions: Iterable[float]) -> float:
    """Std left to the worst-placed receiver of a sum of independent noises, each variance known to one participant."""
    parts = [float(v) for v in contributions]
    return math.sqrt(receiver_variance(math.fsum(parts), parts))
