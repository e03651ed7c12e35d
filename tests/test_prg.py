"""Tests for protocols.prg: validation, determinism, portability and distributions."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from protocols import prg
from protocols.prg import (
    SEED_BYTES,
    derive_subseed,
    gaussian,
    laplace,
    portable_math,
    random_bytes,
    stream,
    uniform,
    uniform_ints,
    ziggurat,
)

SEED = bytes(range(32))
SEED2 = hashlib.sha256(b"another seed").digest()
REPO = Path(__file__).resolve().parents[1]

FLOAT_FUNCS = [gaussian, laplace, uniform]


def _ints7(seed: bytes, size: int) -> np.ndarray:
    return uniform_ints(seed, size, 7)


ALL_VECTOR_FUNCS = [*FLOAT_FUNCS, _ints7]


# Hash of every generator's output. Kept as source so that a fresh interpreter can run
# exactly the same code without importing this test module (and scipy/pytest).
_DIGEST_SRC = """
import hashlib
import numpy as np
from protocols.prg import derive_subseed, gaussian, laplace, random_bytes, uniform, uniform_ints


def digest(seed, n):
    h = hashlib.sha256()
    for arr in (
        gaussian(seed, n),
        gaussian(seed, n, sigma=0.37),
        laplace(seed, n, scale=2.5),
        uniform(seed, n),
        uniform_ints(seed, n, 1000003),
        uniform_ints(seed, n, 2**64),
    ):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(random_bytes(seed, 1000))
    h.update(derive_subseed(seed, "label"))
    return h.hexdigest()
