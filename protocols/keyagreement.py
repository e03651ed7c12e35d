"""X25519 key agreement and HKDF-SHA256 pair-seed derivation.

Two clients compute the same raw secret ``agree(own, peer_public)`` and expand it with ``derive_pair_seed`` into
32-byte seeds for the noise PRG (:mod:`protocols.prg`) and relay keys (:mod:`protocols.relay_crypto`).

* Raw X25519 output is a curve coordinate, not uniform: it is only ever HKDF input keying material.
* The HKDF ``info`` is a length-prefixed encoding of (version, purpose, round, min(a, b), max(a, b), context),
  so purposes, rounds, pairs and runs get independent seeds (one DH secret serves many rounds without reusing a
  PRG seed) and both ends derive the same seed without coordination.
* :class:`KeyAgreementError` rejects malformed keys, the all-zero secret of small-order points (RFC 7748
  section 6.1) and a peer key equal to one's own (a reflected key).
"""

from __future__ import annotations

import hmac
import operator
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

__all__ = [
    "KEY_BYTES",
    "KeyAgreementError",
    "KeyPair",
    "generate_keypair",
    "keypair_from_private",
    "agree",
    "agree_many",
    "derive_pair_seed",
    "hkdf_sha256_32",
]

KEY_BYTES = 32
_SEED_BYTES = 32
_HKDF_SALT = b"cancelfl/pair-seed/v1/salt"
_INFO_PREFIX = b"cancelfl/pair-seed/v1"
_MAX_U64 = 2**64 - 1


class KeyAgreementError(ValueError):
    """A public key or shared secret is malformed or cryptographically unsafe."""


@dataclass(frozen=True)
class KeyPair:
    """Raw X25519 key pair (32 + 32 bytes), storable in Flower ``Context.state``."""

    private_bytes: bytes
    public_bytes: bytes

    def __repr__(self) -> str:  # never print the private key in logs
        return f"KeyPair(public_bytes={self.public_bytes.hex()}, private_bytes=<redacted>)"


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _as_key_bytes(value: object, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise KeyAgreementError(f"{what} must be {KEY_BYTES} raw bytes, got {type(value).__name__}")
    value = bytes(value)
    if len(value) != KEY_BYTES:
        raise KeyAgreementError(f"{what} must be exactly {KEY_BYTES} bytes, got {len(value)}")
    return value


def generate_keypair() -> KeyPair:
    """Fresh X25519 key pair from the OS CSPRNG."""
    private = X25519PrivateKey.generate()
    raw_private = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    return KeyPair(private_bytes=raw_private, public_bytes=_raw(private.public_key()))


def keypair_from_private(private_bytes: bytes) -> KeyPair:
    """Rebuild a key pair from its 32 raw private bytes (e.g. restored from state)."""
    raw_private = _as_key_bytes(private_bytes, "private key")
    private = X25519PrivateKey.from_private_bytes(raw_private)
    return KeyPair(private_bytes=raw_private, public_bytes=_raw(private.public_key()))


def agree(own: KeyPair, peer_public: bytes) -> bytes:
    """Raw 32-byte X25519 shared secret between ``own`` and ``peer_public``.

    Raises KeyAgreementError for a malformed peer key, a small-order point (all-zero
    secret) or a peer key equal to our own public key.
    """
    private = X25519PrivateKey.from_private_bytes(_as_key_bytes(own.private_bytes, "private key"))
    return _exchange(private, own.public_bytes, peer_public)


def agree_many(own: KeyPair, peer_publics: Iterable[bytes]) -> list[bytes]:
    """:func:`agree` with every key of ``peer_publics`` (the private key is loaded once)."""
    private = X25519PrivateKey.from_private_bytes(_as_key_bytes(own.private_bytes, "private key"))
    return [_exchange(private, own.public_bytes, pk) for pk in peer_publics]


def _exchange(private: X25519PrivateKey, own_public: bytes, peer_public: bytes) -> bytes:
    peer = _as_key_bytes(peer_public, "peer public key")
    if hmac.compare_digest(peer, own_public):
        raise KeyAgreementError("peer public key equals our own public key (reflected key)")
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer))
    except ValueError as exc:  # OpenSSL refuses an all-zero result (small-order point)
        raise KeyAgreementError(f"peer public key {peer.hex()} is a small-order point: shared secret would be all zero") from exc
    if not any(shared):  # belt and braces, in case a backend does not check
        raise KeyAgreementError(f"peer public key {peer.hex()} is a small-order point: shared secret is all zero")
    return shared


def _u64(value: int, what: str) -> bytes:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if not 0 <= value <= _MAX_U64:
        raise ValueError(f"{what} must be in [0, 2**64), got {value}")
    return value.to_bytes(8, "big")


def _lp(data: bytes) -> bytes:
    """Length-prefixed field: makes the info encoding injective."""
    return len(data).to_bytes(4, "big") + data


def derive_pair_seed(
    shared: bytes,
    *,
    purpose: str,
    round_num: int,
    node_a: int,
    node_b: int,
    context: bytes = b"",
) -> bytes:
    """32-byte seed for (purpose, round, {node_a, node_b}, context) via HKDF-SHA256.

    Symmetric in (node_a, node_b); any change of purpose, round, pair or context gives an
    independent seed. ``context`` should carry a run id so seeds never repeat across runs.
    """
    if not isinstance(shared, (bytes, bytearray, memoryview)):
        raise TypeError(f"shared secret must be bytes, got {type(shared).__name__}")
    shared = bytes(shared)
    if len(shared) != KEY_BYTES:
        raise ValueError(f"shared secret must be {KEY_BYTES} bytes, got {len(shared)}")
    if not any(shared):
        raise KeyAgreementError("shared secret is all zero")
    if not isinstance(purpose, str) or not purpose:
        raise ValueError("purpose must be a non-empty str")
    if not isinstance(context, (bytes, bytearray, memoryview)):
        raise TypeError(f"context must be bytes, got {type(context).__name__}")
    a, b = _u64(node_a, "node_a"), _u64(node_b, "node_b")
    if a == b:
        raise ValueError(f"node_a and node_b must differ, both are {int(node_a)}")
    lo, hi = min(a, b), max(a, b)  # big-endian: byte order == numeric order
    info = _INFO_PREFIX + _lp(purpose.encode("utf-8")) + _u64(round_num, "round_num") + lo + hi + _lp(bytes(context))
    return hkdf_sha256_32(shared, salt=_HKDF_SALT, info=info)


def hkdf_sha256_32(ikm: bytes, *, salt: bytes, info: bytes) -> bytes:
    """RFC 5869 HKDF-SHA256 with a 32-byte output (one expand block), from two one-shot HMACs.

    Bit-identical to ``cryptography``'s ``HKDF(SHA256(), 32, salt, info).derive(ikm)`` (tested) with less
    per-call overhead, which matters because a client derives one seed per neighbour per round.
    """
    prk = hmac.digest(salt, ikm, "sha256")  # extract
    return hmac.digest(prk, info + b"\x01", "sha256")  # expand: T(1) = HMAC(PRK, info || 0x01)
