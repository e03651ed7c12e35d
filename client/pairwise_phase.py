"""Client side of the key-exchange phase shared by every pairwise-noise method.

* :func:`handle_keys` answers ``query.keys`` (:class:`protocols.wire.keys.KeyRequest`) with a fresh X25519 public
  key for the server's key epoch, signed with the node's Ed25519 identity (:mod:`client.identity`), and the digest
  (or, when asked, the text) of the roster it trusts; the private key, the roster digest and the epoch's shared
  secrets (keyed by peer id and public key) stay in ``Context.state``.
* :func:`check_view` checks the view the message shows against the roster's pairing graph of the round
  (:func:`protocols.graphs.roster_round_of`: seed, public sample and graph from the roster and the round number only): the graph
  seed, every participant in the sample under its signed name, the peer list equal to this node's roster
  neighbours among the participants, at least :func:`protocols.graphs.present_floor` of them, and the roster
  unchanged within the key epoch; it hashes the view with the node's run settings
  (:func:`protocols.identity.settings_digest`), so clients shown different views or settings derive no common seed.
* :func:`pair_seeds` derives one 32-byte seed per neighbour with HKDF, separated by purpose, round, pair, run id
  and the round's view; it refuses (``IdentityError`` naming the node) an unknown, unsigned or wrongly signed
  peer key.  Rationale: ``docs/concepts.md`` (Key exchange).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from client.identity import node_identity, sign_key, verify_peers
from protocols.graphs import present_floor, present_graph, roster_round_of
from protocols.identity import Roster, roster_digest, settings_digest, view_digest
from protocols.keyagreement import agree_many, derive_pair_seed, generate_keypair, keypair_from_private
from protocols.prg import gaussian
from protocols.wire.common import TrainIns, ViewError
from protocols.wire.keys import KeyReply, KeyRequest, MaskProbe, PeerKeys

#: ``Context.state`` record holding the epoch's key pair and cached shared secrets (:class:`KeyStore`).
STATE_KEY = "cancelfl-keys"
#: ``Context.state`` record of the last checked view's participants and roster names (:func:`participants_of`).
VIEW_KEY = "cancelfl-view"


@dataclass
class KeyStore:
    """The node's private key of one key epoch and the X25519 secrets agreed with peers under it."""

    epoch: int
    private: bytes
    #: (peer id, peer public key) -> shared secret; one entry per peer, for its latest key.
    shared: dict[tuple[int, bytes], bytes]
    #: peer id -> roster name its cached key was verified under.
    names: dict[int, str] = field(default_factory=dict)
    #: digest of the roster the node trusted when it made the key pair (fixed for the key epoch).
    roster: bytes = b""

    _EPOCH, _PRIVATE, _PEERS, _PEER_KEYS, _SECRETS = "epoch", "private", "cached-peers", "cached-keys", "cached-secrets"
    _NAMES, _ROSTER = "cached-names", "roster-digest"

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
        return cls(int(rec[cls._EPOCH]), bytes(rec[cls._PRIVATE]), shared, names, bytes(rec.get(cls._ROSTER, b"")))

    def save(self, env: ClientEnv) -> None:
        """Write to ``Context.state`` (Flower cannot serialise empty lists, so an empty cache is left out)."""
        rec = ConfigRecord({self._EPOCH: self.epoch, self._PRIVATE: self.private})
        if self.roster:
            rec[self._ROSTER] = self.roster
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
    training; other methods ignore it; and, when the server asks (it holds no
    roster yet), the roster this node trusts (public).
    """
    req = KeyRequest.from_config(msg.content["config"])
    kp = generate_keypair()
    name, signature = sign_key(env, req.key_epoch, kp.public_bytes)  # fails before anything is stored
    roster = node_identity(env).roster
    digest = roster_digest(roster)
    # Keep only the current epoch's key (and no cached secret of an older one).
    KeyStore(req.key_epoch, kp.private_bytes, {}, roster=digest).save(env)
    text = Roster(dict(roster)).to_json() if req.want_roster else ""
    reply = KeyReply(kp.public_bytes, len(env.y), name, signature, digest, text)
    return Message(RecordDict({"config": ConfigRecord(reply.to_config())}), reply_to=msg)


def peers(msg: Message) -> list[int]:
    """Neighbour node ids sent by the server for this round."""
    return list(PeerKeys.from_config(msg.content["config"]).peer_ids)


@dataclass(frozen=True)
class RoundView:
    """A checked view: its digest (bound into the pair seeds), this node's present neighbours, the graph."""

    digest: bytes
    neighbours: list[int]
    #: the present graph over all participants (only when asked for: O(K^2) for a complete graph).
    graph: dict[int, list[int]] | None = None
    #: with the graph: participant -> its neighbours in the roster's graph of the round, present or not.
    degrees: dict[int, int] | None = None
    #: the round, its participants and their roster names (what :func:`remember_view` keeps).
    round: int = 0
    participants: tuple[int, ...] = ()
    names: tuple[str, ...] = ()


