"""Client side of dropout recovery (``query.recover``) for the pairwise-noise methods nadp, niss and mpddp.

When it uploads, a client keeps (:class:`RecoveryStore`, in ``Context.state``) this round's material its upload
holds because of each neighbour: nadp and mpddp the per-round pair seed, niss a
:class:`~protocols.wire.recovery.NissPairMaterial`.  The next train message overwrites it.

:func:`handle_recover` answers a :class:`~protocols.wire.recovery.RecoveryRequest` with the material of the
dropped neighbours only, after :func:`check_request`: it refuses, naming the reason, a round it did not upload in (in this run),
a request without its own upload in ``received``, a node both received and dropped, a neighbour in neither set,
or a different request than the one it already signed or answered this round (:func:`pinned`, in the ledger).
Material that would strip all pair noise from its own upload is kept (``kept``); for ``excluded`` peers it reveals
only what leaves their own noise in.
With double masking (:func:`answer_masked`, :mod:`protocols.masking`) it reveals per neighbour either its share of
the neighbour's self-mask seed or their pair material, never both, and refuses when fewer than its threshold of
neighbours are named received; pair material of a neighbour ``k`` not aggregated goes out only for the outcome this
client signed (:mod:`client.consistency`) and with enough valid signatures of it from ``k``'s neighbours
(:func:`unsigned`, :mod:`protocols.consistency`).  Threat model: ``docs/robustness.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from client.env import ClientEnv
from client.floor import policy
from client.identity import node_identity
from client.ledger import ClientLedger, ledger_dir
from client.pairwise_phase import pair_seeds, participants_of, roster_round_of
from client.recovery_ledger import charge_recovery, recovery_events
from protocols.consistency import SignedOutcome, outcome_digest, valid_signers
from protocols.floor import FloorViolation
from protocols.masking import (
    SHARE_PURPOSE,
    commitment,
    mask_threshold,
    new_mask_seed,
    open_share,
    seal_shares,
    self_mask,
    signature_count,
)
from protocols.relay_crypto import RelayAuthError
from protocols.wire.common import TrainIns
from protocols.wire.consistency import CONSISTENCY_RECORD, SignedOutcomes
from protocols.wire.recovery import SELF_MASK_RECORD, RecoveryReply, RecoveryRequest, SelfMaskShares

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
    #: neighbour -> material to reveal when the server holds its upload (default: ``material``).
    protect: dict[int, bytes] = field(default_factory=dict)
    #: neighbour -> projection of what ``protect`` leaves in the aggregate (cancellation check only).
    protect_probe: dict[int, float] = field(default_factory=dict)
    #: neighbour -> material revealing neither noise (default: nothing).
    shield: dict[int, bytes] = field(default_factory=dict)
    #: (received, dropped, excluded) of the request already answered this round, if any.
    answered: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
    #: double masking: neighbour -> key opening the self-mask share it sealed for this client (empty: unmasked).
    mask_keys: dict[int, bytes] = field(default_factory=dict)
    #: shares of this client's own self-mask seed needed to rebuild it.
    threshold: int = 0
    #: neighbours whose self-mask share / pair seed this client revealed this round.
    revealed_mask: set[int] = field(default_factory=set)
    revealed_pair: set[int] = field(default_factory=set)
    #: digest of the round outcome this client signed (:mod:`client.consistency`; empty: none yet).
    signed: bytes = b""
    #: what the round charged and the public values that price a recovery (:mod:`client.recovery_ledger`; JSON).
    charge: str = ""
    #: the Flower run of the upload (None: unknown; :func:`check_request` then answers no run).
    run_id: int | None = None

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
            if self.protect:
                rec["protect"] = [self.protect.get(p, self.material[p]) for p in peers]
            if self.protect_probe:
                rec["protect-probe"] = [float(self.protect_probe.get(p, 0.0)) for p in peers]
            if self.shield:
                rec["shield"] = [self.shield.get(p, b"") for p in peers]
        if self.mask_keys:
            rec["mask-peers"] = [str(p) for p in sorted(self.mask_keys)]
            rec["mask-keys"] = [self.mask_keys[p] for p in sorted(self.mask_keys)]
            rec["threshold"] = int(self.threshold)
        for key, nodes in (("revealed-mask", self.revealed_mask), ("revealed-pair", self.revealed_pair)):
            if nodes:
                rec[key] = [str(n) for n in sorted(nodes)]
        if self.signed:
            rec["signed"] = self.signed
        if self.charge:
            rec["charge"] = self.charge
        if self.run_id is not None:
            rec["run-id"] = str(self.run_id)  # text: a Flower run id is an unsigned 64-bit value
        if self.answered is not None:
            rec["answered-received"] = [str(n) for n in self.answered[0]] or [""]
            rec["answered-dropped"] = [str(n) for n in self.answered[1]] or [""]
            rec["answered-excluded"] = [str(n) for n in self.answered[2]] or [""]
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
        protect = dict(zip(peers, (bytes(m) for m in rec["protect"]), strict=True)) if "protect" in rec else {}
        protect_probe = (dict(zip(peers, (float(v) for v in rec["protect-probe"]), strict=True))
                         if "protect-probe" in rec else {})
        answered = None
        if "answered-received" in rec:
            answered = tuple(tuple(int(n) for n in rec[k] if n != "") for k in ("answered-received",
                                                                                  "answered-dropped",
                                                                                  "answered-excluded"))
        shield = dict(zip(peers, (bytes(m) for m in rec["shield"]), strict=True)) if "shield" in rec else {}
        mask_keys = dict(zip((int(p) for p in rec.get("mask-peers", [])), (bytes(k) for k in rec.get("mask-keys", [])),
                             strict=True))
        return cls(int(rec["round"]), material, noise, partial, kept_probe, protect, protect_probe, shield,
                   answered, mask_keys, int(rec.get("threshold", 0)),  # type: ignore[arg-type]
                   {int(n) for n in rec.get("revealed-mask", [])}, {int(n) for n in rec.get("revealed-pair", [])},
                   bytes(rec.get("signed", b"")), str(rec.get("charge", "")),
                   int(rec["run-id"]) if "run-id" in rec else None)


def remember(env: ClientEnv, rnd: int, material: Mapping[int, bytes], noise: Mapping[int, float] | None = None,
             partial: Mapping[int, bytes] | None = None, kept_probe: Mapping[int, float] | None = None,
             protect: Mapping[int, bytes] | None = None, protect_probe: Mapping[int, float] | None = None,
             shield: Mapping[int, bytes] | None = None, mask_keys: Mapping[int, bytes] | None = None,
             threshold: int = 0, charge: str = "") -> None:
    """Keep this round's pair material (called by the method's train handler when it uploads).

    ``noise[j]``: how much of this client's own pairwise noise lives with neighbour ``j`` (any positive unit;
    default 1 per neighbour); ``partial[j]``: the material to reveal instead when revealing ``material`` would
    leave none of it (default: nothing); ``kept_probe[j]``: the cancellation check's projection of the own
    noise that then stays in the aggregate; ``protect[j]``: the material for a neighbour whose upload the
    server holds (default: ``material``) and ``protect_probe[j]`` the projection of what it leaves;
    ``shield[j]``: the material revealing neither noise (default: nothing).  ``mask_keys``/``threshold``: the
    upload is self-masked (:func:`self_mask_upload`); recovery then follows :func:`answer_masked`.
    ``charge``: what the upload charged and the public values that price a recovery
    (:func:`client.recovery_ledger.charge_spec`; empty: answering charges nothing).
    """
    RecoveryStore(int(rnd), dict(material), dict(noise) if noise is not None else dict.fromkeys(material, 1.0),
                  dict(partial or {}), dict(kept_probe or {}), dict(protect or {}), dict(protect_probe or {}),
                  dict(shield or {}), None, dict(mask_keys or {}), int(threshold), charge=charge,
                  run_id=int(env.context.run_id)).save(env)


def _share_context(env: ClientEnv) -> bytes:
    return int(env.context.run_id).to_bytes(8, "big")


@dataclass(frozen=True)
class SelfMask:
    """The round's self-mask of an upload: the vector to add, the reply record, and what recovery needs."""

    vector: np.ndarray
    shares: SelfMaskShares
    keys: dict[int, bytes]
    threshold: int

    def attach(self, out: Message) -> Message:
        """Put the sealed shares into the train reply ``out`` (returned)."""
        out.content[SELF_MASK_RECORD] = ConfigRecord(self.shares.to_config())
        return out


