"""DDP-SA ``ddpsa-noise = "gaussian"``: shares summing to cdp's central Gaussian, charges, floors, ledgers, audit.

Statistical tests use fixed seeds (production draws os.urandom).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord
from scipy import stats

import client.methods.ddpsa as ddpsa_client
from client.ledger import ClientLedger
from protocols.config import ConfigError, RunConfig
from protocols.ddpsa import (
    distributed_gaussian_share,
    gaussian_multiplier,
    gaussian_share_std,
    honest_participants,
    present_multiplier,
)
from protocols.privacy import GaussianEvent, GdpAccountant, gaussian_epsilon, gdp_epsilon, l1_sensitivity, noise_multiplier
from protocols.wire.ddpsa import DdpsaRound
from strategies.ddpsa import DdpsaStrategy
from tests.test_ddpsa_method import LINEAR, UNREACHED, _raw, _served, _setup, credentials  # noqa: F401 (autouse)
from tests.test_ddpsa_noise import _one_round

GAUSS = {"ddpsa_noise": "gaussian"}


def _seed(label: int) -> bytes:
    return label.to_bytes(32, "big")


# ------------------------------------------------------------------------------ the math
def test_multiplier_is_cdps_calibration() -> None:
    """The same (epsilon, delta, rounds) give cdp's z, whose releases spend the budget under RDP."""
    for eps, rounds in ((1.0, 8), (1.0, 1), (4.0, 30)):
        z = gaussian_multiplier(eps, 1e-5, rounds)
        assert z == noise_multiplier(eps, 1e-5, rounds)
        assert gaussian_epsilon(z, 1.0, rounds, 1e-5) <= eps < gaussian_epsilon(0.99 * z, 1.0, rounds, 1e-5)


@pytest.mark.parametrize(("participants", "frac"), [(10, 0.1), (4, 0.0)])
def test_honest_shares_sum_to_the_calibrated_variance(participants: int, frac: float) -> None:
    """N' = n - floor(f n) honest shares sum to N(0, (z Delta_2)^2) (variance and KS); one fewer is rejected."""
    size, sens = 40_000, l1_sensitivity(1.0, adjacency="replace-one")
    z = gaussian_multiplier(1.0, 1e-5, 8)
    honest = honest_participants(participants, frac)
    std = gaussian_share_std(sens, z, honest)
    shares = [distributed_gaussian_share(size, std, seed=_seed(1000 * participants + i)) for i in range(honest)]
    total = np.sum(shares, axis=0)
    central = z * sens
    assert np.var(total) == pytest.approx(central ** 2, rel=0.03)
    assert stats.kstest(total, stats.norm(scale=central).cdf).pvalue > 1e-3
    short = total - shares[0]  # one honest share missing: too little noise, and the test sees it
    assert stats.kstest(short, stats.norm(scale=central).cdf).pvalue < 1e-6
    assert np.var(short) == pytest.approx(central ** 2 * (honest - 1) / honest, rel=0.03)


def test_present_multiplier_is_the_noise_left() -> None:
    assert present_multiplier(2.0, 9, 9) == 2.0
    assert present_multiplier(2.0, 9, 12) == 2.0  # colluders' shares count for nothing
    assert present_multiplier(2.0, 9, 4) == pytest.approx(2.0 * math.sqrt(4 / 9))
    assert present_multiplier(2.0, 9, 0) == 0.0


# ------------------------------------------------------------------------------ configuration and wire
def test_bad_gaussian_settings_are_refused_before_round_one() -> None:
    for extra in ({"ddpsa-composition": "pld"}, {"ddpsa-composition": "advanced"}, {"ddpsa-allocation": "exponential"}):
        with pytest.raises(ConfigError, match="ddpsa-noise"):
            RunConfig.from_mapping(_raw(**GAUSS, **{k.replace("-", "_"): v for k, v in extra.items()}))
    with pytest.raises(ConfigError):
        RunConfig.from_mapping(_raw(ddpsa_noise="gauss"))
    RunConfig.from_mapping(_raw(**GAUSS))


