"""Client side of ``mpddp`` (DDP_Client), ``mpdp-naive`` and ``mpcdp``: gradient at W-hat, Psi, Phi, noise.

The train message (:mod:`protocols.wire.mpddp`) carries the perturbed expanded model W-hat and the server's noise
scales, which the client checks against its own calibration (:func:`ddp_floor`,
:func:`protocols.floor.mpdp_naive_sigma`) and refuses when smaller.  The client computes one full-batch gradient
of the paper's loss ``1/2 ||y - onehot||^2`` at W-hat plus Psi and Phi (FedSGD), each example's perturbed
upload clipped to ``clip`` (:func:`protocols.mpddp.clipped_client_gradients` with ``rho`` from W-hat,
:func:`protocols.mpddp.mask_reference`; record sensitivity ``2 clip / n_k``, and ``kappa`` times it given the
server's R, :func:`protocols.mpddp.mp_record_sensitivity`), then by method:

* ``mpddp``: :func:`protocols.mpddp.ddp_client` (Algorithm 2): ``eta_k`` (``mpddp-eta``: N(0, sigma_eta^2), or
  the paper's DN(sigma_eta, 1)) from a fresh ``os.urandom`` seed plus ``sum_v Delta_kv``,
  ``Delta_kv ~ DN(sigma_Delta, 1)`` from the pair seeds (purpose ``mpddp-delta``), and with ``self-mask`` a
  Shamir-shared self-mask (:mod:`protocols.masking`);
* ``mpdp-naive``: :func:`protocols.mpddp.naive_client`, ``N(0, (z 2 clip / n_k)^2)`` on the perturbed gradient;
* ``mpcdp``: no client noise (the server adds it).

Psi and Phi go up unnoised, as in the paper, in ``mpddp-side-dtype`` (:func:`protocols.wire.mpddp.upload_arrays`).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from flwr.app import Message

from client.env import ClientEnv, full_batch_dtype, reply
from client.floor import release
from client.identity import node_identity
from client.pairwise_phase import mask_probe, pair_seeds
from client.records import to_record
from client.recovery import remember, self_mask_upload
from client.recovery_ledger import Kept, charge_spec, gone, top_event
from protocols.floor import FloorViolation, at_least, mpddp_complete, mpddp_floor, mpdp_naive_sigma
from protocols.graphs import calibration_size, roster_round_of
from protocols.mpddp import (
    clipped_client_gradients,
    ddp_client,
    delta_variance,
    eta_variance,
    keeps_records,
    mask_reference,
    mp_record_sensitivity,
    n_out_shortfall,
    naive_client,
    one_hot,
    round_event,
    theta_after,
    torch_threads,
)
from protocols.mpddp import flatten as mp_flatten
from protocols.mpddp import unflatten as mp_unflatten
from protocols.privacy import DpEvent, Event, GaussianEvent, event_from_dict
from protocols.schedule import roster_releases
from protocols.wire.common import TrainIns, ViewError
from protocols.wire.keys import MaskProbe, PeerKeys, probe_metric
from protocols.wire.mpddp import DdpNoise, NaiveNoise, PerturbedModel, upload_arrays
from protocols.wire.recovery import RecoveryRequest

#: HKDF purpose of the pairwise Delta seeds (fixed on the client: the server cannot redirect it).
DELTA_PURPOSE = "mpddp-delta"


def train(msg: Message, env: ClientEnv) -> Message:
    """One round of the client: gradient + Psi, Phi at W-hat, method noise, upload."""
    with torch_threads(1):  # tiny matrices: thread hand-offs dominate otherwise
        return _train(msg, env)


def _train(msg: Message, env: ClientEnv) -> Message:
    method = env.cfg.method
    cfg = msg.content["config"]
    # Theorem 13's n_L + 2 gradients are the client's whole cost.  With float32 side information they are
    # computed in float32 (half the time; the recovery error stays far below any DP noise) and the gradient is
    # widened to float64 before the pair noise is added, so the Delta's still cancel exactly.  With float64 side
    # information everything stays float64 (exact recovery).
    # A clip the side dtype does not resolve (a record's squared gradient norm rounding to 0) computes in float64,
    # and so does a W-hat whose mask reference the side dtype cannot carry (every record would be dropped).
    resolving = full_batch_dtype(env.cfg.clip, str(np.dtype(env.cfg.mpddp_side_dtype)))
    received = PerturbedModel.from_record(msg.content["arrays"]).matrices
    # rho from W-hat as received (float64), as the server computes it: the clip bounds a record given R too.
    rho = mask_reference(received[-1])
    dtype = torch.float32 if resolving == "float32" and keeps_records(rho, env.cfg.clip, torch.float32) else torch.float64
    if not keeps_records(rho, env.cfg.clip, torch.float64):
        raise ViewError(f"the perturbed model's mask reference rho = {rho:.3g} is too large for a clip of "
                        f"{env.cfg.clip:g} even in float64: every record would be dropped from the upload")
    w_hat = [torch.from_numpy(m).to(dtype) for m in received]
    x = torch.from_numpy(np.asarray(env.x).reshape(len(env.x), -1)).to(dtype)
    y = one_hot(torch.from_numpy(np.asarray(env.y)), env.num_classes, dtype)
    up, clipped = clipped_client_gradients(w_hat, x, y, env.cfg.clip, rho=rho)
    if dtype != torch.float64:
        up = up.with_grads([g.double() for g in up.grads])
    metrics: dict[str, float] = {"clipped_fraction": clipped}
    if method == "mpddp":
        noise = DdpNoise.from_config(cfg)
        # Everything that can refuse comes before the ledger records the round.  The view check binds the sizes
        # and scales in: clients shown different plans derive no common pair noise, so no Delta cancels.
        seeds = pair_seeds(msg, env, DELTA_PURPOSE, view_extra=noise.pair_view())
        sigma_eta, sigma_delta, event = ddp_floor(msg, env)  # the client's own scales (privacy floor)
        size = sum(int(np.prod(g.shape)) for g in up.grads)
        # Self-mask with the std of the upload's whole gradient noise.
        noise_var = eta_variance(sigma_eta, env.cfg.mpddp_eta) + delta_variance(sigma_delta) * len(seeds)
        mask = self_mask_upload(msg, env, size, math.sqrt(noise_var))
        if env.cfg.cancellation_check:
            MaskProbe.from_config(cfg)  # the probe seed must be there before the round is recorded
        metrics.update(release(msg, env, downlink=event))  # the uploads: no guarantee
        remember(env, TrainIns.from_config(cfg).round, seeds,  # revealed only for neighbours that drop out
                 mask_keys=mask.keys if mask else None, threshold=mask.threshold if mask else 0,
                 charge=recovery_charge(msg, env, sigma_eta, sigma_delta, event))
        up, delta = ddp_client(up, own_id=env.node_id, pair_seeds=seeds,
                               eta_seed=os.urandom(32), sigma_eta=sigma_eta, sigma_delta=sigma_delta,
                               eta=env.cfg.mpddp_eta)
        if mask is not None:
            up = up.with_grads(mp_unflatten(mp_flatten(up.grads) + mask.vector, list(up.grads)))
        if env.cfg.cancellation_check:
            metrics.update(probe_metric(mask_probe(msg, delta)))
    elif method == "mpdp-naive":
        mask = None
        size = len(env.y)
        sigma = mpdp_naive_sigma(env.cfg, size)  # the client's own; the server's multiplier is only checked
        z = sigma / mp_record_sensitivity(env.cfg.clip, size, adjacency=env.cfg.adjacency)
        at_least("mpddp-sigma", NaiveNoise.from_config(cfg).sigma, z)
        metrics.update(release(msg, env, downlink=GaussianEvent(z)))
        up = naive_client(up, eta_seed=os.urandom(32), sigma=sigma)
    elif method == "mpcdp":
        mask = None
        metrics.update(release(msg, env))  # the (trusted) server adds the noise
    else:
        raise ValueError(f"client.methods.mpddp does not handle method {method!r}")
    out = reply(msg, to_record(upload_arrays(up, env.cfg.mpddp_side_dtype), None), len(env.y), **metrics)
    return mask.attach(out) if mask is not None else out


def recovery_charge(msg: Message, env: ClientEnv, sigma_eta: float, sigma_delta: float,
                    event: GaussianEvent | DpEvent) -> str:
    """What a recovery of this round is priced from (:mod:`client.recovery_ledger`): the scales per unit sensitivity.

    The sensitivity and the graph's theorem as :func:`ddp_floor` took them; ``event``: the round's charge.
    """
    sizes = DdpNoise.from_config(msg.content["config"]).sizes
    participants = PeerKeys.from_config(msg.content["config"]).participants
    sens = mp_record_sensitivity(env.cfg.clip, min(sizes), adjacency=env.cfg.adjacency)
    return charge_spec(downlink=event, eta=sigma_eta / sens, pair=sigma_delta / sens,
                       participants=list(participants), complete=mpddp_complete(env.cfg, len(participants)),
                       n_out=env.cfg.n_out if env.cfg.graph == "n-out" else None,
                       releases=roster_releases(env.cfg, node_identity(env).roster))


def ddp_floor(msg: Message, env: ClientEnv) -> tuple[float, float, GaussianEvent | DpEvent]:
    """``(sigma_eta, sigma_delta, round event)`` of ``mpddp`` from the client's own run config (privacy floor).

    Sensitivity: the record sensitivity of the smallest participant, from the public sizes the train
    message lists for the round's participants (the key phase's ``|D_i|``); the client checks that its
    own entry is its own size (a smaller one than the truth only adds noise).  The sizes and the sent scales
    are bound into the pair seeds (:meth:`protocols.wire.mpddp.DdpNoise.pair_view`): a server that shows each
    client another size list (the others' inflated) gets Deltas that do not cancel.

    K: the participants the message lists (what an honest server calibrates for,
    :meth:`strategies.key_phase.KeyRound.calibration_size`); a round whose K the theorems do not cover, or a
    sparse roster graph of the round with so few present that a complete-graph calibration would apply
    (:func:`protocols.graphs.calibration_size`, the server's check), is refused.
    Complete graph (Theorem 10): the client uses its own scales for K, or the server's where larger (the server
    raises them to keep the run within its epsilon target; the round event's multiplier grows by the smaller of
    the two factors).  n-out graph (Theorem 11, scales that grow as K shrinks): it uses the server's scales once
    they pass its floor for K (both ends of every pair must draw the same sigma_delta).  Scales below the floor
    are refused (:class:`protocols.floor.FloorViolation`).  Call it after the view check (:func:`pair_seeds`).
    """
    cfg = env.cfg
    sent = DdpNoise.from_config(msg.content["config"])
    pk = PeerKeys.from_config(msg.content["config"])
    if len(sent.sizes) != len(pk.participants) or env.node_id not in pk.participants:
        raise ViewError(f"the train message lists {len(sent.sizes)} sizes for {len(pk.participants)} participants "
                         f"(node {env.node_id} must be among them): the record sensitivity cannot be checked")
    own = sent.sizes[pk.participants.index(env.node_id)]
    if own != len(env.y):
        raise ViewError(f"server lists |D_i|={own} for node {env.node_id}, but it holds {len(env.y)} examples")
    roster = node_identity(env).roster
    rr = roster_round_of(cfg, roster, TrainIns.from_config(msg.content["config"]).round)
    k = len(pk.participants)
    t = roster_releases(cfg, roster)  # the public schedule's most participations of a client
    try:
        calibration_size(rr, k, lambda n: mpddp_complete(cfg, n))
        se, sd, _theta = mpddp_floor(cfg, k, min(sent.sizes), releases=t)
    except ValueError as err:
        raise FloorViolation("participants", k, "a setting Theorems 10/11 cover", str(err)) from err
    complete = mpddp_complete(cfg, k)
    at_least("mpddp-sigma-eta", sent.sigma_eta, se)
    at_least("mpddp-sigma-delta", sent.sigma_delta, sd)
    if complete:
        eta, pair = max(sent.sigma_eta, se), max(sent.sigma_delta, sd)  # more noise than the floor, never less
        scale = min((a / b for a, b in ((eta, se), (pair, sd)) if b > 0), default=1.0)
        return eta, pair, round_event(cfg.epsilon, cfg.delta, t, complete=True, scale=scale)
    return sent.sigma_eta, sent.sigma_delta, round_event(cfg.epsilon, cfg.delta, t, complete=False)


def price_recovery(env: ClientEnv, spec: dict, store: Kept, req: RecoveryRequest) -> tuple[None, Event | None]:
    """What answering ``req`` strips from this node's mpddp round: its card's ``recovery_charge``.

    (uplink, downlink) events to compose on top of the round's charge (:mod:`client.recovery_ledger`).
    """
    aggregated, _ = gone(store, req)
    survivors = len(aggregated & {int(n) for n in spec["participants"]})
    if survivors == len(spec["participants"]):
        return None, None
    try:
        theta = theta_after(float(spec["eta"]), float(spec["pair"]), survivors, complete=bool(spec["complete"]),
                            n_out=spec.get("n_out"))
    except ValueError as err:
        raise FloorViolation("survivors", survivors, "a setting Theorems 10/11 cover", str(err)) from err
    charged = event_from_dict(dict(spec["downlink"]))
    if isinstance(charged, DpEvent):  # Theorem 11: basic composition of (epsilon/T, delta/T) rounds
        extra = n_out_shortfall(theta, env.cfg.epsilon, env.cfg.delta, int(spec["releases"]))
        return None, DpEvent(extra) if extra > 0 else None
    return None, top_event(spec["downlink"], 1.0 / math.sqrt(theta) if theta > 0 else math.inf)
