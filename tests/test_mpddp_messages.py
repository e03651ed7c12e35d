"""The mpddp family's message vocabulary: every part round-trips through its encoder/decoder and refuses bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from client.records import to_record
from protocols.mpddp import ClientUpload, aggregate
from protocols.wire.arrays import from_record
from protocols.wire.common import TrainIns, merge_configs
from protocols.wire.mpddp import DdpNoise, NaiveNoise, PerturbedModel, mean_upload, upload_arrays, upload_from_record

RNG = np.random.default_rng(5)


def random_upload(dims: list[int]) -> ClientUpload:
    """A well-formed upload for an MLP with widths ``dims`` (grads, Psi, Phi of the trainable blocks)."""
    shapes = [(dims[i + 1], dims[i] + 1) for i in range(len(dims) - 1)]
    n_out = dims[-1]
    grads = tuple(torch.as_tensor(RNG.standard_normal(s)) for s in shapes)
    psi = tuple(torch.as_tensor(RNG.standard_normal((n_out, *s))) for s in shapes)
    phi = tuple(torch.as_tensor(RNG.standard_normal(s)) for s in shapes)
    return ClientUpload(grads, psi, phi)


def upload_record(upload: ClientUpload, side_dtype: str = "float64"):
    """The client's train reply record (each array in its wire dtype)."""
    return to_record(upload_arrays(upload, side_dtype), None)


def test_perturbed_model_roundtrip_and_validation() -> None:
    mats = tuple(RNG.standard_normal(s) for s in [(5, 4), (5, 5), (3, 5)])
    record = to_record(PerturbedModel(mats).to_arrays(), np.float64)
    assert all(a.dtype == "float64" for a in record.values())
    back = PerturbedModel.from_record(record)
    assert back.num_layers == 2 and all(np.array_equal(a, b) for a, b in zip(back.matrices, mats, strict=True))
    with pytest.raises(ValueError, match="L >= 2"):
        PerturbedModel(mats[:2])  # an even count is not an expanded model
    with pytest.raises(ValueError, match="matrix"):
        PerturbedModel((mats[0], mats[1], mats[2].ravel()))
    arrays = from_record(record)
    shuffled = {k: arrays[k] for k in reversed(list(arrays))}
    with pytest.raises(ValueError, match="in order"):
        PerturbedModel.from_arrays(shuffled)


def test_noise_scales_roundtrip_merge_and_validation() -> None:
    rec = merge_configs(TrainIns(3).to_config(), DdpNoise(0.5, 12.0).to_config())
    assert DdpNoise.from_config(rec) == DdpNoise(0.5, 12.0) and TrainIns.from_config(rec).round == 3
    assert NaiveNoise.from_config(NaiveNoise(0.25).to_config()) == NaiveNoise(0.25)
    with pytest.raises(ValueError, match="sigma-delta"):
        # sigma_Delta's entry dropped: the decoder names the missing key.
        DdpNoise.from_config(ConfigRecord({k: v for k, v in DdpNoise(1.0, 2.0).to_config().items() if v != 2.0}))
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="sigma"):
            NaiveNoise(bad)
        with pytest.raises(ValueError, match="sigma-eta"):
            DdpNoise(bad, 1.0)


def test_upload_roundtrip_side_dtype_and_streamed_mean() -> None:
    uploads = [random_upload([6, 4, 3]) for _ in range(4)]
    back = upload_from_record(upload_record(uploads[0]), 2)
    for a, b in zip(back.to_arrays(), uploads[0].to_arrays(), strict=True):
        assert np.array_equal(a, b)
    rec32 = upload_record(uploads[0], "float32")
    assert [a.dtype for a in rec32.values()] == ["float64"] * 2 + ["float32"] * 4  # gradients stay float64
    records = [(10 + i, upload_record(u)) for i, u in enumerate(uploads)]
    got, want = mean_upload(records, 2), aggregate(uploads)
    assert all(np.array_equal(a, b) for a, b in zip(got.to_arrays(), want.to_arrays(), strict=True))
    with pytest.raises(ValueError, match="expected arrays"):
        upload_from_record(upload_record(uploads[0]), 3)  # an upload of the wrong depth
    other = (99, upload_record(random_upload([6, 5, 3])))
    with pytest.raises(ValueError, match="node 99"):
        mean_upload([*records, other], 2)
    with pytest.raises(ValueError, match="no uploads"):
        mean_upload([], 2)
