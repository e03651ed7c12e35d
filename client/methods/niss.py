"""Client side of NISS: noise shares sealed for neighbours, distorted negated shares, noisy upload.

Two steps per round (protocol: :mod:`strategies.niss`, :mod:`strategies.niss_shares`; messages:
:mod:`protocols.wire.niss`):

* :func:`answer_shares` (a ``query.shares`` message, or the previous round's train message, which may carry this
  round's request): ``sigma_k`` from the client's own run config, dataset size and the
  public schedule's most releases of any client (:func:`protocols.niss.client_sigma`) times the round's
  ``niss-noise-scale``, refused below the scale the joint view of all uploads needs (:func:`protocols.floor.niss_floor`
  of the roster graph among the participants and their public sizes, on the same releases; a node whose policy
  asks for a guarantee also refuses ``tau = 0``), one share of variance
  ``sigma_k^2 / m`` per neighbour the server names (:func:`protocols.niss.client_plan`), returned as one AES-256-GCM
  payload per neighbour; seeds, relay keys and parameters are kept in ``Context.state`` for the next phase.
* :func:`train` (``train``): open every relayed payload first (a missing, duplicated, unexpected or unauthentic
  one means no upload, the senders reported), train, and upload ``p_k w_k + sum_i n_i + sum_i s_i r_i`` in
  float64 with ``s_i ~ N(1, tau_k^2)`` per coordinate (:func:`protocols.niss.distortion_seed`), the weighted update
  noised before ``p_k`` times the received model is added (:func:`protocols.niss.client_upload`); keep the round's
  pair material for :mod:`client.recovery`; with ``self-mask`` also add a self-mask ``N(0, sigma_k^2)`` whose
  seed is Shamir-shared among the neighbours (:func:`client.recovery.seal_self_mask`); the next round's share
  request the message may carry is answered before the round is charged (a refused request gets no answer here:
  the server asks again in a ``query.shares`` phase).

Payload format: :func:`client.methods.niss_payload.encode_payload`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from logging import WARNING

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log

from client.env import ClientEnv, client_level_update, record_level_training, reply
from client.floor import FloorViolation, check_new_round, policy, release
from client.identity import node_identity
from client.ledger import ClientLedger, ledger_dir
from client.methods.niss_payload import decode_payload, encode_payload
from client.pairwise_phase import checked_pair_seeds, mask_probe, remember_view
from client.records import to_record
from client.recovery import check_unmasked, remember, seal_self_mask
from client.recovery_ledger import Kept, charge_spec, gone, int_graph, int_keys, top_event
from protocols import niss as niss_math
from protocols.arrays import flatten, unflatten
from protocols.floor import niss_floor
from protocols.masking import SHARE_PURPOSE
from protocols.niss import (
    aggregation_weights,
    client_multiplier,
    client_plan,
    client_sigma,
    client_tau,
    sizes_digest,
    upload_sensitivity,
)
from protocols.niss_joint import recovered_multiplier, revealed_kept
from protocols.privacy import Event, GaussianEvent
from protocols.relay_crypto import RelayAuthError, make_aad, open_sealed, seal
from protocols.schedule import roster_releases
from protocols.task.models import get_weights
from protocols.wire.arrays import from_record
from protocols.wire.common import TrainIns, ViewError, train_metrics
from protocols.wire.keys import probe_metric
from protocols.wire.niss import (
    AHEAD_RECORD,
    AuthFailures,
    Diagnostic,
    NissMetrics,
    RelayedInbox,
    ShareReply,
    ShareRequest,
    diagnostics_allowed,
)
from protocols.wire.recovery import NissPairMaterial, RecoveryRequest

STATE_KEY = "cancelfl-niss"
RELAY_PURPOSE = "niss-relay-key"
#: Name of the node's pinned share secret of a run (:func:`share_secret`).
SECRET_PURPOSE = "niss-share"
_SCALE = struct.Struct(">d")


def _fresh_seed(label: str) -> bytes:
    """32 bytes of fresh OS randomness; ``label`` names the use (tests replace this to make runs replayable)."""
    del label
    return os.urandom(32)


def _aad(sender: int, receiver: int, rnd: int, run_id: int, encoding: str, scale: float) -> bytes:
    """Associated data binding a payload to its pair, round, run, encoding and the request's joint-view scale.

    The one construction both the sealing (:func:`answer_shares`) and the opening (:func:`train`) side use.  The
    relay key binds the rest of the request the two ends share (the view, the sizes: :func:`answer_shares`), so a
    payload opens only where its receiver trains under the very view and scale its sender made the shares for.
    """
    return make_aad(sender=sender, receiver=receiver, round_num=rnd,
                    context=int(run_id).to_bytes(8, "big") + _SCALE.pack(scale) + b"niss/" + encoding.encode())


def share_secret(env: ClientEnv) -> bytes:
    """The node's share secret of the run: 32 bytes of OS randomness, made once and pinned beside its ledger.

    Every task of the node reads the pinned one (:meth:`client.ledger.ClientLedger.run_secret`: an owner-only
    file, first writer wins under the ledger's lock), whatever ``Context.state`` it starts on (Flower's SuperNode
    may start a message's ClientApp on the state from before the previous message's); nothing public (run config,
    run id, identity) determines it.  Read once per message (``env.memo``).

    Raises:
        ValueError: the pinned file does not hold 32 bytes.
    """
    secret = env.memo.get(SECRET_PURPOSE)
    if secret is None:
        secret = ClientLedger.run_secret(ledger_dir(env.context.node_config), env.partition_id, env.context.run_id,
                                         SECRET_PURPOSE, lambda: _fresh_seed(f"{env.node_id}/share"))
        if len(secret) != 32:
            raise ValueError(f"the pinned niss share secret of run {env.context.run_id} holds {len(secret)} bytes, not 32")
        env.memo[SECRET_PURPOSE] = secret
    return secret


def share_seed(env: ClientEnv, rnd: int, scale: float, peer: int, relay_key: bytes) -> bytes:
    """The seed of this node's shares for neighbour ``peer`` in the request of round ``rnd`` at ``scale``.

    A keyed hash of the request (the round, the scale, the peer and its relay key, which binds the view and the
    sizes) under this node's :func:`share_secret`: the same request draws the same shares in every task of the
    node, whatever was asked in between, so whichever of its answers the server relays, they cancel; any other
    request draws independent ones.
    """
    msg = b"cancelfl/niss/share" + b"".join(int(v).to_bytes(8, "big") for v in (rnd, peer)) + _SCALE.pack(scale)
    msg += bytes(relay_key)
    return hmac.new(share_secret(env), msg, hashlib.sha256).digest()


def model_size(env: ClientEnv) -> int:
    """Number of model parameters (the length of every share vector)."""
    return int(sum(v.size for v in get_weights(env.model()).values()))


# --------------------------------------------------------------------------- state
@dataclass
class _Stored:
    """The round's secrets from the share phase (kept in Context.state)."""

    round: int
    weight: float
    sigma: float
    encoding: str
    neighbours: list[int]
    relay_keys: dict[int, bytes]
    outgoing: list[niss_math.ShareBundle]
    #: the distortion std chosen in the share phase (protocols.niss.client_tau of the round's sizes)
    tau: float = 0.0
    #: double masking: neighbour -> key sealing this client's self-mask share for it (empty: ``self-mask = false``)
    mask_keys: dict[int, bytes] = dataclasses.field(default_factory=dict)
    #: the round's joint-view scale on sigma (``niss-noise-scale``, at least :func:`protocols.floor.niss_floor`'s)
    scale: float = 1.0
    #: ``scale`` over the floor's scale (>= 1): the budget guard's raise, which this client's release counts
    credit: float = 1.0
    #: the round's public view that prices a recovery (JSON: every participant's sigma, the graph, the roster degrees)
    view: str = "{}"

    def to_record(self) -> ConfigRecord:
        rec = ConfigRecord({
            "round": self.round, "weight": self.weight, "sigma": self.sigma, "tau": self.tau, "scale": self.scale,
            "credit": self.credit, "encoding": self.encoding, "view": self.view,
            "neighbours": [str(n) for n in self.neighbours],
            "relay-keys": [self.relay_keys[n] for n in self.neighbours],
            "out-receivers": [str(b.receiver) for b in self.outgoing],
            "out-counts": [b.count for b in self.outgoing],
            "out-stds": [b.share_std for b in self.outgoing],
            "out-seeds": [b.seed for b in self.outgoing],
        })
        if self.mask_keys:
            rec["mask-keys"] = [self.mask_keys[n] for n in self.neighbours]
        return rec

    @classmethod
    def load(cls, env: ClientEnv, rnd: int) -> _Stored:
        rec = env.context.state.get(STATE_KEY)
        if rec is None or int(rec["round"]) != rnd:
            raise RuntimeError(f"no NISS share state for round {rnd}: the share phase did not run on this node")
        nbrs = [int(n) for n in rec["neighbours"]]
        me = env.node_id
        out = [niss_math.ShareBundle(me, int(r), int(c), float(s), bytes(seed)) for r, c, s, seed in
               zip(rec["out-receivers"], rec["out-counts"], rec["out-stds"], rec["out-seeds"], strict=True)]
        mask_keys = dict(zip(nbrs, (bytes(k) for k in rec["mask-keys"]), strict=True)) if "mask-keys" in rec else {}
        return cls(rnd, float(rec["weight"]), float(rec["sigma"]), str(rec["encoding"]), nbrs,
                   dict(zip(nbrs, (bytes(k) for k in rec["relay-keys"]), strict=True)), out, float(rec["tau"]),
                   mask_keys, float(rec["scale"]), float(rec.get("credit", 1.0)), str(rec.get("view", "{}")))


