"""Accountants: the privacy a sequence of released events has spent, one interface for every method.

An :class:`Accountant` composes :mod:`events <protocols.privacy.events>` and answers ``epsilon(delta)``; its state
is plain JSON (:meth:`Accountant.to_state`, :func:`accountant_from_state`), so a client's ledger can persist it.

* :class:`RdpAccountant`: Renyi DP over Google's dp-accounting (Mironov 2017; subsampled Gaussian of Mironov,
  Talwar & Zhang 2019) with the fixed orders :data:`RDP_ORDERS`;
* :class:`GdpAccountant`: exact composition of unsampled Gaussian releases (Dong, Roth & Su 2019);
* :class:`DpCompositionAccountant`: basic / advanced composition of (epsilon, delta)-DP releases (DDP-SA Theorem 2);
* :class:`PldAccountant`: privacy-loss-distribution composition of pure-DP releases (:mod:`protocols.privacy.pld`);
* :class:`Lemma2Accountant`: NADP-FL's Lemma 2, for the paper's figures;
* :class:`PerUnitAccountant`: one accountant per unit, reporting the worst.
"""

from __future__ import annotations

import copy
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, ClassVar, Literal

import dp_accounting
import numpy as np
from dp_accounting.rdp import RdpAccountant as _DpRdpAccountant

from protocols.privacy.composition import compose_advanced, compose_basic, lemma2_epsilon
from protocols.privacy.events import DpEvent, Event, GaussianEvent, LaplaceEvent, event_from_dict
from protocols.privacy.mechanisms import analytic_gaussian_epsilon
from protocols.privacy.pld import pld_epsilon

__all__ = [
    "RDP_ORDERS",
    "Accountant",
    "DpCompositionAccountant",
    "GdpAccountant",
    "Lemma2Accountant",
    "PerUnitAccountant",
    "PldAccountant",
    "RdpAccountant",
    "accountant_from_state",
]

#: RDP orders of every RDP accountant: dense at small alpha (large-sigma regime) up to 1024.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 20.0 for x in range(1, 100)] + list(range(6, 64)) + [64, 80, 96, 128, 160, 192, 256, 384, 512, 1024]
)

Composition = Literal["basic", "advanced", "best"]


def _check_delta(delta: float) -> float:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


