"""The wire helpers of strategies.base: fast ``Array`` construction is byte-identical to Flower's own."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array

from strategies.base import from_record, numpy_array, to_record

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