# -------------------------------------------------------------------------- phases
def handle_shares(msg: Message, env: ClientEnv) -> Message:
    """``query.shares``: split this client's DP noise into shares and seal one payload per neighbour."""
    shares = answer_shares(msg.content["config"], env)
    return Message(RecordDict({"config": ConfigRecord(shares.to_config())}), reply_to=msg)


def answer_shares(rec: ConfigRecord, env: ClientEnv, *, training: int | None = None) -> ShareReply:
    """The sealed payloads for the :class:`ShareRequest` in ``rec``, after every check of its view (module doc).

    The round's secrets go to ``Context.state`` (replacing what is there) together with the checked view they were
    made for (:func:`client.pairwise_phase.remember_view`, which the round's recovery counts on), after every
    check: a refused request leaves both as they were.  Asked again for the same round, view and scale, before
    training in it, the client seals the same shares again (:func:`share_seed`), whatever was asked in between:
    whichever payloads the server relays, they cancel.  ``training``: the round whose train message carries it.
    """
    req = ShareRequest.from_config(rec)
    rnd, weight, me = req.round, req.weight, env.node_id
    check_new_round(env, rnd, training)  # never a round trained in (or training now): its view stays recovery's
    nbrs = list(req.peers.peer_ids)
    if not nbrs or me in nbrs:
        raise ViewError(f"invalid neighbour list from the tracker: {nbrs}")
    encoding = env.cfg.niss_share_encoding
    if req.sizes and req.sizes.get(me) != len(env.y):
        raise ViewError(f"server lists |D_k|={req.sizes.get(me)} for node {me}, but it holds {len(env.y)} examples")
    # p_k from the round's public view, never the server's figure: a server that shrank some clients' weights
    # would shrink the noise hiding the negated shares they hold (protocols.niss.aggregation_weights).
    own_weight = aggregation_weights(env.cfg, req.peers.participants, req.sizes)[me]
    if not math.isclose(weight, own_weight, rel_tol=1e-9):
        raise ViewError(f"aggregation weight {weight!r} does not match the round's view "
                         f"(participants and sizes give {own_weight!r})")
    tau = client_tau(env.cfg, req.sizes)  # the sizes can only raise tau above 1/sqrt(m)
    if tau == 0 and policy(env).wants_guarantee:
        raise FloorViolation("niss-tau", tau, "> 0", "with tau = 0 the sum of the uploads is noiseless: no guarantee "
                             "against the server, which this node requires")
    if not env.cfg.self_mask:
        check_unmasked(env)
    # The sizes (hence every p_k) are part of the view: shown other sizes, a client derives relay keys no peer shares.
    # Double masking: keys sealing this round's self-mask shares (sent with the upload, client.recovery).
    purposes = (RELAY_PURPOSE, SHARE_PURPOSE) if env.cfg.self_mask else (RELAY_PURPOSE,)
    view, seeds_for = checked_pair_seeds(rec, env, purposes, view_extra=sizes_digest(req.sizes), full=True,
                                         remember=False)
    # The joint view of all uploads (the roster's graph among the participants, public sizes): refuse a smaller scale.
    # Calibrated for the most rounds the public schedule samples any client in (the server computes the same).
    releases = roster_releases(env.cfg, node_identity(env).roster)
    floor = niss_floor(env.cfg, req.sizes, view.graph or {}, tau, req.noise_scale, releases, degrees=view.degrees)
    # The client's own calibration (run config, its dataset size, the neighbour count): never the server's figures.
    plan = client_plan(env.cfg, own_weight, len(env.y), len(nbrs), req.noise_scale, releases)
    sigma = plan.sigma_k
    if not math.isfinite(sigma * sigma):  # the accounting and the shares' variances square it
        raise ViewError(f"niss-noise-scale {req.noise_scale!r} gives this node a noise std whose square overflows")
    keys, mask_keys = seeds_for[RELAY_PURPOSE], seeds_for.get(SHARE_PURPOSE, {})
    bundles = niss_math.make_outgoing_bundles(me, plan, nbrs,
                                              {n: share_seed(env, rnd, req.noise_scale, n, keys[n]) for n in nbrs})
    by_receiver = {b.receiver: b for b in bundles}
    size = model_size(env) if encoding == "vector" else 0
    payloads = []
    for n in nbrs:  # one payload per neighbour, in the tracker's order
        aad = _aad(me, n, rnd, env.context.run_id, encoding, req.noise_scale)
        payloads.append(seal(keys[n], encode_payload(encoding, by_receiver[n], size), aad=aad))
    graph = view.graph or {}
    weights = aggregation_weights(env.cfg, list(graph), req.sizes)  # as niss_floor: every sigma of the joint view
    sigmas = {n: sigma if n == me else client_sigma(env.cfg, weights[n], int(req.sizes.get(n, 1)), releases)
              * req.noise_scale for n in graph}
    priced = json.dumps({"sigmas": {str(n): s for n, s in sigmas.items()},
                         "graph": {str(n): list(nb) for n, nb in graph.items()},
                         "degrees": {str(n): d for n, d in (view.degrees or {}).items()}, "releases": releases})
    env.context.state[STATE_KEY] = _Stored(rnd, own_weight, sigma, encoding, nbrs, keys, bundles, tau,
                                           mask_keys, req.noise_scale, req.noise_scale / floor.scale, priced).to_record()
    remember_view(env, view)
    return ShareReply(tuple(nbrs), tuple(payloads))


