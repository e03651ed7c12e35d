"""A resumed run whose nodes come back under new ids (Flower's simulation and a new deployment number them anew).

The server cannot tell which earlier node a new id is: every per-client account charges a new id from the dearest
earlier account (:meth:`protocols.privacy.accountant.PerUnitAccountant.renumbered`), so the server's epsilon never
falls behind the clients' own ledgers, and the budget guard still raises the noise after a recharged round.
"""

from __future__ import annotations

import json

import pytest

from protocols.config import RunConfig
from protocols.privacy import GaussianEvent, PerUnitAccountant, RdpAccountant
from server.launch import main
from server.local_grid import LocalGrid
from strategies.run.checkpoint import LEDGER_DIR, load_checkpoint
from tests.conftest import read_metrics
from tests.test_budget_cap import NADP_FAST, _ledger_epsilon, killed_after_uploads


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_a_new_unit_after_renumbering_starts_from_the_dearest_account_and_a_known_one_from_empty():
    acc = PerUnitAccountant()
    acc.compose(GaussianEvent(2.0), units=[1, 2])
    acc.compose(GaussianEvent(2.0), units=[1])
    acc.renumbered([1, 2, 3], delta=1e-5)
    acc.compose(GaussianEvent(2.0), units=[3, 40])  # 3: an earlier node never charged; 40: a renumbered one
    def releases(k: int) -> float:
        rdp = RdpAccountant()
        for _ in range(k):
            rdp.compose(GaussianEvent(2.0))
        return rdp.epsilon(1e-5)

    assert acc.unit(40).epsilon(1e-5) == pytest.approx(releases(3), rel=1e-12)  # unit 1's two, then this one
    assert acc.unit(3).epsilon(1e-5) == pytest.approx(releases(1), rel=1e-12)
    again = PerUnitAccountant.from_state(json.loads(json.dumps(acc.to_state())))  # survives a second checkpoint
    assert again.known == acc.known and again.unit(41).epsilon(1e-5) == pytest.approx(releases(2), rel=1e-12)


@pytest.mark.parametrize("method", ["nadp", "ldp"])
def test_a_resume_with_renumbered_nodes_keeps_the_servers_epsilon_with_the_clients(tmp_path, capsys, monkeypatch,
                                                                                    method):
    """Killed after round 2's uploads; resumed with every node under a new id: no account restarts from zero."""
    cfg = {**(NADP_FAST if method == "nadp" else {"method": method}), "num-clients": 4, "num-rounds": 4, "seed": 5,
           "epsilon": 1.0, "train-subset": 400, "test-subset": 200, "dataset": "digits"}
    out = killed_after_uploads(tmp_path, cfg, 2)
    earlier = set(load_checkpoint(out).pending["strategy_state"]["nodes"])
    monkeypatch.setattr(LocalGrid, "node_id_offset", LocalGrid.node_id_offset + 100)
    assert main(["run", "--resume", str(out)]) == 0
    capsys.readouterr()
    rows = read_metrics(out)
    assert earlier.isdisjoint(str(n) for n in rows[-1].get("client_epsilon", {}))  # the nodes were renumbered
    assert rows[1]["recharged_round"] and rows[1]["noise_scale"] > 1.0
    # The renumbered accounts started from the dearest earlier one, not from nothing: round 3 is planned from what
    # one round costs (it read the inherited history as round 2's cost and asked 2.8x the noise).
    assert 1.0 <= rows[2].get("noise_scale", 1.0) <= rows[1]["noise_scale"] * 1.05
    delta = RunConfig.from_mapping(load_checkpoint(out).config).delta
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(_ledger_epsilon(out / LEDGER_DIR, delta), abs=1e-9)
    assert summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]


def test_a_deployment_keeps_its_node_identities_for_its_resume_and_a_fresh_run_replaces_them(tmp_path):
    """`cancelfl deploy --resume` starts nodes with the crashed run's identities: the same roster and schedule."""
    from server.deploy import node_identities
    from strategies.run.checkpoint import IDENTITY_DIR, clear_outputs

    folder = tmp_path / IDENTITY_DIR
    names = ["node-0", "node-1", "node-2"]
    keys, roster = node_identities(folder, names)
    text, pems = roster.read_text(), {n: p.read_bytes() for n, p in keys.items()}
    assert (keys["node-0"].stat().st_mode & 0o077) == 0  # private keys readable by their owner only
    again, roster2 = node_identities(folder, names)
    assert roster2.read_text() == text and {n: p.read_bytes() for n, p in again.items()} == pems
    _, roster3 = node_identities(folder, [*names, "node-3"])  # another set of nodes: new identities
    assert roster3.read_text() != text
    clear_outputs(tmp_path)
    assert not folder.exists()


def test_a_resume_on_an_engine_whose_nodes_trust_another_roster_is_refused_before_it_starts(tmp_path, capsys):
    """A pairwise run started in-process cannot resume in Flower's simulation: exit 2, naming the command that can.

    The simulation's nodes hold identities derived from the run seed, another roster; in-process it resumes.
    """
    cfg = {**NADP_FAST, "num-clients": 3, "num-rounds": 4, "seed": 5, "epsilon": 1.0, "train-subset": 300,
           "test-subset": 100, "dataset": "digits"}
    out = killed_after_uploads(tmp_path, cfg, 2)
    assert main(["run", "--engine", "simulation", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "another roster" in err and f"cancelfl run --resume {out}" in err, err
    assert main(["run", "--resume", str(out)]) == 0
