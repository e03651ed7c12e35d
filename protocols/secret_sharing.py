"""Fixed-point encoding into Z_{2^64}, full-threshold additive sharing and Shamir t-of-n sharing.

DDP-SA (Wei et al., Algorithms 1-2) encodes each client's noisy gradient as fixed-point integers, splits it into
``m`` shares (one per intermediate server) and lets the parameter server reconstruct only the sum over clients.

* :class:`FixedPointCodec`: ``x * 2**frac_bits`` in the ring Z_{2^64} (exact, vectorised ``uint64`` arithmetic,
  two's-complement decoding); it refuses (:class:`FixedPointRangeError`) a value whose sum over ``max_clients``
  encodings could leave the signed range;
* additive (:func:`share`, the paper's): all ``m`` shares needed, any ``m - 1`` reveal nothing;
* Shamir (:func:`shamir_share_vector`, :func:`shamir_reconstruct_vector`): share ``j`` is ``f(j + 1)`` of a random
  degree ``t - 1`` polynomial over ``Z_p``, ``p = 2^64 - 59`` (:data:`VECTOR_PRIME`); any ``t`` reconstruct, any
  ``t - 1`` reveal nothing; shares are linear, so a server's sum of shares is a share of the sum;
* :func:`shamir_split` / :func:`shamir_combine`: t-of-n sharing of a byte string of at most 64 bytes over
  GF(2^521 - 1) (the self-mask seeds of :mod:`protocols.masking`).

Share randomness: ``os.urandom``, or :mod:`protocols.prg` when an explicit seed is given (tests).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "RING_BITS",
    "VECTOR_PRIME",
    "FixedPointCodec",
    "FixedPointRangeError",
    "encode_and_share",
    "field_sum",
    "from_field",
    "from_wire",
    "random_ring_elements",
    "reconstruct",
    "ring_sum",
    "shamir_reconstruct_vector",
    "shamir_share_vector",
    "share",
    "lagrange_at_zero",
    "shamir_combine",
    "shamir_split",
    "to_field",
    "to_wire",
]

RING_BITS = 64
#: The field of Shamir-shared vectors: the largest prime below 2^64 (one uint64 word per element).
VECTOR_PRIME = (1 << 64) - 59
_P_GAP = np.uint64((1 << 64) - VECTOR_PRIME)  # 59 = 2^64 mod p
_P = np.uint64(VECTOR_PRIME)
#: Largest |sum| that decodes unambiguously from the ring and from the Shamir field: (p - 1) / 2 = 2^63 - 30.
_SIGNED_MAX = (VECTOR_PRIME - 1) // 2

Ring = NDArray[np.uint64]


class FixedPointRangeError(ValueError):
    """A value cannot be fixed-point encoded without risking overflow of the aggregate."""


@dataclass(frozen=True)
class FixedPointCodec:
    """Signed fixed-point encoding of float64 vectors into Z_{2^64}.

    ``encode(x) = round(x * 2**frac_bits) mod 2^64``.  A sum of at most ``max_clients``
    encodings decodes exactly (up to the per-value round-off ``2**-(frac_bits+1)``), from the ring
    or from the Shamir field, because :meth:`encode` only accepts ``|x| <= max_abs``, where::

        max_abs = floor((2^63 - 30) / max_clients) / 2**frac_bits

    e.g. ``frac_bits=32, max_clients=1024`` gives ``max_abs ~= 2.1e6`` with resolution
    ``2.3e-10`` (the paper's ``dn = 10`` decimal places corresponds to ~33 bits).

    Attributes:
        frac_bits: number of fractional bits (precision ``2**-frac_bits``), 0..62.
        max_clients: maximum number of encoded vectors that will ever be summed.
    """

    frac_bits: int = 32
    max_clients: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.frac_bits, int) or not 0 <= self.frac_bits <= RING_BITS - 2:
            raise ValueError(f"frac_bits must be an int in [0, {RING_BITS - 2}], got {self.frac_bits!r}")
        if not isinstance(self.max_clients, int) or self.max_clients < 1:
            raise ValueError(f"max_clients must be a positive int, got {self.max_clients!r}")

    @property
    def scale(self) -> float:
        """Scaling factor ``2**frac_bits`` (exact power of two)."""
        return math.ldexp(1.0, self.frac_bits)

    @property
    def resolution(self) -> float:
        """Quantisation step ``2**-frac_bits``; per-value round-off is at most half of it."""
        return math.ldexp(1.0, -self.frac_bits)

    @property
    def max_abs_int(self) -> int:
        """Largest accepted ``|round(x * 2**frac_bits)|`` (an exact integer)."""
        bound = _SIGNED_MAX // self.max_clients
        # Keep the bound exactly representable as float64 so the range check is exact.
        while float(bound) > bound:
            bound = int(np.nextafter(float(bound), 0.0))
        return bound

    @property
    def max_abs(self) -> float:
        """Largest accepted ``|x|`` in real units (see class docstring)."""
        return math.ldexp(float(self.max_abs_int), -self.frac_bits)

    def encode(self, values: ArrayLike) -> Ring:
        """Encode float values (any shape) into ring elements of the same shape.

        Raises:
            FixedPointRangeError: if any value is NaN/inf or exceeds ``max_abs``, i.e. the
                sum over ``max_clients`` encodings could overflow the signed 64-bit range.
        """
        x = np.asarray(values, dtype=np.float64)
        scaled = np.rint(x * self.scale)  # exact scaling, round-half-even
        # The messages name no value nor position: what is encoded is secret (a client's noisy sum carries only its
        # share of the noise) and an error's text reaches the server.
        if not np.isfinite(scaled).all():
            raise FixedPointRangeError("cannot fixed-point encode a non-finite value")
        if (np.abs(scaled) > float(self.max_abs_int)).any():
            raise FixedPointRangeError(
                f"a value exceeds the fixed-point range |x| <= {self.max_abs:.6g} (frac_bits={self.frac_bits}, max_clients="
                f"{self.max_clients}): a sum over {self.max_clients} clients could overflow "
                f"Z_2^{RING_BITS}; clip/scale the input, lower frac_bits or lower max_clients"
            )
        # |scaled| < 2^63 and integral, so the int64 cast is exact; view as ring element.
        return scaled.astype(np.int64).view(np.uint64)

    def decode(self, ring_values: ArrayLike) -> NDArray[np.float64]:
        """Decode a ring element (one encoding or a sum of <= max_clients) to float64.

        The ring element is read as a two's-complement signed 64-bit integer.
        """
        r = np.asarray(ring_values)
        if r.dtype != np.uint64:
            raise TypeError(f"decode expects uint64 ring elements, got dtype {r.dtype}")
        return r.view(np.int64).astype(np.float64) * self.resolution

    def decode_mean(self, ring_sum_values: ArrayLike, count: int) -> NDArray[np.float64]:
        """Decode a sum of ``count`` encodings and divide by ``count``."""
        if not 1 <= count <= self.max_clients:
            raise ValueError(f"count must be in [1, max_clients={self.max_clients}], got {count}")
        return self.decode(ring_sum_values) / count


def random_ring_elements(size: int, *, seed: bytes | None = None) -> Ring:
    """``size`` uniform elements of Z_{2^64} from a CSPRNG.

    Args:
        size: number of elements.
        seed: ``None`` -> fresh ``os.urandom`` bytes (production). Otherwise a 32-byte seed
            expanded with the project AES-CTR PRG (:func:`protocols.prg.uniform_ints`);
            the same seed always yields the same elements, so never reuse a seed for two
            different secrets.
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if seed is None:
        return np.frombuffer(os.urandom(8 * size), dtype="<u8").astype(np.uint64)
    # Lazy import: the project PRG is only needed for seeded (reproducible) sharing.
    from protocols.prg import uniform_ints

    return np.asarray(uniform_ints(seed, size, 1 << RING_BITS), dtype=np.uint64)


def ring_sum(arrays: Sequence[ArrayLike]) -> Ring:
    """Sum ring elements mod 2^64 (numpy uint64 addition wraps around exactly)."""
    if len(arrays) == 0:
        raise ValueError("ring_sum needs at least one array")
    first = np.asarray(arrays[0])
    if first.dtype != np.uint64:
        raise TypeError(f"ring elements must be uint64, got {first.dtype}")
    total = first.copy()
    for a in arrays[1:]:
        arr = np.asarray(a)
        if arr.dtype != np.uint64:
            raise TypeError(f"ring elements must be uint64, got {arr.dtype}")
        if arr.shape != total.shape:
            raise ValueError(f"shape mismatch in ring_sum: {arr.shape} vs {total.shape}")
        np.add(total, arr, out=total)
    return total


def share(secret: ArrayLike, m: int, *, seed: bytes | None = None) -> list[Ring]:
    """Split ring elements into ``m`` additive shares (Algorithm 1 of the paper).

    Shares ``0..m-2`` are uniform; share ``m-1 = secret - sum(others) mod 2^64``.  Any
    ``m-1`` shares are jointly uniform and independent of the secret; all ``m`` sum to it.

    Args:
        secret: uint64 array (any shape), e.g. from :meth:`FixedPointCodec.encode`.
        m: number of shares / intermediate servers, ``m >= 2`` (``m = 1`` would hand the
            plaintext to a single server, which is never what DDP-SA wants).
        seed: see :func:`random_ring_elements`.
    """
    s = np.asarray(secret)
    if s.dtype != np.uint64:
        raise TypeError(f"secret must be uint64 ring elements, got dtype {s.dtype}")
    if not isinstance(m, int) or m < 2:
        raise ValueError(f"number of shares m must be an int >= 2, got {m!r}")
    rand = random_ring_elements((m - 1) * s.size, seed=seed).reshape((m - 1, *s.shape))
    shares = [rand[i].copy() for i in range(m - 1)]
    last = s.copy()
    for r in shares:
        np.subtract(last, r, out=last)
    shares.append(last)
    return shares


def reconstruct(shares: Sequence[ArrayLike]) -> Ring:
    """Reconstruct (the sum of) secrets from all ``m`` shares: ``sum mod 2^64``."""
    return ring_sum(shares)


def encode_and_share(values: ArrayLike, m: int, codec: FixedPointCodec, *, threshold: int | None = None,
                     seed: bytes | None = None) -> list[Ring]:
    """Fixed-point encode float ``values`` with ``codec`` and split into ``m`` shares.

    ``threshold`` None: additive shares (all ``m`` needed); else Shamir shares, any ``threshold`` of which
    reconstruct.
    """
    if threshold is None:
        return share(codec.encode(values), m, seed=seed)
    return shamir_share_vector(codec.encode(values), m, threshold, seed=seed)


# ----------------------------------------------------------------------------- Shamir over Z_p
def _add_mod(a: Ring, b: Ring) -> Ring:
    """``(a + b) mod p`` for field elements (< p) as uint64, without overflow."""
    total = a + b  # wraps mod 2^64
    total = np.where(total < a, total + _P_GAP, total)  # 2^64 = 59 (mod p); no second wrap
    return np.where(total >= _P, total - _P, total)


def _sub_mod(a: Ring, b: Ring) -> Ring:
    """``(a - b) mod p`` for field elements (< p)."""
    diff = a - b
    return np.where(a < b, diff - _P_GAP, diff)


def _mul_scalar_mod(vec: Ring, c: int) -> Ring:
    """``vec * c mod p`` for field elements ``vec`` and an integer ``c`` (double and add)."""
    c %= VECTOR_PRIME
    out = np.zeros_like(vec)
    base = vec.copy()
    while c:
        if c & 1:
            out = _add_mod(out, base)
        c >>= 1
        if c:
            base = _add_mod(base, base)
    return out


def to_field(ring_values: ArrayLike) -> Ring:
    """Ring elements (two's-complement signed) -> Z_p elements of the same signed value."""
    r = np.asarray(ring_values)
    if r.dtype != np.uint64:
        raise TypeError(f"to_field expects uint64 ring elements, got {r.dtype}")
    return np.where(r >= np.uint64(1 << 63), r - _P_GAP, r)  # negative v: 2^64 + v -> p + v


def from_field(field_values: ArrayLike) -> Ring:
    """Z_p elements -> ring elements, reading ``x > (p - 1) / 2`` as ``x - p`` (inverse of :func:`to_field`)."""
    f = np.asarray(field_values)
    if f.dtype != np.uint64:
        raise TypeError(f"from_field expects uint64 field elements, got {f.dtype}")
    return np.where(f > np.uint64(_SIGNED_MAX), f + _P_GAP, f)  # x - p in two's complement = x + 59


def field_sum(arrays: Sequence[ArrayLike]) -> Ring:
    """Sum Z_p elements mod p (e.g. one server's Shamir shares of many clients)."""
    if len(arrays) == 0:
        raise ValueError("field_sum needs at least one array")
    total = None
    for a in arrays:
        arr = np.asarray(a)
        if arr.dtype != np.uint64:
            raise TypeError(f"field elements must be uint64, got {arr.dtype}")
        if (arr >= _P).any():
            raise ValueError(f"field elements must be < p = 2^64 - {int(_P_GAP)}")
        if total is not None and arr.shape != total.shape:
            raise ValueError(f"shape mismatch in field_sum: {arr.shape} vs {total.shape}")
        total = arr.copy() if total is None else _add_mod(total, arr)
    return total


def _random_field(size: int, seed: bytes | None) -> Ring:
    """``size`` uniform elements of Z_p (uniform 64-bit words, the rare ones >= p redrawn)."""
    out = random_ring_elements(size, seed=seed)
    attempt = 0
    while (bad := out >= _P).any():
        attempt += 1
        sub = None if seed is None else hashlib.sha256(seed + b"shamir-redraw" + attempt.to_bytes(4, "big")).digest()
        out[bad] = random_ring_elements(int(bad.sum()), seed=sub)
    return out


def shamir_share_vector(secret: ArrayLike, m: int, threshold: int, *, seed: bytes | None = None) -> list[Ring]:
    """Split ring elements into ``m`` Shamir shares over Z_p, any ``threshold`` of which reconstruct.

    Share ``j`` (0-based, for server ``j``) is ``f(j + 1)``, ``f(x) = to_field(secret) + a_1 x + ... +
    a_(t-1) x^(t-1)`` with uniform coefficients (one polynomial per element).

    Args:
        secret: uint64 ring elements (any shape), e.g. from :meth:`FixedPointCodec.encode`.
        m: number of shares (>= 2).
        threshold: ``t``, ``2 <= t <= m`` (``t = 1`` would hand the plaintext to every server).
        seed: see :func:`random_ring_elements`.
    """
    s = np.asarray(secret)
    if s.dtype != np.uint64:
        raise TypeError(f"secret must be uint64 ring elements, got dtype {s.dtype}")
    if not isinstance(m, int) or m < 2 or not isinstance(threshold, int) or not 2 <= threshold <= m:
        raise ValueError(f"need ints m >= 2 and 2 <= threshold <= m, got m={m!r}, threshold={threshold!r}")
    flat = to_field(s.ravel())
    coeffs = _random_field((threshold - 1) * flat.size, seed).reshape(threshold - 1, flat.size)
    shares = []
    for j in range(m):
        x = j + 1
        acc = np.zeros_like(flat)
        for k in range(threshold - 2, -1, -1):  # Horner over a_(t-1) .. a_1
            acc = _add_mod(_mul_scalar_mod(acc, x), coeffs[k])
        shares.append(_add_mod(_mul_scalar_mod(acc, x), flat).reshape(s.shape))
    return shares


def shamir_reconstruct_vector(points: Mapping[int, ArrayLike]) -> Ring:
    """The ring value at ``x = 0`` of the polynomial through ``{server index j: share}`` (``x = j + 1``).

    Give at least ``threshold`` points of one sharing (or of a sum of sharings); all points given are
    interpolated, so they must be consistent.  Returns ring elements (:func:`from_field`).
    """
    if len(points) < 1:
        raise ValueError("shamir_reconstruct needs at least one point")
    xs = [int(j) + 1 for j in points]
    if len(set(xs)) != len(xs) or min(xs) < 1:
        raise ValueError(f"server indices must be distinct and >= 0, got {sorted(points)}")
    weights = lagrange_at_zero(xs, VECTOR_PRIME)
    total = None
    for y, xj in zip(points.values(), xs, strict=True):
        term = _mul_scalar_mod(field_sum([y]), weights[xj])
        total = term if total is None else _add_mod(total, term)
    assert total is not None
    return from_field(total)


def to_wire(ring_values: ArrayLike) -> bytes:
    """Serialise ring elements as little-endian uint64 words (flattened, C order)."""
    r = np.asarray(ring_values)
    if r.dtype != np.uint64:
        raise TypeError(f"to_wire expects uint64, got {r.dtype}")
    return r.astype("<u8", copy=False).tobytes()


def from_wire(data: bytes, length: int | None = None) -> Ring:
    """Parse little-endian uint64 words; checks ``length`` (element count) when given."""
    if len(data) % 8:
        raise ValueError(f"wire data length {len(data)} is not a multiple of 8 bytes")
    if length is not None and len(data) != 8 * length:
        raise ValueError(f"wire data holds {len(data) // 8} elements, expected {length}")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64)


