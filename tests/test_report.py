"""The report: `cancelfl compare` (README command 1's engine-independent part) and a single run's own report."""

from __future__ import annotations

import json

import pytest

from server.compare import compare
from server.launch import main, run_inprocess

PNG = b"\x89PNG\r\n\x1a\n"


def _png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 2000


def test_compare_writes_the_side_by_side_report(tmp_path):
    out = tmp_path / "cmp"
    report = compare(["fedavg", "ldp", "nadp"], epsilon=1.0, out=out, engine="inprocess",
                     overrides={"num-rounds": 2, "dataset": "digits"}, command="cancelfl compare ...",
                     inprocess=run_inprocess)
    assert report == out.resolve() / "report.md"
    for name in ("accuracy.png", "epsilon.png", "noise.png"):
        assert _png(out / name), name
    text = report.read_text()
    for method in ("fedavg", "ldp", "nadp"):
        assert f"| {method} |" in text
        run = out / method
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2
        # every run also wrote its own report
        assert (run / "report.md").is_file() and _png(run / "accuracy.png")
    assert "![accuracy per round](accuracy.png)" in text and "cancelfl compare ..." in text
    # The noise figures the report plots: nadp's upload noise cancels (far more noise in an upload than in the
    # model), ldp's independent noise only averages down by sqrt(clients), fedavg has none.
    noise = {m: [json.loads(line) for line in (out / m / "metrics.jsonl").read_text().splitlines()][-1]
             for m in ("fedavg", "ldp", "nadp")}
    assert noise["fedavg"]["upload_noise_std"] == 0 == noise["fedavg"]["model_noise_std"]
    ldp_ratio = noise["ldp"]["upload_noise_std"] / noise["ldp"]["model_noise_std"]
    nadp_ratio = noise["nadp"]["upload_noise_std"] / noise["nadp"]["model_noise_std"]
    # record-level ldp: each client's std follows its n_k (143-144 records here), so sqrt(10) up to 1 %
    assert ldp_ratio == pytest.approx(10 ** 0.5, rel=1e-2) and nadp_ratio > 2 * ldp_ratio
    assert "| fedavg | " in text and "| none | none |" in text  # fedavg: no guarantee in either direction


def test_compare_command_refuses_a_bad_method_or_key(tmp_path, capsys):
    assert main(["compare", "--methods", "fedavg,nope", "--out", str(tmp_path / "a")]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["compare", "--methods", "fedavg", "--run-config", "num-roundz=2", "--out", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "b" / "report.md").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "report.md").write_text("an earlier comparison")
    assert main(["compare", "--methods", "fedavg", "--out", str(tmp_path / "c")]) == 2
    assert "earlier comparison" in capsys.readouterr().err
