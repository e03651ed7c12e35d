"""The array codec of protocols.wire.arrays: its ``Array`` fields are byte-identical to Flower's own ``Array``."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array
from flwr.common.constant import SType

from client.records import to_record
from protocols.wire.arrays import NUMPY_STYPE, array_view, from_record, npy_fields

RNG = np.random.default_rng(0)
CASES = [
    np.full((), 3.5),
    RNG.standard_normal(7),
    RNG.standard_normal((10, 32, 785)),
    RNG.standard_normal((5, 4)).astype(np.float32),
    RNG.integers(0, 2**62, (3, 3), dtype=np.int64),
    RNG.standard_normal((6, 4))[:, ::2],  # not contiguous
    np.asfortranarray(RNG.standard_normal((6, 4))),  # Fortran order
    np.zeros((0, 3)),
    RNG.standard_normal(5) > 0,
]


def numpy_array(value: np.ndarray) -> Array:
    return Array(**npy_fields(value))


def test_the_stype_is_flowers_numpy_stype() -> None:
    assert NUMPY_STYPE == SType.NUMPY


@pytest.mark.parametrize("value", CASES, ids=lambda v: f"{v.dtype}{v.shape}")
def test_numpy_array_is_byte_identical_to_flower(value: np.ndarray) -> None:
    fast = numpy_array(value)
    ref = Array(np.array(value, order="C"))
    assert fast.data == ref.data and fast.dtype == ref.dtype and fast.shape == ref.shape and fast.stype == ref.stype
    back = fast.numpy()
    assert back.dtype == value.dtype and back.shape == value.shape and np.array_equal(back, value)


def test_to_record_roundtrip_and_dtype() -> None:
    weights = {"a": RNG.standard_normal((3, 2)), "b": RNG.standard_normal(4)}
    rec = to_record(weights, np.float32)
    assert all(rec[k].dtype == "float32" for k in weights)
    back = from_record(to_record(weights))
    assert list(back) == ["a", "b"] and all(np.array_equal(back[k], weights[k]) for k in weights)


def test_object_arrays_are_refused() -> None:
    with pytest.raises(TypeError):
        numpy_array(np.array([object()]))


@pytest.mark.parametrize("value", [v for v in CASES if v.dtype != bool], ids=lambda v: f"{v.dtype}{v.shape}")
def test_array_view_is_zero_copy_and_equal(value: np.ndarray) -> None:
    arr = numpy_array(value)
    view = array_view(arr)
    assert view.dtype == value.dtype and view.shape == value.shape and np.array_equal(view, value)
    assert not view.flags.writeable  # a view of the message bytes, never modified in place
    if value.ndim >= 2:  # Flower may also write Fortran-ordered payloads
        assert np.array_equal(array_view(Array(np.asfortranarray(value))), value)


def test_array_view_refuses_bad_payloads() -> None:
    good = numpy_array(np.arange(6.0))
    truncated = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-8])
    with pytest.raises(ValueError, match="bytes"):
        array_view(truncated)
    with pytest.raises(ValueError, match="malformed"):
        array_view(Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=b"not an npy file"))
    with pytest.raises(ValueError, match="numeric"):
        array_view(Array(np.array(["a", "b"])))


def test_mean_upload_equals_protocol_aggregate() -> None:
    """The server's streamed mean over wire records is bit-identical to protocols.mpddp.aggregate."""
    import torch

    from protocols.mpddp import ClientUpload, aggregate
    from protocols.wire.mpddp import mean_upload

    shapes = [(4, 6), (3, 5), (3, 4, 6), (3, 3, 5), (4, 6), (3, 5)]  # L = 2: grads, psi, phi
    uploads = [[RNG.standard_normal(s) * 10.0**k for s in shapes] for k in range(5)]
    records = [(100 + i, to_record({f"up.{j}": a for j, a in enumerate(up)})) for i, up in enumerate(uploads)]
    got = mean_upload(records, 2)
    want = aggregate([ClientUpload.from_arrays(up) for up in uploads])
    for a, b in zip((*got.grads, *got.psi, *got.phi), (*want.grads, *want.psi, *want.phi), strict=True):
        assert torch.equal(a, b)
    bad = records[:2] + [(7, to_record({f"up.{j}": a[..., :-1] for j, a in enumerate(uploads[2])}))]
    with pytest.raises(ValueError, match="node 7"):
        mean_upload(bad, 2)
    with pytest.raises(ValueError, match="node 8"):
        mean_upload(records[:1] + [(8, to_record({"up.0": uploads[0][0]}))], 2)
