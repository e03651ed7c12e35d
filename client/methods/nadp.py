"""Client side of NADP-FL (Noise-Annihilation DP-FL, Algorithm 1 of the paper).

Per round a sampled client, after the key phase (:func:`client.pairwise_phase.handle_keys`),

1. receives the global model, the round's public plan (:class:`protocols.wire.nadp.NadpPlan`) and its peer keys;
2. rebuilds the pairing graph (the roster's graph of the round restricted to the participants,
   :func:`client.pairwise_phase.full_view`) and recomputes the noise allocation itself
   (:func:`protocols.nadp.upload_noise_scales`, deterministic in public values, so both ends of a pair get the
   same ``sigma_ij``);
3. trains with per-example clipping at ``C`` (Lemma 1's sensitivity ``2C/|D_i|`` bounds a mean of per-example
   clipped gradients);
4. uploads ``w_i + (1/p_i) (n_i + lambda (sum_{j>i} n_ij - sum_{j<i} n_ij))`` (Algorithm 1, line 15) in float64,
   ``n_i`` from a fresh ``os.urandom`` seed, ``n_ij`` from the pair seed, plus a Shamir-shared self-mask with
   ``self-mask`` (:mod:`protocols.masking`).

``nadp-variant = "record-ldp"`` adds only independent noise (Lemma 3's LDP comparator).  Privacy floor
(:func:`round_floor`, :func:`protocols.floor.nadp_floor`): every std, the allocation and ``lambda`` are the
client's own; a plan announcing less is refused (:class:`protocols.floor.FloorViolation`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import Message

from client.env import ClientEnv, record_level_training, reply
from client.floor import diagnostics_permitted, release, trust_minimum
from client.identity import node_identity
from client.pairwise_phase import full_view, mask_probe, pair_seeds
from client.records import to_record
from client.recovery import SelfMask, remember, self_mask_upload
from client.recovery_ledger import Kept, charge_spec, gone, int_graph, int_keys, top_event
from protocols.arrays import flatten, unflatten
from protocols.floor import FloorViolation, NadpFloor, at_least, nadp_floor
from protocols.graphs import roster_round_of
from protocols.nadp import nadp_upload
from protocols.nadp_recovery import excluded_uplink_std, receiver_noise_after, survivor_uplink_stds
from protocols.pairwise import pairwise_noise
from protocols.prg import gaussian
from protocols.privacy import Event, GaussianEvent
from protocols.schedule import roster_releases
from protocols.wire.common import TrainIns, ViewError
from protocols.wire.keys import probe_metric
from protocols.wire.nadp import NadpPlan
from protocols.wire.recovery import RecoveryRequest

PAIR_PURPOSE = "nadp-counteract"


def residual_seed() -> bytes:
    """Fresh secret seed of the residual noise ``n_i`` (a function so tests can pin it)."""
    return os.urandom(32)


# ------------------------------------------------------------------- handler
def round_floor(msg: Message, env: ClientEnv, plan: NadpPlan) -> tuple[NadpFloor, dict[int, list[int]] | None]:
    """The client's own view of the round (privacy floor), checked against the server's plan.

    Sigmas, allocation and lambda are recomputed from the run config and the public
    sizes/graph (:func:`protocols.floor.nadp_floor`); a plan that announces less (or
    another variant) is refused with :class:`protocols.floor.FloorViolation`.
    Returns the floor and the round's graph (None for record-ldp).
    """
    me = env.node_id
    if me not in plan.sizes:
        raise ViewError(f"node {me} is not in this round's nadp participants")
    if plan.sizes[me] != len(env.y):
        raise ViewError(f"server lists |D_i|={plan.sizes[me]} for node {me}, but it holds {len(env.y)} examples")
    if plan.variant != env.cfg.nadp_variant:
        raise FloorViolation("nadp-variant", plan.variant, env.cfg.nadp_variant, "not this client's run config")
    graph, degrees = None, None
    ident = node_identity(env)
    rnd = TrainIns.from_config(msg.content["config"]).round
    if plan.variant != "nadp" and ident.name not in roster_round_of(env.cfg, ident.roster, rnd).sample:
        # The noise is calibrated for the most rounds the public schedule samples any client in (below): a round
        # outside this node's schedule would be a release that calibration does not cover.
        raise FloorViolation("round", rnd, "a round whose public sample names this node",
                             "the noise is calibrated for the rounds the public schedule samples this node in")
    if plan.variant == "nadp":
        # The pair variances depend on the whole graph (neighbours' degrees): the roster's graph restricted
        # to the participants, rebuilt and checked from public values (client.pairwise_phase.check_view); lambda's
        # colluders are counted in each participant's roster neighbourhood (degrees), present or not.
        view = full_view(msg, env)
        graph, degrees = view.graph or {}, view.degrees
        if sorted(graph) != sorted(plan.ids):
            raise ViewError("nadp: the plan's participants differ from the round's participant list")
    # More noise than the floor, never less; calibrated for the public schedule's most releases of any client.
    fl = nadp_floor(env.cfg, plan.sizes, me, graph, plan.noise_scale, roster_releases(env.cfg, ident.roster), degrees)
    if fl.sigmas is None:
        at_least("nadp-ldp-stds", plan.ldp_stds[me], fl.ldp_std or 0.0)
    else:
        at_least("nadp-sigma-up", plan.sigma_up, fl.sigmas.sigma_up)
        at_least("nadp-sigma-down", plan.sigma_down, fl.sigmas.sigma_down)
        at_least("nadp-lambda", plan.lam, fl.lam, "less collusion protection than this client's own Eq. 8 factor")
        _lambda_for_node_tau(env, fl.lam, plan.sizes, graph, degrees)
    return fl, graph


def _lambda_for_node_tau(env: ClientEnv, lam: float, sizes: dict[int, int], graph: dict[int, list[int]],
                         degrees: dict[int, int] | None) -> None:
    """Refuse a round whose lambda is below Eq. 8's for this node's tau (:func:`client.floor.trust_minimum`).

    The run's lambda: an explicit ``nadp-lambda``, or 1 where Eq. 8 had no solution for the run's tau.  A node
    stating no tau takes any.
    """
    from protocols.nadp_allocation import neighbourhood_compensation

    tau = trust_minimum(env, "nadp-tau")
    if tau is None:
        return
    try:
        need = neighbourhood_compensation(tau, sizes, graph, degrees)
    except ValueError as err:
        raise FloorViolation("nadp-lambda", lam, f"Eq. 8 for nadp-tau = {tau:g}", str(err)) from err
    at_least("nadp-lambda", lam, need, f"less collusion protection than Eq. 8 for this node's nadp-tau = {tau:g}")


@dataclass(frozen=True)
class NoiseParts:
    """A client's noise of one round (:func:`noise_parts`) and the pair material recovery may need."""

    p_i: float
    residual: np.ndarray
    counteract: np.ndarray
    floor: NadpFloor
    mask: SelfMask | None
    #: Keeps the round's pair material for dropout recovery (:func:`client.recovery.remember`); called only once
    #: the round is charged, so a refused release leaves the previous round's material in place.
    keep: Callable[[], None] = lambda: None


