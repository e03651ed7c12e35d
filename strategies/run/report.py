"""The run report: Markdown plus PNG plots, for one run or several runs side by side.

Reads ``metrics.jsonl`` and ``summary.json`` of each run folder and writes into one folder:

* ``accuracy.png``: the global model's test accuracy per round, one line per method;
* ``epsilon.png``: epsilon spent per round on the uplink and the downlink (a method without a guarantee in a
  direction is listed as "no guarantee" instead of drawn);
* ``noise.png``: per-coordinate noise std in one upload against that left in the model (``upload_noise_std``,
  ``model_noise_std``; log scale), so noise that cancels shows as a tall bar over a short one;
* ``report.md``: one verdict line (:func:`headline`), the final figures, the plots and the command.

Every run keeps one colour, line style and marker in all plots; matplotlib (Agg) is imported only when a report is
written.
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

    def protects(self) -> tuple[str, ...]:
        """The views the run's epsilon covers, of ``("uploads", "published model")`` (empty: no guarantee)."""
        privacy = self.summary.get("privacy") or {}
        if privacy:
            return tuple(view for view, key in (("uploads", "uplink"), ("published model", "downlink"))
                         if (privacy.get(key) or {}).get("adversary"))
        return tuple(view for view, key in (("uploads", "epsilon_uplink"), ("published model", "epsilon_downlink"))
                     if self.last(key) is not None)

    def accuracy(self) -> float | None:
        """Final test accuracy (summary.json, else the last round that has one)."""
        acc = self.summary.get("final_accuracy")
        return float(acc) if acc is not None else self.last("test_accuracy")

    def planned_rounds(self) -> int | None:
        """The run's own num-rounds (its config), None if unknown."""
        rounds = (self.summary.get("config") or {}).get("num-rounds")
        return int(rounds) if isinstance(rounds, int | float) else None

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
_STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ("-", "v"), ("--", "P"), ("-.", "X"), (":", "*"))


def style(index: int, count: int) -> dict:
    """Plot keywords of the ``index``-th of ``count`` runs: its own colour, line style and marker.

    Earlier runs get wider, lighter lines, so a later run drawn on top of one with the same values
    (e.g. two methods spending the same epsilon) leaves both visible.
    """
    plt = pyplot()
    colours = plt.get_cmap("tab10").colors
    line, marker = _STYLES[index % len(_STYLES)]
    width = 1.4 + 2.2 * (count - 1 - index) / max(count - 1, 1)
    return {"color": colours[index % len(colours)], "linestyle": line, "marker": marker, "markersize": 4 + width,
            "linewidth": width, "alpha": 0.85, "markerfacecolor": "none" if index % 2 else None}


def accuracy_figure(runs: Sequence[RunData]):
    """The figure of :func:`plot_accuracy` (not saved)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, run in enumerate(runs):
        ax.plot(*run.series("test_accuracy"), label=run.name, **style(i, len(runs)))
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: the curves end top right
    ax.set_title("Accuracy of the global model")
    return fig


def plot_accuracy(runs: Sequence[RunData], path: Path) -> None:
    """Test accuracy per round, one line per run."""
    save_figure(accuracy_figure(runs), path)


def epsilon_figure(runs: Sequence[RunData]):
    """The figure of :func:`plot_epsilon` (not saved): lines only for runs with a guarantee in that direction."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.2), sharey=True)
    targets = {float(t) for r in runs if (t := (r.summary.get("privacy") or {}).get("target_epsilon")) is not None}
    for ax, key, title in ((axes[0], "epsilon_uplink", "uploads (what the server sees)"),
                           (axes[1], "epsilon_downlink", "published model")):
        missing = []
        for i, run in enumerate(runs):
            rounds, eps = run.series(key)
            if rounds:
                ax.plot(rounds, eps, label=run.name, **style(i, len(runs)))
            else:
                missing.append(run.name)
        for t in sorted(targets):
            ax.axhline(t, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"epsilon spent: {title}")
        ax.set_xlabel("round" + (f"\nno guarantee: {', '.join(missing)}" if missing else ""))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("epsilon (dotted: target)" if targets else "epsilon")
    return fig


