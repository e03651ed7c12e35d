"""Each baseline end to end in a short in-process run, and the run outputs."""

from __future__ import annotations

import json

import pytest

from client.data import load_dataset
from client.models import load_npz_model
from client.training import evaluate


def test_fedavg_digits_learns_and_writes_outputs(run_inprocess, tmp_path):
    out = tmp_path / "fedavg"
    summary, rows = run_inprocess(method="fedavg", num_rounds=10, out_dir=str(out))
    assert summary["final_accuracy"] >= 0.85
    assert [r["round"] for r in rows] == list(range(1, 11))
    for key in ("test_accuracy", "test_loss", "epsilon", "round_time_s", "bytes_sent_per_client",
                "bytes_received_per_client"):
        assert key in rows[0]
    assert rows[0]["bytes_sent_per_client"] > 4 * 4000  # ~4.8k float32 parameters
    saved = json.loads((out / "summary.json").read_text())
    assert saved["config"]["method"] == "fedavg" and saved["epsilon"] is None  # null = no guarantee
    model, _ = load_npz_model(out / "model.npz")  # re-evaluate independently
    ds = load_dataset("digits")
    assert evaluate(model, ds.x_test, ds.y_test)[1] == pytest.approx(summary["final_accuracy"])


@pytest.mark.parametrize("method", ["ldp", "cdp"])
def test_dp_baselines_report_epsilon(run_inprocess, method):
    summary, rows = run_inprocess(method=method, num_rounds=4, epsilon=1.0)
    assert summary["epsilon"] == pytest.approx(1.0, rel=0.02)  # the calibrated budget is spent over the run
    eps = [r["epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    assert summary["method_parameters"]["noise_multiplier"] > 1


def test_ldp_noise_hurts_more_than_cdp_at_large_epsilon(run_inprocess):
    """Same epsilon: local noise (each upload) costs more accuracy than central noise (the mean)."""
    ldp, _ = run_inprocess(method="ldp", num_rounds=10, epsilon=50.0, num_clients=20)
    cdp, _ = run_inprocess(method="cdp", num_rounds=10, epsilon=50.0, num_clients=20)
    assert cdp["final_accuracy"] > ldp["final_accuracy"]
