"""Seeded samplers for Theorem 3's Gaussian-decomposition distributions DN(sigma, n) and DN*(m).

Theorem 3 (MP_Server + DDP_Client paper): if X_1..X_m ~iid DN*(m) and Y_1..Y_n ~iid DN(sigma, n) are independent,
then X_1...X_m * Y_1...Y_n ~ N(0, sigma^2), where (G ~ Gamma(shape, 1), beta Rademacher)

    DN*(m)       = beta * exp{-sum_{l>=1} [G_{1/m,l} / (2l+1) - ln(1 + 1/l) / (2m)]}
    DN(sigma, n) = beta * exp{ln(sqrt(2) sigma) / n - G_{1/n}}

The series variables are Gamma(1/m, 1), as the proof (App. A.1) requires; the text's Gamma(1/n, 1) is a typo.
Closed forms: DN(sigma, 1) = Uniform(-sqrt2 sigma, sqrt2 sigma); |DN*(1)| = Maxwell / sqrt2.  DN*(m >= 2)
samples the series truncated after ``terms`` summands plus a tail matched in its first three cumulants
(:func:`dn_star_cf_error` bounds the error; tests keep it below 1e-6).  The server draws magnitudes
(``signed=False``, MP_Server needs r, s > 0); the client's symmetric DN factor keeps the product N(0, sigma^2).
All randomness comes from :mod:`protocols.prg`, so holders of a pair seed derive bit-identical noise.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from protocols import prg
from protocols.pairwise import Sampler

#: Default number of explicit series terms for DN*(m), m >= 2 (error bound: :func:`dn_star_cf_error`).
DEFAULT_TERMS = 100

__all__ = [
    "DEFAULT_TERMS",
    "Sampler",
    "dn_sampler",
    "dn_star_cf_error",
    "dn_star_cf_log",
    "dn_unit_sampler",
    "sample_dn",
    "sample_dn_star",
    "sample_gamma",
]


def _check(seed: bytes, size: int) -> None:
    if len(seed) != prg.SEED_BYTES:
        raise ValueError(f"seed must be {prg.SEED_BYTES} bytes, got {len(seed)}")
    if size < 0:
        raise ValueError("size must be non-negative")


def _signs(seed: bytes, size: int) -> np.ndarray:
    """Rademacher signs (+1/-1) from one PRG bit each."""
    bits = np.unpackbits(np.frombuffer(prg.random_bytes(seed, (size + 7) // 8), dtype=np.uint8))
    return 1.0 - 2.0 * bits[:size].astype(np.float64)


def sample_gamma(seed: bytes, size: int, shape: float) -> np.ndarray:
    """Gamma(shape, 1) variates from a seed (exact transforms for shapes 1/2, 1, 3/2; else inverse CDF)."""
    _check(seed, size)
    if shape <= 0:
        raise ValueError("gamma shape must be positive")
    if shape == 0.5:
        z = prg.gaussian(seed, size)
        return 0.5 * z * z
    if shape == 1.0:
        return -np.log1p(-prg.uniform(seed, size))
    if shape == 1.5:
        z = prg.gaussian(seed, 3 * size).reshape(size, 3)
        return 0.5 * np.einsum("ij,ij->i", z, z)
    return special.gammaincinv(shape, prg.uniform(seed, size))


def sample_dn(seed: bytes, size: int, sigma: float, n: int = 1) -> np.ndarray:
    """DN(sigma, n) of Theorem 3 (float64). n = 1 is Uniform(-sqrt2*sigma, sqrt2*sigma), sampled exactly."""
    _check(seed, size)
    if sigma < 0 or n < 1:
        raise ValueError("need sigma >= 0 and n >= 1")
    if n == 1:
        return math.sqrt(2.0) * sigma * prg.symmetric_uniform(seed, size)
    g = sample_gamma(prg.derive_subseed(seed, "dn-gamma"), size, 1.0 / n)
    mag = np.exp(math.log(math.sqrt(2.0) * sigma) / n - g) if sigma > 0 else np.zeros(size)
    return _signs(prg.derive_subseed(seed, "dn-sign"), size) * mag


def dn_unit_sampler(seed: bytes, size: int) -> np.ndarray:
    """DN(1, 1) as a pairwise `Sampler`; use `scale=sigma` in pairwise_noise for DN(sigma, 1).

    For many peers prefer ``sampler=prg.symmetric_uniform, scale=sqrt2 * sigma`` (as :func:`protocols.mpddp.ddp.ddp_noise` does):
    the same law, summed exactly as integers by the engine's fast path.
    """
    return sample_dn(seed, size, 1.0, 1)


def dn_sampler(sigma: float, n: int = 1) -> Sampler:
    """A `Sampler` (seed, size) -> DN(sigma, n) vector, e.g. for protocols.pairwise.pairwise_noise."""

    def _sampler(seed: bytes, size: int) -> np.ndarray:
        return sample_dn(seed, size, sigma, n)

    return _sampler


def _tail_params(m: int, terms: int) -> tuple[float, float, float, float]:
    """(explicit-sum constant, tail mean, Gamma shape k, Gamma scale c) for the DN*(m) series.

    ln|X| = -sum_l [w_l G_l - a_l], w_l = 1/(2l+1), a_l = ln(1+1/l)/(2m), G_l ~ Gamma(1/m).
    Exact cumulants of ln|X| (all m factors together are 1/2 ln Gamma(3/2)):
    kappa_j = psi^{(j-1)}(3/2) / (2^j m). The tail beyond `terms` gets the remainder of
    kappa_1..kappa_3 and is realised as mu - c (H - k), H ~ Gamma(k, 1).
    """
    ell = np.arange(1, terms + 1, dtype=np.float64)
    w = 1.0 / (2.0 * ell + 1.0)
    a_sum = float(np.sum(np.log1p(1.0 / ell))) / (2.0 * m)
    head_mean = a_sum - float(np.sum(w)) / m
    k1 = float(special.digamma(1.5)) / (2.0 * m)
    k2 = float(special.polygamma(1, 1.5)) / (4.0 * m)
    k3 = float(special.polygamma(2, 1.5)) / (8.0 * m)
    tail_mean = k1 - head_mean
    tail_var = k2 - float(np.sum(w**2)) / m
    tail_k3 = k3 + 2.0 * float(np.sum(w**3)) / m  # negative: the tail is left-skewed
    c = -tail_k3 / (2.0 * tail_var)
    k = tail_var / (c * c)
    return a_sum, tail_mean, k, c


def _series_log_magnitude(seed: bytes, size: int, m: int, terms: int) -> np.ndarray:
    """ln|DN*(m)| from Theorem 3's series: `terms` explicit summands + the moment-matched Gamma tail."""
    if terms < 1:
        raise ValueError("terms must be >= 1")
    w = 1.0 / (2.0 * np.arange(1, terms + 1, dtype=np.float64) + 1.0)
    a_sum, tail_mean, k, c = _tail_params(m, terms)
    g = sample_gamma(prg.derive_subseed(seed, "dnstar-series"), size * terms, 1.0 / m)
    head = a_sum - g.reshape(size, terms) @ w
    h = sample_gamma(prg.derive_subseed(seed, "dnstar-tail"), size, k)
    return head + tail_mean - c * (h - k)


