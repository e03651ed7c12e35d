"""Uniform streams of the PRG: floats on [0, 1), symmetric [-1, 1) and their exact sums, integers mod m.

``uniform`` builds 53-bit uniforms k / 2**53 with the IEEE exponent trick (exact, and much
faster than numpy's int64 -> float64 cast).  ``symmetric_uniform`` is exactly 2u - 1 =
(k - 2**52) / 2**52; ``symmetric_uniform_sum`` adds/subtracts many such streams as integers
(exact) and rounds once, the pairwise engine's fast path for uniform noise.  ``uniform_ints``
is unbiased for any modulus (rejection, redrawn from the position-addressed side stream).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from protocols.prg.stream import EXP_ONE, check_seed, check_size, scratch, side_words, stream_key, word_chunks


def uniform(seed: bytes, size: int) -> np.ndarray:
    """``size`` float64 uniforms on [0, 1), each k / 2**53 with k uniform (53 bits)."""
    seed = check_seed(seed)
    size = check_size(size)
    out = np.empty(size, dtype=np.float64)
    if size == 0:
        return out
    half = scratch.a
    for start, words, _ in word_chunks(stream_key(seed, b"uniform"), size):
        m = words.size
        seg = out[start : start + m]
        bits = seg.view(np.uint64)
        h = half[:m]
        np.right_shift(words, 12, out=bits)  # bits 12-63: high 52 bits of k
        np.bitwise_or(bits, EXP_ONE, out=bits)
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
    and the float results cancel up to one rounding each.  It is also cheaper than summing
    float vectors: per stream only a shift and an integer add.
    """
    plus = [check_seed(s) for s in plus]
    minus = [check_seed(s) for s in minus]
    size = check_size(size)
    out = np.zeros(size, dtype=np.float64)
    signed = [(s, True) for s in plus] + [(s, False) for s in minus]
    acc = np.empty(size, dtype=np.uint64)
    half = scratch.a
    for first in range(0, len(signed), _EXACT_SUM_STREAMS):
        group = signed[first : first + _EXACT_SUM_STREAMS]
        acc.fill(0)
        for seed, positive in group:
            op = np.add if positive else np.subtract
            for start, words, _ in word_chunks(stream_key(seed, b"uniform"), size):
                m = words.size
                h = half[:m]
                np.right_shift(words, 11, out=h)  # k, 53 bits
                seg = acc[start : start + m]
                op(seg, h, out=seg)
        offset = (sum(1 if positive else -1 for _, positive in group) << 52) % (1 << 64)
        acc -= np.uint64(offset)  # centre every k at 2**52 (mod 2**64)
        out += acc.view(np.int64).astype(np.float64) * 2.0**-52  # exact integer -> one rounding
    return out


def uniform_ints(seed: bytes, size: int, modulus: int) -> np.ndarray:
    """``size`` unbiased integers in [0, modulus) as uint64; 1 <= modulus <= 2**64.

    Power-of-two moduli take the top bits of each word (2**64: raw words). Otherwise a
    word w is accepted iff w < 2**64 - (2**64 mod modulus) and mapped to w % modulus;
    rejected positions are redrawn from the position-addressed side stream, so the
    output is exactly uniform and still a pure function of (seed, position).
    """
    seed = check_seed(seed)
    size = check_size(size)
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
        for start, words, _ in word_chunks(stream_key(seed, label), size):
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
    for start, words, _ in word_chunks(stream_key(seed, label), size):
        seg = out[start : start + words.size]
        np.remainder(words, mod, out=seg)
        bad = np.flatnonzero(words >= limit)
        if bad.size:
            rejected.append(bad + start)
    if rejected:
        side = stream_key(seed, label + b"/side")
        todo = np.concatenate(rejected)
        step = 0
        while todo.size:
            w1, w2 = side_words(side, todo, step)
            ok1 = w1 < limit
            ok2 = ~ok1 & (w2 < limit)
            out[todo[ok1]] = w1[ok1] % mod
            out[todo[ok2]] = w2[ok2] % mod
            todo = todo[~(ok1 | ok2)]
            step += 1
    return out
