"""What a run states about itself: regime, meaning of epsilon, noise check, and whether it learned.

The runner (:mod:`server.runner`) prints these lines at start and after round 1, and writes the
same facts to ``summary.json`` (``regime``, ``privacy``, ``noise_check``) and ``privacy_unit`` to
every ``metrics.jsonl`` row.  The facts come from the method registry
(:data:`protocols.methods.METHODS`: regime and :class:`~protocols.methods.Guarantee`) and from the
strategy's :meth:`~strategies.base.CancelStrategy.noise_estimate`, and the signal measured in what the
rounds released (:class:`protocols.privacy.signal.MeasuredSignal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from protocols.config import RunConfig
from protocols.methods import FULL_BATCH, method_spec
from protocols.privacy.signal import MeasuredSignal

__all__ = ["ABOVE_CHANCE", "chance_level", "learning_check", "noise_check", "over_target", "preamble",
           "privacy_summary"]

#: A published model whose test accuracy is not this far above chance did not learn (the run warns).
ABOVE_CHANCE = 0.05


def _shown(key: str, value: Any) -> str:
    """``key=value`` as a run config writes it; the full-batch size says so."""
    if key == "batch-size" and value == FULL_BATCH:
        return f"{key}={value} (full batch)"
    return f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"


#: Regime keys that only cancelfl's own model and datasets read (a user's model and data ignore them).
APP_TASK_KEYS: tuple[str, ...] = ("hidden", "input-centering")


def preamble(cfg: RunConfig, *, verbose: bool = True, own_model_and_data: bool = False,
             noiseless: bool = False) -> list[str]:
    """Lines printed at start: the regime values applied (keys left "auto") and the guarantee's meaning.

    ``verbose`` False: the guarantee names the views it protects, not the adversaries assumed.
    ``own_model_and_data`` True (a user's ServerApp): the regime line names no dataset and leaves out
    :data:`APP_TASK_KEYS`.  ``noiseless``: the method's settings leave no DP noise (no accountant, e.g. niss-tau = 0).
    """
    applied = dict(cfg.regime_applied)
    where = f" on {cfg.dataset}"
    if own_model_and_data:
        applied = {k: v for k, v in applied.items() if k not in APP_TASK_KEYS}
        where = ""
    lines = []
    if applied:
        lines.append(f"{cfg.method} regime{where} (keys left \"auto\"; set any to override): "
                     + " ".join(_shown(k, v) for k, v in applied.items()))
    g = method_spec(cfg.method).guarantee(cfg.privacy_unit)
    if g.unit == "none":
        lines.append(f"privacy: {cfg.method} gives no DP guarantee (epsilon is reported as null)")
    elif noiseless:
        lines.append(f"privacy: {cfg.method} with these settings leaves no DP noise (e.g. niss-tau = 0): no "
                     "guarantee (epsilon is reported as null)")
    elif not verbose:
        views = " and ".join(v for v, adv in (("the uploads", g.uplink), ("the published model", g.downlink)) if adv)
        lines.append(f"privacy: epsilon {cfg.epsilon:g} (delta {cfg.delta:g}) per {g.unit} over the whole run, "
                     f"protecting {views}")
    else:
        lines.append(f"privacy: epsilon={cfg.epsilon:g}, delta={cfg.delta:g} over the whole run, per {g.unit}; "
                     f"uplink (the uploads): {g.uplink or 'no guarantee'}"
                     + (f" (second figure, no colluding neighbour: {g.uplink_no_colluder})" if g.uplink_no_colluder
                        else "") + "; "
                     f"downlink (the published model): {g.downlink or 'no guarantee'}")
    return lines


def privacy_summary(cfg: RunConfig, last_row: dict[str, Any]) -> dict[str, Any]:
    """summary.json's ``privacy``: target, unit, and per direction the adversary assumed and the epsilon spent.

    A direction without a guarantee has adversary and epsilon null, whatever an accountant holds.  A method whose
    uplink adversary includes colluding peers (:attr:`protocols.methods.Guarantee.uplink_no_colluder`) also has
    ``uplink_no_colluder``: the uploads' view with none of them (``epsilon_uplink_no_colluder``, never above the
    uplink's; the uplink's is what the clients' ledgers charge).
    """
    g = method_spec(cfg.method).guarantee(cfg.privacy_unit)
    alone = {"uplink_no_colluder": {
        "view": "the uploads, with no neighbour of the client colluding with the server", "adversary":
        g.uplink_no_colluder, "epsilon": last_row.get("epsilon_uplink_no_colluder")}} if g.uplink_no_colluder else {}
    return {
        "target_epsilon": cfg.epsilon if g.unit != "none" else None,
        "over_target": over_target(cfg, last_row) is not None,
        "delta": cfg.delta,
        "unit": g.unit,
        "adjacency": cfg.adjacency if g.unit == "record" else None,
        "uplink": {"view": "the uploads, as the server or an eavesdropper sees them", "adversary": g.uplink,
                   "epsilon": last_row.get("epsilon_uplink") if g.uplink else None},
        "downlink": {"view": "the published global models", "adversary": g.downlink,
                     "epsilon": last_row.get("epsilon_downlink") if g.downlink else None},
        **alone,
    }


def over_target(cfg: RunConfig, row: dict[str, Any]) -> str | None:
    """The warning when the epsilon spent so far is above the run's target (None while within it).

    Calibrations are exact for the clients a round starts with.  When some drop after the noise was fixed
    (pairwise methods, then dropout recovery), the accountants charge the noise really left.  The budget
    guard (:mod:`strategies.run.budget`) keeps Gaussian accounts within the target (more noise, or a stop);
    a run whose accounts it cannot read (Laplace, (epsilon, delta) rounds) can end above it: it must say so.
    """
    spent = row.get("epsilon")
    if spent is None or method_spec(cfg.method).guarantee(cfg.privacy_unit).unit == "none":
        return None
    if spent <= cfg.epsilon * (1.0 + 1e-6):
        return None
    return (f"warning: round {row['round']}: epsilon spent {spent:.4g} is above the run's target {cfg.epsilon:g}: "
            "clients dropped after the round's noise was calibrated (see 'dropped' in metrics.jsonl) and the "
            "accountant charges the noise really left (the budget guard cannot hold this method's accounts). "
            "A node caps its own spending with its 'lifetime-epsilon' (rounds beyond it are refused)")


def noise_check(strategy: Any, num_params: int) -> tuple[dict | None, str | None]:
    """(summary.json's ``noise_check``, the warning or None), from the strategy's estimate after round 1."""
    est = strategy.noise_estimate(num_params)
    if est is None:
        return None, None
    return est.as_dict(), (f"warning: {est.message()}" if est.dwarfs else None)


def chance_level(labels: Sequence[int] | np.ndarray) -> float:
    """Share of the most frequent class among ``labels``: what always answering that class scores."""
    y = np.asarray(labels, dtype=np.int64).ravel()
    return float(np.bincount(y).max() / len(y)) if len(y) else 0.0


def learning_check(final_accuracy: float, chance: float, measured: MeasuredSignal) -> tuple[dict, str | None]:
    """Whether the published model is clearly above chance: (summary.json's ``learning_check``, warning or None).

    The a-priori noise check trusts the clip bound as the signal; where the released signal is far below it
    (the MP family, DDP-SA at epsilon 1 on small data) a run can end at chance without it firing.  This check
    reads the outcome itself and quotes what the rounds released (``measured``).
    """
    learned = final_accuracy >= chance + ABOVE_CHANCE
    info = {"final_accuracy": final_accuracy, "chance": chance, "margin": ABOVE_CHANCE, "learned": learned}
    if learned:
        return info, None
    why = (f"; {measured.describe()}: the privacy noise dwarfs what this method's updates carry here. A larger "
           "'epsilon', more clients per round, a smaller model or (record-level methods) more data per client "
           "reduce it" if measured.rounds else "; check the learning rate and the number of rounds")
    return info, (f"warning: the published model is not clearly better than chance (test accuracy "
                  f"{final_accuracy:.3f}, most frequent class {chance:.3f}, margin {ABOVE_CHANCE:g}){why}")
