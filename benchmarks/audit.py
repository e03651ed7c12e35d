"""Claimed vs audited epsilon of every audited method and view (:mod:`server.audit`).

    cancelfl-bench audit [--methods ldp,cdp,nadp,niss,ladp,mpddp,mpdp-naive,mpcdp,ddpsa] [--epsilons 1,4] [--trials N]
                         [--colluders 1,2] [--out DIR]

Each row runs ``cancelfl audit``: one-round releases of the method's real strategy and client handlers on
white-box gradient canaries, the empirical lower bound ``epsilon_lb`` (95 %, Clopper-Pearson) beside the
one-round epsilon the run's accountant claims for that view (``inf`` = no guarantee claimed; ``delta`` 0 where
the ledger certifies it as pure DP).  A row with ``epsilon_lb > claimed`` is audited again afresh and is a
violation (exit status 1) when that audit exceeds the claim too (:func:`_row`).
``--colluders`` adds upload rows of the methods whose adapter allows colluders (nadp, niss) with that many of the
3 peers handing the server their pair material: within the colluders the claim covers
(:meth:`~server.audit_adapter.AuditAdapter.tolerated_colluders`; niss: ``floor(niss-rho x 3)``, nadp: none) a
bound above the claim is a violation, beyond them it is marked ``outside claim`` (the degradation).  Writes
``audit.md``/``audit.csv``, ``audit.json`` and the plot ``audit.png`` into ``--out``.  Trials and federation per
method: :func:`server.audit_spec.federation` (ladp's model view: 2 clients; the MP family: an MLP canary, one
counted canary per release); ``--trials`` overrides the trials of every row but the self-tests that fix their own.
A method audited with further canaries (:attr:`~server.audit_adapter.AuditAdapter.canaries`) gets their rows too
(ladp: adaptive canaries, 16 clients per release).  Each method's adapter names its self-test rows
(:attr:`server.audit_adapter.AuditAdapter.self_tests`, :class:`server.audit_faults.SelfTest`), each in the view
whose claim its fault breaks: ``halve-noise`` of every method (the uploads of ldp, nadp, niss, ladp and ddpsa; the
model of cdp and, from epsilon 4 on, of the MP family), nadp's ``skip-pair-noise`` (one client without its pair
noise) and ladp's ``private-kl`` (the paper's data-dependent P_j, adaptive canaries); those must be flagged; and
its variant rows
(:attr:`~server.audit_adapter.AuditAdapter.variants`: ddpsa's first of 100 rounds under ``ddpsa-composition =
"pld"``, an (epsilon, delta) claim); and for the MP family a ``given secret`` model row (the published first layer
read with the release's R, every canary counted).  ddpsa's rows start local intermediate servers.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from benchmarks.common import publish, pyplot, save_figure
from protocols.privacy.audit import gaussian_ceiling
from server.audit import run_audit
from server.audit_spec import DIRECTIONS, AuditSpec, audit_adapter, auditable_methods, federation

HELP = "claimed vs empirically audited epsilon of every method and view (planted-fault self-test included)"

COLUMNS = ("method", "direction", "canary", "variant", "fault", "colluders", "epsilon", "claim", "claimed", "delta",
           "epsilon_lb",
           "epsilon_ub", "point", "ceiling", "ratio", "tp", "fp", "trials", "seconds", "cpu_s", "confirmed_lb", "verdict")
#: ``cancelfl-bench reproduce``: a row is its method, view, canary, variant, fault, colluders and epsilon; the claim
#: is exact, the bound a random figure (its 95 % interval is wide), the verdict must not change.
KEY = ("method", "direction", "canary", "variant", "fault", "colluders", "epsilon")
FIGURES = {"claimed": 1e-6, "epsilon_lb": 0.5, "verdict": 0.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench audit``."""
    p.add_argument("--methods", default=",".join(auditable_methods()))
    p.add_argument("--directions", default=",".join(DIRECTIONS))
    p.add_argument("--epsilons", default="1,4")
    p.add_argument("--trials", type=int, default=None, help="canaries per row (default: per method, audit_spec.federation)")
    p.add_argument("--colluders", default="1,2", help="nadp upload rows with these numbers of colluding peers ('' = none)")
    p.add_argument("--seed", type=int, default=None, help="canary labels (default: fresh)")
    p.add_argument("--jobs", type=int, default=1, help="audits run at once (each row is one audit, in its own process)")
    p.add_argument("--out", default="runs/bench/audit")


