"""The one round loop of every cancelfl run: ``cancelfl run/deploy`` and a strategy's ``start()`` in your own ServerApp.

:func:`run_rounds` drives a :class:`~strategies.base.CancelStrategy` over any Flower ``Grid`` and writes, to
the run folder (run-config ``out-dir``; ``""`` = a fresh ``runs/<UTC time>-<method>``):

* ``metrics.jsonl`` -- one line per round: accuracy/loss (when the task evaluates), epsilon spent (upload and
  published model), round time, bytes per client, the method's figures;
* ``summary.json`` -- config, final figures, privacy block, noise and learning checks;
* ``report.md`` + plots (:mod:`strategies.run.report`); the final model (``RunTask.save_model``);
* a checkpoint after every round, from which ``resume = true`` continues (:mod:`strategies.run.checkpoint`).

What is trained and how it is evaluated is the :class:`RunTask`: the cancelfl app's own
(``server.runner.AppTask``: dataset and model from the run config) or :class:`FlowerTask` built from the
arguments of Flower's ``Strategy.start`` (initial arrays and an optional ``evaluate_fn``).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from protocols.arrays import Weights
from protocols.config import is_on
from protocols.methods import method_spec
from protocols.privacy.signal import MeasuredSignal
from protocols.trace import trace, traced_cpu, tracing
from protocols.wire.arrays import from_record
from protocols.wire.common import PEAK_RSS_MB
from strategies.records import to_record
from strategies.run.budget import STATE_KEY, BudgetGuard
from strategies.run.checkpoint import Checkpoint, load_for_resume, mark_pending, save_checkpoint, start_run_folder
from strategies.run.grid import OFF_GRID_BYTES, MeteredGrid
from strategies.run.notes import learning_check, noise_check, over_target, preamble, privacy_summary
from strategies.run.report import write_run_report
from strategies.stages import run_round
from strategies.validation import RoundFailed, non_finite_arrays


@dataclass
class RunOutcome:
    """What :func:`run_rounds` returns."""

    summary: dict
    rows: list[dict]
    arrays: ArrayRecord


class RunTask(Protocol):
    """What a run trains and how the server evaluates it (the loop is the same for every task)."""

    #: The initial global model, as the strategy sends it.
    initial: ArrayRecord
    #: Trainable parameters (for the noise check); 0 = unknown.
    num_params: int
    #: Accuracy of always predicting the most frequent test class (learning check); None = no check.
    chance: float | None

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> tuple[float, float] | None:
        """``(loss, accuracy)`` of the global model ``arrays`` after ``server_round`` (0 = initial); None = none."""
        ...

    def save_model(self, path: Path, weights: Weights) -> str | None:
        """Write the final model under ``path`` (a folder); return the file name, or None if not saved."""
        ...


@dataclass
class FlowerTask:
    """The task of Flower's ``Strategy.start(grid, initial_arrays, ..., evaluate_fn)`` in a user's ServerApp.

    ``evaluate_fn(server_round, arrays) -> MetricRecord | None`` is Flower's centralized evaluation; its
    ``loss`` and ``accuracy`` entries (when present) feed the metrics, the divergence stop and the learning check.
    The final model is saved as ``model.npz`` (arrays by name).
    """

    initial: ArrayRecord
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
    chance: float | None = None
    #: The model and data are the user's: cancelfl's ``dataset``, ``hidden`` and ``input-centering`` do not apply.
    own_model_and_data: bool = True

    @property
    def num_params(self) -> int:  # noqa: D102
        return int(sum(np.prod(a.shape) for a in self.initial.values()))

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> tuple[float, float] | None:  # noqa: D102
        if self.evaluate_fn is None:
            return None
        res = self.evaluate_fn(server_round, arrays)
        if res is None:
            return None
        return float(res.get("loss", math.nan)), float(res.get("accuracy", math.nan))

    def save_model(self, path: Path, weights: Weights) -> str | None:  # noqa: D102
        np.savez(path / "model.npz", **{k: np.asarray(v) for k, v in weights.items()})
        return "model.npz"


def strict_json(value):
    """``value`` with every non-finite float replaced by None (JSON null): outputs are strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def non_finite_keys(row: dict) -> list[str]:
    """Top-level keys of ``row`` whose float value is NaN or inf (written as null)."""
    return [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]


