r"""Where a deployment round's time goes: the breakdown of a round trace (:mod:`protocols.trace`).

    cancelfl-bench roundtime --engine deployment --clients 4 --dataset digits --test-subset 0 --rounds 4 \
        --repeats 1 --methods fedavg,nadp --trace --out /tmp/trace     # writes roundtrace.md next to roundtime.md

Every message of a round is followed by its id through the processes that handle it: the ServerApp pushes it
(``push``), the SuperNode takes it from the SuperLink (``node_pull``), its warm ClientApp child runs Flower's
steps (``clientapp``), the SuperNode sends the reply (``node_push``) and the ServerApp pulls it (``reply``).
The segments (seconds, median over the timed rounds' messages of one type):

* ``to_node``: the ServerApp's push until the SuperNode's poll takes the message (its poll interval);
* ``to_fork``: the SuperNode pulls the message's objects and makes the task, its SuperExec's poll finds it,
  the shim starts, the zygote forks;
* ``start``: fork to the message in the child (Flower's runtime connection, message pull), ``fab``: FAB
  install, ``load``: the ClientApp's import, ``handle``: the handler (data, training, protection),
  ``reply``: the child's push of its reply;
* ``to_send``: until the SuperNode's reply wait sees the reply, ``send``: the SuperNode's push to the SuperLink,
  ``to_server``: until the ServerApp's pull takes it (its pull interval);
* ``total``: push to the reply in the ServerApp; ``cpu_*``: the child's CPU seconds per step, ``client_cpu``
  in all.

Per round: the round's wall time, each phase's wall time (first push to last reply), the ServerApp's own work
between phases (round minus phases) and after the round (evaluation, checkpoint), and the CPU seconds all the
deployment's processes spent in the round (``cluster_cpu_s``: what the round costs on a machine that runs
everything, whatever else loads it), of which the ServerApp's (``server_cpu_s``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

#: Segments of one message's path, in order: (name, start, end) over the joined events' times; consecutive
#: milestones of the path, so the segments add up to ``total`` (the ServerApp's push overlaps the SuperNode's
#: pull: the SuperLink hands the message out before the push call returns).
SEGMENTS = (
    ("to_node", "push.t", "node_pull.t_received"),
    ("to_fork", "node_pull.t_received", "clientapp.t_fork"),
    ("start", "clientapp.t_fork", "clientapp.pull_end"),
    ("fab", "clientapp.pull_end", "clientapp.fab_end"),
    ("load", "clientapp.fab_end", "clientapp.load_end"),
    ("handle", "clientapp.load_end", "clientapp.handle_end"),
    ("reply", "clientapp.handle_end", "clientapp.push_end"),
    ("to_send", "clientapp.push_end", "node_push.t_send"),
    ("send", "node_push.t_send", "node_push.t_end"),
    ("to_server", "node_push.t_end", "reply.t"),
    ("total", "push.t", "reply.t"),
)

#: CPU seconds of the child's steps (``clientapp.<step>_cpu``) and in all (``clientapp.cpu``).
CPU = (("cpu_start", "clientapp.pull_cpu"), ("cpu_fab", "clientapp.fab_cpu"), ("cpu_load", "clientapp.load_cpu"),
       ("cpu_handle", "clientapp.handle_cpu"), ("cpu_reply", "clientapp.push_cpu"), ("client_cpu", "clientapp.cpu"))


def load_events(path: Path) -> list[dict]:
    """The trace file's events (lines that do not parse are skipped: a process killed mid-write)."""
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _flat(ev: dict, prefix: str) -> dict[str, float]:
    out = {}
    for k, v in ev.items():
        if isinstance(v, list) and len(v) == 3:  # a timed step: [start, end, cpu]
            out[f"{prefix}.{k}_start"], out[f"{prefix}.{k}_end"], out[f"{prefix}.{k}_cpu"] = v
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}.{k}"] = float(v)
    return out


def message_paths(events: list[dict]) -> list[dict]:
    """One dict per server message: every event's times under ``<event>.<field>``, plus ``message_type``."""
    paths: dict[str, dict] = {}
    for ev in events:
        if ev["event"] == "push":
            for mid in ev["message_ids"]:
                paths[mid] = {"message_type": ev["message_type"], **_flat(ev, "push")}
    for ev in events:
        mid = {"node_pull": ev.get("message_id"), "clientapp": ev.get("message_id"),
               "node_push": ev.get("reply_to"), "reply": ev.get("reply_to")}.get(ev["event"])
        if mid in paths:
            paths[mid].update(_flat(ev, ev["event"]))
    return list(paths.values())