def _row(spec: AuditSpec, seed: int | None, variant: str = "") -> dict:
    """One audit; a row without a planted fault whose bound exceeds a claim covering it is audited again, afresh.

    The verdict is ``VIOLATION`` only when the confirming audit (fresh labels and noise; ``seed + 1`` when seeded)
    exceeds the claim too, else ``ok``: each audit alone errs with probability at most 5 % on a claim that holds,
    and a table of dozens of rows, some near their claim, would show such a chance hit; both audits err with
    probability at most 0.25 %.  The row reports the first audit; ``confirmed_lb`` the second's bound.
    """
    rep = run_audit(spec, seed=seed)
    b = rep.bound
    claimed = rep.claimed_epsilon
    confirmed_lb = None
    if spec.fault:
        verdict = "fault caught" if rep.exceeds_claim else "FAULT MISSED"
    elif math.isinf(claimed):
        verdict = "no claim"
    elif not rep.exceeds_claim:
        verdict = "ok"
    elif rep.violation:
        print(rep.line() + "  (confirming with a fresh audit)", flush=True)
        again = run_audit(spec, seed=None if seed is None else seed + 1)
        confirmed_lb = again.bound.epsilon_lb
        verdict = "VIOLATION" if again.violation else "ok"
    else:  # beyond the colluders or the secret the claim covers (the degradation), or a nominal claim exceeded
        verdict = "outside claim" if not rep.covered else "nominal exceeded"
    print(rep.line(), flush=True)
    return {"method": spec.method, "direction": spec.direction, "canary": rep.canary, "variant": variant,
            "fault": spec.fault or "", "colluders": spec.colluders, "epsilon": spec.epsilon,
            "claim": rep.claim_view, "claimed": claimed, "delta": rep.delta, "epsilon_lb": b.epsilon_lb,
            "epsilon_ub": b.epsilon_ub, "point": b.epsilon_point,
            "ceiling": gaussian_ceiling(claimed, rep.delta, b.trials, spec.alpha)
            if math.isfinite(claimed) and claimed > 0 and rep.delta > 0 else None,
            "ratio": b.epsilon_lb / claimed if math.isfinite(claimed) and claimed > 0 else None,
            "tp": b.true_positives, "fp": b.false_positives, "trials": b.trials, "seconds": round(rep.seconds, 1),
            "cpu_s": round(rep.cpu_seconds, 1), "confirmed_lb": confirmed_lb,
            "verdict": verdict, "report": rep.as_dict()}


def _job(job: tuple[AuditSpec, str, int | None]) -> dict:
    spec, variant, seed = job
    return _row(spec, seed, variant)


