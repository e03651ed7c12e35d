"""Bad replies are excluded with a named reason, the model stays finite and the run finishes.

The real ClientApp runs in-process; chosen nodes corrupt their train replies (tests/faulty_client.py):
NaN, inf, +1e6 in one coordinate, a wrong shape, a wrong dtype, a missing array, num-examples = 1e9 and
an oversized payload, all in the same run, for every method family.  Pairwise methods (nadp, niss,
mpddp) handle the excluded nodes as dropouts (dropout recovery), so their rounds also succeed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from protocols.wire.niss import AHEAD_RECORD, ShareReply
from server.launch import run_inprocess
from tests.conftest import read_metrics
from tests.faulty_client import CORRUPTIONS, REASON_WORD, faulty_grid, with_arrays

FAST = {"dataset": "digits", "num-rounds": 2, "hidden": "", "local-epochs": 1}
#: Per family: run-config overrides (the regime of each method otherwise).
FAMILIES = {
    "fedavg": {},
    "ldp": {"epsilon": 8.0},
    "cdp": {"epsilon": 8.0},
    "ladp": {"epsilon": 8.0},
    "nadp": {"epsilon": 8.0, "batch-size": 1000},
    "niss": {"epsilon": 8.0},
    "mpddp": {"epsilon": 8.0, "hidden": "16", "dataset": "breast-cancer"},
}


def _strict(text: str):
    """json.loads that refuses NaN/Infinity (strict JSON)."""
    def refuse(name: str):
        raise ValueError(f"non-strict JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def _run(tmp_path: Path, method: str, faults: dict, overrides: dict | None = None, **kw):
    factory = faulty_grid(faults, **kw)
    out = tmp_path / method
    cfg = {**FAST, **FAMILIES.get(method, {}), "method": method, "out-dir": str(out), **(overrides or {})}
    summary = run_inprocess(cfg, grid_factory=factory, progress=lambda _s: None)
    return summary, read_metrics(out), factory.grids[0], out


def _model_finite(out: Path) -> bool:
    with np.load(out / "model.npz") as z:
        return all(np.isfinite(z[k]).all() for k in z.files)


@pytest.mark.parametrize("method", list(FAMILIES))
def test_every_kind_of_bad_reply_is_excluded_with_its_reason(tmp_path, monkeypatch, method):
    from strategies.run.budget import BudgetGuard

    # Excluded replies leave the pairwise methods' rounds dearer than planned; with most participants faulty the
    # budget guard would stop the run before round 2 (tests/test_budget_cap.py): here every round must run.
    monkeypatch.setattr(BudgetGuard, "before_round", lambda self, rnd: None)
    faults = dict(enumerate(CORRUPTIONS))
    # Most participants are faulty here: with double masking no honest nadp / mpddp client would have its
    # self-mask threshold of aggregated neighbours (test_masking covers that); the reply checks are the subject.
    summary, rows, grid, out = _run(tmp_path, method, faults, {"num-clients": len(faults) + 3, "self-mask": False})
    bad = {str(grid.node_ids[i]): kind for i, kind in faults.items()}
    honest = [str(n) for n in grid.node_ids[len(faults):]]
    assert len(rows) == FAST["num-rounds"]
    for row in rows:
        assert not row["failed"], (method, row.get("failure"))
        for node, kind in bad.items():
            assert REASON_WORD[kind] in row["excluded"].get(node, ""), (method, kind, row["excluded"].get(node))
        assert not set(honest) & set(row["excluded"]), (method, row["excluded"])
        assert math.isfinite(row["test_loss"])
    assert _model_finite(out)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        _strict(line)
    _strict((out / "summary.json").read_text())


def test_ddpsa_reply_checks(tmp_path):
    """DDP-SA uploads no arrays (shares go to the intermediate servers): size and num-examples are checked."""
    faults = {0: "examples", 1: "oversize"}
    # local noise: the excluded replies' missing shares leave the sum its full noise, so every round is released
    # (with distributed noise such a shortfall is aborted unreleased, tests/test_ddpsa_noise.py)
    _summary, rows, grid, out = _run(tmp_path, "ddpsa", faults, {"num-clients": 5, "epsilon": 10.0, "lr": 10.0,
                                                                 "ddpsa-noise": "local"})
    for row in rows:
        assert not row["failed"], row.get("failure")
        assert "num-examples" in row["excluded"][str(grid.node_ids[0])]
        assert "payload" in row["excluded"][str(grid.node_ids[1])]
    assert _model_finite(out)


def test_repeat_offender_is_left_out(tmp_path):
    _summary, rows, grid, _out = _run(tmp_path, "fedavg", {0: "nan"}, {"num-clients": 4, "num-rounds": 3,
                                                                       "max-strikes": 2})
    bad = str(grid.node_ids[0])
    assert bad in rows[0]["excluded"] and bad in rows[1]["excluded"]
    assert rows[1]["left_out"] == [bad] and rows[2]["left_out"] == [bad]
    assert bad not in rows[2]["excluded"] and rows[2]["clients"] == 3  # not sampled any more
    assert not any(r["failed"] for r in rows)


def test_overflowing_aggregate_fails_the_round_and_keeps_the_model(tmp_path):
    """Finite float64 uploads of 1e308 pass the checks (all alike), but their mean is inf on the float32 wire."""
    def overflow(content: RecordDict) -> RecordDict:
        return with_arrays(content, {k: np.full(a.shape, 1e308) for k, a in content["arrays"].items()})

    _summary, rows, _grid, out = _run(tmp_path, "fedavg", dict.fromkeys(range(3), overflow), {"num-clients": 3})
    assert all(r["failed"] and "not finite" in r["failure"] for r in rows)
    assert _model_finite(out)


def test_overflowing_mp_gradient_fails_the_round_before_the_server_optimizer_steps(tmp_path):
    """An mpcdp run with 1e308 uploads: the recovered gradient overflows; the rounds fail, the model stays finite."""
    def overflow(content: RecordDict) -> RecordDict:
        return with_arrays(content, {k: np.full(a.shape, 1e308) for k, a in content["arrays"].items()})

    _summary, rows, _grid, out = _run(tmp_path, "mpcdp", dict.fromkeys(range(3), overflow),
                                      {"num-clients": 3, "num-rounds": 2, "hidden": "8"})
    assert all(r["failed"] and "recovered gradient is not finite" in r["failure"] for r in rows)
    assert _model_finite(out)


def _flipped(record: ConfigRecord) -> ConfigRecord:
    reply = ShareReply.from_config(record)
    return ConfigRecord(ShareReply(reply.to_ids, tuple(bytes(b ^ 0xFF for b in p) for p in reply.payloads)).to_config())


def _garbage_shares(content: RecordDict) -> RecordDict:
    """Flip every byte of every sealed share payload (same length: only the receiver can tell).

    A ``query.shares`` reply, or the next round's shares a train reply carries (:data:`AHEAD_RECORD`).
    """
    if AHEAD_RECORD in content:
        return RecordDict({**dict(content.items()), AHEAD_RECORD: _flipped(content[AHEAD_RECORD])})
    try:
        return RecordDict({"config": _flipped(content["config"])})
    except (KeyError, ValueError):
        return content  # a train reply that carries no shares


def _huge_share(content: RecordDict) -> RecordDict:
    reply = ShareReply.from_config(content["config"])
    payloads = (reply.payloads[0] + b"\0" * (8 << 20), *reply.payloads[1:])
    return RecordDict({"config": ConfigRecord(ShareReply(reply.to_ids, payloads).to_config())})


def test_niss_garbage_share_payloads_strike_the_sender(tmp_path):
    """Receivers reject the payloads and upload nothing (no strike); the sender is struck, then left out."""
    _summary, rows, grid, out = _run(tmp_path, "niss", {0: _garbage_shares},
                                     {"num-clients": 5, "num-rounds": 3, "max-strikes": 2},
                                     message_type=("query.shares", "train"))
    sender = str(grid.node_ids[0])
    assert rows[2]["left_out"] == [sender]
    assert not rows[2]["failed"], rows[2].get("failure")
    assert any("uploaded nothing" in why for why in rows[0]["excluded"].values())
    assert _model_finite(out)


def test_niss_oversized_share_payload_is_never_relayed(tmp_path):
    relayed: list[int] = []
    factory = faulty_grid({0: _huge_share}, message_type="query.shares")

    def watching(client_app, num_nodes, run_config):
        grid = factory(client_app, num_nodes, run_config)
        inner = grid.client_app

        def app(msg, context):
            if msg.metadata.message_type == "train" and "config" in msg.content:
                payloads = msg.content["config"].get("niss-payloads", [])
                relayed.append(max((len(p) for p in payloads), default=0))
            return inner(msg, context)

        grid.client_app = app
        return grid

    out = tmp_path / "niss-huge"
    run_inprocess({**FAST, **FAMILIES["niss"], "method": "niss", "num-clients": 4, "out-dir": str(out)},
                  grid_factory=watching, progress=lambda _s: None)
    rows = read_metrics(out)
    assert relayed and max(relayed) < 1 << 20
    assert not any(r["failed"] for r in rows), [r.get("failure") for r in rows]


def test_strikes_count_rounds_in_a_row_once_per_round_and_survive_a_checkpoint():
    from strategies.validation import Strikes

    s = Strikes(3)
    s.record(1, {5: "nan"}, [6])
    s.strike(1, 5, "again")  # at most one strike per round
    s.record(2, {}, [5])  # an accepted reply clears the count
    assert 5 not in s.count
    for rnd in (3, 4):
        s.record(rnd, {}, [5])
        s.strike(rnd, 5, "its share payloads were rejected")  # struck although its own upload was accepted
    assert s.count[5] == 2 and not s.banned
    restored = Strikes(3)
    restored.load_state(json.loads(json.dumps(s.to_state())))
    restored.record(5, {5: "nan"}, [])
    assert 5 in restored.banned and "3 rounds in a row" in restored.banned[5]
