"""Deterministic, cryptographically secure noise engine (PRG) for cancelling noise.

What
----
Every pairwise / cancelling noise vector in cancelfl is expanded from a 32-byte seed
by this module: ``gaussian``, ``laplace``, ``uniform``, ``uniform_ints`` and
``random_bytes`` return the *same bits* for the same seed on every machine, process
and numpy version, so the two ends of a pair generate identical vectors and their
``+v`` / ``-v`` contributions cancel exactly on aggregation.

Generator and security rationale
--------------------------------
* Keystream: AES-256 in counter mode (``cryptography``/OpenSSL, AES-NI). AES-CTR under a
  uniformly random key is a standard PRF-based stream generator (NIST SP 800-90A's
  CTR_DRBG is built on it): without the seed the output is computationally
  indistinguishable from uniform, so an adversary (server, other clients) that does not
  hold the pair seed cannot predict -- and hence cannot subtract -- the noise.
  Statistical PRNGs are NOT acceptable here: numpy's PCG64 / MT19937 state can be
  recovered from a few outputs, and Flower's SecAgg+ (``flwr.common.secure_aggregation.
  secaggplus_utils.pseudo_rand_gen``) XOR-folds its seed into a 32-bit MT19937
  ``np.random.RandomState`` seed, i.e. at most 2**32 possible masks, which an attacker
  can brute-force. We never go through numpy's random module.
* Key separation: the AES key of every (seed, distribution) stream is
  ``HMAC-SHA256(seed, "cancelfl/prg/v1/key/<label>")`` so ``gaussian(s)`` and
  ``uniform(s)`` are independent streams; the counter starts at 0 and never wraps
  (2**128 blocks), so no keystream block is ever reused under one key.
* Random access side stream: the rare samples that need extra randomness (ziggurat
  wedge/tail, rejected integers) draw it from ``AES-ECB(side_key, pos || step)``, i.e.
  counter-mode blocks addressed by the *output position*. Every output element is
  therefore a pure function of (seed, position): results are independent of the
  internal chunk size and ``gaussian(s, n) == gaussian(s, m)[:n]`` for n <= m.

Transforms (bit-exact everywhere)
---------------------------------
* ``uniform``: 53-bit uniforms k / 2**53, built with the IEEE exponent trick (exact,
  and much faster than numpy's int64 -> float64 cast). ``symmetric_uniform`` is exactly
  2u - 1 = (k - 2**52) / 2**52; ``symmetric_uniform_sum`` adds/subtracts many such streams
  as integers (exact) and rounds once, the pairwise engine's fast path for uniform noise.
* ``gaussian``: 256-layer ziggurat (Marsaglia & Tsang 2000, numpy/Doornik layout),
  vectorised: per 64-bit word, bits 0-7 pick the layer, bit 8 the sign, bits 12-63 a
  52-bit magnitude uniform on the symmetric odd grid (2m+1)/2**53 (bits 9-11 unused;
  the grid never yields 0 and is exactly symmetric). About 98.8 % of
  words are accepted on the arithmetic fast path; the rest (wedges, tail via
  Marsaglia's tail method) are resolved vectorised from the side stream.
  ``laplace`` uses the same machinery with the exponential ziggurat and a random sign.
* Portability: the fast path uses only exactly-rounded IEEE operations (shift/or,
  subtract, multiply, compare). Tables are computed at import with ``decimal``
  (correctly rounded exp/ln/sqrt) from constants solved offline to 40 digits. The slow
  path uses ``_exp``/``_log`` below, written with + - * / frexp/ldexp/rint only, instead
  of numpy's libm/SIMD transcendental functions, whose last bit differs between CPUs
  (AVX-512 vs scalar glibc vs macOS). Hence outputs are bit-identical across machines.
  Scaling by ``sigma``/``scale`` is one correctly rounded IEEE multiplication.

Speed (single thread, ``tests/benchmarks/bench_protocol_core.py``): ~170-180 M normals/s
on one AMD EPYC core (AVX-512, shared machine), i.e. 3.5x the 50 M/s target and faster
than numpy's own PCG64 ziggurat (~110 M/s there). Work proceeds in chunks of 64 Ki words
(512 KiB, L2-resident scratch reused per thread), so extra memory is O(chunk) plus ~1.5 %
of the output for the slow-path bookkeeping. Per-call overhead: ~20 us (key setup) plus
~0.1-0.2 ms of vectorised slow-path steps once a vector has >= ~1000 elements.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = [
    "SEED_BYTES",
    "derive_subseed",
    "random_bytes",
    "uniform",
    "symmetric_uniform",
    "symmetric_uniform_sum",
    "gaussian",
    "gaussian_many",
    "laplace",
    "uniform_ints",
]

SEED_BYTES = 32
_DOMAIN = b"cancelfl/prg/v1"
_CHUNK_WORDS = 1 << 16  # 512 KiB of keystream per chunk: fits L2, bounds scratch memory

_U64 = np.dtype("<u8")  # the keystream is read as little-endian words on every platform
_EXP_ONE = np.uint64(0x3FF0000000000000)  # bit pattern of 1.0
_SIGN = np.uint64(1 << 63)
_TWO_M53 = 2.0**-53
_ODD_OFFSET = 1.0 - 2.0**-53  # y in [1,2) minus this = (2m+1) * 2**-53, exactly


# --------------------------------------------------------------------------- validation
def _check_seed(seed: bytes) -> bytes:
    if not isinstance(seed, (bytes, bytearray, memoryview)):
        raise TypeError(f"seed must be bytes, got {type(seed).__name__}")
    seed = bytes(seed)
    if len(seed) != SEED_BYTES:
        raise ValueError(f"seed must be exactly {SEED_BYTES} bytes, got {len(seed)}")
    return seed


def _check_size(size: int) -> int:
    try:
        n = operator.index(size)
    except TypeError:
        raise TypeError(f"size must be an integer, got {type(size).__name__}") from None
    if n < 0:
        raise ValueError(f"size must be >= 0, got {n}")
    return n


def _check_scale(value: float, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


# --------------------------------------------------------------------------- keystreams
def _key(seed: bytes, label: bytes) -> bytes:
    """Per-(seed, label) AES-256 key; HMAC-SHA256 is a PRF keyed by the secret seed."""
    return hmac.new(seed, _DOMAIN + b"/key/" + label, hashlib.sha256).digest()


def derive_subseed(seed: bytes, label: str) -> bytes:
    """Derive an independent 32-byte seed for ``label`` from ``seed``.

    HMAC-SHA256(seed, domain || label): distinct labels give computationally
    independent seeds, so one round seed can drive several streams safely.
    """
    seed = _check_seed(seed)
    if not isinstance(label, str):
        raise TypeError("label must be a str")
    return hmac.new(seed, _DOMAIN + b"/subseed/" + label.encode("utf-8"), hashlib.sha256).digest()


class _Scratch(threading.local):
    """Per-thread reusable chunk buffers.

    Avoids re-faulting ~2 MiB of fresh pages per call, which otherwise dominates for vectors of ~1e5 elements.
    """

    def __init__(self) -> None:
        self.buf = bytearray(8 * _CHUNK_WORDS + 16)  # update_into: len(data) + 15 bytes
        self.a = np.empty(_CHUNK_WORDS, dtype=np.uint64)
        self.b = np.empty(_CHUNK_WORDS, dtype=np.uint64)
        self.mask = np.empty(_CHUNK_WORDS, dtype=bool)
        self.layer = np.empty(_CHUNK_WORDS, dtype=np.intp)
        self.gather = np.empty(_CHUNK_WORDS, dtype=np.float64)


_ZEROS = bytes(8 * _CHUNK_WORDS)
_scratch = _Scratch()


def _word_chunks(key: bytes, n_words: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(start, words, raw_bytes)`` of the AES-256-CTR keystream, chunk by chunk.

    The arrays are views of a reused per-thread buffer: consume them before the next
    iteration (all callers in this module do; none nests two streams).
    """
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    buf = _scratch.buf
    zeros = memoryview(_ZEROS)
    start = 0
    while start < n_words:
        m = min(_CHUNK_WORDS, n_words - start)
        enc.update_into(zeros[: 8 * m], buf)
        raw = np.frombuffer(buf, dtype=np.uint8, count=8 * m)
        yield start, np.frombuffer(buf, dtype=_U64, count=m), raw
        start += m


