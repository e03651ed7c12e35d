"""``cancelfl-bench``: the privacy-utility-cost trade-off of every method, side by side.

    python -m server.benchmark grid      # accuracy / epsilon / time / bytes over methods x epsilon x clients
    python -m server.benchmark attacks   # DLG on one client's upload (uplink), membership inference (downlink)
    python -m server.benchmark overhead  # client / server time per round vs FedAvg, Flower SecAgg+ reference
    python -m server.benchmark scale     # per-client cost at 100 / 300 / 1000 simulated clients
    python -m server.benchmark all       # the four above with their defaults

Every run goes through the real app in-process (:func:`server.launch.run_inprocess`
with an observed :class:`server.local_grid.LocalGrid`, see
:mod:`server.attacks.observe`).  Each command writes ``results.csv``,
``results.md`` (with the exact command that produced it) and PNG plots into
``--out`` and prints the table and the total time.  Methods whose modules are
not installed are skipped with a note; a method that refuses a setting (config
or calibration error, failed rounds) gets the reason in the ``status`` column
instead of stopping the benchmark.

Timing: LocalGrid runs the clients one after the other inside the round, and
measures each ClientApp call.  ``client_s`` is the mean time one client spends
per round (all phases), ``server_s`` = round wall time - the sum of all client
times (strategy, key relay, aggregation), and ``deployed_s`` = ``server_s +
client_s``, the round latency when clients run in parallel.  Round 1 of every
run is excluded from the time means (module imports, caches); the first run of
the process is preceded by an unrecorded warm-up.  Bytes are payload bytes
(arrays + configs + metrics) per participating client per round, downlink
(server -> client, all phases) and uplink.

Threads: torch and BLAS are pinned to one thread (``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``); on a small shared machine multi-threaded kernels
for these tiny models are 10-20x slower.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ALL_METHODS = ("fedavg", "ldp", "cdp", "nadp", "niss", "mpddp", "mpdp-naive", "mpcdp", "ladp", "ddpsa")
MPDDP_FAMILY = ("mpddp", "mpdp-naive", "mpcdp")

#: Run-config each method needs in the benchmark, on top of the common settings (documented in the report).
METHOD_DEFAULTS: dict[str, dict] = {
    # MP_Server + DDP_Client: layer expansion is defined for MLPs only; one gradient per round (FedSGD) with
    # the squared loss and its own server learning rate xi (run-config lr is unused).  With xi = 1 (the default)
    # on the MNIST grid mpddp and mpdp-naive diverge (recovered gradient not finite) and mpcdp stays at 9 %
    # (50 clients, epsilon 8); xi = 0.1, picked from 0.05 / 0.1 / 0.3 / 1 on that grid point, gives 42 / 13 / 56 %.
    "mpddp": {"model": "mlp", "mpddp-server-lr": 0.1},
    "mpdp-naive": {"model": "mlp", "mpddp-server-lr": 0.1},
    "mpcdp": {"model": "mlp", "mpddp-server-lr": 0.1},
}

#: Benchmark-only variants: name -> (method, extra run-config), used when the config key exists.
VARIANTS: dict[str, tuple[str, dict]] = {
    "nadp-record-ldp": ("nadp", {"nadp-variant": "record-ldp"}),
    # nadp on a sparser pairing graph (~8 neighbours instead of ~16): half the pairwise streams per client.
    "nadp-4out": ("nadp", {"graph": "n-out", "n-out": 4}),
}


# ====================================================================== helpers
def setup_process() -> Callable[[], None]:
    """One thread for torch, quiet Flower logs (the progress bar reports instead); returns an undo function."""
    import flwr.common.logger  # noqa: F401 - sets the "flwr" logger's level at import; override it after
    import torch

    threads, level = torch.get_num_threads(), logging.getLogger("flwr").level
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)

    def undo() -> None:
        torch.set_num_threads(threads)
        logging.getLogger("flwr").setLevel(level)

    return undo


def method_available(name: str) -> tuple[bool, str]:
    """Whether the strategy and client modules of a method (or variant) exist yet."""
    from client.methods import TRAIN
    from protocols.config import RunConfig
    from strategies.registry import STRATEGIES

    method, extra = VARIANTS.get(name, (name, {}))
    if method not in STRATEGIES:
        return False, f"unknown method {method!r}"
    for spec in (STRATEGIES[method], TRAIN.get(method, "")):
        module = spec.split(":")[0]
        if module and importlib.util.find_spec(module) is None:
            return False, f"module {module} does not exist yet"
    keys = {RunConfig.key_of(f) for f in RunConfig.__dataclass_fields__}
    missing = [k for k in extra if k not in keys]
    if missing:
        return False, f"run-config key(s) {missing} do not exist"
    return True, ""


def resolve_methods(spec: str, *, notes: list[str]) -> list[str]:
    """``all`` or a comma list -> the available methods; unavailable ones are noted and skipped."""
    names = list(ALL_METHODS) + [v for v in VARIANTS if v not in ALL_METHODS] if spec == "all" else \
        [m.strip() for m in spec.split(",") if m.strip()]
    out = []
    for name in names:
        ok, why = method_available(name)
        if ok:
            out.append(name)
        else:
            note = f"skipped {name}: {why}"
            notes.append(note)
            print(note, file=sys.stderr)
    return out


def parse_sets(items: Sequence[str] | None) -> dict:
    """``key=value`` pairs (TOML values, as Flower's --run-config) -> dict."""
    from server.launch import parse_run_config

    return parse_run_config(" ".join(items)) if items else {}


def parse_method_sets(items: Sequence[str] | None) -> dict[str, dict]:
    """``method:key=value`` pairs -> {method: {key: value}}."""
    out: dict[str, dict] = {}
    for item in items or ():
        method, _, kv = item.partition(":")
        if not kv:
            raise SystemExit(f"--method-set expects method:key=value, got {item!r}")
        out.setdefault(method, {}).update(parse_sets([kv]))
    return out


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}g}"
    return str(v)


