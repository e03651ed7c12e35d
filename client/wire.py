"""Flower records <-> numpy arrays: the wire helpers both sides of every method share.

Every upload and model travels as an ``ArrayRecord`` of ``.npy``-serialised arrays.  The
strategies (server side) and the client handlers use exactly these functions, so the byte
layout is defined once.
"""

from __future__ import annotations

import io
import math
from collections import OrderedDict

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

from protocols.arrays import Weights

__all__ = ["Weights", "array_view", "from_record", "numpy_array", "to_record"]


def numpy_array(value: np.ndarray) -> Array:
    """A Flower ``Array`` holding exactly the bytes ``np.save`` writes, built without ``np.save``.

    ``Array(ndarray)`` runs ``np.save`` into a growing ``BytesIO``, which can cost more than the client's
    whole gradient step; here the .npy header is written by numpy's own ``format`` module and joined with
    the raw C-order buffer in one copy.
    """
    value = np.asarray(value)
    if value.dtype.hasobject:
        raise TypeError("object arrays cannot be sent (np.save would need pickle)")
    if not value.flags.c_contiguous:
        value = np.array(value, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray would not)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(value))
    data = b"".join([header.getvalue(), memoryview(value).cast("B") if value.size else b""])
    return Array(dtype=str(value.dtype), shape=tuple(value.shape), stype=SType.NUMPY, data=data)


def to_record(weights: dict[str, np.ndarray], dtype: type | None = np.float64) -> ArrayRecord:
    """Named arrays -> ArrayRecord with ``dtype`` on the wire (None keeps each array's own dtype).

    Pairwise-noise methods need float64: the masks must cancel to round-off.
    """
    return ArrayRecord(OrderedDict((k, numpy_array(np.asarray(v, dtype=dtype))) for k, v in weights.items()))


def array_view(array: Array) -> np.ndarray:
    """A read-only, zero-copy ndarray over an ``Array``'s .npy bytes (``Array.numpy()`` copies them).

    For summing large uploads on the server without holding a second copy of each.  Refuses
    non-numpy payloads and non-numeric dtypes with ``ValueError``.
    """
    if array.stype != SType.NUMPY:
        raise ValueError(f"array is not numpy-serialised (stype {array.stype!r})")
    data = array.data
    header = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(header)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(header)
    except (ValueError, OSError) as err:
        raise ValueError(f"malformed .npy payload: {err}") from err
    if dtype.kind not in "biuf":
        raise ValueError(f"array dtype {dtype} is not numeric")
    count = math.prod(shape)
    if header.tell() + count * dtype.itemsize != len(data):
        raise ValueError(f"payload holds {len(data) - header.tell()} bytes, shape {shape} needs {count * dtype.itemsize}")
    view = np.frombuffer(data, dtype=dtype, count=count, offset=header.tell())
    return view.reshape(shape, order="F" if fortran else "C")


def from_record(record: ArrayRecord) -> Weights:
    """ArrayRecord -> named float64 arrays."""
    return OrderedDict((k, np.asarray(v.numpy(), dtype=np.float64)) for k, v in record.items())
