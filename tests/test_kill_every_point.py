"""A run killed (SIGKILL) at any point of a round and resumed ends within its target, server and clients agreeing.

The killer wraps the round loop's grid: it kills the server process right before or right after each message phase
(keys, shares, train, recover) of the killed round, or right before that round's checkpoint is written (metrics
appended, checkpoint not). The clients run in the same process, so their ledgers stop wherever the kill lands.
After ``cancelfl run --resume`` every run must

* finish (exit 0) or stop before the round that would cross its target (exit 1, "privacy budget"),
* report an epsilon at or below the target, per direction equal to the largest in the clients' own ledgers (killed
  after the round's charge is committed and before its messages leave, the server counts a release that never
  happened: it may then exceed the clients' ledgers, never fall below them),
* hold one metrics row per round, in order.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.ledger import ClientLedger
from protocols.config import RunConfig
from server.launch import main
from strategies.run.checkpoint import LEDGER_DIR, load_checkpoint
from tests.conftest import ROOT, read_metrics

_KILLER = """
import json, os, signal, sys
from strategies.run import grid as gridmod
from strategies.run import loop

LOG, ROUND, CALL, WHEN = os.environ.get("KILL_LOG"), int(os.environ["KILL_ROUND"]), int(os.environ["KILL_CALL"]), \\
    os.environ["KILL_WHEN"]
state = {"round": 0, "call": 0}
reset, send_and_receive, save_checkpoint = (gridmod.MeteredGrid.reset, gridmod.MeteredGrid.send_and_receive,
                                            loop.save_checkpoint)

def counted_reset(self):
    state["round"] += 1
    state["call"] = 0
    return reset(self)

def killing_send_and_receive(self, messages, *, timeout=None):
    messages = list(messages)
    state["call"] += 1
    here = (state["round"], state["call"]) == (ROUND, CALL)
    if LOG and messages:
        with open(LOG, "a") as fh:
            fh.write(json.dumps([state["round"], state["call"], messages[0].metadata.message_type]) + "\\n")
    if here and WHEN == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    replies = send_and_receive(self, messages, timeout=timeout)
    if here and WHEN == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return replies

def killing_save_checkpoint(out, ckpt):
    if WHEN == "checkpoint" and ckpt.round == ROUND:
        os.kill(os.getpid(), signal.SIGKILL)
    return save_checkpoint(out, ckpt)

gridmod.MeteredGrid.reset = counted_reset
gridmod.MeteredGrid.send_and_receive = killing_send_and_receive
loop.save_checkpoint = killing_save_checkpoint
from server.launch import main
sys.exit(main(sys.argv[1:]))
"""

TARGET = 1.0
BASE = {"num-clients": 4, "num-rounds": 3, "seed": 5, "epsilon": TARGET, "train-subset": 400, "test-subset": 200,
        "dataset": "digits"}


def _launch(tmp_path: Path, method: str, out: Path, *, round_: int = 0, call: int = 0, when: str = "",
            log: Path | None = None) -> subprocess.CompletedProcess:
    cfg = {"method": method, **BASE}
    text = " ".join(f"{k}={json.dumps(v)}" for k, v in cfg.items())
    script = tmp_path / "killer.py"
    script.write_text(_KILLER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), KILL_ROUND=str(round_), KILL_CALL=str(call),
               KILL_WHEN=when, KILL_LOG=str(log or ""))
    return subprocess.run([sys.executable, str(script), "run", "--run-config", f'{text} out-dir="{out}"'],
                          cwd=ROOT, env=env, capture_output=True, timeout=600)


def _ledger_epsilons(folder: Path, delta: float) -> dict[str, float]:
    """Direction -> the largest epsilon in the clients' own ledgers (RDP, the server's conversion), finite ones only."""
    worst: dict[str, float] = {}
    for path in sorted(folder.glob("client-*.json")):
        for key, account in ClientLedger(path, json.loads(path.read_text())).accounts.items():
            direction = key.split("/")[0]
            # the server's composition: RDP, or the one a method names (ddpsa's Laplace rounds)
            parts = [acc for acc in (account.rdp, *account.composed.values()) if acc.releases] or [account.rdp]
            worst[direction] = max(worst.get(direction, 0.0), *(acc.epsilon(delta) for acc in parts))
    return {d: e for d, e in worst.items() if math.isfinite(e)}


def _points(log: Path) -> list[tuple[int, int, str, str]]:
    """Every kill point: before/after each phase of round 2, after round 1's key phase, before round 2's checkpoint."""
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    points = [(r, c, when, kind) for r, c, kind in calls if r == 2 for when in ("before", "after")]
    points += [(r, c, "after", kind) for r, c, kind in calls if r == 1 and kind == "query.keys"]
    return points + [(2, 0, "checkpoint", "checkpoint")]


@pytest.mark.parametrize("method", ["nadp", "niss", "mpddp", "ddpsa"])
def test_sigkill_at_every_point_of_a_round_then_resume(tmp_path, capsys, method):
    """Uninterrupted reference first (it lists the phases), then one killed + resumed run per point.

    ddpsa has no recover phase; its clients record a round when they push their shares, before the server has
    released anything.
    """
    log = tmp_path / "calls.jsonl"
    ref = _launch(tmp_path, method, tmp_path / "reference", log=log)
    assert ref.returncode == 0, ref.stderr.decode()[-2000:]
    kinds = {kind for _, _, _, kind in _points(log)}
    assert {"train", "checkpoint"} | ({"query.recover"} if method != "ddpsa" else set()) <= kinds, kinds
    for rnd, call, when, kind in _points(log):
        point = f"{method}: SIGKILL {when} {kind} of round {rnd}"
        out = tmp_path / f"killed-r{rnd}-c{call}-{when}"
        proc = _launch(tmp_path, method, out, round_=rnd, call=call, when=when)
        assert proc.returncode == -9, (point, proc.stderr.decode()[-2000:])
        assert load_checkpoint(out) is not None, point
        code = main(["run", "--resume", str(out)])
        err = capsys.readouterr().err
        summary = json.loads((out / "summary.json").read_text())
        assert code == 0 or (code == 1 and summary.get("stopped_for") == "privacy budget"), (point, code, err[-1500:])
        delta = RunConfig.from_mapping(summary["config"]).delta
        assert summary["epsilon"] <= TARGET + 1e-9 and not summary["privacy"]["over_target"], (point, summary["epsilon"])
        for direction, clients in _ledger_epsilons(out / LEDGER_DIR, delta).items():
            server = summary["privacy"][direction]["epsilon"]
            if (kind, when) == ("train", "before"):  # charged when the messages were built, never released: the
                assert server >= clients - 1e-9, (point, direction, server, clients)  # server errs on the safe side
            else:
                assert server == pytest.approx(clients, abs=1e-9), (point, direction, server, clients)
        rounds = [r["round"] for r in read_metrics(out)]
        assert rounds == list(range(1, len(rounds) + 1)) and len(rounds) >= 1, (point, rounds)
        if code == 0:
            assert rounds[-1] == BASE["num-rounds"], (point, rounds)