def test_plan_carries_the_multiplier_only_for_gaussian_rounds() -> None:
    args = (("a", "b"), ("127.0.0.1:1", "127.0.0.1:2"), 2, "r", 24, 10)
    plan = DdpsaRound(0.5, "gaussian", *args, 3.25)
    assert DdpsaRound.from_config(plan.to_config()) == plan
    for noise, z in (("gaussian", 0.0), ("distributed", 1.0), ("gaussian", -1.0)):
        with pytest.raises(ValueError, match="multiplier"):
            DdpsaRound(0.5, noise, *args, z)


def test_strategy_charges_the_gaussian_the_present_shares_leave() -> None:
    """All present: cdp's z; dropouts: the smaller z of the honest shares left (charged more); none: refused."""
    _, _, s = _setup(num_clients=10, num_rounds=8, epsilon=1.0, ddpsa_collude_frac=0.1, ddpsa_servers=UNREACHED,
                     **GAUSS)
    z = gaussian_multiplier(1.0, 1e-5, 8)
    assert s.z == z and isinstance(s.privacy.uplink, GdpAccountant)
    assert s.round_event(1, 10, 10, 650) == GaussianEvent(z)
    nine, eight = s.round_event(1, 10, 9, 650), s.round_event(1, 10, 8, 650)
    assert nine.noise_multiplier == pytest.approx(z * math.sqrt(8 / 9))
    eps = [GdpAccountant([e]).epsilon(1e-5) for e in (GaussianEvent(z), nine, eight)]
    assert eps[0] < eps[1] < eps[2] < math.inf
    assert s.round_event(1, 10, 1, 650) is None  # the one present may be the colluder
    s.privacy.compose(GaussianEvent(z))
    assert s.privacy_report(1)["epsilon"] == pytest.approx(gdp_epsilon(z, 1, 1e-5))


# ------------------------------------------------------------------------------ the real client and server
@pytest.fixture
def gauss_seen(monkeypatch) -> list[np.ndarray]:
    """The Gaussian share each client adds (noisy sum minus its L2-clipped sum), with deterministic seeds."""
    seen: list[np.ndarray] = []
    original = ddpsa_client.gaussian_gradient_sum

    def spy(model, x, y, clip, multiplier, honest, **kwargs):
        out = original(model, x, y, clip, multiplier, honest, **kwargs)
        seen.append(out[0] - ddpsa_client.clipped_gradient_sum(model, x, y, clip, norm="l2")[0])
        return out

    monkeypatch.setattr(ddpsa_client, "gaussian_gradient_sum", spy)
    seeds = iter(range(10**6))
    monkeypatch.setattr(ddpsa_client, "_noise_seed", lambda: next(seeds).to_bytes(32, "big"))
    return seen


def test_real_round_adds_shares_of_cdps_noise(gauss_seen) -> None:
    with _served(num_clients=8, num_rounds=2, ddpsa_collude_frac=0.0, **GAUSS, **LINEAR) as (cfg, grid, _):
        strategy, replies, arrays = _one_round(cfg, grid)
    assert arrays is not None and len(gauss_seen) == 8
    central = noise_multiplier(cfg.epsilon, cfg.delta, 2) * l1_sensitivity(cfg.clip, adjacency=cfg.adjacency)
    assert np.var(gauss_seen[0]) == pytest.approx(central ** 2 / 8, rel=0.3)
    assert np.var(np.sum(gauss_seen, axis=0)) == pytest.approx(central ** 2, rel=0.3)
    assert strategy.privacy_report(1)["epsilon"] == pytest.approx(gdp_epsilon(strategy.z, 1, cfg.delta))


class _SmallerMultiplier(DdpsaStrategy):
    """A malicious server that asks for half the noise multiplier."""

    def train_config(self, server_round: int) -> ConfigRecord:
        rec = super().train_config(server_round)
        rec["ddpsa-noise-multiplier"] = rec["ddpsa-noise-multiplier"] / 2
        return rec


@pytest.mark.parametrize(("server_noise", "client_noise", "strategy_cls", "parameter"), [
    ("gaussian", "gaussian", _SmallerMultiplier, "ddpsa-noise-multiplier"),
    ("gaussian", "distributed", DdpsaStrategy, "ddpsa-noise"),  # the client's own config asks Laplace
    ("distributed", "gaussian", DdpsaStrategy, "ddpsa-noise"),  # ... or Gaussian
    ("local", "gaussian", DdpsaStrategy, "ddpsa-noise"),
])
def test_client_floor_refuses_a_round_below_its_gaussian(gauss_seen, server_noise, client_noise, strategy_cls,
                                                         parameter) -> None:
    with _served(num_clients=4, num_rounds=2, ddpsa_noise=server_noise, **LINEAR) as (cfg, grid, _):
        for ctx in grid.contexts.values():
            ctx.run_config["ddpsa-noise"] = client_noise
        _, replies, arrays = _one_round(cfg, grid, strategy_cls)
    assert arrays is None and len(replies) == 4 and all(r.has_error() for r in replies)
    assert all("privacy floor" in r.error.reason and parameter in r.error.reason for r in replies)
    assert gauss_seen == []  # refused before any noise was drawn or share pushed


