"""Named numpy arrays <-> the fields of Flower's ``Array``: the array codec both sides of every method share.

Every upload and model travels as an ``ArrayRecord`` of ``.npy``-serialised arrays.  :func:`array_fields`
gives, per name, the four fields of an ``Array`` (``dtype``, ``shape``, ``stype``, ``data``); each side
builds the record from them with Flower's own constructors (``client.records`` and ``strategies.records``, one
line each), and both decode with :func:`from_record` / :func:`array_view`, so the byte layout is defined once.
"""

from __future__ import annotations

import io
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from protocols.arrays import Weights

__all__ = ["NUMPY_STYPE", "Weights", "array_fields", "array_view", "from_record", "npy_fields"]

#: The ``stype`` of a numpy-serialised ``Array`` (Flower's ``SType.NUMPY``).
NUMPY_STYPE = "numpy.ndarray"


class NpyArray(Protocol):
    """What the decoders read of an array on the wire (Flower's ``Array`` has it)."""

    stype: str
    data: bytes

    def numpy(self) -> np.ndarray: ...


def npy_fields(value: np.ndarray) -> dict[str, Any]:
    """The fields of an ``Array`` holding exactly the bytes ``np.save`` writes, built without ``np.save``.

    ``Array(ndarray)`` runs ``np.save`` into a growing ``BytesIO``, which can cost more than the client's
    whole gradient step; here the .npy header is written by numpy's own ``format`` module and joined with
    the raw C-order buffer in one copy.  Returns ``{"dtype": str, "shape": tuple, "stype": NUMPY_STYPE,
    "data": bytes}`` (``Array(**fields)``).  Raises ``TypeError`` for object arrays.
    """
    value = np.asarray(value)
    if value.dtype.hasobject:
        raise TypeError("object arrays cannot be sent (np.save would need pickle)")
    if not value.flags.c_contiguous:
        value = np.array(value, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray would not)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(value))
    data = b"".join([header.getvalue(), memoryview(value).cast("B") if value.size else b""])
    return {"dtype": str(value.dtype), "shape": tuple(value.shape), "stype": NUMPY_STYPE, "data": data}


def array_fields(weights: Mapping[str, np.ndarray], dtype: type | None = np.float64) -> dict[str, dict[str, Any]]:
    """Named arrays -> named ``Array`` fields (:func:`npy_fields`) with ``dtype`` on the wire, in order.

    ``dtype`` None keeps each array's own dtype.  Pairwise-noise methods need float64: the masks must
    cancel to round-off.
    """
    return {k: npy_fields(np.asarray(v, dtype=dtype)) for k, v in weights.items()}


def array_view(array: NpyArray) -> np.ndarray:
    """A read-only, zero-copy ndarray over an ``Array``'s .npy bytes (``Array.numpy()`` copies them).

    For summing large uploads on the server without holding a second copy of each.  Refuses
    non-numpy payloads and non-numeric dtypes with ``ValueError``.
    """
    if array.stype != NUMPY_STYPE:
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


def from_record(record: Mapping[str, NpyArray]) -> Weights:
    """An ``ArrayRecord`` (any mapping of named arrays) -> named float64 arrays."""
    return OrderedDict((k, np.asarray(v.numpy(), dtype=np.float64)) for k, v in record.items())