def plot_epsilon(runs: Sequence[RunData], path: Path) -> None:
    """Epsilon spent per round: the upload as the server sees it (left), the published model (right)."""
    save_figure(epsilon_figure(runs), path)


def noise_figure(runs: Sequence[RunData]):
    """The figure of :func:`plot_noise` (not saved): a bar only for a positive figure."""
    from matplotlib.transforms import blended_transform_factory

    plt = pyplot()
    names = [r.name for r in runs]
    figures = [r.noise() for r in runs]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.set_yscale("log")
    at_axis = blended_transform_factory(ax.transData, ax.transAxes)
    width = 0.38
    colours = pyplot().get_cmap("tab10").colors
    for offset, idx, label, colour in ((-width / 2, 0, "noise in one upload", colours[0]),
                                       (width / 2, 1, "noise left in the model", colours[1])):
        drawn = False
        for i, figure in enumerate(figures):
            v, x = figure[idx], i + offset
            if v is not None and v > 0:
                bar = ax.bar([x], [v], width, color=colour, label=None if drawn else label)[0]
                drawn = True
                ax.annotate(f"{v:.2g}", (x, bar.get_height()), ha="center", va="bottom", fontsize=8)
            else:  # no bar on a log axis: the value is written where the bar would start
                ax.text(x, 0.02, "0" if v == 0 else "n/a", transform=at_axis, ha="center", va="bottom", fontsize=8,
                        color=colour)
    if not any(v is not None and v > 0 for f in figures for v in f):
        ax.set_ylim(1e-3, 1.0)  # nothing drawn: a log axis still needs a range
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("noise std per coordinate")
    ax.set_title("Upload noise vs noise left in the model")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return fig


def plot_noise(runs: Sequence[RunData], path: Path) -> None:
    """Per-coordinate noise std in one upload against in the aggregated model (log scale; 0 and n/a as text)."""
    save_figure(noise_figure(runs), path)


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
        planned = run.planned_rounds()
        rounds = f"{len(run.rows)}" + ("" if planned in (None, len(run.rows)) else f" of {planned}")
        lines.append(
            f"| {run.name} | {_fmt(run.accuracy())} | {rounds} | "
            f"{run.rows[-1].get('privacy_unit', '-') if run.rows else '-'} | {_upload_epsilon(run)} | "
            f"{_fmt(run.last('epsilon_downlink'))} | {_fmt(up, none='n/a')} | {_fmt(model, none='n/a')} | {ratio} | "
            f"{'-' if total is None else f'{total:.1f}'} |")
    return lines


def _upload_epsilon(run: RunData) -> str:
    """The upload column: the claim, and the view with no colluding neighbour where the run reports one."""
    alone = run.last("epsilon_uplink_no_colluder")
    return _fmt(run.last("epsilon_uplink")) + ("" if alone is None else f" (no colluding neighbour: {_fmt(alone)})")


#: Accuracies closer than this (absolute) are reported as the same accuracy in a verdict.
SAME_ACCURACY = 0.01


def _views(views: Sequence[str]) -> str:
    return " and ".join(f"the {v}" for v in views) if views else "nothing"