def noise_parts(msg: Message, env: ClientEnv, plan: NadpPlan, size: int) -> NoiseParts:
    """``p_i``, residual ``n_i``, counteracting sum ``c_i``, the client's floor and self-mask for the round.

    ``c_i = sum_{j>i} n_ij - sum_{j<i} n_ij`` with per-pair stds from the client's own
    allocation (zero vector for the record-ldp variant); every std is the client's own
    (:func:`round_floor`), never the plan's.  The self-mask (run-config ``self-mask``, nadp variant only;
    :mod:`protocols.masking`) has the std of the client's whole upload noise, ``uplink_std`` (>= sigma_up),
    so the upload keeps at least that much noise even if all its pair seeds are revealed.
    """
    me = env.node_id
    fl, graph = round_floor(msg, env, plan)
    if fl.allocation is None:
        total = math.fsum(plan.sizes[c] for c in sorted(plan.ids))
        p_i = plan.sizes[me] / total
        # upload noise std sigma_i  <=>  residual std p_i * sigma_i before the 1/p_i factor
        return NoiseParts(p_i, gaussian(residual_seed(), size, p_i * (fl.ldp_std or 0.0)), np.zeros(size), fl, None)
    alloc = fl.allocation
    # The view is checked against this graph; the sizes and the scale that fix every pair's std are bound in too.
    seeds = pair_seeds(msg, env, purpose=PAIR_PURPOSE, graph=graph, view_extra=plan.pair_view())
    stds = alloc.counteracting_stds(me)
    mask = self_mask_upload(msg, env, size, alloc.uplink_std(me, fl.lam), graph)
    # Revealed for a neighbour only if it drops out after this upload (client.recovery, helper D).
    up, down = releases(fl, me)
    charge = charge_spec(sizes=plan.sizes, graph=graph or {}, scale=plan.noise_scale, uplink=up, downlink=down,
                         releases=roster_releases(env.cfg, node_identity(env).roster), lam=fl.lam)
    keep = functools.partial(remember, env, TrainIns.from_config(msg.content["config"]).round, seeds,
                             {j: stds[j] ** 2 for j in seeds}, mask_keys=mask.keys if mask else None,
                             threshold=mask.threshold if mask else 0, charge=charge)
    residual = gaussian(residual_seed(), size, alloc.residual_std[me])
    counteract = pairwise_noise(me, seeds, size, scale=stds)
    return NoiseParts(alloc.weights[me], residual, counteract, fl, mask, keep)


