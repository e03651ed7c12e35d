"""Tests for protocols.relay_crypto: AES-256-GCM sealing of relayed payloads."""

from __future__ import annotations

import pytest

from protocols.keyagreement import agree, derive_pair_seed, generate_keypair
from protocols.relay_crypto import (
    NONCE_BYTES,
    TAG_BYTES,
    RelayAuthError,
    make_aad,
    open_sealed,
    seal,
)

KEY = bytes(range(32))
AAD = make_aad(sender=7, receiver=9, round_num=3, context=b"run")
MSG = b"share of client 7 for client 9" * 10


def test_roundtrip_and_layout() -> None:
    blob = seal(KEY, MSG, aad=AAD)
    assert len(blob) == NONCE_BYTES + len(MSG) + TAG_BYTES
    assert MSG not in blob
    assert open_sealed(KEY, blob, aad=AAD) == MSG
    assert open_sealed(KEY, seal(KEY, b"", aad=b""), aad=b"") == b""


def test_fresh_nonce_per_message() -> None:
    a, b = seal(KEY, MSG, aad=AAD), seal(KEY, MSG, aad=AAD)
    assert a[:NONCE_BYTES] != b[:NONCE_BYTES] and a != b


def test_relay_between_two_clients() -> None:
    """End to end: both clients derive the relay key from X25519 + HKDF."""
    i, j = generate_keypair(), generate_keypair()
    k_i = derive_pair_seed(agree(i, j.public_bytes), purpose="relay", round_num=3, node_a=7, node_b=9)
    k_j = derive_pair_seed(agree(j, i.public_bytes), purpose="relay", round_num=3, node_a=9, node_b=7)
    assert open_sealed(k_j, seal(k_i, MSG, aad=AAD), aad=AAD) == MSG


@pytest.mark.parametrize("position", [0, NONCE_BYTES, NONCE_BYTES + 5, -1])
@pytest.mark.parametrize("bit", [0, 7])
def test_flipped_bit_rejected(position: int, bit: int) -> None:
    """(d) one flipped bit anywhere (nonce, ciphertext, tag) is detected."""
    blob = bytearray(seal(KEY, MSG, aad=AAD))
    blob[position] ^= 1 << bit
    with pytest.raises(RelayAuthError, match="failed authentication"):
        open_sealed(KEY, bytes(blob), aad=AAD)


@pytest.mark.parametrize(
    "wrong_aad",
    [
        make_aad(sender=9, receiver=7, round_num=3, context=b"run"),  # redirected
        make_aad(sender=7, receiver=9, round_num=4, context=b"run"),  # replayed next round
        make_aad(sender=7, receiver=9, round_num=3, context=b"other-run"),
        b"",
    ],
)
def test_wrong_aad_rejected(wrong_aad: bytes) -> None:
    """(d) a payload moved to another sender/receiver/round/run is rejected."""
    with pytest.raises(RelayAuthError):
        open_sealed(KEY, seal(KEY, MSG, aad=AAD), aad=wrong_aad)


def test_wrong_key_rejected() -> None:
    """(d) a different pair key cannot open the payload."""
    other = bytes(reversed(KEY))
    with pytest.raises(RelayAuthError):
        open_sealed(other, seal(KEY, MSG, aad=AAD), aad=AAD)


@pytest.mark.parametrize("cut", [0, 1, NONCE_BYTES + TAG_BYTES - 1, NONCE_BYTES + TAG_BYTES + 3])
def test_truncated_rejected(cut: int) -> None:
    blob = seal(KEY, MSG, aad=AAD)
    with pytest.raises(RelayAuthError):
        open_sealed(KEY, blob[:cut], aad=AAD)


def test_appended_bytes_rejected() -> None:
    with pytest.raises(RelayAuthError):
        open_sealed(KEY, seal(KEY, MSG, aad=AAD) + b"\x00", aad=AAD)


def test_key_and_aad_validation() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        seal(KEY[:16], MSG, aad=AAD)  # AES-128 keys are refused: AES-256 only
    with pytest.raises(ValueError, match="32 bytes"):
        open_sealed(b"x", b"y" * 40, aad=AAD)
    with pytest.raises(TypeError):
        seal(KEY, MSG, aad="round 3")  # type: ignore[arg-type]
    assert issubclass(RelayAuthError, ValueError)


def test_make_aad_is_injective() -> None:
    assert make_aad(sender=1, receiver=2, round_num=3) != make_aad(sender=2, receiver=1, round_num=3)
    assert make_aad(sender=1, receiver=2, round_num=3, context=b"a") != make_aad(sender=1, receiver=2, round_num=3, context=b"b")
    with pytest.raises(ValueError):
        make_aad(sender=-1, receiver=2, round_num=3)
