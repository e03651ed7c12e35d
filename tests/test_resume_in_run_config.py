"""Run-config ``resume = true`` continues the stored run as ``--resume`` does, and a refused resume loses no metrics."""

from __future__ import annotations

import pytest

from server.launch import main, run_inprocess
from strategies.run.checkpoint import ResumeError

RUN = {"dataset": "breast-cancer", "num-clients": 2, "num-rounds": 1}


@pytest.fixture
def finished(tmp_path):
    """A finished one-round fedavg run folder and its metrics.jsonl text."""
    out = tmp_path / "run"
    run_inprocess({**RUN, "out-dir": str(out)}, progress=lambda *_: None)
    text = (out / "metrics.jsonl").read_text()
    assert text.strip()
    return out, text


def test_a_resume_with_another_run_config_keeps_the_metrics(finished):
    out, text = finished
    with pytest.raises(ResumeError, match="differs from the checkpoint"):
        run_inprocess({**RUN, "lr": 0.5, "out-dir": str(out), "resume": True}, progress=lambda *_: None)
    assert (out / "metrics.jsonl").read_text() == text


def test_resume_true_in_the_run_config_continues_the_stored_run(finished, capsys):
    out, text = finished
    assert main(["run", "--run-config", f'resume=true out-dir="{out}"']) == 0, capsys.readouterr().err
    assert "resuming after round 1 of 1" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == text
