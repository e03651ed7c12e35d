"""What a recovery answer costs the node: its ledger is topped up from the outcome it answers, before it reveals.

A node charges its ledger at upload (:func:`client.floor.release`) with the noise its upload keeps when every
participant is aggregated.  A recovery request names neighbours gone (dropped or excluded); the survivors reveal
their pair material with them, which strips that pair noise from the uploads the server holds, and the
published aggregate keeps only the survivors' noise.  :func:`charge_recovery` recomputes, from the request's
outcome and the round's public values the method kept with its pair material (:func:`charge_spec`, the
``charge`` of :class:`client.recovery.RecoveryStore`), the multipliers the round really keeps, with the same
functions the server's account stage charges with, and composes the shortfall into the ledger
(:func:`client.floor.top_up`), or refuses (:class:`protocols.floor.FloorViolation`) past the node's policy:

* nadp: the joint view of the survivors' uploads (:func:`protocols.nadp_recovery.survivor_uplink_stds`), an
  excluded upload held with its pairs revealed (:func:`~protocols.nadp_recovery.excluded_uplink_std`), and the
  aggregate of the survivors (:func:`~protocols.nadp_recovery.noise_after`; the pairs other survivors keep are
  not counted: less noise, a larger charge);
* niss: the least multiplier the survivors' joint view leaves one of them
  (:func:`protocols.niss_joint.recovered_multiplier`, the server's charge; every other survivor assumed to reveal
  its shares with the gone: less noise);
* mpddp: the published model's theta of the survivors (:func:`protocols.mpddp.theta_after`; Theorem 11 rounds:
  :func:`protocols.mpddp.n_out_shortfall` as one more (epsilon, 0) release).

Every release charged at upload here is an unsampled Gaussian (the sample is public) or, for Theorem 11, an
(epsilon, delta) one, so the top-up of a Gaussian is exact (:func:`protocols.privacy.budget.shortfall_event`:
RDP and GDP add in ``1/z^2``).  Were a charged event sampled, the whole release at the real multiplier is
composed on top instead: the charged event plus an unsampled release at least as noisy as the truth dominates
the true one (composition only adds), so the ledger over-counts and never under-counts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from client.env import ClientEnv
from client.floor import top_up
from protocols.floor import FloorViolation, nadp_floor
from protocols.mpddp import n_out_shortfall, theta_after
from protocols.nadp_recovery import excluded_uplink_std, noise_after, survivor_uplink_stds
from protocols.niss_joint import recovered_multiplier
from protocols.privacy import DpEvent, Event, GaussianEvent, event_from_dict
from protocols.privacy.budget import shortfall_event
from protocols.wire.recovery import RecoveryRequest

__all__ = ["charge_recovery", "charge_spec"]


def charge_spec(kind: str, **values: Any) -> str:
    """The JSON a method keeps with its pair material: ``kind`` (nadp, niss, mpddp) and its public values.

    Events (``uplink``, ``downlink``: what :func:`client.floor.release` charged) as their dicts; mappings keyed
    by node id get string keys.
    """
    def plain(v: Any) -> Any:
        if hasattr(v, "to_dict"):
            return v.to_dict()
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v
    return json.dumps({"kind": kind, **{k: plain(v) for k, v in values.items()}}, sort_keys=True)


def _ints(m: Mapping[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in m.items()}


def _top(charged: Mapping[str, Any] | None, real: float) -> Event | None:
    """The release to compose on top of ``charged`` (an event dict) when its multiplier really was ``real``."""
    if charged is None:
        return None
    event = event_from_dict(dict(charged))
    if isinstance(event, GaussianEvent) and event.sampling_rate == 1.0:
        return shortfall_event(event.noise_multiplier, real)
    return GaussianEvent(max(real, 0.0))  # sampled (or another kind): the whole release on top (module doc)


@dataclass(frozen=True)
class _Kept:
    """What the node kept with its pair material: ``noise`` (neighbour -> own pair noise with it), self-masked."""

    noise: Mapping[int, float]
    masked: bool


def _gone(store: _Kept, req: RecoveryRequest) -> tuple[set[int], set[int]]:
    """(the aggregated uploads, the neighbours of this node named not aggregated) of ``req``."""
    excluded = set(req.excluded)
    return set(req.received) - excluded, set(store.noise) & (set(req.dropped) | excluded)


def _nadp(env: ClientEnv, spec: dict, store: _Kept, req: RecoveryRequest) -> tuple[Event | None, Event | None]:
    me = env.node_id
    aggregated, _ = _gone(store, req)
    if me not in req.excluded and aggregated >= {int(n) for n in spec["sizes"]}:
        return None, None
    fl = nadp_floor(env.cfg, _ints(spec["sizes"]), me, {int(k): list(v) for k, v in spec["graph"].items()},
                    float(spec["scale"]), int(spec["releases"]))
    alloc = fl.allocation
    assert alloc is not None  # record-ldp keeps no pair material
    lam = float(spec["lam"])  # the upload's own (its colluders counted in the roster neighbourhood)
    survivors = sorted(aggregated & set(alloc.client_ids))
    if me in req.excluded:  # held, not aggregated: its neighbours reveal its pairs
        std = excluded_uplink_std(alloc, lam, me, store.masked)
        return _top(spec["uplink"], std / fl.sensitivity), None
    joint, _ = survivor_uplink_stds(alloc, lam, survivors, True)
    total, _ = noise_after(alloc, lam, survivors, kept=())
    w_s = math.fsum(alloc.weights[n] for n in survivors)
    down = total * w_s / (alloc.weights[me] * fl.sensitivity)  # a record of me moves the mean by p_i Delta_i / P_S
    return _top(spec["uplink"], joint[me] / fl.sensitivity), _top(spec.get("downlink"), down)


def _niss(env: ClientEnv, spec: dict, store: _Kept, req: RecoveryRequest) -> tuple[Event | None, None]:
    me = env.node_id
    graph: dict[int, Sequence[int]] = {int(k): list(v) for k, v in spec["graph"].items()}
    aggregated, gone = _gone(store, req)
    survivors = sorted(aggregated & set(graph))
    if me in req.excluded or len(survivors) == len(graph):
        return None, None
    sigmas = {n: float(v) for n, v in _ints(spec["sigmas"]).items() if n in aggregated}
    alive = set(survivors)
    # Every other survivor reveals its own shares with the gone (the least noise it can keep); this node's own:
    # all of them but those it keeps (no self-mask and no neighbour left: client.recovery.answer).
    kept = {n: sigmas[n] ** 2 / len(graph[n]) * sum(j in alive for j in graph[n]) for n in survivors}
    left = math.fsum(v for p, v in store.noise.items() if p not in gone)
    strip = not store.masked and sum(store.noise.values()) > 0 and left <= 0
    kept[me] = sigmas[me] ** 2 - (0.0 if strip else math.fsum(store.noise[p] for p in gone))
    scale = float(spec["scale"])
    real = recovered_multiplier(float(spec["z"]), sigmas, {n: s / scale for n, s in sigmas.items()}, graph, kept,
                                float(spec["tau"]), rho=float(spec["rho"]), degrees=_ints(spec["degrees"]))
    return _top(spec["uplink"], real), None


def _mpddp(env: ClientEnv, spec: dict, store: _Kept, req: RecoveryRequest) -> tuple[None, Event | None]:
    aggregated, _ = _gone(store, req)
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
    return None, _top(spec["downlink"], 1.0 / math.sqrt(theta) if theta > 0 else math.inf)


_KINDS = {"nadp": _nadp, "niss": _niss, "mpddp": _mpddp}


def charge_recovery(env: ClientEnv, req: RecoveryRequest, charge: str, noise: Mapping[int, float],
                    masked: bool) -> None:
    """Charge the ledger what answering ``req`` (checked, not yet answered) strips from round ``req.round``.

    ``charge``: the round's :func:`charge_spec` (empty: a method whose pair material strips no charged noise);
    ``noise``: neighbour -> this node's own pair noise with it; ``masked``: its upload is self-masked.  Nothing
    for an outcome that aggregates every participant.  Raises :class:`FloorViolation` (nothing charged) past the
    node's policy (:func:`client.floor.top_up`).
    """
    if not charge:
        return
    spec = json.loads(charge)
    uplink, downlink = _KINDS[spec["kind"]](env, spec, _Kept(noise, masked), req)
    top_up(env, req.round, uplink, downlink)