def releases(fl: NadpFloor, me: int) -> tuple[GaussianEvent, GaussianEvent | None]:
    """(uplink, downlink) of this upload per record: the server's accounting, from the client's own allocation."""
    if fl.allocation is None:
        return GaussianEvent((fl.ldp_std or 0.0) / fl.sensitivity), None
    alloc = fl.allocation
    return (GaussianEvent(alloc.joint_uplink_std(fl.lam)[me] / fl.sensitivity),
            GaussianEvent(alloc.receiver_std / (alloc.weights[me] * fl.sensitivity)))


def train(msg: Message, env: ClientEnv) -> Message:
    """NADP-FL local step: clipped training, residual + counteracting noise, float64 upload."""
    plan = NadpPlan.from_config(msg.content["config"])
    _, local_w, loss, clip_frac = record_level_training(msg, env)
    w = flatten(local_w)
    parts = noise_parts(msg, env, plan, len(w))
    fl, mask, counteract = parts.floor, parts.mask, parts.counteract
    lam = fl.lam  # the client's own lambda (1 for record-ldp)
    upload = nadp_upload(w, parts.p_i, parts.residual, counteract, lam)
    if mask is not None:
        upload = upload + mask.vector
    probe: dict[str, float] = {}
    if env.cfg.cancellation_check and plan.variant == "nadp" and diagnostics_permitted(env):
        # The part that enters the aggregate: p_i * (lam * c_i / p_i) = lam * c_i (it strips the pair noise along
        # the probe's direction, so a node asking for a guarantee sends it only where its operator allows).
        # Computed before the ledger records the round: a message without the probe seed spends nothing.
        probe = probe_metric(mask_probe(msg, lam * counteract))
    metrics: dict[str, float] = {"train_loss": loss, "clipped_fraction": clip_frac,
                                 **release(msg, env, *releases(fl, env.node_id)), **probe}
    parts.keep()
    out = reply(msg, to_record(unflatten(upload, local_w)), len(env.y), **metrics)
    return mask.attach(out) if mask is not None else out


def price_recovery(env: ClientEnv, spec: dict, store: Kept, req: RecoveryRequest
                    ) -> tuple[Event | None, Event | None]:
    """What answering ``req`` strips from this node's nadp round: its card's ``recovery_charge``.

    (uplink, downlink) events to compose on top of the round's charge (:mod:`client.recovery_ledger`).
    """
    me = env.node_id
    aggregated, _ = gone(store, req)
    if me not in req.excluded and aggregated >= {int(n) for n in spec["sizes"]}:
        return None, None
    fl = nadp_floor(env.cfg, int_keys(spec["sizes"]), me, int_graph(spec["graph"]),
                    float(spec["scale"]), int(spec["releases"]))
    alloc = fl.allocation
    assert alloc is not None  # record-ldp keeps no pair material
    lam = float(spec["lam"])  # the upload's own (its colluders counted in the roster neighbourhood)
    survivors = sorted(aggregated & set(alloc.client_ids))
    if me in req.excluded:  # held, not aggregated: its neighbours reveal its pairs
        std = excluded_uplink_std(alloc, lam, me, store.masked)
        return top_event(spec["uplink"], std / fl.sensitivity), None
    joint, _ = survivor_uplink_stds(alloc, lam, survivors, True)
    total = receiver_noise_after(alloc, lam, survivors, kept=())
    w_s = math.fsum(alloc.weights[n] for n in survivors)
    down = total * w_s / (alloc.weights[me] * fl.sensitivity)  # a record of me moves the mean by p_i Delta_i / P_S
    return top_event(spec["uplink"], joint[me] / fl.sensitivity), top_event(spec.get("downlink"), down)
