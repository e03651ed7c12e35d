"""What a recovery answer costs the node: its ledger is topped up from the outcome it answers, before it reveals.

A node charges its ledger at upload (:func:`client.floor.release`) with the noise its upload keeps when every
participant is aggregated.  A recovery request names neighbours gone (dropped or excluded); the survivors reveal
their pair material with them, which strips that pair noise from the uploads the server holds, and the
published aggregate keeps only the survivors' noise.  :func:`recovery_events` recomputes, from the request's
outcome and the round's public values the method kept with its pair material (:func:`charge_spec`, the
``charge`` of :class:`client.recovery.RecoveryStore`), the multipliers the round really keeps, with the same
functions the server's account stage charges with; :func:`charge_recovery` composes the shortfall into the ledger
(:func:`client.floor.top_up`) once per round and outcome, or refuses (:class:`protocols.floor.FloorViolation`) past
the node's policy.
Each method prices its own outcome (its card's ``recovery_charge``, ``fn(env, spec, kept, request) -> (uplink,
downlink)`` events to compose on top):

* nadp (:func:`client.methods.nadp.price_recovery`): the joint view of the survivors' uploads
  (:func:`protocols.nadp_recovery.survivor_uplink_stds`), an excluded upload held with its pairs revealed
  (:func:`~protocols.nadp_recovery.excluded_uplink_std`), and the aggregate of the survivors
  (:func:`~protocols.nadp_recovery.noise_after`; the pairs other survivors keep are not counted: less noise, a
  larger charge);
* niss (:func:`client.methods.niss.price_recovery`): the least multiplier the survivors' joint view leaves one of
  them (:func:`protocols.niss_joint.recovered_multiplier`, the server's charge; every other survivor assumed to
  reveal its shares with the gone: less noise);
* mpddp (:func:`client.methods.mpddp.price_recovery`): the published model's theta of the survivors
  (:func:`protocols.mpddp.theta_after`; Theorem 11 rounds: :func:`protocols.mpddp.n_out_shortfall` as one more
  (epsilon, 0) release).

Every release charged at upload here is an unsampled Gaussian (the sample is public) or, for Theorem 11, an
(epsilon, delta) one, so the top-up of a Gaussian is exact (:func:`protocols.privacy.budget.shortfall_event`:
RDP and GDP add in ``1/z^2``).  Were a charged event sampled, the whole release at the real multiplier is
composed on top instead: the charged event plus an unsampled release at least as noisy as the truth dominates
the true one (composition only adds), so the ledger over-counts and never under-counts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from client.env import ClientEnv
from client.floor import top_up
from client.ledger import ClientLedger
from protocols.methods import MethodSpec, method_spec
from protocols.privacy import Event, GaussianEvent, event_from_dict
from protocols.privacy.budget import shortfall_event
from protocols.wire.recovery import RecoveryRequest

__all__ = ["Kept", "charge_recovery", "charge_spec", "gone", "int_keys", "recovery_events", "top_event"]


def charge_spec(**values: Any) -> str:
    """The JSON a method keeps with its pair material: the public values its card's ``recovery_charge`` reads.

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
    return json.dumps({k: plain(v) for k, v in values.items()}, sort_keys=True)


def int_keys(m: Mapping[str, Any]) -> dict[int, Any]:
    """``m`` with its keys as node ids."""
    return {int(k): v for k, v in m.items()}


def int_graph(m: Mapping[str, Sequence[Any]]) -> dict[int, list[int]]:
    """A kept graph (node -> neighbours, JSON keys) with node ids as keys and neighbours."""
    return {int(k): [int(n) for n in v] for k, v in m.items()}


def top_event(charged: Mapping[str, Any] | None, real: float) -> Event | None:
    """The release to compose on top of ``charged`` (an event dict) when its multiplier really was ``real``."""
    if charged is None:
        return None
    event = event_from_dict(dict(charged))
    if isinstance(event, GaussianEvent) and event.sampling_rate == 1.0:
        return shortfall_event(event.noise_multiplier, real)
    return GaussianEvent(max(real, 0.0))  # sampled (or another kind): the whole release on top (module doc)


@dataclass(frozen=True)
class Kept:
    """What the node kept with its pair material: ``noise`` (neighbour -> own pair noise with it), self-masked."""

    noise: Mapping[int, float]
    masked: bool


def gone(store: Kept, req: RecoveryRequest) -> tuple[set[int], set[int]]:
    """(the aggregated uploads, the neighbours of this node named not aggregated) of ``req``."""
    excluded = set(req.excluded)
    return set(req.received) - excluded, set(store.noise) & (set(req.dropped) | excluded)


def recovery_events(env: ClientEnv, req: RecoveryRequest, charge: str, noise: Mapping[int, float],
                    masked: bool) -> tuple[Event | None, Event | None]:
    """The (uplink, downlink) events answering ``req`` (checked) adds on top of round ``req.round``'s charge.

    ``charge``: the round's :func:`charge_spec` (empty: a method whose pair material strips no charged noise:
    nothing); ``noise``: neighbour -> this node's own pair noise with it; ``masked``: its upload is self-masked.
    Nothing for an outcome that aggregates every participant.
    """
    if not charge:
        return None, None
    price = method_spec(env.cfg.method).recovery_charge
    if price is None:
        raise ValueError(f"method {env.cfg.method!r} kept a recovery charge but its card names no recovery_charge")
    return MethodSpec.load(price)(env, json.loads(charge), Kept(noise, masked), req)


def charge_recovery(env: ClientEnv, ledger: ClientLedger, rnd: int, digest: bytes,
                    events: tuple[Event | None, Event | None]) -> None:
    """Compose ``events`` (:func:`recovery_events`) into ``ledger`` (open, under its lock) once per round and outcome.

    ``digest``: the answered outcome's (:func:`protocols.consistency.outcome_digest`).  A top-up of round ``rnd``'s
    outcome ``digest`` already in the ledger is not charged again, whichever task of the node answered it.  Raises
    :class:`FloorViolation` (nothing charged) past the node's policy (:func:`client.floor.top_up`).
    """
    if all(e is None for e in events) or ledger.recovery_charged(int(env.context.run_id), rnd, digest):
        return
    top_up(env, rnd, *events, ledger=ledger)
    ledger.mark_recovery_charged(int(env.context.run_id), rnd, digest)
