"""Extreme and ill-typed run-config values: refused at start naming the key, or run at the documented floor.

Every calibration gives at least :data:`protocols.privacy.MIN_NOISE_MULTIPLIER`: a target epsilon beyond what that
noise spends runs and reports the smaller spend (ladp as ldp); the budget guard measures such targets too.
"""

from __future__ import annotations

import pytest

from protocols.config import ConfigError
from server.launch import main, preflight
from tests.test_launch_refusals import _no_process, refused_before_any_message


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err + captured.out


# ------------------------------------------------------------------ the noise floor at a huge epsilon
@pytest.mark.parametrize(("epsilon", "rounds"), [(1e10, 1), (1e300, 20), (1e6, 1)])
def test_ladp_multiplier_stops_at_the_floor(epsilon, rounds):
    from protocols import ladp

    floor = 1e-3  # protocols.privacy.MIN_NOISE_MULTIPLIER, the lower end of every other calibration's bisection
    z = ladp.round_multiplier(epsilon, 1e-5, rounds)
    assert z >= floor * (1 - 1e-12) and z == pytest.approx(floor, rel=1e-9)


def test_ladp_at_a_huge_epsilon_runs_at_the_floor(tmp_path, capsys):
    """Without the floor every client refuses (noise std ~1e-7 below the float32 grid): the run trains, spending ~5.0e5."""
    code, out = _cli(capsys, "run", "--run-config", 'method="ladp" epsilon=1e10 dataset="breast-cancer" num-rounds=1 '
                     f'num-clients=3 out-dir="{tmp_path / "out"}"')
    assert code == 0 and "FAILED" not in out and "eps 504263.89/1e+10" in out, out


@pytest.mark.parametrize("kind", ["gdp", "rdp"])
def test_precision_budget_of_a_huge_target_is_measured(kind):
    from protocols.privacy.budget import precision_budget

    assert precision_budget(1e300, 1e-5, kind) > 1e18  # far above what releases at the floor charge


def test_ladp_at_1e300_plans_at_start():
    preflight({"method": "ladp", "dataset": "breast-cancer", "num-clients": 4, "num-rounds": 1, "epsilon": 1e300},
              warn=print)


@pytest.mark.parametrize("epsilon", [1e300, 1e200, 1e-300])
def test_nadp_plans_every_epsilon_the_rdp_calibration_meets(epsilon):
    """Every epsilon plans: at the target multiplier's scale (1e-3 at the floor, as ldp; about 7e4 at 1e-300).

    Eq. 3's own scale underflows the pair variances at 1e200 ("Matrix is not positive definite") and overflows at
    1e-300.
    """
    from protocols.nadp import round_plan
    from protocols.nadp_privacy import rdp_multiplier

    preflight({"method": "nadp", "dataset": "breast-cancer", "num-clients": 4, "num-rounds": 1, "epsilon": epsilon},
              warn=print)
    sig, alloc = round_plan({1: 100, 2: 120, 3: 90}, {1: 0.02, 2: 0.02, 3: 0.02}, epsilon, 1e-5, 2)
    z = rdp_multiplier(epsilon, 1e-5, 2)
    assert sig.sigma_up > 0 and alloc.receiver_std / (0.02 * 120 / 310) >= z * (1 - 1e-9)  # the aggregate view


# ------------------------------------------------------------------ types and integer counts
@pytest.mark.parametrize(("run_config", "needle"), [
    ("method=true", "run-config 'method' = true must be a string, got bool (write it in quotes: method=\"...\")"),
    ("hidden=[64,32]", "run-config 'hidden' = [64, 32] must be a string, got list"),
    ("nadp-variant=false", "run-config 'nadp-variant' = false must be a string, got bool"),
    ("num-rounds=1e20", "run-config 'num-rounds' = 100000000000000000000 is above the most a run takes, 1,000,000: "
                        "lower 'num-rounds'"),
    ("num-rounds=1000001", "'num-rounds' = 1000001 is above the most a run takes"),
    ("local-epochs=1e9", "run-config 'local-epochs' = 1000000000 is above the most a run takes, 10,000"),
    ("num-clients=1e20", "run-config 'num-clients' = 100000000000000000000 must be an integer in [-2^63, 2^63 - 1]"),
    ("n-out=1e19", "run-config 'n-out' = 10000000000000000000 must be an integer in [-2^63, 2^63 - 1]"),
    ("num-rounds=2.5", "run-config 'num-rounds' = 2.5 must be an integer"),
])
def test_ill_typed_and_absurd_values_are_refused_at_start(capsys, monkeypatch, run_config, needle):
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", run_config)
    assert code == 2 and needle in err and "Traceback" not in err, err


