"""The round loop shared by every method and engine, and the run's outputs.

:func:`run_federation` drives ``num-rounds`` rounds of a :class:`CancelStrategy`
over any Flower ``Grid`` (the SuperLink's in simulation or deployment, or the
in-process :class:`server.local_grid.LocalGrid`), evaluates the global model
centrally after each round, and writes to ``out-dir``:

* ``metrics.jsonl`` -- one line per round: round, test accuracy/loss, epsilon
  spent so far (uplink and downlink), round wall time, payload bytes sent to and
  received from the average participating client, and method figures (e.g. the
  pairwise-noise cancellation residual).
* ``summary.json`` -- config, final accuracy, total time, epsilon, method parameters.
* ``report.md`` + ``accuracy.png``, ``epsilon.png``, ``noise.png`` -- :mod:`server.report`.
* ``model.npz`` + ``model.json`` -- the final global model by layer name and
  what is needed to rebuild it (:func:`client.models.load_npz_model`).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from client.data import dataset_for, partition_indices
from client.messages.common import PEAK_RSS_MB, TrainIns
from client.models import build_model, get_weights, save_npz_model, set_weights
from client.training import evaluate
from client.wire import from_record, to_record
from protocols.config import ConfigError, RunConfig
from protocols.methods import method_spec
from protocols.privacy.signal import MeasuredSignal
from server.checkpoint import Checkpoint, load_for_resume, mark_pending, save_checkpoint, start_run_folder
from server.report import write_run_report
from server.run_notes import chance_level, learning_check, noise_check, over_target, preamble, privacy_summary
from strategies.base import CancelStrategy, RoundFailed, non_finite_arrays
from strategies.validation import payload_bytes


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


def largest_partition(cfg: RunConfig, ds) -> int | None:
    """Size of the largest client partition of the run (None if it cannot be computed here).

    A partitioning no client can get (:class:`ConfigError`, e.g. a Dirichlet split too skewed for its clients)
    stops the run here, before round 1: every client would fail the same way in every round.
    """
    try:
        idx = partition_indices(ds.y_train.tobytes(), cfg.num_clients, cfg.partitioning, cfg.dirichlet_alpha, cfg.seed)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - the cap is a safeguard; without it the round median rule applies
        return None
    return max(len(i) for i in idx)


def divergence(loss: float, initial: float, factor: float) -> str | None:
    """Why the run must stop (loss non-finite or above ``factor`` x ``initial``), or None."""
    if not math.isfinite(loss):
        return f"test loss is {loss} (non-finite)"
    if factor > 0 and math.isfinite(initial) and loss > factor * initial:
        return (f"test loss {loss:.4g} exceeds {factor:g} x the initial loss {initial:.4g} "
                "(run-config 'divergence-factor')")
    return None


class MeteredGrid(Grid):
    """Wraps a Grid and counts payload bytes per node in both directions."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner
        self.sent: dict[int, int] = defaultdict(int)
        self.received: dict[int, int] = defaultdict(int)
        self.phase_times: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        """Start counting a new round."""
        self.sent.clear()
        self.received.clear()
        self.phase_times.clear()

    # Delegation of the Grid API
    def set_run(self, run):  # noqa: D102
        self.inner.set_run(run)

    @property
    def run(self):  # noqa: D102
        return self.inner.run

    def create_message(self, *args, **kwargs):  # noqa: D102
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.inner.get_node_ids()

    def push_messages(self, messages):  # noqa: D102
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids):  # noqa: D102
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Send, receive and count bytes; phase time is accumulated by message type."""
        messages = list(messages)
        if not messages:
            return []
        for m in messages:
            self.sent[m.metadata.dst_node_id] += payload_bytes(m.content)
        t0 = time.perf_counter()
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        self.phase_times[messages[0].metadata.message_type] += time.perf_counter() - t0
        for r in replies:
            if not r.has_error():
                self.received[r.metadata.src_node_id] += payload_bytes(r.content)
        return replies


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


def run_federation(strategy: CancelStrategy, grid: Grid, cfg: RunConfig,
                   progress: Callable[[str], None] = print) -> dict:
    """Run all rounds, write outputs to ``cfg.out_dir`` and return the summary dict."""
    out = start_run_folder(cfg)  # created; an earlier run's outputs removed unless resuming (server/checkpoint.py)
    ds = dataset_for(cfg)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
    arrays = to_record(get_weights(model), strategy.wire_dtype)
    mgrid = MeteredGrid(grid)
    if strategy.max_examples is None:
        strategy.max_examples = largest_partition(cfg, ds)
    strategy.summary()
    for line in preamble(cfg):  # the regime applied and what epsilon protects (server/run_notes.py)
        progress(line)
    noise_info, noise_checked = None, False
    num_params = sum(int(p.numel()) for p in model.parameters())
    # The signal the released aggregates carried, measured against their known noise (protocols/privacy/signal.py).
    measured = MeasuredSignal(planned_rounds=cfg.num_rounds)
    warned_over_target = False
    metrics_path = out / "metrics.jsonl"
    metrics_path.write_text("")
    t_start = time.perf_counter()
    rounds: list[dict] = []
    failures: list[str] = []
    initial_loss, _ = evaluate(model, ds.x_test, ds.y_test)
    kept_arrays, kept_round, stopped = arrays, 0, None
    published: ArrayRecord | None = None  # run-config model-ema: the average the run evaluates and saves
    first, resume_note = 1, {}
    if cfg.resume:  # continue after the checkpoint's last completed round, with its accounts and metrics
        ckpt = load_for_resume(out, cfg, strategy)
        arrays = kept_arrays = to_record(ckpt.weights, strategy.wire_dtype)
        if ckpt.published is not None:
            published = kept_arrays = to_record(ckpt.published, strategy.wire_dtype)
        rounds, failures, kept_round, first = ckpt.rows, ckpt.failures, ckpt.round, ckpt.round + 1
        t_start -= ckpt.elapsed_s
        metrics_path.write_text("".join(dumps(r) + "\n" for r in rounds))
        resume_note = {"resumed_after_round": ckpt.round, "recharged_round": ckpt.pending is not None}
        progress(f"resuming after round {ckpt.round} of {cfg.num_rounds} from {out}")
    else:  # round 0: a crash in round 1 resumes with that round's charge kept
        save_checkpoint(out, Checkpoint(0, from_record(arrays), strategy.state_dict(), [], [], 0.0, cfg.to_mapping()))
    for rnd in range(first, cfg.num_rounds + 1):
        mgrid.reset()
        t0 = time.perf_counter()
        try:
            msgs = strategy.configure_train(rnd, arrays, TrainIns(rnd).to_config(), mgrid)
            mark_pending(out, rnd, strategy.state_dict())  # the round's charge survives a crash from here on
            replies = mgrid.send_and_receive(msgs, timeout=cfg.round_timeout)
            new_arrays, train_metrics = strategy.aggregate_train(rnd, replies)
            mark_pending(out, rnd, strategy.state_dict())  # with what aggregation charged (dropouts, uploads seen)
            if new_arrays is not None and (bad := non_finite_arrays(new_arrays)):
                raise RoundFailed(f"round {rnd}: the aggregate is not finite (arrays {bad[:3]}); the model is kept")
        except RoundFailed as err:
            failures.append(str(err))
            progress(f"[round {rnd}/{cfg.num_rounds}] FAILED: {err}")
            new_arrays, train_metrics = None, None
        wall = time.perf_counter() - t0
        if new_arrays is not None:
            if (release := strategy.released(arrays, new_arrays, num_params)) is not None:
                measured.add(release)
            arrays = new_arrays
            published = model_average(published, arrays, cfg.model_ema, strategy.wire_dtype)
        set_weights(model, from_record(published if published is not None else arrays))
        loss, acc = evaluate(model, ds.x_test, ds.y_test)
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
            "excluded": strategy.exclusions(),
            "left_out": sorted(str(n) for n in strategy.strikes.banned),
        }
        if train_metrics is not None and "train_loss" in train_metrics:
            row["train_loss"] = float(train_metrics["train_loss"])
        if train_metrics is not None and PEAK_RSS_MB in train_metrics:
            row["client_peak_rss_mb"] = float(train_metrics[PEAK_RSS_MB])  # mean over this round's clients
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
        stopped = divergence(loss, initial_loss, cfg.divergence_factor)
        if stopped is None:
            kept_arrays, kept_round = (published if published is not None else arrays), rnd
            save_checkpoint(out, Checkpoint(rnd, from_record(arrays), strategy.state_dict(), rounds, failures,
                                            time.perf_counter() - t_start, cfg.to_mapping(),
                                            published=None if published is None else from_record(published)))
        else:
            progress(f"[round {rnd}/{cfg.num_rounds}] STOPPED: {stopped}; the model of round {kept_round} is kept")
            break
        eps = row["epsilon"]
        progress(f"[round {rnd}/{cfg.num_rounds}] method={cfg.method} acc={acc:.4f} loss={loss:.4f} "
                 f"eps={'inf' if eps is None else f'{eps:.3f}'} time={wall:.2f}s clients={row['clients']}"
                 + "".join(f" {k}={v:.3g}" for k, v in strategy.round_report().items()))
    total = time.perf_counter() - t_start
    final_w = from_record(kept_arrays)
    save_npz_model(out / "model.npz", final_w, {
        "model": cfg.model, "input_shape": list(ds.input_shape), "num_classes": ds.num_classes,
        "hidden": list(cfg.hidden_sizes), "dataset": cfg.dataset,
    })
    last = rounds[-1]
    learned, warning = learning_check(last["test_accuracy"], chance_level(ds.y_test), measured)
    if warning and stopped is None:  # a stopped run has said why already (divergence, not the noise)
        progress(warning)
    summary = {
        "config": cfg.to_mapping(),
        "method": cfg.method,
        "method_parameters": strategy.describe(),
        "final_accuracy": last["test_accuracy"],
        "final_loss": last["test_loss"],
        "epsilon": last["epsilon"],
        "epsilon_uplink": last["epsilon_uplink"],
        "epsilon_downlink": last["epsilon_downlink"],
        "regime": dict(cfg.regime_applied),
        "privacy": privacy_summary(cfg, last),
        "noise_check": None if noise_info is None else {**noise_info, "measured": measured.as_dict()},
        "learning_check": learned,
        "total_time_s": total,
        "mean_round_time_s": sum(r["round_time_s"] for r in rounds) / len(rounds),
        "failed_rounds": failures,
        "rounds_completed": len(rounds),
        "stopped": stopped,
        "initial_loss": initial_loss,
        "model_file": "model.npz",
        "model_round": kept_round,
    }
    (out / "summary.json").write_text(dumps(summary, indent=2))
    write_run_report(out, cfg.method)  # report.md + accuracy/epsilon/noise plots (server/report.py)
    progress(f"done: final accuracy {summary['final_accuracy']:.4f}, epsilon "
             f"{'inf' if summary['epsilon'] is None else round(summary['epsilon'], 4)}, "
             f"{total:.1f} s, outputs in {out}")
    return summary
