"""End to end on real separate processes: a SuperLink and 4 SuperNodes on loopback.

Runs a short training of every pairwise-noise method and of DDP-SA (with its 3
intermediate gRPC servers as their own processes) through ``flwr run``, then
checks that each run finished, beat chance, and that the pairwise noise
cancelled (the run's ``cancellation_residual``).  The cluster is shared by all
runs; every process it started must be gone afterwards.  Every SuperNode has
its own Ed25519 identity and the roster in its node config (``cancelfl keys``),
so the pairwise methods run with authenticated keys.  This is what
``cancelfl deploy`` and the docker-compose deployment do.
"""

from __future__ import annotations

import json

import pytest

from protocols.identity import Roster
from server.deploy import NODES_DIR_MAX, LocalCluster
from server.supernode import warm_count
from tests.conftest import read_metrics
from tests.processes import pid_gone

pytestmark = [pytest.mark.deployment, pytest.mark.slow]

NUM_SUPERNODES = 4
COMMON = {"num-rounds": 2, "dataset": "digits", "cancellation-check": True, "round-timeout": 300.0}
#: Per-method settings for a short run.
RUNS = {
    # One full-batch local step per round (the paper's setting) on a linear model learns fast.
    "nadp": {"method": "nadp", "epsilon": 8.0, "local-epochs": 1, "batch-size": 1000, "lr": 4.0, "hidden": ""},
    "niss": {"method": "niss", "epsilon": 8.0, "niss-tau": 0.0},  # its regime: nadp's full-batch step
    # FedSGD on an MSE loss (what the theory requires) learns slowly on digits; breast-cancer learns in 2 rounds
    # (its regime's server step; in-process 0.90).
    "mpddp": {"method": "mpddp", "epsilon": 16.0, "dataset": "breast-cancer", "hidden": "16"},
    # FedSGD with Laplace noise on per-sample-clipped gradient sums: its regime (linear, server step 100; 0.50).
    "ddpsa": {"method": "ddpsa", "epsilon": 10.0},
}
#: Accuracy that shows learning: chance is 0.1 on digits, the majority class is 0.63 on breast-cancer.
ABOVE_CHANCE = {"digits": 0.2, "breast-cancer": 0.7}
#: Relative residual of float64 pairwise noise that cancelled (probe is ~1e-16 when it did).
CANCEL_BOUND = 1e-9


def test_multiprocess_deployment(tmp_path, niss_diagnostics):  # niss: the residual comes from diagnostic probes
    results = {}
    with LocalCluster(NUM_SUPERNODES, intermediate_servers=3) as cluster:
        pids = list(cluster.pids)
        assert len(pids) == 1 + 3 + NUM_SUPERNODES
        # Every SuperNode runs with its own identity made by `cancelfl keys` and the roster (require-identity:
        # a node without them would refuse instead of falling back to the derived simulation identities).
        assert sorted(Roster.load(cluster.roster)) == [f"node-{i}" for i in range(NUM_SUPERNODES)]
        for name, overrides in RUNS.items():
            out = tmp_path / name
            code = cluster.submit({**COMMON, **overrides, "out-dir": str(out)}, timeout=900)
            assert code == 0, f"{name}: run failed (see the output above)"
            summary = json.loads((out / "summary.json").read_text())
            rows = read_metrics(out)
            results[name] = (summary, rows)
    assert all(pid_gone(p) for p in pids), "processes left running after the cluster closed"
    for name, (summary, rows) in results.items():
        assert len(rows) == COMMON["num-rounds"] and not any(r["failed"] for r in rows), name
        dataset = summary["config"]["dataset"]
        assert summary["final_accuracy"] > ABOVE_CHANCE[dataset], (name, dataset, summary["final_accuracy"])
        if name != "ddpsa":  # ddpsa has no pairwise noise; its aggregate is exact by construction
            residuals = [r["cancellation_residual"] for r in rows]
            assert max(residuals) < CANCEL_BOUND, (name, residuals)
        print(f"{name}: accuracy {summary['final_accuracy']:.3f}, epsilon {summary['epsilon']}, "
              f"mean round {summary['mean_round_time_s']:.1f} s")


