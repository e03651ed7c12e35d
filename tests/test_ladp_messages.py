"""LaDP noise report: what the client encodes the server decodes; inconsistent reports are refused by key."""

from __future__ import annotations

import math

import pytest
from flwr.app import MetricRecord

from protocols.wire.ladp import LayerNoise, NoiseReport

LAYERS = {
    "layers.0.weight": LayerNoise(noise_norm=3.0, sigma=0.1, selected=True, kl=1e-5),
    "layers.0.bias": LayerNoise(noise_norm=0.0, sigma=0.0, selected=False, kl=2e-6),
    "layers.1.weight": LayerNoise(noise_norm=4.0, sigma=0.2, selected=True, kl=3e-5),
}


def _report() -> NoiseReport:
    return NoiseReport(LAYERS, sensitivity=0.8, local_steps=12)


def test_summary_figures() -> None:
    r = _report()
    assert r.noised_layers == 2 and r.num_layers == 3 and r.unnoised_release
    assert r.total_noise_norm == pytest.approx(5.0)
    assert r.noise_norms() == {"noise_norm/layers.0.weight": 3.0, "noise_norm/layers.0.bias": 0.0,
                               "noise_norm/layers.1.weight": 4.0}
    all_noised = NoiseReport({k: LayerNoise(1.0, 0.1, True, 0.0) for k in LAYERS}, 0.8, 12)
    assert not all_noised.unnoised_release


def test_round_trip_through_a_metric_record() -> None:
    metrics = MetricRecord({"num-examples": 90, "train_loss": 0.3, **_report().to_metrics()})
    decoded = NoiseReport.from_metrics(metrics)
    assert decoded == _report()


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_layers", 4.0, "num_layers"),
    ("noised_layers", 3.0, "noised_layers"),
    ("total_noise_norm", 6.0, "total_noise_norm"),
    ("selected/layers.0.bias", 0.5, "selected/layers.0.bias"),
    ("local_steps", 1.5, "local_steps"),
    ("sigma/layers.1.weight", math.nan, "sigma/layers.1.weight"),
])
def test_inconsistent_report_names_the_key(key: str, value: float, match: str) -> None:
    metrics = _report().to_metrics()
    metrics[key] = value
    with pytest.raises(ValueError, match=match):
        NoiseReport.from_metrics(metrics)


def test_missing_per_layer_entry_is_named() -> None:
    metrics = _report().to_metrics()
    del metrics["kl/layers.0.bias"]
    with pytest.raises(ValueError, match="kl/layers.0.bias"):
        NoiseReport.from_metrics(metrics)
