"""The run report: Markdown plus PNG plots, for one run or several runs side by side.

Reads what :mod:`server.runner` writes in each run folder (``metrics.jsonl``,
``summary.json``) and writes, into one folder:

* ``accuracy.png`` -- test accuracy of the global model per round, one line per method;
* ``epsilon.png`` -- epsilon spent per round in both directions: what the server sees of one
  client's upload and what the published model reveals (a method with no guarantee in a
  direction has no line there and says "none" in the table);
* ``noise.png`` -- per-coordinate std of the noise in one upload against the noise left in the
  aggregated model (the strategies' calibrated figures ``upload_noise_std`` and
  ``model_noise_std``): noise that cancels on aggregation shows as a tall first bar over a
  short second one;
* ``report.md`` -- a table of the final figures, the plots, and the command that made it.

matplotlib is imported only when a report is written (on the non-interactive Agg backend).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunData:
    """One run folder's per-round metrics and summary."""

    name: str
    folder: Path
    rows: list[dict]
    summary: dict

    @classmethod
    def load(cls, name: str, folder: Path) -> RunData:
        """Read ``metrics.jsonl`` and ``summary.json`` (strict JSON) from ``folder``."""
        folder = Path(folder)
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        summary_path = folder / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        return cls(name, folder, rows, summary)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(rounds, values) of a per-round figure, skipping rounds where it is missing or null."""
        pts = [(r["round"], float(r[key])) for r in self.rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def last(self, key: str) -> float | None:
        """The figure of the last round that has it (None if no round has it)."""
        for row in reversed(self.rows):
            if row.get(key) is not None:
                return float(row[key])
        return None

    def noise(self) -> tuple[float | None, float | None]:
        """(upload noise std, noise std left in the model) per coordinate, median over the rounds that report it."""
        return _median(self.series("upload_noise_std")[1]), _median(self.series("model_noise_std")[1])


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (imported here, lazily)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Write a matplotlib figure as PNG (creating the folder) and close it."""
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------- plots
def plot_accuracy(runs: Sequence[RunData], path: Path) -> None:
    """Test accuracy per round, one line per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for run in runs:
        ax.plot(*run.series("test_accuracy"), marker="o", markersize=3, label=run.name)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: the curves end top right
    ax.set_title("Accuracy of the global model")
    save_figure(fig, path)


def plot_epsilon(runs: Sequence[RunData], path: Path) -> None:
    """Epsilon spent per round: the upload as the server sees it (left), the published model (right)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 3.8), sharey=True)
    for ax, key, title in ((axes[0], "epsilon_uplink", "upload (what the server sees)"),
                           (axes[1], "epsilon_downlink", "published model")):
        for run in runs:
            rounds, eps = run.series(key)
            if rounds:
                ax.plot(rounds, eps, marker="o", markersize=3, label=run.name)
            else:
                ax.plot([], [], label=f"{run.name}: none")
        ax.set_title(f"epsilon spent: {title}")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("epsilon")
    save_figure(fig, path)


def plot_noise(runs: Sequence[RunData], path: Path) -> None:
    """Per-coordinate noise std in one upload against in the aggregated model (log scale; 0 drawn at the floor)."""
    plt = pyplot()
    names = [r.name for r in runs]
    figures = [r.noise() for r in runs]
    positive = [v for pair in figures for v in pair if v]
    floor = min(positive) / 10 if positive else 1e-6
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.38
    for offset, idx, label in ((-width / 2, 0, "noise in one upload"), (width / 2, 1, "noise left in the model")):
        values = [f[idx] for f in figures]
        xs = [i + offset for i in range(len(names))]
        bars = ax.bar(xs, [v if v else floor for v in values], width, label=label)
        for bar, v in zip(bars, values, strict=True):
            text = "n/a" if v is None else ("0" if v == 0 else f"{v:.2g}")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("noise std per coordinate")
    ax.set_title("Upload noise vs noise left in the model")
    ax.legend(fontsize=8)
    save_figure(fig, path)


# ---------------------------------------------------------------- Markdown
def _fmt(v: float | None, digits: int = 3, none: str = "none") -> str:
    if v is None:
        return none
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return "inf"
    return f"{v:.{digits}g}"


