"""Gaussian and Laplace streams of the PRG: a vectorised, bit-exact 256-layer ziggurat.

Marsaglia & Tsang (2000), numpy/Doornik layout.  Per 64-bit keystream word, bits 0-7 pick
the layer, bit 8 the sign, bits 12-63 a 52-bit magnitude uniform on the symmetric odd grid
(2m+1)/2**53 (bits 9-11 unused; the grid never yields 0 and is exactly symmetric).  About
98.8 % of words are accepted on the arithmetic fast path; the rest (wedges, tail via
Marsaglia's tail method) are resolved vectorised from the side stream
(:func:`_resolve_slow`).  ``laplace`` uses the same machinery with the exponential ziggurat
and a random sign.  Tables are computed at import with ``decimal`` (correctly rounded
exp/ln/sqrt) from constants solved offline to 40 digits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext

import numpy as np

from protocols.prg.portable_math import exp, log, unit, unit_open
from protocols.prg.stream import EXP_ONE, check_scale, check_seed, check_size, scratch, side_words, stream_key, word_chunks

_SIGN = np.uint64(1 << 63)
_ODD_OFFSET = 1.0 - 2.0**-53  # y in [1,2) minus this = (2m+1) * 2**-53, exactly


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
            return exp(-0.5 * (a * a))
    else:

        def density(a: np.ndarray) -> np.ndarray:
            return exp(-a)

    return _Ziggurat(name, float(r), width, inner, f_lo, f_span, density, float(closure))


@functools.cache
def _table(name: str) -> _Ziggurat:
    """The ziggurat tables of ``name`` ("normal" or "exponential"), built on first use (tens of ms) and kept."""
    return _build_ziggurat(name)


def __getattr__(name: str) -> _Ziggurat:
    """``_NORMAL`` and ``_EXPONENTIAL``: the two tables (built on first use, not when the module is imported)."""
    tables = {"_NORMAL": "normal", "_EXPONENTIAL": "exponential"}
    if name in tables:
        return _table(tables[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _candidates(words: np.ndarray, zig: _Ziggurat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ziggurat proposal for arbitrary words (used on the small slow-path arrays).

    Returns (|x|, layer, fast-accept mask); must match the chunk fast path bit for bit.
    """
    layer = (words & np.uint64(0xFF)).astype(np.intp)
    mag = ((words >> np.uint64(12)) | EXP_ONE).view(np.float64) - _ODD_OFFSET
    mag = mag * zig.width[layer]
    return mag, layer, mag < zig.inner[layer]


