"""NISS message vocabulary: the share phase and the relayed inbox of the train message.

Every ``niss-*`` key lives here as a private constant; :mod:`strategies.niss` and :mod:`client.methods.niss` use
only the classes below.  Decoders validate, raise ``ValueError`` naming the key, and ignore other keys, so one
config can carry several parts.  One round:

* ``query.shares`` server -> client: :class:`ShareRequest` (weight ``p_k``, the participants' reported sizes);
* ``query.shares`` client -> server: :class:`ShareReply` (one sealed payload per neighbour, in neighbour order);
* ``train`` server -> client: the global model and a :class:`RelayedInbox` (this client's ciphertexts);
* ``train`` client -> server: the upload with :class:`NissMetrics`, or only :class:`AuthFailures` when a relayed
  payload could not be opened.

The train message may also carry the next round's :class:`ShareRequest` in the record :data:`AHEAD_RECORD`, and
the upload then the :class:`ShareReply` to it in a record of the same name: the next round needs no
``query.shares`` phase for the clients that answered it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocols.wire.common import (
    DIAGNOSTICS_ENV,
    TrainIns,
    diagnostics_allowed,
    merge_configs,
    node_id_strings,
    read_float,
    read_list,
    read_node_ids,
)
from protocols.wire.keys import MaskProbe, PeerKeys

_WEIGHT = "niss-weight"
_SIZE_IDS = "niss-size-ids"
_SIZES = "niss-sizes"
_NOISE_SCALE = "niss-noise-scale"
_TO = "niss-to"
_FROM = "niss-from"
_PAYLOADS = "niss-payloads"
_AUTH_FAILED = "niss-auth-failed"
_AUTH_REASON = "niss-auth-reason"
_SIGMA = "niss-sigma"
_TAU = "niss-tau"
_SHARES = "niss-shares"
_RECEIVED_VAR = "niss-received-var"
_DIAGNOSTIC = "diagnostic"
#: Record of a train message (reply) holding the next round's share request (reply).
AHEAD_RECORD = "niss-ahead"


def _check_weight(weight: float) -> None:
    if not (math.isfinite(weight) and 0 < weight <= 1):
        raise ValueError(f"'{_WEIGHT}' must be in (0, 1], got {weight!r}")


def _check_lengths(ids: Sequence, items: Sequence, id_key: str, items_key: str) -> None:
    if len(ids) != len(items):
        raise ValueError(f"'{id_key}' names {len(ids)} nodes but '{items_key}' holds {len(items)} entries")


# ---------------------------------------------------------------------------- share phase
@dataclass(frozen=True)
class ShareRequest:
    """``query.shares``, server -> client: the round, the weight ``p_k`` to calibrate ``sigma_k`` for, the neighbours.

    ``peers`` names the neighbours (the tracker's list for this client) and
    their public keys, from which the client derives the relay keys.  ``sizes``
    are the round's participants' dataset sizes as they reported them with their
    keys (empty = not sent): the client checks its own entry and derives the
    distortion that protects the published model from them
    (:func:`protocols.niss.client_tau`; a wrong size can only raise it).  ``noise_scale``: the factor on
    every ``sigma_k`` the round's joint view needs (:func:`protocols.floor.niss_floor`; a client refuses less).
    """

    round: int
    weight: float
    peers: PeerKeys
    sizes: Mapping[int, int] = field(default_factory=dict)
    noise_scale: float = 1.0

    def __post_init__(self) -> None:
        _check_weight(self.weight)
        if any(int(n) < 1 for n in self.sizes.values()):
            raise ValueError(f"'{_SIZES}' must hold dataset sizes >= 1")
        if not (math.isfinite(self.noise_scale) and self.noise_scale > 0):
            raise ValueError(f"'{_NOISE_SCALE}' must be finite and > 0, got {self.noise_scale!r}")

    def to_config(self) -> dict[str, Any]:
        ids = sorted(self.sizes)
        sizes = {_SIZE_IDS: node_id_strings(ids), _SIZES: [int(self.sizes[n]) for n in ids]} if ids else {}
        return merge_configs(TrainIns(self.round).to_config(), self.peers.to_config(),
                             {_WEIGHT: float(self.weight), _NOISE_SCALE: float(self.noise_scale), **sizes})

    @classmethod
    def from_config(cls, rec: Mapping) -> ShareRequest:
        ids = read_node_ids(rec, _SIZE_IDS, default=())
        sizes = read_list(rec, _SIZES, int, default=[])
        _check_lengths(ids, sizes, _SIZE_IDS, _SIZES)
        return cls(TrainIns.from_config(rec).round, read_float(rec, _WEIGHT), PeerKeys.from_config(rec),
                   dict(zip(ids, sizes, strict=True)), read_float(rec, _NOISE_SCALE, default=1.0))


@dataclass(frozen=True)
class ShareReply:
    """``query.shares``, client -> server: one sealed payload per neighbour, in the tracker's neighbour order."""

    to_ids: tuple[int, ...]
    payloads: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _check_lengths(self.to_ids, self.payloads, _TO, _PAYLOADS)

    def to_config(self) -> dict[str, Any]:
        return {_TO: node_id_strings(self.to_ids), _PAYLOADS: list(self.payloads)}

    @classmethod
    def from_config(cls, rec: Mapping) -> ShareReply:
        return cls(read_node_ids(rec, _TO), tuple(read_list(rec, _PAYLOADS, bytes)))


# -------------------------------------------------------------------------------- train
@dataclass(frozen=True)
class RelayedInbox:
    """``train``, server -> client (with the global model): the ciphertexts addressed to this client.

    ``from_ids[i]`` sent ``payloads[i]``.  The weight ``p_k`` is sent again so
    that the client can check it did not change between the phases (``sigma_k``
    was calibrated for it); ``probe_seed`` is the public direction of the
    cancellation check.
    """

    round: int
    weight: float
    from_ids: tuple[int, ...]
    payloads: tuple[bytes, ...]
    probe_seed: bytes

    def __post_init__(self) -> None:
        _check_weight(self.weight)
        _check_lengths(self.from_ids, self.payloads, _FROM, _PAYLOADS)

    def to_config(self) -> dict[str, Any]:
        return merge_configs(TrainIns(self.round).to_config(), MaskProbe(self.probe_seed).to_config(),
                             {_WEIGHT: float(self.weight), _FROM: node_id_strings(self.from_ids),
                                           _PAYLOADS: list(self.payloads)})

    @classmethod
    def from_config(cls, rec: Mapping) -> RelayedInbox:
        return cls(TrainIns.from_config(rec).round, read_float(rec, _WEIGHT), read_node_ids(rec, _FROM),
                   tuple(read_list(rec, _PAYLOADS, bytes)), MaskProbe.from_config(rec).seed)


@dataclass(frozen=True)
class AuthFailures:
    """``train``, client -> server: relayed payloads the client rejected (sender, reason); it uploaded nothing.

    Sender 0 stands for a problem with the inbox as a whole (no node has id 0).
    """

    senders: tuple[int, ...]
    reasons: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_lengths(self.senders, self.reasons, _AUTH_FAILED, _AUTH_REASON)

    def __bool__(self) -> bool:
        return bool(self.senders)

    def to_config(self) -> dict[str, Any]:
        return {_AUTH_FAILED: node_id_strings(self.senders), _AUTH_REASON: list(self.reasons)}

    @classmethod
    def from_config(cls, rec: Mapping) -> AuthFailures:
        """The report in a train reply's config; empty when the reply carries none."""
        if _AUTH_FAILED not in rec:
            return cls((), ())
        return cls(read_node_ids(rec, _AUTH_FAILED), tuple(read_list(rec, _AUTH_REASON, str)))

    def describe(self, receiver: int) -> list[str]:
        """One ``"sender -> receiver: reason"`` line per rejected payload."""
        return [f"{s} -> {receiver}: {why}" for s, why in zip(self.senders, self.reasons, strict=True)]


@dataclass(frozen=True)
class NissMetrics:
    """The NISS figures in a train reply's metrics.

    ``sigma_k``, ``tau_k``, the number of own shares and (cancellation-check only)
    the total variance of the shares received.
    """

    sigma: float
    tau: float
    shares: int
    received_var: float | None = None

    def to_metrics(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {_SIGMA: float(self.sigma), _TAU: float(self.tau), _SHARES: int(self.shares)}
        if self.received_var is not None:
            out[_RECEIVED_VAR] = float(self.received_var)
        return out

    @classmethod
    def from_metrics(cls, rec: Mapping) -> NissMetrics:
        return cls(read_float(rec, _SIGMA), read_float(rec, _TAU), int(read_float(rec, _SHARES)),
                   read_float(rec, _RECEIVED_VAR, default=None))


@dataclass(frozen=True)
class Diagnostic:
    """DIAGNOSTIC ONLY (run-config ``cancellation-check`` on a node allowing it): the noiseless update ``p_k w_k``.

    Travels as a side record of the train reply so that the server can measure the aggregate noise; it hands
    the server the unprotected update, so a client sends it only where :func:`diagnostics_allowed` and then
    charges the round's upload as un-noised.
    """

    #: the client's ``ArrayRecord`` (any mapping of named arrays, :mod:`protocols.wire.arrays`).
    update: Mapping

    def add_to(self, content: MutableMapping) -> None:
        """Put the record into a train reply's content."""
        content[_DIAGNOSTIC] = self.update

    @classmethod
    def from_content(cls, content: Mapping) -> Diagnostic | None:
        """The diagnostic record of a train reply (None when it carries none)."""
        return cls(content[_DIAGNOSTIC]) if _DIAGNOSTIC in content else None


__all__ = ["AHEAD_RECORD", "DIAGNOSTICS_ENV", "AuthFailures", "Diagnostic", "NissMetrics", "RelayedInbox", "ShareReply",
           "ShareRequest", "diagnostics_allowed"]