def _run_rows(jobs: list[tuple[AuditSpec, str]], seed: int | None, workers: int) -> list[dict]:
    """The rows of ``jobs`` in order; ``workers`` > 1 runs that many audits at once (fresh processes)."""
    if workers <= 1:
        return [_row(spec, seed, variant) for spec, variant in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_job, [(spec, variant, seed) for spec, variant in jobs]))


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['method']} {r['direction']}" + (f" c={r['colluders']}" if r["colluders"] else "")
              + (f" {r['fault']}" if r["fault"] else "") + (f" {r['variant']}" if r["variant"] else "")
              + f" e={r['epsilon']:g}"
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
    jobs: list[tuple[AuditSpec, str]] = []

    def spec(method: str, direction: str, eps: float, trials: int | None = None, given_secret: bool = False,
             canary: str | None = None, fault: str | None = None, **kw) -> AuditSpec:
        fed = federation(method, direction, canary, given_secret=given_secret, fault=fault)
        return AuditSpec(method, direction, eps, trials or args.trials or fed["trials"], canary=canary, fault=fault,
                         clients=fed["clients"], per_client=fed["per_client"], given_secret=given_secret, **kw)

    for eps in epsilons:
        for method in methods:
            adapter = audit_adapter(method)
            for direction in directions:
                jobs.append((spec(method, direction, eps), ""))
                for canary in adapter.canaries[1:]:  # the method's further canaries (ladp: adaptive)
                    jobs.append((spec(method, direction, eps, canary=canary), ""))
            for c in colluders if adapter.colluders and "upload" in directions else ():
                jobs.append((spec(method, "upload", eps, colluders=c), ""))
            for t in adapter.self_tests:  # the method's planted faults: each row must be flagged
                if t.view in directions and eps >= t.min_epsilon:
                    jobs.append((spec(method, t.view, eps, t.trials, fault=t.fault), ""))
            if "upload" not in directions:
                continue
            for label, rounds, settings, trials in adapter.variants:  # another schedule or accounting of the method
                jobs.append((spec(method, "upload", eps, trials, rounds=rounds, settings=tuple(settings.items())),
                             label))
    rows = _run_rows(jobs, args.seed, args.jobs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps([r["report"] for r in rows], indent=2) + "\n")
    _plot(rows, out / "audit.png")
    notes = ["claimed: the run's own one-round epsilon for the view (accountant after one round at epsilon); inf = "
             "no guarantee claimed in that view (cdp uploads are un-noised: the server is trusted); claim: the view "
             "the figure is the run's epsilon of (uploads, published model, or niss's uploads with no colluding "
             "neighbour, its second upload figure)",
             "epsilon_lb: 95 % lower bound (one-sided Clopper-Pearson on the odds of hits tp against misses fp, less "
             "the hits delta may add; statistic and threshold fitted on every fourth release, trials = the other "
             "releases' canaries; protocols.privacy.audit); epsilon_ub: the upper end of the odds' interval; "
             "ratio = epsilon_lb / claimed",
             "confirmed_lb: a row whose epsilon_lb exceeds a claim covering it (no planted fault) is audited again "
             "with fresh labels and noise; VIOLATION when that bound exceeds the claim too, else ok (each audit "
             "alone errs with probability <= 5 % on a claim that holds, both <= 0.25 %)",
             "seconds: wall time of the row under the machine's load (load average in record.json); cpu_s: its "
             "process time, about its wall time on an idle core",
             "adjacency: zero-out record (the run-config default; a canary present or its input zeroed); canaries: "
             "white-box gradient canaries (clipped gradient clip along their own coordinate), 4 clients x 500 per "
             "release (niss: 4 x 1,000)",
             "ladp: gradient canaries through its stock client (record sensitivity from the client's own N_i, the "
             "layer-wise plan, P_j = B in round 1); model view on 2 clients x 1,000 (the mean's noise multiplier is z "
             "sqrt(2), its claim the upload's); adaptive canaries, replace-one (the label also moves the layer's KL "
             "estimate; one trial per client upload, the model view one per release); fault private-kl = the paper's "
             "P_j from the trained local model (a data-dependent noise scale, adaptive canaries), halve-noise on "
             "gradient canaries",
             "ceiling: the epsilon_lb an ideal test reaches with this row's evaluation trials on a Gaussian mechanism "
             "exactly at the claim (protocols.privacy.audit.gaussian_ceiling; none for pure-DP claims): a row far "
             "below it lacks power, or the mechanism leaks less than it claims",
             "MP family (mpddp, mpdp-naive, mpcdp): canary MLP (4 hidden units, zero output layer), the paper's xi "
             "step; the model row reads the published first layer divided by the release's R^(1) (the adversary holds "
             "R; independent canaries, all counted, fitted within each release) with white-box canaries planted in the "
             "clients' per-example computation (g^, Psi, Phi) = (0, 0, 2 clip / rho^2 u); the upload rows "
             "use input canaries (1000 clip); mpdp-naive's mean carries about sqrt(K) times the Gaussian its claim "
             "counts",
             "niss: the real share phase (sealed noise shares relayed by the strategy, distortion s ~ N(1, tau^2)); "
             "upload view: all the uploads together; fault halve-noise: every share and distortion std halved",
             "ddpsa: L1-clipped canaries, real shares pushed to 3 local intermediate servers; the parameter server "
             "reconstructs only the sum, so its upload view is the model's vector; basic composition is a pure "
             "epsilon-DP claim (bound with delta = 0), the 'pld, 100 rounds' variant an (epsilon, delta) claim of the "
             "first of 100 rounds (bound with delta)",
             "delta: the delta of the claim and of the bound (0: the run's accountant certifies a pure-DP claim)",
             "colluders: peers of each audited client handing the server their pair material (nadp: the pair seeds; "
             "niss: the shares exchanged with it and their distortion); the claim covers none for nadp and "
             "floor(niss-rho x 3) = 1 for niss; 'outside claim' marks a bound above the claim beyond that; niss rows "
             "without colluders are checked against the run's epsilon for uploads with no colluding neighbour, "
             "rows with colluders against the claim"]
    publish(rows, COLUMNS, args, "audit", title="Privacy audit: claimed vs audited epsilon", notes=notes,
            total=time.perf_counter() - t0)
    return 1 if any(r["verdict"] in ("VIOLATION", "FAULT MISSED") for r in rows) else 0
