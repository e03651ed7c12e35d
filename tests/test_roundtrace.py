"""The round trace (protocols.trace) and its breakdown (benchmarks.roundtrace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from benchmarks.roundtrace import SEGMENTS, breakdown, render
from protocols.trace import TRACE_ENV, trace, traced_cpu, tracing


def test_trace_appends_one_line_per_event_only_while_a_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.delenv(TRACE_ENV, raising=False)
    trace("push", t=1.0)
    assert not tracing() and not path.exists()
    monkeypatch.setenv(TRACE_ENV, str(path))
    trace("push", t=1.0, message_ids=["a"])
    trace("reply", t=2.0)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["push", "reply"] and lines[0]["message_ids"] == ["a"]
    assert lines[0]["pid"] == os.getpid()


def test_traced_cpu_counts_the_processes_tracing_into_the_same_file(tmp_path, monkeypatch):
    path = str(tmp_path / "t.jsonl")
    busy = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", busy], env={**os.environ, TRACE_ENV: path})
    other = subprocess.Popen([sys.executable, "-c", busy], env={**os.environ, TRACE_ENV: path + ".other"})
    try:
        monkeypatch.setenv(TRACE_ENV, path)
        deadline = time.time() + 60
        while traced_cpu() < 0.35 and time.time() < deadline:
            time.sleep(0.1)
        assert 0.35 <= traced_cpu() < 0.8  # the one busy process of this trace, not the other's
        monkeypatch.delenv(TRACE_ENV)
        assert traced_cpu() == 0.0
    finally:
        proc.kill()
        other.kill()
        proc.wait()
        other.wait()


def _message(mid: str, t: float, mtype: str = "train") -> list[dict]:
    """The five events of one message whose milestones are 0.1 s apart from ``t``."""
    step = [t + 0.1 * i for i in range(13)]
    return [
        {"event": "push", "t": step[0], "t_end": step[1], "message_type": mtype, "message_ids": [mid]},
        {"event": "node_pull", "t": step[0], "t_received": step[1], "t_end": step[2], "message_id": mid},
        {"event": "clientapp", "t_fork": step[2], "message_id": mid, "pull": [step[2], step[3], 0.01],
         "fab": [step[3], step[4], 0.01], "load": [step[4], step[5], 0.02], "handle": [step[5], step[6], 0.05],
         "push": [step[6], step[7], 0.01], "t_end": step[7], "cpu": 0.1},
        {"event": "node_push", "t": step[7], "t_send": step[8], "t_end": step[9], "reply_to": mid},
        {"event": "reply", "t_pull": step[9], "t": step[10], "reply_to": mid},
    ]


def test_the_breakdown_follows_each_message_and_its_segments_add_up():
    events = [{"event": "round", "round": 1, "method": "m", "t": 0.0, "t_end": 5.0, "t_evaluated": 5.1,
               "t_next": 5.2, "cpu": 1.0}]  # round 1: left out
    events += [{"event": "round", "round": 2, "method": "m", "t": 10.0, "t_end": 13.0, "t_evaluated": 13.5,
                "t_next": 13.7, "cpu": 0.8}]
    events += _message("x", 0.5) + _message("a", 10.0) + _message("b", 10.05) + _message("c", 11.5, "query.recover")
    segments, rounds = breakdown(events)
    train = next(r for r in segments if r["message"] == "train")
    assert train["messages"] == 2  # round 1's message is not timed
    parts = [train[name] for name, _, _ in SEGMENTS if name != "total"]
    assert abs(sum(parts) - train["total"]) < 1e-9 and abs(train["total"] - 1.0) < 1e-9
    assert abs(train["handle"] - 0.1) < 1e-9 and abs(train["cpu_handle"] - 0.05) < 1e-9
    (r,) = rounds
    assert abs(r["round_s"] - 3.0) < 1e-9 and abs(r["evaluate_s"] - 0.5) < 1e-9 and r["cluster_cpu_s"] == 0.8
    assert abs(r["phase train"] - 1.05) < 1e-9 and abs(r["phase query.recover"] - 1.0) < 1e-9
    assert abs(r["server_between_s"] - (3.0 - 2.05)) < 1e-9
    assert "| m | train | 2 |" in render(segments, rounds)