def write_table(rows: list[dict], columns: Sequence[str], out: Path, name: str, *, title: str, command: str,
                notes: Iterable[str] = ()) -> str:
    """Write ``<name>.csv`` and ``<name>.md``; returns the Markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{name}.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
    lines = [f"| {' | '.join(columns)} |", f"|{'|'.join('---' for _ in columns)}|"]
    lines += [f"| {' | '.join(_fmt(r.get(c)) for c in columns)} |" for r in rows]
    table = "\n".join(lines)
    md = [f"## {title}", "", f"Command: `{command}`", "", table, ""]
    md += [f"- {n}" for n in notes]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    return table


def command_line() -> str:
    """The command as typed (for the provenance line of every table)."""
    return "python -m server.benchmark " + " ".join(shlex.quote(a) for a in sys.argv[1:])


# ============================================================== one observed run
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


def _short(err: BaseException | str) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:160]


def point_config(name: str, epsilon: float, clients: int, base: dict, method_sets: dict[str, dict],
                 out_dir: Path) -> tuple[str, dict]:
    """(method, run-config) of one benchmark point: common base, method defaults, variant, per-method sets."""
    method, variant_cfg = VARIANTS.get(name, (name, {}))
    return method, {**base, **METHOD_DEFAULTS.get(method, {}), **variant_cfg, **method_sets.get(name, {}),
                    "method": method, "epsilon": float(epsilon), "num-clients": int(clients), "out-dir": str(out_dir)}


def run_point(name: str, epsilon: float, clients: int, base: dict, method_sets: dict[str, dict], out_dir: Path,
              *, hooks: Sequence = ()) -> RunResult:
    """One federation; never raises (refusals and failures end up in ``status``)."""
    from protocols.config import ConfigError
    from server.attacks.observe import run_observed

    method, ov = point_config(name, epsilon, clients, base, method_sets, out_dir)
    res = RunResult(name, method, epsilon, clients)
    side_up: dict[int, float] = {}

    def side_channel(msgs, replies) -> None:
        # Uplink that bypasses the Flower grid: ddpsa pushes shares to its intermediate servers and reports
        # their size as the reply metric ``share_bytes``; counted per client per round.
        if msgs and msgs[0].metadata.message_type == "train":
            sizes = [float(r.content["metrics"]["share_bytes"]) for r in replies
                     if not r.has_error() and "metrics" in r.content and "share_bytes" in r.content["metrics"]]
            if sizes:
                side_up[int(msgs[0].content["config"]["round"])] = float(np.mean(sizes))

    t0 = time.perf_counter()
    try:
        obs = run_observed(ov, hooks=[*hooks, side_channel])
    except (ConfigError, ValueError) as err:
        res.status = f"refused: {_short(err)}"
        return res
    except Exception as err:  # noqa: BLE001 - the benchmark records any failure and goes on
        res.status = f"error: {type(err).__name__}: {_short(err)}"
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
        res.status = f"failed {len(failed)}/{len(rows)} rounds: {_short(failed[0])}"
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
    if side_up:
        res.extra["bytes_up_off_grid"] = float(np.mean([side_up.get(r["round"], 0.0) for r in timed]))
    return res


def simulation_point(name: str, epsilon: float, clients: int, base: dict, method_sets: dict[str, dict],
                     out_dir: Path) -> RunResult:
    """One federation under Flower's simulation runtime (private SuperLink, one ClientApp per message).

    Round time here includes what a real Flower runtime adds per message phase
    (scheduling the ClientApp, moving the messages through the SuperLink), which
    the in-process grid leaves out.  Rounds after the first are timed (the first
    includes Ray's start-up and, for pairwise methods, the session key phase).
    """
    import json

    from server.deploy import run_simulation

    method, ov = point_config(name, epsilon, clients, base, method_sets, out_dir)
    res = RunResult(name, method, epsilon, clients)
    t0 = time.perf_counter()
    try:
        code = run_simulation(ov)
    except Exception as err:  # noqa: BLE001 - the benchmark records any failure and goes on
        res.status = f"error: {type(err).__name__}: {_short(err)}"
        return res
    res.total_s = time.perf_counter() - t0
    metrics = out_dir / "metrics.jsonl"
    if code != 0 or not metrics.exists():
        res.status = f"error: simulation exit code {code}"
        return res
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    res.rounds = len(rows)
    timed = [r for r in rows if r["round"] > 1 and not r["failed"]] or rows
    res.round_s = float(np.median([r["round_time_s"] for r in timed]))
    res.deployed_s = res.round_s
    res.bytes_down = float(np.mean([r["bytes_sent_per_client"] for r in timed]))
    res.bytes_up = float(np.mean([r["bytes_received_per_client"] for r in timed]))
    res.final_accuracy = rows[-1].get("test_accuracy", math.nan)
    res.extra["first_round_s"] = rows[0]["round_time_s"]
    res.extra["phases"] = "+".join(sorted(timed[-1].get("phase_time_s", {})))
    if any(r["failed"] for r in rows):
        res.status = f"failed {sum(r['failed'] for r in rows)}/{len(rows)} rounds"
    return res


def warm_up(base: dict, clients: Iterable[int], out: Path) -> None:
    """An unrecorded 1-round FedAvg per client count: loads data and partitions into the process caches."""
    for k in sorted(set(clients)):
        run_point("fedavg", 1.0, k, {**base, "num-rounds": 1}, {}, out / "_warmup")


def add_ratios(rows: list[dict], *, key: str = "clients") -> None:
    """Client, server and deployed time of each row relative to FedAvg at the same client count."""
    ref = {r[key]: r for r in rows if r["name"] == "fedavg" and r["status"] == "ok"}
    for r in rows:
        f = ref.get(r[key])
        for col in ("client_s", "server_s", "deployed_s", "round_s"):
            num, den = r.get(col, math.nan), (f or {}).get(col, math.nan)
            r[f"{col}_x_fedavg"] = num / den if f and den and den > 0 and not math.isnan(num) else math.nan


# ========================================================================= grid
GRID_COLUMNS = ("name", "epsilon", "clients", "status", "final_accuracy", "epsilon_reported", "epsilon_uplink",
                "epsilon_downlink", "round_s", "client_s", "server_s", "deployed_s", "deployed_s_x_fedavg",
                "bytes_down", "bytes_up", "bytes_per_client_round")


def common_base(args: argparse.Namespace) -> dict:
    """Run-config shared by every run of a command."""
    base = {"dataset": args.dataset, "train-subset": args.train_subset, "test-subset": args.test_subset,
            "num-rounds": args.rounds, "local-epochs": args.local_epochs, "hidden": args.hidden,
            "batch-size": args.batch_size, "lr": args.lr, "seed": args.seed}
    base.update(parse_sets(args.set))
    return base


def cmd_grid(args: argparse.Namespace) -> list[dict]:
    """Methods x epsilon x clients: accuracy, reported epsilon, time, bytes."""
    from tqdm import tqdm

    out = Path(args.out)
    notes: list[str] = []
    methods = resolve_methods(args.methods, notes=notes)
    epsilons = [float(e) for e in args.epsilons.split(",")]
    clients = [int(k) for k in args.clients.split(",")]
    base = common_base(args)
    msets = parse_method_sets(args.method_set)
    points = [(m, e, k) for k in clients for m in methods for e in ([epsilons[0]] if m == "fedavg" else epsilons)]
    t0 = time.perf_counter()
    warm_up(base, clients, out)
    rows = []
    bar = tqdm(points, desc="grid", unit="run", dynamic_ncols=True)
    for m, e, k in bar:
        bar.set_postfix_str(f"{m} eps={e:g} K={k}")
        r = run_point(m, e, k, base, msets, out / "runs" / f"{m}-eps{e:g}-k{k}")
        rows.append(r.as_row())
        tqdm.write(f"{m:>16} eps={e:<5g} K={k:<4} acc={_fmt(r.final_accuracy)} eps_rep={_fmt(r.epsilon_reported)} "
                   f"round={_fmt(r.round_s)}s client={_fmt(r.client_s)}s server={_fmt(r.server_s)}s {r.status}")
    add_ratios(rows)
    total = time.perf_counter() - t0
    notes.append(f"total benchmark time {total:.0f} s ({len(points)} runs + warm-up) on this machine")
    notes.append("fedavg has no epsilon: it is run once per client count and drawn as a dashed line")
    notes.append("bytes_up includes uploads that bypass the Flower grid (ddpsa: secret shares pushed to its "
                 "intermediate servers, from the clients' share_bytes metric)")
    notes.append("epsilon_reported/uplink/downlink as the method reports them after the last round (inf = no "
                 "guarantee); the configured epsilon is a whole-run budget except for ladp (per round, composed "
                 "by the method over the rounds)")
    notes.append("per-method run-config on top of the common settings: " + "; ".join(
        f"{m}: {', '.join(f'{k}={v}' for k, v in c.items())}" for m, c in METHOD_DEFAULTS.items()))
    table = write_table(rows, GRID_COLUMNS, out, "results", title="Privacy-utility-cost grid",
                        command=command_line(), notes=notes)
    plot_grid(rows, out)
    print(table)
    print(f"\nwrote {out}/results.csv, results.md, accuracy_vs_epsilon.png, round_time.png")
    print(f"total time: {total:.1f} s")
    return rows


def plot_grid(rows: list[dict], out: Path) -> None:
    """accuracy_vs_epsilon.png (one panel per client count) and round_time.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = sorted({r["clients"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(1, len(clients), figsize=(6 * len(clients), 4.5), squeeze=False)
    for ax, k in zip(axes[0], clients, strict=True):
        for i, n in enumerate(names):
            pts = sorted((r["epsilon"], r["final_accuracy"]) for r in rows
                         if r["name"] == n and r["clients"] == k and r["status"].startswith(("ok", "failed")))
            if not pts:
                continue
            if n == "fedavg":
                ax.axhline(pts[0][1], ls="--", color="k", label="fedavg (no DP)")
                continue
            ax.plot(*zip(*pts, strict=True), marker="o", label=n, color=plt.cm.tab20(i % 20))
        ax.set_xscale("log")
        eps_ticks = sorted({r["epsilon"] for r in rows if r["name"] != "fedavg"})
        ax.set_xticks(eps_ticks, [f"{e:g}" for e in eps_ticks])
        ax.minorticks_off()
        ax.set_xlabel("epsilon (as configured)")
        ax.set_ylabel("final test accuracy")
        ax.set_title(f"{k} clients")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_epsilon.png", dpi=110)
    plt.close(fig)

    eps_ref = {}
    for r in rows:  # one bar per method and client count: the run at the smallest epsilon
        key = (r["name"], r["clients"])
        if r["status"].startswith(("ok", "failed")) and (key not in eps_ref or r["epsilon"] < eps_ref[key]["epsilon"]):
            eps_ref[key] = r
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(clients), 1)
    x = np.arange(len(names))
    for j, k in enumerate(clients):
        srv = [eps_ref.get((n, k), {}).get("server_s", np.nan) for n in names]
        cli = [eps_ref.get((n, k), {}).get("client_s", np.nan) for n in names]
        rnd = [eps_ref.get((n, k), {}).get("round_s", np.nan) for n in names]
        axes[0].bar(x + j * width, rnd, width, label=f"{k} clients")
        axes[1].bar(x + j * width, srv, width, label=f"server, {k} clients", color=plt.cm.tab20(2 * j))
        axes[1].bar(x + j * width, cli, width, bottom=srv, label=f"one client, {k} clients", color=plt.cm.tab20(2 * j + 1))
    axes[0].set_title("mean round time, in-process (clients sequential)")
    axes[1].set_title("deployed estimate: server + one client (parallel clients)")
    for ax in axes:
        ax.set_xticks(x + width * (len(clients) - 1) / 2, names, rotation=45, ha="right")
        ax.set_ylabel("seconds per round")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "round_time.png", dpi=110)
    plt.close(fig)


# ====================================================================== attacks
ATTACK_COLUMNS = ("name", "epsilon", "clients", "status", "attacker_sees", "label_ok", "grad_cosine",
                  "grad_rel_error", "ssim_best", "mse_best", "best_variant", "ssim_attacker", "mse_attacker",
                  "ssim_mean_image", "reconstructed")
MIA_COLUMNS = ("name", "epsilon", "clients", "status", "final_accuracy", "model_attacked", "mia_received_acc",
               "mia_received_auc", "mia_received_yeom", "mia_final_acc", "mia_final_auc", "member_loss",
               "nonmember_loss", "train_test_gap")


def cmd_attacks(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Uplink DLG per method and downlink membership inference per method."""
    from tqdm import tqdm

    out = Path(args.out)
    notes: list[str] = []
    methods = resolve_methods(args.methods, notes=notes)
    msets = parse_method_sets(args.method_set)
    t0 = time.perf_counter()
    dlg_rows, images = [], {}
    base = {"dataset": args.dataset, "test-subset": args.test_subset, "hidden": args.hidden, "lr": args.lr,
            "seed": args.seed, **parse_sets(args.set)}
    epsilons = [float(e) for e in args.epsilons.split(",")]
    bar = tqdm([(m, e) for e in epsilons for m in methods], desc="DLG (uplink)", unit="run", dynamic_ncols=True)
    for name, eps in bar:
        bar.set_postfix_str(f"{name} eps={eps:g}")
        row, img = dlg_point(name, eps, args.dlg_clients, base, msets, out / "dlg" / f"eps{eps:g}", args)
        dlg_rows.append(row)
        if img is not None:
            images[(name, eps)] = img
        tqdm.write(f"DLG {name:>16} eps={eps:<5g}: ssim_best={_fmt(row.get('ssim_best'))} "
                   f"ssim_attacker={_fmt(row.get('ssim_attacker'))} cos={_fmt(row.get('grad_cosine'))} {row['status']}")
    dlg_notes = notes + [
        "victim = one client holding one sample, batch size 1, one local epoch, round 1 (the DLG/iDLG setting); "
        "every client holds one sample (train-subset = clients)",
        "ssim_best/mse_best: best reconstruction over all L-BFGS starts and variants (dlg-l2, dlg-cosine, analytic; "
        "for mpddp/mpdp-naive also dlg-whitened and analytic-snr, which use the server's knowledge of R, i.e. of "
        "each entry's noise scale) scored against the truth (the defender's worst case); ssim_attacker: the "
        "DLG start the attacker picks (smallest gradient distance)",
        "grad_cosine / grad_rel_error: the inferred gradient against the victim's true gradient "
        "(1 / 0 = the server holds the exact gradient)",
        "ssim_mean_image: SSIM of the dataset's mean image (a guess that uses no upload) = the floor",
        f"reconstructed = ssim_best >= {args.success_ssim}",
    ]
    write_table(dlg_rows, ATTACK_COLUMNS, out, "dlg", title="Uplink: gradient inversion (iDLG, L-BFGS) per method",
                command=command_line(), notes=dlg_notes)
    plot_reconstructions(images, out / "dlg_reconstructions.png")

    mia_rows = []
    mbase = {"dataset": args.dataset, "train-subset": args.mia_train_subset, "test-subset": args.test_subset,
             "num-rounds": args.mia_rounds, "local-epochs": args.mia_local_epochs, "hidden": args.mia_hidden,
             "lr": args.lr, "seed": args.seed, **parse_sets(args.set)}
    bar = tqdm([(m, e) for e in epsilons for m in methods], desc="membership (downlink)", unit="run",
               dynamic_ncols=True)
    for name, eps in bar:
        bar.set_postfix_str(f"{name} eps={eps:g}")
        row = mia_point(name, eps, args.mia_clients, mbase, msets, out / "mia" / f"eps{eps:g}")
        mia_rows.append(row)
        tqdm.write(f"MIA {name:>16} eps={eps:<5g}: acc={_fmt(row.get('final_accuracy'))} "
                   f"mia={_fmt(row.get('mia_received_acc'))} auc={_fmt(row.get('mia_received_auc'))} {row['status']}")
    total = time.perf_counter() - t0
    mia_notes = notes + [
        "loss-threshold attack (Yeom et al.) on the model a client receives in the last round "
        "(mpddp family: the perturbed model the server sends) and on the final global model",
        "balanced: as many members (training samples) as non-members (test samples); 0.5 = guessing; "
        "acc = threshold fitted on one half, scored on the other; yeom = threshold at the mean training loss",
        f"total attack benchmark time {total:.0f} s",
    ]
    write_table(mia_rows, MIA_COLUMNS, out, "membership", title="Downlink: membership inference per method",
                command=command_line(), notes=mia_notes)
    print((out / "dlg.md").read_text())
    print((out / "membership.md").read_text())
    print(f"total time: {total:.1f} s")
    return dlg_rows, mia_rows


def dlg_point(name: str, epsilon: float, clients: int, base: dict, msets: dict, out: Path,
              args: argparse.Namespace) -> tuple[dict, np.ndarray | None]:
    """Capture the victim's round-1 upload of one method and invert it."""
    from client.data import dataset_for
    from protocols.config import ConfigError
    from server.attacks.ssim import ssim
    from server.attacks.uplink import capture_first_round, uplink_attack

    _method, ov = point_config(name, epsilon, clients, base, msets, out / name)
    row: dict = {"name": name, "epsilon": epsilon, "clients": clients, "status": "ok"}
    try:
        cap = capture_first_round(ov)
        res = uplink_attack(cap, restarts=args.dlg_restarts, iterations=args.dlg_iterations, seed=args.seed)
    except (ConfigError, ValueError) as err:
        row["status"] = f"refused: {_short(err)}"
        return row, None
    except Exception as err:  # noqa: BLE001
        row["status"] = f"error: {type(err).__name__}: {_short(err)}"
        traceback.print_exc(limit=4, file=sys.stderr)
        return row, None
    row["attacker_sees"] = res.note
    if res.report is None:
        row["status"] = "no attacker view"
        return row, None
    ds = dataset_for(cap.cfg)
    data_range = float(ds.x_train.max() - ds.x_train.min())
    best, choice = res.report.best, res.report.attacker_choice
    mean_img = ds.x_train.mean(0)
    row.update(label_ok=res.report.label == res.report.label_true, grad_cosine=res.cosine,
               grad_rel_error=res.rel_error, ssim_best=best.ssim, mse_best=best.mse, best_variant=best.variant,
               ssim_attacker=choice.ssim, mse_attacker=choice.mse,
               ssim_mean_image=ssim(mean_img, cap.x, data_range=data_range),
               reconstructed=bool(best.ssim >= args.success_ssim))
    return row, np.stack([cap.x, best.x])


def plot_reconstructions(images: dict[tuple[str, float], np.ndarray], path: Path) -> None:
    """One row per epsilon, one column per method: best reconstruction; the truth in the first column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not images:
        return
    names = list(dict.fromkeys(n for n, _ in images))
    eps = sorted({e for _, e in images})
    fig, axes = plt.subplots(len(eps), len(names) + 1, figsize=(1.3 * (len(names) + 1), 1.5 * len(eps) + 0.4),
                             squeeze=False)
    for i, e in enumerate(eps):
        for j, name in enumerate([None, *names]):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            pair = images.get((name, e)) if name else next((v for (n, ee), v in images.items() if ee == e), None)
            if pair is None:
                ax.axis("off")
                continue
            img = pair[0] if name is None else pair[1]
            ax.imshow(img.reshape(img.shape[-2:]), cmap="gray")
            if i == 0:
                ax.set_title("truth" if name is None else name, fontsize=7)
        axes[i][0].set_ylabel(f"eps={e:g}", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def received_forward(method: str, msg, cfg) -> tuple[Callable, str]:
    """Forward function of the model a client receives in ``msg``, and what it is."""
    from client.data import dataset_for
    from client.models import build_model, set_weights
    from client.wire import from_record

    arrays = from_record(msg.content["arrays"])
    ds = dataset_for(cfg)
    if method in MPDDP_FAMILY:
        from server.attacks.uplink import received_mpddp_forward

        return received_mpddp_forward(arrays, cfg), "perturbed model W-hat sent by the server"
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed).double()
    set_weights(model, arrays)
    model.eval()
    return (lambda t: model(t.double())), "global model sent to clients"


def mia_point(name: str, epsilon: float, clients: int, base: dict, msets: dict, out: Path) -> dict:
    """Train one method in an overfitting-prone setting; attack what clients receive and the final model."""
    import torch

    from client.data import dataset_for
    from client.models import load_npz_model
    from protocols.config import RunConfig
    from server.attacks.membership import loss_threshold_attack, per_sample_loss
    from server.attacks.uplink import training_loss

    method = VARIANTS.get(name, (name, {}))[0]
    last: dict = {}

    def hook(msgs, _replies) -> None:
        if msgs and msgs[0].metadata.message_type == "train":
            last["msg"] = msgs[0]

    res = run_point(name, epsilon, clients, base, msets, out / name, hooks=[hook])
    row = {"name": name, "epsilon": epsilon, "clients": clients, "status": res.status,
           "final_accuracy": res.final_accuracy}
    if not res.status.startswith(("ok", "failed")) or "msg" not in last:
        return row
    cfg = RunConfig.from_mapping(json.loads((out / name / "summary.json").read_text())["config"])
    ds = dataset_for(cfg)
    loss = training_loss(method)
    fwd, what = received_forward(method, last["msg"], cfg)
    row["model_attacked"] = what
    m_loss = per_sample_loss(fwd, ds.x_train, ds.y_train, loss=loss, num_classes=ds.num_classes)
    n_loss = per_sample_loss(fwd, ds.x_test, ds.y_test, loss=loss, num_classes=ds.num_classes)
    r = loss_threshold_attack(m_loss, n_loss, seed=cfg.seed)
    row.update(mia_received_acc=r.accuracy, mia_received_auc=r.auc, mia_received_yeom=r.yeom_accuracy,
               member_loss=r.member_loss, nonmember_loss=r.nonmember_loss)
    final, _ = load_npz_model(out / name / "model.npz")
    final = final.double().eval()
    with torch.no_grad():
        fm = per_sample_loss(lambda t: final(t.double()), ds.x_train, ds.y_train, loss="ce", num_classes=ds.num_classes)
        fn = per_sample_loss(lambda t: final(t.double()), ds.x_test, ds.y_test, loss="ce", num_classes=ds.num_classes)
    rf = loss_threshold_attack(fm, fn, seed=cfg.seed)
    row.update(mia_final_acc=rf.accuracy, mia_final_auc=rf.auc, train_test_gap=rf.nonmember_loss - rf.member_loss)
    return row


# ==================================================================== overhead
OVERHEAD_COLUMNS = ("name", "clients", "status", "client_s", "client_s_x_fedavg", "server_s", "server_s_x_fedavg",
                    "deployed_s", "deployed_s_x_fedavg", "round_s", "round_s_x_fedavg", "bytes_down", "bytes_up",
                    "bytes_per_client_round", "legacy_fedavg_client_s", "legacy_fedavg_server_s", "final_accuracy",
                    "first_round_s", "phases")


def cmd_overhead(args: argparse.Namespace) -> list[dict]:
    """Per-round client/server time and bytes of each method vs FedAvg, plus Flower's SecAgg+."""
    from tqdm import tqdm

    out = Path(args.out)
    notes: list[str] = []
    methods = resolve_methods(args.methods, notes=notes)
    if "fedavg" not in methods:
        methods.insert(0, "fedavg")
    base = common_base(args)
    msets = parse_method_sets(args.method_set)
    clients = [int(k) for k in args.clients.split(",")]
    t0 = time.perf_counter()
    simulation = args.engine == "simulation"
    if not simulation:
        warm_up(base, clients, out)
    repeats = max(1, args.repeats)
    # Repeats are interleaved (fedavg, nadp, mpddp, fedavg, ...) so a slow spell of a shared machine hits
    # every method; each ratio is taken against FedAvg of the same repeat, then the median is reported.
    todo = [(rep, m, k) for rep in range(repeats) for k in clients for m in methods]
    raw: list[dict] = []
    point = simulation_point if simulation else run_point
    bar = tqdm(todo, desc="overhead", unit="run", dynamic_ncols=True)
    for rep, m, k in bar:
        bar.set_postfix_str(f"{m} K={k}" + (f" repeat {rep + 1}/{repeats}" if repeats > 1 else ""))
        r = point(m, args.epsilon, k, base, msets, out / "runs" / (f"{m}-k{k}" + (f"-r{rep}" if repeats > 1 else "")))
        raw.append({**r.as_row(), "repeat": rep})
        tqdm.write(f"{m:>16} K={k:<4} client={_fmt(r.client_s)}s server={_fmt(r.server_s)}s round={_fmt(r.round_s)}s "
                   f"bytes={_fmt(r.bytes_down + r.bytes_up)} {r.status}")
    for rep in range(repeats):
        add_ratios([r for r in raw if r["repeat"] == rep])
    rows = median_over_repeats(raw)
    if repeats > 1:
        write_table(raw, ("repeat", *OVERHEAD_COLUMNS), out, "overhead_repeats", title="Overhead, every repeat",
                    command=command_line(), notes=[])
    if not args.no_secagg and not simulation:  # SecAgg+ runs through the legacy API on the in-process grid only
        for k in clients:
            for shares in _secagg_share_counts(args.secagg_shares, k):
                try:
                    rows.append(secaggplus_reference(base, k, shares, args.secagg_threshold, args.secagg_rounds))
                except Exception as err:  # noqa: BLE001 - reported in the table, not fatal
                    traceback.print_exc(limit=6, file=sys.stderr)
                    rows.append({"name": f"secagg+ (shares={shares})", "clients": k,
                                 "status": f"error: {type(err).__name__}: {_short(err)}"})
                tqdm.write(f"{rows[-1]['name']:>16} K={k:<4} client={_fmt(rows[-1].get('client_s'))}s "
                           f"server={_fmt(rows[-1].get('server_s'))}s {rows[-1]['status']}")
    # The method rows hold medians of per-repeat ratios; SecAgg+ rows are compared with FedAvg's median row.
    add_ratios([r for r in rows if r["name"] == "fedavg" or str(r["name"]).startswith("secagg+")])
    total = time.perf_counter() - t0
    if repeats > 1:
        notes.append(f"{repeats} interleaved repeats per method: every figure is the median over the repeats, "
                     "*_x_fedavg the median of the per-repeat ratios to FedAvg (all repeats: overhead_repeats.md)")
    if simulation:
        notes.append("engine = simulation: round_s is the median wall time of rounds 2.. under Flower's simulation "
                     "runtime (private SuperLink, a ClientApp per message); client_s/server_s are not measured there")
    notes += [
        "client_s: mean ClientApp time of one client per round (all phases); server_s: round wall time minus the "
        "sum of client times; deployed_s = server_s + client_s (clients in parallel); *_x_fedavg: ratio to "
        "FedAvg at the same client count in this run",
        "secagg+: Flower's SecAggPlusWorkflow (legacy DefaultWorkflow) with secaggplus_mod on a legacy NumPyClient "
        "that trains the same model on the same data, driven through the same in-process LocalGrid; "
        "'secagg+ fedavg' is the same legacy app without SecAgg+ (its own baseline)",
        f"total time {total:.0f} s",
    ]
    table = write_table(rows, OVERHEAD_COLUMNS, out, "overhead", title="Overhead per round vs FedAvg",
                        command=command_line(), notes=notes)
    plot_overhead(rows, out / "overhead.png")
    print(table)
    print(f"total time: {total:.1f} s")
    return rows


def median_over_repeats(raw: list[dict]) -> list[dict]:
    """One row per (name, clients): the median of every numeric column over the repeats (first-seen order)."""
    groups: dict[tuple, list[dict]] = {}
    for r in raw:
        groups.setdefault((r["name"], r["clients"]), []).append(r)
    rows = []
    for group in groups.values():
        row = {k: v for k, v in group[0].items() if k != "repeat"}
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "clients":
                vals = [float(g[key]) for g in group if isinstance(g.get(key), (int, float)) and not math.isnan(g[key])]
                row[key] = float(np.median(vals)) if vals else math.nan
        bad = [g["status"] for g in group if g["status"] != "ok"]
        row["status"] = bad[0] if bad else "ok"
        rows.append(row)
    return rows


def _secagg_share_counts(spec: str, k: int) -> list[int]:
    """SecAgg+ ``num_shares`` values for ``k`` clients ('all' = k); an even value below k is made odd.

    Flower 1.41's workflow sends an even ``num_shares`` to the clients *before* bumping it to the next odd
    number for its neighbour graph, so the clients create one share too few and fail (IndexError).
    """
    out = []
    for s in spec.split(","):
        s = s.strip()
        n = min(k if s in ("all", "k", "K") else int(s), k)
        if n < k and n % 2 == 0:
            n += 1
        out.append(n)
    return list(dict.fromkeys(out))


def secaggplus_reference(base: dict, clients: int, num_shares: int, threshold: float, rounds: int = 1) -> dict:
    """Flower's SecAgg+ on the same model/data, in-process; figures for the legacy app with and without it."""
    from flwr.app import Context, RecordDict
    from flwr.client import ClientApp as LegacyClientApp
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from client.data import client_partition, dataset_for
    from client.models import build_model, get_weights, set_weights
    from client.training import train
    from protocols.config import RunConfig
    from server.attacks.observe import ObservedLocalGrid
    from server.defaults import app_defaults
    from server.local_grid import SERVER_NODE_ID
    from server.runner import payload_bytes

    raw = {**app_defaults(), **base, "num-clients": clients, "method": "fedavg"}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    w0 = get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed))
    keys = list(w0)

    class BenchClient(NumPyClient):
        """Trains like the cancelfl FedAvg client: same model, partition, SGD settings (seeded per partition)."""

        def __init__(self, pid: int) -> None:
            self.pid = pid

        def fit(self, parameters, config):
            x, y = client_partition(cfg, self.pid, clients)
            model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
            set_weights(model, dict(zip(keys, parameters, strict=True)))
            train(model, x, y, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed + self.pid)
            return [v.astype(np.float32) for v in get_weights(model).values()], len(y), {}

    def client_fn(context: Context):
        return BenchClient(int(context.node_config["partition-id"])).to_client()

    results = {}
    for label, secure in (("secagg+ fedavg", False), (f"secagg+ (shares={num_shares})", True)):
        app = LegacyClientApp(client_fn=client_fn, mods=[secaggplus_mod] if secure else [])
        grid = ObservedLocalGrid(app, clients, raw)
        grid.isolate_messages = True
        sent, recv = {}, {}

        def hook(msgs, replies, sent=sent, recv=recv) -> None:
            for m in msgs:
                sent[m.metadata.dst_node_id] = sent.get(m.metadata.dst_node_id, 0) + payload_bytes(m.content)
            for r in replies:
                if not r.has_error():
                    recv[r.metadata.src_node_id] = recv.get(r.metadata.src_node_id, 0) + payload_bytes(r.content)

        grid.hooks = [hook]
        strategy = LegacyFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients,
                                min_available_clients=clients,
                                initial_parameters=ndarrays_to_parameters([v.astype(np.float32) for v in w0.values()]))
        ctx = LegacyContext(Context(run_id=1, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=rounds), strategy=strategy)
        per_round = []
        fit = SecAggPlusWorkflow(num_shares=num_shares, reconstruction_threshold=threshold) if secure else None

        def timed_fit(g, c, fit=fit, per_round=per_round, grid=grid, sent=sent, recv=recv) -> None:
            from flwr.server.workflow.default_workflows import default_fit_workflow

            before = sum(grid.client_time.values())
            sent.clear()
            recv.clear()
            t = time.perf_counter()
            (fit or default_fit_workflow)(g, c)
            wall = time.perf_counter() - t
            ct = sum(grid.client_time.values()) - before
            per_round.append((wall, ct, sum(sent.values()) / clients, sum(recv.values()) / clients))

        from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

        DefaultWorkflow(fit_workflow=timed_fit)(grid, ctx)
        final = [a.numpy() for a in ctx.state.array_records[MAIN_PARAMS_RECORD].values()]
        if all(np.array_equal(f, np.asarray(v, dtype=np.float32)) for f, v in zip(final, w0.values(), strict=True)):
            raise RuntimeError(f"{label}: the workflow halted without aggregating (see Flower's log above)")
        timed = per_round[1:] or per_round
        wall, ct, bdown, bup = (float(np.mean([p[i] for p in timed])) for i in range(4))
        results[label] = {"name": label, "clients": clients, "status": "ok", "round_s": wall,
                          "client_s": ct / clients, "server_s": max(wall - ct, 0.0),
                          "deployed_s": max(wall - ct, 0.0) + ct / clients, "bytes_down": bdown, "bytes_up": bup,
                          "bytes_per_client_round": bdown + bup, "final_accuracy": math.nan}
    secure_row = results[f"secagg+ (shares={num_shares})"]
    plain = results["secagg+ fedavg"]
    for col in ("client_s", "server_s", "deployed_s"):
        secure_row[f"{col}_x_legacy"] = secure_row[col] / plain[col] if plain[col] > 0 else math.nan
    return secure_row | {"legacy_fedavg_client_s": plain["client_s"], "legacy_fedavg_server_s": plain["server_s"]}


