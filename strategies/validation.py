"""Checks every train reply passes before it reaches a method's aggregation, and the exclusion record.

The round template (:meth:`strategies.base.CancelStrategy.aggregate_train`) screens each reply with
:class:`ReplyScreen`; a failing reply is excluded with a named reason (logged, in the round's ``excluded``) and
the rest are aggregated.  Checks, in order:

1. size: at most :func:`size_limit` (twice the expected float64 upload + 1 MiB for configs and metrics);
2. ``num-examples``: an integer in ``[1, cap]``, ``cap`` the largest known partition
   (:attr:`CancelStrategy.max_examples`), else ``MEDIAN_EXAMPLE_FACTOR x`` the round's median claim;
3. arrays: exactly the expected names, allowed dtype, expected shape, finite values;
4. magnitude: the update norm at most :meth:`CancelStrategy.norm_limit` (clipping bound plus a Gaussian tail
   bound of the noise), else at most ``OUTLIER_FACTOR x`` the round's median update norm.

:class:`Strikes` counts a node's consecutive exclusions and leaves it out after ``max-strikes``; a dropout gets
no strike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log

from protocols.wire.arrays import array_view
from protocols.wire.common import num_examples

#: Tail factor t of the Gaussian norm bound ``||N(0, s^2 I_d)|| <= s (sqrt(d) + t)``, exceeded with
#: probability <= exp(-t^2 / 2) (Gaussian concentration of a 1-Lipschitz function): ~1.3e-14 for t = 8.
GAUSS_TAIL = 8.0
#: Methods without a clipping guarantee: an update norm above this multiple of the round's median is excluded.
OUTLIER_FACTOR = 25.0
#: Without known partition sizes: a num-examples claim above this multiple of the round's median is excluded.
MEDIAN_EXAMPLE_FACTOR = 10.0
#: Bytes allowed for configs and metrics on top of the arrays.
META_BYTES = 1 << 20
#: Floating dtypes an upload may use on the wire (methods narrow it).
FLOAT_DTYPES = ("float32", "float64")


def payload_bytes(content: RecordDict) -> int:
    """Bytes of arrays, configs and metrics in a message (what travels, minus framing).

    Flower 1.41's ``ConfigRecord.count_bytes`` indexes ``v[0]`` of every list and
    raises IndexError on an empty one (SecAgg+ sends empty lists); such a list
    carries only its key, so it is counted as the key's length.
    """
    total = 0
    for rec in content.values():
        if isinstance(rec, ConfigRecord) and any(isinstance(v, list) and not v for v in rec.values()):
            total += sum(len(k) for k, v in rec.items() if isinstance(v, list) and not v)
            rec = ConfigRecord({k: v for k, v in rec.items() if not (isinstance(v, list) and not v)})
        total += rec.count_bytes()
    return total


@dataclass(frozen=True)
class ArraySpec:
    """What one uploaded array must look like."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...] = FLOAT_DTYPES


#: Expected upload: array name -> spec, in wire order (empty: the method uploads no arrays).
UploadSpec = Mapping[str, ArraySpec]


def spec_like(record: ArrayRecord, dtypes: tuple[str, ...] = FLOAT_DTYPES) -> dict[str, ArraySpec]:
    """An upload spec with the names and shapes of ``record`` (e.g. the global model)."""
    return {k: ArraySpec(tuple(int(s) for s in a.shape), dtypes) for k, a in record.items()}


def size_limit(spec: UploadSpec) -> int:
    """Largest reply accepted for an upload of ``spec``: twice its float64 size plus :data:`META_BYTES`."""
    return 2 * sum(8 * math.prod(s.shape) for s in spec.values()) + META_BYTES


def gaussian_norm_bound(std: float, dim: int) -> float:
    """``std (sqrt(dim) + GAUSS_TAIL)``: the norm of N(0, std^2 I_dim) stays below it except with prob ~1e-14."""
    return float(std) * (math.sqrt(dim) + GAUSS_TAIL)