"""
_ns: dict = {}
exec(_DIGEST_SRC, _ns)
_digest = _ns["digest"]


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("func", ALL_VECTOR_FUNCS)
@pytest.mark.parametrize("bad", [b"", b"\x00" * 31, b"\x00" * 33, b"\x00" * 64])
def test_seed_must_be_32_bytes(func, bad: bytes) -> None:
    with pytest.raises(ValueError, match="exactly 32 bytes"):
        func(bad, 10)


@pytest.mark.parametrize("func", [*ALL_VECTOR_FUNCS, random_bytes])
def test_seed_type_checked(func) -> None:
    with pytest.raises(TypeError):
        func("0" * 32, 10)


@pytest.mark.parametrize("func", [*ALL_VECTOR_FUNCS, random_bytes])
def test_size_zero_and_negative(func) -> None:
    empty = func(SEED, 0)
    assert len(empty) == 0
    with pytest.raises(ValueError, match=">= 0"):
        func(SEED, -1)
    with pytest.raises(TypeError):
        func(SEED, 3.0)


@pytest.mark.parametrize("func", FLOAT_FUNCS)
def test_float_dtype_and_shape(func) -> None:
    out = func(SEED, 1234)
    assert out.dtype == np.float64 and out.shape == (1234,)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("func", [gaussian, laplace])
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_scale_rejected(func, bad: float) -> None:
    with pytest.raises(ValueError):
        func(SEED, 10, bad)


def test_scale_is_exact_multiplication() -> None:
    assert np.array_equal(gaussian(SEED, 5000, sigma=3.0), gaussian(SEED, 5000) * 3.0)
    assert np.array_equal(laplace(SEED, 5000, scale=0.1), laplace(SEED, 5000) * 0.1)
    assert not np.any(gaussian(SEED, 100, sigma=0.0))


@pytest.mark.parametrize("bad", [0, -3, 2**64 + 1, 2.0, True, None])
def test_uniform_ints_bad_modulus(bad) -> None:
    with pytest.raises((ValueError, TypeError)):
        uniform_ints(SEED, 10, bad)


def test_derive_subseed() -> None:
    a, b = derive_subseed(SEED, "a"), derive_subseed(SEED, "b")
    assert len(a) == SEED_BYTES and a != b and a == derive_subseed(SEED, "a")
    assert derive_subseed(SEED2, "a") != a
    with pytest.raises(ValueError):
        derive_subseed(SEED[:16], "a")
    with pytest.raises(TypeError):
        derive_subseed(SEED, b"a")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("func", ALL_VECTOR_FUNCS)
def test_same_seed_same_output_different_seed_different(func) -> None:
    a, b, c = func(SEED, 4096), func(SEED, 4096), func(SEED2, 4096)
    assert np.array_equal(a, b)
    assert np.mean(a == c) < 0.2  # ints mod 7 collide w.p. 1/7 by chance


def test_bit_identical_in_fresh_subprocess() -> None:
    """(c) the same seed gives bit-identical output in a fresh interpreter."""
    n = 70_001  # more than one internal chunk, not a multiple of it
    main = "print(digest(bytes.fromhex(sys.argv[2]), int(sys.argv[3])))"
    code = f"import sys; sys.path.insert(0, sys.argv[1])\n{_DIGEST_SRC}\n{main}"
    env = dict(os.environ, PYTHONHASHSEED="12345")  # a different hash seed must not matter
    res = subprocess.run(
        [sys.executable, "-c", code, str(REPO), SEED.hex(), str(n)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert res.stdout.strip() == _digest(SEED, n)


def test_pinned_known_answers() -> None:
    """Pinned outputs: exact IEEE arithmetic only, so every machine/numpy version must reproduce them."""
    assert random_bytes(SEED, 16).hex() == PINS["bytes"]
    assert gaussian(SEED, 4).tolist() == PINS["gaussian"]
    assert laplace(SEED, 4).tolist() == PINS["laplace"]
    assert uniform(SEED, 4).tolist() == PINS["uniform"]
    assert uniform_ints(SEED, 4, 10**9 + 7).tolist() == PINS["ints"]
    assert _digest(SEED, 200_000) == PINS["digest"]


PINS: dict = {
    "bytes": "5afed99e15ac24e2cc14ac6e6afb8cec",
    "gaussian": [0.181010666377734, -0.008554974100834278, -2.0385939331932654, 0.8013917476606589],
    "laplace": [-1.4897629495303133, -0.6817618953596813, 1.0718680062985038, 1.3624325630027643],
    "uniform": [0.34086208194792056, 0.5307062670645537, 0.7312928344284646, 0.656501502303067],
    "ints": [181368499, 981122643, 831797046, 827086071],
    "digest": "cd92ba0eadbc15f0eafe7caef0ae96c8de586e328dacf13c45cd5f63ed02a8f3",
}


@pytest.mark.parametrize("func", ALL_VECTOR_FUNCS)
def test_prefix_and_chunk_independence(func, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each element depends only on (seed, position): prefixes agree, the chunk size changes no bit."""
    n = 150_000
    ref = func(SEED, n)
    assert np.array_equal(func(SEED, 1001), ref[:1001])
    for chunk in (997, 4096):
        monkeypatch.setattr(stream, "CHUNK_WORDS", chunk)
        assert np.array_equal(func(SEED, n), ref)


def test_random_bytes_is_documented_aes_ctr_keystream() -> None:
    key = hmac.new(SEED, b"cancelfl/prg/v1/key/bytes", hashlib.sha256).digest()
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    assert random_bytes(SEED, 100_000) == enc.update(bytes(100_000))
    assert random_bytes(SEED, 10) == random_bytes(SEED, 100)[:10]


def test_gaussian_bit_layout_matches_documentation() -> None:
    """Fast-path outputs equal +-u * x_layer of the AES-CTR words as documented.

    Bits 0-7 layer, bit 8 sign, bits 12-63 magnitude; the slow-path proposal helper agrees bit for bit.
    """
    n = 50_000
    key = hmac.new(SEED, b"cancelfl/prg/v1/key/gaussian/main", hashlib.sha256).digest()
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    words = np.frombuffer(enc.update(bytes(8 * n)), dtype="<u8").astype(np.uint64)
    mag, layer, fast = ziggurat._candidates(words, ziggurat._NORMAL)
    u = ((words >> np.uint64(12)).astype(np.float64) * 2.0 + 1.0) * 2.0**-53
    assert np.array_equal(mag, u * ziggurat._NORMAL.width[layer])
    sign = np.where((words >> np.uint64(8)) & np.uint64(1), -1.0, 1.0)
    out = gaussian(SEED, n)
    assert 0.98 < fast.mean() < 0.995
    assert np.array_equal(out[fast], sign[fast] * mag[fast])
    assert np.array_equal(np.sign(out), sign)  # sign survives the slow path too


