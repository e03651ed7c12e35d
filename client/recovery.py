"""Client side of dropout recovery (``query.recover``) for the pairwise-noise methods nadp, niss and mpddp.

When it uploads, a client keeps (in ``Context.state``, :class:`RecoveryStore`) the material of *this round*
that its upload holds because of each neighbour: nadp and mpddp the per-round HKDF pair seed
(:func:`client.pairwise_phase.pair_seeds`, fresh per round, purpose-separated), niss a
:class:`~client.messages.recovery.NissPairMaterial` (own shares sent to the neighbour, distorted negated
shares received from it).  The next train message overwrites it.

:func:`handle_recover` answers a :class:`~client.messages.recovery.RecoveryRequest` with the material of the
dropped neighbours only, after checking the request (SecAgg's rule: never reveal pair material of a peer
whose upload the server holds).  It refuses, with a reason, when:

* it holds no material of that round (it did not upload in it), or its own upload is not in ``received``;
* a node is both ``received`` and ``dropped``, or one of its neighbours is in neither set;
* it already answered a *different* request for the round (a server that first said "k uploaded" cannot
  later say "k dropped"; the same request is answered again, identically).

If revealing would strip all pairwise noise from its own upload (every neighbour that holds some of it
dropped), it reveals only what does not touch its own noise (niss: the shares received from the dropped;
nadp, mpddp: nothing) and names those peers ``kept``: that pair noise stays in the aggregate as extra DP
noise (reported by the server), with its projection for the cancellation check when the method provides it.

What this does not stop (threat model, see :mod:`strategies.recovery`): a server that tells *every*
neighbour of ``k`` the same lie ("k dropped") although it holds k's upload; it then learns k's upload minus
k's pair noise of that round, i.e. k keeps only its independent noise (nadp's residual, mpddp's eta, niss's
shares with no dropped neighbour).  Pair material is per round, so no other round is exposed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from client.messages.recovery import RecoveryReply, RecoveryRequest

#: ``Context.state`` record of the last upload's pair material.
STATE_KEY = "cancelfl-recovery"


@dataclass
class RecoveryStore:
    """The pair material of the round this client last uploaded in, and the recovery request it answered."""

    round: int
    #: neighbour -> material revealed if that neighbour drops.
    material: dict[int, bytes]
    #: neighbour -> pairwise noise of this client's upload that stays only while that neighbour survives.
    noise: dict[int, float]
    #: neighbour -> material revealing none of this client's own noise (default: nothing).
    partial: dict[int, bytes] = field(default_factory=dict)
    #: neighbour -> projection of this client's own pair noise with it (cancellation check only).
    kept_probe: dict[int, float] = field(default_factory=dict)
    #: (received, dropped) of the request already answered this round, if any.
    answered: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def save(self, env: ClientEnv) -> None:
        peers = sorted(self.material)
        rec = ConfigRecord({"round": self.round})
        if peers:  # Flower cannot serialise empty lists
            rec["peers"] = [str(p) for p in peers]
            rec["material"] = [self.material[p] for p in peers]
            rec["noise"] = [float(self.noise.get(p, 0.0)) for p in peers]
            rec["partial"] = [self.partial.get(p, b"") for p in peers]
            if self.kept_probe:
                rec["kept-probe"] = [float(self.kept_probe.get(p, 0.0)) for p in peers]
        if self.answered is not None:
            rec["answered-received"] = [str(n) for n in self.answered[0]] or [""]
            rec["answered-dropped"] = [str(n) for n in self.answered[1]] or [""]
        env.context.state[STATE_KEY] = rec

    @classmethod
    def load(cls, env: ClientEnv) -> RecoveryStore | None:
        rec = env.context.state.get(STATE_KEY)
        if rec is None or "round" not in rec:
            return None
        peers = [int(p) for p in rec.get("peers", [])]
        material = dict(zip(peers, (bytes(m) for m in rec.get("material", [])), strict=True))
        noise = dict(zip(peers, (float(v) for v in rec.get("noise", [])), strict=True))
        partial = dict(zip(peers, (bytes(m) for m in rec.get("partial", [])), strict=True)) if "partial" in rec else {}
        kept_probe = (dict(zip(peers, (float(v) for v in rec["kept-probe"]), strict=True))
                      if "kept-probe" in rec else {})
        answered = None
        if "answered-received" in rec:
            answered = tuple(tuple(int(n) for n in rec[k] if n != "") for k in ("answered-received",
                                                                                  "answered-dropped"))
        return cls(int(rec["round"]), material, noise, partial, kept_probe, answered)  # type: ignore[arg-type]


def remember(env: ClientEnv, rnd: int, material: Mapping[int, bytes], noise: Mapping[int, float] | None = None,
             partial: Mapping[int, bytes] | None = None, kept_probe: Mapping[int, float] | None = None) -> None:
    """Keep this round's pair material (called by the method's train handler when it uploads).

    ``noise[j]``: how much of this client's own pairwise noise lives with neighbour ``j`` (any positive unit;
    default 1 per neighbour); ``partial[j]``: the material to reveal instead when revealing ``material`` would
    leave none of it (default: nothing); ``kept_probe[j]``: the cancellation check's projection of the own
    noise that then stays in the aggregate.
    """
    RecoveryStore(int(rnd), dict(material), dict(noise) if noise is not None else dict.fromkeys(material, 1.0),
                  dict(partial or {}), dict(kept_probe or {})).save(env)


def check_request(store: RecoveryStore | None, req: RecoveryRequest, me: int) -> str:
    """Why this client must refuse ``req`` ("" when it may answer)."""
    if store is None or store.round != req.round:
        return f"no pair material of round {req.round} (this node did not upload in that round)"
    received, dropped = set(req.received), set(req.dropped)
    if me not in received:
        return f"this node's upload (node {me}) is not in the received set"
    both = sorted(received & dropped)
    if both:
        return f"node(s) {both} named both received and dropped"
    neither = sorted(set(store.material) - received - dropped)
    if neither:
        return f"neighbour(s) {neither} are neither received nor dropped"
    if store.answered is not None and (set(store.answered[0]), set(store.answered[1])) != (received, dropped):
        moved = sorted(set(store.answered[0]) & dropped)
        why = f"; node(s) {moved} were reported received before" if moved else ""
        return f"a different recovery request for round {req.round} was already answered{why}"
    return ""


def answer(store: RecoveryStore, dropped: set[int]) -> RecoveryReply:
    """The material of the dropped neighbours; their ``partial`` material if the full one strips all own noise."""
    peers = tuple(sorted(p for p in store.material if p in dropped))
    total = sum(store.noise.values())
    left = sum(v for p, v in store.noise.items() if p not in dropped)
    if total > 0 and left <= 0:
        probe = sum(store.kept_probe[p] for p in peers) if all(p in store.kept_probe for p in peers) else None
        return RecoveryReply(peers, tuple(store.partial.get(p, b"") for p in peers), kept=peers, kept_probe=probe)
    return RecoveryReply(peers, tuple(store.material[p] for p in peers))


def handle_recover(msg: Message, env: ClientEnv) -> Message:
    """``query.recover``: this round's pair material of the dropped neighbours, or a refusal with the reason."""
    req = RecoveryRequest.from_config(msg.content["config"])
    store = RecoveryStore.load(env)
    why = check_request(store, req, env.node_id)
    if why:
        out = RecoveryReply(refused=why)
    else:
        assert store is not None  # check_request refuses otherwise
        out = answer(store, set(req.dropped))
        store.answered = (tuple(sorted(req.received)), tuple(sorted(req.dropped)))
        store.save(env)
    return Message(RecordDict({"config": out.to_config()}), reply_to=msg)