def _answer_ahead(msg: Message, env: ClientEnv) -> ConfigRecord | None:
    """The answer to the next round's share request the train message carries, for the reply's ahead record.

    None when it carries none, or a request this client refuses: the server then asks in a ``query.shares`` phase,
    where the refusal reaches it.  Called before the round is charged, so that nothing the record holds can make
    the train reply fail once the ledger has paid for its upload; any other exception fails the reply uncharged.
    """
    if AHEAD_RECORD not in msg.content:
        return None
    try:
        training = TrainIns.from_config(msg.content["config"]).round  # an ahead request is for a later round only
        return ConfigRecord(answer_shares(msg.content[AHEAD_RECORD], env, training=training).to_config())
    except (ValueError, RuntimeError, KeyError) as err:  # a refusal (FloorViolation, IdentityError), no state
        log(WARNING, "node %s: next round's NISS share request not answered here (%s)", env.node_id, err)
        return None


def _open_incoming(inbox: RelayedInbox, env: ClientEnv, st: _Stored, size: int) -> tuple[list, list[tuple[int, str]]]:
    """Open every relayed payload; returns (sorted [(sender, bundle, vectors)], failures [(sender, reason)])."""
    failures: list[tuple[int, str]] = []
    seen: dict[int, tuple] = {}
    for s, blob in zip(inbox.from_ids, inbox.payloads, strict=True):
        if s not in st.relay_keys:
            failures.append((s, "payload from a node that is not a neighbour"))
            continue
        if s in seen:
            failures.append((s, "duplicate payload"))
            continue
        try:
            plain = open_sealed(st.relay_keys[s], blob, aad=_aad(s, env.node_id, st.round, env.context.run_id,
                                                                   st.encoding, st.scale))
            bundle, vectors = decode_payload(plain, st.encoding, s, env.node_id, size)
        except RelayAuthError as err:
            failures.append((s, f"authentication failed ({err})"))
            continue
        except ValueError as err:
            failures.append((s, f"malformed payload ({err})"))
            continue
        seen[s] = (s, bundle, vectors)
    failures += [(n, "missing payload") for n in st.neighbours if n not in seen and n not in {f for f, _ in failures}]
    return [seen[s] for s in sorted(seen)], failures


