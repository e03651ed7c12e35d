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

Authentication (:mod:`client.identity`): the key reply carries this node's
Ed25519 signature over (run id, key epoch, roster name, node id, X25519 key);
``pair_seeds`` verifies every peer key it has not verified before against the
roster and refuses (``IdentityError`` naming the node) an unknown, unsigned or
wrongly signed one, so a server substituting its own X25519 keys is caught.

Consistent views (SecAgg's concern: a server must not isolate a client by
showing it a peer set the others do not share).  Choice: bind the round's
*view* into every pair seed, at no extra message phase.  ``round_view`` checks
the view the message shows (own id and every peer among the participants, the
peer list equal to this node's row of the graph rebuilt from the public graph
seed, and that seed equal to the one the run, round, key epoch and participants
determine, :func:`protocols.identity.view_graph_seed`, so the server cannot try
seeds until a target's neighbours are its colluders) and hashes (run id, round,
key epoch, graph rule, graph seed, sorted participant ids) into the HKDF context.  Two clients therefore derive the same
pair seed only if the server showed both the same participant set and graph: a
client shown a different set ends up with masks (and, in NISS, relay keys) that
nobody else can derive -- its upload stays protected, the server learns
nothing, and the round fails to cancel (NISS: every relayed payload fails
authentication and the round is refused).  A view consisting of the client and
colluders only is a small round the client sees and judges itself (privacy
floor).  The alternative -- every client signing the view and the server
relaying the signatures before anyone uploads (SecAgg's ConsistencyCheck) --
costs one more message phase per round (6-9 s in deployment) and is only needed
before a client *reveals* pair secrets to the server (dropout recovery).
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
