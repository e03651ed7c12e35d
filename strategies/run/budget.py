"""The run's epsilon as a hard cap: the round loop asks :class:`BudgetGuard` before every round.

The guard reads the strategy's privacy ledger (``strategy.privacy``) as shares of the budget per view
and unit (:func:`protocols.privacy.budget.budget_shares`), learns from each finished round what one round
really costs (at noise scale 1) and, before the next, decides with :func:`protocols.privacy.budget.plan_round`:

* run it as calibrated (every clean run: the noise is never changed);
* run it with every noise std raised by ``strategy.noise_scale`` (methods with ``scales_noise = True``:
  the clients accept more noise than their floor, never less), after rounds that cost more than planned;
* stop before it, when even that cannot keep the run within its target (the loop ends the run, the
  summary says it stopped for the privacy budget and ``cancelfl run`` exits non-zero).

Methods whose accounts are not Gaussian precisions (Laplace rounds, (epsilon, delta) rounds) are guarded by
stops only: before each round the guard composes, on a copy of the ledger, what the round will cost
(:func:`protocols.privacy.budget.epsilon_after`) and stops when that would cross the target.  What it will cost
is the method's planned release of that round (``strategy.planned_release(round) -> Event | None``, composed
into both views as :meth:`~protocols.privacy.PrivacyLedger.compose` does; e.g. DDP-SA's ``eps_t`` of a decaying
schedule), and also the dearest round so far once a round cost more than its planned release; a method without
a plan is projected with the dearest round so far.  A stop says which rounds cost more than planned and which
were charged again after a resume, where any did.  The guard's own state travels in the checkpoint
(:data:`STATE_KEY`).
"""

from __future__ import annotations

import math
from typing import Any

from protocols.config import RunConfig
from protocols.methods import method_spec
from protocols.privacy import PrivacyLedger
from protocols.privacy.budget import (
    RoundBudget,
    budget_shares,
    epsilon_after,
    events_from_state,
    events_to_state,
    plan_round,
    round_events,
    start_share,
    view_events,
)
from protocols.privacy.events import Event

#: Key of the guard's state in the checkpoint's strategy state.
STATE_KEY = "budget_guard"
#: Relative slack of "within the target" and of "cost more than planned" (float round-off of the accountants).
_TOL = 1e-9


def _rounds(numbers: list[int]) -> str:
    """``"round 2"`` or ``"rounds 2, 3"``."""
    return ("round " if len(numbers) == 1 else "rounds ") + ", ".join(str(n) for n in numbers)


def _above(value: float, reference: float) -> bool:
    """Whether ``value`` exceeds ``reference`` by more than round-off."""
    return value > reference * (1.0 + _TOL) + 1e-12


