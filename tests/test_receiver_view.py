"""The published model's epsilon holds against any receiver, a participant that knows its own noise included.

A participant of the round receives the model and knows the noise it put in itself: from its position only the
others' noise protects a record of another client (:mod:`protocols.privacy.receiver`).  Each test takes the real
round's noise (the plan the server and every client compute, or the figures of an in-process run), subtracts one
participant's own part and checks that the model's account (the server's and the node's own) covers what is left.
"""

from __future__ import annotations

import math

import pytest

from protocols.config import RunConfig
from protocols.privacy import GaussianEvent, RdpAccountant, gaussian_epsilon, receiver_std, record_sensitivity
from protocols.task.data import partitions_for
from server.defaults import app_defaults


def _cfg(method: str, clients: int, rounds: int = 20, **extra) -> RunConfig:
    return RunConfig.from_mapping({**app_defaults(), "method": method, "num-clients": clients, "num-rounds": rounds,
                                   "epsilon": 1.0, **extra})


def _epsilon(multipliers: list[float], delta: float) -> float:
    acc = RdpAccountant()
    for z in multipliers:
        acc.compose(GaussianEvent(z))
    return acc.epsilon(delta)


def test_receiver_std_leaves_out_the_largest_known_part() -> None:
    assert receiver_std([4.0, 1.0, 1.0]) == pytest.approx(math.sqrt(2.0))
    assert receiver_std([1.0, 1.0]) == pytest.approx(1.0)
    assert receiver_std([9.0]) == pytest.approx(3.0)  # a lone participant: its other receivers know nothing


# ------------------------------------------------------------------------------------------------------ nadp
@pytest.mark.parametrize("k", [2, 3, 10])
def test_nadp_model_account_covers_a_participant_that_knows_its_residual(k: int) -> None:
    """The round plan (server and clients alike): each participant i subtracts its residual from the model's.

    The residual left protects a record of client j != i; over the run's rounds it must stay within the target,
    and the node's own charge (:func:`client.methods.nadp.releases`) must not read less than it.
    """
    from client.methods.nadp import releases
    from protocols.floor import nadp_floor, nadp_round_noise

    cfg = _cfg("nadp", k)
    sizes = {c: 100 + c for c in range(1, k + 1)}
    noise = nadp_round_noise(cfg, sizes, None)
    alloc = noise.allocation
    worst = math.inf
    for j in alloc.client_ids:
        _, down = releases(nadp_floor(cfg, sizes, j, None), j)
        for i in alloc.client_ids:
            if i == j:
                continue
            left = math.sqrt(math.fsum(alloc.residual_std[c] ** 2 for c in alloc.client_ids if c != i))
            z = left / (alloc.weights[j] * noise.sensitivities[j])
            assert down.noise_multiplier <= z * (1 + 1e-9), (i, j)
            worst = min(worst, z)
    assert gaussian_epsilon(worst, 1.0, cfg.num_rounds, cfg.delta) <= cfg.epsilon * (1 + 1e-6)


def _receiver_epsilon(rows: list[dict], sizes: list[int], cfg: RunConfig, parts) -> float:
    """Epsilon over the run's rounds of the model against the worst receiving participant, from the real noise.

    ``parts(row)``: each participant's variance in the published model, in ``sizes``' order.
    """
    total = math.fsum(sizes)
    sens = [n * record_sensitivity(cfg, n) / total for n in sizes]  # a record of j moves the mean by p_j Delta_j
    zs = []
    for row in rows:
        var = parts(row)
        zs.append(min(math.sqrt(math.fsum(var) - var[i]) / sens[j]
                      for i in range(len(sizes)) for j in range(len(sizes)) if i != j))
    return _epsilon(zs, cfg.delta)


FAST = {"local_epochs": 1, "batch_size": 1000, "lr": 4.0, "clip": 1.0, "hidden": ""}


def test_two_client_nadp_run_keeps_the_model_within_target_against_the_other_participant(run_inprocess) -> None:
    """``flwr run .``'s default of 2 clients: the pair noise cancels, the peer's residual alone is left."""
    summary, rows = run_inprocess(method="nadp", num_clients=2, num_rounds=3, epsilon=1.0, **FAST)
    cfg = _cfg("nadp", 2, 3, **{k.replace("_", "-"): v for k, v in FAST.items()})
    sizes = [len(p) for p in partitions_for(cfg)]
    p = [n / sum(sizes) for n in sizes]
    # every participant survived: residual i has variance p_i sigma_down^2 of the aggregate's sigma_down^2
    real = _receiver_epsilon(rows, sizes, cfg, lambda r: [q * r["aggregate_noise_std"] ** 2 for q in p])
    assert real <= rows[-1]["epsilon_downlink"] * (1 + 1e-6)
    assert real <= cfg.epsilon * (1 + 1e-6)
    assert rows[-1]["epsilon_downlink"] <= cfg.epsilon * (1 + 1e-6)