def check_unmasked(env: ClientEnv) -> None:
    """Refuse a round without double masking (``self-mask = false``) on a node whose policy asks for a guarantee.

    Without a self-mask, a server that holds this node's upload and names it dropped or excluded has its neighbours
    reveal every pair seed with it: the upload keeps only its independent noise (nadp's residual, niss's
    distortion: none at ``tau = 0``), far below the joint view its ledger charged, and no answer of this node's
    tops the ledger up (docs/robustness.md).  Raises :class:`FloorViolation`.
    """
    if policy(env).wants_guarantee:
        raise FloorViolation("self-mask", False, True, "without double masking a server holding this node's upload "
                             "can have its neighbours strip all its pair noise, which its ledger cannot charge; this "
                             "node's 'max-epsilon-per-run' / 'lifetime-epsilon' asks for a guarantee")


def self_mask_upload(msg: Message, env: ClientEnv, size: int, std: float,
                     graph: dict[int, list[int]] | None = None) -> SelfMask | None:
    """A fresh self-mask ``N(0, std^2)`` for this round's upload, its seed shared t-of-n among the neighbours.

    ``std``: at least the client's floor upload noise (what stays in the upload if all its pair noise is
    revealed).  None when the run has ``self-mask = false`` or the client has no neighbour.  Each share is
    sealed under a pair key (purpose :data:`protocols.masking.SHARE_PURPOSE`) bound to the round's view.
    """
    if not env.cfg.self_mask:
        check_unmasked(env)
        return None
    keys = pair_seeds(msg, env, purpose=SHARE_PURPOSE, graph=graph)
    return seal_self_mask(keys, TrainIns.from_config(msg.content["config"]).round, env, size, std)