def dumps(value, **kwargs) -> str:
    """Strict JSON (``allow_nan=False``) of ``value`` after :func:`strict_json`."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)


def divergence(loss: float, initial: float, factor: float) -> str | None:
    """Why the run must stop (loss non-finite or above ``factor`` x ``initial``), or None."""
    if not math.isfinite(loss):
        return f"test loss is {loss} (non-finite)"
    if factor > 0 and math.isfinite(initial) and loss > factor * initial:
        return (f"test loss {loss:.4g} exceeds {factor:g} x the initial loss {initial:.4g} "
                "(run-config 'divergence-factor')")
    return None


def _finite(x: float) -> float | None:
    """JSON-safe epsilon: ``None`` (null) stands for 'no guarantee' (infinite)."""
    return None if x is None or not math.isfinite(x) else float(x)


def model_average(published: ArrayRecord | None, arrays: ArrayRecord, decay: float, dtype) -> ArrayRecord | None:
    """Run-config ``model-ema``: the published model ``decay * published + (1 - decay) * arrays`` (None when off).

    The exponential moving average of the global models is post-processing of what the rounds already
    released, so it costs no privacy; it averages out part of the DP noise the rounds left in the model
    (De et al. 2022, "Unlocking high-accuracy differentially private image classification through scale",
    use the same for DP-SGD).  Training goes on from the latest aggregate; the runner evaluates, checkpoints
    and saves the average.  The first aggregate starts it.
    """
    if decay <= 0.0:
        return None
    new = from_record(arrays)
    if published is None:
        return to_record(new, dtype)
    old = from_record(published)
    return to_record({k: decay * np.asarray(old[k], dtype=np.float64) + (1.0 - decay) * np.asarray(v, dtype=np.float64)
                      for k, v in new.items()}, dtype)



#: Environment variable that turns on the detailed round lines (``1``): how ``cancelfl run/deploy/compare
#: --verbose`` reaches a ServerApp that Flower runs in another process.
VERBOSE_ENV = "CANCELFL_VERBOSE"


def verbose_from_env() -> bool:
    """True when :data:`VERBOSE_ENV` is ``1``/``true``/``yes``."""
    return is_on(os.environ.get(VERBOSE_ENV, "").strip())


def _kb(n: float) -> str:
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def _eps_text(value: float) -> str:
    """An epsilon of the progress line: two decimals, or three significant digits from 1e7 (``1e+300``)."""
    return f"{value:.2f}" if abs(value) < 1e7 else f"{value:.3g}"


def round_line(row: dict, total_rounds: int, target: float | None, *, verbose: bool = False,
               figures: dict[str, float] | None = None) -> str:
    """The progress line of one round (``row``: its metrics.jsonl row).

    Default: round, test accuracy, epsilon spent of the run's ``target`` (``none`` for a method without a
    guarantee, ``target`` None) and the round's seconds, e.g. ``round 3/20  acc 0.842  eps 0.31/1.00  1.8 s``;
    a failed round (``row["failed"]``) shows ``FAILED: <why>`` in place of the accuracy of the model it kept.
    ``verbose`` adds the loss, epsilon per direction, clients, bytes per client and the method's own figures
    (``figures``, e.g. the paper's accounting, marked as such).
    """
    acc = row.get("test_accuracy")
    eps = row.get("epsilon")
    parts = [f"round {row['round']}/{total_rounds}"]
    if row.get("failed"):
        parts.append(f"FAILED: {row.get('failure', '')}")
    elif acc is not None:
        parts.append(f"acc {acc:.3f}")
    parts.append("eps none (no DP)" if target is None else
                 f"eps {'inf' if eps is None else _eps_text(eps)}/{_eps_text(target)}")
    parts.append(f"{row['round_time_s']:.1f} s")
    line = "  ".join(parts)
    if not verbose:
        return line
    details = []
    if row.get("test_loss") is not None:
        details.append(f"loss {row['test_loss']:.4f}")
    if target is not None:
        details.append("eps upload " + ("none" if row.get("epsilon_uplink") is None else f"{row['epsilon_uplink']:.3f}")
                       + ("" if row.get("epsilon_uplink_no_colluder") is None else
                          f" (no colluding neighbour {row['epsilon_uplink_no_colluder']:.3f})")
                       + ", model " + ("none" if row.get("epsilon_downlink") is None else f"{row['epsilon_downlink']:.3f}"))
    details.append(f"clients {row.get('clients', 0)}")
    details.append(f"sent {_kb(row.get('bytes_sent_per_client', 0.0))}, "
                   f"received {_kb(row.get('bytes_received_per_client', 0.0))} per client")
    line += "  | " + "  ".join(details)
    if figures:
        line += "  | method figures: " + " ".join(f"{k}={v:.3g}" for k, v in figures.items())
    return line


def run_rounds(strategy: Strategy, grid: Grid, task: RunTask, *, num_rounds: int | None = None,
               progress: Callable[[str], None] = print, verbose: bool | None = None) -> RunOutcome:
    """Run the strategy's rounds on ``grid``, write the run folder, return the summary and the final model.

    Args:
        strategy: the method's :class:`~strategies.base.CancelStrategy`; its run config (``strategy.cfg``)
            names the folder, the rounds and whether to resume.
        grid: any Flower ``Grid`` (SuperLink, simulation, or the in-process ``server.local_grid.LocalGrid``).
        task: the model and evaluation (:class:`RunTask`).
        num_rounds: rounds to run (default and maximum: run-config ``num-rounds``, which the noise is calibrated for).
        progress: where one line per round and the run's notes go.
        verbose: detailed round lines and the method's parameters (:func:`round_line`); None = the
            environment variable :data:`VERBOSE_ENV`.

    Returns:
        :class:`RunOutcome`: the summary written to ``summary.json``, the rows of ``metrics.jsonl`` and the final
        published global model (the model of the last round that did not diverge).

    Raises:
        ResumeError: ``resume = true`` with a checkpoint whose run config differs.
    """
    # Ray's tip that a future Ray stops hiding GPUs from actors that ask for none concerns Ray's own users; Flower's
    # simulation starts Ray in this process after the first round's messages go out.
    warnings.filterwarnings("ignore", category=FutureWarning, module="ray._private.worker")
    cfg = strategy.cfg
    total_rounds = cfg.num_rounds if num_rounds is None else int(num_rounds)
    out = start_run_folder(cfg)  # created; an earlier run's outputs removed unless resuming
    arrays = task.initial
    mgrid = MeteredGrid(grid, fault_rate=cfg.fault_drop_rate, seed=cfg.seed)
    verbose = verbose_from_env() if verbose is None else verbose
    # A method whose settings leave no noise (niss-tau = 0) holds no accountant: no guarantee, as for fedavg.
    noiseless = strategy.privacy.uplink is None and strategy.privacy.downlink is None
    target = None if noiseless or method_spec(cfg.method).guarantee(cfg.privacy_unit).unit == "none" else cfg.epsilon
    if hasattr(strategy, "verbose"):
        strategy.verbose = verbose  # the method's own start-of-run details
    if verbose:
        strategy.summary()  # the method's parameters (Flower's log)
    own = bool(getattr(task, "own_model_and_data", False))
    # the regime applied, what epsilon protects
    for line in preamble(cfg, verbose=verbose, own_model_and_data=own, noiseless=noiseless):
        progress(line)
    noise_info, noise_checked = None, False
    num_params = task.num_params
    measured = MeasuredSignal(planned_rounds=total_rounds)  # the signal the releases carried, against their noise
    warned_over_target = False
    metrics_path = out / "metrics.jsonl"  # a fresh run empties it; a resume rewrites it once its checkpoint is checked
    t_start = time.perf_counter()
    rounds: list[dict] = []
    failures: list[str] = []
    initial_eval = task.evaluate(0, arrays)
    initial_loss = initial_eval[0] if initial_eval is not None else math.nan
    kept_arrays, kept_round, stopped = arrays, 0, None
    kept_eval = initial_eval  # (loss, accuracy) of the model kept: the final figures describe it
    published: ArrayRecord | None = None  # run-config model-ema: the average the run evaluates and saves
    first, resume_note = 1, {}
    guard = BudgetGuard(cfg, strategy, total_rounds)  # epsilon is a hard cap (strategies.run.budget)
    stopped_for = None

    def state() -> dict:
        return {**strategy.state_dict(), STATE_KEY: guard.to_state()}

    if cfg.resume:  # continue after the checkpoint's last completed round, with its accounts and metrics
        ckpt = load_for_resume(out, cfg, strategy)
        guard.load_state((ckpt.pending or {}).get("strategy_state", ckpt.strategy_state).get(STATE_KEY))
        arrays = kept_arrays = to_record(ckpt.weights, strategy.wire_dtype)
        if ckpt.published is not None:
            published = kept_arrays = to_record(ckpt.published, strategy.wire_dtype)
        rounds, failures, kept_round, first = ckpt.rows, ckpt.failures, ckpt.round, ckpt.round + 1
        kept_eval = next(((r.get("test_loss"), r.get("test_accuracy")) for r in rounds if r["round"] == kept_round),
                         initial_eval)
        t_start -= ckpt.elapsed_s
        metrics_path.write_text("".join(dumps(r) + "\n" for r in rounds))
        resume_note = {"resumed_after_round": ckpt.round, "recharged_round": ckpt.pending is not None}
        progress(f"resuming after round {ckpt.round} of {total_rounds} from {out}")
    else:  # round 0: a crash in round 1 resumes with that round's charge kept
        metrics_path.write_text("")
        save_checkpoint(out, Checkpoint(0, from_record(arrays), state(), [], [], 0.0, cfg.to_mapping()))
    if first <= total_rounds:  # the first round also starts the clients (a simulation's workers): say so
        progress(f"starting round {first} of {total_rounds} ...")
    for rnd in range(first, total_rounds + 1):
        if (stopped := guard.before_round(rnd)) is not None:  # before any noise of the round is released
            stopped_for = "privacy budget"
            progress(f"round {rnd}/{total_rounds}  STOPPED: {stopped}; the model of round {kept_round} is kept")
            break
        mgrid.reset()
        cpu0 = traced_cpu() if tracing() else 0.0  # (CANCELFL_TRACE) before the round's clock starts
        t0, t0_wall, own0 = time.perf_counter(), time.time(), time.process_time()
        try:
            new_arrays, train_metrics = run_round(  # the round's charge survives a crash once the messages are built
                strategy, mgrid, rnd, arrays, before_send=lambda r=rnd: mark_pending(out, r, state()))
            mark_pending(out, rnd, state())  # with what aggregation charged (dropouts, uploads seen)
            if new_arrays is not None and (bad := non_finite_arrays(new_arrays)):
                raise RoundFailed(f"round {rnd}: the aggregate is not finite (arrays {bad[:3]}); the model is kept")
        except RoundFailed as err:
            failures.append(str(err))
            new_arrays, train_metrics = None, None
        wall = time.perf_counter() - t0
        t_round_end, cpu_round, own_cpu = time.time(), traced_cpu() - cpu0 if tracing() else 0.0, time.process_time() - own0
        guard.after_round()
        if new_arrays is not None:
            if (release := strategy.released(arrays, new_arrays, num_params)) is not None:
                measured.add(release)
            arrays = new_arrays
            published = model_average(published, arrays, cfg.model_ema, strategy.wire_dtype)
        evaluated = task.evaluate(rnd, published if published is not None else arrays)
        loss, acc = evaluated if evaluated is not None else (None, None)
        t_evaluated = time.time()
        privacy = strategy.privacy_report(rnd)
        n_sent = max(len(mgrid.sent), 1)
        row = {
            "round": rnd,
            "test_accuracy": acc,
            "test_loss": loss,
            "epsilon": _finite(privacy.get("epsilon", math.inf)),
            "epsilon_uplink": _finite(privacy.get("epsilon_uplink", math.inf)),
            "epsilon_downlink": _finite(privacy.get("epsilon_downlink", math.inf)),
            "privacy_unit": method_spec(cfg.method).guarantee(cfg.privacy_unit).unit,
            "round_time_s": wall,
            "bytes_sent_per_client": sum(mgrid.sent.values()) / n_sent,
            "bytes_received_per_client": sum(mgrid.received.values()) / max(len(mgrid.received), 1),
            "clients": len(mgrid.received),
            "phase_time_s": dict(mgrid.phase_times),
            "failed": new_arrays is None,
            **strategy.round_report(),
            **guard.report(),
            "excluded": strategy.exclusions(),
            "left_out": sorted(str(n) for n in strategy.strikes.banned),
        }
        for key in ("train_loss", "clipped_fraction"):  # means over this round's clients
            if train_metrics is not None and key in train_metrics:
                row[key] = float(train_metrics[key])
        if train_metrics is not None and PEAK_RSS_MB in train_metrics:
            row["client_peak_rss_mb"] = float(train_metrics[PEAK_RSS_MB])  # mean over this round's clients
        if train_metrics is not None and OFF_GRID_BYTES in train_metrics:
            row["client_off_grid_bytes"] = float(train_metrics[OFF_GRID_BYTES])  # mean over this round's clients
        if row["failed"]:
            row["failure"] = failures[-1]
        # Per-client lifetime epsilon as each client's own ledger reports it (null = no guarantee; client.ledger).
        row["client_epsilon"] = {str(n): _finite(e) for n, e in sorted(getattr(strategy, "client_epsilon", {}).items())}
        strategy.client_epsilon = {}
        row.update(resume_note)  # the first resumed round says so
        resume_note = {}
        row["non_finite"] = non_finite_keys(row)
        rounds.append(row)
        if not noise_checked and not row["failed"]:  # after round 1: round-dependent calibrations exist
            noise_checked = True
            noise_info, warning = noise_check(strategy, num_params)
            if warning:
                progress(warning)
            if noise_info is not None:
                measured.space = str(noise_info["space"])
        if not warned_over_target and (warning := over_target(cfg, row)):
            warned_over_target = True
            progress(warning)
        with metrics_path.open("a") as fh:
            fh.write(dumps(row) + "\n")
        stopped = None if loss is None else divergence(loss, initial_loss, cfg.divergence_factor)
        if stopped is None:
            kept_arrays, kept_round, kept_eval = (published if published is not None else arrays), rnd, evaluated
            save_checkpoint(out, Checkpoint(rnd, from_record(arrays), state(), rounds, failures,
                                            time.perf_counter() - t_start, cfg.to_mapping(),
                                            published=None if published is None else from_record(published)))
        else:
            stopped_for = "divergence"
            progress(f"round {rnd}/{total_rounds}  STOPPED: {stopped}; the model of round {kept_round} is kept "
                     f"(a lower run-config 'lr' than {cfg.lr:g} usually trains stably; 'divergence-factor' = 0 "
                     "disables the stop)")
            break
        progress(round_line(row, total_rounds, target, verbose=verbose, figures=strategy.round_report()))
        trace("round", round=rnd, method=cfg.method, t=t0_wall, t_end=t_round_end, t_evaluated=t_evaluated,
              t_next=time.time(), cpu=cpu_round, server_cpu=own_cpu)
    total = time.perf_counter() - t_start
    model_file = task.save_model(out, from_record(kept_arrays))
    last = rounds[-1] if rounds else {"epsilon": None, "epsilon_uplink": None, "epsilon_downlink": None}
    # The saved model's figures (a diverged round's stay in metrics.jsonl); the epsilon is what all rounds spent.
    final_loss, final_accuracy = kept_eval or (None, None)
    learned = None
    if task.chance is not None and final_accuracy is not None:
        learned, warning = learning_check(final_accuracy, task.chance, measured)
        if warning and stopped is None:  # a stopped run has said why already (divergence, not the noise)
            progress(warning)
    summary = {
        "config": cfg.to_mapping(),
        "method": cfg.method,
        "method_parameters": strategy.describe(),
        "final_accuracy": final_accuracy,
        "final_loss": final_loss,
        "epsilon": last["epsilon"],
        "epsilon_uplink": last["epsilon_uplink"],
        "epsilon_downlink": last["epsilon_downlink"],
        "regime": dict(cfg.regime_applied),
        "privacy": privacy_summary(cfg, last),
        "noise_check": None if noise_info is None else {**noise_info, "measured": measured.as_dict()},
        "learning_check": learned,
        "total_time_s": total,
        "mean_round_time_s": sum(r["round_time_s"] for r in rounds) / max(len(rounds), 1),
        "failed_rounds": failures,
        "rounds_completed": len(rounds),
        "stopped": stopped,
        "stopped_for": stopped_for,
        "initial_loss": initial_loss,
        "model_file": model_file,
        "model_round": kept_round,
    }
    (out / "summary.json").write_text(dumps(summary, indent=2))
    write_run_report(out, cfg.method)  # report.md + accuracy/epsilon/noise plots
    acc_text = "" if summary["final_accuracy"] is None else f"final accuracy {summary['final_accuracy']:.4f}, "
    progress(f"done: {acc_text}epsilon "
             f"{'none (no DP)' if summary['epsilon'] is None else round(summary['epsilon'], 4)}, "
             f"{total:.1f} s, outputs in {out}")
    return RunOutcome(summary, rounds, kept_arrays)