def test_a_number_for_a_string_key_is_its_text():
    from protocols.config import RunConfig

    assert RunConfig.from_mapping({"hidden": 64}).hidden_sizes == (64,)
    assert RunConfig.from_mapping({"num-rounds": 1e6}).num_rounds == 1_000_000


# ------------------------------------------------------------------ delta against the records it protects
@pytest.mark.parametrize(("raw", "needle"), [
    ({"method": "nadp", "delta": 0.999}, "run-config 'delta' = 0.999 is at least 1/n = 0.00877 (n = 114, the records "
                                         "of the largest client)"),
    ({"method": "ldp", "delta": 0.3, "privacy-unit": "client"}, "'delta' = 0.3 is at least 1/n = 0.25 (n = 4, the "
                                                                "clients)"),
])
def test_a_delta_not_far_below_one_over_n_is_named_at_start(raw, needle):
    """At delta 0.999 nadp reports epsilon 0: the start names the key and the usual rule."""
    notes: list[str] = []
    preflight({"dataset": "breast-cancer", "num-clients": 4, "num-rounds": 1, **raw}, warn=notes.append)
    assert any(needle in n and "delta << 1/n" in n for n in notes), notes


@pytest.mark.parametrize("raw", [{"method": "nadp"}, {"method": "fedavg", "delta": 0.5},
                                 {"method": "ldp", "delta": 0.05, "privacy-unit": "client"}])
def test_a_usual_delta_is_not_named(raw):
    notes: list[str] = []
    preflight({"dataset": "breast-cancer", "num-clients": 4, "num-rounds": 1, **raw}, warn=notes.append)
    assert not [n for n in notes if "delta << 1/n" in n], notes


@pytest.mark.parametrize("delta", [1, 1.5, 0, -1e-5])
def test_delta_outside_the_open_unit_interval_is_refused(capsys, monkeypatch, delta):
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", f'method="nadp" delta={delta}')
    assert code == 2 and f"run-config 'delta' = {float(delta)} must be in (0, 1)" in err, err


# ------------------------------------------------------------------ round-timeout in-process
@pytest.mark.parametrize(("argv", "warned"), [
    (("run",), True), (("run", "--engine", "simulation"), False),
])
def test_round_timeout_the_in_process_engine_does_not_apply_is_named(tmp_path, capsys, monkeypatch, argv, warned):
    monkeypatch.setattr("server.launch._inprocess_exit", lambda *_a, **_k: 0)
    monkeypatch.setattr("server.deploy.run_simulation", lambda *_a, **_k: 0)
    code, err = _cli(capsys, *argv, "--run-config", f'round-timeout=5 dataset="breast-cancer" out-dir="{tmp_path / "o"}"')
    assert code == 0 and ("'round-timeout' = 5 is not applied by the in-process engine" in err) is warned, err


def test_the_default_round_timeout_is_not_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("server.launch._inprocess_exit", lambda *_a, **_k: 0)
    code, err = _cli(capsys, "run", "--run-config", f'dataset="breast-cancer" out-dir="{tmp_path / "o"}"')
    assert code == 0 and "round-timeout" not in err, err


# ------------------------------------------------------------------ the testing aid against the self-mask threshold
@pytest.mark.parametrize("method", ["nadp", "niss", "mpddp"])
def test_a_fault_drop_rate_no_round_can_unmask_is_refused_at_start(capsys, monkeypatch, method):
    """6 clients, 2 withheld: each upload keeps 3 of 5 neighbours, below the threshold 4; every round failed."""
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", f'method="{method}" num-clients=6 fault-drop-rate=0.3')
    assert code == 2 and "'fault-drop-rate' = 0.3 withholds 2 of the 6 clients of every round" in err, err
    assert "keeps 3 of its 5 neighbours, fewer than its self-mask threshold 4" in err and "'self-mask' = false" in err


