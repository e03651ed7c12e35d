"""DDP-SA end to end: exact reconstruction, training with m = 3 server processes, failures, budget.

Also: clients refuse a strategy's own intermediate servers.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

import client.methods.ddpsa as ddpsa_client
import server.intermediate.launcher as launcher
from client.app import app as client_app
from client.records import to_record
from protocols.arrays import flatten
from protocols.config import ConfigError, RunConfig
from protocols.ddpsa import composition_accountant, laplace_noise
from protocols.privacy import exponential_allocation, per_round_epsilons
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.arrays import from_record
from server.defaults import app_defaults
from server.intermediate import IntermediateServerCluster, start_intermediate_servers
from server.intermediate.launcher import roster_of
from server.local_grid import LocalGrid
from server.runner import run_federation
from strategies.base import RoundState
from strategies.ddpsa import DdpsaStrategy
from tests.ddpsa_setup import ddpsa_credentials
from tests.processes import pid_gone

LINEAR = {"hidden": "", "lr": 10.0, "epsilon": 10.0}  # softmax regression: fast FedSGD on digits
#: Addresses for strategies that never reach their servers (configuration and budget tests).
UNREACHED = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"


@pytest.fixture(scope="module", autouse=True)
def credentials(tmp_path_factory) -> dict[str, str]:
    """A CA file and a parameter-server key for strategies whose servers are never reached."""
    CREDENTIALS.update(ddpsa_credentials(tmp_path_factory.mktemp("ddpsa")))
    return CREDENTIALS


CREDENTIALS: dict[str, str] = {}


def _raw(**overrides) -> dict:
    return {**app_defaults(), "method": "ddpsa", **{k.replace("_", "-"): v for k, v in overrides.items()}}


def _setup(**overrides) -> tuple[RunConfig, LocalGrid, DdpsaStrategy]:
    raw = _raw(**overrides)
    if raw.get("ddpsa-servers"):
        raw = {**raw, **CREDENTIALS}
    cfg = RunConfig.from_mapping(raw)
    return cfg, LocalGrid(client_app, cfg.num_clients, raw), DdpsaStrategy(cfg)


@contextlib.contextmanager
def _served(servers: int = 3, **overrides) -> Iterator[tuple[RunConfig, LocalGrid, IntermediateServerCluster]]:
    """A grid whose nodes trust m = ``servers`` fresh server processes (in their own run config), and the run config."""
    raw = _raw(**overrides)
    grid = LocalGrid(client_app, RunConfig.from_mapping(raw).num_clients, raw)
    roster = roster_of(c.node_config for c in grid.contexts.values())
    assert roster is not None  # the in-process grid gives its nodes real identities
    with start_intermediate_servers(servers, roster) as cluster:
        for ctx in grid.contexts.values():
            ctx.run_config.update({k: v for k, v in cluster.run_config().items() if k != "ddpsa-server-key"})
        yield RunConfig.from_mapping({**raw, **cluster.run_config()}), grid, cluster
    assert all(pid_gone(p) for p in cluster.pids)


def _roster_names(grid: LocalGrid) -> list[str]:
    """The roster names of the grid's nodes (what query.ddpsa_identity answers)."""
    from protocols.wire.ddpsa import RosterName

    replies = grid.send_and_receive([Message(RecordDict(), n, "query.ddpsa_identity") for n in grid.node_ids])
    return sorted(RosterName.from_content(r.content).name for r in replies)


def _initial(cfg: RunConfig):
    ds = dataset_for(cfg)
    return to_record(get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)),
                     np.float64)


@pytest.fixture
def recorded(monkeypatch) -> dict[int, np.ndarray]:
    """Record every client's noisy sum s_i (in call order) as it is shared."""
    seen: dict[int, np.ndarray] = {}
    original = ddpsa_client.noisy_gradient_sum
    counter = iter(range(10**6))

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen[next(counter)] = out[0].copy()
        return out

    monkeypatch.setattr(ddpsa_client, "noisy_gradient_sum", spy)
    # Deterministic Laplace noise per call (production draws os.urandom).
    seeds = iter(range(10**6))
    monkeypatch.setattr(ddpsa_client, "_noise_seed", lambda: next(seeds).to_bytes(32, "big"))
    return seen


