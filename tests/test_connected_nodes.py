"""Rounds go on with the nodes that are connected; guard rails of the run loop.

* a node that disappears is not waited for, a node that comes back (with its state lost, as after a
  restart) is sampled again and re-keys;
* fewer than ``min-clients`` connected nodes: the round waits ``node-timeout`` and fails naming the keys;
* a run whose test loss diverges stops with ``stopped`` in summary.json and a non-zero exit code;
* metrics.jsonl and summary.json are strict JSON (non-finite numbers are written as null).
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
from flwr.app import RecordDict

from server.launch import run_inprocess
from server.local_grid import LocalGrid
from strategies.run.checkpoint import run_outcome
from strategies.run.loop import dumps, non_finite_keys
from tests.conftest import read_metrics
from tests.faulty_client import faulty_grid, with_arrays


def _hiding_grid(grids: list):
    """A LocalGrid factory whose ``hidden`` nodes are not listed as connected (and do not answer)."""
    def factory(client_app, num_nodes, run_config):
        grid = LocalGrid(client_app, num_nodes, run_config)
        grid.hidden = set()
        grid.get_node_ids = lambda: [n for n in grid.node_ids if n not in grid.hidden]
        grids.append(grid)
        return grid
    return factory


def test_a_node_leaves_and_rejoins_with_fresh_state(tmp_path):
    grids: list[LocalGrid] = []
    out = tmp_path / "rejoin"

    def progress(line: str) -> None:
        grid = grids[0]
        node = grid.node_ids[0]
        if line.startswith("round 1/"):
            grid.hidden.add(node)
            grid.offline.add(node)
        elif line.startswith("round 2/"):
            grid.hidden.discard(node)
            grid.offline.discard(node)
            grid.contexts[node].state = RecordDict()  # a restarted SuperNode: keys and pair material are gone

    run_inprocess({"method": "nadp", "num-clients": 5, "num-rounds": 4, "hidden": "", "epsilon": 8.0,
                   "local-epochs": 1, "batch-size": 1000, "out-dir": str(out)},
                  grid_factory=_hiding_grid(grids), progress=progress)
    rows = read_metrics(out)
    assert not any(r["failed"] for r in rows), [r.get("failure") for r in rows]
    assert [r["clients"] for r in rows][:2] == [5, 4]
    assert rows[3]["clients"] == 5 and rows[3].get("clients_dropped", 0) == 0  # back, re-keyed, uploading


def test_too_few_nodes_fail_after_the_node_timeout(tmp_path):
    grids: list[LocalGrid] = []
    factory = _hiding_grid(grids)

    def two_of_three(client_app, num_nodes, run_config):
        grid = factory(client_app, num_nodes, run_config)
        grid.hidden.add(grid.node_ids[0])
        return grid

    out = tmp_path / "few"
    t0 = time.perf_counter()
    run_inprocess({"num-clients": 3, "min-clients": 3, "node-timeout": 1.0, "num-rounds": 2, "out-dir": str(out)},
                  grid_factory=two_of_three, progress=lambda _s: None)
    rows = read_metrics(out)
    assert all(r["failed"] and "min-clients" in r["failure"] for r in rows)
    assert time.perf_counter() - t0 < 30
    assert run_outcome(out)[0] == 1  # no round succeeded: non-zero exit

    out2 = tmp_path / "enough"
    run_inprocess({"num-clients": 3, "min-clients": 2, "node-timeout": 1.0, "num-rounds": 2, "out-dir": str(out2)},
                  grid_factory=two_of_three, progress=lambda _s: None)
    rows = read_metrics(out2)
    assert not any(r["failed"] for r in rows) and all(r["clients"] == 2 for r in rows)


def test_diverging_loss_stops_the_run(tmp_path):
    def blow_up(content: RecordDict) -> RecordDict:
        return with_arrays(content, {k: 1e3 * a.numpy() for k, a in content["arrays"].items()})

    out = tmp_path / "diverge"
    summary = run_inprocess({"num-clients": 3, "num-rounds": 4, "divergence-factor": 2.0, "out-dir": str(out)},
                            grid_factory=faulty_grid(dict.fromkeys(range(3), blow_up)), progress=lambda _s: None)
    rows = read_metrics(out)
    assert len(rows) == 1 and summary["stopped"] and "divergence-factor" in summary["stopped"]
    assert summary["model_round"] == 0  # the diverged model is not the one kept
    code, message = run_outcome(out)
    assert code == 1 and "stopped" in message
    with np.load(out / "model.npz") as z:
        assert all(np.isfinite(z[k]).all() and np.abs(z[k]).max() < 100 for k in z.files)


def test_outputs_are_strict_json():
    row = {"test_loss": math.nan, "epsilon": math.inf, "nested": {"x": -math.inf}, "ok": 1.5}
    text = dumps({**row, "non_finite": non_finite_keys(row)})
    back = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert back == {"test_loss": None, "epsilon": None, "nested": {"x": None}, "ok": 1.5,
                    "non_finite": ["test_loss", "epsilon"]}
