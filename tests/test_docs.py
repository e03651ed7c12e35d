"""The documentation: it builds strictly, its generated pages follow the code, and what it cites exists.

* the site builds with ``mkdocs build --strict`` (broken links, anchors, API references fail it);
* the configuration reference lists every ``RunConfig`` key with its ``pyproject.toml`` default;
* the benchmarks page shows a recorded result (command, date, commit, the table) and, for a benchmark
  with no record, its command and "no result";
* every ``cancelfl``/``cancelfl-bench`` subcommand and repository path the README and docs cite exists;
* the README keeps the CI contract: its first two commands are the set-up and ``python -m pytest -q``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))

import gen_config  # noqa: E402 - docs/ is not a package

PAGES = sorted(DOCS.rglob("*.md"))


def _documents() -> list[Path]:
    return [ROOT / "README.md", *(p for p in PAGES if "results" not in p.relative_to(DOCS).parts)]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs / mkdocstrings not installed: pip install -e '.[docs]'")
def test_docs_build_strict(tmp_path):
    """``mkdocs build --strict`` succeeds and the generated configuration page holds every run-config key."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    for f in gen_config.config_fields():
        assert f"<code>{f.key}</code>" in page, f.key


def test_configuration_reference_covers_every_key():
    """Every RunConfig field appears with the default ``[tool.flwr.app.config]`` gives it, and every method's regime."""
    from protocols.config import RunConfig
    from protocols.methods import METHODS

    with (ROOT / "pyproject.toml").open("rb") as fh:
        toml_defaults = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    fields = {f.key: f for f in gen_config.config_fields()}
    assert set(fields) == set(RunConfig().to_mapping())
    text = gen_config.render_config()
    for key, f in fields.items():
        assert f.toml_default == toml_defaults[key]
        row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
        assert f"`{gen_config._toml(toml_defaults[key])}`" in row, row
    for name in METHODS:
        assert f"| `{name}` | small |" in text and f"| `{name}` | large |" in text


def test_benchmarks_page_renders_recorded_results(tmp_path):
    """A folder written as ``cancelfl-bench`` writes it is shown with its provenance; others say no result."""
    from benchmarks.cli import BENCHMARKS, machine, write_record

    folder = tmp_path / "clipping"
    folder.mkdir()
    (folder / "clipping.md").write_text("# Per-example clipping\n\n| model | examples/s |\n|---|---|\n| mlp | 1234 |\n")
    write_record(folder, benchmark="clipping", command="cancelfl-bench clipping --out X", status=0,
                 started="2030-01-02T03:04:05+00:00", wall_s=1.0, host=machine())
    record = json.loads((folder / "record.json").read_text())
    assert record["files"] == ["clipping.md"] and record["machine"]["cores"] >= 1
    page = gen_config.render_benchmarks(tmp_path)
    section = page.split("## clipping", 1)[1].split("\n## ", 1)[0]
    assert "cancelfl-bench clipping --out X" in section and "2030-01-02T03:04:05+00:00" in section
    assert "| mlp | 1234 |" in section and "\n### Per-example clipping" in section
    assert (record["commit"] or "unknown") in section
    for name in BENCHMARKS:
        if name != "clipping":
            other = page.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
            assert "No result has been recorded yet." in other and gen_config.bench_commands()[name] in other


def _subcommands(parser) -> set[str]:
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def _cancelfl_subcommands() -> set[str]:
    """The subcommands ``cancelfl --help`` lists (its usage line ``{run,deploy,...}``)."""
    import contextlib
    import io

    from server.launch import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return set(re.search(r"\{([\w,-]+)\}", out.getvalue()).group(1).split(","))


def test_cited_commands_and_paths_exist():
    """``cancelfl X`` / ``cancelfl-bench X`` in the README and docs are real subcommands; cited paths exist."""
    from benchmarks.cli import build_parser as bench_parser

    cli, bench = _cancelfl_subcommands(), _subcommands(bench_parser()) | {"<benchmark>"}
    path_re = re.compile(r"`((?:protocols|client|strategies|server|benchmarks|tests|docker|docs|\.ci)/[\w./-]*)`")
    for doc in _documents():
        text = doc.read_text()
        code = " ".join(re.findall(r"```.*?```|`[^`\n]+`", text, flags=re.S))  # commands are cited as code
        for word in re.findall(r"(?<![\w-])cancelfl ([a-z][\w-]*)", code):
            assert word in cli, f"{doc.name}: 'cancelfl {word}' is not a cancelfl subcommand"
        for word in re.findall(r"(?<![\w-])cancelfl-bench ([a-z][\w-]*)", code):
            assert word in bench, f"{doc.name}: 'cancelfl-bench {word}' is not a benchmark"
        for m in path_re.finditer(text):
            path = m.group(1).split("::")[0]
            assert (ROOT / path).exists(), f"{doc.name}: cites {path}, which does not exist"


