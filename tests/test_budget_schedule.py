"""Calibration to the public participation schedule (sample-rate < 1) and the budget guard of every method."""

from __future__ import annotations

import json

import pytest

from protocols.config import RunConfig
from protocols.floor import FloorViolation, at_least, nadp_floor, nadp_round_noise, niss_floor
from protocols.graphs import roster_round_of
from protocols.niss import client_multiplier, client_sigma, client_tau
from protocols.schedule import most_participations, participations, roster_releases
from tests.test_budget_cap import DROPS, NADP_FAST

ROSTER = {f"client-{i:02d}": bytes([i]) * 32 for i in range(10)}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


# ------------------------------------------------------------------------------------------------ the schedule
def test_the_schedule_is_the_rounds_samples_counted():
    """Counts agree with the per-round public samples both ends draw; sample-rate 1 gives num-rounds."""
    cfg = RunConfig.from_mapping({"method": "nadp", "num-clients": 10, "sample-rate": 0.5, "num-rounds": 12})
    counts = {name: 0 for name in ROSTER}
    for rnd in range(1, 13):
        for name in roster_round_of(cfg, ROSTER, rnd).sample:
            counts[name] += 1
    assert participations(list(ROSTER), 5, _digest(), 1, 12) == counts
    assert sum(counts.values()) == 12 * 5
    most = roster_releases(cfg, ROSTER)
    assert most == max(counts.values()) and 6 <= most < 12  # fewer releases than rounds: less noise is needed
    assert participations(list(ROSTER), 5, _digest(), 4, 12) == {
        n: c - sum(n in roster_round_of(cfg, ROSTER, r).sample for r in range(1, 4)) for n, c in counts.items()}
    full = RunConfig.from_mapping({"method": "nadp", "num-clients": 10, "num-rounds": 12})
    assert roster_releases(full, ROSTER) == 12 == most_participations(list(ROSTER), 10, _digest(), 12)


def _digest() -> bytes:
    from protocols.identity import roster_digest

    return roster_digest(ROSTER)


def test_the_nadp_floor_follows_the_schedule():
    """Fewer releases, less noise per release; a plan calibrated for fewer releases than the schedule is refused."""
    cfg = RunConfig.from_mapping({**NADP_FAST, "num-clients": 10, "num-rounds": 12, "sample-rate": 0.5})
    sizes = {11: 100, 12: 120, 13: 90}
    full, sched = nadp_round_noise(cfg, sizes, None), nadp_round_noise(cfg, sizes, None, releases=8)
    assert full.sigmas == nadp_round_noise(cfg, sizes, None, releases=12).sigmas  # num-rounds is the default
    assert sched.sigmas.sigma_down == pytest.approx(full.sigmas.sigma_down * (8 / 12) ** 0.5, rel=1e-3)  # z ~ sqrt(T)
    fewer = nadp_floor(cfg, sizes, 12, None, releases=7)
    with pytest.raises(FloorViolation, match="nadp-sigma-down"):
        at_least("nadp-sigma-down", fewer.sigmas.sigma_down, nadp_floor(cfg, sizes, 12, None, releases=8).sigmas.sigma_down)
    for bad in (0, 13):
        with pytest.raises(FloorViolation, match="releases"):
            nadp_round_noise(cfg, sizes, None, releases=bad)


def test_the_niss_floor_follows_the_schedule():
    """sigma_k for the schedule's releases; a share request calibrated for fewer releases is refused by the floor."""
    cfg = RunConfig.from_mapping({"method": "niss", "num-clients": 10, "num-rounds": 12, "sample-rate": 0.5})
    sizes = {11: 100, 12: 120, 13: 90}
    graph = {n: [m for m in sizes if m != n] for n in sizes}
    tau = client_tau(cfg, sizes)
    assert client_sigma(cfg, 0.3, 100) == client_sigma(cfg, 0.3, 100, releases=12)  # num-rounds is the default
    full, sched = client_sigma(cfg, 0.3, 100), client_sigma(cfg, 0.3, 100, releases=8)
    assert sched == pytest.approx(full * (8 / 12) ** 0.5, rel=1e-2)  # z ~ sqrt(T)
    floor = niss_floor(cfg, sizes, graph, tau, releases=8)
    assert floor.scale == pytest.approx(niss_floor(cfg, sizes, graph, tau).scale, rel=1e-12)  # scale-free in z
    assert floor.scale >= 1.0
    # A server calibrated for 7 releases asks for z_7 / z_8 of the client's sigma: below its floor, refused.
    fewer = client_multiplier(cfg, 7) / client_multiplier(cfg, 8) * floor.scale
    assert fewer < floor.scale
    with pytest.raises(FloorViolation, match="joint-view noise scale"):
        niss_floor(cfg, sizes, graph, tau, offered=fewer, releases=8)
    niss_floor(cfg, sizes, graph, tau, offered=floor.scale, releases=8)  # its own calibration passes
    for bad in (0, 13):
        with pytest.raises(FloorViolation, match="releases"):
            niss_floor(cfg, sizes, graph, tau, releases=bad)


# ------------------------------------------------------------------------------------------------ real runs
def _client_epsilons(out, views: tuple[str, ...] = ("uplink", "downlink")) -> list[float]:
    from client.ledger import ClientLedger
    from strategies.run.checkpoint import LEDGER_DIR

    delta = json.loads((out / "summary.json").read_text())["config"]["delta"]
    worst = []
    for path in sorted((out / LEDGER_DIR).glob("client-*.json")):
        led = ClientLedger(path, json.loads(path.read_text()))
        worst.append(max(a.rdp.epsilon(delta) for k, a in led.accounts.items() if k.split("/")[-2] in views))
    return worst


@pytest.mark.parametrize("method", ["nadp", "mpddp", "niss"])
def test_half_sample_rate_spends_the_budget(run_inprocess, tmp_path, method):
    """Q = 0.5, 8 rounds: calibrated for the most rounds a client is sampled in, epsilon ends close to 1, never over."""
    cfg = {**(NADP_FAST if method == "nadp" else {"method": method}), "num-clients": 10, "sample-rate": 0.5,
           "num-rounds": 8, "seed": 2, "epsilon": 1.0, "train-subset": 500, "test-subset": 200}
    summary, rows = run_inprocess(**cfg)
    assert summary["stopped"] is None and summary["failed_rounds"] == [] and len(rows) == 8
    assert all("noise_scale" not in r for r in rows)  # a clean run: the guard leaves the schedule's noise alone
    assert 0.9 <= summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]
    # The clients' own ledgers agree: the most sampled spent ~1 (mpddp's uploads carry no guarantee: its model's).
    clients = _client_epsilons(tmp_path / "run", ("downlink",) if method == "mpddp" else ("uplink", "downlink"))
    assert max(clients) <= 1.0 and max(clients) >= 0.9
    assert min(clients) < max(clients)  # the schedule is uneven: clients sampled less spend less


def test_nadp_at_half_sample_rate_with_dropouts_ends_within_the_target(run_inprocess):
    """The guard plans per client over the rounds the schedule still samples it: 20 % drop, still <= 1."""
    summary, rows = run_inprocess(**NADP_FAST, **{**DROPS, "num-rounds": 4, "sample-rate": 0.5})
    assert summary["stopped"] is None and len(rows) == 4
    assert any(r.get("dropped") for r in rows)
    assert any(r.get("noise_scale", 1.0) > 1.0 for r in rows)  # the dearer rounds raised the noise of later ones
    assert summary["epsilon"] <= 1.0 and not summary["privacy"]["over_target"]