def seal_self_mask(keys: Mapping[int, bytes], rnd: int, env: ClientEnv, size: int, std: float) -> SelfMask | None:
    """A fresh self-mask ``N(0, std^2)`` of round ``rnd``, its seed shared t-of-n among the peers of ``keys``.

    ``keys``: neighbour -> sealing key (purpose :data:`protocols.masking.SHARE_PURPOSE`, bound to the round's
    view).  Returns None when ``keys`` is empty.  :func:`self_mask_upload` derives the keys from a train message
    carrying peer keys; niss derives them in its share phase.
    """
    if not keys:
        return None
    keys = dict(keys)
    t = mask_threshold(len(keys), env.cfg.mask_corruption_rate)
    seed = new_mask_seed()
    sealed = seal_shares(seed, keys, t, sender=env.node_id, round_num=rnd, context=_share_context(env))
    return SelfMask(self_mask(seed, size, std), SelfMaskShares(sealed, commitment(seed), std), keys, t)


def check_request(store: RecoveryStore | None, req: RecoveryRequest, me: int, run_id: int | None = None) -> str:
    """Why this client must refuse ``req`` ("" when it may answer).

    ``run_id``: the Flower run asking; a store of another run is refused.  Flower carries ``Context.state`` into
    the next run of a run series: answered there, a round would be charged to that run's ledger, past its own
    run's ``max-epsilon-per-run``.
    """
    if store is None or store.round != req.round:
        return f"no pair material of round {req.round} (this node did not upload in that round)"
    if run_id is not None and store.run_id != run_id:
        return (f"no pair material of round {req.round} of run {run_id} (this node's last upload was in "
                f"{'another run' if store.run_id is not None else 'an unknown run'})")
    received, dropped, excluded = set(req.received), set(req.dropped), set(req.excluded)
    if me not in received or (me in excluded and not store.mask_keys):
        return f"this node's upload (node {me}) is not in the received set, or excluded"
    if not excluded <= received:
        return f"node(s) {sorted(excluded - received)} named excluded but not received"
    both = sorted(received & dropped)
    if both:
        return f"node(s) {both} named both received and dropped"
    neither = sorted(set(store.material) - received - dropped)
    if neither:
        return f"neighbour(s) {neither} are neither received nor dropped"
    if store.answered is not None and tuple(set(a) for a in store.answered) != (received, dropped, excluded):
        moved = sorted(set(store.answered[0]) & dropped)
        why = f"; node(s) {moved} were reported received before" if moved else ""
        return f"a different recovery request for round {req.round} was already answered{why}"
    return ""


