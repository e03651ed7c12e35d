"""Messages of the key phase shared by the pairwise-noise methods (nadp, niss, mpddp).

* :class:`KeyRequest` (server -> client, ``query.keys``): make the key pair of this key epoch (and, while
  the server holds no roster, send the roster this node trusts).
* :class:`KeyReply` (client -> server): the X25519 public half, its owner's roster name and Ed25519
  signature over it (:func:`protocols.identity.key_statement`), plus ``|D_i|`` for methods that need it,
  the digest of the roster it trusts and, when asked, the roster file's text.
* :class:`PeerKeys` (server -> client, with a later message of the round): the
  neighbours' ids, public keys, roster names and signatures, the key epoch they
  belong to, the round's participant ids with their roster names, and its public graph and probe seeds
  (the client binds participants and graph seed into its pair seeds: the view).
* :class:`MaskProbe` and :func:`probe_metric` / :func:`probe_value`: the
  optional cancellation check (public random direction; the projection of a
  client's pairwise mask on it, reported as a train metric).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocols.identity import SIGNATURE_BYTES
from protocols.keyagreement import KEY_BYTES
from protocols.wire.common import (
    TrainIns,
    merge_configs,
    node_id_strings,
    read_bytes,
    read_int,
    read_list,
    read_node_ids,
    read_str,
)

_KEY_EPOCH = "key-epoch"
_PUBLIC_KEY = "public-key"
_NUM_EXAMPLES = "num-examples"
_PEER_IDS = "peer-ids"
_PEER_KEYS = "peer-keys"
_GRAPH_SEED = "graph-seed"
_PROBE_SEED = "probe-seed"
_MASK_PROBE = "mask-probe"
_NAME = "identity-name"
_SIGNATURE = "key-signature"
_PEER_NAMES = "peer-names"
_PEER_SIGNATURES = "peer-signatures"
_PARTICIPANTS = "participants"
_PARTICIPANT_NAMES = "participant-names"
_WANT_ROSTER = "want-roster"
_ROSTER = "roster"
_ROSTER_DIGEST = "roster-digest"


def _epoch(rec: Mapping[str, Any]) -> int:
    if _KEY_EPOCH not in rec:
        raise ValueError(f"message lacks '{_KEY_EPOCH}': cannot tell which key pair the peer keys belong to")
    return read_int(rec, _KEY_EPOCH, minimum=0)


@dataclass(frozen=True)
class KeyRequest:
    """``query.keys``: make (and keep) a key pair for ``key_epoch``; sent in round ``round``."""

    round: int
    key_epoch: int
    #: the server holds no roster yet: the reply carries the roster this node trusts.
    want_roster: bool = False

    def to_config(self) -> dict[str, Any]:
        rec = {_KEY_EPOCH: int(self.key_epoch)}
        if self.want_roster:
            rec[_WANT_ROSTER] = True
        return merge_configs(TrainIns(self.round).to_config(), rec)

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> KeyRequest:
        return cls(TrainIns.from_config(rec).round, _epoch(rec), rec.get(_WANT_ROSTER) is True)


@dataclass(frozen=True)
class KeyReply:
    """The client's public key of the requested epoch, signed by its roster identity ``name``, and ``|D_i|``."""

    public_key: bytes
    num_examples: int | None = None
    name: str = ""
    signature: bytes = b""
    #: :func:`protocols.identity.roster_digest` of the roster this node trusts (b"": not sent).
    roster_digest: bytes = b""
    #: the roster file's text (``cancelfl-roster/v1`` JSON) when the request asked for it, else "".
    roster: str = ""

    def to_config(self) -> dict[str, Any]:
        rec = {_PUBLIC_KEY: bytes(self.public_key), _NAME: self.name, _SIGNATURE: bytes(self.signature)}
        if self.num_examples is not None:
            rec[_NUM_EXAMPLES] = int(self.num_examples)
        if self.roster_digest:
            rec[_ROSTER_DIGEST] = bytes(self.roster_digest)
        if self.roster:
            rec[_ROSTER] = self.roster
        return rec

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> KeyReply:
        """Reject a key of the wrong length or all zeros (never usable for agreement), or one without a signature."""
        key = read_bytes(rec, _PUBLIC_KEY, length=KEY_BYTES)
        if not any(key):
            raise ValueError(f"'{_PUBLIC_KEY}' is all zeros")
        name = read_str(rec, _NAME)
        if not name:
            raise ValueError(f"'{_NAME}' is empty")
        return cls(key, read_int(rec, _NUM_EXAMPLES, minimum=1, default=None), name,
                   read_bytes(rec, _SIGNATURE, length=SIGNATURE_BYTES), read_bytes(rec, _ROSTER_DIGEST, length=32, default=b""),
                   read_str(rec, _ROSTER, default=""))


