"""Shared test fixtures: no Flower telemetry, outputs in tmp folders, fast in-process runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


class Crash(Exception):
    """Raised by :func:`crash_after`: a run killed mid-way (its checkpoint is what a crash leaves)."""


def crash_after(k: int):
    """A ``progress`` callback for ``run_inprocess`` that raises :class:`Crash` once round ``k`` is reported."""
    def progress(line: str) -> None:
        if line.startswith(f"round {k}/"):
            raise Crash(line)
    return progress


def read_metrics(out_dir: Path) -> list[dict]:
    """Rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def run_inprocess(tmp_path):
    """Run the app in-process with run-config overrides; returns (summary, metrics rows)."""
    from server.launch import run_inprocess as _run

    def _go(**overrides):
        overrides = {k.replace("_", "-"): v for k, v in overrides.items()}
        overrides.setdefault("out-dir", str(tmp_path / "run"))
        summary = _run(overrides, progress=lambda _s: None)
        return summary, read_metrics(Path(overrides["out-dir"]))

    return _go


@pytest.fixture
def unplanned_dropouts(monkeypatch):
    """``fn(rate)``: every round's grid withholds ``rate`` of the train messages as ``fault-drop-rate`` would.

    The run config does not say so: real dropouts the run did not plan for (the config refuses a planned rate its
    rounds cannot survive).
    """
    from strategies.run import loop
    from strategies.run.grid import MeteredGrid

    def withhold(rate: float) -> None:
        class Withholding(MeteredGrid):
            def __init__(self, inner, *, fault_rate: float = 0.0, seed: int = 0) -> None:
                super().__init__(inner, fault_rate=rate, seed=seed)

        monkeypatch.setattr(loop, "MeteredGrid", Withholding)

    return withhold


@pytest.fixture
def niss_diagnostics(monkeypatch):
    """Nodes of this process allow niss's noiseless-update diagnostic (tests that measure the aggregate noise)."""
    from protocols.wire.niss import DIAGNOSTICS_ENV

    monkeypatch.setenv(DIAGNOSTICS_ENV, "1")


@pytest.fixture
def one_thread():
    """Tiny models: multi-threaded torch kernels are much slower on a shared 2-core machine."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def task_identity(monkeypatch):
    """What a ServerApp process has set before it builds messages."""
    from flwr.supercore.task_identity import TaskIdentity

    for key, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, key, value)