def pinned(env: ClientEnv, rnd: int, digest: bytes) -> str:
    """Why this node must refuse outcome ``digest`` of round ``rnd`` ("" when it is the round's one), pinning it first.

    One outcome per round, signed or answered, across every message (:meth:`client.ledger.ClientLedger.pin_outcome`:
    in the ledger, as a message's ClientApp may start on ``Context.state`` from before the previous message's).
    ``digest``: :func:`protocols.consistency.outcome_digest` of the outcome.
    """
    with _ledger(env) as led:
        return _pin(env, led, rnd, digest)


def _ledger(env: ClientEnv) -> AbstractContextManager[ClientLedger]:
    return ClientLedger.open(ledger_dir(env.context.node_config), env.partition_id)


def _pin(env: ClientEnv, led: ClientLedger, rnd: int, digest: bytes) -> str:
    first = led.pin_outcome(int(env.context.run_id), rnd, digest)
    return "" if first == digest else f"this node already signed or answered another outcome of round {rnd}"


def settle(env: ClientEnv, store: RecoveryStore, req: RecoveryRequest, digest: bytes) -> str:
    """Why the answer to ``req`` (outcome ``digest``) must be refused ("" to send it), in one ledger open.

    Pins the outcome (:func:`pinned`), then charges what answering it strips
    (:func:`client.recovery_ledger.charge_recovery`: once per round and outcome, whichever task of the node
    answers); a charge past the node's policy is refused, the pin kept.  Priced only while ``store`` holds no
    answer of the round (:func:`check_request` refuses an answered round's other outcomes).
    """
    events = (recovery_events(env, req, store.charge, store.noise, bool(store.mask_keys)) if store.answered is None
              else (None, None))
    with _ledger(env) as led:
        why = _pin(env, led, req.round, digest)
        if not why:
            try:
                charge_recovery(env, led, req.round, digest, events)
            except FloorViolation as err:
                why = str(err)
    return why


def answer(store: RecoveryStore, dropped: set[int], excluded: set[int] = frozenset()) -> RecoveryReply:  # type: ignore[assignment]
    """The material of the dropped and excluded neighbours (see the module docstring for what is kept)."""
    gone = dropped | excluded
    peers = tuple(sorted(p for p in store.material if p in gone))
    total = sum(store.noise.values())
    left = sum(v for p, v in store.noise.items() if p not in gone)
    strip = total > 0 and left <= 0
    material, kept, probes = [], [], []
    for p in peers:
        if p in excluded and strip:  # neither this node's noise nor the held peer's: both stay in the aggregate
            material.append(store.shield.get(p, b""))
            kept.append(p)
            both = [store.kept_probe.get(p), store.protect_probe.get(p)] if p in store.protect else [None]
            probes.append(None if None in both else math.fsum(v for v in both if v is not None))
        elif p in excluded:
            material.append(store.protect.get(p, store.material[p]))
            if p in store.protect:
                kept.append(p)
                probes.append(store.protect_probe.get(p))
        elif strip:
            material.append(store.partial.get(p, b""))
            kept.append(p)
            probes.append(store.kept_probe.get(p))
        else:
            material.append(store.material[p])
    probe = math.fsum(v for v in probes if v is not None) if kept and all(v is not None for v in probes) else None
    return RecoveryReply(peers, tuple(material), kept=tuple(kept), kept_probe=probe)


