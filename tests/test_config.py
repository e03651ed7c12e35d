"""Run-config validation: bad values are refused naming the key and the allowed values."""

from __future__ import annotations

import tomllib

import pytest

from protocols.config import ConfigError, RunConfig
from protocols.methods import AUTO, AUTO_KEYS, METHOD_NAMES, regime
from server.defaults import APP_DIR
from server.launch import main


def test_pyproject_defaults_match_dataclass():
    """Every run-config key is declared in pyproject (Flower refuses unknown overrides) with the same default.

    Exactly the method-dependent keys (AUTO_KEYS) default to "auto"; fedavg's regime is the dataclass default.
    """
    declared = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert {k for k, v in declared.items() if v == AUTO} == set(AUTO_KEYS)
    assert {k: v for k, v in declared.items() if v != AUTO} == {
        k: v for k, v in RunConfig().to_mapping().items() if k not in AUTO_KEYS}
    assert RunConfig.from_mapping(declared) == RunConfig()


def test_regime_applies_only_to_keys_left_auto():
    """A method's regime fills the "auto" (or absent) keys, is recorded, and never replaces a value the user set."""
    cfg = RunConfig.from_mapping({"method": "nadp", "lr": "auto", "clip": 0.5})
    applied = dict(cfg.regime_applied)
    assert cfg.clip == 0.5 and "clip" not in applied  # user-set value wins
    assert cfg.lr == applied["lr"] == regime("nadp", "digits")["lr"]
    assert cfg.local_epochs == 1 and cfg.batch_size >= 10_000  # one full-batch step per round (the paper's regime)
    assert "regime-applied" not in cfg.to_mapping()
    for method in METHOD_NAMES:  # every regime is a valid config on every dataset
        for dataset in ("digits", "mnist"):
            RunConfig.from_mapping({"method": method, "dataset": dataset})
    with pytest.raises(ConfigError, match="cannot be"):
        RunConfig.from_mapping({"epsilon": "auto"})


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("method", "magic", "fedavg"),
        ("dataset", "cifar", "digits"),
        ("model", "resnet", "mlp"),
        ("partitioning", "zipf", "dirichlet"),
        ("sample-rate", 1.5, "sample-rate"),
        ("delta", 2.0, "delta"),
        ("epsilon", -1.0, "epsilon"),
        ("num-rounds", 0, "num-rounds"),
        ("graph", "ring", "n-out"),
        ("lr", "fast", "lr"),
    ],
)
def test_bad_values_name_key_and_choices(key, value, needle):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping({key: value})
    assert key in str(err.value) and needle in str(err.value)


def test_unknown_key_is_refused_naming_the_nearest_known_key():
    with pytest.raises(ConfigError, match=r"unknown run-config key 'num-round' \(did you mean 'num-rounds'\?\)"):
        RunConfig.from_mapping({"num-round": 3})
    with pytest.raises(ConfigError, match=r"unknown run-config key 'zzz'; known keys"):
        RunConfig.from_mapping({"zzz": 3})


def test_removed_key_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="'niss-unit-variance' was removed: NISS sends one noise share per neighbour"):
        RunConfig.from_mapping({"method": "niss", "niss-unit-variance": 1.0})
    assert RunConfig.from_mapping({"niss-unit-variance": 1.0}, strict=False).method == "fedavg"  # older peers: ignored


def test_types_are_coerced():
    cfg = RunConfig.from_mapping({"num-rounds": "5", "lr": 1, "epsilon": "0.5"})
    assert (cfg.num_rounds, cfg.lr, cfg.epsilon) == (5, 1.0, 0.5)
    assert RunConfig.from_mapping({"sample-rate": 0.25, "num-clients": 10}).clients_per_round == 2


def test_cli_refuses_bad_config_at_start(capsys):
    assert main(["run", "--run-config", 'method="nope"']) == 2
    assert "method" in capsys.readouterr().err


@pytest.mark.parametrize(("raw", "needle"), [
    ({"method": "nadp", "num-clients": 1}, "set 'num-clients' >= 2"),
    ({"method": "niss", "num-clients": 10, "sample-rate": 0.1}, "raise 'sample-rate' to at least 0.2"),
    ({"method": "mpddp", "num-clients": 4, "sample-rate": 0.2}, "'sample-rate' = 0.2 gives 1"),
    ({"method": "ddpsa", "num-clients": 1}, "'num-clients' = 1"),
])
def test_methods_that_need_two_clients_per_round_refuse_one(raw, needle):
    """Pairwise-noise and secure-sum methods with one client per round: refused by the config, naming the keys."""
    with pytest.raises(ConfigError, match="needs at least 2 clients per round") as err:
        RunConfig.from_mapping(raw)
    assert needle in str(err.value)