# ------------------------------------------------------------------ client math
def test_clipped_sum_matches_per_sample_loop_and_noise_is_laplace_of_seed() -> None:
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10, (16,), 3)
    rng = np.random.default_rng(1)
    x = rng.random((300, 1, 8, 8)).astype(np.float32)  # > CHUNK: exercises chunking
    y = rng.integers(0, 10, 300)
    clip = 0.5
    got, loss, frac = ddpsa_client.clipped_gradient_sum(model, x, y, clip)
    expected = np.zeros_like(got)
    for i in range(len(y)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.as_tensor(x[i:i + 1])), torch.as_tensor(y[i:i + 1])).backward()
        g = np.concatenate([p.grad.detach().double().numpy().ravel() for p in model.parameters()])
        expected += g / max(1.0, np.abs(g).sum() / clip)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(got).sum() <= len(y) * clip * (1 + 1e-9)  # each sample contributes L1 <= Delta
    assert 0 < frac <= 1 and loss > 0
    seed = bytes(32)
    noisy, _, _ = ddpsa_client.noisy_gradient_sum(model, x, y, clip, 2.0, adjacency="replace-one", seed=seed)
    # Lap(2 Delta / eps): replace-one sensitivity of the clipped sum (N_i is published).
    np.testing.assert_allclose(noisy - got, laplace_noise(got.size, 2 * clip / 2.0, seed=seed), rtol=0, atol=1e-9)


# ------------------------------------------------------------------ reconstruction
@pytest.mark.parametrize("frac_bits", [10, 24])
def test_reconstruction_equals_plain_sum_of_noisy_updates(recorded, frac_bits: int) -> None:
    """The parameter server recovers sum_i s_i up to fixed-point round-off only, and steps on it."""
    with _served(num_clients=4, num_rounds=2, ddpsa_frac_bits=frac_bits, **LINEAR) as (cfg, grid, cluster):
        strategy = DdpsaStrategy(cfg)
        try:
            arrays = _initial(cfg)
            msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"round": 1}), grid))
            replies = list(grid.send_and_receive(msgs))
            assert not any(r.has_error() for r in replies)
            new_arrays, metrics = strategy.aggregate_train(1, replies)
        finally:
            strategy.close()
        assert all(h.is_running() for h in cluster.handles)  # the strategy neither starts nor stops servers
    assert len(recorded) == 4
    plain = np.sum(list(recorded.values()), axis=0)  # float64 sum of the clients' noisy sums
    err = np.abs(strategy.last_decoded_sum - plain)
    bound = 4 * 2.0 ** -(frac_bits + 1) + 1e-12 * np.abs(plain).max()
    assert err.max() <= bound
    if frac_bits == 10:
        assert err.max() > 0  # the only error is round-off, and it is visible at 10 bits
    # The sum is really noisy: the 4 distributed shares make one Laplace(2 Delta/eps_t) per coordinate (std sqrt(2) b).
    eps_t = strategy.epsilon_of_round(1)
    assert np.std(plain) > 0.5 * np.sqrt(2) * 2 * cfg.clip / eps_t
    n_total = float(metrics["num-examples"])
    expected = flatten(from_record(arrays)) - cfg.lr * plain / n_total
    np.testing.assert_allclose(flatten(from_record(new_arrays)), expected, rtol=0, atol=cfg.lr * bound / n_total + 1e-12)


