"""Communication graphs over which pairwise (cancelling) noise is shared.

* :func:`complete_graph`: every pair of nodes shares a seed (O(n^2) pairs).
* :func:`n_out_graph`: each node picks ``n_out`` distinct others uniformly; an undirected edge exists if either
  endpoint picked the other (SecAgg+-style; ``n_out ~ log n`` keeps it connected w.h.p.).

Both return ``{node: sorted neighbours}`` (symmetric) and are pure functions of (node ids, n_out, round seed):
ids are sorted first and randomness comes from :mod:`protocols.prg` (unbiased partial Fisher-Yates), because
every client must compute the same graph without talking to the others.  :func:`round_graph` is the one rule
that picks the graph of a round (run-config ``graph``, ``n-out``), used by the server's key phase, NISS and the
nadp client alike.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from protocols.prg import derive_subseed, uniform_ints

__all__ = ["GRAPH_KINDS", "complete_graph", "n_out_graph", "edges", "round_graph", "round_neighbours"]

#: Graph kinds understood by :func:`round_graph`.
GRAPH_KINDS = ("complete", "n-out")


def _canonical_nodes(node_ids: Sequence[int]) -> list[int]:
    nodes = []
    for node in node_ids:
        if isinstance(node, bool):
            raise TypeError("node ids must be ints, got bool")
        try:
            nodes.append(operator.index(node))
        except TypeError:
            raise TypeError(f"node ids must be ints, got {type(node).__name__}") from None
    ordered = sorted(nodes)
    dupes = sorted({a for a, b in zip(ordered, ordered[1:], strict=False) if a == b})
    if dupes:
        raise ValueError(f"duplicate node ids: {dupes[:10]}")
    return ordered


def complete_graph(node_ids: Sequence[int]) -> dict[int, list[int]]:
    """Every node adjacent to every other node (duplicate ids rejected)."""
    nodes = _canonical_nodes(node_ids)
    return {v: [u for u in nodes if u != v] for v in nodes}


def n_out_graph(node_ids: Sequence[int], n_out: int, round_seed: bytes) -> dict[int, list[int]]:
    """Random n-out graph, identical for every caller given the same inputs.

    Node k (in sorted order) selects ``n_out`` distinct others by a partial Fisher-Yates
    shuffle of the other nodes; step s uses an exact uniform integer in
    [0, n-1-s) from the PRG stream "n-out-graph/step/<s>" at position k. Requires
    0 < n_out < len(node_ids).
    """
    nodes = _canonical_nodes(node_ids)
    n = len(nodes)
    if isinstance(n_out, bool):
        raise TypeError("n_out must be an int")
    n_out = operator.index(n_out)
    if not 0 < n_out < n:
        raise ValueError(f"n_out must satisfy 0 < n_out < len(node_ids) = {n}, got {n_out}")
    # one vector of draws per Fisher-Yates step, entry k belongs to node k
    draws = [uniform_ints(derive_subseed(round_seed, f"n-out-graph/step/{s}"), n, n - 1 - s).tolist() for s in range(n_out)]
    adjacency: dict[int, set[int]] = {v: set() for v in nodes}
    for k, v in enumerate(nodes):
        swapped: dict[int, int] = {}  # sparse permutation of positions 0..n-2 (others)
        for s in range(n_out):
            j = s + draws[s][k]
            pick = swapped.get(j, j)
            swapped[j] = swapped.get(s, s)
            other = nodes[pick if pick < k else pick + 1]  # position -> other node id
            adjacency[v].add(other)
            adjacency[other].add(v)
    return {v: sorted(nbrs) for v, nbrs in adjacency.items()}


def round_graph(kind: str, n_out: int, participants: Sequence[int], seed: bytes) -> dict[int, list[int]]:
    """The neighbour graph of one round over ``participants``.

    ``kind == "n-out"`` gives the random n-out graph of ``seed`` when ``n_out <
    len(participants) - 1``; otherwise (kind "complete", or too few
    participants for a sparse graph) every two participants are neighbours.
    """
    if kind not in GRAPH_KINDS:
        raise ValueError(f"unknown graph kind {kind!r} (expected one of {GRAPH_KINDS})")
    if kind == "n-out" and n_out < len(participants) - 1:
        return n_out_graph(participants, n_out, seed)
    return complete_graph(participants)


def round_neighbours(kind: str, n_out: int, participants: Sequence[int], seed: bytes, node: int) -> list[int]:
    """``round_graph(kind, n_out, participants, seed)[node]`` (O(K) for a complete graph instead of O(K^2))."""
    if kind == "n-out" and n_out < len(participants) - 1:
        return n_out_graph(participants, n_out, seed)[node]
    if kind not in GRAPH_KINDS:
        raise ValueError(f"unknown graph kind {kind!r} (expected one of {GRAPH_KINDS})")
    nodes = _canonical_nodes(participants)
    if node not in nodes:
        raise KeyError(node)
    return [u for u in nodes if u != node]


def edges(adjacency: dict[int, list[int]]) -> list[tuple[int, int]]:
    """Undirected edge list (i < j) of a symmetric adjacency, sorted."""
    return sorted((v, u) for v, nbrs in adjacency.items() for u in nbrs if v < u)
