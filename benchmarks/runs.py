"""One benchmark point = one observed federation, reduced to one row of figures.

Every run goes through the real app in-process (:func:`server.launch.run_inprocess` with an
observed :class:`server.local_grid.LocalGrid`, see :mod:`benchmarks.adversary.observe`).  A method
that refuses a setting (config or calibration error, failed rounds) gets the reason in the
``status`` column instead of stopping the benchmark.

Timing: LocalGrid runs the clients one after the other inside the round, and measures each
ClientApp call.  ``client_s`` is the mean time one client spends per round (all phases),
``server_s`` = round wall time - the sum of all client times (strategy, key relay,
aggregation), and ``deployed_s`` = ``server_s + client_s``, the round latency when clients run
in parallel.  Round 1 of every run is excluded from the time means (module imports, caches);
the first run of a benchmark is preceded by an unrecorded warm-up (:func:`warm_up`).  Bytes
are payload bytes (arrays + configs + metrics) per participating client per round, downlink
(server -> client, all phases) and uplink.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import method_config, reference


@dataclass
class RunResult:
    """Figures of one federation run (one row of a table)."""

    name: str
    method: str
    epsilon: float
    clients: int
    status: str = "ok"
    final_accuracy: float = math.nan
    epsilon_reported: float | None = math.nan
    epsilon_uplink: float | None = math.nan
    epsilon_downlink: float | None = math.nan
    round_s: float = math.nan
    client_s: float = math.nan
    server_s: float = math.nan
    deployed_s: float = math.nan
    bytes_down: float = math.nan
    bytes_up: float = math.nan
    total_s: float = math.nan
    rounds: int = 0
    extra: dict = field(default_factory=dict)

    def as_row(self) -> dict:
        """Flat dict for the tables."""
        row = {k: v for k, v in self.__dict__.items() if k != "extra"}
        row["bytes_per_client_round"] = self.bytes_down + self.bytes_up
        row.update(self.extra)
        return row


def short_error(err: BaseException | str) -> str:
    """First line of an error, at most 160 characters (for a table's ``status`` cell)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:160]


def point_config(name: str, epsilon: float, clients: int, base: dict, method_sets: dict[str, dict],
                 out_dir: Path) -> tuple[str, dict]:
    """(method, run-config) of one benchmark point: common base, method/variant defaults, per-method sets."""
    method, defaults = method_config(name)
    return method, {**base, **defaults, **method_sets.get(name, {}), "method": method, "epsilon": float(epsilon),
                    "num-clients": int(clients), "out-dir": str(out_dir)}


def run_point(name: str, epsilon: float, clients: int, base: dict, method_sets: dict[str, dict], out_dir: Path,
              *, hooks: Sequence = ()) -> RunResult:
    """One federation; never raises (refusals and failures end up in ``status``)."""
    from benchmarks.adversary.observe import run_observed
    from protocols.config import ConfigError
    from protocols.wire.ddpsa import ShareReceipt

    method, ov = point_config(name, epsilon, clients, base, method_sets, out_dir)
    res = RunResult(name, method, epsilon, clients)
    side_up: dict[int, float] = {}

    def side_channel(msgs, replies) -> None:
        # Uplink that bypasses the Flower grid: ddpsa pushes shares to its intermediate servers and reports
        # their size in the reply's ShareReceipt; counted per client per round.
        if msgs and msgs[0].metadata.message_type == "train":
            receipts = [ShareReceipt.from_reply(r.content) for r in replies
                        if not r.has_error() and "metrics" in r.content]
            sizes = [float(rc.share_bytes) for rc in receipts if rc is not None]
            if sizes:
                side_up[int(msgs[0].content["config"]["round"])] = float(np.mean(sizes))

    t0 = time.perf_counter()
    try:
        obs = run_observed(ov, hooks=[*hooks, side_channel])
    except (ConfigError, ValueError) as err:
        res.status = f"refused: {short_error(err)}"
        return res
    except Exception as err:  # noqa: BLE001 - the benchmark records any failure and goes on
        res.status = f"error: {type(err).__name__}: {short_error(err)}"
        traceback.print_exc(limit=4, file=sys.stderr)
        return res
    res.total_s = time.perf_counter() - t0
    s, rows = obs.summary, obs.rows
    res.rounds = len(rows)
    res.final_accuracy = s["final_accuracy"]
    # summary.json writes "no guarantee" as null
    res.epsilon_reported, res.epsilon_uplink, res.epsilon_downlink = (
        math.inf if s[k] is None else float(s[k]) for k in ("epsilon", "epsilon_uplink", "epsilon_downlink"))
    failed = s.get("failed_rounds") or []
    if failed:
        res.status = f"failed {len(failed)}/{len(rows)} rounds: {short_error(failed[0])}"
    timed = [r for r in rows if r["round"] > 1 and not r["failed"]] or [r for r in rows if not r["failed"]] or rows
    per_client, server = [], []
    for r in timed:
        t = obs.grid.timings.get(r["round"])
        ct = t.client_time_s if t else 0.0
        per_client.append(t.per_client_s if t else 0.0)
        server.append(max(r["round_time_s"] - ct, 0.0))
    res.round_s = float(np.mean([r["round_time_s"] for r in timed]))
    res.client_s = float(np.mean(per_client))
    res.server_s = float(np.mean(server))
    res.deployed_s = res.client_s + res.server_s
    res.bytes_down = float(np.mean([r["bytes_sent_per_client"] for r in timed]))
    res.bytes_up = float(np.mean([r["bytes_received_per_client"] + side_up.get(r["round"], 0.0) for r in timed]))
    res.extra["peak_rss_mb"] = peak_rss(timed)
    if side_up:
        res.extra["bytes_up_off_grid"] = float(np.mean([side_up.get(r["round"], 0.0) for r in timed]))
    return res


def peak_rss(rows: list[dict]) -> float:
    """Median over ``rows`` of the round's mean client peak RSS (MiB; the ``client_peak_rss_mb`` column), nan if absent."""
    vals = [float(r["client_peak_rss_mb"]) for r in rows if r.get("client_peak_rss_mb") is not None]
    return float(np.median(vals)) if vals else math.nan


def warm_up(base: dict, clients: Iterable[int], out: Path) -> None:
    """An unrecorded 1-round run of the reference arm per client count: loads data and partitions into the caches."""
    for k in sorted(set(clients)):
        run_point(reference(), 1.0, k, {**base, "num-rounds": 1}, {}, out / "_warmup")


def add_ratios(rows: list[dict], *, key: str = "clients") -> None:
    """Client, server and deployed time of each row relative to the reference arm (FedAvg) at the same client count.

    The ratio columns are ``<col>_x_fedavg``.
    """
    name = reference()
    ref = {r[key]: r for r in rows if r["name"] == name and r["status"] == "ok"}
    for r in rows:
        f = ref.get(r[key])
        for col in ("client_s", "server_s", "deployed_s", "round_s"):
            num, den = r.get(col, math.nan), (f or {}).get(col, math.nan)
            r[f"{col}_x_fedavg"] = num / den if f and den and den > 0 and not math.isnan(num) else math.nan