def check_arrays(content: RecordDict, spec: UploadSpec) -> tuple[str | None, np.ndarray | None]:
    """``(reason, flat float64 upload)``: reason is None when the arrays match ``spec`` and are finite."""
    if not spec:
        return None, np.zeros(0)
    if "arrays" not in content or not isinstance(content["arrays"], ArrayRecord):
        return "missing upload (no 'arrays' record)", None
    record = content["arrays"]
    missing = [k for k in spec if k not in record]
    if missing:
        return f"missing array(s) {missing[:3]}", None
    extra = [k for k in record if k not in spec]
    if extra:
        return f"unexpected array(s) {extra[:3]}", None
    views = []
    for name, want in spec.items():
        try:
            view = array_view(record[name])
        except ValueError as err:
            return f"malformed array '{name}': {err}", None
        if view.dtype.name not in want.dtypes:
            return f"array '{name}' has dtype {view.dtype.name}, expected one of {list(want.dtypes)}", None
        if tuple(view.shape) != want.shape:
            return f"array '{name}' has shape {tuple(view.shape)}, expected {want.shape}", None
        # A finite sum has finite terms (NaN and inf propagate); only a non-finite sum needs the element test.
        if not np.isfinite(np.add.reduce(view, axis=None, dtype=np.float64)) and not np.isfinite(view).all():
            return f"array '{name}' holds non-finite values (NaN or inf)", None
        views.append(view)
    flat = np.empty(sum(v.size for v in views), dtype=np.float64)
    at = 0
    for view in views:
        flat[at:at + view.size] = view.ravel()
        at += view.size
    return None, flat


def claimed_examples(content: RecordDict) -> tuple[str | None, int | None]:
    """``(reason, num-examples)`` of a train reply's metrics (reason None when it is an integer >= 1)."""
    if "metrics" not in content or not isinstance(content["metrics"], MetricRecord):
        return "missing metrics (no 'metrics' record)", None
    try:
        raw = content["metrics"]["num-examples"] if "num-examples" in content["metrics"] else None
        n = num_examples(content["metrics"])
    except (ValueError, TypeError, OverflowError) as err:
        return f"unreadable num-examples ({err})", None
    if isinstance(raw, float) and not (math.isfinite(raw) and raw.is_integer()):
        return f"num-examples = {raw!r} is not an integer", None
    if n < 1:
        return f"num-examples = {n} < 1", None
    return None, n


@dataclass
class Screened:
    """Outcome of screening one round's replies."""

    #: Replies that passed, by node.
    accepted: dict[int, Message]
    #: node -> reason of every excluded reply.
    excluded: dict[int, str]
    #: node -> the norm of its update (``reference(node, flat upload)``) for the accepted replies.
    norms: dict[int, float] = field(default_factory=dict)


