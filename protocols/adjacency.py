"""Neighbouring datasets (run-config ``adjacency``): which change of one record a record-level epsilon covers.

``zero-out`` (the default): one record's contribution replaced by zero with every dataset size fixed, the
convention of Opacus and dp-accounting's DP-SGD; ``replace-one``: one record replaced by any other (the papers'
convention, twice the sensitivity of a clipped sum).
"""

from __future__ import annotations

#: Adjacency -> the most one record moves a sum of terms clipped to C, in units of C.
ADJACENCIES: dict[str, float] = {"zero-out": 1.0, "replace-one": 2.0}


def adjacency_factor(adjacency: str) -> float:
    """How many clips one record moves a sum of clipped terms by: 1 (zero-out) or 2 (replace-one).

    Raises:
        ValueError: an unknown adjacency.
    """
    try:
        return ADJACENCIES[adjacency]
    except KeyError:
        raise ValueError(f"adjacency {adjacency!r}; choose one of {', '.join(ADJACENCIES)}") from None
