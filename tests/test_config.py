"""Run-config validation: bad values are refused naming the key and the allowed values."""

from __future__ import annotations

import tomllib

import pytest

from protocols.config import ConfigError, RunConfig
from server.defaults import APP_DIR
from server.launch import main


def test_pyproject_defaults_match_dataclass():
    """Every run-config key is declared in pyproject (Flower refuses unknown overrides) with the same default."""
    declared = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert declared == RunConfig().to_mapping()


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


def test_unknown_key_is_refused():
    with pytest.raises(ConfigError, match="unknown run-config key 'num-round'"):
        RunConfig.from_mapping({"num-round": 3})


def test_types_are_coerced():
    cfg = RunConfig.from_mapping({"num-rounds": "5", "lr": 1, "epsilon": "0.5"})
    assert (cfg.num_rounds, cfg.lr, cfg.epsilon) == (5, 1.0, 0.5)
    assert RunConfig.from_mapping({"sample-rate": 0.25, "num-clients": 10}).clients_per_round == 2


def test_cli_refuses_bad_config_at_start(capsys):
    assert main(["run", "--run-config", 'method="nope"']) == 2
    assert "method" in capsys.readouterr().err
