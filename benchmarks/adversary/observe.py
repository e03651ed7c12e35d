"""Run the app in-process while watching every message and timing the clients.

:class:`ObservedLocalGrid` is a :class:`server.local_grid.LocalGrid` that
additionally (a) attributes the ClientApp time LocalGrid measures per node to
rounds and phases, and (b) hands every (messages, replies) batch to hooks, which
is how the attacks intercept what a client receives and uploads on the real
code path (the strategy, the ClientApp and the method handlers are untouched).

:func:`run_observed` runs one federation through
:func:`server.launch.run_inprocess`, handing it a factory for an
:class:`ObservedLocalGrid` and, when the caller needs it (e.g. the mpddp attacker,
who uses the server's own perturbation secret), keeping the strategy object.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flwr.app import Message

from protocols.wire.common import TrainIns
from server.local_grid import LocalGrid

Hook = Callable[[list[Message], list[Message]], None]

__all__ = ["ObservedLocalGrid", "Observed", "RoundTiming", "run_observed"]


@dataclass
class RoundTiming:
    """ClientApp time of one round, summed over the clients that took part."""

    round: int
    client_time_s: float = 0.0  # sum over clients and phases
    nodes: set[int] = field(default_factory=set)  # clients that received a message this round
    phase_client_time_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def per_client_s(self) -> float:
        """Mean ClientApp time of one client in this round (what each client spends)."""
        return self.client_time_s / max(len(self.nodes), 1)


def _round_of(msgs: Sequence[Message], default: int) -> int:
    """Round number carried in the messages' config (every cancelfl phase sends it)."""
    for m in msgs:
        try:
            return TrainIns.from_config(m.content["config"]).round
        except (KeyError, TypeError, ValueError):
            continue
    return default


class ObservedLocalGrid(LocalGrid):
    """LocalGrid + per-round client time + message hooks (see module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hooks: list[Hook] = []
        self.timings: dict[int, RoundTiming] = {}
        self._last_round = 1
        #: Deliver a private copy of every message, as a real transport does.  LocalGrid hands
        #: the same content object to each ClientApp call, and Flower's secaggplus_mod edits it
        #: in place (so the second client would see the first one's leftovers).
        self.isolate_messages = False

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Deliver as LocalGrid does; attribute client time to (round, phase); call the hooks."""
        messages = list(messages)
        if self.isolate_messages:
            messages = [Message(copy.deepcopy(m.content), m.metadata.dst_node_id, m.metadata.message_type,
                                group_id=m.metadata.group_id) for m in messages]
        before = dict(self.client_time)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        rnd = _round_of(messages, self._last_round)
        self._last_round = rnd
        timing = self.timings.setdefault(rnd, RoundTiming(rnd))
        phase = messages[0].metadata.message_type if messages else ""
        for m in messages:
            dst = m.metadata.dst_node_id
            spent = self.client_time[dst] - before.get(dst, 0.0)
            timing.client_time_s += spent
            timing.phase_client_time_s[phase] += spent
            timing.nodes.add(dst)
        for hook in self.hooks:
            hook(messages, replies)
        return replies


@dataclass
class Observed:
    """Outputs of one observed run."""

    summary: dict
    rows: list[dict]  # metrics.jsonl
    grid: ObservedLocalGrid
    strategy: object | None = None  # only when run with keep_strategy=True


def _read_rows(out_dir: str) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_observed(overrides: dict, *, hooks: Sequence[Hook] = (), keep_strategy: bool = False,
                 progress: Callable[[str], None] = lambda _s: None) -> Observed:
    """Run one federation in-process through :func:`server.launch.run_inprocess` with an observed grid."""
    from server.launch import run_inprocess

    grids: list[ObservedLocalGrid] = []
    strategies: list = []

    def factory(client_app, num_nodes: int, run_config: dict) -> ObservedLocalGrid:
        grid = ObservedLocalGrid(client_app, num_nodes, run_config)
        grid.hooks = list(hooks)
        grids.append(grid)
        return grid

    summary = run_inprocess(overrides, progress=progress, grid_factory=factory, keep_strategy=strategies)
    out_dir = str(summary["config"]["out-dir"])  # the run's folder (a fresh runs/<time>-<method> when not given)
    return Observed(summary, _read_rows(out_dir), grids[0], strategies[0] if keep_strategy else None)
