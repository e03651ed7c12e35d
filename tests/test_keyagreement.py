"""Tests for protocols.keyagreement: X25519 agreement and HKDF pair-seed separation."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os

import pytest

from protocols.keyagreement import (
    KeyAgreementError,
    KeyPair,
    agree,
    derive_pair_seed,
    generate_keypair,
    keypair_from_private,
)

# RFC 7748 section 6.1 test vector
ALICE_PRIV = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
ALICE_PUB = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
BOB_PRIV = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
BOB_PUB = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
RFC_SHARED = bytes.fromhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")

# Curve25519 points of small order (0, 1, order-8 points, p-1, p, p+1), canonical and with
# the (ignored) top bit set: X25519 with any of them yields the all-zero secret.
_LOW_ORDER = [
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0100000000000000000000000000000000000000000000000000000000000000",
    "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
    "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
]
LOW_ORDER = [bytes.fromhex(h) for h in _LOW_ORDER] + [
    bytes.fromhex(h)[:31] + bytes([bytes.fromhex(h)[31] | 0x80]) for h in _LOW_ORDER
]


def _seed(shared: bytes, **kw: object) -> bytes:
    args: dict = {"purpose": "noise", "round_num": 3, "node_a": 5, "node_b": 9, "context": b"run"}
    args.update(kw)
    return derive_pair_seed(shared, **args)


def test_rfc7748_vector() -> None:
    alice, bob = keypair_from_private(ALICE_PRIV), keypair_from_private(BOB_PRIV)
    assert alice.public_bytes == ALICE_PUB and bob.public_bytes == BOB_PUB
    assert agree(alice, BOB_PUB) == RFC_SHARED
    assert agree(bob, ALICE_PUB) == RFC_SHARED


def test_generate_and_restore_keypair() -> None:
    kp = generate_keypair()
    assert isinstance(kp, KeyPair)
    assert len(kp.private_bytes) == 32 and len(kp.public_bytes) == 32
    assert keypair_from_private(kp.private_bytes) == kp
    assert generate_keypair().private_bytes != kp.private_bytes
    assert kp.private_bytes.hex() not in repr(kp)  # no private key in logs


def test_both_ends_derive_same_seed() -> None:
    """(a) i and j derive the same 32-byte seed, independent of argument order."""
    i, j = generate_keypair(), generate_keypair()
    s_ij = agree(i, j.public_bytes)
    s_ji = agree(j, i.public_bytes)
    assert s_ij == s_ji
    seed_i = derive_pair_seed(s_ij, purpose="noise", round_num=7, node_a=11, node_b=42)
    seed_j = derive_pair_seed(s_ji, purpose="noise", round_num=7, node_a=42, node_b=11)
    assert seed_i == seed_j and len(seed_i) == 32


def test_seed_separation() -> None:
    """(a) different pairs / rounds / purposes / contexts give pairwise-distinct seeds."""
    shared = agree(generate_keypair(), generate_keypair().public_bytes)
    seeds = {}
    for purpose, rnd, pair, ctx in itertools.product(
        ["noise", "relay", "mask"], [0, 1, 2**40], [(1, 2), (1, 3), (2, 3)], [b"", b"run-a", b"run-b"]
    ):
        seeds[(purpose, rnd, pair, ctx)] = _seed(
            shared, purpose=purpose, round_num=rnd, node_a=pair[0], node_b=pair[1], context=ctx
        )
    assert len(set(seeds.values())) == len(seeds)
    # a different shared secret gives different seeds for identical labels
    other = agree(generate_keypair(), generate_keypair().public_bytes)
    assert _seed(other) != _seed(shared)


def test_info_encoding_is_unambiguous() -> None:
    """Length prefixes: shifting bytes between purpose and context changes the seed."""
    shared = RFC_SHARED
    assert _seed(shared, purpose="ab", context=b"c") != _seed(shared, purpose="a", context=b"bc")
    assert _seed(shared, node_a=1, node_b=256) != _seed(shared, node_a=256, node_b=65536)


def _hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """Independent RFC 5869 implementation used as an oracle for the documented format."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    okm, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def test_pair_seed_known_answer() -> None:
    """Pinned output + documented wire format: every client version must agree bit for bit."""
    seed = derive_pair_seed(RFC_SHARED, purpose="noise", round_num=1, node_a=2, node_b=1, context=b"run-0")
    assert seed.hex() == "2e2cda3c4717463e2106097d442ecd9764a1f539b56748370d68be12c02806be"
    info = (
        b"cancelfl/pair-seed/v1"
        + (5).to_bytes(4, "big") + b"noise"
        + (1).to_bytes(8, "big")
        + (1).to_bytes(8, "big") + (2).to_bytes(8, "big")
        + (5).to_bytes(4, "big") + b"run-0"
    )  # fmt: skip
    assert seed == _hkdf_sha256(RFC_SHARED, b"cancelfl/pair-seed/v1/salt", info, 32)


