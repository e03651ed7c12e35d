"""The client's Flower records for the array codec (:mod:`protocols.wire.arrays`): named arrays -> ``ArrayRecord``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from protocols.wire.arrays import array_fields


def to_record(weights: Mapping[str, np.ndarray], dtype: type | None = np.float64) -> ArrayRecord:
    """Named arrays -> ArrayRecord with ``dtype`` on the wire (None keeps each array's own dtype)."""
    return ArrayRecord({k: Array(**f) for k, f in array_fields(weights, dtype).items()})