# ------------------------------------------------------------------ end to end
def test_trains_with_three_server_processes_and_cleans_up(run_inprocess, monkeypatch) -> None:
    started: list[IntermediateServerCluster] = []
    original = launcher.start_intermediate_servers

    def spy(m: int, roster, **kw) -> IntermediateServerCluster:
        assert isinstance(roster, Path)  # the in-process nodes' real roster, not the seed-derived one
        c = original(m, roster, **kw)
        started.append(c)
        return c

    monkeypatch.setattr(launcher, "start_intermediate_servers", spy)
    # epsilon 30: Laplace at 2 clip / eps_t (replace-one) over 8 rounds leaves digits at 0.25-0.45 at epsilon 10;
    # this test is about the three processes, so give the model room to clear chance every time
    summary, rows = run_inprocess(method="ddpsa", num_rounds=8, ddpsa_num_servers=3, ddpsa_composition="basic",
                                  **{**LINEAR, "epsilon": 30.0})
    assert len(started) == 1 and len(started[0].pids) == 3 and len(set(started[0].pids)) == 3
    assert all(pid_gone(p) for p in started[0].pids)  # stopped when run_inprocess leaves local_intermediate_servers
    assert summary["failed_rounds"] == []
    assert summary["final_accuracy"] > 0.3  # chance is 0.1
    eps = [r["epsilon"] for r in rows]
    np.testing.assert_allclose(eps, 30.0 * np.arange(1, 9) / 8)  # basic composition, uniform allocation
    assert rows[-1]["epsilon_round"] == pytest.approx(30.0 / 8)
    assert summary["method_parameters"]["num_intermediate_servers"] == 3


class _KillingStrategy(DdpsaStrategy):
    """Kills intermediate server #1 of ``victims`` after the clients pushed their round-2 shares."""

    victims: IntermediateServerCluster

    def aggregate(self, state):
        if state.round == 2:
            os.kill(self.victims.pids[1], signal.SIGKILL)
            self.victims.handles[1].process.wait()
        return super().aggregate(state)


def test_killed_intermediate_server_fails_additive_round_naming_it_and_charges_what_clients_recorded(tmp_path) -> None:
    """ddpsa-threshold = m: the paper's additive sharing needs every server.

    Round 2's shares were pushed (each client recorded the release) and its sum was never reconstructed: it is
    charged its planned release; round 3 fails before any client works and charges nothing.
    """
    lines: list[str] = []
    with _served(num_rounds=3, num_clients=4, out_dir=str(tmp_path), ddpsa_threshold=3, **LINEAR) as (cfg, grid, victims):
        strategy = _KillingStrategy(cfg)  # own servers: this test kills one
        strategy.victims = victims
        try:
            summary = run_federation(strategy, grid, cfg, progress=lines.append)
        finally:
            strategy.close()
        dead = victims.addresses[1]
    # Only round 1 produced a model; round 2 is charged what its pushing clients recorded, round 3 nothing.
    recorded = composition_accountant(cfg.ddpsa_composition, cfg.ddpsa_noise)
    for rnd in (1, 2):
        recorded.compose(strategy.planned_release(rnd))
    assert strategy.privacy_report(3)["epsilon"] == pytest.approx(recorded.epsilon(cfg.delta), rel=1e-9)
    assert summary["epsilon"] == pytest.approx(recorded.epsilon(cfg.delta), rel=1e-9)
    assert len(summary["failed_rounds"]) == 2
    fetch_err, health_err = summary["failed_rounds"]
    # Round 2: the shares were pushed, then the fetch of partial sum #1 failed.
    assert "round 2" in fetch_err and "reconstruction impossible" in fetch_err
    assert f"server #1 ({dead})" in fetch_err and "UNAVAILABLE" in fetch_err
    # Round 3: opening the round on the servers fails before any client works.
    assert "round 3" in health_err and f"intermediate server #1 ({dead})" in health_err
    assert any("FAILED" in line and dead in line for line in lines)


