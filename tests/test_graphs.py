"""Tests for protocols.graphs: complete and deterministic random n-out graphs."""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import pytest
from scipy import stats

from protocols.graphs import complete_graph, edges, n_out_graph, round_graph
from protocols.prg import derive_subseed, uniform_ints

SEED = hashlib.sha256(b"round-seed").digest()


def _assert_symmetric_sorted(adj: dict[int, list[int]]) -> None:
    for v, nbrs in adj.items():
        assert nbrs == sorted(set(nbrs)) and v not in nbrs
        for u in nbrs:
            assert v in adj[u]


def test_complete_graph() -> None:
    adj = complete_graph([5, 1, 9, 3])
    assert adj == {1: [3, 5, 9], 3: [1, 5, 9], 5: [1, 3, 9], 9: [1, 3, 5]}
    assert len(edges(adj)) == 6
    assert complete_graph([7]) == {7: []}
    assert complete_graph([]) == {}


@pytest.mark.parametrize("ids", [[1, 2, 1], [3, 3]])
def test_duplicates_rejected(ids: list[int]) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        complete_graph(ids)
    with pytest.raises(ValueError, match="duplicate"):
        n_out_graph(ids + [100, 101], 1, SEED)


def test_non_int_ids_rejected() -> None:
    with pytest.raises(TypeError):
        complete_graph([1, 2.0])
    with pytest.raises(TypeError):
        complete_graph([True, 2])


@pytest.mark.parametrize("n_out", [0, -1, 5, 6])
def test_n_out_validated(n_out: int) -> None:
    with pytest.raises(ValueError, match="0 < n_out < len"):
        n_out_graph([1, 2, 3, 4, 5], n_out, SEED)


def test_n_out_seed_validated() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        n_out_graph([1, 2, 3], 1, SEED[:16])


def test_n_out_graph_structure() -> None:
    nodes = list(range(100, 160))
    adj = n_out_graph(nodes, 4, SEED)
    assert sorted(adj) == nodes
    _assert_symmetric_sorted(adj)
    assert min(len(v) for v in adj.values()) >= 4  # everyone picked 4 distinct others
    n_edges = len(edges(adj))
    assert 4 * len(nodes) / 2 <= n_edges <= 4 * len(nodes)


def test_n_out_graph_identical_for_every_client() -> None:
    """Pure function of (id set, n_out, seed): input order is irrelevant, and the seed matters."""
    nodes = [2**63 + 7, 3, 17, 2**40, 99, 1000, 5, 8]
    shuffled = nodes[:]
    random.Random(0).shuffle(shuffled)
    a = n_out_graph(nodes, 2, SEED)
    assert n_out_graph(shuffled, 2, SEED) == a
    assert n_out_graph(tuple(nodes), 2, bytearray(SEED)) == a
    others = {str(n_out_graph(nodes, 2, hashlib.sha256(bytes([i])).digest())) for i in range(20)}
    assert len(others) > 15


def test_n_out_graph_pinned() -> None:
    """Pinned edge list: the graph must never change across versions or machines."""
    adj = n_out_graph(list(range(8)), 2, SEED)
    assert edges(adj) == PINNED_EDGES


PINNED_EDGES = [
    (0, 2), (0, 4), (0, 6), (1, 3), (1, 5), (1, 6), (2, 3),
    (2, 4), (2, 7), (3, 4), (4, 6), (4, 7), (5, 6),
]  # fmt: skip


def test_n_out_graph_matches_reference_fisher_yates() -> None:
    """The sparse partial shuffle equals a plain Fisher-Yates driven by the documented PRG streams."""
    nodes = sorted([40, 3, 17, 8, 91, 55, 23, 64, 12])
    n, n_out = len(nodes), 4
    draws = [uniform_ints(derive_subseed(SEED, f"n-out-graph/step/{s}"), n, n - 1 - s) for s in range(n_out)]
    expected: dict[int, set[int]] = {v: set() for v in nodes}
    for k, v in enumerate(nodes):
        others = [u for u in nodes if u != v]
        for s in range(n_out):
            j = s + int(draws[s][k])
            others[s], others[j] = others[j], others[s]
        for u in others[:n_out]:
            expected[v].add(u)
            expected[u].add(v)
    assert n_out_graph(nodes, n_out, SEED) == {v: sorted(e) for v, e in expected.items()}


def test_n_out_full_is_complete() -> None:
    nodes = list(range(10))
    assert n_out_graph(nodes, 9, SEED) == complete_graph(nodes)


def test_n_out_choices_uniform() -> None:
    """Node 0's edges are uniform over the others (degree mean + chi-square over many round seeds)."""
    n, n_out, rounds = 12, 3, 3000
    nodes = list(range(n))
    counts = np.zeros(n, dtype=np.int64)
    degree_sum = 0
    for r in range(rounds):
        seed = hashlib.sha256(r.to_bytes(4, "big")).digest()
        adj = n_out_graph(nodes, n_out, seed)
        degree_sum += len(adj[0])
        for u in adj[0]:
            counts[u] += 1
    # P(edge 0-u) = 1 - (1 - p)^2 with p = n_out/(n-1) (either side picks)
    p = n_out / (n - 1)
    q = 1 - (1 - p) ** 2
    assert abs(degree_sum / rounds - q * (n - 1)) < 5 * math.sqrt(q * (1 - q) * (n - 1) / rounds)
    assert stats.chisquare(counts[1:]).pvalue > 0.001


def test_n_out_scales() -> None:
    adj = n_out_graph(range(2000), 11, SEED)
    _assert_symmetric_sorted(adj)
    assert min(len(v) for v in adj.values()) >= 11


def test_round_graph_rule() -> None:
    """n-out only when it can be sparse; complete otherwise (and for kind "complete"); unknown kinds rejected."""
    ids = [40, 10, 30, 20, 50, 60]
    assert round_graph("n-out", 2, ids, SEED) == n_out_graph(ids, 2, SEED)
    assert round_graph("n-out", 5, ids, SEED) == complete_graph(ids)  # n_out >= len - 1: nothing to leave out
    assert round_graph("n-out", 4, ids, SEED) == n_out_graph(ids, 4, SEED) != complete_graph(ids)
    assert round_graph("complete", 2, ids, SEED) == complete_graph(ids)
    assert round_graph("n-out", 3, ids, SEED) != round_graph("n-out", 3, ids, hashlib.sha256(b"other").digest())
    with pytest.raises(ValueError, match="graph kind"):
        round_graph("ring", 2, ids, SEED)
