"""Benchmark: MP_Server + DDP_Client (mpddp) against its ablations MP-CDP (mpcdp) and MP-DP-Naive.

Same data, model, rounds, server learning rate and (epsilon, delta) budget over the whole run for the
three methods; every run goes through ``server.launch.run_inprocess`` (real messages, in-process grid).
DP noise comes from the OS CSPRNG, so each configuration is repeated and reported as mean +- std.

    cancelfl-bench mpddp [OUT_DIR] [--dataset breast-cancer] [--clients 100]
        [--rounds 30] [--lr 0.1] [--hidden 16] [--epsilon 1.0] [--repeats 3] [--methods ...] [--first-rep 0]

Prints a table (accuracy, nominal epsilon, epsilon given R, client_model_distance, round time) and
writes ``runs.csv`` (one line per run), ``results.md`` (table + acceptance lines) and ``results.json``
to OUT_DIR (default ``runs/bench-mpddp``).  The methods are the registry's ``mpddp`` family.

Acceptance: mpddp within 3 accuracy points of mpcdp and far above mpdp-naive.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

from protocols.methods import METHODS as REGISTRY
from protocols.methods.mpddp import ABLATION

HELP = "MP_Server + DDP_Client against its ablations MP-CDP and MP-DP-Naive"

#: The family of the method under test (:data:`protocols.methods.mpddp.ABLATION`), in registration order.
METHODS = tuple(name for name, spec in REGISTRY.items() if spec.family == REGISTRY[ABLATION.method].family)


def one_run(method: str, args: argparse.Namespace, rep: int, out: Path) -> dict:
    """One federation; returns the figures of the table."""
    from server.launch import run_inprocess

    run_dir = out / f"{method}-rep{rep}"
    overrides = {
        "method": method, "dataset": args.dataset, "hidden": args.hidden, "num-clients": args.clients,
        "sample-rate": 1.0, "num-rounds": args.rounds, "mpddp-server-lr": args.lr, "epsilon": args.epsilon,
        "delta": args.delta, "clip": 1.0, "seed": 42 + rep, "cancellation-check": method == ABLATION.method,
        "out-dir": str(run_dir),
    }
    t0 = time.perf_counter()
    summary = run_inprocess(overrides, progress=lambda _s: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ok = [r for r in rows if not r["failed"]]
    res = {
        "method": method, "rep": rep, "dataset": args.dataset, "clients": args.clients, "rounds": args.rounds,
        "accuracy": summary["final_accuracy"],
        "best_accuracy": max(r["test_accuracy"] for r in rows),
        "epsilon": summary["epsilon"] if summary["epsilon"] is not None else float("inf"),
        "epsilon_given_R": rows[-1].get("epsilon_given_R", float("nan")),
        "client_model_distance": statistics.fmean(r["client_model_distance"] for r in ok),
        "round_time_s": summary["mean_round_time_s"],
        "upload_bytes_per_client": statistics.fmean(r["bytes_received_per_client"] for r in ok),
        "download_bytes_per_client": statistics.fmean(r["bytes_sent_per_client"] for r in ok),
        "cancellation_residual_max": max((r.get("cancellation_residual", float("nan")) for r in ok), default=float("nan")),
        "failed_rounds": len(summary["failed_rounds"]),
        "wall_s": time.perf_counter() - t0,
    }
    if method == ABLATION.trusted:
        clipped = [r["clipped_fraction"] for r in ok if "clipped_fraction" in r]
        res["clipped_fraction_mean"] = statistics.fmean(clipped) if clipped else float("nan")
    print(f"  {method:10s} rep {rep}: acc {res['accuracy']:.4f}  eps {res['epsilon']:.3f}  "
          f"eps|R {res['epsilon_given_R']:.3g}  dist {res['client_model_distance']:.2f}  "
          f"round {res['round_time_s']:.2f}s", flush=True)
    return res


def mean_std(values: list[float]) -> str:
    """``mean ± std`` over the repeats (just the value for one repeat)."""
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench mpddp``."""
    parser.add_argument("out", nargs="?", default="runs/bench-mpddp")
    parser.add_argument("--dataset", default="breast-cancer")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", default="16")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--first-rep", type=int, default=0, help="index of the first repeat (seed = 42 + index)")


def run(args: argparse.Namespace) -> int:
    """Every method ``--repeats`` times (interleaved); the table, the acceptance lines and the files."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    print(f"bench-mpddp: {args.dataset}, K = {args.clients} clients per round, {args.rounds} rounds, "
          f"hidden {args.hidden}, xi = {args.lr}, epsilon = {args.epsilon} over the run, delta = {args.delta}")
    reps = range(args.first_rep, args.first_rep + args.repeats)
    results = [one_run(m, args, rep, out) for rep in reps for m in methods]

    with (out / "runs.csv").open("w", newline="") as fh:
        keys = sorted({k for r in results for k in r})
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(results)

    header = ("| method | accuracy | best-round acc | epsilon (nominal) | epsilon given R | client_model_distance "
              "| round time (s) |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    acc: dict[str, float] = {}
    for m in methods:
        rs = [r for r in results if r["method"] == m]
        acc[m] = statistics.fmean(r["accuracy"] for r in rs)
        lines.append(f"| {m} | {mean_std([r['accuracy'] for r in rs])} | {mean_std([r['best_accuracy'] for r in rs])} "
                     f"| {statistics.fmean(r['epsilon'] for r in rs):.3f} "
                     f"| {statistics.fmean(r['epsilon_given_R'] for r in rs):.3g} "
                     f"| {statistics.fmean(r['client_model_distance'] for r in rs):.2f} "
                     f"| {statistics.fmean(r['round_time_s'] for r in rs):.2f} |")
    checks = []
    main, trusted, naive = ABLATION.method, ABLATION.trusted, ABLATION.naive
    if {main, trusted} <= acc.keys():
        gap = 100 * (acc[trusted] - acc[main])
        checks.append(f"{main} vs {trusted}: {gap:+.1f} points (acceptance: <= 3) -> {'PASS' if gap <= 3 else 'FAIL'}")
    if {main, naive} <= acc.keys():
        gain = 100 * (acc[main] - acc[naive])
        checks.append(f"{main} vs {naive}: {gain:+.1f} points (acceptance: far above, >= 10) -> "
                      f"{'PASS' if gain >= 10 else 'FAIL'}")
    residual = [r["cancellation_residual_max"] for r in results if r["method"] == main]
    if residual:
        checks.append(f"{main} max cancellation residual: {max(residual):.2e}")
    clipped = [r["clipped_fraction_mean"] for r in results if "clipped_fraction_mean" in r]
    if clipped:
        checks.append(f"{trusted} mean fraction of clipped client gradients: {statistics.fmean(clipped):.2f}")
    table = "\n".join(lines)
    print("\n" + table + "\n\n" + "\n".join(checks))
    (out / "results.md").write_text(
        f"# bench-mpddp\n\n{args.dataset}, K = {args.clients}, {args.rounds} rounds, hidden {args.hidden}, "
        f"xi = {args.lr}, epsilon = {args.epsilon} over the run (RDP, no amplification), delta = {args.delta}, "
        f"{args.repeats} repeats (mean ± std).\n\n{table}\n\n" + "\n".join(f"- {c}" for c in checks) + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": results, "checks": checks}, indent=2))
    return 0
