"""Message parts every method shares: the round number of a round's messages and the train reply's metrics.

Also the typed readers the protocol modules build their decoders from: each
takes the record and the key, and raises :class:`ViewError` naming the key when it
is missing or has the wrong type.  Node ids travel as decimal strings
(they are unsigned 64-bit; Flower's ConfigRecord integers are signed).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_ROUND = "round"
_NUM_EXAMPLES = "num-examples"
#: Peak resident memory of the client process so far, MiB (a cost diagnostic: in deployment every message runs
#: in a fresh process, so it is that client's peak; under Flower simulation, the peak of the worker running it).
PEAK_RSS_MB = "peak-rss-mb"
#: Record of a train message that carries the previous round's unmasking (a ``RecoveryRequest``), and of the
#: train reply that answers it (a ``RecoveryReply``; :mod:`protocols.wire.recovery`): run-config ``unmask-next-round``.
UNMASK_RECORD = "unmask"

_MISSING = object()


class ViewError(ValueError):
    """A message a node refuses for what it says (a missing or malformed key, a view it cannot accept).

    Its text names keys and what the message itself says, never the node's data or noise: a ClientApp sends it to
    the server as is (:mod:`client.errors`), where other exceptions' texts are withheld.
    """


# ------------------------------------------------------------------ readers
def _absent(rec: Mapping[str, Any], key: str, default: Any) -> bool:
    """True when ``key`` is absent and has a default; ValueError when it is absent and required."""
    if key in rec:
        return False
    if default is _MISSING:
        raise ViewError(f"message lacks '{key}'")
    return True


def read_int(rec: Mapping[str, Any], key: str, *, minimum: int | None = None, default: Any = _MISSING) -> int:
    """An integer (bool rejected), optionally ``>= minimum``."""
    if _absent(rec, key, default):
        return default
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ViewError(f"'{key}' must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ViewError(f"'{key}' must be >= {minimum}, got {value}")
    return int(value)


def read_float(rec: Mapping[str, Any], key: str, *, default: Any = _MISSING) -> float:
    """A finite number."""
    if _absent(rec, key, default):
        return default
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ViewError(f"'{key}' must be a finite number, got {value!r}")
    return float(value)


def read_str(rec: Mapping[str, Any], key: str, *, default: Any = _MISSING) -> str:
    """A string."""
    if _absent(rec, key, default):
        return default
    value = rec[key]
    if not isinstance(value, str):
        raise ViewError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def read_bytes(rec: Mapping[str, Any], key: str, *, length: int | None = None, default: Any = _MISSING) -> bytes:
    """A byte string, optionally of exactly ``length`` bytes."""
    if _absent(rec, key, default):
        return default
    value = rec[key]
    if not isinstance(value, bytes):
        raise ViewError(f"'{key}' must be bytes, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ViewError(f"'{key}' must hold {length} bytes, got {len(value)}")
    return bytes(value)


def read_list(rec: Mapping[str, Any], key: str, item: type | tuple[type, ...], *, default: Any = _MISSING) -> list:
    """A list whose items are all of type ``item`` (bool never counts as int)."""
    if _absent(rec, key, default):
        return default
    value = rec[key]
    if not isinstance(value, list | tuple):
        raise ViewError(f"'{key}' must be a list, got {type(value).__name__}")
    if any(isinstance(v, bool) or not isinstance(v, item) for v in value):
        raise ViewError(f"'{key}' holds an item that is not {item}")
    return list(value)


def read_node_ids(rec: Mapping[str, Any], key: str, *, default: Any = _MISSING) -> tuple[int, ...]:
    """Node ids sent as decimal strings, each an unsigned 64-bit value."""
    if _absent(rec, key, default):
        return default
    try:
        ids = tuple(int(v) for v in read_list(rec, key, str))
    except ValueError as err:
        if "'" + key + "'" in str(err):
            raise
        raise ViewError(f"'{key}' holds a node id that is not a decimal integer") from None
    if any(not 0 <= n < 2**64 for n in ids):
        raise ViewError(f"'{key}' holds a node id outside the unsigned 64-bit range")
    return ids


def node_id_strings(ids: Iterable[int]) -> list[str]:
    """Encode node ids for a ConfigRecord (decimal strings)."""
    return [str(int(n)) for n in ids]


def merge_configs(*parts: Mapping[str, Any]) -> dict[str, Any]:
    """One config from several message parts (a key two parts both set must agree)."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key in out and out[key] != value:
                raise ViewError(f"message parts disagree on '{key}'")
            out[key] = value
    return out


# ------------------------------------------------------------ the round number
@dataclass(frozen=True)
class TrainIns:
    """What every message of a round carries: its round number (base of every train config)."""

    round: int

    def to_config(self) -> dict[str, Any]:
        return {_ROUND: int(self.round)}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> TrainIns:
        return cls(read_int(rec, _ROUND, minimum=0))


# ------------------------------------------------------------ train reply metrics
def train_metrics(num_examples: int, **figures: float) -> dict[str, int | float]:
    """The train reply's metrics (for a ``MetricRecord``): the local dataset size plus the method's figures."""
    if _NUM_EXAMPLES in figures:
        raise ValueError(f"'{_NUM_EXAMPLES}' is set from num_examples, not as a figure")
    return {_NUM_EXAMPLES: int(num_examples), PEAK_RSS_MB: peak_rss_mb(), **{k: float(v) for k, v in figures.items()}}


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (``getrusage``; 0 where unavailable)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def num_examples(metrics: Mapping[str, Any]) -> int:
    """The ``|D_i|`` a train reply reports."""
    value = metrics[_NUM_EXAMPLES] if _NUM_EXAMPLES in metrics else None
    if value is None:
        raise ValueError(f"train reply lacks '{_NUM_EXAMPLES}'")
    return int(value)


def mean_metrics(metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Example-weighted mean of every numeric metric of several train replies (+ their total examples).

    Each metric is averaged over the replies that report it (a node may withhold one:
    :func:`client.floor.withhold_unprotected`).  For a ``MetricRecord``.
    """
    sizes = [float(num_examples(m)) for m in metrics]
    keys = set().union(*(m.keys() for m in metrics)) - {_NUM_EXAMPLES}
    out = {}
    for k in keys:
        held = [(float(m[k]), n) for m, n in zip(metrics, sizes, strict=True) if k in m]
        weight = sum(n for _v, n in held)
        out[k] = sum(v * n for v, n in held) / weight if weight > 0 else sum(v for v, _n in held) / len(held)
    out[_NUM_EXAMPLES] = sum(sizes)
    return out


#: Environment variable of a node's process that lets ``cancellation-check`` send measured-noise diagnostics (the
#: noise probes of a node asking for a guarantee, niss's noiseless update) (``1``/``true``/``yes``): tests and
#: benchmarks that measure the aggregate noise; never set it on a real node.
DIAGNOSTICS_ENV = "CANCELFL_DIAGNOSTICS"


def diagnostics_allowed() -> bool:
    """Whether this node's operator allows measured-noise diagnostics (:data:`DIAGNOSTICS_ENV`)."""
    from protocols.config import is_on

    return is_on(os.environ.get(DIAGNOSTICS_ENV, "").strip())