def unsigned(store: RecoveryStore, req: RecoveryRequest, env: ClientEnv, gone: set[int],
             signatures: SignedOutcomes | None, digest: bytes) -> tuple[str, set[int]]:
    """(why no pair material may go out at all, "" when some may; the neighbours of ``gone`` whose may not).

    Requires that this client signed the request's outcome (:func:`client.consistency.handle_consistency`) and,
    for each ``k`` in ``gone`` (not aggregated), valid signatures on that same outcome from at least
    :func:`protocols.masking.signatures_needed` of ``k``'s present neighbours (this client counts for itself;
    :func:`protocols.masking.signature_count`, the rule the server predicts answers with),
    each checked against the roster under the name the round's checked view gives its node; a ``k`` short of them
    is in the second set (its pair material stays secret, its pair noise in the aggregate).  ``digest``: the
    request's outcome digest (:func:`protocols.consistency.outcome_digest`).
    """
    if store.signed != digest:
        return (f"the request declares neighbour(s) {sorted(gone)} not aggregated, but this node signed "
                f"{'another' if store.signed else 'no'} outcome of round {req.round} (consistency check)"), set()
    present = participants_of(env, req.round)
    if present is None:
        return f"this node holds no checked view of round {req.round}", set()
    me = node_identity(env)
    offered: dict[int, list[SignedOutcome]] = {}
    for e in signatures.entries if signatures else ():
        offered.setdefault(e.node, []).append(e)
    checked = {env.node_id: True}  # node -> whether it offers a valid signature (each verified at most once)

    def valid(n: int) -> bool:
        if n not in checked:
            checked[n] = bool(valid_signers(me.roster, offered[n], present, run_id=int(env.context.run_id),
                                            round_num=req.round, digest=digest))
        return checked[n]

    rr = roster_round_of(env.cfg, me.roster, req.round)
    short = set()
    for k in sorted(gone):
        roster_nbrs = set(rr.neighbours(present[k]))
        nbrs = sorted(n for n, name in present.items() if name in roster_nbrs)
        have, need = signature_count(nbrs, len(roster_nbrs), env.cfg.mask_corruption_rate,
                                     lambda n: (n in offered or n == env.node_id) and valid(n))
        if have < need:
            short.add(k)
    return "", short


def answer_masked(store: RecoveryStore, req: RecoveryRequest, env: ClientEnv, digest: bytes,
                  signatures: SignedOutcomes | None = None) -> RecoveryReply:
    """Double masking: self-mask shares of the received neighbours, pair seeds of the dropped and excluded.

    An excluded client (its upload held, not aggregated) answers too, with its neighbours' self-mask shares only:
    its pair material is in no aggregated upload (its aggregated neighbours reveal their side), and revealing
    it would strip its own pair noise from the upload the server holds.
    Refuses (and reveals nothing) when fewer than ``threshold`` neighbours are named received and not
    excluded while this client's own upload is to be aggregated, when the request asks for the other kind of
    material of a peer than this client already revealed, or when the request's outcome differs from the one
    this client signed (:func:`unsigned`).  The pair material of a neighbour not aggregated whose neighbours did
    not sign the outcome enough stays secret (its material empty, named ``kept``: that pair noise stays in the
    aggregate); the rest of the answer goes out, so one short neighbourhood does not fail the round.
    ``digest``: the request's outcome digest; ``signatures``: those the server collected in the consistency phase.
    """
    excluded = set(req.excluded)
    kept = set(req.received) - excluded
    nbrs = set(store.material)
    alive = nbrs & kept
    gone = set() if env.node_id in excluded else nbrs - alive  # pair material goes out only from an aggregated node
    # Pair seeds go out for every neighbour not aggregated (dropped or excluded): at most d - t of them, else a
    # server splitting the neighbours' views could collect this node's self-mask and all its pair seeds.
    if env.node_id not in excluded and len(alive) < store.threshold:
        return RecoveryReply(refused=(
            f"only {len(alive)} of this node's {len(nbrs)} neighbours are named received, fewer than the "
            f"{store.threshold} needed to rebuild its own self-mask: the round cannot use its upload"))
    conflict = sorted((alive & store.revealed_pair) | (gone & store.revealed_mask))
    if conflict:
        return RecoveryReply(refused=f"node(s) {conflict}: the other kind of material was already revealed this round")
    if store.signed and store.signed != digest:
        return RecoveryReply(refused=f"the request's outcome differs from the one this node signed for round {req.round}")
    why, short = unsigned(store, req, env, gone, signatures, digest) if gone else ("", set())
    if why:
        return RecoveryReply(refused=why)
    forwarded = req.forwarded or {}
    mask_peers, shares = [], []
    for x in sorted(alive):
        if x not in forwarded or x not in store.mask_keys:
            continue
        try:
            shares.append(open_share(store.mask_keys[x], forwarded[x], sender=x, receiver=env.node_id,
                                     round_num=req.round, context=_share_context(env)))
        except RelayAuthError:
            continue  # a tampered or misdirected share is not revealed
        mask_peers.append(x)
    peers = tuple(sorted(gone))
    store.revealed_mask |= set(mask_peers)
    store.revealed_pair |= gone - short
    # A neighbour short of signatures: nothing of the pair goes out (empty material, named kept), its noise stays.
    return RecoveryReply(peers, tuple(b"" if p in short else store.material[p] for p in peers),
                         kept=tuple(sorted(short)), mask_peers=tuple(mask_peers), mask_shares=tuple(shares))


