"""Dropout-aware planning (run-config ``dropout-rate``, :mod:`protocols.dropouts`) of nadp and niss.

* the tail bound ``m``: the smallest count with ``P[Bin(k, r) > m] <= 1e-3``;
* nadp: with up to ``m`` participants dropped (random sets, the largest weights, all but one neighbour of the
  least-connected client) the survivors' renormalised aggregate and their joint upload view keep the round's
  multiplier, i.e. each survivor's round costs at most the per-round epsilon; the plan without the rate does not
  (the test can fail).  Server plan and client floor derive the same sigmas; a client refuses a plan without;
* niss: the joint-view scale carries the dropout factor on both ends and a client refuses a smaller one;
* real clients and strategy in-process on an n-out graph: a round whose dropouts leave one client with fewer
  than its self-mask threshold of neighbours used to charge that client its residual alone (epsilon ~15 in one
  round: the budget guard stopped the run); the held upload's self-mask is now counted and the run ends under its
  target without raising its noise.
"""

from __future__ import annotations

import math
import random

import pytest

import strategies.run.grid as metered_grid
from protocols.config import RunConfig
from protocols.dropouts import binom_tail, dropout_bound, nadp_dropout_factor, niss_dropout_factor
from protocols.floor import FloorViolation, at_least, nadp_floor, nadp_round_noise, niss_floor
from protocols.graphs import complete_graph, n_out_graph
from protocols.masking import mask_threshold
from protocols.niss import client_tau
from protocols.privacy import GaussianEvent, RdpAccountant, calibrate_noise_multiplier
from protocols.wire.keys import PeerKeys
from strategies.nadp import NadpStrategy

NADP_FAST = {"method": "nadp", "local-epochs": 1, "batch-size": 1000, "lr": 4.0, "clip": 1.0, "hidden": ""}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.mark.parametrize(("k", "rate"), [(10, 0.01), (60, 0.1), (300, 0.1), (1000, 0.05)])
def test_tail_bound_is_the_smallest_count_the_tail_allows(k, rate):
    m = dropout_bound(k, rate)
    assert binom_tail(k, rate, m + 1) <= 1e-3 < binom_tail(k, rate, m)
    assert dropout_bound(k, 0.0) == 0 and dropout_bound(2, 0.4) == 1  # one survivor always remains


def _cfg(k: int, rate: float, graph: str = "n-out") -> RunConfig:
    return RunConfig.from_mapping({**NADP_FAST, "num-clients": k, "num-rounds": 2, "graph": graph, "n-out": 4,
                                   "dropout-rate": rate})


def _survivor_multipliers(noise, survivors: list[int]) -> tuple[float, float]:
    """(least joint upload-view multiplier among ``survivors``, their renormalised aggregate's multiplier)."""
    a = noise.allocation
    joint = a.joint_uplink_std(noise.lam, among=survivors)
    z_up = min(joint[n] / noise.sensitivities[n] for n in survivors)
    z_down = (math.sqrt(math.fsum(a.residual_std[n] ** 2 for n in survivors))
              / max(a.weights[n] * noise.sensitivities[n] for n in survivors))
    return z_up, z_down


