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
  path uses :mod:`protocols.prg.portable_math`'s ``exp``/``log``, written with + - * / frexp/ldexp/rint only, instead
  of numpy's libm/SIMD transcendental functions, whose last bit differs between CPUs
  (AVX-512 vs scalar glibc vs macOS). Hence outputs are bit-identical across machines.
  Scaling by ``sigma``/``scale`` is one correctly rounded IEEE multiplication.

Speed (single thread, ``cancelfl-bench protocol-core``): ~170-180 M normals/s
on one AMD EPYC core (AVX-512, shared machine), i.e. 3.5x the 50 M/s target and faster
than numpy's own PCG64 ziggurat (~110 M/s there). Work proceeds in chunks of 64 Ki words
(512 KiB, L2-resident scratch reused per thread), so extra memory is O(chunk) plus ~1.5 %
of the output for the slow-path bookkeeping. Per-call overhead: ~20 us (key setup) plus
~0.1-0.2 ms of vectorised slow-path steps once a vector has >= ~1000 elements.

Modules
-------
* :mod:`protocols.prg.stream`: seeds, per-label AES-CTR keystreams, the side stream,
  ``derive_subseed``, ``random_bytes``;
* :mod:`protocols.prg.uniform`: ``uniform``, ``symmetric_uniform``, ``symmetric_uniform_sum``,
  ``uniform_ints``;
* :mod:`protocols.prg.ziggurat`: ``gaussian``, ``gaussian_many``, ``laplace``;
* :mod:`protocols.prg.portable_math`: the slow path's bit-reproducible log/exp.
"""

from protocols.prg.stream import SEED_BYTES, derive_subseed, random_bytes
from protocols.prg.uniform import symmetric_uniform, symmetric_uniform_sum, uniform, uniform_ints
from protocols.prg.ziggurat import gaussian, gaussian_many, laplace

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