def test_readme_keeps_the_ci_commands_and_its_size():
    """README: <= 12,000 characters; its first command sets up and runs the main job, its second runs the tests."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= 12_000, len(readme)
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[0] == ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && "
                           "cancelfl compare --engine simulation --epsilon 1")
    assert commands[1].endswith("python -m pytest -q")
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_method_pages_show_measured_figures_from_the_defaults_record(tmp_path):
    """Every registered method is measured on a method page, read from ``defaults.csv`` with its provenance."""
    from protocols.methods import METHODS

    marked = {m for page in (DOCS / "methods").glob("*.md")
              for group in re.findall(r"<!-- generated:measured ([\w,-]+) -->", page.read_text())
              for m in group.split(",")}
    assert set(METHODS) <= marked, set(METHODS) - marked
    assert "No measured figures" in gen_config.render_measured(["nadp"], tmp_path)
    folder = tmp_path / "defaults"
    folder.mkdir()
    (folder / "record.json").write_text(json.dumps({"command": "cancelfl-bench defaults --out X",
                                                    "date": "2030-01-02T03:04:05+00:00",
                                                    "machine": {"cpu": "Some CPU", "cores": 4}}))
    (folder / "defaults.csv").write_text(
        "dataset,method,unit,seeds,final_accuracy,sd,epsilon_uplink,epsilon_downlink,rounds\n"
        "digits,nadp,record,3,0.89166,0.0123,0.9961,0.9931,30\n"
        "digits,cdp,record,1,0.9028,,,0.99996,30\n")
    page = gen_config.render_measured(["nadp"], tmp_path)
    assert "cancelfl-bench defaults --out X" in page and "2030-01-02" in page and "Some CPU, 4 cores" in page
    assert "| digits | `nadp` | record | 0.892 | 3 (0.012) | 1.00 | 0.99 | 30 |" in page and "cdp" not in page
    assert "| digits | `cdp` | record | 0.903 | 1 | - | 1.00 | 30 |" in gen_config.render_measured(["cdp"], tmp_path)
    assert "No measured figures for ladp" in gen_config.render_measured(["ladp"], tmp_path)


def test_every_figure_quoted_in_the_docs_matches_its_record(tmp_path):
    """Prose figures carry a marker naming their recorded table cell, and equal it to the decimals shown.

    A re-recorded table whose prose was not updated fails here; so do a ratio typed without a marker, a marker that
    follows no number, a marker naming a row the table lacks, and a comment the checker cannot read as a marker.
    """
    import figures

    assert figures.check_documents(_documents(), DOCS / "results") == []

    (tmp_path / "rt").mkdir()
    (tmp_path / "rt" / "roundtime.csv").write_text("name,clients,round_s,round_s_x_fedavg,bytes\n"
                                                   "fedavg,4,1.7746,1.0,56676\nnadp,4,2.998,1.6894,0\n"
                                                   "nadp,8,3.5,1.9,0\nniss,4,0.8935,7.544,nan\n")
    (tmp_path / "rt" / "trace.json").write_text('{"rounds": [{"method": "fedavg", "cpu_s": 3.135}]}')
    page = tmp_path / "page.md"
    page.write_text("FedAvg 1.77 s<!-- fig rt fedavg round_s -->, nadp 1.69x<!-- fig rt name=nadp,clients=4 "
                    "round_s_x_fedavg --> and 1.9<!-- fig rt name=nadp,clients=8 round_s_x_fedavg -->; "
                    "57 kB<!-- fig rt fedavg bytes/1000 -->, 3.1 s<!-- fig rt/trace.rounds fedavg cpu_s -->, "
                    "0.893<!-- fig rt niss round_s -->–0.894<!-- fig rt niss round_s -->, 7.5×<!-- fig rt niss "
                    "round_s_x_fedavg -->, 0.56<!-- fig rt name=nadp,clients=4 round_s_x_fedavg/round_s -->.\n")
    assert figures.check_documents([page], tmp_path) == []
    page.write_text("56 kB<!-- fig rt fedavg bytes/1000 -->, 3.2 s<!-- fig rt/trace.rounds fedavg cpu_s -->, "
                    "0.892<!-- fig rt niss round_s -->, 1<!-- fig rt/trace.steps fedavg cpu_s -->, 0<!-- fig rt niss "
                    "bytes -->, 0.2<!-- fig rt name=nadp,clients=4 round_s_x_fedavg/bytes --> and 7.54×.\n")
    problems = figures.check_documents([page], tmp_path)
    assert any("typed 56" in p and "bytes/1000" in p for p in problems), problems
    assert any("typed 3.2" in p for p in problems), problems
    assert any("typed 0.892" in p for p in problems), problems
    assert any("trace.json has no list 'steps'" in p for p in problems), problems
    assert any("ratio 7.54× has no" in p for p in problems), problems
    assert any("bytes of 'niss' is not a number ('nan'" in p for p in problems), problems
    assert any("round_s_x_fedavg/bytes of 'name=nadp,clients=4' is not a number" in p for p in problems), problems
    assert len(problems) == 7, problems
    page.write_text("FedAvg 1.78 s<!-- fig rt fedavg round_s -->, nadp 1.7x<!-- fig rt nadp round_s_x_fedavg -->, "
                    "niss 1.72x, <!-- fig rt fedavg round_s --> and 2<!-- fig rt ldp round_s -->.\n")
    problems = figures.check_documents([page], tmp_path)
    assert any("typed 1.78" in p and "rounds to 1.77" in p for p in problems), problems
    assert any("2 rows of roundtime.csv match 'nadp'" in p for p in problems), problems
    assert any("ratio 1.72x has no" in p for p in problems), problems
    assert any("follows no number" in p for p in problems), problems
    assert any("0 rows of roundtime.csv match 'ldp'" in p for p in problems), problems
    assert len(problems) == 5, problems
    page.write_text("1.2 s<!-- fig rt/trace.rounds fedavg phase cpu_s --> is no marker the checker reads.\n")
    assert any("is not '<!-- fig RECORD ROW COLUMN -->'" in p for p in figures.check_documents([page], tmp_path))