def _received(incoming: list, size: int, tau: float, private: bytes) -> dict[int, np.ndarray]:
    """Per sender, the distorted negated shares received from it (one distortion stream per sender)."""
    expanded = iter(niss_math.bundles_shares([b for _s, b, v in incoming if v is None], size))  # seed encoding
    groups = []
    for s, _b, v in incoming:
        if v is None:
            v = next(expanded)
            np.negative(v, out=v)  # the negated shares r = -n, in place
        groups.append((s, v))
    return niss_math.distorted_partials(groups, size, tau, private)


def _recovery_material(st: _Stored, incoming: list, partials: dict[int, np.ndarray], size: int, tau: float,
                       private: bytes, probe: Callable[[np.ndarray], float] | None = None) -> tuple[dict, ...]:
    """Per neighbour, what this upload holds because of it (revealed only if it drops, :mod:`client.recovery`).

    Own shares sent to it (bundle seed) and the distorted negated shares received from it: with the ``seed``
    encoding its bundle seed and this client's distortion seed for it (:func:`protocols.niss.distortion_seed`,
    which distorts nothing else), with the ``vector`` encoding the exact contribution vector.  The noise
    weight of a neighbour is the variance of this client's own shares it holds; the partial material keeps
    those shares secret (and ``probe`` gives their projection for the cancellation check); the protecting
    material, for a neighbour whose upload the server holds, keeps that neighbour's shares secret instead.
    Returns ``(material, noise, partial, kept_probe, protect, protect_probe, shield)`` (shield: neither).
    """
    out_by = {b.receiver: b for b in st.outgoing}
    by_seed = st.encoding == "seed"
    material, noise, partial, kept_probe, protect, protect_probe, shield = {}, {}, {}, {}, {}, {}, {}
    for s, b, _v in incoming:
        o = out_by.get(s)
        oc, ostd, oseed = (o.count, o.share_std, o.seed) if o is not None else (0, 0.0, bytes(32))
        m = NissPairMaterial(oc, ostd, oseed, b.count, b.share_std, in_seed=b.seed if by_seed else None,
                             in_dseed=niss_math.distortion_seed(private, s) if by_seed and tau > 0 else None,
                             in_vector=None if by_seed else partials[s])
        material[s], noise[s], partial[s] = m.to_bytes(), oc * ostd**2, m.keep_own().to_bytes()
        protect[s], shield[s] = m.keep_in().to_bytes(), m.keep_own().keep_in().to_bytes()
        if probe is not None:
            kept_probe[s] = probe(niss_math.sender_noise([o], size)) if o is not None else 0.0
            protect_probe[s] = probe(partials[s])
    return material, noise, partial, kept_probe, protect, protect_probe, shield


