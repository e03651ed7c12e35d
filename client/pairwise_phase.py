"""Client side of the key-exchange phase shared by every pairwise-noise method.

``handle_keys`` answers ``query.keys`` (:class:`client.messages.keys.KeyRequest`)
with a fresh X25519 public key for the server's key epoch (run-config
``key-rotation``) and keeps the private key in ``Context.state`` (the only
storage that survives between phases and rounds: in deployment every message
runs in a new process).  ``pair_seeds`` derives one 32-byte seed per neighbour
named in the message's :class:`~client.messages.keys.PeerKeys` with HKDF,
separated by purpose, round, pair and run id, so no seed is ever reused even
when the key pair lives for many rounds.  The X25519 shared secrets of an epoch
are cached next to the private key (keyed by the peer's id *and* public key, so
a re-keyed peer is agreed anew).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from client.messages.common import TrainIns
from client.messages.keys import KeyReply, KeyRequest, MaskProbe, PeerKeys
from protocols.keyagreement import agree_many, derive_pair_seed, generate_keypair, keypair_from_private
from protocols.prg import gaussian

#: ``Context.state`` record holding the epoch's key pair and cached shared secrets (:class:`KeyStore`).
STATE_KEY = "cancelfl-keys"


@dataclass
class KeyStore:
    """The node's private key of one key epoch and the X25519 secrets agreed with peers under it."""

    epoch: int
    private: bytes
    #: (peer id, peer public key) -> shared secret; one entry per peer, for its latest key.
    shared: dict[tuple[int, bytes], bytes]

    _EPOCH, _PRIVATE, _PEERS, _PEER_KEYS, _SECRETS = "epoch", "private", "cached-peers", "cached-keys", "cached-secrets"

    @classmethod
    def load(cls, env: ClientEnv) -> KeyStore | None:
        """The stored key pair (None if this node has none)."""
        rec = env.context.state.get(STATE_KEY)
        if rec is None or cls._EPOCH not in rec:
            return None
        shared = {(int(p), bytes(k)): bytes(s) for p, k, s in
                  zip(rec.get(cls._PEERS, []), rec.get(cls._PEER_KEYS, []), rec.get(cls._SECRETS, []), strict=True)}
        return cls(int(rec[cls._EPOCH]), bytes(rec[cls._PRIVATE]), shared)

    def save(self, env: ClientEnv) -> None:
        """Write to ``Context.state`` (Flower cannot serialise empty lists, so an empty cache is left out)."""
        rec = ConfigRecord({self._EPOCH: self.epoch, self._PRIVATE: self.private})
        if self.shared:
            rec[self._PEERS] = [str(p) for p, _ in self.shared]
            rec[self._PEER_KEYS] = [k for _, k in self.shared]
            rec[self._SECRETS] = list(self.shared.values())
        env.context.state[STATE_KEY] = rec


def handle_keys(msg: Message, env: ClientEnv) -> Message:
    """Make the key pair of the server's key epoch, store the private half, return the public half.

    The reply also carries ``|D_i|`` (the local dataset size), which methods
    whose noise allocation depends on public dataset sizes (nadp) need before
    training; other methods ignore it.
    """
    req = KeyRequest.from_config(msg.content["config"])
    kp = generate_keypair()
    # Keep only the current epoch's key (and no cached secret of an older one).
    KeyStore(req.key_epoch, kp.private_bytes, {}).save(env)
    return Message(RecordDict({"config": KeyReply(kp.public_bytes, len(env.y)).to_config()}), reply_to=msg)


def peers(msg: Message) -> list[int]:
    """Neighbour node ids sent by the server for this round."""
    return list(PeerKeys.from_config(msg.content["config"]).peer_ids)


def pair_seeds(msg: Message, env: ClientEnv, purpose: str) -> dict[int, bytes]:
    """One seed per neighbour for ``purpose`` and this round (both ends derive the same value)."""
    cfg = msg.content["config"]
    rnd = TrainIns.from_config(cfg).round
    pk = PeerKeys.from_config(cfg)
    store = KeyStore.load(env)
    if store is None or store.epoch != pk.key_epoch:
        raise RuntimeError(f"no key pair for key epoch {pk.key_epoch} (round {rnd}): the key phase did not run on "
                           "this node or its state was lost; the server re-keys it when it is next sampled")
    pairs = list(zip(pk.peer_ids, pk.peer_keys, strict=True))
    new = [pair for pair in pairs if pair not in store.shared]
    if new:
        own = keypair_from_private(store.private)
        store.shared.update(zip(new, agree_many(own, [k for _, k in new]), strict=True))
        # One secret per peer, for its latest key (new entries come last in the dict, so they win).
        latest = {p: (k, s) for (p, k), s in store.shared.items()}
        store.shared = {(p, k): s for p, (k, s) in latest.items()}
        store.save(env)
    context = int(env.context.run_id).to_bytes(8, "big")
    return {peer: derive_pair_seed(store.shared[(peer, key)], purpose=purpose, round_num=rnd, node_a=env.node_id,
                                   node_b=peer, context=context)
            for peer, key in pairs}


def mask_probe(msg: Message, mask: np.ndarray) -> float:
    """Projection of the pairwise mask on the round's public random direction (cancellation check)."""
    seed = MaskProbe.from_config(msg.content["config"]).seed
    return float(np.dot(mask, gaussian(seed, len(mask))))
