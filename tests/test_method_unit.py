"""A method is one unit: a new method added from this module alone, with one registry call, runs end to end.

``gldp`` is a Gaussian local-DP variant whose clients add ``gldp-noise-boost`` times ldp's noise.  Its options
class, server strategy and client handler are defined here; :func:`protocols.methods.register` (as a ``with`` block) is the only
call into the project's registry.  The run goes through ``cancelfl run`` in-process: checkpoint, crash, resume,
metrics, accounting and the report.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
from flwr.app import Message

from client.env import ClientEnv, record_level_training, reply
from client.floor import release
from client.records import to_record
from protocols.arrays import flatten, unflatten
from protocols.config import ConfigError, RunConfig
from protocols.floor import at_least, ldp_noise_multiplier
from protocols.methods import Guarantee, MethodSpec, register
from protocols.options import MethodOptions, option
from protocols.privacy import (
    Accountant,
    GaussianEvent,
    GdpAccountant,
    PrivacyLedger,
    gdp_epsilon,
    multiplier_under,
    record_sensitivity,
)
from protocols.wire.baselines import LocalDpNoise
from server.launch import main, run_inprocess
from strategies.baselines import LocalDPStrategy
from strategies.run.checkpoint import load_checkpoint
from tests.conftest import Crash, crash_after, read_metrics


@dataclass(frozen=True)
class GaussLdpOptions(MethodOptions):
    """gldp's own key: how many times ldp's noise multiplier its clients use."""

    prefix = "gldp"
    title = "Gaussian LDP (test method)"

    noise_boost: float = option(2.0, "multiplier of ldp's noise", low=1.0)


class GaussLdpStrategy(LocalDPStrategy):
    """ldp's server with the boosted noise multiplier (its accounting follows ``self.z``)."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.z *= cfg.options_of(GaussLdpOptions).noise_boost


def train_gldp(msg: Message, env: ClientEnv) -> Message:
    """Per-example-clipped full-batch step, then the local model plus N(0, (boost z 2 C lr / n_k)^2)."""
    from protocols.prg import gaussian

    z = env.cfg.options_of(GaussLdpOptions).noise_boost * ldp_noise_multiplier(env.cfg)
    at_least("noise-multiplier", LocalDpNoise.from_config(msg.content["config"]).multiplier, z)
    global_w, local_w, loss, frac = record_level_training(msg, env)
    std = z * record_sensitivity(env.cfg, len(env.y))
    flat = flatten(local_w)
    noisy = flat + gaussian(os.urandom(32), len(flat), std)
    spent = release(msg, env, GaussianEvent(z))
    return reply(msg, to_record(unflatten(noisy, global_w)), len(env.y), train_loss=loss, clipped_fraction=frac,
                 noise_std=std, **spent)


GLDP = MethodSpec("gldp", GaussLdpStrategy, train_gldp, options=(GaussLdpOptions,),
                  privacy=Guarantee("record", "the server and eavesdroppers", "anyone who gets the models"))
RUN = {"method": "gldp", "num-clients": 4, "num-rounds": 3, "local-epochs": 1, "batch-size": 1_000_000, "lr": 4.0,
       "hidden": "", "dataset": "digits", "train-subset": 400, "test-subset": 200}


def test_a_method_registered_from_a_test_module_runs_crashes_resumes_and_reports(tmp_path, capsys):
    out = tmp_path / "gldp"
    with register(GLDP):
        with pytest.raises(ConfigError, match="gldp-noise-boost"):  # its own key, validated by its options class
            RunConfig.from_mapping({**RUN, "gldp-noise-boost": 0.5})
        with pytest.raises(Crash):
            run_inprocess({**RUN, "out-dir": str(out)}, progress=crash_after(2))
        assert load_checkpoint(out).round == 2 and not (out / "summary.json").exists()
        assert main(["run", "--resume", str(out)]) == 0
        capsys.readouterr()
        rows = read_metrics(out)
        summary = json.loads((out / "summary.json").read_text())
        plain = RunConfig.from_mapping({**RUN, "method": "ldp"})
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[2]["resumed_after_round"] == 2
    assert summary["config"]["gldp-noise-boost"] == 2.0
    eps = [r["epsilon"] for r in rows]
    assert eps[0] < eps[1] < eps[2] == pytest.approx(summary["epsilon"])
    # Twice ldp's noise multiplier: the same 3 rounds cost far less than the target ldp would spend.
    assert summary["epsilon"] < 0.6 * plain.epsilon
    assert 0 < rows[-1]["client_epsilon_max"] <= summary["epsilon"]  # the clients' ledgers ran through the resume
    assert (out / "report.md").is_file() and "gldp" in (out / "report.md").read_text()
    # Outside the block the method and its key are unknown again.
    with pytest.raises(ConfigError, match="unknown run-config key 'gldp-noise-boost'"):
        RunConfig.from_mapping({"gldp-noise-boost": 2.0})
    with pytest.raises(ConfigError, match="gldp"):
        RunConfig.from_mapping({**RUN, "method": "gldp"})


