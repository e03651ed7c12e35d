"""Privacy events: what one release was, in the terms an accountant composes.

An event says which mechanism ran and how strongly, never on whose data: the
accountant it is composed into decides whose guarantee it spends (one per run,
per direction, per client with :class:`protocols.privacy.accountant.PerUnitAccountant`).
Events are frozen and round-trip through :meth:`to_dict` / :func:`event_from_dict`
(plain JSON types), so an accountant's state can be stored and reloaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DpEvent", "Event", "GaussianEvent", "LaplaceEvent", "at_sensitivity", "event_from_dict", "joint_gaussian"]


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")


@dataclass(frozen=True)
class GaussianEvent:
    """``count`` releases of a Gaussian mechanism, each on a Poisson subsample of rate ``sampling_rate``.

    ``noise_multiplier`` = noise std / L2 sensitivity (``z``); 0 stands for a release
    without noise (no guarantee: infinite epsilon).  ``sampling_rate`` 1.0 means no
    amplification by sampling (e.g. the server knows whom it sampled).
    """

    noise_multiplier: float
    sampling_rate: float = 1.0
    count: int = 1

    def __post_init__(self) -> None:
        z, q = self.noise_multiplier, self.sampling_rate
        if not (math.isfinite(z) and z >= 0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {z!r}")
        if not 0 < q <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {q!r}")
        _check_count(self.count)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``kind`` = ``"gaussian"``)."""
        return {"kind": "gaussian", "noise_multiplier": float(self.noise_multiplier),
                "sampling_rate": float(self.sampling_rate), "count": int(self.count)}


@dataclass(frozen=True)
class LaplaceEvent:
    """``count`` releases of a pure ``epsilon``-DP mechanism (Laplace with scale ``Delta_1 / epsilon``)."""

    epsilon: float
    count: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"epsilon must be a finite number > 0, got {self.epsilon!r}")
        _check_count(self.count)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``kind`` = ``"laplace"``)."""
        return {"kind": "laplace", "epsilon": float(self.epsilon), "count": int(self.count)}


@dataclass(frozen=True)
class DpEvent:
    """``count`` releases each certified ``(epsilon, delta)``-DP by a theorem (e.g. MP-DDP's Theorem 11 per round).

    Only composition theorems can account these (:class:`protocols.privacy.accountant.DpCompositionAccountant`);
    a Laplace release is :class:`LaplaceEvent` (which the RDP accountant also takes).
    """

    epsilon: float
    delta: float = 0.0
    count: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"epsilon must be a finite number > 0, got {self.epsilon!r}")
        if not 0.0 <= self.delta < 1.0:
            raise ValueError(f"delta must be in [0, 1), got {self.delta!r}")
        _check_count(self.count)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``kind`` = ``"dp"``)."""
        return {"kind": "dp", "epsilon": float(self.epsilon), "delta": float(self.delta), "count": int(self.count)}


Event = GaussianEvent | LaplaceEvent | DpEvent


def event_from_dict(data: Mapping[str, Any]) -> Event:
    """Inverse of ``to_dict`` (ValueError on an unknown kind or a missing field)."""
    kind = data.get("kind")
    try:
        if kind == "gaussian":
            return GaussianEvent(float(data["noise_multiplier"]), float(data["sampling_rate"]), int(data["count"]))
        if kind == "laplace":
            return LaplaceEvent(float(data["epsilon"]), int(data["count"]))
        if kind == "dp":
            return DpEvent(float(data["epsilon"]), float(data["delta"]), int(data["count"]))
    except KeyError as err:
        raise ValueError(f"privacy event {dict(data)!r} lacks {err}") from err
    raise ValueError(f"unknown privacy event kind {kind!r}")


def joint_gaussian(events: Iterable[GaussianEvent]) -> GaussianEvent:
    """Several Gaussian releases of the same sampled round, as the one Gaussian they are equivalent to.

    Gaussian mechanisms on the same data compose exactly into one Gaussian with
    ``z = (sum_i z_i^-2)^-1/2`` (Mironov 2017, RDP of the Gaussian is linear in
    ``1/z^2``; Dong, Roth & Su 2019, Cor. 3.3 for GDP); under one Poisson sample per
    round this is how dp-accounting treats ``PoissonSampled(Composed(Gaussians))``
    (Mironov, Talwar & Zhang 2019, Sec. 3).  All events must share ``sampling_rate`` and ``count``.
    """
    evs = list(events)
    if not evs:
        raise ValueError("need at least one GaussianEvent")
    q, count = evs[0].sampling_rate, evs[0].count
    if any(e.sampling_rate != q or e.count != count for e in evs):
        raise ValueError("Gaussian releases of one round must share sampling_rate and count")
    if any(e.noise_multiplier == 0.0 for e in evs):
        return GaussianEvent(0.0, q, count)
    return GaussianEvent(math.fsum(e.noise_multiplier ** -2 for e in evs) ** -0.5, q, count)


def at_sensitivity(event: Event, factor: float) -> Event:
    """``event`` for neighbours ``factor`` (>= 1) times its sensitivity apart: the same noise, less privacy.

    Gaussian: the multiplier over ``factor``; Laplace: epsilon times ``factor``; a theorem-certified ``DpEvent``:
    group privacy over ``k = factor`` (an integer) steps, ``(k eps, k e^((k-1) eps) delta)``, or an un-noised
    release (``GaussianEvent(0)``) when that delta reaches 1.

    Raises:
        ValueError: ``factor`` below 1 or not finite, or not an integer for a ``DpEvent``.
    """
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"sensitivity factor must be a finite number >= 1, got {factor!r}")
    if isinstance(event, GaussianEvent):
        return GaussianEvent(event.noise_multiplier / factor, event.sampling_rate, event.count)
    if isinstance(event, LaplaceEvent):
        return LaplaceEvent(event.epsilon * factor, event.count)
    if factor != int(factor):
        raise ValueError(f"a DpEvent takes an integer sensitivity factor (group privacy), got {factor!r}")
    k = int(factor)
    delta = k * math.exp((k - 1) * event.epsilon) * event.delta
    return DpEvent(k * event.epsilon, delta, event.count) if delta < 1.0 else GaussianEvent(0.0, count=event.count)
