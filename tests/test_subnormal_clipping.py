"""A record's clipped terms that floating point would round on its subnormal grid: the record adds at most the clip.

Crafted models (a server's choice) make a record's clip factor ``C / ||g||`` subnormal (an L1 norm near float32's
largest value), or its scaled output gradient ``s d`` subnormal before the sum multiplies it by a unit of ``1e38``
(:func:`protocols.per_example.clip_factors`), or its squared gradient norm round to 0 in the MP family's closed form
(:mod:`protocols.mpddp.gradients`).  These tests drive the real code on neighbouring datasets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _pytest.monkeypatch import MonkeyPatch

import client.methods.ddpsa as ddpsa_client
from protocols.config import RunConfig
from protocols.mpddp import clipped_client_gradients, mask_reference
from protocols.privacy import l1_sensitivity, resolving_dtype, smallest_resolvable
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from server.defaults import app_defaults
from tests.ddpsa_setup import ddpsa_credentials
from tests.test_nonfinite_records import DDPSA, _ddpsa_push

pytestmark = pytest.mark.usefixtures("one_thread")

#: float32's smallest subnormal step.
ULP = float(np.finfo(np.float32).smallest_subnormal)


@pytest.mark.parametrize(("unit", "logits"), [
    (1e-7 / (1.05 * ULP), (50.0, 50.1, 0.0)),  # factor C / ||g||_1 of one subnormal step (L1 norm 7e37)
    (1e-7 / (0.525 * ULP), (20.7233, 0.0, -100.0)),  # a normal factor; s d = 0.525 steps times a unit of 1.4e38
])
def test_ddpsa_a_record_rounded_on_the_subnormal_grid_adds_at_most_the_clip(unit, logits, tmp_path,
                                                                           monkeypatch: MonkeyPatch) -> None:
    """The real ddpsa clients (noise 0, L1 Laplace, hidden layer): with and without a class-0 record (zero-out).

    Hidden unit 0 is ``unit`` for every record and feeds nothing; the output biases set a class-0 record's output
    gradient.  Measured without the rule: the record moved the sum by 1.90 times the clip (both cases).
    """
    clip = 1e-7
    raw = {**app_defaults(), **DDPSA, **ddpsa_credentials(tmp_path), "hidden": "8", "clip": clip,
           "adjacency": "zero-out", "ddpsa-frac-bits": 40}
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    x, y = ds.x_train[:100], ds.y_train[:100]
    rest = np.delete(np.arange(len(y)), int(np.flatnonzero(y == 0)[0]))
    weights = get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed))
    for w in weights.values():
        w[...] = 0.0
    keys = list(weights)
    weights[keys[1]][0] = unit
    weights[keys[-1]][0], weights[keys[-1]][1], weights[keys[-1]][2:] = logits
    for name in ("laplace_noise", "distributed_laplace_share"):
        monkeypatch.setattr(ddpsa_client, name, lambda n, *a, **k: np.zeros(n))
    sums = []
    for xs, ys in ((x, y), (x[rest], y[rest])):
        replies, pushed = _ddpsa_push(raw, monkeypatch, xs, ys, weights)
        assert not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
        sums.append(pushed[0])
    moved = float(np.abs(sums[0] - sums[1]).sum()) / l1_sensitivity(clip, adjacency="zero-out")
    assert moved <= 1.0 + 1e-4, moved


def _tiny_signal_at_a_large_unit() -> tuple[list[np.ndarray], torch.Tensor, torch.Tensor]:
    """``(mats, x, y)``: a float32 W-hat (hidden 8, 8 expanded: 5 matrices) and six records, three of class 0.

    A class-0 record's gradient signal at z_2 is ``6e-24`` and the unit it multiplies ``2^63``: the signal's square
    underflows, the product (``6e-5``) does not.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, 64, generator=gen)
    y = torch.zeros(6, 10)
    y[:3, 0] = y[3:, 1] = 1.0
    k, h, m3, eps = 2.0 ** 60, 2.0 ** 63, 2.0 ** -80, 2.0 ** -7
    mats = [np.zeros((9, 65), np.float32), *(np.zeros((9, 9), np.float32) for _ in range(3)),
            np.zeros((10, 9), np.float32)]
    mats[0][0, -1], mats[1][0, 0], mats[2][0, 0], mats[3][0, 0] = k, h / k, 1.0, m3  # h2[0] = 2^63, h4[0] = m3 h
    mats[4][0, 0], mats[4][1, 0] = 1 / (m3 * h), eps / (m3 * h)  # out_0 = 1 exactly, out_1 = eps
    return mats, x, y


def test_mp_a_record_whose_squared_signal_underflows_is_clipped() -> None:
    """:func:`clipped_client_gradients` (what the mpddp / mpcdp clients run) in float32, with and without record 0.

    Measured with ``||d||^2 ||h||^2``: the record's norm came out 6e-8 (true 6.1e-5) and it moved ``n`` times the
    uploaded mean gradient by 35.8 times the clip.
    """
    mats, x, y = _tiny_signal_at_a_large_unit()
    clip, rho = 1e-6, mask_reference(np.asarray(mats[-1], np.float64))
    sums = []
    for keep in (slice(None), slice(1, None)):
        up, _ = clipped_client_gradients(mats, x[keep], y[keep], clip, rho=rho)
        sums.append(torch.cat([g.double().ravel() for g in up.grads]) * len(y[keep]))
    moved = float((sums[0] - sums[1]).norm()) / clip
    assert moved <= 1.0 + 1e-4, moved


def test_a_clip_below_float32s_resolution_computes_in_float64_and_below_float64s_is_refused() -> None:
    """:func:`resolving_dtype`: the dtype the DDP-SA and MP clients compute their clipped sums in."""
    f32 = smallest_resolvable(float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny))
    f64 = smallest_resolvable(float(np.finfo(np.float64).max), float(np.finfo(np.float64).tiny))
    assert resolving_dtype(1.0) == "float32" and resolving_dtype(1.0, "float64") == "float64"
    assert resolving_dtype(f32 / 2) == "float64" and resolving_dtype(f64 * 2) == "float64"
    assert resolving_dtype(f64 / 2) is None