@pytest.mark.parametrize("run_config", [
    {"method": "niss", "num-clients": 8, "fault-drop-rate": 0.3},  # keeps 5 of 7, threshold 5
    {"method": "mpddp", "num-clients": 6, "fault-drop-rate": 0.15},
    {"method": "nadp", "num-clients": 6, "fault-drop-rate": 0.3, "self-mask": False},
])
def test_a_fault_drop_rate_a_round_survives_stays_allowed(run_config):
    preflight({"dataset": "breast-cancer", "num-rounds": 1, **run_config}, warn=print)


def test_a_budget_stop_names_no_learning_rate(tmp_path):
    """The stop for the privacy budget says why and what is kept; the divergence stop's lr hint does not apply."""
    from server.launch import run_inprocess

    lines: list[str] = []
    run_inprocess({"method": "niss", "dataset": "digits", "num-clients": 8, "num-rounds": 2, "fault-drop-rate": 0.3,
                   "out-dir": str(tmp_path / "o")}, progress=lines.append)
    stop = [line for line in lines if "STOPPED: privacy budget" in line]
    assert stop and "'lr'" not in stop[0] and "divergence-factor" not in stop[0], lines


# ------------------------------------------------------------------ processes the launcher starts
def test_more_intermediate_servers_than_memory_holds_are_refused_at_start(tmp_path, capsys, monkeypatch):
    """Every locally started DDP-SA intermediate server is a process (about 67 MB idle): a typo must not start 1000."""
    monkeypatch.setattr("server.deploy.available_memory_mb", lambda: 5.5 * 70)  # server.deploy.INTERMEDIATE_IDLE_MB
    monkeypatch.setattr("server.launch._inprocess_exit", lambda *_a, **_k: 0)
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", 'method="ddpsa" ddpsa-num-servers=6')
    assert code == 2 and "run-config 'ddpsa-num-servers' = 6" in err and "at most 5 fit here" in err, err
    code, err = _cli(capsys, "run", "--run-config", f'method="ddpsa" ddpsa-num-servers=5 out-dir="{tmp_path / "o"}"')
    assert code == 0, err


# ------------------------------------------------------------------ ladp's float32 upload against the client's records
def test_ladp_noise_its_largest_client_cannot_upload_is_refused_at_start(capsys, monkeypatch):
    """1437 records: the floor noise std 2.8e-6 is below float32's grid at 4 over 16; every client refused each round."""
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", 'method="ladp" num-clients=1 num-rounds=1 epsilon=1e10')
    assert code == 2 and "cannot keep its noise in the float32 upload of a client with 1437 records" in err, err
    assert "lower 'epsilon' to at most 68000 or raise 'num-clients'" in err


def test_ladp_at_the_largest_epsilon_named_trains(tmp_path, capsys):
    code, out = _cli(capsys, "run", "--run-config", f'method="ladp" num-clients=1 num-rounds=1 epsilon=68000 '
                     f'out-dir="{tmp_path / "o"}"')
    assert code == 0 and "FAILED" not in out, out


def test_the_serverapp_applies_the_size_check_before_any_message(tmp_path):
    """Submitted without the launcher (flwr run): the ServerApp refuses before it asks any node anything."""
    (tmp_path / "out").mkdir()
    raw = {"method": "ladp", "num-clients": 1, "epsilon": 1e10, "out-dir": str(tmp_path / "out")}
    refused_before_any_message(raw, 1, "cannot keep its noise in the float32 upload")


@pytest.mark.parametrize("factor", [0.5, 0.999, -1, "inf"])
def test_a_divergence_factor_below_one_is_refused(capsys, monkeypatch, factor):
    """0.5 stopped digits' fedavg in round 1 with its loss falling (2.117 > 0.5 x 2.302)."""
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", f"divergence-factor={factor}")
    assert code == 2 and "'divergence-factor'" in err and "must be 0 (off) or a finite number >= 1" in err, err


