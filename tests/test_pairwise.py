"""Tests for protocols.pairwise: pairwise noise cancels exactly on aggregation."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable

import numpy as np
import pytest

from protocols.graphs import complete_graph, n_out_graph
from protocols.keyagreement import KeyPair, agree, derive_pair_seed, generate_keypair
from protocols.pairwise import Sampler, pairwise_noise, residual_norm
from protocols.prg import gaussian, laplace, symmetric_uniform, symmetric_uniform_sum, uniform

DIM = 1_000_000
RUN_ID = b"test-run"


def _clients(n: int, seed: int) -> tuple[list[int], dict[int, KeyPair]]:
    """Flower-like random uint64 node ids with fresh X25519 key pairs."""
    rng = random.Random(seed)
    ids = sorted(rng.randrange(1, 2**64) for _ in range(n))
    return ids, {i: generate_keypair() for i in ids}


def _pair_seeds(own: int, peers: list[int], keys: dict[int, KeyPair], round_num: int) -> dict[int, bytes]:
    """What client ``own`` computes locally: DH with each neighbour's public key."""
    return {
        j: derive_pair_seed(
            agree(keys[own], keys[j].public_bytes),
            purpose="noise",
            round_num=round_num,
            node_a=own,
            node_b=j,
            context=RUN_ID,
        )
        for j in peers
    }


def _pair_scale(i: int, j: int) -> float:
    """A per-pair scale both ends can compute (symmetric in i, j), in [0.5, 1.5)."""
    lo, hi = min(i, j), max(i, j)
    return 0.5 + ((lo * 31 + hi) % 1000) / 1000.0


def _aggregate(
    graph: dict[int, list[int]],
    keys: dict[int, KeyPair],
    size: int,
    *,
    sampler: Sampler = gaussian,
    scale: float = 1.0,
    scale_fn: Callable[[int, int], float] | None = None,
) -> tuple[float, float]:
    """Sum every client's pairwise noise (one accumulator, nothing else kept).

    Returns (||sum||, rms of the individual client noise norms).
    """
    total = np.zeros(size)
    sq_norms = []
    for i, peers in graph.items():
        c = scale if scale_fn is None else {j: scale_fn(i, j) for j in peers}
        noise = pairwise_noise(i, _pair_seeds(i, peers, keys, round_num=4), size, sampler=sampler, scale=c)
        sq_norms.append(float(noise @ noise))
        total += noise
    return float(np.linalg.norm(total)), math.sqrt(float(np.mean(sq_norms)))


def _tiled_gaussian(seed: bytes, size: int) -> np.ndarray:
    """Seed-keyed Gaussian block tiled to ``size``.

    Bit-identical at both ends like the real sampler but ~15x cheaper, so 50 clients x 49 peers x 1e6 dims stays fast.
    """
    return np.resize(gaussian(seed, 1 << 14), size)


def test_complete_graph_50_clients_cancels() -> None:
    """(b) 50 clients, complete graph, 1e6 dims, X25519 + HKDF seeds, per-pair scales: cancels to < 1e-12."""
    ids, keys = _clients(50, seed=1)
    resid, noise = _aggregate(complete_graph(ids), keys, DIM, sampler=_tiled_gaussian, scale_fn=_pair_scale)
    assert noise > 0.5 * math.sqrt(49 * DIM)  # the noise is real ...
    assert resid < 1e-12 * noise  # ... and cancels


def test_n_out_graph_50_clients_cancels() -> None:
    """(b) same with a random 3-out graph and the real Gaussian sampler, sigma via scale."""
    ids, keys = _clients(50, seed=2)
    graph = n_out_graph(ids, 3, hashlib.sha256(b"round 4").digest())
    resid, noise = _aggregate(graph, keys, DIM, sampler=gaussian, scale=2.5)
    assert noise > 2.5 * math.sqrt(3 * DIM)
    assert resid < 1e-12 * noise


@pytest.mark.parametrize("sampler", [laplace, lambda s, n: uniform(s, n) - 0.5])
def test_other_samplers_cancel(sampler) -> None:
    ids, keys = _clients(6, seed=3)
    resid, noise = _aggregate(complete_graph(ids), keys, DIM, sampler=sampler, scale_fn=_pair_scale)
    assert noise > 0.1 * math.sqrt(5 * DIM)
    assert resid < 1e-12 * noise


def test_asymmetric_scale_does_not_cancel() -> None:
    """Negative control: ends disagreeing on a pair's scale leave a residual of the order of the noise."""
    ids, keys = _clients(5, seed=4)
    resid, noise = _aggregate(complete_graph(ids), keys, 10_000, scale_fn=lambda i, j: 1.0 + (i < j))
    assert resid > 0.3 * noise