def test_run_keeps_training_when_one_of_three_servers_is_killed(tmp_path) -> None:
    """Default 2-of-3 Shamir sharing: server #1 dies after round 2's pushes; every round still trains and is charged."""
    with _served(num_rounds=4, num_clients=4, out_dir=str(tmp_path), **{**LINEAR, "epsilon": 30.0}) as (
            cfg, grid, victims):
        strategy = _KillingStrategy(cfg)
        strategy.victims = victims
        try:
            summary = run_federation(strategy, grid, cfg, progress=lambda _s: None)
        finally:
            strategy.close()
        assert not victims.handles[1].is_running() and victims.handles[0].is_running()
    assert summary["failed_rounds"] == [] and summary["rounds_completed"] == 4
    assert summary["epsilon"] == pytest.approx(30.0, rel=1e-3)  # all four rounds released and charged (PLD)
    assert summary["final_accuracy"] > 0.3  # chance is 0.1
    assert summary["method_parameters"]["sharing_threshold"] == 2


# ------------------------------------------------------------------ configuration and budget
def test_config_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="lists 2 address"):
        _setup(ddpsa_servers="127.0.0.1:1,127.0.0.1:2", ddpsa_num_servers=3)
    with pytest.raises(ConfigError, match="at least 2 clients per round"):
        _setup(num_clients=2, sample_rate=0.5, ddpsa_servers=UNREACHED)
    with pytest.raises(ConfigError, match="needs its intermediate servers"):
        _setup()  # the strategy never starts servers: with none named it refuses
    with pytest.raises(ConfigError, match="needs 'ddpsa-ca'"):
        RunConfig.from_mapping(_raw(ddpsa_servers=UNREACHED))  # servers without a CA and a server key


def _spent(strategy: DdpsaStrategy, rounds: int) -> list[float]:
    """Epsilon reported after each of ``rounds`` released rounds (composed as the train and account stages do)."""
    out = []
    for t in range(1, rounds + 1):
        strategy.charge_release(RoundState(t, []))  # nothing: the round is charged when it is reconstructed
        strategy.release_round(t)
        out.append(strategy.privacy_report(t)["epsilon"])
    return out


def test_budget_schedules_and_spent_epsilon() -> None:
    _, _, s = _setup(num_rounds=10, epsilon=5.0, ddpsa_allocation="exponential", ddpsa_decay=0.8,
                     ddpsa_composition="basic", ddpsa_servers=UNREACHED)
    eq12 = exponential_allocation(5.0, 10, 0.8)
    np.testing.assert_allclose([s.epsilon_of_round(t) for t in range(1, 11)], eq12, rtol=1e-12)
    np.testing.assert_allclose(_spent(s, 10), np.cumsum(eq12), rtol=1e-12)
    assert s.epsilon_of_round(1) > s.epsilon_of_round(10)
    _, _, adv = _setup(num_rounds=200, epsilon=5.0, ddpsa_composition="advanced", ddpsa_servers=UNREACHED)
    _, _, basic = _setup(num_rounds=200, epsilon=5.0, ddpsa_composition="basic", ddpsa_servers=UNREACHED)
    # Advanced composition certifies larger per-round budgets over many rounds, same total.
    assert adv.epsilon_of_round(1) > 1.5 * basic.epsilon_of_round(1)
    adv_spent, basic_spent = _spent(adv, 200), _spent(basic, 200)
    assert adv_spent[-1] == pytest.approx(5.0, rel=1e-9)
    assert basic_spent[-1] == pytest.approx(5.0, rel=1e-9)
    spent = [adv_spent[t - 1] for t in (1, 10, 100, 200)]
    assert spent == sorted(spent) and spent[0] == pytest.approx(adv.epsilon_of_round(1))  # basic is tighter early


# ------------------------------------------------------------------ a strategy's own servers are refused
class _ForeignServers(DdpsaStrategy):
    """A malicious parameter server that tells the clients to push to intermediate servers it controls."""

    foreign: IntermediateServerCluster

    def train_config(self, server_round: int) -> ConfigRecord:
        rec = super().train_config(server_round)
        rec["ddpsa-servers"] = list(self.foreign.addresses)
        return rec