@dataclass(frozen=True)
class PeerKeys:
    """A client's neighbours of the round and their public keys of epoch ``key_epoch``.

    ``peer_names``/``peer_signatures`` are each key's roster name and its owner's
    signature (empty when the server sent none: the client then refuses, naming
    the node); ``participants`` are the round's participant ids and ``participant_names``
    their roster names (same order).
    ``graph_seed`` is the public seed the neighbour graph was drawn from
    (:func:`protocols.graphs.roster_round`), ``probe_seed`` the public direction
    of the cancellation check; either may be absent from a message that does
    not need it.
    """

    peer_ids: tuple[int, ...]
    peer_keys: tuple[bytes, ...]
    key_epoch: int
    graph_seed: bytes | None = None
    probe_seed: bytes | None = None
    peer_names: tuple[str, ...] = ()
    peer_signatures: tuple[bytes, ...] = ()
    participants: tuple[int, ...] = ()
    participant_names: tuple[str, ...] = ()

    def to_config(self) -> dict[str, Any]:
        rec = {
            _PEER_IDS: node_id_strings(self.peer_ids),
            _PEER_KEYS: [bytes(k) for k in self.peer_keys],
            _KEY_EPOCH: int(self.key_epoch),
        }
        # Flower cannot serialise empty lists: absent lists mean "none sent".
        if self.peer_names:
            rec[_PEER_NAMES] = list(self.peer_names)
        if self.peer_signatures:
            rec[_PEER_SIGNATURES] = [bytes(s) for s in self.peer_signatures]
        if self.participants:
            rec[_PARTICIPANTS] = node_id_strings(self.participants)
        if self.participant_names:
            rec[_PARTICIPANT_NAMES] = list(self.participant_names)
        if self.graph_seed is not None:
            rec[_GRAPH_SEED] = bytes(self.graph_seed)
        if self.probe_seed is not None:
            rec[_PROBE_SEED] = bytes(self.probe_seed)
        return rec

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> PeerKeys:
        ids = read_node_ids(rec, _PEER_IDS)
        keys = tuple(bytes(k) for k in read_list(rec, _PEER_KEYS, bytes))
        if len(ids) != len(keys):
            raise ValueError(f"{len(ids)} '{_PEER_IDS}' but {len(keys)} '{_PEER_KEYS}'")
        if len(set(ids)) != len(ids):
            raise ValueError(f"'{_PEER_IDS}' holds a node twice")
        names = tuple(read_list(rec, _PEER_NAMES, str, default=[]))
        sigs = tuple(bytes(s) for s in read_list(rec, _PEER_SIGNATURES, bytes, default=[]))
        for key, values in ((_PEER_NAMES, names), (_PEER_SIGNATURES, sigs)):
            if values and len(values) != len(ids):
                raise ValueError(f"{len(ids)} '{_PEER_IDS}' but {len(values)} '{key}'")
        participants = read_node_ids(rec, _PARTICIPANTS, default=())
        if len(set(participants)) != len(participants):
            raise ValueError(f"'{_PARTICIPANTS}' holds a node twice")
        part_names = tuple(read_list(rec, _PARTICIPANT_NAMES, str, default=[]))
        if part_names and len(part_names) != len(participants):
            raise ValueError(f"{len(participants)} '{_PARTICIPANTS}' but {len(part_names)} '{_PARTICIPANT_NAMES}'")
        return cls(ids, keys, _epoch(rec), read_bytes(rec, _GRAPH_SEED, default=None),
                   read_bytes(rec, _PROBE_SEED, default=None), names, sigs, tuple(participants), part_names)

    def name_of(self, index: int) -> str:
        """Roster name sent for the ``index``-th peer ('' if none)."""
        return self.peer_names[index] if self.peer_names else ""

    def signature_of(self, index: int) -> bytes:
        """Signature sent for the ``index``-th peer's key (b'' if none)."""
        return self.peer_signatures[index] if self.peer_signatures else b""


@dataclass(frozen=True)
class MaskProbe:
    """The public direction of the cancellation check (the same value as :attr:`PeerKeys.probe_seed`)."""

    seed: bytes

    def to_config(self) -> dict[str, Any]:
        return {_PROBE_SEED: bytes(self.seed)}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> MaskProbe:
        return cls(read_bytes(rec, _PROBE_SEED))


def probe_metric(value: float) -> dict[str, float]:
    """The train-reply metric carrying a client's mask projection (merge into its metrics)."""
    return {_MASK_PROBE: float(value)}


def probe_value(metrics: Mapping[str, Any]) -> float | None:
    """The mask projection a train reply reports (None if it reports none)."""
    return float(metrics[_MASK_PROBE]) if _MASK_PROBE in metrics else None
