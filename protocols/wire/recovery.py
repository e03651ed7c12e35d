"""Messages of the dropout-recovery phase (``query.recover``) of the pairwise-noise methods (nadp, niss, mpddp).

* :class:`RecoveryRequest` (server -> surviving client): the round, the participants whose uploads the
  server received and those it will not aggregate (dropped or excluded).
* :class:`RecoveryReply` (client -> server): for each dropped neighbour, this round's pair material
  (nadp, mpddp: the per-round HKDF pair seed; niss: a :class:`NissPairMaterial`), or a refusal naming
  why (:attr:`RecoveryReply.refused`).
* :class:`SelfMaskShares` (client -> server, with the upload): the sealed Shamir shares of the upload's
  self-mask seed (one per neighbour), a commitment to the seed and the mask's std (:mod:`protocols.masking`);
  the server forwards each neighbour its sealed shares with the recovery request (``forwarded``).
* With run-config ``unmask-next-round``, a round without dropouts is unmasked in the next round's train
  messages instead: the request and the reply travel in the record
  :data:`protocols.wire.common.UNMASK_RECORD`.
* :class:`NissPairMaterial`: what a NISS survivor's upload holds because of one dropped neighbour
  (its own shares sent to it, and the distorted negated shares received from it).

Protocol and threat model: :mod:`strategies.recovery` (server) and :mod:`client.recovery` (client).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.niss import SHARES_PER_NEIGHBOUR
from protocols.wire.common import (
    TrainIns,
    merge_configs,
    node_id_strings,
    read_float,
    read_list,
    read_node_ids,
    read_str,
)

_RECEIVED = "recovery-received"
_DROPPED = "recovery-dropped"
_EXCLUDED = "recovery-excluded"
_PEERS = "recovery-peers"
_MATERIAL = "recovery-material"
_REFUSED = "recovery-refused"
_KEPT = "recovery-kept"
_KEPT_PROBE = "recovery-kept-probe"
_FWD_FROM = "recovery-shares-from"
_FWD_BLOBS = "recovery-shares"
_MASK_PEERS = "recovery-mask-peers"
_MASK_SHARES = "recovery-mask-shares"
#: Key of the train reply's record holding :class:`SelfMaskShares`.
SELF_MASK_RECORD = "self-mask"
_SM_PEERS, _SM_SEALED, _SM_COMMIT, _SM_STD = "peers", "sealed-shares", "commitment", "std"


@dataclass(frozen=True)
class RecoveryRequest:
    """``query.recover``: the server received the uploads of ``received`` and none of ``dropped``.

    ``excluded`` (a subset of ``received``): uploads the server received but will not aggregate (its reply
    checks excluded them); their own noise must stay with them, so clients reveal less for them.
    """

    round: int
    received: tuple[int, ...]
    dropped: tuple[int, ...]
    excluded: tuple[int, ...] = ()
    #: self-masked methods: sender -> the sealed share of its self-mask seed it made for this recipient.
    forwarded: Mapping[int, bytes] | None = None

    def to_config(self) -> dict[str, Any]:
        rec = {_RECEIVED: node_id_strings(self.received)}
        if self.dropped:  # Flower cannot serialise empty lists
            rec[_DROPPED] = node_id_strings(self.dropped)
        if self.excluded:
            rec[_EXCLUDED] = node_id_strings(self.excluded)
        if self.forwarded:
            senders = sorted(self.forwarded)
            rec[_FWD_FROM] = node_id_strings(senders)
            rec[_FWD_BLOBS] = [bytes(self.forwarded[n]) for n in senders]
        return merge_configs(TrainIns(self.round).to_config(), rec)

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> RecoveryRequest:
        received, dropped = read_node_ids(rec, _RECEIVED), read_node_ids(rec, _DROPPED, default=())
        excluded = read_node_ids(rec, _EXCLUDED, default=())
        if any(len(set(ids)) != len(ids) for ids in (received, dropped, excluded)):
            raise ValueError(f"'{_RECEIVED}', '{_DROPPED}' and '{_EXCLUDED}' must not repeat a node")
        senders = read_node_ids(rec, _FWD_FROM, default=())
        blobs = tuple(bytes(b) for b in read_list(rec, _FWD_BLOBS, bytes, default=[]))
        if len(senders) != len(blobs) or len(set(senders)) != len(senders):
            raise ValueError(f"'{_FWD_FROM}' and '{_FWD_BLOBS}' must be equally long, senders distinct")
        forwarded = dict(zip(senders, blobs, strict=True)) if senders else None
        return cls(TrainIns.from_config(rec).round, received, dropped, excluded, forwarded)


@dataclass(frozen=True)
class RecoveryReply:
    """Pair material for each dropped neighbour (``peers[i]`` -> ``material[i]``), or a refusal.

    ``kept``: dropped neighbours whose pair noise *in this client's own upload* it does not reveal, because
    revealing it would leave its upload without pairwise noise; that noise stays in the aggregate as extra
    DP noise (nadp, mpddp: ``material`` is empty for them; niss: only the shares received from the peer).
    ``kept_probe``: with the cancellation check, the projection of that kept noise on the check's direction.
    """

    peers: tuple[int, ...] = ()
    material: tuple[bytes, ...] = ()
    refused: str = ""
    kept: tuple[int, ...] = ()
    kept_probe: float | None = None
    #: self-masked methods: received neighbours whose self-mask share this reply reveals, and the shares.
    mask_peers: tuple[int, ...] = ()
    mask_shares: tuple[bytes, ...] = ()

    def to_config(self) -> dict[str, Any]:
        if self.refused:
            return {_REFUSED: self.refused}
        # Flower cannot serialise empty lists: a reply with no dropped neighbour carries a placeholder.
        rec = {_PEERS: node_id_strings(self.peers) or [""], _MATERIAL: list(self.material) or [b""]}
        if self.kept:
            rec[_KEPT] = node_id_strings(self.kept)
        if self.kept_probe is not None:
            rec[_KEPT_PROBE] = float(self.kept_probe)
        if self.mask_peers:
            rec[_MASK_PEERS] = node_id_strings(self.mask_peers)
            rec[_MASK_SHARES] = [bytes(s) for s in self.mask_shares]
        return rec

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> RecoveryReply:
        if _REFUSED in rec:
            return cls(refused=read_str(rec, _REFUSED) or "refused")
        kept = read_node_ids(rec, _KEPT, default=())
        probe = read_float(rec, _KEPT_PROBE, default=None)
        mask_peers = read_node_ids(rec, _MASK_PEERS, default=())
        mask_shares = tuple(bytes(s) for s in read_list(rec, _MASK_SHARES, bytes, default=[]))
        if len(mask_peers) != len(mask_shares) or len(set(mask_peers)) != len(mask_peers):
            raise ValueError(f"'{_MASK_PEERS}' and '{_MASK_SHARES}' must be equally long, peers distinct")
        if rec.get(_PEERS) == [""]:
            return cls(kept=kept, kept_probe=probe, mask_peers=mask_peers, mask_shares=mask_shares)
        peers = read_node_ids(rec, _PEERS)
        material = tuple(bytes(m) for m in read_list(rec, _MATERIAL, bytes))
        if len(material) != len(peers) or len(set(peers)) != len(peers):
            raise ValueError(f"'{_PEERS}' and '{_MATERIAL}' must be equally long, peers distinct")
        if not set(kept) <= set(peers):
            raise ValueError(f"'{_KEPT}' names a node without material")
        if set(mask_peers) & set(peers):
            raise ValueError("a reply reveals both a self-mask share and pair material of one peer")
        return cls(peers, material, kept=kept, kept_probe=probe, mask_peers=mask_peers, mask_shares=mask_shares)

    def by_peer(self) -> dict[int, bytes]:
        return dict(zip(self.peers, self.material, strict=True))


@dataclass(frozen=True)
class SelfMaskShares:
    """With a self-masked upload: peer -> sealed share of the self-mask seed, its commitment, the mask's std."""

    sealed: Mapping[int, bytes]
    commitment: bytes
    std: float

    def to_config(self) -> dict[str, Any]:
        peers = sorted(self.sealed)
        return {_SM_PEERS: node_id_strings(peers), _SM_SEALED: [bytes(self.sealed[p]) for p in peers],
                             _SM_COMMIT: bytes(self.commitment), _SM_STD: float(self.std)}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> SelfMaskShares:
        peers = read_node_ids(rec, _SM_PEERS)
        blobs = tuple(bytes(b) for b in read_list(rec, _SM_SEALED, bytes))
        if len(peers) != len(blobs) or len(set(peers)) != len(peers):
            raise ValueError(f"'{_SM_PEERS}' and '{_SM_SEALED}' must be equally long, peers distinct")
        commit = rec.get(_SM_COMMIT)
        if not isinstance(commit, bytes) or len(commit) != 32:
            raise ValueError(f"'{_SM_COMMIT}' must be 32 bytes")
        std = read_float(rec, _SM_STD)
        if not (math.isfinite(std) and std >= 0):
            raise ValueError(f"'{_SM_STD}' must be finite and >= 0")
        return cls(dict(zip(peers, blobs, strict=True)), commit, std)


