"""Figures quoted in the prose of the README and the docs, each bound to the recorded table it comes from.

A figure typed in prose carries a marker right after it (invisible once rendered)::

    nadp takes 1.26x<!-- fig roundtime nadp round_s_x_fedavg --> FedAvg's round

``<!-- fig RECORD ROW COLUMN -->``: ``RECORD`` a folder under ``docs/results`` (``RECORD/TABLE`` picks
``TABLE.csv`` where the folder holds several tables, ``RECORD/FILE.KEY`` the list of rows under ``KEY`` in
``FILE.json``), ``ROW`` the value of the table's first column, or ``col=value,col=value`` for tables keyed by
several columns, ``COLUMN`` the column quoted, optionally in another unit (``bytes_per_client/1000`` for kB,
``server_cpu_s*1000`` for ms) or over another column of its row (``point/claimed``).  The typed number must
equal the recorded value (in that unit) rounded to the decimals it shows; each end of a range (``0.11–0.16 s``)
carries its own marker.  :func:`check_documents` lists every figure that does not (a re-recorded table whose prose
was not updated), every marker that names no figure or no row, and every ratio figure (``1.26x``, ``7.5×``) typed
without a marker.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Quote", "check_documents", "check_quote", "quotes", "unmarked_ratios"]

_MARKER = re.compile(r"<!-- fig (\S+) (\S+) (\S+) -->")
#: The number a marker binds: the last one before it, with an optional unit (``1.26x``, ``0.9 s``, ``12 %``).
_FIGURE = re.compile(r"(-?\d+(?:\.\d+)?)\s?(?:x|×|%|s|ms|MB|MiB|GB|KB|kB)?\**\s*$")
#: A ratio typed in prose (``1.26x``): each needs a marker.
_RATIO = re.compile(r"(?<![\w.])(\d+\.\d+)[x×](?!\w)")
#: A column quoted in another unit or against another column of its row: ``COLUMN*FACTOR``, ``COLUMN/DIVISOR``.
_SCALED = re.compile(r"(.+?)([*/])(.+)")


@dataclass(frozen=True)
class Quote:
    """One marked figure: where it is, the number typed and the table cell it quotes."""

    path: Path
    line: int
    typed: str
    record: str
    row: str
    column: str

    def where(self) -> str:
        """``file:line`` of the quote."""
        return f"{self.path.name}:{self.line}"


def quotes(path: Path) -> tuple[list[Quote], list[str]]:
    """The marked figures of a Markdown file, and the markers that follow no number (as problems)."""
    found: list[Quote] = []
    problems: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.count("<!-- fig ") > len(_MARKER.findall(line)):
            problems.append(f"{path.name}:{number}: a figure marker is not '<!-- fig RECORD ROW COLUMN -->'")
        for m in _MARKER.finditer(line):
            if line[:m.start()].count("`") % 2:  # quoted in code, not a marker
                continue
            figure = _FIGURE.search(line[:m.start()])
            if figure is None:
                problems.append(f"{path.name}:{number}: marker '{m.group(0)}' follows no number")
                continue
            found.append(Quote(path, number, figure.group(1), *m.groups()))
    return found, problems


def _rows(results: Path, record: str) -> tuple[str, list[dict[str, str]]]:
    """The named table's file name and rows (cells as text); LookupError when it is missing or ambiguous."""
    folder, _, table = record.partition("/")
    if not table:
        tables = sorted((results / folder).glob("*.csv"))
        if len(tables) != 1:
            raise LookupError(f"docs/results/{folder} holds {len(tables)} tables: name one as {folder}/<table>")
        table = tables[0].stem
    path = results / folder / f"{table}.csv"
    if path.is_file():
        with path.open(newline="") as fh:
            return path.name, list(csv.DictReader(fh))
    stem, _, key = table.rpartition(".")
    path = results / folder / f"{stem}.json"
    if not stem or not path.is_file():
        raise LookupError(f"no recorded table docs/results/{folder}/{table}.csv")
    rows = json.loads(path.read_text()).get(key)
    if not isinstance(rows, list):
        raise LookupError(f"docs/results/{folder}/{path.name} has no list {key!r}")
    return f"{path.name}:{key}", [{k: str(v) for k, v in r.items()} for r in rows]


def check_quote(quote: Quote, results: Path) -> str | None:
    """Why ``quote`` does not match its record (None when it does).

    The typed number matches when the recorded value rounded to the typed number's decimals equals it (either
    neighbour of a value halfway between two, such as an accuracy of 0.8935 typed as 0.893 or 0.894).
    """
    try:
        name, rows = _rows(results, quote.record)
    except LookupError as err:
        return f"{quote.where()}: {err}"
    if not rows:
        return f"{quote.where()}: {name} has no rows"
    first = next(iter(rows[0]))
    wanted = dict(kv.split("=", 1) for kv in quote.row.split(",")) if "=" in quote.row else {first: quote.row}
    match = [r for r in rows if all(_same(r.get(k), v) for k, v in wanted.items())]
    if len(match) != 1:
        return f"{quote.where()}: {len(match)} rows of {name} match {quote.row!r} (need exactly 1)"
    column, op, by = quote.column, "*", "1"
    if (m := _SCALED.fullmatch(quote.column)) and m.group(1) in match[0]:
        column, op, by = m.groups()
    cell = match[0].get(column)
    if cell is None:
        return f"{quote.where()}: {name} has no column {column!r}"
    try:
        factor = float(match[0].get(by, by))
        value = float(cell) * factor if op == "*" else float(cell) / factor
        if math.isnan(value):
            raise ValueError(value)
    except (ValueError, ZeroDivisionError):
        return f"{quote.where()}: {quote.column} of {quote.row!r} is not a number ({cell!r}, {by!r})"
    decimals = len(quote.typed.partition(".")[2])
    if abs(value - float(quote.typed)) > 0.5 * 10.0 ** -decimals + 1e-9 * max(1.0, abs(value)):
        return (f"{quote.where()}: typed {quote.typed}, but {quote.record} {quote.row} {quote.column} is "
                f"{value:.{decimals + 2}f} (rounds to {round(value, decimals):.{decimals}f})")
    return None


def _same(cell: str | None, wanted: str) -> bool:
    """A key cell equals the wanted value as text or as a number (``0.1`` matches ``0.10``)."""
    if cell is None:
        return False
    if cell == wanted:
        return True
    try:
        return math.isclose(float(cell), float(wanted))
    except ValueError:
        return False


def unmarked_ratios(path: Path) -> list[str]:
    """Ratio figures (``1.26x``) of a Markdown file that carry no marker."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        marked = {m.start() for m in _MARKER.finditer(line)}
        for m in _RATIO.finditer(line):
            if m.end() not in marked:
                out.append(f"{path.name}:{number}: ratio {m.group(0)} has no '<!-- fig ... -->' marker")
    return out


def check_documents(paths: list[Path], results: Path) -> list[str]:
    """Every problem of the figures quoted in ``paths``: mismatches, bad markers, unmarked ratios."""
    problems: list[str] = []
    for path in paths:
        found, bad = quotes(path)
        problems += bad + unmarked_ratios(path)
        problems += [p for q in found if (p := check_quote(q, results)) is not None]
    return problems
