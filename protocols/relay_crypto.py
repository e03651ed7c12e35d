"""AES-256-GCM for client-to-client payloads relayed by an honest-but-curious server.

``seal(key, plaintext, aad=...)`` returns ``nonce (12 B) || ciphertext || tag (16 B)``; ``open_sealed`` verifies
and decrypts it.  The key is a 32-byte pair key (``derive_pair_seed(shared, purpose="relay", ...)``,
:mod:`protocols.keyagreement`).  The server can neither read a payload nor, with (sender, receiver, round, run id)
in the associated data (:func:`make_aad`), replay or redirect it unnoticed.  Nonces are 96-bit random; one key per
pair and round stays far below NIST SP 800-38D's limit for random nonces.  Any failure (tampering, wrong key or
aad, truncation) raises :class:`RelayAuthError` and releases no plaintext.
"""

from __future__ import annotations

import operator
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["KEY_BYTES", "NONCE_BYTES", "TAG_BYTES", "RelayAuthError", "seal", "open_sealed", "make_aad"]

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


class RelayAuthError(ValueError):
    """A relayed payload failed authentication (tampered, wrong key or wrong aad)."""


def _check(key: bytes, aad: bytes) -> tuple[bytes, bytes]:
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise ValueError(f"relay key must be {KEY_BYTES} bytes (AES-256)")
    if not isinstance(aad, (bytes, bytearray, memoryview)):
        raise TypeError(f"aad must be bytes, got {type(aad).__name__}")
    return bytes(key), bytes(aad)


def seal(key: bytes, plaintext: bytes, *, aad: bytes) -> bytes:
    """Encrypt and authenticate ``plaintext`` bound to ``aad``: nonce || ct || tag."""
    key, aad = _check(key, aad)
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, bytes(plaintext), aad)


def open_sealed(key: bytes, blob: bytes, *, aad: bytes) -> bytes:
    """Verify and decrypt a ``seal`` output; RelayAuthError on any mismatch."""
    key, aad = _check(key, aad)
    blob = bytes(blob)
    if len(blob) < NONCE_BYTES + TAG_BYTES:
        raise RelayAuthError(f"sealed payload too short ({len(blob)} bytes)")
    try:
        return AESGCM(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except InvalidTag:
        raise RelayAuthError("relayed payload failed authentication (tampered, wrong key or wrong aad)") from None


def make_aad(*, sender: int, receiver: int, round_num: int, context: bytes = b"") -> bytes:
    """Canonical associated data binding a payload to (sender, receiver, round, context)."""
    fields = []
    for name, value in (("sender", sender), ("receiver", receiver), ("round_num", round_num)):
        value = operator.index(value)
        if not 0 <= value < 2**64:
            raise ValueError(f"{name} must be in [0, 2**64), got {value}")
        fields.append(value.to_bytes(8, "big"))
    return b"cancelfl/relay/v1" + b"".join(fields) + len(context).to_bytes(4, "big") + bytes(context)