# ----------------------------------------------------------------------------- NISS pair material
_NISS = b"NRC\x01"
_BUNDLE = struct.Struct(">Id")  # count, share std
_KIND_SEED, _KIND_DISTORTED, _KIND_VECTOR, _KIND_KEPT = b"S", b"D", b"V", b"K"


@dataclass(frozen=True)
class NissPairMaterial:
    """What survivor ``i``'s NISS upload holds because of dropped neighbour ``k``.

    ``out_*``: the bundle of shares ``i`` generated for ``k`` (its own noise, in ``i``'s upload with nothing
    left to cancel it); ``out_seed`` None when ``i`` keeps them (they stay in the aggregate as DP noise).
    ``in_*``: the shares received from ``k`` (negated, distorted, in ``i``'s upload): with the ``seed``
    encoding ``k``'s bundle seed and, when ``tau > 0``, ``i``'s distortion seed for ``k``'s shares
    (:func:`protocols.niss.distortion_seed`; the server expands ``sum (1 + tau z) (-share)``); with the
    ``vector`` encoding the exact distorted contribution vector ``in_vector``.
    """

    out_count: int
    out_std: float
    out_seed: bytes | None
    in_count: int
    in_std: float
    in_seed: bytes | None = None
    in_vector: np.ndarray | None = None
    in_dseed: bytes | None = None

    @property
    def in_kept(self) -> bool:
        """Whether the received shares are not revealed (the peer's own noise stays in the aggregate)."""
        return self.in_seed is None and self.in_vector is None

    def keep_in(self) -> NissPairMaterial:
        """The same material without the peer's shares (for a peer whose upload the server holds)."""
        return NissPairMaterial(self.out_count, self.out_std, self.out_seed, self.in_count, self.in_std)

    def keep_own(self) -> NissPairMaterial:
        """The same material without this client's own shares (they are kept, i.e. not revealed)."""
        return NissPairMaterial(self.out_count, self.out_std, None, self.in_count, self.in_std, self.in_seed,
                                self.in_vector, self.in_dseed)

    def to_bytes(self) -> bytes:
        out_seed = bytes(32) if self.out_seed is None else self.out_seed
        head = (_NISS + (b"K" if self.out_seed is None else b"R") + _BUNDLE.pack(self.out_count, self.out_std)
                + out_seed + _BUNDLE.pack(self.in_count, self.in_std))
        if self.in_kept:
            return head + _KIND_KEPT
        if self.in_vector is None:
            if self.in_seed is None or len(self.in_seed) != 32:
                raise ValueError("NISS pair material needs a 32-byte incoming bundle seed")
            if self.in_dseed is not None:
                return head + _KIND_DISTORTED + self.in_seed + self.in_dseed
            return head + _KIND_SEED + self.in_seed
        return head + _KIND_VECTOR + np.ascontiguousarray(self.in_vector, dtype="<f8").tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes, size: int) -> NissPairMaterial:
        """Parse; ``size`` is the model size (the length of a contribution vector)."""
        n = len(_NISS) + 1
        if blob[:n - 1] != _NISS or blob[n - 1:n] not in (b"K", b"R") or len(blob) < n + 2 * _BUNDLE.size + 33:
            raise ValueError("not a NISS recovery material v1")
        out_count, out_std = _BUNDLE.unpack_from(blob, n)
        out_seed: bytes | None = blob[n + _BUNDLE.size:n + _BUNDLE.size + 32] if blob[n - 1:n] == b"R" else None
        off = n + _BUNDLE.size + 32
        in_count, in_std = _BUNDLE.unpack_from(blob, off)
        off += _BUNDLE.size
        kind, body = blob[off:off + 1], blob[off + 1:]
        if not all(math.isfinite(s) and s >= 0 for s in (out_std, in_std)):
            raise ValueError("NISS recovery material: share std must be finite and >= 0")
        if max(out_count, in_count) > SHARES_PER_NEIGHBOUR:
            raise ValueError(f"NISS recovery material: a pair exchanges at most {SHARES_PER_NEIGHBOUR} share(s) "
                             f"per direction, got {out_count} out / {in_count} in")
        if kind == _KIND_KEPT and not body:
            return cls(out_count, out_std, out_seed, in_count, in_std)
        if kind == _KIND_SEED and len(body) == 32:
            return cls(out_count, out_std, out_seed, in_count, in_std, in_seed=body)
        if kind == _KIND_DISTORTED and len(body) == 64:
            return cls(out_count, out_std, out_seed, in_count, in_std, in_seed=body[:32], in_dseed=body[32:])
        if kind == _KIND_VECTOR and len(body) == 8 * size:
            vec = np.frombuffer(body, dtype="<f8").astype(np.float64)
            if not np.all(np.isfinite(vec)):
                raise ValueError("NISS recovery material: non-finite contribution vector")
            return cls(out_count, out_std, out_seed, in_count, in_std, in_vector=vec)
        raise ValueError(f"NISS recovery material: bad body (kind {kind!r}, {len(body)} bytes for size {size})")
