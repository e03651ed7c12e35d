"""The AES-256-CTR keystream every distribution of :mod:`protocols.prg` is expanded from.

A 32-byte seed keys one independent stream per label (``HMAC-SHA256(seed, domain || label)``
is the AES key; the counter starts at 0 and never wraps).  Callers read the stream as
little-endian 64-bit words in chunks of :data:`CHUNK_WORDS` (:func:`word_chunks`), and draw
the rare extra randomness a rejection step needs from the position-addressed side stream
(:func:`side_words`), so every output element is a pure function of (seed, position).
Also here: seed/size/scale validation, :func:`derive_subseed` and :func:`random_bytes`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import operator
import threading
from collections.abc import Iterator

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

SEED_BYTES = 32
_DOMAIN = b"cancelfl/prg/v1"
CHUNK_WORDS = 1 << 14  # 128 KiB of keystream per chunk: a pass's working arrays stay in L2 (faster than 1 << 16)

_U64 = np.dtype("<u8")  # the keystream is read as little-endian words on every platform
EXP_ONE = np.uint64(0x3FF0000000000000)  # bit pattern of 1.0: or-ing in 52 random bits gives a float in [1, 2)


# --------------------------------------------------------------------------- validation
def check_seed(seed: bytes) -> bytes:
    """``seed`` as ``bytes`` of exactly :data:`SEED_BYTES` (TypeError / ValueError otherwise)."""
    if not isinstance(seed, (bytes, bytearray, memoryview)):
        raise TypeError(f"seed must be bytes, got {type(seed).__name__}")
    seed = bytes(seed)
    if len(seed) != SEED_BYTES:
        raise ValueError(f"seed must be exactly {SEED_BYTES} bytes, got {len(seed)}")
    return seed


def check_size(size: int) -> int:
    """A non-negative integer number of samples."""
    try:
        n = operator.index(size)
    except TypeError:
        raise TypeError(f"size must be an integer, got {type(size).__name__}") from None
    if n < 0:
        raise ValueError(f"size must be >= 0, got {n}")
    return n


def check_scale(value: float, name: str) -> float:
    """A finite, non-negative ``sigma`` / ``scale``."""
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


# --------------------------------------------------------------------------- keystreams
def stream_key(seed: bytes, label: bytes) -> bytes:
    """Per-(seed, label) AES-256 key; HMAC-SHA256 is a PRF keyed by the secret seed."""
    return hmac.new(seed, _DOMAIN + b"/key/" + label, hashlib.sha256).digest()


def derive_subseed(seed: bytes, label: str) -> bytes:
    """Derive an independent 32-byte seed for ``label`` from ``seed``.

    HMAC-SHA256(seed, domain || label): distinct labels give computationally
    independent seeds, so one round seed can drive several streams safely.
    """
    seed = check_seed(seed)
    if not isinstance(label, str):
        raise TypeError("label must be a str")
    return hmac.new(seed, _DOMAIN + b"/subseed/" + label.encode("utf-8"), hashlib.sha256).digest()


class _Scratch(threading.local):
    """Per-thread reusable chunk buffers.

    Avoids re-faulting ~2 MiB of fresh pages per call, which otherwise dominates for vectors of ~1e5 elements.
    """

    def __init__(self) -> None:
        self.buf = bytearray(8 * CHUNK_WORDS + 16)  # update_into: len(data) + 15 bytes
        self.a = np.empty(CHUNK_WORDS, dtype=np.uint64)
        self.b = np.empty(CHUNK_WORDS, dtype=np.uint64)
        self.mask = np.empty(CHUNK_WORDS, dtype=bool)
        self.layer = np.empty(CHUNK_WORDS, dtype=np.intp)
        self.gather = np.empty(CHUNK_WORDS, dtype=np.float64)


_ZEROS = bytes(8 * CHUNK_WORDS)
scratch = _Scratch()


def word_chunks(key: bytes, n_words: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(start, words, raw_bytes)`` of the AES-256-CTR keystream, chunk by chunk.

    The arrays are views of a reused per-thread buffer: consume them before the next
    iteration (all callers in this package do; none nests two streams).
    """
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    buf = scratch.buf
    zeros = memoryview(_ZEROS)
    start = 0
    while start < n_words:
        m = min(CHUNK_WORDS, n_words - start)
        enc.update_into(zeros[: 8 * m], buf)
        raw = np.frombuffer(buf, dtype=np.uint8, count=8 * m)
        yield start, np.frombuffer(buf, dtype=_U64, count=m), raw
        start += m


def side_words(key: bytes, positions: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
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
    seed = check_seed(seed)
    n = check_size(n)
    enc = Cipher(algorithms.AES(stream_key(seed, b"bytes")), modes.CTR(bytes(16))).encryptor()
    return enc.update(bytes(n)) + enc.finalize()