def recovery_answer(content: RecordDict, env: ClientEnv) -> ConfigRecord:
    """The answer to the recovery request in ``content["config"]``: pair material, self-mask shares, or a refusal.

    ``content`` may also hold the consistency phase's signatures (record ``CONSISTENCY_RECORD``).  The same rules
    hold whether the request came as ``query.recover`` or in the next round's train message
    (:func:`answer_carried`).  Before an answer leaves, its outcome is pinned and the node's ledger charged what the
    outcome strips from the round's noise, once per round and outcome (:func:`settle`); a charge past the node's
    policy is refused and the reply is the refusal, nothing revealed.
    """
    try:
        req = RecoveryRequest.from_config(content["config"])
    except (KeyError, TypeError, ValueError) as err:
        return ConfigRecord(RecoveryReply(refused=f"malformed recovery request ({err})").to_config())
    store = RecoveryStore.load(env)
    why = check_request(store, req, env.node_id, int(env.context.run_id))
    if why:
        out = RecoveryReply(refused=why)
    else:
        assert store is not None  # check_request refuses otherwise
        digest = outcome_digest(req.round, req.received, req.dropped, req.excluded)
        if store.mask_keys:
            try:
                sigs = (SignedOutcomes.from_config(content[CONSISTENCY_RECORD])
                        if CONSISTENCY_RECORD in content else None)
            except ValueError as err:
                out = RecoveryReply(refused=f"malformed signatures ({err})")
            else:
                out = answer_masked(store, req, env, digest, sigs)
        else:
            out = answer(store, set(req.dropped), set(req.excluded))
        if not out.refused and (why := settle(env, store, req, digest)):
            out = RecoveryReply(refused=why)
        if not out.refused:
            store.answered = (tuple(sorted(req.received)), tuple(sorted(req.dropped)), tuple(sorted(req.excluded)))
            store.save(env)
    return ConfigRecord(out.to_config())


def answer_carried(rec: object, env: ClientEnv) -> ConfigRecord:
    """The previous round's unmasking request carried by a train message (its record ``UNMASK_RECORD``), answered.

    Called before the train handler keeps this round's material (:func:`remember`), which replaces the
    previous round's.
    """
    if not isinstance(rec, ConfigRecord):
        return ConfigRecord(RecoveryReply(refused="malformed recovery request (not a config record)").to_config())
    return recovery_answer(RecordDict({"config": rec}), env)


def handle_recover(msg: Message, env: ClientEnv) -> Message:
    """``query.recover``: this round's pair material of the dropped neighbours, or a refusal with the reason."""
    return Message(RecordDict({"config": recovery_answer(msg.content, env)}), reply_to=msg)