def check_view(env: ClientEnv, pk: PeerKeys, rnd: int, *, full: bool = False, remember: bool = True) -> RoundView:
    """Check the round's view ``pk`` against the roster graph (see the module doc); ``full``: also the graph.

    Authenticates the peers' keys first (and agrees the missing secrets).  ``remember``: keep the checked view as
    the round's (:func:`remember_view`); False leaves that to a caller that commits the view later.  Raises
    IdentityError naming a peer whose key is not its roster identity's, ValueError naming what the view contradicts.
    """
    return _checked(env, pk, rnd, full=full, remember=remember)[0]


def _checked(env: ClientEnv, pk: PeerKeys, rnd: int, *, full: bool, remember: bool) -> tuple[RoundView, KeyStore]:
    store = _authenticated(env, pk, rnd)
    me, parts, names = env.node_id, pk.participants, pk.participant_names
    if not parts or pk.graph_seed is None:
        raise ViewError("the message lacks the round's participant list or graph seed: the view cannot be checked")
    if len(names) != len(parts):
        raise ViewError("the message lacks the participants' roster names: the view cannot be checked")
    present = dict(zip(parts, names, strict=True))
    if me not in present:
        raise ViewError(f"node {me} is not among the round's participants")
    strangers = sorted(set(pk.peer_ids) - set(present))
    if strangers:
        raise ViewError(f"peers {strangers} are not among the round's participants")
    ident = node_identity(env)
    if present[me] != ident.name:
        raise ViewError(f"the participant list names node {me} {present[me]!r}, not this node's {ident.name!r}")
    digest = roster_digest(ident.roster)
    if store.roster and store.roster != digest:
        raise ViewError(f"this node's roster changed within key epoch {store.epoch}: the pairing graph follows the "
                         "roster of the key epoch")
    rr = roster_round_of(env.cfg, ident.roster, rnd)
    if pk.graph_seed != rr.seed:
        # A seed of the server's choosing could place this node among colluding neighbours.
        raise ViewError("the graph seed is not the one this node's roster and the round determine: the server may "
                         "not choose the pairing graph (or it holds another roster)")
    if len(set(names)) != len(names):
        raise ViewError("the participant list names one roster identity twice")
    outside = sorted(set(names) - set(rr.sample))
    if outside:
        raise ViewError(f"participants {outside[:5]} are not in the round's public sample of the roster")
    mine = rr.neighbours(ident.name)
    ids_of = {name: node for node, name in present.items()}
    row = sorted(ids_of[m] for m in mine if m in ids_of)
    if sorted(pk.peer_ids) != row:
        raise ViewError("the peer list differs from this node's neighbours in the roster's pairing graph of the round")
    for i, peer in enumerate(pk.peer_ids):
        if pk.peer_names and pk.name_of(i) != present[peer]:
            raise ViewError(f"peer {peer} carries roster name {pk.name_of(i)!r}, the participant list {present[peer]!r}")
    floor = present_floor(len(mine), env.cfg.mask_corruption_rate)
    if len(row) < floor:
        raise ViewError(f"only {len(row)} of this node's {len(mine)} roster neighbours take part in round {rnd}; "
                         f"it needs at least {floor} (run-config 'mask-corruption-rate')")
    view = view_digest(run_id=int(env.context.run_id), round_num=rnd, key_epoch=pk.key_epoch, graph=env.cfg.graph,
                       n_out=env.cfg.n_out, graph_seed=pk.graph_seed, participants=parts, names=names,
                       settings=settings_digest(env.cfg))
    degrees = {node: len(rr.neighbours(name)) for node, name in present.items()} if full else None
    out = RoundView(view, row, present_graph(rr, present) if full else None, degrees, rnd, tuple(parts), tuple(names))
    if remember:
        remember_view(env, out)
    return out, store


