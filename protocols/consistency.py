"""Signed consistency check of the unmasking phase (SecAgg+'s malicious-setting check, Bell et al. 2020).

Before a survivor reveals its pair material with a neighbour ``k`` that the server declares dropped (or
excluded), it needs proof that enough of ``k``'s neighbours were shown the same outcome of the round.  Each
survivor signs, with its Ed25519 roster identity, one :func:`outcome_digest` per round (the received, dropped
and excluded sets) over :func:`consistency_statement`; it reveals pair material for ``k`` only with valid
signatures on the digest it signed itself from at least :func:`protocols.masking.signatures_needed` of ``k``'s
present neighbours (:func:`valid_signers`).

Why it closes the split lie: the server needs ``t`` shares of ``k``'s self-mask (from honest neighbours shown
``k`` received, plus up to ``c`` colluders) and ``s`` signatures of an outcome without ``k`` (from other honest
neighbours, plus the colluders).  An honest neighbour signs one outcome and answers only that one, so both need
``t + s <= d + c``; ``s = d + c - t + 1`` makes that impossible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocols.identity import SIGNATURE_BYTES
from protocols.keyagreement import _lp, _u64

__all__ = ["SignedOutcome", "consistency_statement", "outcome_digest", "valid_signers"]

_OUTCOME = b"cancelfl/round-outcome/v1"
_STATEMENT = b"cancelfl/consistency-statement/v1"


def outcome_digest(round_num: int, received: Iterable[int], dropped: Iterable[int], excluded: Iterable[int]) -> bytes:
    """SHA-256 of a round's outcome as the server declares it: the sorted received, dropped and excluded sets."""
    h = hashlib.sha256(_OUTCOME + _u64(round_num, "round_num"))
    for label, nodes in ((b"received", received), (b"dropped", dropped), (b"excluded", excluded)):
        ids = sorted({int(n) for n in nodes})
        h.update(_lp(label) + _u64(len(ids), "count") + b"".join(_u64(n, "node") for n in ids))
    return h.digest()


def consistency_statement(*, run_id: int, round_num: int, name: str, node_id: int, digest: bytes) -> bytes:
    """The bytes a survivor signs: run, round, its roster name and node id, and the outcome digest it was shown."""
    if len(digest) != 32:
        raise ValueError(f"outcome digest must be 32 bytes, got {len(digest)}")
    return (_STATEMENT + _u64(run_id, "run_id") + _u64(round_num, "round_num") + _lp(name.encode())
            + _u64(node_id, "node_id") + bytes(digest))


@dataclass(frozen=True)
class SignedOutcome:
    """One survivor's signature on an outcome digest (the digest itself is not sent: the verifier has its own)."""

    node: int
    name: str
    signature: bytes


def valid_signers(roster: Mapping[str, bytes], signatures: Iterable[SignedOutcome], eligible: Mapping[int, str], *,
                  run_id: int, round_num: int, digest: bytes) -> set[int]:
    """The nodes of ``eligible`` (node id -> roster name) with a valid signature on ``digest`` among ``signatures``.

    A signature counts only under the roster name ``eligible`` gives its node, with that name's roster key;
    unknown names, wrong lengths and forgeries are ignored.
    """
    out = set()
    for sig in signatures:
        name = eligible.get(sig.node)
        if name is None or name != sig.name or name not in roster or len(sig.signature) != SIGNATURE_BYTES:
            continue
        statement = consistency_statement(run_id=run_id, round_num=round_num, name=name, node_id=sig.node,
                                          digest=digest)
        try:
            Ed25519PublicKey.from_public_bytes(bytes(roster[name])).verify(bytes(sig.signature), statement)
        except (InvalidSignature, ValueError):
            continue
        out.add(sig.node)
    return out