def gdp_accountant() -> Accountant:
    """gldp-gdp's one composition: exact Gaussian DP, for the noise, the server's ledger and the clients' ledgers."""
    return GdpAccountant()


def gdp_multiplier(cfg: RunConfig) -> float:
    return multiplier_under(gdp_accountant(), cfg.epsilon, cfg.delta, cfg.num_rounds)


class GdpLdpStrategy(LocalDPStrategy):
    """The ldp server with its noise calibrated and charged under :func:`gdp_accountant`."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.z = gdp_multiplier(cfg)
        self.privacy = PrivacyLedger(cfg.delta, uplink=gdp_accountant(), downlink=gdp_accountant(), headline="uplink")


def train_gdp_ldp(msg: Message, env: ClientEnv) -> Message:
    """The record-level ldp upload with the multiplier and the ledger charge of :func:`gdp_accountant`."""
    from protocols.prg import gaussian

    asked = LocalDpNoise.from_config(msg.content["config"]).multiplier
    at_least("noise-multiplier", asked, gdp_multiplier(env.cfg))
    z = max(asked, gdp_multiplier(env.cfg))
    global_w, local_w, loss, _ = record_level_training(msg, env)
    flat = flatten(local_w)
    noisy = flat + gaussian(os.urandom(32), len(flat), z * record_sensitivity(env.cfg, len(env.y)))
    spent = release(msg, env, GaussianEvent(z), accountant=gdp_accountant())
    return reply(msg, to_record(unflatten(noisy, global_w)), len(env.y), train_loss=loss, **spent)


def test_a_method_changes_its_accountant_in_one_function(tmp_path):
    """The accountant a card names calibrates the noise, charges the server's ledger and the clients' ledgers."""
    out = tmp_path / "gdp"
    spec = MethodSpec("gldp-gdp", GdpLdpStrategy, train_gdp_ldp,
                      privacy=Guarantee("record", "the server and eavesdroppers", "anyone who gets the models"))
    with register(spec):
        run_inprocess({**RUN, "method": "gldp-gdp", "out-dir": str(out)})
        cfg = RunConfig.from_mapping({**RUN, "method": "gldp-gdp"})
    rows, summary = read_metrics(out), json.loads((out / "summary.json").read_text())
    z = gdp_multiplier(cfg)
    assert z < ldp_noise_multiplier(cfg)  # the RDP multiplier spends less than the target under Gaussian DP
    assert gdp_epsilon(ldp_noise_multiplier(cfg), cfg.num_rounds, cfg.delta) < 0.99 * cfg.epsilon
    assert summary["epsilon"] == pytest.approx(gdp_epsilon(z, cfg.num_rounds, cfg.delta))
    assert summary["epsilon"] <= cfg.epsilon * (1 + 1e-9)
    assert summary["epsilon"] == pytest.approx(cfg.epsilon, rel=1e-3)
    assert rows[-1]["client_epsilon_max"] == pytest.approx(summary["epsilon"])


def test_what_the_project_knows_of_a_method_is_read_from_its_card():
    """Graph default, server step, the defaults benchmark's floor and named variants: fields of the card alone."""
    from benchmarks.defaults import acceptance
    from protocols.methods import method_or_variant, register_variant

    rows = [{"dataset": "digits", "method": "gldp", "final_accuracy": 0.2}]
    carded = MethodSpec("gldp", GaussLdpStrategy, train_gldp, options=(GaussLdpOptions,), privacy=GLDP.privacy,
                        sparse_graph=True, server_step_lr="lr", floor_exempt=("small",))
    with register(carded), register_variant("gldp-strong", "gldp", {"gldp-noise-boost": 4.0}):
        assert RunConfig.from_mapping({**RUN, "num-clients": 40}).graph == "n-out"
        assert RunConfig.from_mapping({**RUN, "server-optimizer": "adam"}).server_optimizer == "adam"
        assert acceptance(rows, {"digits": 0.1}) == []
        assert method_or_variant("gldp-strong") == ("gldp", {"gldp-noise-boost": 4.0})
        with pytest.raises(ValueError, match="already registered"):
            register_variant("gldp", "gldp", {})
    with pytest.raises(ValueError, match="unknown method"):
        method_or_variant("gldp-strong")
    with register(GLDP):  # the same method without those fields
        assert RunConfig.from_mapping({**RUN, "num-clients": 40}).graph == "complete"
        with pytest.raises(ConfigError, match="server-optimizer"):
            RunConfig.from_mapping({**RUN, "server-optimizer": "adam"})
        failed = acceptance(rows, {"digits": 0.1})
        assert len(failed) == 1 and failed[0].startswith("digits: gldp") and failed[0].endswith("is below 0.500")


