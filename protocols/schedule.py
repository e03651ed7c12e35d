"""The run's public participation schedule: which roster names each round samples, known before round 1.

The pairwise methods (nadp, niss, mpddp) draw each round's sample of the roster from
:func:`protocols.identity.roster_round_seed` (roster digest, round number) with
:func:`protocols.graphs.roster_sample`: no server choice and no secret, so the server and every client
compute the whole schedule before round 1.  A client releases only in the rounds that sample it (it refuses a
view that does not, :func:`client.pairwise_phase.check_view`), so the most rounds any roster name is sampled in
(:func:`most_participations`) bounds every client's releases over the run: the noise is calibrated for that
many releases instead of ``num-rounds`` (with ``sample-rate`` = 1 both are ``num-rounds``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache

from protocols.config import RunConfig
from protocols.graphs import roster_sample
from protocols.identity import roster_digest, roster_round_seed

__all__ = ["most_participations", "participations", "roster_participations", "roster_releases"]


def participations(names: Sequence[str], sample_size: int, digest: bytes, first: int, last: int) -> dict[str, int]:
    """Rounds ``first..last`` (inclusive, 1-based) that sample each roster name (every name listed, 0 if none).

    Args:
        names: the roster's names.
        sample_size: names sampled per round (run-config ``clients-per-round``; all when >= ``len(names)``).
        digest: the roster digest (:func:`protocols.identity.roster_digest`).
        first: the first round counted.
        last: the last round counted (``last < first``: none).

    Raises:
        ValueError: as :func:`protocols.graphs.roster_sample` (duplicate names, ``sample_size`` < 1).
    """
    return dict(_counts(tuple(sorted(names)), int(sample_size), bytes(digest), int(first), int(last)))


def most_participations(names: Sequence[str], sample_size: int, digest: bytes, num_rounds: int) -> int:
    """Most rounds of ``1..num_rounds`` that sample any one roster name: the releases the noise is calibrated for.

    Equals ``num_rounds`` when every round samples every name; at least 1.
    """
    counts = participations(names, sample_size, digest, 1, num_rounds)
    return max(1, max(counts.values(), default=0))


@lru_cache(maxsize=64)
def _counts(names: tuple[str, ...], sample_size: int, digest: bytes, first: int, last: int) -> tuple[tuple[str, int], ...]:
    size = min(len(names), sample_size)
    count: Counter[str] = Counter(dict.fromkeys(names, 0))
    for rnd in range(first, last + 1):
        count.update(roster_sample(names, size, roster_round_seed(digest, rnd)))
    return tuple(sorted(count.items()))


def roster_releases(cfg: RunConfig, roster: Mapping[str, bytes]) -> int:
    """Releases the run's noise is calibrated for: the most rounds any roster name is sampled in (both ends call it).

    :func:`most_participations` over rounds ``1..num-rounds`` of the public schedule (``num-rounds`` when every
    round samples every name).
    """
    return most_participations(list(roster), cfg.clients_per_round, roster_digest(roster), cfg.num_rounds)


def roster_participations(cfg: RunConfig, roster: Mapping[str, bytes], first: int, last: int) -> dict[str, int]:
    """Rounds ``first..last`` of the public schedule that sample each roster name."""
    return participations(list(roster), cfg.clients_per_round, roster_digest(roster), first, last)