class BudgetGuard:
    """Keeps a run's spent epsilon at or below its target (see the module docstring).

    Use: :meth:`before_round` (stop message or None; sets the strategy's noise scale), then
    :meth:`after_round` once the round's replies were accounted (or the round failed).
    """

    def __init__(self, cfg: RunConfig, strategy: Any, total_rounds: int) -> None:
        self.strategy = strategy
        self.total_rounds = int(total_rounds)
        #: Whether the method has a guarantee to guard.
        self.guarded = method_spec(cfg.method).guarantee(cfg.privacy_unit).unit != "none"
        self.epsilon, self.delta = float(cfg.epsilon), float(cfg.delta)
        #: Largest share of the budget one unit was charged in one round so far, at noise scale 1.
        self.dearest = 0.0
        #: The current round's decision and the precisions before it.
        self.decision = RoundBudget()
        self._before: dict | None = None
        #: Ledgers that are not precisions: the releases of the dearest round so far, and its epsilon increase.
        self.dearest_events: dict[str, list[Event]] | None = None
        self.dearest_epsilon = 0.0
        self._before_ledger: dict | None = None
        #: Rounds that cost more than their planned release (``planned_release``), and rounds charged again after a resume.
        self.dearer: list[int] = []
        self.recharged: list[int] = []
        #: Headline epsilon when the guard last looked (a resumed ledger above it holds the interrupted round's charge).
        self.last_epsilon: float | None = None
        #: The current round, its planned release (by account) and the units it is composed into.
        self._round = 0
        self._planned: dict[str, list[Event]] | None = None
        self._units: list[int] | None = None

    @property
    def scalable(self) -> bool:
        """Whether the strategy raises its noise on request: ``scales_noise = True`` in its own class.

        Not inherited: a subclass (e.g. a method of your own on ldp's server) may pair with clients that do not
        add the raised noise, so it declares ``scales_noise`` itself once they do.
        """
        return bool(type(self.strategy).__dict__.get("scales_noise", False))

    def before_round(self, rnd: int) -> str | None:
        """Decide round ``rnd``: set ``strategy.noise_scale``; return why the run must stop before it, or None."""
        self.decision = RoundBudget()
        self._before = self._before_ledger = self._planned = None
        self._round = rnd
        if self.guarded:
            self._note_recharge(rnd)
        shares = budget_shares(self.strategy.privacy, self.epsilon) if self.guarded else None
        if shares is None and self.guarded:
            return self._check_events(rnd)
        if shares == {}:  # nothing charged yet (an empty per-unit account): learn the round either way
            self._watch(rnd)
        if shares is not None:
            self._before = shares
            spent = max(shares.values(), default=0.0)
            self.decision = self._plan(shares, rnd)
            if self.decision.stop is not None:
                why = self._why(dearer=False) or ("the rounds so far cost more than the run's calibration (clients "
                                                  "dropped or were left out after the noise was fixed)")
                return (f"{self._stop_head(rnd)} ({spent:.1%} of the budget): {self.decision.stop}; {why}")
        if self.scalable:
            self.strategy.noise_scale = self.decision.scale
        return None

    def _note_recharge(self, rnd: int) -> None:
        """Record ``rnd`` as charged again when the ledger grew since the guard last looked (a resumed round's charge)."""
        now = self.strategy.privacy.report()["epsilon"]
        if not math.isfinite(now):
            return
        if self.last_epsilon is not None and _above(now, self.last_epsilon) and rnd not in self.recharged:
            self.recharged.append(rnd)
        self.last_epsilon = now

    def _stop_head(self, rnd: int) -> str:
        """The first words of every stop."""
        return (f"privacy budget: round {rnd} would take the run past its target epsilon {self.epsilon:g} "
                f"(delta {self.delta:g}); epsilon spent so far {self.strategy.privacy.report()['epsilon']:.4g}")

    def _why(self, *, dearer: bool = True) -> str:
        """The rounds that cost more than planned (``dearer``) or were charged again ("" when none is known)."""
        parts = []
        if dearer and self.dearer:
            parts.append(f"{_rounds(self.dearer)} cost more than planned (clients dropped after the noise was fixed)")
        if self.recharged:
            parts.append(f"{_rounds(self.recharged)} {'was' if len(self.recharged) == 1 else 'were'} charged again "
                         "after a resume")
        return "; ".join(parts)

    def _plan(self, shares: dict[tuple[str, int | None], float], rnd: int) -> RoundBudget:
        """:func:`plan_round` for every account (per unit: the rounds left that sample it), combined.

        An account of all clients (unit None) is charged every round left.  A client's account (per unit) is
        charged only in the rounds the public schedule samples it (:meth:`CancelStrategy.schedule_left`;
        without a schedule, every round left); a client not charged yet is planned with the most rounds any
        client has left.  A method that cannot raise its noise stops only for a client the next round samples.
        Returns the largest scale asked for, or the first stop.
        """
        all_left = self.total_rounds - rnd + 1
        sched = getattr(self.strategy, "schedule_left", lambda _a, _b: None)
        left_of, most = sched(rnd, self.total_rounds) or ({}, all_left)
        now_of, now_most = sched(rnd, rnd) or ({}, 1)
        plans = [(0.0, most, now_most)] if left_of else []  # a client not charged yet
        for (_view, unit), spent in shares.items():
            if unit is None:
                plans.append((spent, all_left, 1))
            else:
                plans.append((spent, left_of.get(unit, most), now_of.get(unit, now_most)))
        out = RoundBudget()
        for spent, left, now in plans:
            if left < 1 or (not self.scalable and not now):
                continue
            b = plan_round(1.0, spent, self.dearest, left, scalable=self.scalable)
            if b.stop is not None:
                return b
            if b.scale > out.scale:
                out = b
        return out

    def _check_events(self, rnd: int) -> str | None:
        """Ledgers that are not precisions: stop when round ``rnd``'s projected cost would cross the target.

        The projection is the round's planned release, and also the dearest round so far after a round cost
        more than planned; without a plan, the dearest round so far (nothing before the first round).
        """
        ledger = self.strategy.privacy
        self._watch(rnd)
        if not math.isfinite(ledger.report()["epsilon"]):
            return None
        projections: list[tuple[float, str]] = []
        if self._planned is not None:
            projections.append((epsilon_after(ledger, self._planned, self._units),
                                f"round {rnd}'s planned release would bring it to"))
        if self.dearest_events and (self._planned is None or self.dearer):
            projections.append((epsilon_after(ledger, self.dearest_events, self._units),
                                "a round like the dearest so far would bring it to"))
        crossing = [(after, what) for after, what in projections if _above(after, self.epsilon)]
        if not crossing:
            return None
        after, what = max(crossing)
        why = self._why() or ("no round cost more than planned: the run's planned rounds do not fit its target"
                              if self._planned is not None else "the method has no per-round plan")
        return f"{self._stop_head(rnd)}: {what} {after:.4g}; {why}"

    def _watch(self, rnd: int) -> None:
        """Keep the ledger before round ``rnd``, the units it charges and its planned release (for :meth:`after_round`)."""
        ledger = self.strategy.privacy
        self._before_ledger = ledger.to_state()
        sampled = getattr(self.strategy, "schedule_left", lambda _a, _b: None)(rnd, rnd)
        self._units = None if sampled is None else [u for u, c in sampled[0].items() if c] + [-1]  # -1: one not known yet
        release = getattr(self.strategy, "planned_release", lambda _r: None)(rnd)
        self._planned = None if release is None else view_events(ledger, release)

    def after_round(self) -> None:
        """Learn what the round just accounted cost per unit (normalised to noise scale 1)."""
        now = self.strategy.privacy.report()["epsilon"] if self._before_ledger is not None or self.guarded else math.nan
        if self._before_ledger is not None:
            before = PrivacyLedger.from_state(self._before_ledger)
            self._before_ledger = None
            events = round_events(before, self.strategy.privacy)
            if events and any(events.values()):
                cost = now - before.report()["epsilon"]
                if math.isfinite(cost) and cost >= self.dearest_epsilon:
                    self.dearest_events, self.dearest_epsilon = events, cost
            if (self._planned is not None and math.isfinite(now) and self._round not in self.dearer
                    and _above(now, epsilon_after(before, self._planned, self._units))):
                self.dearer.append(self._round)
            self._planned = None
        if self.guarded and math.isfinite(now):
            self.last_epsilon = now
        if self._before is None:
            return
        shares = budget_shares(self.strategy.privacy, self.epsilon)
        if shares is None:
            return
        # A unit new this round started from 0, or from the account a renumbered node inherited (not this round's).
        costs = [p - self._before.get(key, start_share(self.strategy.privacy, self.epsilon, *key))
                 for key, p in shares.items()]
        cost = max((c for c in costs if math.isfinite(c)), default=0.0)
        self.dearest = max(self.dearest, cost * self.decision.scale**2)
        self._before = None

    def report(self) -> dict[str, float]:
        """Figures for the round's metrics row: the noise scale when the budget raised it."""
        return {"noise_scale": self.decision.scale} if self.decision.scale != 1.0 else {}

    def to_state(self) -> dict[str, Any]:
        """JSON state (what a resumed run needs to go on guarding)."""
        out: dict[str, Any] = {"dearest": self.dearest, "dearer": self.dearer, "recharged": self.recharged}
        if self.last_epsilon is not None:
            out["last_epsilon"] = self.last_epsilon
        if self.dearest_events is not None:
            out.update(dearest_events=events_to_state(self.dearest_events), dearest_epsilon=self.dearest_epsilon)
        return out

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Inverse of :meth:`to_state` (None or missing: nothing learnt yet)."""
        if state:
            self.dearest = float(state.get("dearest", 0.0))
            self.dearer = [int(r) for r in state.get("dearer", [])]
            self.recharged = [int(r) for r in state.get("recharged", [])]
            self.last_epsilon = None if state.get("last_epsilon") is None else float(state["last_epsilon"])
            if "dearest_events" in state:
                self.dearest_events = events_from_state(state["dearest_events"])
                self.dearest_epsilon = float(state.get("dearest_epsilon", 0.0))
