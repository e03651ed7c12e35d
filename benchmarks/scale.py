"""Per-client and server cost of one round as the number of simulated clients grows.

    cancelfl-bench scale [--methods fedavg,nadp,mpddp] [--clients 100,300,1000] ...

One round (key phase included) per method and client count, sparse pairing by default
(nadp 8-out, mpddp 80-out); writes ``scale.csv``, ``scale.md`` and ``scale.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.runs import run_point, warm_up
from protocols.wire.keys import PeerKeys

HELP = "per-client cost at growing client counts"

COLUMNS = ("name", "clients", "status", "client_s", "server_s", "deployed_s", "bytes_down", "bytes_up",
           "bytes_per_client_round", "neighbours", "total_s")


def _degree(config) -> int:
    """Neighbours a train message names (0 for methods without a key phase)."""
    try:
        return len(PeerKeys.from_config(config).peer_ids)
    except (KeyError, ValueError):
        return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench scale``."""
    common.add_federation_arguments(p, dataset="digits", train_subset=0, test_subset=0, rounds=1, hidden="16",
                             out="runs/bench/scale", methods="fedavg,nadp,mpddp", local_epochs=1, batch_size=100000)
    p.set_defaults(method_set=common.SPARSE_PAIRING)
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--clients", default="100,300,1000")


def run(args: argparse.Namespace) -> int:
    """Per-client time and bytes as the number of simulated clients grows."""
    from tqdm import tqdm

    out, notes, methods, msets = common.plan(args)
    base = common.common_base(args)
    clients = [int(k) for k in args.clients.split(",")]
    t0 = time.perf_counter()
    warm_up(base, clients, out)
    rows = []
    todo = [(m, k) for k in clients for m in methods]
    for m, k in tqdm(todo, desc="scale", unit="run", dynamic_ncols=True):
        degree: dict[str, float] = {}

        def hook(msgs, _replies, degree=degree) -> None:
            if msgs and msgs[0].metadata.message_type == "train":
                deg = [_degree(m.content["config"]) for m in msgs if "config" in m.content]
                degree["mean"] = float(np.mean(deg)) if deg else 0.0

        r = run_point(m, args.epsilon, k, base, msets, out / "runs" / f"{m}-k{k}", hooks=[hook])
        row = r.as_row()
        row["neighbours"] = degree.get("mean", math.nan)
        rows.append(row)
        tqdm.write(f"{m:>10} K={k:<5} client={common.fmt(r.client_s)}s server={common.fmt(r.server_s)}s "
                   f"bytes/client={common.fmt(r.bytes_down + r.bytes_up)} neighbours={common.fmt(row['neighbours'])} {r.status}")
    total = time.perf_counter() - t0
    notes.append(f"total time {total:.0f} s")
    plot(rows, out / "scale.png")
    common.publish(rows, COLUMNS, args, "scale", title="Per-client cost vs number of clients", notes=notes, total=total)
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Per-client time and bytes against the number of clients (log-log)."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = sorted((r["clients"], r["client_s"], r["server_s"], r["bytes_per_client_round"]) for r in rows
                     if r["name"] == name and r["status"].startswith("ok"))
        if not pts:
            continue
        k, c, s, b = zip(*pts, strict=True)
        axes[0].plot(k, c, marker="o", label=name)
        axes[1].plot(k, s, marker="o", label=name)
        axes[2].plot(k, b, marker="o", label=name)
    for ax, title in zip(axes, ("one client, s/round", "server, s/round", "bytes per client per round"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    common.save_figure(fig, path)
