"""Epsilon as a hard cap: the budget left, the noise the remaining rounds need, and charges topped up to the real noise.

Unsampled Gaussian releases compose additively in their *precision* ``1 / z^2`` (RDP of the Gaussian is
linear in it; so are Gaussian DP and NADP-FL's Lemma 2), and epsilon at a fixed delta grows with the total.
A run's target (epsilon, delta) is therefore a total precision :func:`precision_budget`, and every account
holding only such releases has a precision spent so far (:func:`unit_precisions`, per view and unit).

* :func:`plan_round` -- before a round: the noise scale ``s >= 1`` (every noise std times ``s``, every
  precision over ``s^2``) that keeps the remaining rounds within the budget, or why the run must stop.
  While the rounds cost what they were planned to, ``s = 1`` (a clean run's noise is never changed).
  After a round cost more than planned (clients dropped after the noise was fixed, a round charged
  again after a resume) the budget left is spread evenly over the rounds left, each planned as dear as
  the dearest round so far, with :data:`RESERVE` of it held back so the last round still fits when it
  costs a little more.
* :func:`top_up` -- compose into a ledger what a round really cost beyond its planned charge (the
  planned charge was composed when the noise was released); :func:`shortfall_event` and :func:`charge_shortfall`
  the same for one release whose multiplier turned out smaller than charged (a server's accountant, a node's ledger).
* :func:`round_events`, :func:`view_events` and :func:`epsilon_after` -- for accounts that are not precisions
  (Laplace rounds, (epsilon, delta) rounds): the releases one round added (or a planned release), and the epsilon
  a ledger would reach with them composed on top (a method that cannot raise its noise stops before the round
  that would cross).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from protocols.privacy.accountant import (
    Accountant,
    GdpAccountant,
    Lemma2Accountant,
    PerUnitAccountant,
    RdpAccountant,
    accountant_from_state,
)
from protocols.privacy.events import Event, GaussianEvent, event_from_dict
from protocols.privacy.ledger import PrivacyLedger

__all__ = ["MAX_NOISE_SCALE", "RESERVE", "RoundBudget", "budget_shares", "charge_shortfall", "crosses", "empty_like",
           "epsilon_after", "events_from_state", "events_to_state", "plan_round", "precision", "precision_budget", "round_events",
           "shortfall_event", "start_share", "top_up", "unit_precisions", "view_events"]

#: Share of the budget left that a re-planned round holds back for the rounds after it (and the last round
#: for itself): a round may cost this much more than the dearest round before it without crossing the target.
RESERVE = 0.05
#: Most a round's noise may be raised (std factor) to stay within the budget; a round that would need more
#: is not run (the run stops: its model would be mostly noise).
MAX_NOISE_SCALE = 4.0
#: Relative slack of "within the budget" (float round-off of the accountants).
_TOL = 1e-9


def precision(acc: Accountant) -> float | None:
    """Total precision ``sum count q / z^2`` an account holds, or None when epsilon is not a function of it.

    RDP and GDP accountants holding only unsampled Gaussian releases (their ``epsilon_rank``) and NADP-FL's
    Lemma 2 accountant; ``inf`` for an un-noised release.
    """
    if isinstance(acc, RdpAccountant | GdpAccountant):
        return acc.epsilon_rank()
    if isinstance(acc, Lemma2Accountant):
        total = 0.0
        for e in acc.events:
            if e.count:
                total += math.inf if e.noise_multiplier == 0.0 else e.count * e.sampling_rate / e.noise_multiplier**2
        return total
    return None


def _views(ledger: PrivacyLedger) -> dict[str, Accountant]:
    """The views the headline epsilon reads (both for ``"worst"``), each accountant once."""
    out: dict[str, Accountant] = {}
    for name, acc in (("uplink", ledger.uplink), ("downlink", ledger.downlink)):
        if ledger.headline in ("worst", name) and acc is not None and not any(acc is a for a in out.values()):
            out[name] = acc
    return out


def unit_precisions(ledger: PrivacyLedger) -> dict[tuple[str, int | None], float] | None:
    """Precision spent per (view, unit) of the views the headline reads (unit None: one account for all).

    None when a view holds releases whose epsilon is not a function of a precision (Laplace, sampled
    Gaussians, (epsilon, delta) rounds): then no noise scale can be derived from this module.
    """
    out: dict[tuple[str, int | None], float] = {}
    for (name, unit), acc in _unit_accounts(ledger).items():
        p = precision(acc)
        if p is None:
            return None
        out[(name, unit)] = p
    return out


def _unit_accounts(ledger: PrivacyLedger) -> dict[tuple[str, int | None], Accountant]:
    out: dict[tuple[str, int | None], Accountant] = {}
    for name, acc in _views(ledger).items():
        if isinstance(acc, PerUnitAccountant):
            out.update({(name, u): acc.unit(u) for u in acc.units})
        else:
            out[(name, None)] = acc
    return out


def budget_shares(ledger: PrivacyLedger, epsilon: float) -> dict[tuple[str, int | None], float] | None:
    """Share of the budget ``epsilon`` (at the ledger's delta) spent per (view, unit): 1 = the target reached.

    Each account is measured against the precision budget of its own conversion (:func:`precision_budget`);
    None as for :func:`unit_precisions`.
    """
    out: dict[tuple[str, int | None], float] = {}
    for key, acc in _unit_accounts(ledger).items():
        p = precision(acc)
        if p is None:
            return None
        out[key] = p / precision_budget(epsilon, ledger.delta, _KIND[type(acc)])
    return out


def start_share(ledger: PrivacyLedger, epsilon: float, view: str, unit: int | None) -> float:
    """Share of the budget ``epsilon`` the account of ``unit`` in ``view`` held when it was created.

    0, but for a unit a per-unit account gave the dearest earlier account to (a renumbered node of a resumed run,
    :meth:`~protocols.privacy.accountant.PerUnitAccountant.renumbered`): that account's share.
    """
    acc = _views(ledger).get(view)
    if not isinstance(acc, PerUnitAccountant) or unit is None or acc.inherit is None or acc.known is None \
            or unit in acc.known:
        return 0.0
    p = precision(acc.inherit)
    return 0.0 if p is None else p / precision_budget(epsilon, ledger.delta, _KIND[type(acc.inherit)])


#: The conversion of each precision account, by accountant type.
_KIND: dict[type, str] = {RdpAccountant: "rdp", GdpAccountant: "gdp", Lemma2Accountant: "lemma2"}


@lru_cache(maxsize=64)
def precision_budget(epsilon: float, delta: float, kind: str = "rdp") -> float:
    """Largest total precision of unsampled Gaussian releases whose epsilon at ``delta`` is <= ``epsilon``.

    ``kind``: the accountant's conversion -- ``"rdp"`` (:class:`~protocols.privacy.accountant.RdpAccountant`:
    one Gaussian of the summed precision over :data:`~protocols.privacy.accountant.RDP_ORDERS`), ``"gdp"``
    (:class:`~protocols.privacy.accountant.GdpAccountant`, the analytic Gaussian) or ``"lemma2"``
    (NADP-FL's Lemma 2: ``epsilon^2 / (2 ln(1/delta))``).  Bisection to a relative 1e-12, on the safe side.  A
    precision whose epsilon overflows the conversion counts as over the target: for a larger ``epsilon`` the budget
    is the largest precision the conversion measures (gdp: about 1e19), far above what releases at
    :data:`~protocols.privacy.calibration.MIN_NOISE_MULTIPLIER` reach (1e6 per release).

    Raises:
        ValueError: ``epsilon`` not > 0, ``delta`` not in (0, 1), or an unknown ``kind``.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    accountants = {"rdp": RdpAccountant, "gdp": GdpAccountant}
    if kind == "lemma2":
        return epsilon**2 / (2.0 * math.log(1.0 / delta))
    if kind not in accountants:
        raise ValueError(f"unknown precision budget kind {kind!r} (use 'rdp', 'gdp' or 'lemma2')")

    def eps(p: float) -> float:
        try:
            return accountants[kind]([GaussianEvent(p**-0.5)]).epsilon(delta)
        except ArithmeticError:  # past the conversion's float range (gdp: about 1e21): more than any target
            return math.inf

    lo, hi = 0.0, 1.0
    while eps(hi) <= epsilon:
        lo, hi = hi, hi * 2.0
    while (hi - lo) > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= epsilon:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class RoundBudget:
    """What :func:`plan_round` decided for one round.

    Attributes:
        scale: factor on every noise std of the round (>= 1; 1 = as calibrated for the whole run).
        stop: why the round must not run (None: run it at ``scale``).
        replanned: True when the budget left, not the run's calibration, set the scale.
    """

    scale: float = 1.0
    stop: str | None = None
    replanned: bool = False


def plan_round(total: float, spent: float, dearest: float, rounds_left: int, *, scalable: bool) -> RoundBudget:
    """The noise scale of the next round so that the run ends within ``total``, or why it must stop first.

    Args:
        total: the run's budget as a precision (:func:`precision_budget`), or 1 with shares (:func:`budget_shares`).
        spent: the largest precision (share) any unit has spent so far.
        dearest: the largest precision (share) one unit was charged in one earlier round, at noise scale 1
            (0 = no round yet: nothing to go by, the round runs as calibrated).
        rounds_left: rounds still to run, this one included (>= 1).
        scalable: whether the method can raise its noise (otherwise: run as calibrated, or stop).

    Returns:
        :class:`RoundBudget`: scale 1 while the rounds left fit at their planned cost; else, when
        ``scalable``, the scale that gives each round left ``(1 - RESERVE) (total - spent) / rounds_left``
        at the dearest round's cost; a stop when that would need more than :data:`MAX_NOISE_SCALE` or,
        for a method that cannot raise its noise, when the next round alone would cross ``total``.
    """
    if rounds_left < 1:
        raise ValueError(f"rounds_left must be >= 1, got {rounds_left}")
    limit = total * (1.0 + _TOL)
    if not (math.isfinite(spent) and math.isfinite(dearest)):
        return RoundBudget()  # an un-noised release already voided the guarantee: nothing left to keep
    if dearest <= 0.0 or spent + rounds_left * dearest <= limit:
        return RoundBudget()
    left = total - spent
    if not scalable:
        if spent + dearest <= limit:
            return RoundBudget()
        return RoundBudget(stop=f"the next round would cost {dearest / total:.1%} of the budget and "
                                f"{max(left, 0.0) / total:.1%} is left")
    per_round = (1.0 - RESERVE) * left / rounds_left
    if per_round <= 0.0:
        return RoundBudget(stop="no budget is left")
    scale = math.sqrt(dearest / per_round)
    if scale > MAX_NOISE_SCALE:
        return RoundBudget(stop=f"{left / total:.1%} of the budget is left for {rounds_left} round(s): each would "
                                f"need {scale:.2g}x its planned noise, more than the {MAX_NOISE_SCALE:g}x a round may take")
    return RoundBudget(max(scale, 1.0), None, True)


# ------------------------------------------------------------------------------------------------ top-ups
def _empty(acc: Accountant) -> Accountant:
    if isinstance(acc, PerUnitAccountant):
        return PerUnitAccountant(accountant_from_state(acc.template.to_state()))
    state = acc.to_state()
    return accountant_from_state({**state, "events": []})


def empty_like(ledger: PrivacyLedger) -> PrivacyLedger:
    """A ledger with empty accountants of the same kinds, views shared and extras aliased as in ``ledger``."""
    up = None if ledger.uplink is None else _empty(ledger.uplink)
    down = up if ledger.downlink is ledger.uplink else (None if ledger.downlink is None else _empty(ledger.downlink))
    extra = {name: up if acc is ledger.uplink else down if acc is ledger.downlink else _empty(acc)
             for name, acc in ledger.extra.items()}
    return PrivacyLedger(ledger.delta, uplink=up, downlink=down, headline=ledger.headline, extra=extra)


def _shortfall(into: Accountant, planned: Accountant | None, real: Accountant) -> None:
    """Compose into ``into`` the precision ``real`` holds beyond ``planned`` (the real events if not a precision)."""
    p_real = precision(real)
    p_planned = 0.0 if planned is None else precision(planned)
    if p_real is None or p_planned is None:
        for e in real.events if hasattr(real, "events") else ():  # conservative: the real charge on top
            into.compose(e)
        return
    extra = p_real - p_planned
    if extra <= 0.0:
        return
    into.compose(GaussianEvent(0.0 if math.isinf(extra) else extra**-0.5))


def shortfall_event(planned: float, real: float) -> GaussianEvent | None:
    """The release to compose on top of an unsampled Gaussian of multiplier ``planned`` when ``real`` was the truth.

    Gaussian RDP (and GDP) is additive in ``1/z^2``, so the exact shortfall is one more Gaussian with
    ``1/z^2 = 1/real^2 - 1/planned^2``; ``real <= 0`` gives an un-noised release.  None when ``real`` is not below
    ``planned`` (or below it by rounding only): nothing to charge.
    """
    if real >= planned:
        return None
    if real <= 0:
        return GaussianEvent(0.0)
    gap = 1.0 / real**2 - 1.0 / planned**2
    return GaussianEvent(1.0 / math.sqrt(gap)) if gap > 0 else None


def charge_shortfall(accountant: Accountant, planned: float, real: float, **compose_kwargs: Any) -> None:
    """Charge ``accountant`` for a release whose noise multiplier was ``real`` instead of the ``planned`` one.

    The planned (unsampled) Gaussian release is already composed; :func:`shortfall_event` is composed on top
    (``compose_kwargs``: e.g. the ``units`` of a per-unit accountant).
    """
    event = shortfall_event(planned, real)
    if event is not None:
        accountant.compose(event, **compose_kwargs)


def top_up(ledger: PrivacyLedger, planned: PrivacyLedger, real: PrivacyLedger,
           accounts: Collection[str] | None = None) -> None:
    """Charge ``ledger`` what a round really cost (``real``) beyond what was composed for it (``planned``).

    ``planned`` and ``real`` hold only that round's releases, in accountants parallel to ``ledger``'s
    (:func:`empty_like`).  Per account (and per unit of a per-unit account) the precision ``real`` holds
    beyond ``planned`` is composed as one Gaussian release: exact for precision accounts, since they are
    additive in it; an account without a precision gets the real releases on top (an over-count).
    A unit charged less than planned keeps the planned charge.  ``accounts``: only these (names as
    :meth:`PrivacyLedger.accounts` gives them; None: all).
    """
    plan, into_of = dict(planned.accounts()), dict(ledger.accounts())
    for name, acc in real.accounts():
        if accounts is not None and name not in accounts:
            continue
        into = into_of[name]
        before = plan.get(name)
        if isinstance(acc, PerUnitAccountant):
            assert isinstance(into, PerUnitAccountant)
            for u in acc.units:
                p = before.unit(u) if isinstance(before, PerUnitAccountant) and u in before.units else None
                _shortfall(into.unit(u), p, acc.unit(u))
        else:
            _shortfall(into, before, acc)


# ------------------------------------------------------------------------------------------------ event rounds
def _added(before: tuple[Event, ...], after: tuple[Event, ...]) -> list[Event]:
    """Events of the append-only log ``after`` beyond ``before`` (its last event may have grown in count)."""
    if not before:
        return list(after)
    k = len(before) - 1
    out = [replace(after[k], count=after[k].count - before[k].count)] if after[k].count > before[k].count else []
    return out + list(after[k + 1:])


def round_events(before: PrivacyLedger, after: PrivacyLedger) -> dict[str, list[Event]] | None:
    """The releases each account (by name, :func:`_accounts`) of ``after`` holds beyond ``before``.

    ``before`` is an earlier state of the same ledger.  A per-unit account gives the releases of the unit whose
    epsilon (at the ledger's delta) grew most.  None when an account keeps no event log.
    """
    prior = dict(before.accounts())
    out: dict[str, list[Event]] = {}
    for name, acc in after.accounts():
        was = prior.get(name)
        if isinstance(acc, PerUnitAccountant):
            assert was is None or isinstance(was, PerUnitAccountant)
            best: tuple[float, list[Event]] = (-math.inf, [])
            for u in acc.units:
                old = was.unit(u) if was is not None and u in was.units else None
                added = _log_added(old, acc.unit(u))
                if added is None:
                    return None
                grew = acc.unit(u).epsilon(after.delta) - (0.0 if old is None else old.epsilon(after.delta))
                if added and grew > best[0]:
                    best = (grew, added)
            out[name] = best[1]
            continue
        added = _log_added(was, acc)
        if added is None:
            return None
        out[name] = added
    return out


def view_events(ledger: PrivacyLedger, event: Event) -> dict[str, list[Event]]:
    """``event`` composed into both views of ``ledger`` (:meth:`PrivacyLedger.compose`), named as in :func:`round_events`."""
    views = [a for a in (ledger.uplink, ledger.downlink) if a is not None]
    return {name: [event] for name, acc in ledger.accounts() if any(acc is v for v in views)}


def _log_added(was: Accountant | None, now: Accountant) -> list[Event] | None:
    if not hasattr(now, "events"):
        return None
    return _added(tuple(was.events) if was is not None else (), tuple(now.events))  # type: ignore[attr-defined]


def epsilon_after(ledger: PrivacyLedger, events: dict[str, list[Event]], units: list[int] | None = None) -> float:
    """The headline epsilon ``ledger`` would report with ``events`` (:func:`round_events`) composed on top.

    A per-unit account gets its events in each unit of ``units`` (None: every unit it has, and one new unit);
    ``ledger`` itself is not changed.
    """
    trial = PrivacyLedger.from_state(ledger.to_state())
    accounts = dict(trial.accounts())
    for name, evs in events.items():
        acc = accounts[name]
        if isinstance(acc, PerUnitAccountant):
            fresh = min(acc.units, default=0) - 1
            targets = [*acc.units, fresh] if units is None else units
            for e in evs:
                acc.compose(e, units=targets)
        else:
            for e in evs:
                acc.compose(e)
    return trial.report()["epsilon"]


def crosses(ledger: PrivacyLedger, event: Event, epsilon: float) -> bool:
    """Whether composing ``event`` into both views of ``ledger`` would take its headline epsilon past ``epsilon``.

    For a release the server can still decline (e.g. a sum not yet reconstructed); ``ledger`` is not changed.
    """
    trial = PrivacyLedger.from_state(ledger.to_state())
    trial.compose(event)
    return trial.report()["epsilon"] > epsilon * (1.0 + _TOL)


def events_to_state(events: dict[str, list[Event]]) -> dict[str, list[dict[str, Any]]]:
    """JSON form of :func:`round_events`' result."""
    return {name: [e.to_dict() for e in evs] for name, evs in events.items()}


def events_from_state(state: dict[str, list[dict[str, Any]]]) -> dict[str, list[Event]]:
    """Inverse of :func:`events_to_state`."""
    return {name: [event_from_dict(e) for e in evs] for name, evs in state.items()}