def test_sign_convention_and_scales() -> None:
    """noise_i = sum_j sign(i, j) * scale_j * sampler(seed_ij), sign = +1 iff i < j."""
    seeds = {3: b"\x01" * 32, 20: b"\x03" * 32}
    got = pairwise_noise(10, seeds, 1000, scale={3: 2.0, 20: 0.5})
    want = -2.0 * gaussian(seeds[3], 1000) + 0.5 * gaussian(seeds[20], 1000)
    assert np.allclose(got, want, rtol=0, atol=1e-12)
    got = pairwise_noise(10, seeds, 1000, sampler=laplace, scale=3.0)
    want = 3.0 * (-laplace(seeds[3], 1000) + laplace(seeds[20], 1000))
    assert np.allclose(got, want, rtol=0, atol=1e-12)


def test_two_party_bitwise_cancellation() -> None:
    """Both ends compute the identical vector, so a pair cancels exactly (bitwise)."""
    i, j = generate_keypair(), generate_keypair()
    si = derive_pair_seed(agree(i, j.public_bytes), purpose="noise", round_num=0, node_a=1, node_b=2)
    sj = derive_pair_seed(agree(j, i.public_bytes), purpose="noise", round_num=0, node_a=2, node_b=1)
    a = pairwise_noise(1, {2: si}, 100_000, scale=0.3)
    b = pairwise_noise(2, {1: sj}, 100_000, scale={1: 0.3})
    assert np.array_equal(a, -b) and np.any(a)


def test_pairwise_noise_validation() -> None:
    seeds = {2: b"\x01" * 32}
    assert np.array_equal(pairwise_noise(1, {}, 7), np.zeros(7))
    assert pairwise_noise(1, seeds, 0).shape == (0,)
    with pytest.raises(ValueError, match="own id"):
        pairwise_noise(2, seeds, 10)
    with pytest.raises(ValueError, match="size"):
        pairwise_noise(1, seeds, -1)
    with pytest.raises(ValueError, match="lacks peers"):
        pairwise_noise(1, {2: b"\x01" * 32, 3: b"\x02" * 32}, 10, scale={2: 1.0})
    with pytest.raises(ValueError, match="non-finite"):
        pairwise_noise(1, seeds, 10, scale=float("nan"))
    with pytest.raises(ValueError, match="shape"):
        pairwise_noise(1, seeds, 10, sampler=lambda s, n: np.zeros(n + 1))
    with pytest.raises(ValueError, match="32 bytes"):
        pairwise_noise(1, {2: b"short"}, 10)


def test_residual_norm() -> None:
    a = np.array([3.0, 0.0])
    b = np.array([0.0, 4.0])
    assert residual_norm([a, b]) == 5.0
    assert residual_norm([a, -a]) == 0.0
    assert residual_norm([]) == 0.0


def test_symmetric_uniform_is_twice_uniform_minus_one() -> None:
    seed = b"\x05" * 32
    assert np.array_equal(symmetric_uniform(seed, 10_000), 2.0 * uniform(seed, 10_000) - 1.0)


def test_symmetric_uniform_fast_path_cancels_and_matches_float_sum() -> None:
    """The exact integer path: same values as summing the float streams, and the parties' sums cancel."""
    ids, keys = _clients(12, seed=5)
    graph = n_out_graph(ids, 3, hashlib.sha256(b"round 5").digest())
    resid, noise = _aggregate(graph, keys, 200_000, sampler=symmetric_uniform, scale_fn=lambda i, j: 0.5 + (i + j) % 3)
    assert noise > 0.3 * math.sqrt(3 * 200_000)
    assert resid < 1e-14 * noise
    own, peers = ids[0], graph[ids[0]]
    seeds = _pair_seeds(own, peers, keys, round_num=4)
    scales = {j: 0.5 + (own + j) % 3 for j in peers}
    fast = pairwise_noise(own, seeds, 50_000, sampler=symmetric_uniform, scale=scales)
    slow = pairwise_noise(own, seeds, 50_000, sampler=lambda s, n: 2.0 * uniform(s, n) - 1.0, scale=scales)
    assert np.allclose(fast, slow, rtol=0, atol=1e-13 * len(peers))


def test_symmetric_uniform_sum_groups_many_streams() -> None:
    """More streams than one exact uint64 group holds: still the float sum, still exact per group."""
    seeds = [hashlib.sha256(b"s%d" % k).digest() for k in range(2100)]
    plus, minus = seeds[::2], seeds[1::2]
    got = symmetric_uniform_sum(plus, minus, 64)
    want = sum(symmetric_uniform(s, 64) for s in plus) - sum(symmetric_uniform(s, 64) for s in minus)
    assert np.allclose(got, want, rtol=0, atol=1e-11)
    # Within one group the sum is an exact integer: streams added and subtracted leave exactly 0.
    assert not np.any(symmetric_uniform_sum(seeds[:1000], seeds[:1000], 64))
