"""Client side of the key-exchange phase shared by every pairwise-noise method.

* :func:`handle_keys` answers ``query.keys`` (:class:`client.messages.keys.KeyRequest`) with a fresh X25519 public
  key for the server's key epoch, signed with the node's Ed25519 identity (:mod:`client.identity`); the private
  key and the epoch's shared secrets (keyed by peer id and public key) stay in ``Context.state``.
* :func:`pair_seeds` derives one 32-byte seed per neighbour with HKDF, separated by purpose, round, pair, run id
  and the round's view; it refuses (``IdentityError`` naming the node) an unknown, unsigned or wrongly signed
  peer key.
* :func:`round_view` checks the view the message shows (participants, this node's row of the graph rebuilt from
  :func:`protocols.identity.view_graph_seed`) and hashes it, so clients shown different views derive no common
  seed.  Rationale: ``docs/concepts.md`` (Key exchange).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from client.identity import sign_key, verify_peers
from client.messages.common import TrainIns
from client.messages.keys import KeyReply, KeyRequest, MaskProbe, PeerKeys
from protocols.graphs import round_neighbours
from protocols.identity import view_digest, view_graph_seed
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
    #: peer id -> roster name its cached key was verified under.
    names: dict[int, str] = field(default_factory=dict)

    _EPOCH, _PRIVATE, _PEERS, _PEER_KEYS, _SECRETS = "epoch", "private", "cached-peers", "cached-keys", "cached-secrets"
    _NAMES = "cached-names"

    @classmethod
    def load(cls, env: ClientEnv) -> KeyStore | None:
        """The stored key pair (None if this node has none)."""
        rec = env.context.state.get(STATE_KEY)
        if rec is None or cls._EPOCH not in rec:
            return None
        peers = rec.get(cls._PEERS, [])
        shared = {(int(p), bytes(k)): bytes(s) for p, k, s in
                  zip(peers, rec.get(cls._PEER_KEYS, []), rec.get(cls._SECRETS, []), strict=True)}
        names = dict(zip((int(p) for p in peers), rec.get(cls._NAMES, []), strict=True))
        return cls(int(rec[cls._EPOCH]), bytes(rec[cls._PRIVATE]), shared, names)

    def save(self, env: ClientEnv) -> None:
        """Write to ``Context.state`` (Flower cannot serialise empty lists, so an empty cache is left out)."""
        rec = ConfigRecord({self._EPOCH: self.epoch, self._PRIVATE: self.private})
        if self.shared:
            rec[self._PEERS] = [str(p) for p, _ in self.shared]
            rec[self._PEER_KEYS] = [k for _, k in self.shared]
            rec[self._SECRETS] = list(self.shared.values())
            rec[self._NAMES] = [self.names[p] for p, _ in self.shared]
        env.context.state[STATE_KEY] = rec


def handle_keys(msg: Message, env: ClientEnv) -> Message:
    """Make the key pair of the server's key epoch, store the private half, return the public half.

    The reply also carries ``|D_i|`` (the local dataset size), which methods
    whose noise allocation depends on public dataset sizes (nadp) need before
    training; other methods ignore it.
    """
    req = KeyRequest.from_config(msg.content["config"])
    kp = generate_keypair()
    name, signature = sign_key(env, req.key_epoch, kp.public_bytes)  # fails before anything is stored
    # Keep only the current epoch's key (and no cached secret of an older one).
    KeyStore(req.key_epoch, kp.private_bytes, {}).save(env)
    reply = KeyReply(kp.public_bytes, len(env.y), name, signature)
    return Message(RecordDict({"config": reply.to_config()}), reply_to=msg)


def peers(msg: Message) -> list[int]:
    """Neighbour node ids sent by the server for this round."""
    return list(PeerKeys.from_config(msg.content["config"]).peer_ids)


def round_view(env: ClientEnv, pk: PeerKeys, rnd: int, graph: dict[int, list[int]] | None = None) -> bytes:
    """Check the round's view ``pk`` shows this node; its digest (bound into every pair seed, see module doc).

    ``graph``: the round's graph when the caller has built it already (nadp), else rebuilt from the seed.
    """
    me, parts = env.node_id, pk.participants
    if not parts or pk.graph_seed is None:
        raise ValueError("the message lacks the round's participant list or graph seed: the view cannot be checked")
    members = set(parts)
    if me not in members:
        raise ValueError(f"node {me} is not among the round's participants")
    strangers = sorted(set(pk.peer_ids) - members)
    if strangers:
        raise ValueError(f"peers {strangers} are not among the round's participants")
    if graph is not None and set(graph) != members:
        raise ValueError("the round's plan and its participant list name different nodes")
    run_id = int(env.context.run_id)
    if pk.graph_seed != view_graph_seed(run_id=run_id, round_num=rnd, key_epoch=pk.key_epoch, participants=parts):
        # A seed of the server's choosing could place this node among colluding neighbours.
        raise ValueError("the graph seed is not the one the round's run, round, key epoch and participants "
                         "determine: the server may not choose the pairing graph")
    row = graph[me] if graph is not None else round_neighbours(env.cfg.graph, env.cfg.n_out, parts, pk.graph_seed, me)
    if sorted(pk.peer_ids) != sorted(row):
        raise ValueError("the peer list differs from this node's neighbours in the round's graph")
    return view_digest(run_id=run_id, round_num=rnd, key_epoch=pk.key_epoch, graph=env.cfg.graph,
                       n_out=env.cfg.n_out, graph_seed=pk.graph_seed, participants=parts)


def pair_seeds(msg: Message, env: ClientEnv, purpose: str,
               graph: dict[int, list[int]] | None = None, view_extra: bytes = b"") -> dict[int, bytes]:
    """One seed per neighbour for ``purpose`` and this round (both ends derive the same value).

    Refuses an inconsistent view (:func:`round_view`) and any peer key not signed by its roster identity.
    ``view_extra``: more of the round's public view the method relies on (NISS: the participants' sizes),
    bound into the seeds like the participant list.
    """
    cfg = msg.content["config"]
    rnd = TrainIns.from_config(cfg).round
    pk = PeerKeys.from_config(cfg)
    store = KeyStore.load(env)
    if store is None or store.epoch != pk.key_epoch:
        raise RuntimeError(f"no key pair for key epoch {pk.key_epoch} (round {rnd}): the key phase did not run on "
                           "this node or its state was lost; the server re-keys it when it is next sampled")
    context = int(env.context.run_id).to_bytes(8, "big") + round_view(env, pk, rnd, graph) + bytes(view_extra)
    pairs = list(zip(pk.peer_ids, pk.peer_keys, strict=True))
    # A cached secret was agreed only after its key was verified under the same name.
    fresh = [i for i, pair in enumerate(pairs) if pair not in store.shared or store.names.get(pair[0]) != pk.name_of(i)]
    if fresh:
        verify_peers(env, pk, fresh)
        store.names.update((pk.peer_ids[i], pk.name_of(i)) for i in fresh)
    new = [pairs[i] for i in fresh if pairs[i] not in store.shared]
    if fresh:
        own = keypair_from_private(store.private)
        store.shared.update(zip(new, agree_many(own, [k for _, k in new]), strict=True))
        # One secret per peer, for its latest key (new entries come last in the dict, so they win).
        latest = {p: (k, s) for (p, k), s in store.shared.items()}
        store.shared = {(p, k): s for p, (k, s) in latest.items()}
        store.names = {p: store.names[p] for p, _ in store.shared}
        store.save(env)
    return {peer: derive_pair_seed(store.shared[(peer, key)], purpose=purpose, round_num=rnd, node_a=env.node_id,
                                   node_b=peer, context=context)
            for peer, key in pairs}


def mask_probe(msg: Message, mask: np.ndarray) -> float:
    """Projection of the pairwise mask on the round's public random direction (cancellation check)."""
    seed = MaskProbe.from_config(msg.content["config"]).seed
    return float(np.dot(mask, gaussian(seed, len(mask))))