def _drop_sets(graph: dict[int, list[int]], sizes: dict[int, int], m: int) -> list[set[int]]:
    rng = random.Random(5)
    ids = sorted(graph)
    low = min(ids, key=lambda n: (len(graph[n]), n))
    sets = [set(rng.sample(ids, d)) for d in (1, m // 2, m, m, m)]
    sets.append(set(sorted(ids, key=lambda n: -sizes[n])[:m]))  # the largest weights: the least residual left
    sets.append(set(graph[low][: min(m, len(graph[low]) - 1)]))  # the least-connected client keeps one neighbour
    return sets


@pytest.mark.parametrize(("k", "rate", "kind"), [(60, 0.1, "n-out"), (10, 0.05, "complete")])
def test_nadp_plan_keeps_the_round_multiplier_for_up_to_m_dropouts(k, rate, kind):
    sizes = {n: 20 + 3 * n for n in range(k)}  # unequal: the largest clients carry the most residual
    graph = n_out_graph(list(range(k)), 4, b"g" * 32) if kind == "n-out" else complete_graph(list(range(k)))
    z = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 2)
    per_round = RdpAccountant([GaussianEvent(z)]).epsilon(1e-5)
    m = dropout_bound(k, rate)
    planned, blind = nadp_round_noise(_cfg(k, rate, kind), sizes, graph), nadp_round_noise(_cfg(k, 0.0, kind), sizes, graph)
    assert planned.dropout_factor == pytest.approx(nadp_dropout_factor(sizes, rate)) and planned.dropout_factor > 1
    assert blind.dropout_factor == 1.0
    for drop in _drop_sets(graph, sizes, m):
        assert 1 <= len(drop) <= m
        survivors = [n for n in sizes if n not in drop]
        z_up, z_down = _survivor_multipliers(planned, survivors)
        assert z_down >= z * (1 - 1e-9) and z_up >= z * (1 - 1e-9), (len(drop), z_up / z, z_down / z)
        assert RdpAccountant([GaussianEvent(min(z_up, z_down))]).epsilon(1e-5) <= per_round * (1 + 1e-9)
    worst = set(sorted(sizes, key=lambda n: -sizes[n])[:m])
    z_up, z_down = _survivor_multipliers(blind, [n for n in sizes if n not in worst])
    assert min(z_up, z_down) < 0.97 * z  # without the rate the same dropouts cost more than the round's share


def test_nadp_client_floor_derives_the_same_plan_and_refuses_one_without_dropouts():
    k, rate = 40, 0.1
    sizes = {n: 30 + n for n in range(k)}
    graph = n_out_graph(list(range(k)), 4, b"h" * 32)
    server = nadp_round_noise(_cfg(k, rate), sizes, graph)
    for me in (0, 17, 39):
        client = nadp_floor(_cfg(k, rate), sizes, me, graph)
        assert client.sigmas == server.sigmas and client.lam == server.lam
        assert client.allocation.residual_std[me] == server.allocation.residual_std[me]
    careless = nadp_round_noise(_cfg(k, 0.0), sizes, graph)  # a server that ignores the dropout rate
    with pytest.raises(FloorViolation, match="nadp-sigma-down"):
        at_least("nadp-sigma-down", careless.sigmas.sigma_down, nadp_floor(_cfg(k, rate), sizes, 3, graph).sigmas.sigma_down)


def test_niss_scale_carries_the_dropout_factor_on_both_ends():
    k = 60
    graph = n_out_graph(list(range(k)), 4, b"n" * 32)
    sizes = dict.fromkeys(graph, 40)

    def cfg(rate: float) -> RunConfig:
        return RunConfig.from_mapping({"method": "niss", "num-clients": k, "graph": "n-out", "n-out": 4,
                                       "dropout-rate": rate})

    tau = client_tau(cfg(0.1), sizes)
    plain, planned = niss_floor(cfg(0.0), sizes, graph, tau), niss_floor(cfg(0.1), sizes, graph, tau)
    factor = niss_dropout_factor(dict.fromkeys(graph, 1.0), graph, 0.1)
    assert planned.scale == pytest.approx(plain.scale * factor) and factor > 1.1
    with pytest.raises(FloorViolation, match="joint-view noise scale"):
        niss_floor(cfg(0.1), sizes, graph, tau, offered=plain.scale)
    # complete graph: exact, the 5 survivors of 5 dropouts keep 4/9 of their shares
    assert niss_dropout_factor(dict.fromkeys(range(10), 1.0), complete_graph(list(range(10))), 0.1) == pytest.approx(
        math.sqrt(10 / (5 * 4 / 9)))
    with pytest.raises(ValueError, match="dropout-rate"):  # a path of 3: 2 dropouts could take every share
        niss_dropout_factor(dict.fromkeys(range(3), 1.0), {0: [1], 1: [0, 2], 2: [1]}, 0.4)


# ----------------------------------------------------------------------------------- real clients in-process
def _strip_one_client(messages, rate, seed, fallback_round=1):
    """Round 1: withhold the train messages of ``d - t + 1`` neighbours of the least-connected client."""
    train = [m for m in messages if m.metadata.message_type == "train"]
    if not train or int(train[0].content["config"]["round"]) != 1:
        return fallback_round, set()
    nbrs = {m.metadata.dst_node_id: PeerKeys.from_config(m.content["config"]).peer_ids for m in train}
    target = min(nbrs, key=lambda n: (len(nbrs[n]), n))
    d = len(nbrs[target])
    return 1, set(sorted(nbrs[target])[: d - mask_threshold(d, 0.1) + 1])


def _residual_only(self, st, node):
    """The accounting before: an upload held, its pairs revealed, charged its residual alone."""
    a = st.allocation
    return a.residual_std[node] / (a.weights[node] * st.sensitivity[node])


def test_an_n_out_round_with_a_held_upload_stays_under_target(run_inprocess, tmp_path, monkeypatch):
    """20 clients, 4-out, round 1 strips one client below its self-mask threshold: it is held, not aggregated."""
    monkeypatch.setattr(metered_grid, "fault_drops", _strip_one_client)
    common = {**NADP_FAST, "num-clients": 20, "num-rounds": 2, "graph": "n-out", "n-out": 4, "seed": 3,
              "epsilon": 1.0, "fault-drop-rate": 0.1}
    with monkeypatch.context() as old:
        old.setattr(NadpStrategy, "_excluded_multiplier", _residual_only)
        before, _ = run_inprocess(**common, dropout_rate=0.0, out_dir=str(tmp_path / "before"))
    assert before["stopped"] is not None and "past its target epsilon" in before["stopped"], before["stopped"]
    summary, rows = run_inprocess(**common, dropout_rate=0.1, out_dir=str(tmp_path / "after"))
    assert summary["stopped"] is None and summary["failed_rounds"] == [] and len(rows) == 2
    assert rows[0]["dropped"] >= 3, rows[0]  # 2 withheld, and the stripped client's upload held, not aggregated
    z = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 2)
    assert rows[0]["epsilon"] <= RdpAccountant([GaussianEvent(z)]).epsilon(1e-5) * (1 + 1e-6)
    assert "noise_scale" not in rows[1]  # round 2 needed no more noise than planned
    assert summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]
