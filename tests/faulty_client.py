"""A faulty or malicious client for the tests: the real ClientApp, with chosen nodes' train replies corrupted.

:func:`faulty_grid` is a ``grid_factory`` for :func:`server.launch.run_inprocess`: it runs the real
ClientApp in a :class:`server.local_grid.LocalGrid` and rewrites the train reply of the nodes it is
told to, one corruption per node (:data:`CORRUPTIONS`), so the server sees exactly what a client
running modified code would send.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from client.records import to_record
from server.local_grid import LocalGrid

#: Extra bytes of an oversized reply (above the 1 MiB slack of strategies.validation.size_limit).
OVERSIZE = 3 << 20


def _arrays(content: RecordDict) -> OrderedDict[str, np.ndarray]:
    return OrderedDict((k, np.array(a.numpy())) for k, a in content["arrays"].items())


def with_arrays(content: RecordDict, arrays: dict[str, np.ndarray]) -> RecordDict:
    """``content`` with its upload replaced by ``arrays``."""
    out = RecordDict({k: v for k, v in content.items() if k != "arrays"})
    out["arrays"] = to_record(arrays, None)
    return out


def _set_first(content: RecordDict, value: float, add: bool = False) -> RecordDict:
    arrays = _arrays(content)
    first = next(iter(arrays))
    flat = arrays[first].reshape(-1)
    flat[0] = flat[0] + value if add else value
    return with_arrays(content, arrays)


def _reshape(content: RecordDict) -> RecordDict:
    arrays = _arrays(content)
    first = next(iter(arrays))
    arrays[first] = np.zeros(arrays[first].size + 1, dtype=arrays[first].dtype)
    return with_arrays(content, arrays)


def _retype(content: RecordDict) -> RecordDict:
    arrays = _arrays(content)
    first = next(iter(arrays))
    arrays[first] = arrays[first].astype(np.float16)
    return with_arrays(content, arrays)


def _drop_array(content: RecordDict) -> RecordDict:
    arrays = _arrays(content)
    arrays.pop(next(iter(arrays)))
    return with_arrays(content, arrays)


def _claim_examples(content: RecordDict) -> RecordDict:
    out = RecordDict(dict(content.items()))
    metrics = dict(content["metrics"].items())
    metrics["num-examples"] = 10**9
    out["metrics"] = MetricRecord(metrics)
    return out


def _oversize(content: RecordDict) -> RecordDict:
    out = RecordDict(dict(content.items()))
    out["padding"] = ConfigRecord({"blob": b"\0" * OVERSIZE})
    return out


#: name -> how the reply content is rewritten.
CORRUPTIONS: dict[str, Callable[[RecordDict], RecordDict]] = {
    "nan": lambda c: _set_first(c, float("nan")),
    "inf": lambda c: _set_first(c, float("inf")),
    "huge": lambda c: _set_first(c, 1e6, add=True),
    "shape": _reshape,
    "dtype": _retype,
    "missing": _drop_array,
    "examples": _claim_examples,
    "oversize": _oversize,
}

#: A word the exclusion reason of each corruption contains.
REASON_WORD = {"nan": "non-finite", "inf": "non-finite", "huge": "norm", "shape": "shape", "dtype": "dtype",
               "missing": "missing", "examples": "num-examples", "oversize": "payload"}


def faulty_grid(faults: dict[int, Callable[[RecordDict], RecordDict] | str], *,
                message_type: str | tuple[str, ...] = "train") -> Callable[..., LocalGrid]:
    """A ``grid_factory`` whose node number ``i`` (partition i) corrupts its replies with ``faults[i]``.

    A fault is a :data:`CORRUPTIONS` name or a function of the reply content; only replies to
    ``message_type`` messages (one type or a tuple of types) are corrupted.  ``factory.grids`` lists the grids it made.
    """

    def factory(client_app, num_nodes: int, run_config: dict) -> LocalGrid:
        grid = LocalGrid(client_app, num_nodes, run_config)
        factory.grids.append(grid)
        bad = {grid.node_ids[i]: CORRUPTIONS[f] if isinstance(f, str) else f for i, f in faults.items()}

        def app(msg: Message, context: Context) -> Message:
            reply = client_app(msg, context)
            corrupt = bad.get(context.node_id)
            types = (message_type,) if isinstance(message_type, str) else message_type
            if corrupt is None or msg.metadata.message_type not in types or reply.has_error():
                return reply
            return Message(corrupt(reply.content), reply_to=msg)

        grid.client_app = app
        return grid

    factory.grids = []  # the grids made, for the tests to read node ids
    return factory


__all__ = ["CORRUPTIONS", "REASON_WORD", "faulty_grid", "with_arrays"]
