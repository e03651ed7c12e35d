"""Claimed vs audited epsilon of every audited method and view (:mod:`server.audit`).

    cancelfl-bench audit [--methods ldp,cdp,nadp] [--epsilons 1,4] [--trials 300000] [--colluders 1,2]

Each row runs ``cancelfl audit``: one-round releases of the method's real strategy and client handlers on
white-box gradient canaries, the empirical lower bound ``epsilon_lb`` (95 %, Clopper-Pearson) beside the
one-round epsilon the run's accountant claims for that view (``inf`` = no guarantee claimed).  A row with
``epsilon_lb > claimed`` is a violation (exit status 1).  ``--colluders`` adds nadp upload rows with that many
of the 3 peers handing the server their pair material (nadp's epsilon_uplink assumes no colluding client, so
those rows show the degradation, not a violation).  Writes ``audit.md``/``audit.csv``,
``audit.json`` and the plot ``audit.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from benchmarks.common import publish, pyplot, save_figure
from server.audit import AUDITED, DIRECTIONS, AuditSpec, run_audit

HELP = "claimed vs empirically audited epsilon of every method and view (planted-fault self-test included)"

COLUMNS = ("method", "direction", "colluders", "epsilon", "claimed", "epsilon_lb", "epsilon_ub", "point", "ratio",
           "tp", "fp", "trials", "seconds", "verdict")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench audit``."""
    p.add_argument("--methods", default=",".join(AUDITED))
    p.add_argument("--directions", default=",".join(DIRECTIONS))
    p.add_argument("--epsilons", default="1,4")
    p.add_argument("--trials", type=int, default=AuditSpec.trials)
    p.add_argument("--colluders", default="1,2", help="nadp upload rows with these numbers of colluding peers ('' = none)")
    p.add_argument("--seed", type=int, default=None, help="canary labels (default: fresh)")
    p.add_argument("--out", default="runs/bench/audit")


def _row(spec: AuditSpec, seed: int | None) -> dict:
    rep = run_audit(spec, seed=seed)
    b = rep.bound
    claimed = rep.claimed_epsilon
    if math.isinf(claimed):
        verdict = "no claim"
    else:
        verdict = "VIOLATION" if rep.violation else "ok"
        if rep.violation and spec.colluders:
            verdict = "outside claim"  # epsilon_uplink assumes no colluding client (protocols.methods)
    print(rep.line(), flush=True)
    return {"method": spec.method, "direction": spec.direction, "colluders": spec.colluders, "epsilon": spec.epsilon,
            "claimed": claimed, "epsilon_lb": b.epsilon_lb, "epsilon_ub": b.epsilon_ub, "point": b.epsilon_point,
            "ratio": b.epsilon_lb / claimed if math.isfinite(claimed) and claimed > 0 else None,
            "tp": b.true_positives, "fp": b.false_positives, "trials": b.trials, "seconds": round(rep.seconds, 1),
            "verdict": verdict, "report": rep.as_dict()}


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['method']} {r['direction']}" + (f" c={r['colluders']}" if r["colluders"] else "") + f" e={r['epsilon']:g}"
              for r in rows]
    xs = range(len(rows))
    cap = max((r["claimed"] for r in rows if math.isfinite(r["claimed"])), default=1.0) * 1.6
    ax.bar([x - 0.2 for x in xs], [min(r["claimed"], cap) for r in rows], 0.4, label="claimed (bar at top: none)",
           color="#9ab")
    ax.bar([x + 0.2 for x in xs], [min(r["epsilon_lb"], cap) for r in rows], 0.4, label="audited lower bound (95 %)",
           color="#d63")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("epsilon (one round)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """Every method x view x epsilon (plus nadp's colluder rows); exit 1 if a claimed guarantee is violated."""
    t0 = time.perf_counter()
    methods = [m for m in args.methods.split(",") if m]
    directions = [d for d in args.directions.split(",") if d]
    epsilons = [float(e) for e in args.epsilons.split(",") if e]
    colluders = [int(c) for c in args.colluders.split(",") if c.strip()]
    rows = []
    for eps in epsilons:
        for method in methods:
            for direction in directions:
                rows.append(_row(AuditSpec(method, direction, eps, args.trials), args.seed))
            if method == "nadp" and "upload" in directions:
                for c in colluders:
                    rows.append(_row(AuditSpec(method, "upload", eps, args.trials, colluders=c), args.seed))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps([r["report"] for r in rows], indent=2) + "\n")
    _plot(rows, out / "audit.png")
    notes = ["claimed: the run's own one-round epsilon for the view (accountant after one round at epsilon); inf = "
             "no guarantee claimed in that view (cdp uploads are un-noised: the server is trusted)",
             "epsilon_lb: 95 % lower bound (Clopper-Pearson on TPR and FPR, threshold fitted on the other half of the "
             "releases); epsilon_ub: the upper end of what this test could show; ratio = epsilon_lb / claimed",
             "adjacency: replace-one record; canaries: white-box gradient canaries (clipped gradient +-clip along "
             "their own coordinate), 4 clients x 500 per release",
             "colluders: peers of each audited client handing the server their pair material; nadp's epsilon_uplink "
             "assumes no colluding client, so 'outside claim' marks a bound above it in those rows (the degradation)"]
    publish(rows, COLUMNS, args, "audit", title="Privacy audit: claimed vs audited epsilon", notes=notes,
            total=time.perf_counter() - t0)
    return 1 if any(r["verdict"] == "VIOLATION" for r in rows) else 0