# --------------------------------------------------------------------------- portable math
def test_portable_log_exp_accuracy() -> None:
    x = np.concatenate([np.geomspace(2.0**-60, 1.0, 20_001), np.linspace(0.5, 2.0, 10_001)])
    ref = np.array([math.log(v) for v in x])
    err = np.abs(portable_math.log(x) - ref) / np.maximum(np.abs(ref), 1e-300)
    assert np.all((err < 4e-16) | (np.abs(portable_math.log(x) - ref) < 4e-16))
    y = np.linspace(-60.0, 0.0, 30_001)
    ref = np.array([math.exp(v) for v in y])
    assert np.max(np.abs(portable_math.exp(y) - ref) / ref) < 4e-16


def test_ziggurat_tables() -> None:
    for zig in (ziggurat._NORMAL, ziggurat._EXPONENTIAL):
        assert zig.closure < 1e-30  # top layer has the same area as all others
        assert np.all(np.diff(zig.width[1:]) < 0) and zig.inner[-1] == 0.0
        assert np.all(zig.inner < zig.width) and np.all(zig.f_span > 0)


def test_stored_ziggurat_tables_are_the_ones_decimal_builds() -> None:
    """protocols/prg/ziggurat_tables.py is exactly what _build_ziggurat computes, bit for bit."""
    stored = Path(ziggurat.__file__).with_name("ziggurat_tables.py").read_text()
    assert stored == ziggurat.tables_module_source()
    for name in ("normal", "exponential"):
        built, loaded = ziggurat._build_ziggurat(name), ziggurat._table(name)
        assert (built.r, built.closure) == (loaded.r, loaded.closure)
        for field in ("width", "inner", "f_lo", "f_span"):
            assert np.array_equal(getattr(built, field).view(np.uint64), getattr(loaded, field).view(np.uint64))


# --------------------------------------------------------------------------- distributions
def _moment_checks(x: np.ndarray, mean: float, var: float, kurt_excess: float) -> None:
    n = x.size
    assert abs(x.mean() - mean) < 5 * math.sqrt(var / n)
    # Var(sample variance) ~ var^2 (2 + excess kurtosis) / n
    assert abs(x.var() - var) < 5 * var * math.sqrt((2 + kurt_excess) / n)


def _equiprobable_chi2(x: np.ndarray, ppf, bins: int) -> float:
    edges = ppf(np.linspace(0, 1, bins + 1)[1:-1])
    counts = np.bincount(np.searchsorted(edges, x), minlength=bins)
    return stats.chisquare(counts).pvalue


def test_gaussian_distribution() -> None:
    """(c) KS + fine-binned chi-square (sensitive to ziggurat wedge errors) + tails."""
    sigma = 2.0
    x = gaussian(SEED, 4_000_000, sigma=sigma)
    assert stats.kstest(x[:1_000_000], "norm", args=(0, sigma)).pvalue > 0.01
    assert stats.kstest(gaussian(SEED2, 200_000), "norm").pvalue > 0.01
    z = x / sigma
    assert _equiprobable_chi2(z, stats.norm.ppf, 1000) > 0.001
    _moment_checks(x, 0.0, sigma**2, 0.0)
    # tail beyond 3 sigma (covers the tail layer, r = 3.654): truncated-normal KS
    t = np.abs(z[np.abs(z) > 3.0])
    p_tail = 2 * stats.norm.sf(3.0)
    assert abs(t.size - z.size * p_tail) < 5 * math.sqrt(z.size * p_tail)
    assert stats.kstest(t, stats.truncnorm(3.0, np.inf).cdf).pvalue > 0.01
    assert np.mean(np.abs(z) > ziggurat._NORMAL.r) > 0  # the tail is actually reached
    assert abs(np.mean(z > 0) - 0.5) < 5 * 0.5 / math.sqrt(z.size)