# ----------------------------------------------------------------------------- Shamir t-of-n
#: The Mersenne prime 2^521 - 1: the encoded secret (length, secret, tag: at most 65 bytes) is a field element.
SHAMIR_PRIME = (1 << 521) - 1
#: Bytes of the integrity tag bound into the secret: shares that do not reconstruct it pass with odds 2^-64.
SHAMIR_TAG_BYTES = 8
SHAMIR_SECRET_MAX = 65 - 1 - SHAMIR_TAG_BYTES
#: Bytes of one encoded share: x (2 bytes) || y (66 bytes).
SHAMIR_SHARE_BYTES = 2 + 66


def shamir_split(secret: bytes, n: int, t: int) -> list[bytes]:
    """Split ``secret`` (1..64 bytes) into ``n`` shares, any ``t`` of which reconstruct it (1 <= t <= n < 2^16).

    Returns share ``i`` (i = 0..n-1) encoded as ``x || y`` with x = i + 1 (big-endian), coefficients from
    the OS CSPRNG.  The polynomial's constant term is ``len || secret || tag`` (:func:`_shamir_tag`), so
    :func:`shamir_combine` detects too few or mixed shares.
    """
    secret = bytes(secret)
    if not 1 <= len(secret) <= SHAMIR_SECRET_MAX:
        raise ValueError(f"a Shamir secret must be 1..{SHAMIR_SECRET_MAX} bytes, got {len(secret)}")
    if not (isinstance(n, int) and isinstance(t, int) and 1 <= t <= n < 1 << 16):
        raise ValueError(f"need 1 <= t <= n < 65536, got t={t!r}, n={n!r}")
    coeffs = [int.from_bytes(bytes([len(secret)]) + secret + _shamir_tag(secret), "big")]
    coeffs += [int.from_bytes(os.urandom(66), "big") % SHAMIR_PRIME for _ in range(t - 1)]
    out = []
    for x in range(1, n + 1):
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % SHAMIR_PRIME
        out.append(x.to_bytes(2, "big") + y.to_bytes(66, "big"))
    return out