def verdict(run: RunData, runs: Sequence[RunData]) -> str | None:
    """One line on what ``run`` (a DP method) buys against the other runs; None for a run without a guarantee.

    The comparator is the run that protects less (a strict subset of ``run``'s views, :meth:`RunData.protects`)
    and, among those, protects the most, then has the best accuracy: the price of the extra protection.
    A run protecting the same views is named too.  Accuracies within :data:`SAME_ACCURACY` count as the same.
    """
    mine, acc = set(run.protects()), run.accuracy()
    if not mine or acc is None:
        return None
    privacy = run.summary.get("privacy") or {}
    spent = ", ".join(f"{view} {_fmt(privacy.get(key, {}).get('epsilon') if privacy else run.last('epsilon_' + key))}"
                      for view, key in (("uploads", "uplink"), ("published model", "downlink")) if view in mine)
    target = privacy.get("target_epsilon")
    guarantee = (f"epsilon {_fmt(target)} per {privacy.get('unit', 'record')}" if target is not None else "epsilon")
    line = f"**{run.name}** protects {_views(run.protects())} ({guarantee}; spent: {spent})"
    others = [r for r in runs if r is not run and r.accuracy() is not None]
    lesser = [r for r in others if set(r.protects()) < mine]
    if lesser:
        ref = max(lesser, key=lambda r: (len(r.protects()), r.accuracy()))
        extra = _views([v for v in run.protects() if v not in ref.protects()])
        diff = acc - ref.accuracy()
        ref_views = ref.protects()
        too = " too" if ref_views else ""
        named = f"{ref.name} (which protects {_views(ref_views)})" if ref_views else f"{ref.name} (no DP)"
        figures = f"{acc:.3f} vs {ref.accuracy():.3f}"
        if abs(diff) <= SAME_ACCURACY:
            line += f": the accuracy of {named}, {figures}, with {extra} protected{too}"
        elif diff > 0:
            line += f": {diff:.3f} above {named}, {figures}, with {extra} protected{too}"
        else:
            line += f": {-diff:.3f} below {named}, {figures}, the price of protecting {extra}{too}"
    same = [r for r in others if set(r.protects()) == mine]
    if same:
        best = max(same, key=lambda r: r.accuracy())
        diff = acc - best.accuracy()
        word = "same accuracy as" if abs(diff) <= SAME_ACCURACY else ("above" if diff > 0 else "below")
        line += (f"; against {best.name}, which protects the same: {word} it ({acc:.3f} vs {best.accuracy():.3f})")
    return line + "."


def headline(runs: Sequence[RunData]) -> str | None:
    """The report's one verdict line: :func:`verdict` of the DP run that protects the most, then is most accurate.

    None for a single run (nothing to compare with) or when no run has a guarantee.
    """
    ranked = [r for r in runs if r.protects() and r.accuracy() is not None]
    if len(runs) < 2 or not ranked:
        return None
    return verdict(max(ranked, key=lambda r: (len(r.protects()), r.accuracy())), runs)


def setting_line(runs: Sequence[RunData]) -> str:
    """The settings all runs share (dataset, clients, rounds, epsilon, delta); one that differs is marked per method."""
    keys = ("dataset", "num-clients", "num-rounds", "epsilon", "delta")
    configs = [r.summary.get("config", {}) for r in runs]
    parts = []
    for key in keys:
        values = [c.get(key) for c in configs if key in c]
        if not values:
            continue
        if all(v == values[0] for v in values):
            parts.append(f"{key}={values[0]}")
        else:
            parts.append(f"{key}: " + ", ".join(f"{r.name} {c.get(key)}" for r, c in zip(runs, configs, strict=True)))
    return "; ".join(parts)


def no_guarantee_caption(runs: Sequence[RunData]) -> str:
    """The caption of epsilon.png: which runs have no line in which panel ("" if every run has both)."""
    parts = []
    for view in ("uploads", "published model"):
        names = [r.name for r in runs if view not in r.protects()]
        if names:
            parts.append(f"{view}: {', '.join(names)}")
    return ("No guarantee, so no line: " + "; ".join(parts) + ".") if parts else ""


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
    setting = setting_line(data)
    md = [f"# {title}", ""]
    if setting:
        md += [f"Setting: {setting}.", ""]
    if command:
        md += ["Made by:", "", "```bash", command, "```", ""]
    if found := headline(data):
        md += ["## Verdict", "", found, ""]
    md += summary_table(data)
    md += ["", "Epsilon is the whole-run figure spent after the last round; \"none\" means the method gives no "
           "guarantee in that direction; an upload figure \"(no colluding neighbour: x)\" is the uploads' epsilon "
           "when none of a client's neighbours colludes with the server (the first figure holds with the colluders "
           "the method tolerates). Noise figures are the calibrated per-coordinate standard deviations "
           "(median over rounds) of the noise in one client's upload and of the noise that stays in the "
           "aggregated model; a large ratio means the upload noise cancels on aggregation.", ""]
    notes = [*run_flags(data), *notes]
    md += [f"- {n}" for n in notes]
    if notes:
        md.append("")
    md += ["![accuracy per round](accuracy.png)", "", "![epsilon spent per round](epsilon.png)", ""]
    if caption := no_guarantee_caption(data):
        md += [caption, ""]
    md += ["![upload noise vs noise left in the model](noise.png)", ""]
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
