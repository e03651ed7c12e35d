"""DDP-SA message vocabulary: the round parameters of the train message and the share receipt of the reply.

Every ``ddpsa-*`` key lives here as a private constant; :mod:`strategies.ddpsa` and :mod:`client.methods.ddpsa`
use only the classes below.  One round:

* ``query.ddpsa_identity`` server -> client (once per node): the reply is a :class:`RosterName`;
* ``train`` server -> client: the global model, :class:`~protocols.wire.common.TrainIns` and :class:`DdpsaRound`
  (``eps_t``, the noise mode and a Gaussian round's multiplier, the participants' roster names, the intermediate
  servers in share order, the run id and the fixed-point codec);
* ``train`` client -> server: no arrays; metrics and a :class:`ShareReceipt` (roster name, bytes, time).

The servers listed in :class:`DdpsaRound` are only compared with the client's own configuration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocols.methods.ddpsa import NOISE_MODES as DDPSA_NOISE_MODES
from protocols.secret_sharing import FixedPointCodec
from protocols.wire.common import read_float, read_int, read_list, read_str

#: The query action (message type ``query.ddpsa_identity``) that asks a node for its roster name.
IDENTITY_ACTION = "ddpsa_identity"

_EPSILON = "ddpsa-epsilon"
_NOISE = "ddpsa-noise"
_PARTICIPANTS = "ddpsa-participants"
_SERVERS = "ddpsa-servers"
_THRESHOLD = "ddpsa-threshold"
_RUN_ID = "ddpsa-run-id"
_FRAC_BITS = "ddpsa-frac-bits"
_MAX_CLIENTS = "ddpsa-max-clients"
_MULTIPLIER = "ddpsa-noise-multiplier"
#: The reply record that names the client (:meth:`ShareReceipt.to_config`, :meth:`RosterName.to_config`).
RECEIPT = "ddpsa-receipt"
_CLIENT = "ddpsa-client"
SHARE_BYTES = "share_bytes"
_SHARE_TIME = "share_time_s"


@dataclass(frozen=True)
class DdpsaRound:
    """``train``, server -> client: how to noise, encode and share this round's gradient sum.

    ``servers[j]`` (``host:port``) receives share ``j``; the codec built from
    ``frac_bits``/``max_clients`` must be the one the parameter server decodes with.
    ``noise`` is ``"distributed"`` or ``"local"`` (run-config ``ddpsa-noise``); ``participants``
    are the roster names of the round's participants (distinct; the distributed noise is split
    over them).  ``multiplier``: a ``"gaussian"`` round's noise multiplier ``z`` (> 0; 0 for Laplace rounds, whose
    noise scale ``epsilon`` sets).  ``threshold`` servers reconstruct: equal to ``len(servers)`` for additive
    shares, smaller for Shamir shares.
    """

    epsilon: float
    noise: str
    participants: tuple[str, ...]
    servers: tuple[str, ...]
    threshold: int
    run_id: str
    frac_bits: int
    max_clients: int
    multiplier: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"'{_EPSILON}' must be a positive finite number, got {self.epsilon!r}")
        if self.noise not in DDPSA_NOISE_MODES:
            raise ValueError(f"'{_NOISE}' must be one of {DDPSA_NOISE_MODES}, got {self.noise!r}")
        gaussian = self.noise == "gaussian"
        if not math.isfinite(self.multiplier) or (self.multiplier > 0) != gaussian or self.multiplier < 0:
            raise ValueError(f"'{_MULTIPLIER}' must be > 0 for a gaussian round and 0 otherwise, got "
                             f"{self.multiplier!r} ({self.noise})")
        if not self.participants or len(set(self.participants)) != len(self.participants):
            raise ValueError(f"'{_PARTICIPANTS}' must be non-empty and distinct, got {list(self.participants)}")
        if len(self.servers) < 2:
            raise ValueError(f"'{_SERVERS}' must name at least 2 intermediate servers, got {len(self.servers)}")
        if any(not s or s != s.strip() for s in self.servers):
            raise ValueError(f"'{_SERVERS}' holds an empty or padded address: {list(self.servers)}")
        if not 2 <= self.threshold <= len(self.servers):
            raise ValueError(f"'{_THRESHOLD}' must be in [2, {len(self.servers)}], got {self.threshold!r}")
        if not self.run_id:
            raise ValueError(f"'{_RUN_ID}' must not be empty")
        try:
            self.codec()
        except ValueError as err:
            raise ValueError(f"'{_FRAC_BITS}'/'{_MAX_CLIENTS}': {err}") from None

    @property
    def shamir_threshold(self) -> int | None:
        """``threshold`` for Shamir sharing, None for additive (all servers needed)."""
        return None if self.threshold == len(self.servers) else self.threshold

    def codec(self) -> FixedPointCodec:
        """The fixed-point codec both sides encode and decode with."""
        return FixedPointCodec(frac_bits=self.frac_bits, max_clients=self.max_clients)

    def to_config(self) -> dict[str, Any]:
        return {
            _EPSILON: float(self.epsilon),
            _NOISE: self.noise,
            _PARTICIPANTS: list(self.participants),
            _SERVERS: list(self.servers),
            _THRESHOLD: int(self.threshold),
            _RUN_ID: self.run_id,
            _FRAC_BITS: int(self.frac_bits),
            _MAX_CLIENTS: int(self.max_clients),
            _MULTIPLIER: float(self.multiplier),
        }

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> DdpsaRound:
        return cls(
            read_float(rec, _EPSILON),
            read_str(rec, _NOISE),
            tuple(read_list(rec, _PARTICIPANTS, str)),
            tuple(read_list(rec, _SERVERS, str)),
            read_int(rec, _THRESHOLD),
            read_str(rec, _RUN_ID),
            read_int(rec, _FRAC_BITS),
            read_int(rec, _MAX_CLIENTS),
            read_float(rec, _MULTIPLIER, default=0.0),
        )


@dataclass(frozen=True)
class ShareReceipt:
    """``train`` reply: the roster name the shares were pushed under, how many bytes, and how long it took."""

    client: str
    share_bytes: int
    share_time_s: float

    def to_config(self) -> dict[str, Any]:
        """The reply's :data:`RECEIPT` record: the client's roster name (the figures go in its metrics)."""
        return {_CLIENT: self.client}

    @staticmethod
    def client_of(content: Mapping[str, Any]) -> str:
        """The roster name a DDP-SA train reply's shares were pushed under (ValueError if it names none)."""
        rec = content.get(RECEIPT)
        if not isinstance(rec, Mapping):
            raise ValueError(f"DDP-SA reply without '{RECEIPT}'")
        return read_str(rec, _CLIENT)

    def to_metrics(self) -> dict[str, float]:
        """Figures to merge into the reply's metrics."""
        return {SHARE_BYTES: float(self.share_bytes), _SHARE_TIME: float(self.share_time_s)}

    @classmethod
    def from_reply(cls, content: Mapping[str, Any]) -> ShareReceipt | None:
        """The receipt a reply's content carries (None if it carries none: not a DDP-SA reply)."""
        metrics = content["metrics"]
        if SHARE_BYTES not in metrics:
            return None
        return cls(cls.client_of(content), int(read_float(metrics, SHARE_BYTES)), read_float(metrics, _SHARE_TIME))


@dataclass(frozen=True)
class RosterName:
    """``query.ddpsa_identity`` reply: the roster name a node signs its pushes with."""

    name: str

    def to_config(self) -> dict[str, Any]:
        """The reply's :data:`RECEIPT` record."""
        return {_CLIENT: self.name}

    @classmethod
    def from_content(cls, content: Mapping[str, Any]) -> RosterName:
        """ValueError if the reply names nobody."""
        return cls(ShareReceipt.client_of(content))
