"""Generators of the documentation's reference pages, from the code (used by ``docs/hooks.py`` at build time).

* :func:`render_config`: the run-configuration reference, read from :class:`protocols.config.RunConfig` (field
  names, types, defaults and the comment on each field's line), each method's options class (its keys' help and
  allowed values, :mod:`protocols.options`), ``[tool.flwr.app.config]`` in ``pyproject.toml``
  (the defaults a run starts from), the allowed values ``RunConfig.validate`` checks, and the method registry
  (:mod:`protocols.methods`: each method's regime for the keys left ``"auto"`` and its privacy guarantee).
* :func:`render_benchmarks`: the benchmark results recorded under ``docs/results/<benchmark>/`` by
  ``cancelfl-bench ... --out docs/results/<benchmark>`` (``record.json`` + the tables and plots it wrote).
* :func:`render_measured`: a method page's measured figures, read from ``docs/results/defaults/defaults.csv``
  (what ``cancelfl-bench defaults`` wrote) with that record's command, date and machine.

Run ``python docs/gen_config.py`` to print the configuration reference.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import re
import sys
import tokenize
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Field:
    """One run-config key as the code defines it."""

    section: str
    key: str
    type: str
    field_default: object
    toml_default: object
    comment: str
    allowed: tuple[str, ...]


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (without ``#``)."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _allowed_values(tree: ast.Module, namespace: dict) -> dict[str, tuple[str, ...]]:
    """Run-config key -> the values ``validate()`` accepts, from its ``_choice("key", value, ALLOWED)`` calls."""
    out: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_choice"
                and isinstance(node.args[0], ast.Constant)):
            allowed = node.args[2]
            try:
                value = eval(compile(ast.Expression(allowed), "<allowed>", "eval"), namespace)  # noqa: S307
            except Exception:  # noqa: BLE001 - an expression we cannot evaluate statically is left out
                continue
            out[node.args[0].value] = tuple(str(v) for v in value)
    return out


def config_fields() -> list[Field]:
    """Every run-config key of :class:`protocols.config.RunConfig`, in declaration order."""
    import protocols.config as config

    path = ROOT / "protocols" / "config.py"
    source = path.read_text()
    tree = ast.parse(source)
    comments = _comments(source)
    allowed = _allowed_values(tree, vars(config))
    with (ROOT / "pyproject.toml").open("rb") as fh:
        toml_defaults = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunConfig")
    defaults = config.RunConfig()
    out: list[Field] = []
    section = ""
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        # A comment on its own line right above the field starts a section ("# Privacy").
        above = comments.get(node.lineno - 1, "")
        if above and not above.startswith(":") and source.splitlines()[node.lineno - 2].strip().startswith("#"):
            section = above
        if name in ("regime_applied", "options"):
            continue
        key = config.RunConfig.key_of(name)
        out.append(Field(section, key, ast.unparse(node.annotation), getattr(defaults, name),
                         toml_defaults.get(key, "(missing)"), comments.get(node.lineno, ""), allowed.get(key, ())))
    from protocols.methods import options_classes

    for opt_cls in options_classes():  # each method's own keys, from its options class (protocols/methods/<method>.py)
        for key, f in opt_cls.keys().items():
            out.append(Field(opt_cls.title or opt_cls.__name__, key, str(f.type), f.default,
                             toml_defaults.get(key, "(missing)"), f.metadata["help"], f.metadata["choices"]))
    return out


def _toml(value: object) -> str:
    """A default as it is written in ``--run-config`` (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _cell(text: str) -> str:
    """A table cell: pipes escaped (code spans included: the tables extension splits on them)."""
    return text.replace("|", "\\|")


def _text(text: str) -> str:
    """Prose for a table cell: :func:`_cell`, and ``<``/``>`` as entities (a comment's ``<dataset>`` is not HTML)."""
    return _cell(text).replace("<", "&lt;").replace(">", "&gt;")


def render_config() -> str:
    """The configuration reference page body (Markdown)."""
    from protocols.methods import AUTO_KEYS, METHODS, regime

    lines: list[str] = []
    section = None
    for f in config_fields():
        if f.section != section:
            section = f.section
            lines += ["", f"### {section}", "", "| key | default | type | meaning | allowed |", "|---|---|---|---|---|"]
        default = f"`{_toml(f.toml_default)}`"
        if f.key in AUTO_KEYS:
            default += f" (else `{_toml(f.field_default)}`)"
        allowed = ", ".join(f"`{a}`" for a in f.allowed)
        lines.append(f"| `{f.key}` | {_cell(default)} | {f.type} | {_text(f.comment)} | {_cell(allowed)} |")
    lines += ["", "### Regimes: what `\"auto\"` becomes", "",
              "Keys whose default is `\"auto\"` take the method's regime for the dataset (its card in `protocols/methods/`); "
              "small datasets are digits, breast-cancer and your own loaders, large ones MNIST, Fashion-MNIST and "
              "`hub:` datasets. A value you set always wins; the run prints the regime it applied and writes it to "
              "`summary.json` (`regime`). `graph = \"auto\"` is decided from the clients per round "
              "(`protocols.methods.auto_graph`).", ""]
    keys = [k for k in AUTO_KEYS if k != "graph"]
    lines += ["| method | dataset size | " + " | ".join(f"`{k}`" for k in keys) + " |",
              "|---|---|" + "---|" * len(keys)]
    for name in METHODS:
        for size, dataset in (("small", "digits"), ("large", "mnist")):
            values = regime(name, dataset)
            cells = [f"`{_toml(values[k])}`" if k in values else "–" for k in keys]
            lines.append(f"| `{name}` | {size} | " + " | ".join(cells) + " |")
    lines += ["", "### What each method's epsilon protects", "",
              "From the registry (`protocols.methods.METHODS`); a run writes the same into `summary.json` "
              "(`privacy`). *none* = no guarantee in that direction: the run reports epsilon `null` there.", "",
              "| method | unit(s) | uploads: adversary | published model: adversary |", "|---|---|---|---|"]
    for name, spec in METHODS.items():
        units = ", ".join(spec.units) or "none"
        lines.append(f"| `{name}` | {units} | {_text(spec.privacy.uplink or '*none*')} | "
                     f"{_text(spec.privacy.downlink or '*none*')} |")
    return "\n".join(lines).strip() + "\n"


# ---------------------------------------------------------------------------- benchmarks
#: Every ``cancelfl-bench`` subcommand, with the command whose output the page shows for it.
def bench_commands() -> dict[str, str]:
    """Benchmark name -> the command that records its result for the docs (``--out docs/results/<name>``)."""
    from benchmarks.cli import BENCHMARKS

    out = {}
    for name in BENCHMARKS:
        positional = name in ("nadp", "niss", "mpddp", "ladp")  # these take the output folder as an argument
        target = f"docs/results/{name}"
        out[name] = f"cancelfl-bench {name} {target}" if positional else f"cancelfl-bench {name} --out {target}"
    return out


def _demote(markdown: str) -> str:
    """Headings of an included table file two levels down, under the page's own."""
    return re.sub(r"^(#{1,4}) ", lambda m: "#" * min(len(m.group(1)) + 2, 6) + " ", markdown, flags=re.M)


def render_benchmarks(results: Path, page_dir: str = "results") -> str:
    """The benchmarks page body: one section per benchmark, each from its ``record.json`` (or 'no result')."""
    from benchmarks.cli import BENCHMARKS, summary

    commands = bench_commands()
    lines: list[str] = []
    for name in BENCHMARKS:
        line = summary(name)[0]  # the benchmark's HELP, read without importing it
        lines += ["", f"## {name}", "", f"{line[:1].upper()}{line[1:]}.", ""]
        # docs/results/<name>/ and any docs/results/<name>-<setting>/ (e.g. roundtime-deployment): one record each
        folders = [f for f in (results / name, *sorted(results.glob(f"{name}-*"))) if (f / "record.json").is_file()]
        if not folders:
            lines += ["To record a result:", "", "```bash", commands[name], "```", "",
                      "No result has been recorded yet.", ""]
            continue
        for folder in folders:
            lines += _render_record(folder, name if folder.name == name else folder.name, page_dir)
    return "\n".join(lines).strip() + "\n"


def _render_record(folder: Path, title: str, page_dir: str) -> list[str]:
    """One recorded result: its provenance table, its markdown tables and its plots."""
    lines: list[str] = [] if "-" not in title else [f"### {title}", ""]
    record = json.loads((folder / "record.json").read_text())
    host = record.get("machine") or {}
    load = host.get("load_average")
    lines += ["| | |", "|---|---|",
              f"| command | `{_cell(record.get('command', '?'))}` |",
              f"| date (UTC) | {record.get('date', '?')} |",
              f"| commit | `{record.get('commit') or 'unknown'}` |",
              f"| machine | {_text(str(host.get('cpu', '?')))}, {host.get('cores', '?')} cores"
              + (f", GPU {host['gpu']}" if host.get("gpu") else "")
              + (f", load average at start {load[0]}" if load else "") + " |",
              f"| exit status | {record.get('exit_status', '?')} (wall {record.get('wall_s', '?')} s) |", ""]
    for file in sorted(record.get("files", [])):
        path = folder / file
        if path.suffix == ".md" and path.is_file():
            lines += [_demote(path.read_text()).strip(), ""]
    for file in sorted(record.get("files", [])):
        if file.endswith(".png") and (folder / file).is_file():
            lines += [f"![{title}: {file}]({page_dir}/{folder.name}/{file})", ""]
    return lines


# ---------------------------------------------------------------------------- a method page's measured figures
def _fmt(value: str, digits: int = 3) -> str:
    """A CSV number rounded for a table; '' (no guarantee / one seed) -> '-'."""
    return "-" if value in ("", None) else f"{float(value):.{digits}f}"


def render_measured(methods: list[str], results: Path) -> str:
    """Rows of ``results/defaults/defaults.csv`` for ``methods``, under the record's command, date and machine.

    Args:
        methods: method names as the page lists them (``cancelfl run`` ``method`` values).
        results: the ``docs/results`` folder.

    Returns:
        Markdown: a provenance line and one table row per (dataset, method); a line saying how to record the
        figures when the record or a method's rows are missing.
    """
    folder = results / "defaults"
    command = "cancelfl-bench defaults --datasets digits,mnist,fashion-mnist --out docs/results/defaults"
    if not (folder / "record.json").is_file() or not (folder / "defaults.csv").is_file():
        return f"No measured figures are recorded yet: `{command}` records them.\n"
    record = json.loads((folder / "record.json").read_text())
    host = record.get("machine") or {}
    with (folder / "defaults.csv").open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["method"] in methods]
    if not rows:
        return f"No measured figures for {', '.join(methods)} are recorded yet: `{command}` records them.\n"
    rows.sort(key=lambda r: methods.index(r["method"]))
    lines = [f"Each method with only `method` and `dataset` set (its regime applied), at the default epsilon = 1 "
             f"and delta = 1e-5 over the run; epsilon `-` = no guarantee. Recorded by `{_cell(record.get('command', '?'))}` "
             f"on {str(record.get('date', '?'))[:10]} ({_text(str(host.get('cpu', '?')))}, {host.get('cores', '?')} "
             f"cores); all methods side by side: [benchmarks](../benchmarks.md#defaults).", "",
             "| dataset | method | unit | test accuracy | seeds (sd) | epsilon upload | epsilon model | rounds |",
             "|---|---|---|---|---|---|---|---|"]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        for r in (r for r in rows if r["dataset"] == dataset):
            seeds = r["seeds"] + (f" ({_fmt(r['sd'])})" if r.get("sd") else "")
            lines.append(f"| {dataset} | `{r['method']}` | {r['unit']} | {_fmt(r['final_accuracy'])} | {seeds} | "
                         f"{_fmt(r['epsilon_uplink'], 2)} | {_fmt(r['epsilon_downlink'], 2)} | {r['rounds']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_config())