def test_clients_refuse_a_strategys_own_intermediate_servers(recorded) -> None:
    """Every client refuses with a floor violation naming the list; neither server set receives a share."""
    from protocols.wire.intermediate import IntermediateServerClient, register_run
    from protocols.wire.intermediate.auth import load_signer

    with _served(num_clients=4, num_rounds=2, **LINEAR) as (cfg, grid, honest):
        roster = roster_of(c.node_config for c in grid.contexts.values())
        with start_intermediate_servers(3, roster) as foreign:
            strategy = _ForeignServers(cfg)
            strategy.foreign = foreign
            foreign_signer = load_signer(foreign.server_key_file)
            assert register_run(foreign.servers, strategy.run_id, 1, 650, 4, foreign_signer,
                                participants=_roster_names(grid)) == []  # ready to receive
            msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
            replies = list(grid.send_and_receive(msgs))
            assert len(replies) == 4 and all(r.has_error() for r in replies)
            for r in replies:
                assert "privacy floor" in r.error.reason and "ddpsa-servers" in r.error.reason
            assert recorded == {}  # refused before any gradient was computed
            for cluster, signer in ((foreign, foreign_signer), (honest, strategy.signer)):
                for a in cluster.addresses:
                    with IntermediateServerClient(a, cluster.servers.ca) as c:
                        assert c.status(signer).stored_bytes == 0
            strategy.close()


def test_default_regime_spends_exactly_the_target_with_zero_out_laplace(run_inprocess) -> None:
    """Only the method set: the regime's rounds share epsilon (basic composition), noise scale clip / eps_t."""
    summary, rows = run_inprocess(method="ddpsa")
    cfg = RunConfig.from_mapping(_raw())
    assert cfg.ddpsa_composition == "basic"
    assert summary["failed_rounds"] == [] and len(rows) == cfg.num_rounds
    eps_t = per_round_epsilons(cfg.epsilon, cfg.delta, cfg.num_rounds, composition="basic").epsilons[0]
    assert eps_t == pytest.approx(cfg.epsilon / cfg.num_rounds)
    assert [r["epsilon_round"] for r in rows] == pytest.approx([eps_t] * cfg.num_rounds, rel=1e-12)
    assert summary["epsilon"] == pytest.approx(cfg.epsilon, rel=1e-3) and summary["epsilon"] <= cfg.epsilon
    assert summary["method_parameters"]["laplace_scale_first_round"] == pytest.approx(cfg.clip / eps_t)


def test_a_run_whose_rounds_mostly_failed_exits_non_zero(tmp_path, monkeypatch, capsys) -> None:
    """Cancelfl run (in-process): two of three servers die after round 1, rounds 2-5 fail: exit status 1."""
    from server.launch import _inprocess_exit

    started: list[IntermediateServerCluster] = []
    original_start = launcher.start_intermediate_servers
    original_plan = DdpsaStrategy.plan

    def start(m: int, roster, **kw) -> IntermediateServerCluster:
        started.append(original_start(m, roster, **kw))
        return started[-1]

    def plan(self, grid, st):
        if st.round == 2:
            for j in (1, 2):
                os.kill(started[0].pids[j], signal.SIGKILL)
                started[0].handles[j].process.wait()
        return original_plan(self, grid, st)

    monkeypatch.setattr(launcher, "start_intermediate_servers", start)
    monkeypatch.setattr(DdpsaStrategy, "plan", plan)
    out = tmp_path / "run"
    code = _inprocess_exit({"method": "ddpsa", "num-clients": 4, "num-rounds": 5, "out-dir": str(out),
                            **{k: v for k, v in LINEAR.items()}})
    assert code == 1
    assert "most rounds failed (4 of 5" in capsys.readouterr().err
    import json

    from strategies.run.checkpoint import run_outcome

    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["failed_rounds"]) == 4 and summary["rounds_completed"] == 5
    summary["failed_rounds"] = summary["failed_rounds"][:2]  # 2 of 5 failed: a run that mostly trained exits 0
    (out / "summary.json").write_text(json.dumps(summary))
    assert run_outcome(out)[0] == 0