@pytest.mark.parametrize("factor", [0, 1, 100])
def test_a_divergence_factor_of_zero_or_one_and_up_stays_allowed(factor):
    from protocols.config import RunConfig

    assert RunConfig.from_mapping({"divergence-factor": factor}).divergence_factor == factor


# ------------------------------------------------------------------ float64 floors every client applies to public values
@pytest.mark.parametrize(("run_config", "needle"), [
    ('method="ldp" privacy-unit="client" clip=1e-300', "run-config 'clip' = 1e-300 is below 1.19e-153"),
    ('method="nadp" clip=1e-200', "run-config 'clip' = 1e-200 is below 1.19e-153"),  # not "Matrix is not positive"
    ('method="ddpsa" clip=1e-200', "run-config 'clip' = 1e-200 is below 1.19e-153"),
    ('method="ldp" lr=1e-300', "a record's clipped step (8.77e-303, lr / batch or lr x clip / batch on 114 records) "
                               "is below 1.19e-153"),
    ('method="ldp" lr=1e308', "local training on 114 records may reach 1e+308, beyond float64's range"),
])
def test_settings_every_client_would_refuse_are_refused_at_start(capsys, monkeypatch, run_config, needle):
    """Each client's floor (client.env) refused every round: "no round succeeded" after the clients started."""
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", f'{run_config} dataset="breast-cancer" num-clients=4 num-rounds=1')
    assert code == 2 and needle in err and "every client would refuse every round" in err, err


@pytest.mark.parametrize("raw", [{"method": "fedavg", "clip": 1e-200}, {"method": "ldp", "clip": 1e-100},
                                 {"method": "mpddp", "lr": 1e308}])
def test_settings_the_floors_hold_stay_allowed(raw):
    preflight({"dataset": "breast-cancer", "num-clients": 4, "num-rounds": 1, **raw}, warn=print)


# ------------------------------------------------------------------ method keys' messages name the key
@pytest.mark.parametrize(("raw", "needle"), [
    ({"method": "ddpsa", "num-rounds": 3, "ddpsa-allocation": "exponential", "ddpsa-decay": 1e-300},
     "run-config 'ddpsa-allocation' = 'exponential', 'ddpsa-decay' = 1e-300"),
    ({"method": "niss", "niss-tau": 1e160}, "run-config 'niss-tau' is too large for float64"),
])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # niss's covariance at tau^2 = inf
def test_a_method_key_no_plan_can_meet_is_named(raw, needle):
    """The message names the keys: not only "all per-round epsilons must be finite and > 0", nor "niss-tau = 0"."""
    with pytest.raises(ConfigError) as err:
        preflight({"dataset": "breast-cancer", "num-clients": 4, **raw}, warn=print)
    assert needle in str(err.value) and "niss-tau = 0" not in str(err.value), err.value


# ------------------------------------------------------------------ the in-process engine called as a library
@pytest.mark.parametrize(("raw", "needle"), [
    ({"method": "nadp", "dataset": "breast-cancer", "num-clients": 4, "clip": 1e-200},
     "run-config 'clip' = 1e-200 is below 1.19e-153"),
    ({"method": "ldp", "dataset": "breast-cancer", "num-clients": 4, "lr": 1e-300},
     "a record's clipped step (8.77e-303, lr / batch or lr x clip / batch on 114 records) is below 1.19e-153"),
    ({"method": "ladp", "num-clients": 1, "epsilon": 1e10},
     "cannot keep its noise in the float32 upload of a client with 1437 records"),
])
def test_run_inprocess_refuses_at_start_what_every_engine_refuses(tmp_path, monkeypatch, raw, needle):
    """Benchmarks and tests call run_inprocess without the launcher's preflight: refused before any client trains.

    The start sequence every engine applies (protocols.start_checks): no grid is made and no out-dir.
    """
    import re

    from server.launch import run_inprocess

    _no_process(monkeypatch)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        run_inprocess({"num-rounds": 1, **raw, "out-dir": str(tmp_path / "o")}, progress=lambda _s: None)
    assert not (tmp_path / "o").exists()
