"""Communication graphs over which pairwise (cancelling) noise is shared.

* :func:`complete_graph`: every pair of nodes shares a seed (O(n^2) pairs).
* :func:`n_out_graph`: each node picks ``n_out`` distinct others uniformly; an undirected edge exists if either
  endpoint picked the other (SecAgg+-style; ``n_out ~ log n`` keeps it connected w.h.p.).

Both return ``{node: sorted neighbours}`` (symmetric) and are pure functions of (node ids, n_out, round seed):
ids are sorted first and randomness comes from :mod:`protocols.prg` (unbiased partial Fisher-Yates), because
every client must compute the same graph without talking to the others.  :func:`round_graph` is the one rule
that picks the graph of a round (run-config ``graph``, ``n-out``).

The pairwise methods draw it over the roster, never over the participants a server announces:
:func:`roster_round` gives the round's public sample of roster names and the graph over it, both from the seed
:func:`protocols.identity.roster_round_seed` (roster digest, round number); :func:`present_graph` restricts it
to the nodes present (an absent roster neighbour is just absent, nothing is re-drawn), so leaving honest nodes
out gives nobody a neighbour the roster graph does not; :func:`present_floor` is the fewest present neighbours
a client accepts; :func:`calibration_size` is the participant count a round's noise is calibrated for.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from protocols.config import RunConfig
from protocols.identity import roster_digest, roster_round_seed
from protocols.masking import assumed_colluders, mask_threshold
from protocols.prg import derive_subseed, uniform_ints
from protocols.wire.common import ViewError

__all__ = ["GRAPH_KINDS", "complete_graph", "n_out_graph", "edges", "round_graph", "round_neighbours",
           "RosterRound", "roster_round", "roster_sample", "present_graph", "present_floor", "calibration_size"]

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


def roster_sample(names: Sequence[str], size: int, seed: bytes) -> list[str]:
    """``size`` of the roster ``names`` drawn from ``seed`` (all of them when ``size >= len(names)``), sorted.

    Exact partial Fisher-Yates over the sorted names: step s swaps position s with s + an exact
    uniform integer in [0, n - s) from the PRG stream "roster-sample/step/<s>".
    """
    ordered = sorted(set(names))
    if len(ordered) != len(names):
        raise ValueError("roster names must be distinct")
    n = len(ordered)
    if size >= n:
        return ordered
    if size < 1:
        raise ValueError(f"sample size must be >= 1, got {size}")
    pool = list(ordered)
    for s in range(size):
        j = s + int(uniform_ints(derive_subseed(seed, f"roster-sample/step/{s}"), 1, n - s)[0])
        pool[s], pool[j] = pool[j], pool[s]
    return sorted(pool[:size])


@dataclass(frozen=True)
class RosterRound:
    """The round's public sample of roster names and its pairing graph over them (names).

    ``graph`` is None when every two sampled names are neighbours (kind "complete", or ``n_out``
    too large for a sparse graph over the sample).
    """

    seed: bytes
    sample: tuple[str, ...]
    graph: Mapping[str, Sequence[str]] | None

    @property
    def complete(self) -> bool:
        """Every two sampled names are neighbours."""
        return self.graph is None

    def neighbours(self, name: str) -> list[str]:
        """Roster neighbours of ``name`` in the round (KeyError if it is not sampled)."""
        if self.graph is not None:
            return list(self.graph[name])
        if name not in self.sample:
            raise KeyError(name)
        return [m for m in self.sample if m != name]


def roster_round(kind: str, n_out: int, names: Sequence[str], sample_size: int, seed: bytes) -> RosterRound:
    """The round's sample of ``names`` (:func:`roster_sample`) and the ``round_graph`` over its sorted positions."""
    sample = roster_sample(names, sample_size, seed)
    if kind not in GRAPH_KINDS:
        raise ValueError(f"unknown graph kind {kind!r} (expected one of {GRAPH_KINDS})")
    if kind == "n-out" and n_out < len(sample) - 1:
        by_pos = n_out_graph(range(len(sample)), n_out, derive_subseed(seed, "roster-graph"))
        return RosterRound(seed, tuple(sample), {sample[i]: [sample[j] for j in nb] for i, nb in by_pos.items()})
    return RosterRound(seed, tuple(sample), None)


def roster_round_of(cfg: RunConfig, roster: Mapping[str, bytes], rnd: int) -> RosterRound:
    """The round's public sample and pairing graph of ``roster`` under the run's graph rule (both ends call it).

    Sample size: run-config ``clients-per-round`` of the roster's names (all of them if it lists fewer).  The
    last few are kept per process (a client checks the same round's view several times per message).
    """
    digest = roster_digest(roster)
    key = (cfg.graph, cfg.n_out, cfg.clients_per_round, digest, int(rnd))
    if key not in _ROUNDS:
        names = list(roster)
        _ROUNDS[key] = roster_round(cfg.graph, cfg.n_out, names, min(len(names), cfg.clients_per_round),
                                    roster_round_seed(digest, rnd))
        while len(_ROUNDS) > 8:
            _ROUNDS.pop(next(iter(_ROUNDS)))
    return _ROUNDS[key]


_ROUNDS: dict[tuple, RosterRound] = {}


def present_graph(rr: RosterRound, present: Mapping[int, str]) -> dict[int, list[int]]:
    """The roster graph restricted to the present nodes (node id -> roster name, every name sampled).

    Node ids are adjacent iff their names are; an absent roster neighbour is just not there.
    Raises ViewError (a ValueError) for a name outside the round's sample or two ids under one name.
    """
    ids_of = {name: node for node, name in present.items()}
    if len(ids_of) != len(present):
        raise ViewError("two present nodes carry one roster name")
    sampled = set(rr.sample)
    strangers = sorted(n for n in ids_of if n not in sampled)
    if strangers:
        raise ViewError(f"roster names {strangers[:5]} are not in the round's public sample")
    if rr.graph is None:
        return complete_graph(list(present))
    return {node: sorted(ids_of[m] for m in rr.graph[name] if m in ids_of) for node, name in present.items()}


def calibration_size(rr: RosterRound | None, participants: int, complete: Callable[[int], bool]) -> int:
    """The participant count K a round's noise is calibrated for: the participants it lists (both ends call it).

    ``complete(K)``: the calibration for K assumes a complete graph.  Raises ValueError when it would while the
    roster's graph of the round ``rr`` is sparse (too few of the sample present for the sparse calibration).
    """
    if rr is not None and not rr.complete and complete(participants):
        raise ValueError(f"only {participants} of the roster's {len(rr.sample)} sampled clients take part, too few "
                         "for the sparse graph's calibration")
    return participants


def present_floor(roster_degree: int, corruption: float) -> int:
    """Fewest present neighbours a client with ``roster_degree`` roster neighbours accepts (0 if it has none).

    The colluders assumed among its roster neighbours, ``c = ceil(corruption * roster_degree)``
    (run-config ``mask-corruption-rate``; the roster graph does not depend on who colludes), must
    stay below the self-mask threshold of the present neighbourhood
    (:func:`protocols.masking.mask_threshold`), so they alone can never rebuild its self-mask; and at
    least one neighbour must be present (pair noise needs a partner).
    """
    if roster_degree < 1:
        return 0
    colluders = assumed_colluders(roster_degree, corruption)
    for d in range(1, roster_degree + 1):
        if mask_threshold(d, corruption) > colluders:
            return d
    return roster_degree