def _side_words(key: bytes, positions: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Two fresh 64-bit words per position: AES-ECB(key, pos || step).

    This is counter mode addressed by (output position, attempt); all input blocks are distinct.
    """
    blocks = np.empty((positions.size, 2), dtype=_U64)
    blocks[:, 0] = positions
    blocks[:, 1] = step
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    out = np.frombuffer(enc.update(blocks.tobytes()) + enc.finalize(), dtype=_U64).reshape(-1, 2)
    out = out.astype(np.uint64)
    return out[:, 0], out[:, 1]


def random_bytes(seed: bytes, n: int) -> bytes:
    """``n`` bytes of the AES-256-CTR keystream for ``seed`` (label "bytes")."""
    seed = _check_seed(seed)
    n = _check_size(n)
    enc = Cipher(algorithms.AES(_key(seed, b"bytes")), modes.CTR(bytes(16))).encryptor()
    return enc.update(bytes(n)) + enc.finalize()


# --------------------------------------------------------------------------- portable math
_LN2_HI = 6.93147180369123816490e-01  # fdlibm split: e * _LN2_HI is exact for |e| < 2**11
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.4426950408889634
_SQRT_HALF = 0.7071067811865476
_LOG_COEF = [2.0 / (2 * k + 1) for k in range(11, -1, -1)]  # 2*atanh series, z**11 .. 1
_EXP_COEF = [1.0 / math.factorial(k) for k in range(13, -1, -1)]  # Taylor, r**13 .. 1


def _log(x: np.ndarray) -> np.ndarray:
    """Natural log of positive normal floats using only exactly-rounded operations.

    log x = e ln2 + 2 atanh(s), s = (m-1)/(m+1), m in [sqrt(1/2), sqrt(2)) so |s| < 0.172;
    the series to s**23 is below 2**-60 relative. Accuracy ~1-2 ulp, bit-reproducible.
    """
    m, e = np.frexp(x)
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)
    ef = (e - low).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = np.full_like(z, _LOG_COEF[0])
    for c in _LOG_COEF[1:]:
        p = p * z + c
    return ef * _LN2_HI + (ef * _LN2_LO + s * p)


def _exp(x: np.ndarray) -> np.ndarray:
    """exp(x) for moderate x (|x| < 700) using only exactly-rounded operations.

    x = k ln2 + r with |r| <= ln2/2 (Cody-Waite), Taylor to r**13 (error < 2**-57).
    """
    k = np.rint(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = np.full_like(r, _EXP_COEF[0])
    for c in _EXP_COEF[1:]:
        p = p * r + c
    return np.ldexp(p, k.astype(np.int32))


def _unit_open(words: np.ndarray) -> np.ndarray:
    """Uniform on (0, 1]: ((w >> 11) + 1) / 2**53 (exact; small arrays only)."""
    return ((words >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * _TWO_M53


def _unit(words: np.ndarray) -> np.ndarray:
    """Uniform on [0, 1): (w >> 11) / 2**53 (exact; small arrays only)."""
    return (words >> np.uint64(11)).astype(np.float64) * _TWO_M53


# --------------------------------------------------------------------------- ziggurat
@dataclass(frozen=True)
class _Ziggurat:
    """Tables of a 256-layer symmetric ziggurat for density f(|x|) on the real line.

    Layer i (area v each) spans x in [0, x_i], y in [f(x_i), f(x_{i+1})]; layer 0 is the
    base rectangle [0, r] plus the tail, with pseudo-width x_0 = v / f(r); x_256 = 0.
    """

    name: str
    r: float
    width: np.ndarray  # x_i                  (pseudo-width for i = 0)
    inner: np.ndarray  # x_{i+1}: |x| < inner[i] is inside the curve (fast accept)
    f_lo: np.ndarray  # f(x_i)
    f_span: np.ndarray  # f(x_{i+1}) - f(x_i)
    density: Callable[[np.ndarray], np.ndarray]  # unnormalised f(|x|), portable
    closure: float  # |area(top layer) - v| / v, a table self-check (tests)


def _build_ziggurat(name: str) -> _Ziggurat:
    # r and v = r f(r) + tail(r) solved offline with mpmath (60 digits) so that the
    # recursion x_{i+1} = f^-1(f(x_i) + v/x_i) closes with a top layer of area exactly v.
    with localcontext() as ctx:
        ctx.prec = 50
        if name == "normal":
            r = Decimal("3.654152885361008771645429720399515762975")
            v = Decimal("0.004928673233974655347361775402336028069135")

            def f(x: Decimal) -> Decimal:
                return (-(x * x) / 2).exp()

            def finv(y: Decimal) -> Decimal:
                return (-2 * y.ln()).sqrt()
        else:
            r = Decimal("7.697117470131049714044628048015215499114")
            v = Decimal("0.003949659822581557219977571956814861091913")

            def f(x: Decimal) -> Decimal:
                return (-x).exp()

            def finv(y: Decimal) -> Decimal:
                return -y.ln()

        xs = [v / f(r), r]
        for _ in range(254):
            xs.append(finv(f(xs[-1]) + v / xs[-1]))
        closure = abs(xs[255] * (1 - f(xs[255])) - v) / v
        xs.append(Decimal(0))
        fx = [f(x) for x in xs]
        width = np.array([float(x) for x in xs[:256]])
        inner = np.array([float(x) for x in xs[1:]])
        f_lo = np.array([float(y) for y in fx[:256]])
        f_span = np.array([float(fx[i + 1] - fx[i]) for i in range(256)])
    if name == "normal":

        def density(a: np.ndarray) -> np.ndarray:
            return _exp(-0.5 * (a * a))
    else:

        def density(a: np.ndarray) -> np.ndarray:
            return _exp(-a)

    return _Ziggurat(name, float(r), width, inner, f_lo, f_span, density, float(closure))


_NORMAL = _build_ziggurat("normal")
_EXPONENTIAL = _build_ziggurat("exponential")


def _candidates(words: np.ndarray, zig: _Ziggurat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ziggurat proposal for arbitrary words (used on the small slow-path arrays).

    Returns (|x|, layer, fast-accept mask); must match the chunk fast path bit for bit.
    """
    layer = (words & np.uint64(0xFF)).astype(np.intp)
    mag = ((words >> np.uint64(12)) | _EXP_ONE).view(np.float64) - _ODD_OFFSET
    mag = mag * zig.width[layer]
    return mag, layer, mag < zig.inner[layer]


def _multi_side_words(keys: Sequence[bytes], owner: np.ndarray, positions: np.ndarray,
                      step: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_side_words` for items of several streams: item i uses ``keys[owner[i]]``."""
    if len(keys) == 1:
        return _side_words(keys[0], positions, step)
    w1 = np.empty(positions.size, dtype=np.uint64)
    w2 = np.empty(positions.size, dtype=np.uint64)
    order = np.argsort(owner, kind="stable")
    sorted_owner = owner[order]
    present = np.flatnonzero(np.diff(sorted_owner, prepend=-1))
    ends = np.append(present[1:], sorted_owner.size)
    for start, end in zip(present, ends, strict=True):
        sel = order[start:end]
        w1[sel], w2[sel] = _side_words(keys[int(sorted_owner[start])], positions[sel], step)
    return w1, w2


def _resolve_slow(zig: _Ziggurat, side_keys: Sequence[bytes], owner: np.ndarray, pos: np.ndarray, mag: np.ndarray,
                  layer: np.ndarray) -> np.ndarray:
    """Finish the proposals that missed the fast path; returns their |x|.

    Items may come from several streams (item i belongs to stream ``owner[i]`` with
    side key ``side_keys[owner[i]]``): every item's state machine depends only on its
    own stream's key and position, so resolving many streams together (one pass of
    the vectorised math instead of one per stream) gives bit-identical results.

    Per-item state machine, run in lockstep; step t of item p uses side block (p, t):
      * wedge (layer > 0): accept if f_lo + U*f_span < f(|x|); otherwise the draw is
        discarded and a fresh ziggurat proposal is made from the block's 2nd word
        (a restart, exactly as in the sequential algorithm);
      * tail (layer 0): normal -> Marsaglia's tail method, repeated until accepted
        (a tail rejection must NOT restart the ziggurat, that would bias the tail);
        exponential -> r - log(U) (memoryless, always accepted).
    Accepted draws are exactly f-distributed, so the result is independent of how many
    steps an item needs. The sign (word bit 8) never enters an accept/reject decision,
    so an item keeps its original sign across restarts.
    """
    result = np.empty(mag.size)
    todo = np.arange(mag.size)
    in_tail = layer == 0
    step = 0
    while todo.size:
        w1, w2 = _multi_side_words(side_keys, owner[todo], pos[todo], step)
        done = np.zeros(todo.size, dtype=bool)
        # tail items
        t = np.flatnonzero(in_tail[todo])
        if t.size:
            u1 = _unit_open(w1[t])
            if zig.name == "normal":
                a = -_log(u1) / zig.r
                b = -_log(_unit_open(w2[t]))
                ok = (b + b) > a * a
                result[todo[t[ok]]] = zig.r + a[ok]
                done[t[ok]] = True
            else:
                result[todo[t]] = zig.r - _log(u1)
                done[t] = True
        # wedge items
        g = np.flatnonzero(~in_tail[todo])
        if g.size:
            items = todo[g]
            lay = layer[items]
            y = zig.f_lo[lay] + _unit(w1[g]) * zig.f_span[lay]
            ok = y < zig.density(mag[items])
            result[items[ok]] = mag[items[ok]]
            done[g[ok]] = True
            # restart the rejected ones with a fresh proposal from the second word
            rej = g[~ok]
            if rej.size:
                nmag, nlay, fast = _candidates(w2[rej], zig)
                ritems = todo[rej]
                result[ritems[fast]] = nmag[fast]
                done[rej[fast]] = True
                mag[ritems] = nmag
                layer[ritems] = nlay
                in_tail[ritems] = nlay == 0
        todo = todo[~done]
        step += 1
    return result


def _ziggurat_fast(seed: bytes, size: int, zig: _Ziggurat, label: bytes
                   ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Fast path of the symmetric ziggurat for one stream.

    Returns the output array (fast-path values set) and the slow items' positions,
    magnitudes, layers and sign bits (lists of chunks) for :func:`_resolve_slow`.
    """
    out = np.empty(size, dtype=np.float64)
    slow_pos: list[np.ndarray] = []
    slow_mag: list[np.ndarray] = []
    slow_layer: list[np.ndarray] = []
    slow_sign: list[np.ndarray] = []
    if size == 0:
        return out, slow_pos, slow_mag, slow_layer, slow_sign
    out_bits = out.view(np.uint64)
    sc = _scratch
    t_val = sc.a.view(np.float64)
    for start, words, raw in _word_chunks(_key(seed, label + b"/main"), size):
        m = words.size
        tb, tv, sg, ms = sc.a[:m], t_val[:m], sc.b[:m], sc.mask[:m]
        layer, g = sc.layer[:m], sc.gather[:m]
        np.copyto(layer, raw[::8])  # low byte of each little-endian word: bits 0-7
        np.right_shift(words, 12, out=tb)  # 52-bit magnitude ...
        np.bitwise_or(tb, _EXP_ONE, out=tb)  # ... as a float in [1, 2)
        np.subtract(tv, _ODD_OFFSET, out=tv)  # u = (2m+1)/2**53 in (0, 1), exact
        np.take(zig.width, layer, out=g)
        np.multiply(tv, g, out=tv)  # |x| = u * x_i
        np.take(zig.inner, layer, out=g)
        np.greater_equal(tv, g, out=ms)  # misses the fast path (|x| >= x_{i+1})?
        np.left_shift(words, 55, out=sg)  # bit 8 -> sign bit
        np.bitwise_and(sg, _SIGN, out=sg)
        np.bitwise_or(tb, sg, out=out_bits[start : start + m])
        slow = np.flatnonzero(ms)
        if slow.size:
            slow_pos.append(slow + start)
            slow_mag.append(tv[slow])
            slow_layer.append(layer[slow])
            slow_sign.append(sg[slow])
    return out, slow_pos, slow_mag, slow_layer, slow_sign


def _ziggurat_many(seeds: Sequence[bytes], size: int, zig: _Ziggurat, label: bytes) -> list[np.ndarray]:
    """Symmetric ziggurat samples (unit scale) for each seed, slow paths resolved together."""
    outs, keys, owner, pos, mag, layer, sign = [], [], [], [], [], [], []
    for idx, seed in enumerate(seeds):
        out, p, m, lay, sg = _ziggurat_fast(seed, size, zig, label)
        outs.append(out)
        keys.append(_key(seed, label + b"/side"))
        if p:
            p = np.concatenate(p)
            owner.append(np.full(p.size, idx, dtype=np.intp))
            pos.append(p)
            mag.append(np.concatenate(m))
            layer.append(np.concatenate(lay))
            sign.append(np.concatenate(sg))
    if pos:
        own = np.concatenate(owner)
        all_pos = np.concatenate(pos)
        resolved = _resolve_slow(zig, keys, own, all_pos, np.concatenate(mag), np.concatenate(layer))
        bits = resolved.view(np.uint64) | np.concatenate(sign)
        start = 0
        for p in pos:  # items are grouped by stream, in stream order
            stream = outs[int(own[start])]
            stream.view(np.uint64)[p] = bits[start : start + p.size]
            start += p.size
    return outs


def _ziggurat(seed: bytes, size: int, zig: _Ziggurat, label: bytes) -> np.ndarray:
    """Symmetric ziggurat samples (unit scale) for ``seed`` into a new float64 array."""
    return _ziggurat_many([seed], size, zig, label)[0]


#: Streams of :func:`gaussian_many` resolved together are capped at this many samples (32 MiB of float64).
_MANY_MAX_ELEMENTS = 1 << 22


# --------------------------------------------------------------------------- public API
def uniform(seed: bytes, size: int) -> np.ndarray:
    """``size`` float64 uniforms on [0, 1), each k / 2**53 with k uniform (53 bits)."""
    seed = _check_seed(seed)
    size = _check_size(size)
    out = np.empty(size, dtype=np.float64)
    if size == 0:
        return out
    half = _scratch.a
    for start, words, _ in _word_chunks(_key(seed, b"uniform"), size):
        m = words.size
        seg = out[start : start + m]
        bits = seg.view(np.uint64)
        h = half[:m]
        np.right_shift(words, 12, out=bits)  # bits 12-63: high 52 bits of k
        np.bitwise_or(bits, _EXP_ONE, out=bits)
        np.subtract(seg, 1.0, out=seg)  # j / 2**52, exact
        # lowest bit of k (word bit 11) adds 2**-53: the float bit pattern of 2**-53 is
        # 0x3CA0..., selected by an all-ones/all-zeros mask. The sum is exact.
        np.right_shift(words, 11, out=h)
        np.bitwise_and(h, np.uint64(1), out=h)
        np.negative(h, out=h)
        np.bitwise_and(h, np.uint64(0x3CA0000000000000), out=h)
        np.add(seg, h.view(np.float64), out=seg)
    return out


def symmetric_uniform(seed: bytes, size: int) -> np.ndarray:
    """``size`` float64 uniforms on [-1, 1): (k - 2**52) / 2**52, k the 53-bit integer of :func:`uniform`.

    Exactly ``2 * uniform(seed, size) - 1`` (same stream, no rounding).  Pairwise sums of
    these streams have an exact integer form: see :func:`symmetric_uniform_sum`.
    """
    out = uniform(seed, size)
    out *= 2.0
    out -= 1.0  # exact: 2k/2**53 - 1 = (k - 2**52) / 2**52 is on the 2**-52 grid in [-1, 1)
    return out


#: Streams summed exactly in one uint64 accumulator: |sum of (k - 2**52)| < 2047 * 2**52 < 2**63.
_EXACT_SUM_STREAMS = 2047


def symmetric_uniform_sum(plus: Sequence[bytes], minus: Sequence[bytes], size: int) -> np.ndarray:
    """``sum(symmetric_uniform(s) for s in plus) - sum(symmetric_uniform(s) for s in minus)``, exactly.

    The sum is formed on the integers k - 2**52 (wrap-around uint64 arithmetic, exact while
    fewer than 2048 streams are summed; more are summed in groups) and rounded to float64
    once per group.  So when every stream appears once in some ``plus`` and once in some
    ``minus`` (pairwise cancelling noise), the parties' integer sums add up to exactly 0
    and the float results cancel up to one rounding each.  It is also ~2x faster than
    summing float vectors: per stream only a shift and an integer add.
    """
    plus = [_check_seed(s) for s in plus]
    minus = [_check_seed(s) for s in minus]
    size = _check_size(size)
    out = np.zeros(size, dtype=np.float64)
    signed = [(s, True) for s in plus] + [(s, False) for s in minus]
    acc = np.empty(size, dtype=np.uint64)
    half = _scratch.a
    for first in range(0, len(signed), _EXACT_SUM_STREAMS):
        group = signed[first : first + _EXACT_SUM_STREAMS]
        acc.fill(0)
        for seed, positive in group:
            op = np.add if positive else np.subtract
            for start, words, _ in _word_chunks(_key(seed, b"uniform"), size):
                m = words.size
                h = half[:m]
                np.right_shift(words, 11, out=h)  # k, 53 bits
                seg = acc[start : start + m]
                op(seg, h, out=seg)
        offset = (sum(1 if positive else -1 for _, positive in group) << 52) % (1 << 64)
        acc -= np.uint64(offset)  # centre every k at 2**52 (mod 2**64)
        out += acc.view(np.int64).astype(np.float64) * 2.0**-52  # exact integer -> one rounding
    return out


def gaussian(seed: bytes, size: int, sigma: float = 1.0) -> np.ndarray:
    """``size`` i.i.d. N(0, sigma**2) float64 samples expanded from ``seed``."""
    seed = _check_seed(seed)
    size = _check_size(size)
    sigma = _check_scale(sigma, "sigma")
    out = _ziggurat(seed, size, _NORMAL, b"gaussian")
    if sigma != 1.0:
        out *= sigma
    return out


def gaussian_many(seeds: Sequence[bytes], size: int, sigma: float = 1.0) -> Iterator[np.ndarray]:
    """``gaussian(seed, size, sigma)`` for each seed, in order, bit-identical to separate calls.

    Faster for many short streams (e.g. the pairwise noise of a client with many
    peers): the ziggurat's rejection slow path is resolved for a group of streams
    in one vectorised pass instead of once per stream.  Groups hold at most
    ~4M samples, so memory stays bounded for large models.
    """
    seeds = [_check_seed(seed) for seed in seeds]
    size = _check_size(size)
    sigma = _check_scale(sigma, "sigma")
    group = max(1, _MANY_MAX_ELEMENTS // max(size, 1))
    for first in range(0, len(seeds), group):
        for out in _ziggurat_many(seeds[first : first + group], size, _NORMAL, b"gaussian"):
            if sigma != 1.0:
                out *= sigma
            yield out


def laplace(seed: bytes, size: int, scale: float = 1.0) -> np.ndarray:
    """``size`` i.i.d. Laplace(0, scale) float64 samples (variance 2 scale**2)."""
    seed = _check_seed(seed)
    size = _check_size(size)
    scale = _check_scale(scale, "scale")
    out = _ziggurat(seed, size, _EXPONENTIAL, b"laplace")
    if scale != 1.0:
        out *= scale
    return out


def uniform_ints(seed: bytes, size: int, modulus: int) -> np.ndarray:
    """``size`` unbiased integers in [0, modulus) as uint64; 1 <= modulus <= 2**64.

    Power-of-two moduli take the top bits of each word (2**64: raw words). Otherwise a
    word w is accepted iff w < 2**64 - (2**64 mod modulus) and mapped to w % modulus;
    rejected positions are redrawn from the position-addressed side stream, so the
    output is exactly uniform and still a pure function of (seed, position).
    """
    seed = _check_seed(seed)
    size = _check_size(size)
    if isinstance(modulus, bool):
        raise TypeError("modulus must be an int")
    try:
        modulus = operator.index(modulus)
    except TypeError:
        raise TypeError(f"modulus must be an int, got {type(modulus).__name__}") from None
    if not 1 <= modulus <= 2**64:
        raise ValueError(f"modulus must be in [1, 2**64], got {modulus}")
    out = np.empty(size, dtype=np.uint64)
    if size == 0:
        return out
    label = b"ints/" + str(modulus).encode()
    pow2 = modulus & (modulus - 1) == 0
    if pow2:
        shift = np.uint64(65 - modulus.bit_length())  # keep the top log2(modulus) bits
        for start, words, _ in _word_chunks(_key(seed, label), size):
            seg = out[start : start + words.size]
            if modulus == 2**64:
                seg[...] = words
            elif modulus == 1:
                seg[...] = 0
            else:
                np.right_shift(words, shift, out=seg)
        return out
    mod = np.uint64(modulus)
    limit = np.uint64(2**64 - (2**64 % modulus))  # largest multiple of modulus <= 2**64
    rejected = []
    for start, words, _ in _word_chunks(_key(seed, label), size):
        seg = out[start : start + words.size]
        np.remainder(words, mod, out=seg)
        bad = np.flatnonzero(words >= limit)
        if bad.size:
            rejected.append(bad + start)
    if rejected:
        side = _key(seed, label + b"/side")
        todo = np.concatenate(rejected)
        step = 0
        while todo.size:
            w1, w2 = _side_words(side, todo, step)
            ok1 = w1 < limit
            ok2 = ~ok1 & (w2 < limit)
            out[todo[ok1]] = w1[ok1] % mod
            out[todo[ok2]] = w2[ok2] % mod
            todo = todo[~(ok1 | ok2)]
            step += 1
    return out
