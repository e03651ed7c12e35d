"""Messages of the signed consistency check (``query.consistency``) of the double-masked methods (nadp, niss, mpddp).

* :class:`ConsistencyRequest` (server -> every participant whose upload arrived, only in rounds whose unmasking
  declares some upload not aggregated): the round's outcome, the sets the recovery request will carry.
* :class:`ConsistencyReply` (client -> server): its roster name and Ed25519 signature over
  :func:`protocols.consistency.consistency_statement`, or a refusal naming why.
* :class:`SignedOutcomes` (server -> client, record :data:`CONSISTENCY_RECORD` of the ``query.recover`` message):
  the collected signatures a client checks before revealing pair material.

Flower-free: ``to_config`` returns a plain dict (wrap it in a ``ConfigRecord``), ``from_config`` reads any mapping
and raises ``ValueError`` naming a malformed key.  Protocol: :mod:`protocols.consistency`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from protocols.consistency import SignedOutcome
from protocols.identity import SIGNATURE_BYTES

#: Record of the ``query.recover`` message holding :class:`SignedOutcomes`.
CONSISTENCY_RECORD = "consistency"
_ROUND, _RECEIVED, _DROPPED, _EXCLUDED = "round", "outcome-received", "outcome-dropped", "outcome-excluded"
_NAME, _SIGNATURE, _REFUSED = "signer-name", "signature", "refused"
_SIGNERS, _NAMES, _SIGNATURES = "signers", "signer-names", "signatures"


def _ids(rec: Mapping[str, Any], key: str, *, required: bool = False) -> tuple[int, ...]:
    if key not in rec:
        if required:
            raise ValueError(f"message lacks '{key}'")
        return ()
    raw = rec[key]
    if not isinstance(raw, list | tuple) or not all(isinstance(x, str) and x.isdigit() for x in raw):
        raise ValueError(f"'{key}' must be a list of decimal node ids")
    ids = tuple(int(x) for x in raw)
    if len(set(ids)) != len(ids) or any(n >= 2**64 for n in ids):
        raise ValueError(f"'{key}' repeats a node or holds one out of range")
    return ids


def _strings(ids: Iterable[int]) -> list[str]:
    return [str(int(n)) for n in ids]


@dataclass(frozen=True)
class ConsistencyRequest:
    """``query.consistency``: sign the round's outcome (the server holds ``received``, not ``dropped``)."""

    round: int
    received: tuple[int, ...]
    dropped: tuple[int, ...] = ()
    excluded: tuple[int, ...] = ()

    def to_config(self) -> dict[str, Any]:
        rec: dict[str, Any] = {_ROUND: int(self.round), _RECEIVED: _strings(self.received)}
        if self.dropped:  # Flower cannot serialise empty lists
            rec[_DROPPED] = _strings(self.dropped)
        if self.excluded:
            rec[_EXCLUDED] = _strings(self.excluded)
        return rec

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> ConsistencyRequest:
        rnd = rec.get(_ROUND)
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise ValueError(f"'{_ROUND}' must be a non-negative integer")
        return cls(rnd, _ids(rec, _RECEIVED, required=True), _ids(rec, _DROPPED), _ids(rec, _EXCLUDED))


@dataclass(frozen=True)
class ConsistencyReply:
    """A client's signature of the outcome (under its roster ``name``), or a refusal."""

    name: str = ""
    signature: bytes = b""
    refused: str = ""

    def to_config(self) -> dict[str, Any]:
        if self.refused:
            return {_REFUSED: self.refused}
        return {_NAME: self.name, _SIGNATURE: bytes(self.signature)}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> ConsistencyReply:
        if _REFUSED in rec:
            return cls(refused=str(rec[_REFUSED]) or "refused")
        name, sig = rec.get(_NAME), rec.get(_SIGNATURE)
        if not isinstance(name, str) or not name:
            raise ValueError(f"'{_NAME}' must be a non-empty string")
        if not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
            raise ValueError(f"'{_SIGNATURE}' must be {SIGNATURE_BYTES} bytes")
        return cls(name, sig)


@dataclass(frozen=True)
class SignedOutcomes:
    """Signatures collected in the consistency phase, sent with the recovery request (checked by the client)."""

    entries: tuple[SignedOutcome, ...] = ()

    def to_config(self) -> dict[str, Any]:
        if not self.entries:
            return {}
        return {_SIGNERS: _strings(e.node for e in self.entries), _NAMES: [e.name for e in self.entries],
                _SIGNATURES: [bytes(e.signature) for e in self.entries]}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> SignedOutcomes:
        nodes = _ids(rec, _SIGNERS)
        names, sigs = list(rec.get(_NAMES, [])), list(rec.get(_SIGNATURES, []))
        if not (len(nodes) == len(names) == len(sigs)):
            raise ValueError(f"'{_SIGNERS}', '{_NAMES}' and '{_SIGNATURES}' must be equally long")
        if not all(isinstance(n, str) for n in names) or not all(isinstance(s, bytes) for s in sigs):
            raise ValueError(f"'{_NAMES}' must hold strings and '{_SIGNATURES}' bytes")
        return cls(tuple(SignedOutcome(n, name, s) for n, name, s in zip(nodes, names, sigs, strict=True)))