def remember_view(env: ClientEnv, view: RoundView) -> None:
    """Keep ``view`` as its round's checked view (:func:`participants_of`; the one a recovery of the round counts on).

    A handler whose secrets for the round are committed after the check (NISS's share phase) calls this with that
    commit, never before: a request refused after its view was checked leaves the view of the secrets in place.
    """
    _remember_view(env, view.round, view.participants, view.names)


def _remember_view(env: ClientEnv, rnd: int, parts: Sequence[int], names: Sequence[str]) -> None:
    """Keep round ``rnd``'s checked view, and the one checked before it for another round.

    NISS checks round r+1's view with round r's upload, while round r's recovery may still need round r's.
    """
    rec = ConfigRecord({"round": int(rnd), "participants": [str(p) for p in parts], "names": list(names)})
    old = env.context.state.get(VIEW_KEY)
    if old is not None and "round" in old and old["round"] != int(rnd):
        rec.update({"previous-round": old["round"], "previous-participants": old["participants"],
                    "previous-names": old["names"]})
    elif old is not None and "previous-round" in old:  # round rnd checked again: the round before keeps its view
        rec.update({k: old[k] for k in ("previous-round", "previous-participants", "previous-names")})
    env.context.state[VIEW_KEY] = rec


def participants_of(env: ClientEnv, rnd: int) -> dict[int, str] | None:
    """Participant -> roster name of round ``rnd``'s view if it is one of the last two rounds' this node checked."""
    rec = env.context.state.get(VIEW_KEY)
    if rec is None:
        return None
    for prefix in ("", "previous-"):
        if rec.get(prefix + "round") == int(rnd):
            return dict(zip((int(p) for p in rec[prefix + "participants"]), (str(n) for n in rec[prefix + "names"]),
                            strict=True))
    return None


def full_view(msg: Message, env: ClientEnv) -> RoundView:
    """The train message's checked view with the round's present graph and the participants' roster degrees."""
    return _message_view(msg, env, full=True)[2]


def _message_view(msg: Message | ConfigRecord, env: ClientEnv, *, full: bool, remember: bool = True
                  ) -> tuple[PeerKeys, int, RoundView, KeyStore]:
    """``(peer keys, round, checked view, key store)`` of ``msg``, checked once per message (:func:`check_view`).

    The result is kept in ``env.memo`` with the message's config record itself, so a later call for the same
    record (a handler derives seeds for several purposes, the self-mask, the graph) reuses the check instead of
    parsing and hashing the whole participant list again; any other record is checked anew.  ``remember``: as
    :func:`check_view`'s (a reused check is kept then if it was not yet).
    """
    cfg = msg.content["config"] if isinstance(msg, Message) else msg
    hit = env.memo.get(VIEW_KEY)
    if hit is not None and hit[0] is cfg and (hit[3].graph is not None or not full):
        if remember and not hit[5]:
            remember_view(env, hit[3])
            env.memo[VIEW_KEY] = (*hit[:5], True)
        return hit[1], hit[2], hit[3], hit[4]
    rnd = TrainIns.from_config(cfg).round
    pk = PeerKeys.from_config(cfg)
    view, store = _checked(env, pk, rnd, full=full, remember=remember)
    env.memo[VIEW_KEY] = (cfg, pk, rnd, view, store, remember)
    return pk, rnd, view, store