def _rejected(msg: Message, env: ClientEnv, failures: list[tuple[int, str]]) -> Message:
    """The train reply of a client that could not open its inbox: no upload, the offending senders named."""
    report = AuthFailures(tuple(s for s, _ in failures), tuple(why for _, why in failures))
    return Message(RecordDict({"metrics": MetricRecord(train_metrics(len(env.y))), "config": ConfigRecord(report.to_config())}),
                   reply_to=msg)


def _trained(msg: Message, env: ClientEnv, g: np.ndarray) -> tuple[np.ndarray, float, float, dict[str, float]]:
    """Local training per the run's privacy unit: ``(flat update to g, train loss, update norm, extra metrics)``.

    ``g``: the received global model, flat.  Record level: per-example-clipped SGD (its record sensitivity is what
    ``sigma_k`` was calibrated for), the update the local model minus ``g``; client level: ordinary local training
    with the update clipped to ``clip``.
    """
    if env.cfg.privacy_unit == "client":
        _, clipped, loss, norm = client_level_update(msg, env, env.cfg.clip)
        return clipped, loss, norm, {}
    _, local_w, loss, frac = record_level_training(msg, env)
    update = flatten(local_w) - g
    return update, loss, float(np.linalg.norm(update)), {"clipped_fraction": frac}


