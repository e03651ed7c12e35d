"""Deterministic, cryptographically secure noise engine (PRG) for cancelling noise.

Every pairwise / cancelling noise vector is expanded from a 32-byte seed: ``gaussian``, ``laplace``,
``uniform``, ``uniform_ints`` and ``random_bytes`` return the same bits for the same seed on every machine,
process and numpy version, so the two ends of a pair generate identical vectors that cancel exactly.
Without the seed the output is indistinguishable from uniform (AES-256-CTR keystream per (seed, label), key
``HMAC-SHA256(seed, "cancelfl/prg/v1/key/<label>")``).  Every output element is a pure function of
(seed, position): ``gaussian(s, n) == gaussian(s, m)[:n]`` for ``n <= m``.  Design: ``docs/concepts.md``.

* :mod:`protocols.prg.stream`: seeds, per-label keystreams, the side stream, ``derive_subseed``, ``random_bytes``;
* :mod:`protocols.prg.uniform`: ``uniform``, ``symmetric_uniform``, ``symmetric_uniform_sum``, ``uniform_ints``;
* :mod:`protocols.prg.ziggurat`: ``gaussian``, ``gaussian_many``, ``laplace`` (256-layer ziggurats);
* :mod:`protocols.prg.portable_math`: the slow path's bit-reproducible ``log``/``exp``.
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