def test_tls_deployment(tmp_path):
    """SuperNodes reach the SuperLink over TLS (self-made CA), as in the compose deployment; only registered ones join.

    The cluster's nodes train a round; an intruder SuperNode with the CA certificate (all an outsider needs to
    reach the port) and no registered key is refused (Flower's node authentication).
    """
    import subprocess
    import sys
    import time

    from server.flower_commands import BIN
    from server.processes import free_port

    with LocalCluster(2, tls=True) as cluster:
        assert (cluster.work / "certs" / "ca.crt").is_file()
        code = cluster.submit({"num-rounds": 1, "out-dir": str(tmp_path / "tls")}, timeout=600)
        address = cluster.address
        log = tmp_path / "intruder.log"
        with open(log, "w") as sink:  # a file, not a pipe: the SuperNode's children inherit it
            intruder = subprocess.Popen([sys.executable, "-m", "server.supernode", "--superlink", address,
                                         "--root-certificates", str(cluster.work / "certs" / "ca.crt"),
                                         "--host", "127.0.0.1", "--port", str(free_port()),
                                         "--node-config", "partition-id=0 num-partitions=2"],
                                        env=cluster.env, stdout=sink, stderr=subprocess.STDOUT)
            try:
                intruder.wait(timeout=120)
            finally:
                if intruder.poll() is None:
                    intruder.kill()
        out = log.read_text()
        deadline = time.monotonic() + 60
        while True:
            listed = subprocess.run([str(BIN / "flwr"), "supernode", "list", cluster.connection, "--format", "json"],
                                    env=cluster.env, capture_output=True, text=True, check=True)
            nodes = json.loads(listed.stdout[listed.stdout.index("{"):])["nodes"]
            online = [n for n in nodes if n["status"] == "online"]
            if len(online) == 2 or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert code == 0
    assert json.loads((tmp_path / "tls" / "summary.json").read_text())["final_accuracy"] > 0.2
    assert intruder.returncode != 0 and "must be registered" in out, out
    assert len(nodes) == 2 and len(online) == 2, nodes


def test_each_message_starts_when_the_supernode_wakes_its_superexec(tmp_path, monkeypatch):
    """The SuperExec's task poll at 60 s (Flower's longest): rounds still take seconds, each task wakes it.

    Without the wake (:mod:`server.superexec_wake`) a message waits for the SuperExec's next poll: a round after the
    first (its message ~3 s after the last poll found the previous one) would take about a minute.
    """
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "60")
    out = tmp_path / "woken"
    with LocalCluster(2) as cluster:
        cluster.wait_warm()
        assert warm_count(cluster.nodes_dir) == 2  # each node's warm ClientApp serves its socket
        code = cluster.submit({"method": "fedavg", "num-rounds": 3, "dataset": "digits", "out-dir": str(out)},
                              timeout=900)
    assert code == 0
    rows = read_metrics(out)
    assert len(rows) == 3 and not any(r["failed"] for r in rows)
    assert max(r["round_time_s"] for r in rows[1:]) < 30, [r["round_time_s"] for r in rows]


def test_a_long_work_folder_keeps_the_supernodes_socket_paths_short(tmp_path):
    """A ``keep_workdir`` of ~100 bytes: the SuperNodes' work folders (Unix sockets, at most 107 bytes) go elsewhere.

    Under the long folder the warm ClientApp's and the SuperExec's sockets could not be bound.  The nodes' folder
    is removed on exit.
    """
    keep = tmp_path / ("w" * 100)
    with LocalCluster(1, keep_workdir=str(keep)) as cluster:
        assert not cluster.nodes_dir.is_relative_to(keep)
        assert len(str(cluster.nodes_dir)) <= NODES_DIR_MAX
        cluster.wait_warm(timeout=180)
        assert warm_count(cluster.nodes_dir) == 1
    assert not cluster.nodes_dir.exists()
