"""Fixed-point encoding in Z_2^64 and additive secret sharing (DDP-SA Algorithm 1)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats

from protocols.secret_sharing import (
    FixedPointCodec,
    FixedPointRangeError,
    encode_and_share,
    from_wire,
    random_ring_elements,
    reconstruct,
    ring_sum,
    share,
    to_wire,
)

SEED = bytes(range(32))


def _seed(label: int) -> bytes:
    return bytes([label]) * 32


def test_encode_decode_roundoff_bound() -> None:
    codec = FixedPointCodec(frac_bits=20, max_clients=16)
    x = np.random.default_rng(0).uniform(-codec.max_abs, codec.max_abs, size=10_000)
    err = np.abs(codec.decode(codec.encode(x)) - x)
    assert err.max() <= 2.0 ** -(codec.frac_bits + 1)
    assert codec.encode(np.array([-1.0])).dtype == np.uint64
    # Negative values are two's complement in the ring.
    assert codec.encode([-1.0])[0] == np.uint64(2**64 - 2**20)


@pytest.mark.parametrize("frac_bits,n_clients,m", [(32, 4, 3), (16, 10, 2), (40, 7, 5)])
def test_aggregate_reconstruction_is_exact(frac_bits: int, n_clients: int, m: int) -> None:
    codec = FixedPointCodec(frac_bits=frac_bits, max_clients=16)
    rng = np.random.default_rng(frac_bits)
    d = 2000
    xs = [rng.normal(scale=50.0, size=d) for _ in range(n_clients)]
    # Each client shares; server j sums the j-th shares of all clients; PS sums partials.
    client_shares = [encode_and_share(x, m, codec, seed=_seed(i)) for i, x in enumerate(xs)]
    partials = [ring_sum([cs[j] for cs in client_shares]) for j in range(m)]
    total = reconstruct(partials)
    # Ring arithmetic is exact: equals the integer sum of the encodings.
    exact = sum(codec.encode(x).view(np.int64).astype(object) for x in xs)
    assert np.array_equal(total.view(np.int64).astype(object), exact)
    err = np.abs(codec.decode(total) - np.sum(xs, axis=0))
    assert err.max() <= n_clients * 2.0**-frac_bits
    mean_err = np.abs(codec.decode_mean(total, n_clients) - np.mean(xs, axis=0))
    assert mean_err.max() <= 2.0**-frac_bits


def test_documented_range_is_tight() -> None:
    codec = FixedPointCodec(frac_bits=30, max_clients=4)
    top = codec.encode([codec.max_abs])
    # max_clients copies of the extreme value decode correctly (no overflow) ...
    assert codec.decode(ring_sum([top] * 4))[0] == pytest.approx(4 * codec.max_abs, rel=1e-15)
    assert codec.decode(ring_sum([codec.encode([-codec.max_abs])] * 4))[0] < 0
    # ... while one more summand than allowed wraps around (why encode must refuse).
    assert codec.decode(ring_sum([top] * 5))[0] < 0


def test_encode_refuses_values_that_could_overflow() -> None:
    codec = FixedPointCodec(frac_bits=32, max_clients=1000)
    assert codec.max_abs == pytest.approx((2**63 - 1) / 1000 / 2**32, rel=1e-12)
    with pytest.raises(FixedPointRangeError, match="max_clients=1000"):
        codec.encode([0.0, codec.max_abs * 1.0001])
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(FixedPointRangeError, match="non-finite"):
            codec.encode([1.0, bad])
    with pytest.raises(ValueError):
        FixedPointCodec(frac_bits=63)
    with pytest.raises(ValueError):
        FixedPointCodec(max_clients=0)
    with pytest.raises(TypeError):
        codec.decode(np.zeros(3, dtype=np.int64))


@pytest.mark.parametrize("m", [2, 3, 5])
def test_share_reconstruct_roundtrip(m: int) -> None:
    secret = random_ring_elements(1000, seed=SEED)
    shares = share(secret, m)  # os.urandom path
    assert len(shares) == m and all(s.dtype == np.uint64 and s.shape == secret.shape for s in shares)
    assert np.array_equal(reconstruct(shares), secret)
    assert not any(np.array_equal(s, secret) for s in shares)
    # 2-D secrets keep their shape.
    mat = secret.reshape(10, 100)
    assert np.array_equal(reconstruct(share(mat, m, seed=SEED)), mat)


def test_share_validation_and_determinism() -> None:
    secret = np.arange(10, dtype=np.uint64)
    with pytest.raises(ValueError):
        share(secret, 1)
    with pytest.raises(TypeError):
        share(secret.astype(np.int64), 3)
    a, b = share(secret, 3, seed=SEED), share(secret, 3, seed=SEED)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    c = share(secret, 3, seed=_seed(7))
    assert not np.array_equal(a[0], c[0])


def test_ring_sum_wraps_and_wire_roundtrip() -> None:
    top = np.array([2**64 - 1, 5], dtype=np.uint64)
    assert ring_sum([top, np.array([2, 2**64 - 5], dtype=np.uint64)]).tolist() == [1, 0]
    data = to_wire(top)
    assert len(data) == 16 and data[:8] == b"\xff" * 8
    assert np.array_equal(from_wire(data, 2), top)
    with pytest.raises(ValueError):
        from_wire(data, 3)
    with pytest.raises(ValueError):
        from_wire(data[:-1])


def _unit(u: np.ndarray) -> np.ndarray:
    """Map uint64 ring elements to floats in [0, 1) (top 53 bits)."""
    return (u >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _assert_uniform_and_value_independent(view_a: list[np.ndarray], view_b: list[np.ndarray]) -> None:
    """view_x = the m-1 shares an adversary sees for secret x (one sample per coordinate)."""
    n = view_a[0].size
    for va, vb in zip(view_a, view_b, strict=True):
        for v in (va, vb):
            # Every bit is a fair coin (z-score per bit, 64 bits).
            bits = ((v[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)).sum(axis=0)
            z = (bits - n / 2) / np.sqrt(n / 4)
            assert np.abs(z).max() < 5.0
            # Top byte is uniform over 256 values; values are U[0,1).
            assert stats.chisquare(np.bincount((v >> np.uint64(56)).astype(np.int64), minlength=256)).pvalue > 1e-4
            assert stats.kstest(_unit(v), "uniform").pvalue > 1e-4
        # Same distribution whichever secret was shared.
        assert stats.ks_2samp(_unit(va), _unit(vb)).pvalue > 1e-4
    # Jointly uniform (hence independent): 2-D histogram of the top nibbles of pairs.
    for view in (view_a, view_b):
        for s, t in itertools.combinations(view, 2):
            cells = (s >> np.uint64(60)).astype(np.int64) * 16 + (t >> np.uint64(60)).astype(np.int64)
            assert stats.chisquare(np.bincount(cells, minlength=256)).pvalue > 1e-4


@pytest.mark.parametrize("m", [2, 3, 4])
def test_any_m_minus_1_shares_are_uniform_and_independent_of_secret(m: int) -> None:
    n = 20_000  # each coordinate is an independent sharing of the same secret
    codec = FixedPointCodec(frac_bits=32, max_clients=16)
    secret_a = np.full(n, codec.encode([1.0e5])[0], dtype=np.uint64)
    secret_b = np.full(n, codec.encode([-3.25])[0], dtype=np.uint64)  # very different bits
    shares_a = share(secret_a, m, seed=_seed(10 + m))
    shares_b = share(secret_b, m, seed=_seed(20 + m))
    for subset in itertools.combinations(range(m), m - 1):  # includes the "last" share
        _assert_uniform_and_value_independent([shares_a[i] for i in subset], [shares_b[i] for i in subset])
    # All m shares together do determine the secret.
    assert np.array_equal(reconstruct(shares_a), secret_a)


def test_statistical_checks_have_power() -> None:
    """A broken scheme (share = secret + small noise) must fail the same checks."""
    n = 20_000
    rng = np.random.default_rng(1)
    bad_a = np.uint64(1 << 40) + rng.integers(0, 1 << 50, size=n, dtype=np.uint64)
    bad_b = np.uint64(3 << 62) + rng.integers(0, 1 << 50, size=n, dtype=np.uint64)
    assert stats.ks_2samp(_unit(bad_a), _unit(bad_b)).pvalue < 1e-10
    with pytest.raises(AssertionError):
        _assert_uniform_and_value_independent([bad_a], [bad_b])
    # Also: one honest share next to a share that leaks its partner fails the joint test.
    good = random_ring_elements(n, seed=SEED)
    with pytest.raises(AssertionError):
        _assert_uniform_and_value_independent([good, good ^ np.uint64(1)], [good, good ^ np.uint64(1)])


# ----------------------------------------------------------------------------- Shamir over Z_p
def test_shamir_any_t_of_m_reconstruct_a_sum_of_sharings_exactly() -> None:
    from protocols.secret_sharing import VECTOR_PRIME, field_sum, shamir_reconstruct_vector, shamir_share_vector

    codec = FixedPointCodec(frac_bits=24, max_clients=8)
    rng = np.random.default_rng(3)
    secrets = [rng.normal(size=500) * 1e3 for _ in range(8)]
    secrets[0][:2] = [codec.max_abs, -codec.max_abs]  # the range edges decode too
    secrets[1][:2] = [codec.max_abs, -codec.max_abs]
    m, t = 5, 3
    sharings = [shamir_share_vector(codec.encode(x), m, t, seed=bytes([i]) * 32) for i, x in enumerate(secrets)]
    held = [field_sum([s[j] for s in sharings]) for j in range(m)]  # each server sums its shares mod p
    assert all((h < np.uint64(VECTOR_PRIME)).all() for h in held)
    exact = sum(codec.encode(x).view(np.int64).astype(object) for x in secrets)
    for subset in itertools.combinations(range(m), t):
        total = shamir_reconstruct_vector({j: held[j] for j in subset})
        assert np.array_equal(total.view(np.int64).astype(object), exact), subset
    assert np.array_equal(shamir_reconstruct_vector(dict(enumerate(held))).view(np.int64).astype(object), exact)
    # t - 1 points interpolate a different (random) polynomial: not the sum.
    wrong = shamir_reconstruct_vector({0: held[0], 3: held[3]})
    assert np.mean(wrong.view(np.int64).astype(object) == exact) < 0.01


def test_shamir_t_minus_one_shares_are_uniform_whatever_the_secret() -> None:
    """One share of a 2-of-3 sharing (many sharings of 0 and of a large secret): uniform top bits in both cases."""
    from protocols.secret_sharing import shamir_share_vector

    for secret in (0, 123456789):
        share = shamir_share_vector(np.full(20_000, secret, dtype=np.uint64), 3, 2, seed=bytes([secret % 251]) * 32)[1]
        top = (share >> np.uint64(56)).astype(np.int64)  # 256 buckets
        counts = np.bincount(top, minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-3


def test_shamir_refuses_bad_parameters_and_field_elements() -> None:
    from protocols.secret_sharing import VECTOR_PRIME, field_sum, shamir_share_vector

    x = np.zeros(3, dtype=np.uint64)
    for m, t in ((3, 1), (3, 4), (1, 1)):
        with pytest.raises(ValueError):
            shamir_share_vector(x, m, t)
    with pytest.raises(ValueError, match="below p|< p"):
        field_sum([np.full(3, VECTOR_PRIME, dtype=np.uint64)])