class ReplyScreen:
    """Screens one round's replies against a spec, an example cap and per-node norm limits."""

    def __init__(self, spec: UploadSpec, *, max_examples: int | None, max_bytes: int | None = None) -> None:
        self.spec = dict(spec)
        self.max_examples = max_examples
        self.max_bytes = size_limit(self.spec) if max_bytes is None else max_bytes

    def screen(self, replies: Mapping[int, Message], reference, limit) -> Screened:
        """Check every reply; ``reference(node, flat) -> update`` and ``limit(node) -> bound | None``.

        Replies without a method bound (``limit`` None) are compared with the round's median update norm.
        """
        out = Screened({}, {})
        claims: dict[int, int] = {}
        for node, reply in sorted(replies.items()):
            size = payload_bytes(reply.content)
            if size > self.max_bytes:
                out.excluded[node] = f"payload of {size} bytes exceeds the limit of {self.max_bytes}"
                continue
            why, n = claimed_examples(reply.content)
            if why is None and self.max_examples is not None and n > self.max_examples:
                why = f"num-examples = {n} exceeds the largest partition ({self.max_examples})"
            if why is None:
                why, flat = check_arrays(reply.content, self.spec)
            if why is not None:
                out.excluded[node] = why
                continue
            claims[node] = n
            out.accepted[node] = reply
            if self.spec:  # the norm now: the flat copy of a large upload is not kept
                out.norms[node] = float(np.linalg.norm(reference(node, flat)))
        if self.max_examples is None and len(claims) >= 3:
            median = float(np.median(list(claims.values())))
            for node, n in claims.items():
                if n > MEDIAN_EXAMPLE_FACTOR * median:
                    self._drop(out, node, f"num-examples = {n} exceeds {MEDIAN_EXAMPLE_FACTOR:g} x the round's median "
                                          f"({median:g})")
        if self.spec:
            self._check_norms(out, limit)
        return out

    def _check_norms(self, out: Screened, limit) -> None:
        norms = dict(out.norms)
        robust = []
        for node, norm in norms.items():
            bound = limit(node)
            if bound is None:
                robust.append(node)
            elif not norm <= bound:
                self._drop(out, node, f"update norm {norm:.4g} exceeds the method's bound {bound:.4g}")
        if len(robust) >= 2:
            values = sorted(norms[n] for n in robust)
            median = values[(len(values) - 1) // 2]  # the lower median: an outlier cannot raise it
            cap = OUTLIER_FACTOR * median
            for node in robust:
                if median > 0 and norms[node] > cap:
                    self._drop(out, node, f"update norm {norms[node]:.4g} exceeds {OUTLIER_FACTOR:g} x the round's "
                                          f"median ({median:.4g})")

    @staticmethod
    def _drop(out: Screened, node: int, reason: str) -> None:
        out.accepted.pop(node, None)
        out.norms.pop(node, None)
        out.excluded[node] = reason


class Strikes:
    """Consecutive exclusions per node; a node with ``max_strikes`` in a row is left out of later rounds."""

    def __init__(self, max_strikes: int) -> None:
        self.max_strikes = max_strikes
        self.count: dict[int, int] = {}
        self.banned: dict[int, str] = {}

        self._before: dict[int, int] = {}

    def to_state(self) -> dict:
        """JSON state (checkpoint/resume): strike counts and banned nodes, node ids as strings."""
        return {"count": {str(n): c for n, c in self.count.items()},
                "banned": {str(n): why for n, why in self.banned.items()}}

    def load_state(self, state: Mapping) -> None:
        """Inverse of :meth:`to_state`."""
        self.count = {int(n): int(c) for n, c in state.get("count", {}).items()}
        self.banned = {int(n): str(why) for n, why in state.get("banned", {}).items()}

    def record(self, server_round: int, excluded: Mapping[int, str], accepted: Iterable[int]) -> None:
        """The round's screening: strike every excluded node, clear the accepted ones, ban at ``max_strikes``."""
        self._before = dict(self.count)
        for node in accepted:
            self.count.pop(node, None)
        for node, reason in excluded.items():
            self.strike(server_round, node, reason)

    def strike(self, server_round: int, node: int, reason: str) -> None:
        """One strike for ``node`` this round (once per round, on top of its earlier rounds); ban at ``max_strikes``."""
        before = self._before.get(node, 0)
        if self.count.get(node, 0) > before:
            return  # already struck this round
        self.count[node] = before + 1
        log(WARNING, "round %d: node %s struck (%d in a row): %s", server_round, node, self.count[node], reason)
        if self.max_strikes and self.count[node] >= self.max_strikes and node not in self.banned:
            self.banned[node] = f"failed {self.count[node]} rounds in a row (last, round {server_round}: {reason})"
            log(WARNING, "node %s is left out of later rounds: %s", node, self.banned[node])


__all__ = ["ArraySpec", "FLOAT_DTYPES", "GAUSS_TAIL", "OUTLIER_FACTOR", "ReplyScreen", "Screened", "Strikes",
           "UploadSpec", "check_arrays", "claimed_examples", "gaussian_norm_bound", "payload_bytes", "size_limit",
           "spec_like"]


class RoundFailed(RuntimeError):
    """A round cannot produce a correct aggregate (raised, never a silent wrong model)."""


def non_finite_arrays(record: ArrayRecord) -> list[str]:
    """Names of the arrays of ``record`` holding NaN or inf."""
    return [k for k, a in record.items() if not np.isfinite(array_view(a)).all()]