class _DropNonConvergedOrders(logging.Filter):
    """Drops dp-accounting's "_compute_log_a_frac failed to converge" warnings (one per order and evaluation).

    For a sampled Gaussian with a large multiplier the series of a fractional order converges too slowly;
    dp-accounting then sets that order's RDP to infinity, i.e. leaves it out of the minimum over orders, so the
    epsilon stays a valid (slightly looser) bound.  A calibration evaluates hundreds of orders per bisection
    step: a q = 0.5 run printed over 1,000 such lines.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


logging.getLogger("absl").addFilter(_DropNonConvergedOrders())


class Accountant(ABC):
    """One privacy guarantee (e.g. a client's uplink): events in, ``epsilon(delta)`` out."""

    #: Name in the serialised state (``{"kind": ...}``).
    kind: ClassVar[str]

    @abstractmethod
    def compose(self, event: Event) -> None:
        """Add one released event (``event.count`` releases)."""

    @abstractmethod
    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (0 before any release, ``inf`` for an un-noised release)."""

    @property
    @abstractmethod
    def releases(self) -> int:
        """Number of releases composed so far."""

    def pure_epsilon(self) -> float | None:
        """The epsilon of a pure (delta = 0) DP guarantee of the releases so far, or None where none is certified.

        Only accountants of pure-DP events certify one (their basic composition, ``sum eps_t``); a privacy audit
        compares a lower bound at ``delta = 0`` with a claim only where this is no larger than the claim.
        """
        return None

    def epsilon_rank(self) -> float | None:
        """A number whose order is the order of epsilon at every delta among accountants of this class, or None.

        Lets :class:`PerUnitAccountant` find its worst unit with one epsilon computation.
        """
        return None

    @abstractmethod
    def to_state(self) -> dict[str, Any]:
        """The whole state as plain JSON types; :func:`accountant_from_state` rebuilds an equal accountant."""

    @classmethod
    @abstractmethod
    def from_state(cls, state: Mapping[str, Any]) -> Accountant:
        """Inverse of :meth:`to_state`."""

    @classmethod
    def _check_kind(cls, state: Mapping[str, Any]) -> None:
        if state.get("kind") != cls.kind:
            raise ValueError(f"{cls.__name__} state must have kind {cls.kind!r}, got {state.get('kind')!r}")


class _EventLog(Accountant):
    """An accountant whose state is the list of events it composed, consecutive equal events merged.

    Every event but the last is *committed* (folded into the running figure with its
    merged count); the last one stays open while equal events keep arriving.  Rebuilding
    from the state therefore repeats exactly the same arithmetic: the epsilon of a
    reloaded accountant is bit-identical to the original's.
    """

    #: Event types this accountant can compose.
    accepts: ClassVar[tuple[type, ...]] = (GaussianEvent, LaplaceEvent)

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self._events: list[Event] = []
        for e in events:
            self.compose(e)

    def compose(self, event: Event) -> None:
        if not isinstance(event, self.accepts):
            raise TypeError(f"{type(self).__name__} cannot compose {type(event).__name__}")
        self._check(event)
        if event.count == 0:
            return
        last = self._events[-1] if self._events else None
        if last is not None and replace(last, count=0) == replace(event, count=0):
            self._events[-1] = replace(last, count=last.count + event.count)
            return
        if last is not None:
            self._commit(last)
        self._events.append(event)

    def _check(self, event: Event) -> None:
        """Refuse an event this accountant cannot account (before anything changes)."""

    def _commit(self, event: Event) -> None:
        """Fold a finished event (no more merging into it) into the running figure."""

    @property
    def events(self) -> tuple[Event, ...]:
        """The released events, oldest first."""
        return tuple(self._events)

    @property
    def releases(self) -> int:
        return sum(e.count for e in self._events)

    def _params(self) -> dict[str, Any]:
        """Constructor keywords stored with the state."""
        return {}

    def to_state(self) -> dict[str, Any]:
        return {"kind": self.kind, **self._params(), "events": [e.to_dict() for e in self._events]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> _EventLog:
        cls._check_kind(state)
        params = {k: v for k, v in state.items() if k not in ("kind", "events")}
        return cls(events=[event_from_dict(e) for e in state["events"]], **params)


class RdpAccountant(_EventLog):
    """Renyi-DP accountant (dp-accounting's, with :data:`RDP_ORDERS`).

    Gaussian releases: RDP of the (Poisson-subsampled) Gaussian mechanism (Mironov
    2017, Prop. 7; Mironov, Talwar & Zhang 2019); Laplace releases: Mironov 2017,
    Prop. 6.  RDP adds up over releases; epsilon at ``delta`` is dp-accounting's
    conversion minimised over the orders.  Unsampled Gaussian releases are kept as
    one sum of ``1/z^2`` and handed to dp-accounting as the single Gaussian they
    are equivalent to (exact: the Gaussian's RDP is linear in ``1/z^2``; dp-accounting
    does the same for composed Gaussians), so composing them costs nothing.
    Fixed-size client sampling (m of N) accounted with ``sampling_rate = m/N`` is
    the usual Poisson approximation of DP-FL papers.
    """

    kind = "rdp"

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self._committed = _DpRdpAccountant(list(RDP_ORDERS))  # committed sampled Gaussian / Laplace events
        self._precision = 0.0  # committed unsampled Gaussian releases: sum of count / z^2
        self._only_plain = True  # no sampled Gaussian / Laplace event so far
        self._with_last: tuple[Event, _DpRdpAccountant] | None = None  # committed + open event, cached
        super().__init__(events)

    @staticmethod
    def _plain(event: Event) -> bool:
        return isinstance(event, GaussianEvent) and event.sampling_rate >= 1.0

    @staticmethod
    def _dp_event(event: Event) -> dp_accounting.DpEvent:
        if isinstance(event, LaplaceEvent):
            return dp_accounting.LaplaceDpEvent(1.0 / event.epsilon)
        if event.noise_multiplier == 0.0:
            return dp_accounting.NonPrivateDpEvent()
        gauss = dp_accounting.GaussianDpEvent(event.noise_multiplier)
        return gauss if event.sampling_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(event.sampling_rate, gauss)

    def compose(self, event: Event) -> None:
        super().compose(event)
        if event.count and not self._plain(event):
            self._only_plain = False

    def _others(self) -> _DpRdpAccountant:
        """dp-accounting's accountant of the events other than unsampled Gaussians (each RDP computed once)."""
        last = self._events[-1]
        if self._plain(last):
            return self._committed
        if self._with_last is None or self._with_last[0] != last:
            acc = copy.deepcopy(self._committed)
            acc.compose(self._dp_event(last), last.count)
            self._with_last = (last, acc)
        return self._with_last[1]

    def _total_precision(self) -> float:
        last = self._events[-1]
        return self._precision + (GdpAccountant.precision_of(last) if self._plain(last) else 0.0)

    def _commit(self, event: Event) -> None:
        if self._plain(event):
            self._precision += GdpAccountant.precision_of(event)
        else:
            self._committed = self._others()  # ``event`` is the open event here

    def epsilon(self, delta: float) -> float:
        delta = _check_delta(delta)
        if not self._events:
            return 0.0
        acc, precision = self._others(), self._total_precision()
        if precision > 0.0:
            acc = copy.deepcopy(acc)
            acc.compose(dp_accounting.GaussianDpEvent(precision**-0.5) if math.isfinite(precision)
                        else dp_accounting.NonPrivateDpEvent())
        return float(acc.get_epsilon(delta))

    def epsilon_rank(self) -> float | None:
        """Total ``1/z^2`` when only unsampled Gaussians were composed (epsilon grows with it), else None."""
        if not self._only_plain:
            return None
        return self._total_precision() if self._events else 0.0


class GdpAccountant(_EventLog):
    """Exact composition of unsampled Gaussian releases (Gaussian DP).

    A Gaussian release with multiplier ``z`` is ``1/z``-GDP; T of them compose to
    ``mu = sqrt(sum_t z_t^-2)``-GDP (Dong, Roth & Su 2019, Cor. 3.3), i.e. to one
    Gaussian release with multiplier ``1/mu``, whose exact epsilon at ``delta`` is
    the analytic Gaussian profile (Balle & Wang 2018, Thm 8; Dong et al. Cor. 2.13).
    Tighter than RDP for the same releases; no amplification by sampling.
    """

    kind = "gdp"
    accepts = (GaussianEvent,)

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self._committed = 0.0  # sum over committed releases of count / z^2
        super().__init__(events)

    def _check(self, event: Event) -> None:
        if event.sampling_rate != 1.0:
            raise ValueError("GdpAccountant composes unsampled Gaussian releases only (sampling_rate 1)")

    @staticmethod
    def precision_of(event: GaussianEvent) -> float:
        """``count / z^2`` of an unsampled Gaussian event (``inf`` for an un-noised release)."""
        z = event.noise_multiplier
        return math.inf if z == 0.0 else event.count / z**2

    def _commit(self, event: Event) -> None:
        self._committed += self.precision_of(event)

    def epsilon_rank(self) -> float:
        """Total ``1/z^2`` (epsilon grows with it)."""
        return self._committed + self.precision_of(self._events[-1]) if self._events else 0.0

    def epsilon(self, delta: float) -> float:
        delta = _check_delta(delta)
        if not self._events:
            return 0.0
        precision = self.epsilon_rank()
        if math.isinf(precision):
            return math.inf
        return analytic_gaussian_epsilon(1.0 / math.sqrt(precision), delta, 1.0)


class DpCompositionAccountant(_EventLog):
    """Composition of (epsilon, delta)-DP releases (Laplace, or rounds a theorem certifies) by DDP-SA's Theorem 2.

    ``composition``: ``"basic"`` (``(sum eps_t, sum delta_t)``), ``"advanced"``
    (``sqrt(2 ln(1/delta') sum eps_t^2) + sum eps_t (e^eps_t - 1)`` with
    ``delta' = delta - sum delta_t``; Dwork, Rothblum & Vadhan 2010) or ``"best"`` (the
    smaller of the two; both are valid bounds).  :func:`protocols.privacy.composition.compose_basic`
    and :func:`~protocols.privacy.composition.compose_advanced` hold the formulas.
    """

    kind = "dp-composition"
    accepts = (LaplaceEvent, DpEvent)

    def __init__(self, events: Iterable[Event] = (), *, composition: Composition = "basic") -> None:
        if composition not in ("basic", "advanced", "best"):
            raise ValueError(f"unknown composition {composition!r} (use 'basic', 'advanced' or 'best')")
        self.composition: Composition = composition
        super().__init__(events)

    def _params(self) -> dict[str, Any]:
        return {"composition": self.composition}

    def epsilon(self, delta: float) -> float:
        """Epsilon of the releases so far at total ``delta`` (``inf`` if their own deltas already exceed it)."""
        delta = _check_delta(delta)
        if not self._events:
            return 0.0
        counts = [e.count for e in self._events]
        eps = np.repeat([e.epsilon for e in self._events], counts)
        deltas = np.repeat([getattr(e, "delta", 0.0) for e in self._events], counts)
        spent_delta = float(deltas.sum())
        basic = compose_basic(eps, deltas).epsilon if spent_delta <= delta * (1 + 1e-9) else math.inf
        if self.composition == "basic":
            return basic
        slack = delta - spent_delta
        advanced = compose_advanced(eps, deltas, delta_prime=slack).epsilon if slack > 0 else math.inf
        return advanced if self.composition == "advanced" else min(basic, advanced)

    def pure_epsilon(self) -> float | None:
        """Basic composition ``sum eps_t`` when every release so far is pure DP (delta 0), else None."""
        if any(getattr(e, "delta", 0.0) != 0.0 for e in self._events):
            return None
        return float(sum(e.epsilon * e.count for e in self._events))


class PldAccountant(_EventLog):
    """Privacy-loss-distribution composition of pure-DP releases (:func:`protocols.privacy.pld.pld_epsilon`).

    A :class:`LaplaceEvent` is composed as the Laplace mechanism of its epsilon; a :class:`DpEvent` (``delta``
    must be 0) as any mechanism of that epsilon (the worst-case pure-DP PLD).  Never above basic composition.
    """

    kind = "pld"
    accepts = (LaplaceEvent, DpEvent)

    def _check(self, event: Event) -> None:
        if isinstance(event, DpEvent) and event.delta != 0.0:
            raise ValueError("PldAccountant composes pure-DP releases only (DpEvent delta 0)")

    def pure_epsilon(self) -> float | None:
        """Basic composition ``sum eps_t`` when every release so far is pure DP (delta 0), else None."""
        if any(getattr(e, "delta", 0.0) != 0.0 for e in self._events):
            return None
        return float(sum(e.epsilon * e.count for e in self._events))

    def epsilon(self, delta: float) -> float:
        return pld_epsilon([(e.epsilon, isinstance(e, LaplaceEvent), e.count) for e in self._events],
                           _check_delta(delta))


class Lemma2Accountant(_EventLog):
    """NADP-FL's composition (Lemma 2): ``eps = sqrt(2 ln(1/delta) sum_releases q / z^2)``.

    The paper's own accounting, reported next to the RDP accountant's figure (it drops the moments accountant's
    ``rho`` term, an under-estimate; see :func:`protocols.privacy.composition.lemma2_epsilon`).  A release on a
    sample of rate ``q`` counts as ``q`` queries, the paper's heuristic for LDP (Lemma 3).
    """

    kind = "lemma2"
    accepts = (GaussianEvent,)

    def epsilon(self, delta: float) -> float:
        _check_delta(delta)
        return lemma2_epsilon(((1.0, e.noise_multiplier, e.count * e.sampling_rate) for e in self._events), delta)


class PerUnitAccountant(Accountant):
    """One accountant per unit (client or record owner); ``epsilon`` is the worst unit's.

    ``template`` is an empty accountant (default :class:`RdpAccountant`) copied, through
    its state, for every new unit.  Units are integer ids (Flower node ids); the state
    keys them by their decimal strings.  A persistent per-client ledger stores
    :meth:`to_state` (or each :meth:`unit`'s) between runs.
    """

    kind = "per-unit"

    def __init__(self, template: Accountant | None = None, units: Mapping[int, Accountant] | None = None, *,
                 known: Iterable[int] | None = None, inherit: Accountant | None = None) -> None:
        self.template = template if template is not None else RdpAccountant()
        if self.template.releases:
            raise ValueError("the template accountant of PerUnitAccountant must be empty")
        self._units: dict[int, Accountant] = dict(units or {})
        #: Set by :meth:`renumbered`: an earlier run's node ids, and the account a unit outside them starts from.
        self.known: frozenset[int] | None = None if known is None else frozenset(int(u) for u in known)
        self.inherit = inherit

    def unit(self, unit: int) -> Accountant:
        """The accountant of ``unit``, created on first use: empty, or :attr:`inherit` for a unit not :attr:`known`."""
        acc = self._units.get(unit)
        if acc is None:
            renumbered = self.inherit is not None and self.known is not None and unit not in self.known
            acc = self._units[unit] = accountant_from_state((self.inherit if renumbered else self.template).to_state())
        return acc

    def renumbered(self, earlier: Iterable[int], delta: float) -> None:
        """A unit neither in ``earlier`` (node ids) nor accounted starts from the dearest account (at ``delta``).

        Resumed nodes may come back under new ids, and which earlier node a new id is cannot be told: an upper
        bound, exact when every node took part in the same rounds.  No-op before any node was seen.
        """
        if not (known := frozenset(int(u) for u in earlier) | frozenset(self._units)):
            return
        worst, _ = self.worst(delta)
        self.known = known | (self.known or frozenset())
        if worst is not None and (self.inherit is None or self._units[worst].epsilon(delta) >= self.inherit.epsilon(delta)):
            self.inherit = accountant_from_state(self._units[worst].to_state())

    @property
    def units(self) -> tuple[int, ...]:
        """Units with an accountant, ascending."""
        return tuple(sorted(self._units))

    def compose(self, event: Event, *, units: Iterable[int]) -> None:  # type: ignore[override]
        """Add ``event`` to the accountant of every unit in ``units`` (those whose data it used)."""
        for u in units:
            self.unit(u).compose(event)

    def epsilons(self, delta: float) -> dict[int, float]:
        """Every unit's epsilon at ``delta``."""
        return {u: acc.epsilon(delta) for u, acc in sorted(self._units.items())}

    def worst(self, delta: float) -> tuple[int | None, float]:
        """``(unit, epsilon)`` of the unit that spent most (``(None, 0.0)`` before any release; ties: smallest id)."""
        if not self._units:
            return None, 0.0
        ranks = {u: acc.epsilon_rank() for u, acc in sorted(self._units.items())}
        if len({type(acc) for acc in self._units.values()}) == 1 and None not in ranks.values():
            unit = max(ranks, key=lambda u: ranks[u])  # first (smallest id) among equal ranks
            return unit, self._units[unit].epsilon(delta)
        best: tuple[int | None, float] = (None, 0.0)
        for u, eps in self.epsilons(delta).items():
            if best[0] is None or eps > best[1]:
                best = (u, eps)
        return best

    def epsilon(self, delta: float) -> float:
        return self.worst(delta)[1]

    @property
    def releases(self) -> int:
        """Most releases any one unit took part in."""
        return max((acc.releases for acc in self._units.values()), default=0)

    def to_state(self) -> dict[str, Any]:
        renumbered = {} if self.known is None else {"known": [str(u) for u in sorted(self.known)], "inherit":
                                                     None if self.inherit is None else self.inherit.to_state()}
        return {"kind": self.kind, "template": self.template.to_state(),
                "units": {str(u): acc.to_state() for u, acc in sorted(self._units.items())}, **renumbered}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PerUnitAccountant:
        cls._check_kind(state)
        units = {int(u): accountant_from_state(s) for u, s in state["units"].items()}
        known, inherit = state.get("known"), state.get("inherit")
        return cls(accountant_from_state(state["template"]), units, known=None if known is None else map(int, known),
                   inherit=None if inherit is None else accountant_from_state(inherit))


_KINDS: dict[str, type[Accountant]] = {
    c.kind: c
    for c in (RdpAccountant, GdpAccountant, DpCompositionAccountant, PldAccountant, Lemma2Accountant, PerUnitAccountant)
}


def accountant_from_state(state: Mapping[str, Any]) -> Accountant:
    """Rebuild any accountant from its :meth:`Accountant.to_state`."""
    kind = state.get("kind")
    if kind not in _KINDS:
        raise ValueError(f"unknown accountant kind {kind!r} (known: {sorted(_KINDS)})")
    return _KINDS[kind].from_state(state)