def train(msg: Message, env: ClientEnv) -> Message:
    """Open the relayed shares, train, and upload ``p_k w_k + sum_i (n_i + s_i r_i)`` (float64)."""
    cfg = msg.content["config"]
    rnd = TrainIns.from_config(cfg).round
    st = _Stored.load(env, rnd)
    del env.context.state[STATE_KEY]  # one-time secrets: never reused in another round
    try:
        inbox = RelayedInbox.from_config(cfg)
    except ValueError as err:
        return _rejected(msg, env, [(0, f"malformed relay inbox ({err})")])
    if not math.isclose(inbox.weight, st.weight, rel_tol=1e-9):
        # sigma_k was calibrated for the share-phase weight; a larger weight now would shrink the noise-to-signal ratio.
        raise ViewError(f"aggregation weight changed between phases ({st.weight} -> {inbox.weight})")
    global_w = from_record(msg.content["arrays"])
    size = int(sum(v.size for v in global_w.values()))
    incoming, failures = _open_incoming(inbox, env, st, size)
    if failures:
        return _rejected(msg, env, failures)

    g = flatten(global_w)
    update, loss, norm, extra = _trained(msg, env, g)
    tau = st.tau  # chosen in the share phase (the round's sizes)
    own = niss_math.sender_noise(st.outgoing, size)
    private = _fresh_seed(f"{env.node_id}/{rnd}/distortion")  # s_i: known to nobody but this client
    partials = _received(incoming, size, tau, private)
    received = np.zeros(size)
    for s in sorted(partials):
        received += partials[s]
    # Double masking: a self-mask with the std of the own noise sigma_k, its seed shared t-of-n among the neighbours.
    mask = seal_self_mask(st.mask_keys, rnd, env, size, st.sigma)
    # The update meets its noise before the model the server sent (of any magnitude) is added.
    upload = niss_math.client_upload(g, update, st.weight, own, received, mask.vector if mask is not None else None)
    # The measured-noise diagnostics hand the server the noise itself (the probe: its projection on a public direction,
    # which with the upload's gives the noiseless update's there) or the noiseless update: only where the node's own
    # operator allows it (DIAGNOSTICS_ENV), never on the run config's word, and then this round is charged as un-noised.
    diagnostic = env.cfg.cancellation_check and diagnostics_allowed()
    probe_fn = (lambda v: mask_probe(msg, v)) if diagnostic else None
    figures = NissMetrics(st.sigma, tau, sum(b.count for b in st.outgoing))
    probe: dict[str, float] = {}
    if env.cfg.cancellation_check:
        figures = dataclasses.replace(figures, received_var=sum(b.count * b.share_std**2 for _s, b, _v in incoming))
    if diagnostic:
        probe = probe_metric(mask_probe(msg, own + received))
    # sigma_k = scale z Delta f_k: the uploads together leave this client at least (credit z Delta f_k)^2 of variance
    # (protocols.floor.niss_floor at scale / credit), one Gaussian release of multiplier credit z (the server charges
    # the same: the budget guard's raise is credit); none at all with tau = 0.
    z = st.credit * st.sigma / (st.scale * upload_sensitivity(env.cfg, st.weight, len(env.y))) if tau > 0 else 0.0
    charged = GaussianEvent(0.0 if diagnostic else z)
    ahead = _answer_ahead(msg, env)  # this round's secrets are gone from Context.state; nothing charged yet
    spent = release(msg, env, charged)
    view = json.loads(st.view)
    charge = charge_spec(uplink=charged, z=client_multiplier(env.cfg, view.get("releases")), scale=st.scale,
                         tau=tau, rho=env.cfg.niss_rho, **{k: view.get(k, {}) for k in ("sigmas", "graph", "degrees")})
    # Kept for recovery only once charged: a refused release leaves the previous round's material in place.
    remember(env, rnd, *_recovery_material(st, incoming, partials, size, tau, private, probe_fn),
             mask_keys=mask.keys if mask else None, threshold=mask.threshold if mask else 0, charge=charge)
    out = reply(msg, to_record(unflatten(upload, global_w), np.float64), len(env.y), train_loss=loss,
                update_norm=norm, **extra, **figures.to_metrics(), **probe, **spent)
    if diagnostic:
        Diagnostic(to_record(unflatten(st.weight * (g + update), global_w), np.float64)).add_to(out.content)
    if ahead is not None:
        out.content[AHEAD_RECORD] = ahead
    return mask.attach(out) if mask is not None else out