@pytest.mark.parametrize("key", LOW_ORDER, ids=lambda k: k.hex()[:8] + ".." + k.hex()[-2:])
def test_low_order_points_rejected(key: bytes) -> None:
    """(e) small-order public keys are refused with a clear KeyAgreementError."""
    with pytest.raises(KeyAgreementError, match="small-order"):
        agree(generate_keypair(), key)


@pytest.mark.parametrize("key", [b"", b"\x09" * 31, b"\x09" * 33, b"\x09" * 64])
def test_wrong_length_rejected(key: bytes) -> None:
    """(e) wrong-length public keys are refused with KeyAgreementError."""
    with pytest.raises(KeyAgreementError, match="exactly 32 bytes"):
        agree(generate_keypair(), key)


@pytest.mark.parametrize("key", [None, "8520f0098930a754", 12345, [1] * 32])
def test_wrong_type_rejected(key: object) -> None:
    with pytest.raises(KeyAgreementError, match="32 raw bytes"):
        agree(generate_keypair(), key)  # type: ignore[arg-type]


def test_reflected_own_key_rejected() -> None:
    kp = generate_keypair()
    with pytest.raises(KeyAgreementError, match="own public key"):
        agree(kp, kp.public_bytes)


def test_keyagreement_error_is_value_error() -> None:
    assert issubclass(KeyAgreementError, ValueError)


def test_malformed_private_key_rejected() -> None:
    with pytest.raises(KeyAgreementError):
        keypair_from_private(b"\x01" * 31)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"node_a": 4, "node_b": 4}, ValueError),
        ({"node_a": -1}, ValueError),
        ({"node_b": 2**64}, ValueError),
        ({"round_num": -1}, ValueError),
        ({"purpose": ""}, ValueError),
        ({"purpose": b"noise"}, ValueError),
        ({"node_a": True}, TypeError),
        ({"node_a": 1.5}, TypeError),
        ({"context": "run"}, TypeError),
    ],
)
def test_derive_pair_seed_validation(kwargs: dict, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        _seed(RFC_SHARED, **kwargs)


def test_derive_pair_seed_rejects_bad_secret() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        _seed(RFC_SHARED[:16])
    with pytest.raises(KeyAgreementError, match="all zero"):
        _seed(bytes(32))


def test_large_node_ids_supported() -> None:
    """Flower node ids are uint64: the full range must work and stay symmetric."""
    a, b = 2**64 - 1, 2**63
    assert _seed(RFC_SHARED, node_a=a, node_b=b) == _seed(RFC_SHARED, node_a=b, node_b=a)


def test_hkdf_matches_rfc5869_and_cryptography() -> None:
    """hkdf_sha256_32 is RFC 5869 HKDF-SHA256 (test case 1, first 32 bytes) and equals cryptography's HKDF."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from protocols.keyagreement import hkdf_sha256_32

    okm = hkdf_sha256_32(b"\x0b" * 22, salt=bytes(range(13)), info=bytes(range(0xF0, 0xFA)))
    assert okm.hex() == "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
    for k in range(20):
        ikm, salt, info = os.urandom(32), os.urandom(k), os.urandom(3 * k)
        want = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt or None, info=info).derive(ikm)
        assert hkdf_sha256_32(ikm, salt=salt, info=info) == want