def _segment(p: dict, start: str, end: str) -> float:
    a, b = p.get(start), p.get(end)
    return b - a if a is not None and b is not None else math.nan


def breakdown(events: list[dict], *, skip_rounds: int = 1) -> tuple[list[dict], list[dict]]:
    """Per (method, message type): median segment seconds; per method: median round composition.

    Rounds ``<= skip_rounds`` (start-up, the first key phase) are left out.
    """
    rounds = [e for e in events if e["event"] == "round" and e["round"] > skip_rounds]
    paths = message_paths(events)

    def round_of(t: float) -> dict | None:
        return next((r for r in rounds if r["t"] <= t <= r["t_end"]), None)

    seg_rows: dict[tuple[str, str], list[dict]] = defaultdict(list)
    phase_walls: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for p in paths:
        r = round_of(p["push.t"])
        if r is None:
            continue
        seg_rows[(r["method"], p["message_type"])].append(p)
        phase_walls[(id(r), p["message_type"])]["start"].append(p["push.t"])
        phase_walls[(id(r), p["message_type"])]["end"].append(p.get("reply.t", math.nan))
    segments = []
    for (method, mtype), ps in seg_rows.items():
        row = {"method": method, "message": mtype, "messages": len(ps)}
        for name, a, b in SEGMENTS:
            row[name] = median([_segment(p, a, b) for p in ps])
        for name, key in CPU:
            row[name] = median([p.get(key, math.nan) for p in ps])
        segments.append(row)
    per_round: dict[str, list[dict]] = defaultdict(list)
    for r in rounds:
        comp = {"round_s": r["t_end"] - r["t"], "evaluate_s": r["t_evaluated"] - r["t_end"],
                "after_s": r["t_next"] - r["t_evaluated"], "cluster_cpu_s": r.get("cpu", math.nan),
                "server_cpu_s": r.get("server_cpu", math.nan)}
        walls = 0.0
        for (rid, mtype), w in phase_walls.items():
            if rid == id(r):
                comp[f"phase {mtype}"] = max(w["end"]) - min(w["start"])
                walls += comp[f"phase {mtype}"]
        comp["server_between_s"] = comp["round_s"] - walls
        per_round[r["method"]].append(comp)
    composition = []
    for method, comps in per_round.items():
        keys = sorted({k for c in comps for k in c})
        composition.append({"method": method, "rounds": len(comps),
                            **{k: median([c.get(k, math.nan) for c in comps]) for k in keys}})
    return segments, composition


def median(values: list[float]) -> float:
    """Median of the values that are not None or NaN (NaN when none is left)."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return float(np.median(vals)) if vals else math.nan


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) and not math.isnan(v) else ("-" if isinstance(v, float) else str(v))


def render(segments: list[dict], composition: list[dict]) -> str:
    """Both tables as markdown."""
    lines = ["## Where a deployment round's time goes", "", "Per message (seconds, median over the timed rounds):", ""]
    cols = ["method", "message", "messages", *(n for n, _, _ in SEGMENTS), *(n for n, _ in CPU)]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, math.nan)) for c in cols) + " |" for r in segments]
    keys = sorted({k for c in composition for k in c} - {"method", "rounds", "round_s"})
    cols = ["method", "rounds", "round_s", *keys]
    lines += ["", "Per round (seconds, median over the timed rounds):", "",
              "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, math.nan)) for c in cols) + " |" for r in composition]
    return "\n".join(lines) + "\n"


def write_breakdown(trace_file: Path, out: Path) -> Path:
    """Write ``roundtrace.md`` (and ``roundtrace.json``) of ``trace_file`` into ``out``; returns the markdown path."""
    segments, composition = breakdown(load_events(trace_file))
    (out / "roundtrace.json").write_text(json.dumps({"segments": segments, "rounds": composition}, indent=1))
    path = out / "roundtrace.md"
    path.write_text(render(segments, composition))
    return path


if __name__ == "__main__":
    import sys

    events = load_events(Path(sys.argv[1]))
    print(render(*breakdown(events)))
