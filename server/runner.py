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
* ``model.npz`` + ``model.json`` -- the final global model by layer name and
  what is needed to rebuild it (:func:`client.models.load_npz_model`).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from client.data import dataset_for
from client.messages.common import TrainIns
from client.models import build_model, get_weights, save_npz_model, set_weights
from client.training import evaluate
from client.wire import from_record, to_record
from protocols.config import RunConfig
from server.report import write_run_report
from strategies.base import CancelStrategy, RoundFailed


def payload_bytes(content: RecordDict) -> int:
    """Bytes of arrays, configs and metrics in a message (what travels, minus framing).

    Flower 1.41's ``ConfigRecord.count_bytes`` indexes ``v[0]`` of every list and
    raises IndexError on an empty one (SecAgg+ sends empty lists); such a list
    carries only its key, so it is counted as the key's length.
    """
    total = 0
    for rec in content.values():
        if isinstance(rec, ConfigRecord) and any(isinstance(v, list) and not v for v in rec.values()):
            total += sum(len(k) for k, v in rec.items() if isinstance(v, list) and not v)
            rec = ConfigRecord({k: v for k, v in rec.items() if not (isinstance(v, list) and not v)})
        total += rec.count_bytes()
    return total


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


def run_federation(strategy: CancelStrategy, grid: Grid, cfg: RunConfig,
                   progress: Callable[[str], None] = print) -> dict:
    """Run all rounds, write outputs to ``cfg.out_dir`` and return the summary dict."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ds = dataset_for(cfg)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
    arrays = to_record(get_weights(model), strategy.wire_dtype)
    mgrid = MeteredGrid(grid)
    strategy.summary()
    metrics_path = out / "metrics.jsonl"
    metrics_path.write_text("")
    t_start = time.perf_counter()
    rounds: list[dict] = []
    failures: list[str] = []
    for rnd in range(1, cfg.num_rounds + 1):
        mgrid.reset()
        t0 = time.perf_counter()
        try:
            msgs = strategy.configure_train(rnd, arrays, TrainIns(rnd).to_config(), mgrid)
            replies = mgrid.send_and_receive(msgs, timeout=cfg.round_timeout)
            new_arrays, train_metrics = strategy.aggregate_train(rnd, replies)
        except RoundFailed as err:
            failures.append(str(err))
            progress(f"[round {rnd}/{cfg.num_rounds}] FAILED: {err}")
            new_arrays, train_metrics = None, None
        wall = time.perf_counter() - t0
        if new_arrays is not None:
            arrays = new_arrays
        set_weights(model, from_record(arrays))
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
            "round_time_s": wall,
            "bytes_sent_per_client": sum(mgrid.sent.values()) / n_sent,
            "bytes_received_per_client": sum(mgrid.received.values()) / max(len(mgrid.received), 1),
            "clients": len(mgrid.received),
            "phase_time_s": dict(mgrid.phase_times),
            "failed": new_arrays is None,
            **strategy.round_report(),
        }
        if train_metrics is not None and "train_loss" in train_metrics:
            row["train_loss"] = float(train_metrics["train_loss"])
        rounds.append(row)
        with metrics_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        eps = row["epsilon"]
        progress(f"[round {rnd}/{cfg.num_rounds}] method={cfg.method} acc={acc:.4f} loss={loss:.4f} "
                 f"eps={'inf' if eps is None else f'{eps:.3f}'} time={wall:.2f}s clients={row['clients']}"
                 + "".join(f" {k}={v:.3g}" for k, v in strategy.round_report().items()))
    total = time.perf_counter() - t_start
    final_w = from_record(arrays)
    save_npz_model(out / "model.npz", final_w, {
        "model": cfg.model, "input_shape": list(ds.input_shape), "num_classes": ds.num_classes,
        "hidden": list(cfg.hidden_sizes), "dataset": cfg.dataset,
    })
    last = rounds[-1]
    summary = {
        "config": cfg.to_mapping(),
        "method": cfg.method,
        "method_parameters": strategy.describe(),
        "final_accuracy": last["test_accuracy"],
        "final_loss": last["test_loss"],
        "epsilon": last["epsilon"],
        "epsilon_uplink": last["epsilon_uplink"],
        "epsilon_downlink": last["epsilon_downlink"],
        "total_time_s": total,
        "mean_round_time_s": sum(r["round_time_s"] for r in rounds) / len(rounds),
        "failed_rounds": failures,
        "model_file": "model.npz",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_run_report(out, cfg.method)  # report.md + accuracy/epsilon/noise plots (server/report.py)
    progress(f"done: final accuracy {summary['final_accuracy']:.4f}, epsilon "
             f"{'inf' if summary['epsilon'] is None else round(summary['epsilon'], 4)}, "
             f"{total:.1f} s, outputs in {out}")
    return summary