def test_a_methods_round_time_goal_is_read_from_its_card():
    """``cancelfl-bench roundtime`` states a registered method's goal from its card; a card without one shows none."""
    from benchmarks.roundtime import _ratios, goals

    shipped = {"nadp": 1.1, "niss": 1.1, "mpddp": 1.1, "ldp": 1.1, "cdp": 1.1, "ladp": 1.1, "ddpsa": 1.5}
    assert goals(False) == shipped and goals(True) == dict.fromkeys(shipped, 1.2)
    raw = [{"name": name, "repeat": 0, "status": "ok", "clients": 3, "round_s": t, "peak_rss_mb": 100.0}
           for name, t in (("fedavg", 1.0), ("gldp", 1.25), ("ldp", 1.0))]
    carded = MethodSpec("gldp", GaussLdpStrategy, train_gldp, options=(GaussLdpOptions,), privacy=GLDP.privacy,
                        round_time_goal=1.3, deployment_round_time_goal=1.5)
    with register(carded):
        assert goals(False)["gldp"] == 1.3 and goals(True)["gldp"] == 1.5
        row = next(r for r in _ratios([dict(r) for r in raw], 1, goals(False)) if r["name"] == "gldp")
        assert (row["goal"], row["meets_goal"]) == ("<= 1.3x", "yes")
    with register(GLDP):
        row = next(r for r in _ratios([dict(r) for r in raw], 1, goals(False)) if r["name"] == "gldp")
        assert (row["goal"], row["meets_goal"]) == ("-", "-")


def test_the_benchmarks_run_a_method_registered_after_they_were_imported():
    """``--methods all`` reads the registry when it runs, not a list taken when the benchmarks were imported."""
    from benchmarks import common, defaults

    with register(GLDP):
        assert "gldp" in common.benchmark_names() and "gldp" in defaults._names("all")
    assert "gldp" not in common.benchmark_names()


def test_an_option_flower_does_not_know_travels_in_method_options():
    """A method's own key rides in the declared ``method-options``, read back as the key itself.

    Flower's runtime takes only the keys ``[tool.flwr.app.config]`` declares; another undeclared key is refused by name.
    """
    from flwr.common.config import parse_config_args

    from server.defaults import app_defaults, flower_run_config
    from server.flower_commands import run_config_arg

    with register(GLDP):
        ov = flower_run_config({**RUN, "gldp-noise-boost": 3.0})
        assert ov["method-options"] == "{gldp-noise-boost = 3.0}" and "gldp-noise-boost" not in ov
        flower = parse_config_args([run_config_arg(ov)])  # as `flwr run` parses the launcher's --run-config
        assert RunConfig.from_mapping({**app_defaults(), **flower}).gldp_noise_boost == 3.0
        with pytest.raises(ConfigError, match="given twice"):
            flower_run_config({**RUN, "gldp-noise-boost": 3.0, "method-options": "{gldp-noise-boost = 4.0}"})
    with pytest.raises(ConfigError, match="'gldp-noise-boost': not declared in"):
        flower_run_config({**RUN, "gldp-noise-boost": 3.0})