def summary_table(runs: Sequence[RunData]) -> list[str]:
    """Markdown table of the final figures of each run."""
    lines = ["| method | final accuracy | rounds | privacy unit | epsilon: upload (server's view) | "
             "epsilon: published model | noise std in one upload | noise std left in the model | upload / model noise "
             "| time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        up, model = run.noise()
        ratio = (f"{up / model:.3g}" if up and model else ("-" if not up else "inf"))
        total = run.summary.get("total_time_s")
        lines.append(
            f"| {run.name} | {_fmt(run.last('test_accuracy'))} | {len(run.rows)} | "
            f"{run.rows[-1].get('privacy_unit', '-') if run.rows else '-'} | {_fmt(run.last('epsilon_uplink'))} | "
            f"{_fmt(run.last('epsilon_downlink'))} | {_fmt(up, none='n/a')} | {_fmt(model, none='n/a')} | {ratio} | "
            f"{'-' if total is None else f'{total:.1f}'} |")
    return lines


def run_flags(runs: Sequence[RunData]) -> list[str]:
    """One line per run that did not learn or ended above its epsilon target (from its summary.json)."""
    lines = []
    for run in runs:
        check = run.summary.get("learning_check") or {}
        if check.get("learned") is False:
            lines.append(f"**{run.name} did not learn**: final accuracy {_fmt(check.get('final_accuracy'))}, most "
                         f"frequent test class {_fmt(check.get('chance'))} (margin {check.get('margin')}).")
        privacy = run.summary.get("privacy") or {}
        if privacy.get("over_target"):
            lines.append(f"**{run.name} ended above its epsilon target** {privacy.get('target_epsilon')}: clients "
                         "dropped after the noise was calibrated, and the accountant charged the noise left.")
    return lines


def write_report(runs: Mapping[str, Path], out: Path, *, title: str = "cancelfl run report", command: str = "",
                 notes: Sequence[str] = ()) -> Path:
    """Write ``report.md``, ``accuracy.png``, ``epsilon.png`` and ``noise.png`` into ``out``; returns report.md.

    ``runs`` maps a label (usually the method) to a run folder written by :func:`server.runner.run_federation`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = [RunData.load(name, folder) for name, folder in runs.items()]
    plot_accuracy(data, out / "accuracy.png")
    plot_epsilon(data, out / "epsilon.png")
    plot_noise(data, out / "noise.png")
    cfg = data[0].summary.get("config", {})
    setting = ", ".join(f"{k}={cfg[k]}" for k in ("dataset", "num-clients", "num-rounds", "epsilon", "delta") if k in cfg)
    md = [f"# {title}", ""]
    if setting:
        md += [f"Setting: {setting}.", ""]
    if command:
        md += ["Made by:", "", "```bash", command, "```", ""]
    md += summary_table(data)
    md += ["", "Epsilon is the whole-run figure spent after the last round; \"none\" means the method gives no "
           "guarantee in that direction. Noise figures are the calibrated per-coordinate standard deviations "
           "(median over rounds) of the noise in one client's upload and of the noise that stays in the "
           "aggregated model; a large ratio means the upload noise cancels on aggregation.", ""]
    notes = [*run_flags(data), *notes]
    md += [f"- {n}" for n in notes]
    if notes:
        md.append("")
    md += ["![accuracy per round](accuracy.png)", "", "![epsilon spent per round](epsilon.png)", "",
           "![upload noise vs noise left in the model](noise.png)", ""]
    md += ["Run folders: " + ", ".join(f"`{r.name}`: `{r.folder}`" for r in data), ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def write_run_report(out_dir: Path, method: str) -> Path | None:
    """The report of one run, written into its own folder (None if it could not be drawn).

    The run's results are already on disk: a failure to draw (e.g. matplotlib missing) is reported on
    stderr and never fails the finished run.
    """
    try:
        return write_report({method: Path(out_dir)}, Path(out_dir), title=f"cancelfl run: {method}")
    except Exception as err:  # noqa: BLE001 - the report is an extra; the run's outputs stand
        print(f"cancelfl: report not written in {out_dir} ({type(err).__name__}: {err})", file=sys.stderr)
        return None