def test_laplace_distribution() -> None:
    b = 0.5
    x = laplace(SEED, 4_000_000, scale=b)
    assert stats.kstest(x[:1_000_000], "laplace", args=(0, b)).pvalue > 0.01
    assert _equiprobable_chi2(x / b, stats.laplace.ppf, 1000) > 0.001
    _moment_checks(x, 0.0, 2 * b * b, 3.0)
    # beyond the exponential ziggurat's r = 7.697 the excess must be Exp(1) (memoryless)
    r = ziggurat._EXPONENTIAL.r
    t = np.abs(x[np.abs(x) > 5 * b]) / b - 5
    assert stats.kstest(t, "expon").pvalue > 0.01
    assert np.any(np.abs(x) / b > r)


@pytest.mark.parametrize("zig", [ziggurat._NORMAL, ziggurat._EXPONENTIAL], ids=lambda z: z.name)
def test_tail_sampler_exact(zig) -> None:
    """Drive the rare (~1e-4) tail branch directly: 200k items must follow the exact tail law beyond r."""
    n = 200_000
    pos = np.arange(n, dtype=np.uint64)
    mag = np.full(n, zig.r * 1.5)
    tail = ziggurat._resolve_slow(zig, [SEED], np.zeros(n, dtype=np.intp), pos, mag, np.zeros(n, dtype=np.intp))
    assert tail.min() >= zig.r
    ref = stats.truncnorm(zig.r, np.inf) if zig.name == "normal" else stats.expon(zig.r)
    assert stats.kstest(tail, ref.cdf).pvalue > 0.01
    assert abs(tail.mean() - ref.mean()) < 5 * ref.std() / math.sqrt(n)


def test_wedge_sampler_exact() -> None:
    """Fast-path magnitudes completed by resolving the misses (wedges, restarts, tail) are half-normal."""
    n = 400_000
    zig = ziggurat._NORMAL
    words = np.frombuffer(random_bytes(SEED2, 8 * n), dtype="<u8").astype(np.uint64)
    mag, layer, fast = ziggurat._candidates(words, zig)
    slow = np.flatnonzero(~fast)
    resolved = ziggurat._resolve_slow(zig, [SEED], np.zeros(slow.size, dtype=np.intp), slow.astype(np.uint64),
                                  mag[slow], layer[slow])
    full = mag.copy()
    full[slow] = resolved
    assert stats.kstest(full, stats.halfnorm.cdf).pvalue > 0.01
    assert _equiprobable_chi2(full, stats.halfnorm.ppf, 500) > 0.001


def test_uniform_distribution() -> None:
    u = uniform(SEED, 2_000_000)
    assert u.min() >= 0.0 and u.max() < 1.0
    k = u * 2.0**53
    assert np.array_equal(k, np.floor(k))  # exact multiples of 2**-53
    assert abs(np.mean(k % 2) - 0.5) < 5 * 0.5 / math.sqrt(u.size)  # 53rd bit is random
    assert stats.kstest(u[:1_000_000], "uniform").pvalue > 0.01
    assert _equiprobable_chi2(u, lambda q: q, 1000) > 0.001
    _moment_checks(u, 0.5, 1 / 12, -1.2)


@pytest.mark.parametrize("modulus", [7, 1000, 2**20, 2**64 - 59])
def test_uniform_ints_unbiased(modulus: int) -> None:
    n = 400_000
    v = uniform_ints(SEED, n, modulus)
    assert v.dtype == np.uint64 and int(v.max()) < modulus
    if modulus <= 1000:
        counts = np.bincount(v.astype(np.int64), minlength=modulus)
    else:  # 64 (near-)equiprobable bins of the range
        counts = np.bincount((v.astype(np.float64) / modulus * 64).astype(np.int64), minlength=64)
    assert stats.chisquare(counts).pvalue > 0.001