def shamir_combine(shares: Sequence[bytes]) -> bytes:
    """The secret from at least ``t`` distinct shares of :func:`shamir_split` (Lagrange interpolation at 0).

    Raises ValueError for malformed or repeated shares, or when the interpolated value is no secret
    (too few shares, or shares of different secrets: its length and tag do not match, but with odds 2^-64).
    """
    points: dict[int, int] = {}
    for sh in shares:
        sh = bytes(sh)
        if len(sh) != SHAMIR_SHARE_BYTES:
            raise ValueError(f"a Shamir share is {SHAMIR_SHARE_BYTES} bytes, got {len(sh)}")
        x, y = int.from_bytes(sh[:2], "big"), int.from_bytes(sh[2:], "big")
        if x == 0 or y >= SHAMIR_PRIME:
            raise ValueError("malformed Shamir share")
        if x in points and points[x] != y:
            raise ValueError(f"two different Shamir shares at x = {x}")
        points[x] = y
    if not points:
        raise ValueError("no Shamir shares")
    weights = lagrange_at_zero(points, SHAMIR_PRIME)
    total = sum(yi * weights[xi] for xi, yi in points.items()) % SHAMIR_PRIME
    raw = total.to_bytes(66, "big").lstrip(b"\x00")
    n = raw[0] if raw else 0
    secret = raw[1:1 + n]
    if not 1 <= n <= SHAMIR_SECRET_MAX or len(raw) != 1 + n + SHAMIR_TAG_BYTES or raw[1 + n:] != _shamir_tag(secret):
        raise ValueError("the Shamir shares do not reconstruct a secret (too few, or of different secrets)")
    return secret