def test_one_client_per_round_stays_allowed_where_it_works():
    """Methods whose round works with one client keep accepting it (fedavg, the baselines, the MP ablations)."""
    for method in ("fedavg", "ldp", "cdp", "mpdp-naive", "mpcdp", "ladp"):
        assert RunConfig.from_mapping({"method": method, "num-clients": 4, "sample-rate": 0.2}).clients_per_round == 1


@pytest.mark.parametrize(("raw", "needle"), [
    ({"epsilon": True}, "'epsilon' = true must be a number"),
    ({"num-rounds": True}, "'num-rounds' = true must be an integer"),
    ({"n-out": True}, "'n-out' = true must be an integer"),
    ({"self-mask": 5}, "'self-mask' = 5 must be a boolean"),
    ({"cancellation-check": 2}, "'cancellation-check' = 2 must be a boolean"),
    ({"input-centering": 1.0}, "'input-centering' = 1.0 must be a boolean"),
    ({"self-mask": "maybe"}, "'self-mask' = 'maybe' must be a boolean"),
])
def test_booleans_and_numbers_are_not_interchangeable(raw, needle):
    """A boolean for a number key and a number for a boolean key are refused, naming the key and the type."""
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping(raw)
    assert needle in str(err.value)


def test_boolean_keys_take_booleans_and_their_words():
    for value, want in ((True, True), (False, False), ("true", True), ("False", False), ("yes", True), ("0", False)):
        assert RunConfig.from_mapping({"cancellation-check": value}).cancellation_check is want


@pytest.mark.parametrize("value", [0, 0.0])
def test_integer_range_errors_show_integers(value):
    with pytest.raises(ConfigError, match=r"'n-out' = 0 must be in \[1, inf\)"):
        RunConfig.from_mapping({"n-out": value})


def test_min_clients_above_num_clients_is_refused_naming_both():
    """A round cannot wait for more nodes than the federation has: refused, not capped at num-clients."""
    with pytest.raises(ConfigError, match=r"'min-clients' = 5 is above 'num-clients' = 4.*'min-clients' <= 4"):
        RunConfig.from_mapping({"num-clients": 4, "min-clients": 5})
    assert RunConfig.from_mapping({"num-clients": 4, "min-clients": 4}).min_clients == 4
    # the default 2 runs a 1-client federation (its one node); any other value above num-clients is refused
    RunConfig.from_mapping({"num-clients": 1, "min-clients": 2})
    with pytest.raises(ConfigError, match=r"'min-clients' = 3 is above 'num-clients' = 1"):
        RunConfig.from_mapping({"num-clients": 1, "min-clients": 3})


@pytest.mark.parametrize(("raw", "needle"), [
    ({"fault-drop-rate": 0.2}, "withholds 2 of the 10 clients of every round, more than 'ddpsa-dropout-frac' = 0 "
                               "lets a round lose (0)"),
    ({"fault-drop-rate": 0.3, "ddpsa-dropout-frac": 0.2}, "set 'ddpsa-dropout-frac' >= 3/10"),
    ({"fault-drop-rate": 0.5, "ddpsa-noise": "local", "num-clients": 2}, "a DDP-SA partial sum needs at least 2"),
])
def test_ddpsa_refuses_a_fault_drop_rate_every_round_would_fail_on(raw, needle):
    """Withholding more than ddpsa-dropout-frac lets a round lose aborts every round: refused before round 1."""
    with pytest.raises(ConfigError, match="'fault-drop-rate'") as err:
        RunConfig.from_mapping({"method": "ddpsa", **raw})
    assert needle in str(err.value)


@pytest.mark.parametrize("raw", [{"fault-drop-rate": 0.2, "ddpsa-dropout-frac": 0.2},
                                 {"fault-drop-rate": 0.12, "ddpsa-dropout-frac": 0.1},  # round(1.2) = 1 = floor(1)
                                 {"fault-drop-rate": 0.5, "ddpsa-noise": "local"}])
def test_ddpsa_accepts_a_fault_drop_rate_its_rounds_survive(raw):
    assert RunConfig.from_mapping({"method": "ddpsa", **raw}).fault_drop_rate == raw["fault-drop-rate"]
