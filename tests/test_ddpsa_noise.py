"""DDP-SA distributed noise: shares that sum to one central Laplace, the epsilon of the noise present, the floor.

Statistical tests use fixed seeds (production draws os.urandom).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord
from scipy import integrate, stats

import client.methods.ddpsa as ddpsa_client
from protocols.config import ConfigError
from protocols.ddpsa import (
    distributed_laplace_share,
    gamma_difference_epsilon,
    gamma_noise,
    honest_participants,
    laplace_noise,
)
from protocols.privacy import l1_sensitivity, laplace_scale
from protocols.wire.arrays import from_record
from protocols.wire.ddpsa import DdpsaRound
from strategies.ddpsa import DdpsaStrategy
from tests.test_ddpsa_method import LINEAR, _initial, _served, _setup, credentials  # noqa: F401 (autouse fixture)


def _seed(label: int) -> bytes:
    return label.to_bytes(32, "big")


# ------------------------------------------------------------------------------ the math
def test_gamma_noise_has_the_gamma_moments_and_distribution() -> None:
    for shape in (0.1, 1.0, 3.5):
        x = gamma_noise(40_000, shape, 2.0, seed=_seed(int(shape * 10)))
        assert stats.kstest(x, stats.gamma(shape, scale=2.0).cdf).pvalue > 1e-3
    # The test has power: a 10 % wrong shape is rejected.
    assert stats.kstest(gamma_noise(40_000, 1.1, 2.0, seed=_seed(5)), stats.gamma(1.0, scale=2.0).cdf).pvalue < 1e-6


@pytest.mark.parametrize("honest", [3, 10])
def test_honest_shares_sum_to_a_laplace_of_the_central_scale(honest: int) -> None:
    """N' shares of Gamma(1/n', b) - Gamma(1/n', b) sum to Lap(b) (KS); fewer do not."""
    b, size = 2.5, 50_000
    shares = [distributed_laplace_share(size, b, honest, seed=_seed(100 * honest + i)) for i in range(honest)]
    total = np.sum(shares, axis=0)
    assert stats.kstest(total, stats.laplace(scale=b).cdf).pvalue > 1e-3
    # Power: a 10 % smaller scale, or one honest share missing, is rejected.
    assert stats.kstest(total, stats.laplace(scale=0.9 * b).cdf).pvalue < 1e-6
    assert stats.kstest(total - shares[0], stats.laplace(scale=b).cdf).pvalue < 1e-6
    # Each share is small: variance 2 b^2 / n' against the local Laplace's 2 b^2.
    assert np.var(shares[0]) == pytest.approx(2 * b * b / honest, rel=0.1)


def test_aggregate_noise_is_one_over_n_of_local() -> None:
    """N participants, no colluder: the distributed aggregate's variance is 1/(n - 1) of n local Laplaces'.

    A receiving participant knows its own share: n' = n - 1 shares make one Lap(b) (the paper's n' = n).
    """
    n, b, size = 8, 1.0, 40_000
    local = np.sum([laplace_noise(size, b, seed=_seed(i)) for i in range(n)], axis=0)
    dist = np.sum([distributed_laplace_share(size, b, honest_participants(n, 0.0), seed=_seed(50 + i))
                   for i in range(n)], axis=0)
    assert np.var(dist) / np.var(local) == pytest.approx(1 / (n - 1), rel=0.1)


def test_honest_participants_counts_out_the_colluding_fraction() -> None:
    # at least one share left out: a receiving participant knows its own (a lone participant's receivers none)
    assert [honest_participants(n, 0.1) for n in (5, 10, 19, 20, 100)] == [4, 9, 18, 18, 90]
    assert honest_participants(7, 0.0) == 6 and honest_participants(2, 0.0) == 1 and honest_participants(1, 0.0) == 1
    for bad in (-0.1, 1.0, math.nan):
        with pytest.raises(ValueError):
            honest_participants(10, bad)


def test_epsilon_of_the_noise_present() -> None:
    """Full shares: eps_t; fewer: more, growing as shares go missing and with the dimension; a <= 1/2: unbounded."""
    eps_t = 0.5
    assert gamma_difference_epsilon(1.0, eps_t, 650) == eps_t
    assert gamma_difference_epsilon(1.3, eps_t, 650) == eps_t
    # Continuous at a = 1 and at d = 1 it is the exact worst log-ratio log p(0) - log p(S) of the density.
    assert gamma_difference_epsilon(1 - 1e-9, eps_t, 650) == pytest.approx(eps_t, rel=1e-4)
    a, s = 0.8, 0.7
    f = stats.gamma(a).pdf

    def p(v: float) -> float:  # density of X - Y, X, Y ~ Gamma(a, 1), by numerical convolution
        v = abs(v)
        return sum(integrate.quad(lambda y: f(y) * f(y + v), lo, hi, limit=200)[0] for lo, hi in ((0, 1), (1, 60)))

    worst = max(math.log(p(z) / p(z + s)) for z in np.linspace(-3, 3, 61))  # the worst shift point is z = 0
    assert gamma_difference_epsilon(a, s, 1) == pytest.approx(worst, rel=1e-6)
    assert gamma_difference_epsilon(a, s, 1) == pytest.approx(math.log(p(0) / p(s)), rel=1e-9)
    values = [gamma_difference_epsilon(a, eps_t, 650) for a in (0.99, 0.9, 0.75, 0.6)]
    assert eps_t < values[0] < values[1] < values[2] < values[3] < math.inf
    assert gamma_difference_epsilon(0.9, eps_t, 100_000) > gamma_difference_epsilon(0.9, eps_t, 650)
    assert gamma_difference_epsilon(0.5, eps_t, 650) == math.inf


def test_strategy_charges_more_when_participants_drop() -> None:
    _, _, s = _setup(num_clients=10, epsilon=2.0, num_rounds=2, ddpsa_collude_frac=0.1, ddpsa_composition="basic",
                     ddpsa_servers="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    eps_t = s.epsilon_of_round(1)
    # n = 10, f = 0.1: n' = 9, one share may be a colluder's; all 10 present = eps_t.
    assert s.round_charge(1, 10, 10, 650) == eps_t
    nine, eight = s.round_charge(1, 10, 9, 650), s.round_charge(1, 10, 8, 650)
    assert eps_t < nine < eight < math.inf
    assert nine == pytest.approx(gamma_difference_epsilon(8 / 9, eps_t, 650))
    assert s.round_charge(1, 10, 5, 650) == math.inf  # (5 - 1) / 9 <= 1/2
    s.release_round(1, nine)
    assert s.privacy_report(1)["epsilon"] == pytest.approx(nine)
    _, _, local = _setup(num_clients=10, epsilon=2.0, num_rounds=2, ddpsa_noise="local",
                         ddpsa_servers="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    assert local.round_charge(1, 10, 5, 650) == eps_t  # every local upload carries its own Lap(b)


# ------------------------------------------------------------------------------ the real client and server
@pytest.fixture
def noise_seen(monkeypatch) -> list[np.ndarray]:
    """The noise each client adds (noisy sum minus its clipped sum), with deterministic seeds."""
    seen: list[np.ndarray] = []
    original = ddpsa_client.noisy_gradient_sum

    def spy(model, x, y, clip, epsilon, **kwargs):
        out = original(model, x, y, clip, epsilon, **kwargs)
        centred = kwargs.get("centred", False)
        seen.append(out[0] - ddpsa_client.clipped_gradient_sum(model, x, y, clip, centred=centred)[0])
        return out

    monkeypatch.setattr(ddpsa_client, "noisy_gradient_sum", spy)
    seeds = iter(range(10**6))
    monkeypatch.setattr(ddpsa_client, "_noise_seed", lambda: next(seeds).to_bytes(32, "big"))
    return seen


def _one_round(cfg, grid, strategy_cls=DdpsaStrategy):
    strategy = strategy_cls(cfg)
    try:
        msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
        replies = list(grid.send_and_receive(msgs))
        if any(r.has_error() for r in replies):
            return strategy, replies, None
        arrays, _ = strategy.aggregate_train(1, replies)
        return strategy, replies, arrays
    finally:
        strategy.close()


def test_real_round_noise_is_one_over_n_of_local(noise_seen) -> None:
    """Driving the client code: the aggregate noise of a distributed round has ~1/n' of the local round's variance."""
    variances = {}
    for mode in ("local", "distributed"):
        noise_seen.clear()
        with _served(num_clients=8, num_rounds=2, ddpsa_noise=mode, ddpsa_collude_frac=0.0,
                     **{**LINEAR, "epsilon": 1.0}) as (cfg, grid, _):
            strategy, replies, arrays = _one_round(cfg, grid)
        assert arrays is not None and len(noise_seen) == 8
        b = laplace_scale(l1_sensitivity(cfg.clip, adjacency=cfg.adjacency), strategy.epsilon_of_round(1))
        per_client = np.var(noise_seen[0])
        assert per_client == pytest.approx(2 * b * b / (8 if mode == "distributed" else 1), rel=0.3)
        variances[mode] = np.var(np.sum(noise_seen, axis=0))
        assert strategy.privacy_report(1)["epsilon"] == pytest.approx(strategy.epsilon_of_round(1), rel=1e-3)
    assert variances["distributed"] / variances["local"] == pytest.approx(1 / 8, rel=0.35)


class _PaddedList(DdpsaStrategy):
    """A malicious server that lists more participants than the run has per round: smaller noise shares."""

    def train_config(self, server_round: int) -> ConfigRecord:
        rec = super().train_config(server_round)
        rec["ddpsa-participants"] = [*rec["ddpsa-participants"], *(f"ghost-{i}" for i in range(20))]
        return rec


class _Unlisted(DdpsaStrategy):
    """A malicious server that leaves the receiving client off the participant list."""

    def train_content(self, state, node, arrays):
        content = super().train_content(state, node, arrays)
        rec = content["config"]
        rec["ddpsa-participants"] = [n for n in rec["ddpsa-participants"] if n != state.names[node]]
        return content


@pytest.mark.parametrize(("strategy_cls", "client_noise", "parameter"), [
    (_PaddedList, "distributed", "ddpsa-participants"),
    (_Unlisted, "distributed", "ddpsa-participants"),
    (DdpsaStrategy, "local", "ddpsa-noise"),  # server asks distributed, the client's own config says local
])
def test_client_floor_refuses_a_view_that_shrinks_its_share(noise_seen, strategy_cls, client_noise, parameter) -> None:
    with _served(num_clients=4, num_rounds=2, **LINEAR) as (cfg, grid, _):
        for ctx in grid.contexts.values():
            ctx.run_config["ddpsa-noise"] = client_noise
        _, replies, arrays = _one_round(cfg, grid, strategy_cls)
    assert arrays is None and len(replies) == 4 and all(r.has_error() for r in replies)
    for r in replies:
        assert "privacy floor" in r.error.reason and parameter in r.error.reason
    assert noise_seen == []  # refused before any noise was drawn or share pushed


def test_local_round_accepted_by_a_distributed_client(noise_seen) -> None:
    """A local round gives each client its full Laplace: never below a distributed client's floor."""
    with _served(num_clients=4, num_rounds=2, ddpsa_noise="local", **LINEAR) as (cfg, grid, _):
        for ctx in grid.contexts.values():
            ctx.run_config["ddpsa-noise"] = "distributed"
        strategy, _, arrays = _one_round(cfg, grid)
    assert arrays is not None
    b = laplace_scale(l1_sensitivity(cfg.clip, adjacency=cfg.adjacency), strategy.epsilon_of_round(1))
    assert stats.kstest(noise_seen[0], stats.laplace(scale=b).cdf).pvalue > 1e-3
    assert from_record(arrays)


def test_dropped_participants_abort_a_distributed_round_and_not_a_local_one(run_inprocess, tmp_path,
                                                                            unplanned_dropouts) -> None:
    """Replies withheld after the shares were pushed: a distributed round is aborted unreleased.

    Each share's signed terms allow only a sum over every participant its client was shown but ``floor(d n)``
    (the ledger charged the whole central Laplace); the round is charged its planned release, which the clients
    that pushed recorded.  Shares sized for the dropouts (``ddpsa-dropout-frac``) release every round.  A local
    round (every upload carries its own Laplace) is released over the shares that came.  Planned with
    ``fault-drop-rate`` above ``ddpsa-dropout-frac``, such a run is refused before round 1.
    """
    common = dict(method="ddpsa", num_clients=10, num_rounds=4, ddpsa_collude_frac=0.0, ddpsa_composition="basic",
                  **LINEAR)
    full, _ = run_inprocess(**common)
    assert full["failed_rounds"] == [] and full["epsilon"] == pytest.approx(10.0)
    with pytest.raises(ConfigError, match=r"'fault-drop-rate' = 0.5 withholds 5 of the 10 .*'ddpsa-dropout-frac' = 0"):
        run_inprocess(**common, fault_drop_rate=0.5, out_dir=str(tmp_path / "refused"))
    unplanned_dropouts(0.5)
    half, _ = run_inprocess(**common, out_dir=str(tmp_path / "half"))
    assert len(half["failed_rounds"]) == 4
    assert all("summed only with at least 10 of the participants" in f for f in half["failed_rounds"])
    assert half["epsilon"] == pytest.approx(10.0)  # nothing released, each round charged what the clients recorded
    # Shares sized for half the participants dropping: every round releases at its nominal eps_t, and every
    # client's ledger holds what the server charged.
    sized, rows = run_inprocess(**common, fault_drop_rate=0.5, ddpsa_dropout_frac=0.5, out_dir=str(tmp_path / "sized"))
    assert sized["failed_rounds"] == [] and len(rows) == 4 and sized["epsilon"] == pytest.approx(10.0)
    assert all(0 < len(r["client_epsilon"]) <= 10 for r in rows)
    assert max(e for r in rows for e in r["client_epsilon"].values()) <= sized["epsilon"] * (1 + 1e-9)
    local, rows = run_inprocess(**{**common, "ddpsa_noise": "local"}, fault_drop_rate=0.5,
                                out_dir=str(tmp_path / "local"))
    assert local["failed_rounds"] == [] and len(rows) == 4 and local["epsilon"] == pytest.approx(10.0)


def test_plan_round_trip_carries_noise_and_participants() -> None:
    plan = DdpsaRound(0.5, "distributed", ("a", "b"), ("127.0.0.1:1", "127.0.0.1:2"), 2, "r", 24, 10)
    assert DdpsaRound.from_config(plan.to_config()) == plan


def test_client_floor_refuses_a_lower_sharing_threshold(noise_seen) -> None:
    """A client whose own config asks 3-of-3 refuses a 2-of-3 round: two servers could then rebuild its upload."""
    with _served(num_clients=4, num_rounds=2, **LINEAR) as (cfg, grid, _):
        for ctx in grid.contexts.values():
            ctx.run_config["ddpsa-threshold"] = 3
        _, replies, arrays = _one_round(cfg, grid)
    assert arrays is None and all(r.has_error() and "ddpsa-threshold" in r.error.reason for r in replies)
    assert noise_seen == []


def test_reply_naming_another_client_is_left_out_as_a_dropout(tmp_path) -> None:
    """Node 0's receipt names node 1: it is left out of the sum, so 3 of 4 shares remain and the round is aborted.

    A distributed share is summed only with all the participants its client was shown; the round is charged its
    planned release, which the clients that pushed recorded in their ledgers.
    """
    from flwr.app import ConfigRecord as Rec

    from server.launch import run_inprocess
    from tests.faulty_client import faulty_grid

    def impostor(content):
        content["ddpsa-receipt"] = Rec({"ddpsa-client": "partition-1"})
        return content

    summary = run_inprocess({"method": "ddpsa", "num-clients": 4, "num-rounds": 2, "ddpsa-collude-frac": 0.0,
                             "out-dir": str(tmp_path / "run"), **LINEAR},
                            grid_factory=faulty_grid({0: impostor}), progress=lambda _s: None)
    assert len(summary["failed_rounds"]) == 2 and summary["epsilon"] == pytest.approx(LINEAR["epsilon"])
    assert all("only 3 of 4 participants" in f and "aborted unreleased" in f for f in summary["failed_rounds"])