@pytest.mark.usefixtures("one_thread")
def test_client_ledgers_agree_with_the_server(run_inprocess, tmp_path) -> None:
    from strategies.run.checkpoint import LEDGER_DIR

    summary, rows = run_inprocess(method="ddpsa", num_rounds=3, num_clients=3, hidden="", epsilon=2.0, **GAUSS)
    assert summary["failed_rounds"] == [] and len(rows) == 3
    z = gaussian_multiplier(2.0, summary["config"]["delta"], 3)
    assert all(r["noise_multiplier_round"] == pytest.approx(z) for r in rows)
    # Exact Gaussian-DP composition of cdp's multiplier: at most the RDP figure it was calibrated to.
    assert summary["epsilon"] == pytest.approx(gdp_epsilon(z, 3, summary["config"]["delta"]), rel=1e-9)
    assert 1.5 <= summary["epsilon"] <= gaussian_epsilon(z, 1.0, 3, summary["config"]["delta"]) <= 2.0
    paths = sorted((tmp_path / "run" / LEDGER_DIR).glob("client-*.json"))
    assert len(paths) == 3
    for path in paths:
        led = ClientLedger(path, json.loads(path.read_text()))
        assert led.spent(summary["config"]["delta"]) == {"uplink/record": pytest.approx(summary["epsilon"], rel=1e-9)}


@pytest.mark.usefixtures("one_thread")
def test_dropouts_abort_a_gaussian_round_charged_as_planned(run_inprocess, tmp_path, unplanned_dropouts) -> None:
    """Replies withheld after the shares were pushed: the round is aborted unreleased.

    Each share's signed terms allow only a sum over every participant its client was shown (the ledger charged the
    whole central Gaussian); the round is charged its planned release, which the clients that pushed recorded.
    """
    common = dict(method="ddpsa", num_clients=10, num_rounds=4, ddpsa_collude_frac=0.0, **GAUSS, **LINEAR)
    full, _ = run_inprocess(**common)
    z = gaussian_multiplier(LINEAR["epsilon"], full["config"]["delta"], 4)
    delta = full["config"]["delta"]
    assert full["failed_rounds"] == [] and full["epsilon"] == pytest.approx(gdp_epsilon(z, 4, delta))
    unplanned_dropouts(0.1)
    dropped, _ = run_inprocess(**common, out_dir=str(tmp_path / "drop"))
    assert dropped["failed_rounds"] and all("summed only with at least 10 of the participants" in f
                                            for f in dropped["failed_rounds"])
    assert dropped["epsilon"] == pytest.approx(full["epsilon"]) and not dropped["privacy"]["over_target"]


# ------------------------------------------------------------------------------ audit
def test_audit_finds_no_violation_and_catches_halved_gaussian_noise() -> None:
    """The real Gaussian shares on local intermediate servers: claimed at delta, not flagged; halved: caught."""
    from server.audit import run_audit
    from server.audit_spec import AuditSpec

    settings = (("ddpsa-noise", "gaussian"),)
    report = run_audit(AuditSpec("ddpsa", "upload", 4.0, trials=16_000, settings=settings), seed=3)
    assert report.delta > 0 and report.claimed_epsilon <= 4.0 * (1 + 1e-9), report.line()
    assert report.trials >= 16_000 and not report.violation, report.line()
    # A claim at delta needs more trials than a pure one to separate a halved std (64k trials: 3.65 for a claim of
    # 3.70 in one CI run; 256k: 4.08-4.94 over four seeds, about 10 s).
    halved = run_audit(AuditSpec("ddpsa", "upload", 4.0, trials=256_000, settings=settings, fault="halve-noise"),
                       seed=5)
    assert halved.epsilon_lb > halved.claimed_epsilon, halved.line()
