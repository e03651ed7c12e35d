"""Bit-reproducible log/exp and 53-bit uniforms for the ziggurat's slow path.

Written with + - * / frexp/ldexp/rint only (exactly rounded IEEE operations), instead of
numpy's libm/SIMD transcendental functions, whose last bit differs between CPUs (AVX-512
vs scalar glibc vs macOS): the noise vectors must be identical on every machine.
"""

from __future__ import annotations

import math

import numpy as np

_TWO_M53 = 2.0**-53
_LN2_HI = 6.93147180369123816490e-01  # fdlibm split: e * _LN2_HI is exact for |e| < 2**11
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.4426950408889634
_SQRT_HALF = 0.7071067811865476
_LOG_COEF = [2.0 / (2 * k + 1) for k in range(11, -1, -1)]  # 2*atanh series, z**11 .. 1
_EXP_COEF = [1.0 / math.factorial(k) for k in range(13, -1, -1)]  # Taylor, r**13 .. 1


def log(x: np.ndarray) -> np.ndarray:
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


def exp(x: np.ndarray) -> np.ndarray:
    """e**x for moderate x (|x| < 700) using only exactly-rounded operations.

    x = k ln2 + r with |r| <= ln2/2 (Cody-Waite), Taylor to r**13 (error < 2**-57).
    """
    k = np.rint(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = np.full_like(r, _EXP_COEF[0])
    for c in _EXP_COEF[1:]:
        p = p * r + c
    return np.ldexp(p, k.astype(np.int32))


def unit_open(words: np.ndarray) -> np.ndarray:
    """Uniform on (0, 1]: ((w >> 11) + 1) / 2**53 (exact; small arrays only)."""
    return ((words >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * _TWO_M53


def unit(words: np.ndarray) -> np.ndarray:
    """Uniform on [0, 1): (w >> 11) / 2**53 (exact; small arrays only)."""
    return (words >> np.uint64(11)).astype(np.float64) * _TWO_M53