# ------------------------------------------------------------------------------------------------------- ldp
def test_two_client_ldp_run_charges_the_model_against_the_other_participant(run_inprocess) -> None:
    """Independent noise: the other participant's upload noise alone is left, the upload's own guarantee."""
    from protocols.floor import ldp_noise_std

    summary, rows = run_inprocess(method="ldp", num_clients=2, num_rounds=3, epsilon=1.0, **FAST)
    cfg = _cfg("ldp", 2, 3, **{k.replace("_", "-"): v for k, v in FAST.items()})
    sizes = [len(p) for p in partitions_for(cfg)]
    total = sum(sizes)

    def parts(row: dict) -> list[float]:
        scale = row["upload_noise_std"] / min(ldp_noise_std(cfg, n) for n in sizes)  # the budget guard's raise
        return [(n / total * ldp_noise_std(cfg, n) * scale) ** 2 for n in sizes]

    real = _receiver_epsilon(rows, sizes, cfg, parts)
    assert real <= rows[-1]["epsilon_downlink"] * (1 + 1e-6)
    assert rows[-1]["epsilon_downlink"] <= cfg.epsilon * (1 + 1e-6)


# ------------------------------------------------------------------------------------------------------ niss
def test_three_client_niss_run_charges_the_model_against_a_participant_knowing_its_shares(run_inprocess) -> None:
    """A participant subtracts the residuals of its own shares and of those it received from the model's noise.

    Every share's residual ``(1 - s) n`` is known to its receiver (it holds n and s) and hides nothing from its
    sender in the coordinates where ``|n|`` is small.  Complete graph of 3: ``sigma_k = z p_k Delta_k`` split
    evenly over the 2 neighbours; the model keeps ``theorem2_variance = tau^2 sum_k sigma_k^2`` (the run's own figure).
    """
    summary, rows = run_inprocess(method="niss", num_clients=3, num_rounds=2, epsilon=1.0, **FAST)
    cfg = _cfg("niss", 3, 2, **{k.replace("_", "-"): v for k, v in FAST.items()})
    sizes = [len(p) for p in partitions_for(cfg)]
    total = sum(sizes)
    sens2 = [(n * record_sensitivity(cfg, n) / total) ** 2 for n in sizes]

    def parts(row: dict) -> list[float]:
        unit = row["theorem2_variance"] / math.fsum(sens2)  # tau^2 z^2 (scale included): per unit of sens^2
        return [unit * (sens2[i] + math.fsum(sens2[k] / 2 for k in range(3) if k != i)) for i in range(3)]

    zs = []
    for row in rows:
        known = parts(row)
        zs.append(min(math.sqrt(row["theorem2_variance"] - known[i]) / math.sqrt(sens2[j])
                      for i in range(3) for j in range(3) if i != j))
    real = _epsilon(zs, cfg.delta)
    assert real <= rows[-1]["epsilon_downlink"] * (1 + 1e-6)


# ----------------------------------------------------------------------------------------------------- ddpsa
@pytest.mark.parametrize("n", [2, 3, 10, 100])
@pytest.mark.parametrize("noise", ["distributed", "gaussian"])
def test_ddpsa_shares_left_to_a_receiving_participant_make_the_central_noise(n: int, noise: str, tmp_path) -> None:
    """The shares a receiving participant does not know still make the central noise the round is charged for.

    Each client adds the share its floor computes (``1/n'`` of one central noise); a receiving participant knows
    its own share or the ``floor(f n)`` colluders' (it among them).  The server's round charge (all shares summed)
    must not read less than what the rest leave.
    """
    from protocols.ddpsa import gamma_difference_epsilon, present_multiplier
    from protocols.ddpsa_floor import ddpsa_noise_share
    from strategies.ddpsa import DdpsaStrategy
    from tests.ddpsa_setup import ddpsa_credentials

    cfg = _cfg("ddpsa", n, 5, **{"ddpsa-noise": noise, "ddpsa-servers": "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
                                 **ddpsa_credentials(tmp_path)})
    share = ddpsa_noise_share(cfg, noise, n)  # every client's n' (the client floor)
    left = n - max(1, math.floor(cfg.ddpsa_collude_frac * n))  # its own share, or the colluders' (it among them)
    assert left >= share
    strategy = DdpsaStrategy(cfg)
    if noise == "gaussian":
        assert present_multiplier(strategy.z, share, left) == pytest.approx(strategy.z)
        assert strategy.round_event(1, n, n, 100).noise_multiplier <= strategy.z * (1 + 1e-12)
    else:
        eps_t = strategy.epsilon_of_round(1)
        real = gamma_difference_epsilon(left / share, eps_t, 100)
        assert real <= eps_t * (1 + 1e-12)
        assert strategy.round_charge(1, n, n, 100) >= real * (1 - 1e-12)