def _multi_side_words(keys: Sequence[bytes], owner: np.ndarray, positions: np.ndarray,
                      step: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`side_words` for items of several streams: item i uses ``keys[owner[i]]``."""
    if len(keys) == 1:
        return side_words(keys[0], positions, step)
    w1 = np.empty(positions.size, dtype=np.uint64)
    w2 = np.empty(positions.size, dtype=np.uint64)
    order = np.argsort(owner, kind="stable")
    sorted_owner = owner[order]
    present = np.flatnonzero(np.diff(sorted_owner, prepend=-1))
    ends = np.append(present[1:], sorted_owner.size)
    for start, end in zip(present, ends, strict=True):
        sel = order[start:end]
        w1[sel], w2[sel] = side_words(keys[int(sorted_owner[start])], positions[sel], step)
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
            u1 = unit_open(w1[t])
            if zig.name == "normal":
                a = -log(u1) / zig.r
                b = -log(unit_open(w2[t]))
                ok = (b + b) > a * a
                result[todo[t[ok]]] = zig.r + a[ok]
                done[t[ok]] = True
            else:
                result[todo[t]] = zig.r - log(u1)
                done[t] = True
        # wedge items
        g = np.flatnonzero(~in_tail[todo])
        if g.size:
            items = todo[g]
            lay = layer[items]
            y = zig.f_lo[lay] + unit(w1[g]) * zig.f_span[lay]
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
    sc = scratch
    t_val = sc.a.view(np.float64)
    for start, words, raw in word_chunks(stream_key(seed, label + b"/main"), size):
        m = words.size
        tb, tv, sg, ms = sc.a[:m], t_val[:m], sc.b[:m], sc.mask[:m]
        layer, g = sc.layer[:m], sc.gather[:m]
        np.copyto(layer, raw[::8])  # low byte of each little-endian word: bits 0-7
        np.right_shift(words, 12, out=tb)  # 52-bit magnitude ...
        np.bitwise_or(tb, EXP_ONE, out=tb)  # ... as a float in [1, 2)
        np.subtract(tv, _ODD_OFFSET, out=tv)  # u = (2m+1)/2**53 in (0, 1), exact
        # layer < 256 = the tables' length: mode="wrap" never wraps, it only skips the bounds-checked buffered gather
        np.take(zig.width, layer, out=g, mode="wrap")
        np.multiply(tv, g, out=tv)  # |x| = u * x_i
        np.take(zig.inner, layer, out=g, mode="wrap")
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


def _ziggurat_many(seeds: Sequence[bytes], sizes: Sequence[int], zig: _Ziggurat, label: bytes) -> list[np.ndarray]:
    """Symmetric ziggurat samples (unit scale), ``sizes[i]`` of them for ``seeds[i]``, slow paths resolved together."""
    outs, keys, owner, pos, mag, layer, sign = [], [], [], [], [], [], []
    for idx, (seed, size) in enumerate(zip(seeds, sizes, strict=True)):
        out, p, m, lay, sg = _ziggurat_fast(seed, size, zig, label)
        outs.append(out)
        keys.append(stream_key(seed, label + b"/side"))
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
    return _ziggurat_many([seed], [size], zig, label)[0]


#: Streams of :func:`gaussian_many` resolved together are capped at this many samples (32 MiB of float64).
_MANY_MAX_ELEMENTS = 1 << 22


def _scaled(seed: bytes, size: int, scale: float, scale_name: str, zig: _Ziggurat, label: bytes) -> np.ndarray:
    """Validated arguments -> unit-scale ziggurat samples times ``scale`` (one correctly rounded multiplication)."""
    seed = check_seed(seed)
    size = check_size(size)
    scale = check_scale(scale, scale_name)
    out = _ziggurat(seed, size, zig, label)
    if scale != 1.0:
        out *= scale
    return out


def gaussian(seed: bytes, size: int, sigma: float = 1.0) -> np.ndarray:
    """``size`` i.i.d. N(0, sigma**2) float64 samples expanded from ``seed``."""
    return _scaled(seed, size, sigma, "sigma", _table("normal"), b"gaussian")


def gaussian_many(seeds: Sequence[bytes], size: int | Sequence[int],
                  sigma: float | Sequence[float] = 1.0) -> Iterator[np.ndarray]:
    """``gaussian(seed, size, sigma)`` for each seed, in order, bit-identical to separate calls.

    ``size`` and ``sigma``: one value for every stream, or one per seed.  Faster for many short streams
    (e.g. the pairwise noise of a client with many peers, the layers of one model): the ziggurat's
    rejection slow path is resolved for a group of streams in one vectorised pass instead of once per
    stream.  Groups hold at most ~4M samples (or one longer stream), so memory stays bounded for large
    models.  Raises ValueError when a per-seed list has another length than ``seeds`` (or as
    :func:`gaussian` does).
    """
    seeds = [check_seed(seed) for seed in seeds]
    n = len(seeds)
    sizes = [check_size(k) for k in _per_seed(size, n, "sizes")]
    sigmas = [check_scale(v, "sigma") for v in _per_seed(sigma, n, "sigmas")]
    first = 0
    while first < n:
        stop, total = first + 1, sizes[first]
        while stop < n and total + sizes[stop] <= _MANY_MAX_ELEMENTS:
            total += sizes[stop]
            stop += 1
        for out, s in zip(_ziggurat_many(seeds[first:stop], sizes[first:stop], _table("normal"), b"gaussian"),
                          sigmas[first:stop], strict=True):
            if s != 1.0:
                out *= s
            yield out
        first = stop


def _per_seed(value: object, n: int, name: str) -> list:
    """``value`` for each of ``n`` streams: a scalar repeated, or a sequence of exactly ``n`` values."""
    if np.ndim(value) == 0:
        return [value] * n
    values = list(value)  # type: ignore[call-overload]
    if len(values) != n:
        raise ValueError(f"{len(values)} {name} for {n} seeds")
    return values


def laplace(seed: bytes, size: int, scale: float = 1.0) -> np.ndarray:
    """``size`` i.i.d. Laplace(0, scale) float64 samples (variance 2 scale**2)."""
    return _scaled(seed, size, scale, "scale", _table("exponential"), b"laplace")