def price_recovery(env: ClientEnv, spec: dict, store: Kept, req: RecoveryRequest) -> tuple[Event | None, None]:
    """What answering ``req`` strips from this node's niss round: its card's ``recovery_charge``.

    (uplink, downlink) events to compose on top of the round's charge (:mod:`client.recovery_ledger`).
    """
    me = env.node_id
    graph = int_graph(spec["graph"])
    aggregated, gone_peers = gone(store, req)
    survivors = sorted(aggregated & set(graph))
    if me in req.excluded or len(survivors) == len(graph):
        return None, None
    sigmas = {n: float(v) for n, v in int_keys(spec["sigmas"]).items() if n in set(survivors)}
    # Every other survivor reveals its own shares with the gone (the least noise it can keep); this node's own:
    # all of them but those it keeps (no self-mask and no neighbour left: client.recovery.answer).
    kept = revealed_kept(sigmas, graph)
    left = math.fsum(v for p, v in store.noise.items() if p not in gone_peers)
    strip = not store.masked and sum(store.noise.values()) > 0 and left <= 0
    own = sigmas[me] ** 2 - (0.0 if strip else math.fsum(store.noise[p] for p in gone_peers))
    # Priced with the least of the two (less noise, a dearer charge): the survivors of one outcome then price it
    # with the same inputs, whose joint factors a process computes once (protocols.niss_joint.joint_factors).
    kept[me] = min(kept[me], own)
    scale = float(spec["scale"])
    real = recovered_multiplier(float(spec["z"]), sigmas, {n: s / scale for n, s in sigmas.items()}, graph, kept,
                                float(spec["tau"]), rho=float(spec["rho"]), degrees=int_keys(spec["degrees"]))
    return top_event(spec["uplink"], real), None