def sample_dn_star(seed: bytes, size: int, m: int, *, signed: bool = True, terms: int = DEFAULT_TERMS) -> np.ndarray:
    """DN*(m) of Theorem 3 (float64). signed=False returns the magnitude |DN*(m)| > 0 (server r, s).

    m = 1 uses the exact closed form sqrt(Gamma(3/2, 1)); m >= 2 the compensated truncated series.
    """
    _check(seed, size)
    if m < 1:
        raise ValueError("m must be >= 1")
    if m == 1:
        mag = np.sqrt(sample_gamma(prg.derive_subseed(seed, "dnstar-maxwell"), size, 1.5))
    else:
        mag = np.exp(_series_log_magnitude(seed, size, m, terms))
    if not signed:
        return mag
    return _signs(prg.derive_subseed(seed, "dnstar-sign"), size) * mag


def dn_star_cf_log(t: np.ndarray, m: int) -> np.ndarray:
    """Exact log characteristic function of ln|DN*(m)|: (lnGamma(3/2 + it/2) - lnGamma(3/2)) / m."""
    t = np.asarray(t, dtype=np.float64)
    return (special.loggamma(1.5 + 0.5j * t) - special.loggamma(1.5)) / m


def dn_star_cf_error(
    m: int, terms: int = DEFAULT_TERMS, t_max: float = 50.0, points: int = 2001, *, compensate: bool = True
) -> float:
    """sup_{|t| <= t_max} |phi_series(t) - phi_exact(t)| for ln|DN*(m)|, computed analytically.

    phi_series is the characteristic function of the compensated truncated series that `sample_dn_star`
    draws for m >= 2 (for m = 1 the sampler uses the exact closed form instead), or, with
    compensate=False, of the plain truncated series with no tail at all (shows why the tail term matters).
    """
    t = np.linspace(-t_max, t_max, points)
    ell = np.arange(1, terms + 1, dtype=np.float64)
    w = 1.0 / (2.0 * ell + 1.0)
    a_sum, tail_mean, k, c = _tail_params(m, terms)
    it = 1j * t
    log_head = it * a_sum - np.sum(np.log1p(np.outer(it, w)), axis=1) / m
    log_tail = it * (tail_mean + c * k) - k * np.log1p(it * c) if compensate else 0.0
    approx = np.exp(log_head + log_tail)
    exact = np.exp(dn_star_cf_log(t, m))
    return float(np.max(np.abs(approx - exact)))
