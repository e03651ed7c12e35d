"""``cancelfl-bench cost`` at its smallest: in-process, 4 clients, 1 round, with and without a dropout.

At 4 clients (degree 3) the default ``mask-corruption-rate`` 0.1 makes the self-mask threshold 3 = the degree, so
a dropout fails a double-masked round; assuming no colluders (threshold 2) lets one client drop.
"""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks import cli


@pytest.mark.slow
def test_cost_bench_measures_phases_bytes_and_cpu_of_every_arm(tmp_path):
    out = tmp_path / "cost"
    status = cli.main(["cost", "--clients", "4", "--rounds", "1", "--dropouts", "0,0.25", "--methods", "fedavg,nadp",
                       "--hidden", "8", "--set", "mask-corruption-rate=0.0", "--out", str(out)])
    with (out / "cost.csv").open() as fh:
        rows = {(r["name"], r["masking"], float(r["dropout"])): r for r in csv.DictReader(fh)}
    assert status == 0 and len(rows) == 8, rows
    for key, r in rows.items():
        assert r["status"] == "ok", key
        assert float(r["bytes_down"]) > 0 and float(r["bytes_up"]) > 0 and float(r["round_s"]) > 0, key
        assert float(r["server_cpu_s"]) > 0 and float(r["client_cpu_s"]) > 0, key
        assert int(float(r["dropped"])) == (1 if key[2] == 0.25 else 0), key
    fedavg, now, today = (rows[("fedavg", "-", 0.0)], rows[("nadp", "double masking", 0.0)],
                          rows[("nadp", "pair noise only", 0.0)])
    assert fedavg["phases"] == "train"
    # double masking: one query.recover phase more than the same method without it, in every round, and the
    # self-mask shares and their reveal cost bytes
    assert now["phases"] == today["phases"] + "+query.recover"
    assert int(now["phase_count"]) == int(today["phase_count"]) + 1 > int(fedavg["phase_count"])
    assert float(now["extra_bytes"]) > 0 and float(now["bytes_per_client"]) > float(today["bytes_per_client"])
    # without double masking the reveal phase runs only when a client dropped
    assert rows[("nadp", "pair noise only", 0.25)]["phases"].endswith("query.recover")
    secagg = rows[("Flower SecAgg+", "SecAgg+", 0.0)]
    assert secagg["phases"] == "setup+share_keys+collect_masked_vectors+unmask"
    assert float(rows[("Flower SecAgg+", "SecAgg+", 0.25)]["bytes_up"]) > 0
    record = json.loads((out / "record.json").read_text())
    assert record["command"].startswith("cancelfl-bench cost") and "cost.md" in record["files"]
