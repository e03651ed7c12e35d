"""Named model arrays <-> one flat float64 vector (the layout every protocol adds noise to).

Flower-free and torch-free: the server (aggregation), the clients (noise) and the tests share it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

Weights = OrderedDict[str, np.ndarray]


def flatten(weights: dict[str, np.ndarray]) -> np.ndarray:
    """Concatenate named arrays into one float64 vector (in key order)."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in weights.values()]) if weights else np.zeros(0)


def unflatten(vector: np.ndarray, like: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """Split a flat vector back into arrays shaped like ``like``."""
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    pos = 0
    for k, v in like.items():
        n = int(np.prod(np.shape(v)))
        out[k] = np.asarray(vector[pos:pos + n], dtype=np.float64).reshape(np.shape(v))
        pos += n
    if pos != len(vector):
        raise ValueError(f"vector has {len(vector)} entries, model needs {pos}")
    return out


def weighted_average(uploads: list[dict[str, np.ndarray]], weights: list[float]) -> Weights:
    """``sum_i w_i x_i / sum_i w_i`` per array, in float64 (ValueError when the weights sum to <= 0)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("aggregation weights sum to zero")
    out: Weights = OrderedDict()
    for k in uploads[0]:
        acc = np.zeros_like(uploads[0][k], dtype=np.float64)
        for up, w in zip(uploads, weights, strict=True):
            acc += (w / total) * up[k]
        out[k] = acc
    return out
