"""What a run states about itself: the regime it applied, what its epsilon means, and the noise check.

The runner (:mod:`server.runner`) prints these lines at start and after round 1, and writes the
same facts to ``summary.json`` (``regime``, ``privacy``, ``noise_check``) and ``privacy_unit`` to
every ``metrics.jsonl`` row.  The facts come from the method registry
(:data:`protocols.methods.METHODS`: regime and :class:`~protocols.methods.Guarantee`) and from the
strategy's :meth:`~strategies.base.CancelStrategy.noise_estimate`.
"""

from __future__ import annotations

from typing import Any

from protocols.config import RunConfig
from protocols.methods import method_spec
from strategies.base import CancelStrategy

__all__ = ["noise_check", "preamble", "privacy_summary"]


def preamble(cfg: RunConfig) -> list[str]:
    """Lines printed at start: the regime values applied (keys left "auto") and the guarantee's meaning."""
    applied = dict(cfg.regime_applied)
    lines = []
    if applied:
        lines.append(f"{cfg.method} regime on {cfg.dataset} (keys left \"auto\"; set any to override): "
                     + " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in applied.items()))
    g = method_spec(cfg.method).guarantee(cfg.privacy_unit)
    if g.unit == "none":
        lines.append(f"privacy: {cfg.method} gives no DP guarantee (epsilon is reported as null)")
    else:
        lines.append(f"privacy: epsilon={cfg.epsilon:g}, delta={cfg.delta:g} over the whole run, per {g.unit}; "
                     f"uplink (the uploads): {g.uplink or 'no guarantee'}; "
                     f"downlink (the published model): {g.downlink or 'no guarantee'}")
    return lines


def privacy_summary(cfg: RunConfig, last_row: dict[str, Any]) -> dict[str, Any]:
    """summary.json's ``privacy``: target, unit, and per direction the adversary assumed and the epsilon spent.

    A direction without a guarantee has adversary and epsilon null, whatever an accountant holds.
    """
    g = method_spec(cfg.method).guarantee(cfg.privacy_unit)
    return {
        "target_epsilon": cfg.epsilon if g.unit != "none" else None,
        "delta": cfg.delta,
        "unit": g.unit,
        "uplink": {"view": "the uploads, as the server or an eavesdropper sees them", "adversary": g.uplink,
                   "epsilon": last_row.get("epsilon_uplink") if g.uplink else None},
        "downlink": {"view": "the published global models", "adversary": g.downlink,
                     "epsilon": last_row.get("epsilon_downlink") if g.downlink else None},
    }


def noise_check(strategy: CancelStrategy, num_params: int) -> tuple[dict | None, str | None]:
    """(summary.json's ``noise_check``, the warning or None), from the strategy's estimate after round 1."""
    est = strategy.noise_estimate(num_params)
    if est is None:
        return None, None
    return est.as_dict(), (f"warning: {est.message()}" if est.dwarfs else None)