def _shamir_tag(secret: bytes) -> bytes:
    """The integrity tag of a Shamir secret: the first :data:`SHAMIR_TAG_BYTES` of SHA-256 over it."""
    return hashlib.sha256(b"cancelfl/shamir/v1" + bytes([len(secret)]) + secret).digest()[:SHAMIR_TAG_BYTES]


def lagrange_at_zero(xs: Iterable[int], prime: int) -> dict[int, int]:
    """Lagrange weights at 0 over Z_prime: ``f(0) = sum_i w_i f(x_i)`` for any polynomial of degree < len(xs).

    ``w_i = prod_{j != i} x_j / (x_j - x_i) mod prime``; the ``xs`` must be distinct and nonzero mod ``prime``.
    Cached per point set (a round's clients share theirs): exact integer products, one modular inversion.
    """
    return dict(_lagrange_weights(tuple(sorted(int(x) for x in xs)), int(prime)))


@functools.lru_cache(maxsize=256)
def _lagrange_weights(points: tuple[int, ...], prime: int) -> tuple[tuple[int, int], ...]:
    """``((x_i, w_i), ...)`` of :func:`lagrange_at_zero` for sorted distinct ``points``."""
    nums, dens = [], []
    for i, xi in enumerate(points):
        num, den = 1, 1
        for j, xj in enumerate(points):
            if j != i:
                num *= xj
                den *= xj - xi
        nums.append(num % prime)
        dens.append(den % prime)
    # Montgomery's trick: invert all denominators with one pow.
    prefix = [1]
    for d in dens:
        prefix.append(prefix[-1] * d % prime)
    inv = pow(prefix[-1], -1, prime)
    weights = [0] * len(points)
    for i in range(len(points) - 1, -1, -1):
        weights[i] = nums[i] * (inv * prefix[i] % prime) % prime
        inv = inv * dens[i] % prime
    return tuple(zip(points, weights, strict=True))