def pair_seeds(msg: Message, env: ClientEnv, purpose: str,
               graph: dict[int, list[int]] | None = None, view_extra: bytes = b"") -> dict[int, bytes]:
    """One seed per neighbour for ``purpose`` and this round (both ends derive the same value).

    Refuses any peer key not signed by its roster identity, then an inconsistent view (:func:`check_view`).
    ``graph``: the round's graph if the caller built it (it must agree with the roster's).
    ``view_extra``: more of the round's public view the method relies on (NISS: the participants' sizes),
    bound into the seeds like the participant list.
    """
    return checked_pair_seeds(msg, env, (purpose,), graph=graph, view_extra=view_extra)[1][purpose]


def checked_pair_seeds(msg: Message | ConfigRecord, env: ClientEnv, purposes: Sequence[str], *,
                       graph: dict[int, list[int]] | None = None, view_extra: bytes = b"",
                       full: bool = False, remember: bool = True) -> tuple[RoundView, dict[str, dict[int, bytes]]]:
    """The checked view (``full``: with the graph, :func:`check_view`) and :func:`pair_seeds` for each purpose.

    ``msg``: the message, or the record holding the round and the peer keys.  One check of the view per message
    for all purposes and calls (:func:`_message_view`); ``remember``: as :func:`check_view`'s.  Raises as
    :func:`pair_seeds`.
    """
    pk, rnd, view, store = _message_view(msg, env, full=full, remember=remember)
    if graph is not None and sorted(graph.get(env.node_id, ())) != view.neighbours:
        raise ViewError("the round's plan and the roster's graph give this node different neighbours")
    context = int(env.context.run_id).to_bytes(8, "big") + view.digest + bytes(view_extra)
    return view, {purpose: {peer: derive_pair_seed(store.shared[(peer, key)], purpose=purpose, round_num=rnd,
                                                   node_a=env.node_id, node_b=peer, context=context)
                            for peer, key in zip(pk.peer_ids, pk.peer_keys, strict=True)}
                  for purpose in purposes}


def _authenticated(env: ClientEnv, pk: PeerKeys, rnd: int) -> KeyStore:
    """The key store with a verified, agreed secret for every peer of ``pk`` (IdentityError naming a bad peer)."""
    store = KeyStore.load(env)
    if store is None or store.epoch != pk.key_epoch:
        raise RuntimeError(f"no key pair for key epoch {pk.key_epoch} (round {rnd}): the key phase did not run on "
                           "this node or its state was lost; the server re-keys it when it is next sampled")
    pairs = list(zip(pk.peer_ids, pk.peer_keys, strict=True))
    # A cached secret was agreed only after its key was verified under the same name.
    fresh = [i for i, pair in enumerate(pairs) if pair not in store.shared or store.names.get(pair[0]) != pk.name_of(i)]
    if fresh:
        verify_peers(env, pk, fresh)
        store.names.update((pk.peer_ids[i], pk.name_of(i)) for i in fresh)
        new = [pairs[i] for i in fresh if pairs[i] not in store.shared]
        own = keypair_from_private(store.private)
        store.shared.update(zip(new, agree_many(own, [k for _, k in new]), strict=True))
        # One secret per peer, for its latest key (new entries come last in the dict, so they win).
        latest = {p: (k, s) for (p, k), s in store.shared.items()}
        store.shared = {(p, k): s for p, (k, s) in latest.items()}
        store.names = {p: store.names[p] for p, _ in store.shared}
        store.save(env)
    return store


def mask_probe(msg: Message, mask: np.ndarray) -> float:
    """Projection of the pairwise mask on the round's public random direction (cancellation check)."""
    seed = MaskProbe.from_config(msg.content["config"]).seed
    return float(np.dot(mask, gaussian(seed, len(mask))))
