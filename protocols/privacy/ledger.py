"""A method's privacy accounts: one accountant per adversary view, and the report read from them.

* ``uplink`` -- what the server (or an eavesdropper) learns from the uploads;
* ``downlink`` -- what anyone learns from the published global models;
* ``extra`` -- further named accounts shown next to them (e.g. a paper's own composition).

``None`` for a view means the method gives no guarantee there (reported as ``inf``).  Both
views may share one accountant (one bound covers both): it is then composed once.  The
strategy composes each release's events into the ledger when it happens; the strategy base
reads :meth:`PrivacyLedger.report`.  A per-client ledger plugs in by holding
per-unit accountants (:class:`~protocols.privacy.accountant.PerUnitAccountant`) and composing with ``units=``;
:meth:`PrivacyLedger.to_state` stores everything as JSON.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from protocols.privacy.accountant import Accountant, PerUnitAccountant, accountant_from_state
from protocols.privacy.events import Event

__all__ = ["Headline", "PrivacyLedger"]

#: Which view is the method's headline ``epsilon``: the worse of the two, or the one its threat model claims.
Headline = Literal["worst", "uplink", "downlink"]


def compose_into(acc: Accountant, event: Event, units: Iterable[int] | None = None) -> None:
    """Compose ``event`` into ``acc``; a :class:`PerUnitAccountant` needs the ``units`` whose data it used."""
    if isinstance(acc, PerUnitAccountant):
        if units is None:
            raise ValueError("a per-unit account needs the units (clients) a release used")
        acc.compose(event, units=units)
    else:
        acc.compose(event)


class PrivacyLedger:
    """The accountants of one method's guarantees and the epsilon figures read from them (at ``delta``)."""

    def __init__(self, delta: float, *, uplink: Accountant | None = None, downlink: Accountant | None = None,
                 headline: Headline = "worst", extra: Mapping[str, Accountant] | None = None) -> None:
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if headline not in ("worst", "uplink", "downlink"):
            raise ValueError(f"unknown headline {headline!r} (use 'worst', 'uplink' or 'downlink')")
        self.delta = float(delta)
        self.uplink = uplink
        self.downlink = downlink
        self.headline: Headline = headline
        self.extra: dict[str, Accountant] = dict(extra or {})

    def compose(self, event: Event, *, units: Iterable[int] | None = None) -> None:
        """Compose one release into both views (once when they share an accountant); views without a guarantee skip it."""
        units = None if units is None else list(units)
        seen: list[Accountant] = []
        for acc in (self.uplink, self.downlink):
            if acc is not None and not any(acc is s for s in seen):
                compose_into(acc, event, units)
                seen.append(acc)

    def accounts(self) -> list[tuple[str, Accountant]]:
        """Every distinct accountant of the ledger, named (views, then extra accounts; a shared one once)."""
        out: list[tuple[str, Accountant]] = []
        for name, acc in (("uplink", self.uplink), ("downlink", self.downlink), *self.extra.items()):
            if acc is not None and not any(acc is a for _, a in out):
                out.append((name, acc))
        return out

    def per_unit(self) -> list[PerUnitAccountant]:
        """The ledger's per-unit accountants (each once, views and extra accounts)."""
        return [acc for _, acc in self.accounts() if isinstance(acc, PerUnitAccountant)]

    @staticmethod
    def _epsilon(acc: Accountant | None, delta: float) -> float:
        return math.inf if acc is None else acc.epsilon(delta)

    def report(self) -> dict[str, float]:
        """``epsilon``, ``epsilon_uplink``, ``epsilon_downlink`` spent so far (``inf`` = no guarantee)."""
        up = self._epsilon(self.uplink, self.delta)
        down = up if self.downlink is self.uplink else self._epsilon(self.downlink, self.delta)
        headline = {"worst": max(up, down), "uplink": up, "downlink": down}[self.headline]
        return {"epsilon": headline, "epsilon_uplink": up, "epsilon_downlink": down}

    def extra_report(self) -> dict[str, float]:
        """``epsilon_<name>`` of every extra account."""
        return {f"epsilon_{name}": acc.epsilon(self.delta) for name, acc in self.extra.items()}

    def to_state(self) -> dict[str, Any]:
        """Everything as plain JSON types (:meth:`from_state` rebuilds an equal ledger)."""
        shared = self.uplink is not None and self.downlink is self.uplink
        return {
            "delta": self.delta,
            "headline": self.headline,
            "uplink": None if self.uplink is None else self.uplink.to_state(),
            "downlink": "uplink" if shared else (None if self.downlink is None else self.downlink.to_state()),
            "extra": {name: self._alias(acc) or acc.to_state() for name, acc in self.extra.items()},
        }

    def _alias(self, acc: Accountant) -> str | None:
        """``"uplink"``/``"downlink"`` when an extra account is that view's accountant (kept shared by :meth:`from_state`)."""
        return "uplink" if acc is self.uplink else "downlink" if acc is self.downlink else None

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PrivacyLedger:
        """Inverse of :meth:`to_state`."""
        up = None if state["uplink"] is None else accountant_from_state(state["uplink"])
        down_state = state["downlink"]
        down = up if down_state == "uplink" else (None if down_state is None else accountant_from_state(down_state))
        views = {"uplink": up, "downlink": down}
        extra = {name: views[s] if isinstance(s, str) else accountant_from_state(s)
                 for name, s in state.get("extra", {}).items()}
        return cls(float(state["delta"]), uplink=up, downlink=down, headline=state["headline"], extra=extra)