def plot_overhead(rows: list[dict], path: Path) -> None:
    """Per-client and server time per round for each method (grouped by client count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status", "").startswith("ok")]
    if not ok:
        return
    labels = [f"{r['name']}\nK={r['clients']}" for r in ok]
    x = np.arange(len(ok))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok)), 4.5))
    if all(math.isnan(float(r.get("client_s", math.nan))) for r in ok):  # simulation engine: round time only
        ax.bar(x, [r["round_s"] for r in ok], 0.5, label="round wall time (Flower simulation runtime)")
    else:
        ax.bar(x - 0.2, [r["client_s"] for r in ok], 0.4, label="one client per round")
        ax.bar(x + 0.2, [r["server_s"] for r in ok], 0.4, label="server per round")
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ======================================================================= scale
SCALE_COLUMNS = ("name", "clients", "status", "client_s", "server_s", "deployed_s", "bytes_down", "bytes_up",
                 "bytes_per_client_round", "neighbours", "total_s")


def cmd_scale(args: argparse.Namespace) -> list[dict]:
    """Per-client time and bytes as the number of simulated clients grows."""
    from tqdm import tqdm

    out = Path(args.out)
    notes: list[str] = []
    methods = resolve_methods(args.methods, notes=notes)
    base = common_base(args)
    msets = parse_method_sets(args.method_set)
    clients = [int(k) for k in args.clients.split(",")]
    t0 = time.perf_counter()
    warm_up(base, clients, out)
    rows = []
    todo = [(m, k) for k in clients for m in methods]
    for m, k in tqdm(todo, desc="scale", unit="run", dynamic_ncols=True):
        degree: dict[str, float] = {}

        def hook(msgs, _replies, degree=degree) -> None:
            if msgs and msgs[0].metadata.message_type == "train":
                deg = [len(list(m.content["config"].get("peer-ids", []))) for m in msgs if "config" in m.content]
                degree["mean"] = float(np.mean(deg)) if deg else 0.0

        r = run_point(m, args.epsilon, k, base, msets, out / "runs" / f"{m}-k{k}", hooks=[hook])
        row = r.as_row()
        row["neighbours"] = degree.get("mean", math.nan)
        rows.append(row)
        tqdm.write(f"{m:>10} K={k:<5} client={_fmt(r.client_s)}s server={_fmt(r.server_s)}s "
                   f"bytes/client={_fmt(r.bytes_down + r.bytes_up)} neighbours={_fmt(row['neighbours'])} {r.status}")
    total = time.perf_counter() - t0
    notes.append(f"total time {total:.0f} s")
    table = write_table(rows, SCALE_COLUMNS, out, "scale", title="Per-client cost vs number of clients",
                        command=command_line(), notes=notes)
    plot_scale(rows, out / "scale.png")
    print(table)
    print(f"total time: {total:.1f} s")
    return rows


def plot_scale(rows: list[dict], path: Path) -> None:
    """Per-client time and bytes against the number of clients (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ========================================================================= CLI
def _common(p: argparse.ArgumentParser, *, dataset: str, train_subset: int, test_subset: int, rounds: int,
            hidden: str, out: str, methods: str, local_epochs: int = 1, lr: float = 0.1, batch_size: int = 32) -> None:
    p.add_argument("--methods", default=methods, help="'all' or a comma list (variants: " + ", ".join(VARIANTS) + ")")
    p.add_argument("--dataset", default=dataset)
    p.add_argument("--train-subset", type=int, default=train_subset)
    p.add_argument("--test-subset", type=int, default=test_subset)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--local-epochs", type=int, default=local_epochs)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--hidden", default=hidden)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="extra run-config for every run")
    p.add_argument("--method-set", nargs="*", metavar="METHOD:KEY=VALUE", help="run-config for one method only")
    p.add_argument("--out", default=out)


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of ``cancelfl-bench``."""
    parser = argparse.ArgumentParser(prog="cancelfl-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}

    g = sub.add_parser("grid", help="methods x epsilon x clients", **fmt)
    # FedSGD for every method (one full-batch step per round, as nadp, mpddp and ddpsa require): same optimiser,
    # so accuracy differences come from the privacy mechanisms.  ~14 min on 2 shared cores.
    _common(g, dataset="mnist", train_subset=6000, test_subset=2000, rounds=15, hidden="32",
            out="runs/bench/grid", methods="all", batch_size=100000, lr=0.5)
    g.add_argument("--epsilons", default="1,8")
    g.add_argument("--clients", default="10,50")

    a = sub.add_parser("attacks", help="uplink DLG and downlink membership inference per method", **fmt)
    _common(a, dataset="mnist", train_subset=0, test_subset=1000, rounds=1, hidden="32",
            out="runs/bench/attacks", methods="all")
    a.add_argument("--epsilons", default="1,8,64")
    a.add_argument("--dlg-clients", type=int, default=10)
    a.add_argument("--dlg-restarts", type=int, default=2)
    a.add_argument("--dlg-iterations", type=int, default=300)
    a.add_argument("--success-ssim", type=float, default=0.8)
    a.add_argument("--mia-clients", type=int, default=10)
    a.add_argument("--mia-train-subset", type=int, default=500)
    a.add_argument("--mia-rounds", type=int, default=10)
    a.add_argument("--mia-local-epochs", type=int, default=5)
    a.add_argument("--mia-hidden", default="128")

    o = sub.add_parser("overhead", help="client/server time and bytes vs FedAvg, and SecAgg+", **fmt)
    _common(o, dataset="mnist", train_subset=6000, test_subset=1000, rounds=3, hidden="32",
            out="runs/bench/overhead", methods="fedavg,nadp,mpddp")
    # The paper's sparse pairing for both (mpddp: Theorem 11 needs n ~ 80 at K = 100; nadp: any n works).
    o.set_defaults(method_set=['nadp:graph="n-out"', "nadp:n-out=8", 'mpddp:graph="n-out"', "mpddp:n-out=80"])
    o.add_argument("--epsilon", type=float, default=1.0)
    o.add_argument("--clients", default="100")
    o.add_argument("--engine", choices=("inprocess", "simulation"), default="inprocess",
                   help="inprocess: compute cost through the in-process grid (client/server split, SecAgg+ "
                        "reference); simulation: round wall time under Flower's simulation runtime")
    o.add_argument("--repeats", type=int, default=1,
                   help="interleaved repeats per method; medians are reported (the machine's speed drifts)")
    o.add_argument("--no-secagg", action="store_true")
    o.add_argument("--secagg-shares", default="all,11",
                   help="SecAgg+ num_shares values ('all' = every client, i.e. SecAgg; even values are made odd)")
    o.add_argument("--secagg-rounds", type=int, default=1, help="SecAgg+ rounds (all timed; caches are warm)")
    o.add_argument("--secagg-threshold", type=float, default=0.5, help="reconstruction threshold (fraction)")

    s = sub.add_parser("scale", help="per-client cost at growing client counts", **fmt)
    _common(s, dataset="digits", train_subset=0, test_subset=0, rounds=1, hidden="16",
            out="runs/bench/scale", methods="fedavg,nadp,mpddp", local_epochs=1, batch_size=100000)
    s.set_defaults(method_set=['nadp:graph="n-out"', "nadp:n-out=8", 'mpddp:graph="n-out"', "mpddp:n-out=80"])
    s.add_argument("--epsilon", type=float, default=1.0)
    s.add_argument("--clients", default="100,300,1000")

    al = sub.add_parser("all", help="grid, attacks, overhead and scale with their defaults", **fmt)
    al.add_argument("--out", default="runs/bench")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cancelfl-bench`` / ``python -m server.benchmark``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    undo = setup_process()
    commands = {"grid": cmd_grid, "attacks": cmd_attacks, "overhead": cmd_overhead, "scale": cmd_scale}
    t0 = time.perf_counter()
    try:
        if args.command == "all":
            for cmd in commands:
                commands[cmd](parser.parse_args([cmd, "--out", str(Path(args.out) / cmd)]))
        else:
            commands[args.command](args)
    finally:
        undo()
    print(f"benchmark '{args.command}' finished in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