def test_uniform_ints_rejection_removes_bias() -> None:
    """Modulus 3 * 2**62: naive w % m gives P(v < 2**62) = 1/2, unbiased is 1/3.

    A quarter of the words are rejected, exercising the side-stream redraws.
    """
    n = 300_000
    v = uniform_ints(SEED, n, 3 * 2**62)
    frac = np.mean(v < np.uint64(2**62))
    assert abs(frac - 1 / 3) < 5 * math.sqrt(2 / 9 / n)
    assert int(v.max()) < 3 * 2**62


def test_uniform_ints_edge_moduli() -> None:
    assert not np.any(uniform_ints(SEED, 1000, 1))
    raw = uniform_ints(SEED, 1000, 2**64)
    assert raw.dtype == np.uint64 and int(raw.max()) > 2**63  # full 64-bit words
    top = uniform_ints(SEED, 1000, 2**8)
    assert int(top.max()) < 256


def test_streams_are_independent() -> None:
    """Different distributions from the same seed use different keys (no reuse)."""
    n = 200_000
    g, lap, u = gaussian(SEED, n), laplace(SEED, n), uniform(SEED, n)
    for a, b in ((g, lap), (g, u), (lap, u)):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(n)
    # and adjacent seeds give uncorrelated gaussians
    assert abs(np.corrcoef(g, gaussian(SEED2, n))[0, 1]) < 5 / math.sqrt(n)


@pytest.mark.parametrize("size", [0, 1, 1000, 70_000])
def test_gaussian_many_is_bit_identical_to_separate_streams(size) -> None:
    """Resolving the slow paths of several streams together must not change a single bit."""
    seeds = [hashlib.sha256(f"many-{i}".encode()).digest() for i in range(12)]
    together = list(prg.gaussian_many(seeds, size, 0.7))
    assert len(together) == len(seeds)
    for seed, got in zip(seeds, together, strict=True):
        assert np.array_equal(got.view(np.uint64), gaussian(seed, size, 0.7).view(np.uint64))


def test_gaussian_many_per_seed_sizes_and_sigmas_are_bit_identical_to_separate_streams(monkeypatch) -> None:
    """One std and one length per seed (a NISS client's streams, a model's layers) change no bit either."""
    monkeypatch.setattr(ziggurat, "_MANY_MAX_ELEMENTS", 5000)  # groups: [0, 1], [70_000], [64, 3000]
    seeds = [hashlib.sha256(f"sig-{i}".encode()).digest() for i in range(5)]
    sigmas = [1.0, 0.0, 2.5, 1e-3, 7.25]
    for seed, sigma, got in zip(seeds, sigmas, prg.gaussian_many(seeds, 3000, sigmas), strict=True):
        assert np.array_equal(got.view(np.uint64), gaussian(seed, 3000, sigma).view(np.uint64))
    sizes = [0, 1, 70_000, 64, 3000]  # one length per seed (the layers of a model), the long one alone in its group
    for seed, k, sigma, got in zip(seeds, sizes, sigmas, prg.gaussian_many(seeds, sizes, sigmas), strict=True):
        assert np.array_equal(got.view(np.uint64), gaussian(seed, k, sigma).view(np.uint64))
    with pytest.raises(ValueError, match="sigmas"):
        list(prg.gaussian_many(seeds, 10, sigmas[:2]))
    with pytest.raises(ValueError, match="sizes"):
        list(prg.gaussian_many(seeds, sizes[:4], 1.0))
    with pytest.raises(ValueError, match="sigma"):
        list(prg.gaussian_many(seeds[:1], 10, [-1.0]))


def test_gaussian_many_groups_bound_memory(monkeypatch) -> None:
    monkeypatch.setattr(ziggurat, "_MANY_MAX_ELEMENTS", 2500)  # forces groups of 2 streams of 1000
    seeds = [hashlib.sha256(f"grp-{i}".encode()).digest() for i in range(5)]
    for seed, got in zip(seeds, prg.gaussian_many(seeds, 1000), strict=True):
        assert np.array_equal(got, gaussian(seed, 1000))
