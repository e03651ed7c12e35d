"""mkdocs hooks: pages generated from the code at build time (``mkdocs.yml`` ``hooks:``).

A page holding ``<!-- generated:config -->`` gets the run-configuration reference
(:func:`gen_config.render_config`); ``<!-- generated:benchmarks -->`` the recorded benchmark results under
``docs/results/`` (:func:`gen_config.render_benchmarks`); ``<!-- generated:measured a,b -->`` the measured figures
of methods a and b (:func:`gen_config.render_measured`).  Nothing generated is committed, so it cannot drift.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

import gen_config  # noqa: E402 - after the path set-up above


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace the generation markers of a page with the generated Markdown."""
    if "<!-- generated:config -->" in markdown:
        markdown = markdown.replace("<!-- generated:config -->", gen_config.render_config())
    if "<!-- generated:benchmarks -->" in markdown:
        rel = Path(page.file.src_uri).parent
        prefix = "/".join([".."] * len(rel.parts) + ["results"]) if rel.parts else "results"
        markdown = markdown.replace("<!-- generated:benchmarks -->",
                                    gen_config.render_benchmarks(Path(config["docs_dir"]) / "results", prefix))
    results = Path(config["docs_dir"]) / "results"
    return re.sub(r"<!-- generated:measured ([\w,-]+) -->",
                  lambda m: gen_config.render_measured(m.group(1).split(","), results), markdown)
