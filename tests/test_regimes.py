"""Every method out of the box: its regime applied, its epsilon the whole-run target, its guarantee stated.

Default runs go through the real app in-process with nothing but ``method`` (and the output folder, and
where noted fewer rounds) set, as ``cancelfl run --run-config 'method="M"'`` would.
"""

from __future__ import annotations

import json
import math

import pytest

from protocols import ladp as ladp_math
from protocols.adjustments import adjustments
from protocols.config import ConfigError, RunConfig
from protocols.methods import FULL_BATCH, METHOD_NAMES, METHODS, regime
from protocols.niss import client_tau
from protocols.privacy import gdp_epsilon
from protocols.privacy.signal import NoiseEstimate
from server.launch import run_inprocess


def _run(tmp_path, name: str, lines: list[str] | None = None, **overrides) -> tuple[dict, list[dict]]:
    out = tmp_path / name
    summary = run_inprocess({**overrides, "out-dir": str(out)},
                            progress=(lines.append if lines is not None else lambda _line: None))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_record_step_regimes_centre_images_and_the_others_do_not():
    centred = {m for m in METHOD_NAMES if RunConfig.from_mapping({"method": m}).input_centering}
    assert centred == {"nadp", "niss", "cdp", "ldp", "ladp"}
    assert not RunConfig.from_mapping({"method": "nadp", "input-centering": False}).input_centering
    assert RunConfig.from_mapping({"method": "fedavg", "input-centering": True}).input_centering


def test_image_only_settings_are_refused_on_tabular_data_and_no_regime_sets_them():
    """input-centering centres images only: on breast-cancer it would change nothing the run config claims."""
    for method in METHOD_NAMES:
        cfg = RunConfig.from_mapping({"method": method, "dataset": "breast-cancer"})
        assert not cfg.input_centering and "input-centering" not in dict(cfg.regime_applied)
    for key, value, fix in (("input-centering", True, "false"), ("model", "cnn", "'mlp'")):
        with pytest.raises(ConfigError, match=f"'{key}' is for images; dataset 'breast-cancer' is tabular: set "
                                              f"'{key}' = {fix}"):
            RunConfig.from_mapping({"method": "ldp", "dataset": "breast-cancer", key: value})


def test_the_start_line_names_the_dataset_only_for_cancelfls_own_model_and_data():
    from strategies.run.notes import APP_TASK_KEYS, preamble

    cfg = RunConfig.from_mapping({"method": "nadp"})
    assert set(APP_TASK_KEYS) <= set(dict(cfg.regime_applied))
    ours = preamble(cfg, verbose=False)[0]
    assert ours.startswith("nadp regime on digits ") and "input-centering=True" in ours and "hidden=''" in ours
    theirs = preamble(cfg, verbose=False, own_model_and_data=True)[0]
    assert theirs.startswith("nadp regime (") and "digits" not in theirs and "model-ema=0.8" in theirs
    assert not any(f"{key}=" in theirs for key in APP_TASK_KEYS)


def test_every_method_has_a_guarantee_and_a_regime_that_differs_from_fedavg_where_the_paper_says_so():
    for name, spec in METHODS.items():
        g = spec.privacy
        assert g.unit in ("record", "client", "none")
        if name == "fedavg":
            assert g.unit == "none" and g.uplink is None and g.downlink is None and not spec.units
        else:
            assert g.downlink is not None, f"{name}: every DP method protects the published model"
            # every DP method protects a record by default (the papers' neighbouring datasets)
            assert spec.units[0] == "record" and RunConfig.from_mapping({"method": name}).privacy_unit == "record"
            assert spec.guarantee("record").unit == "record"
    # the papers' regimes: one full-batch clipped step per round (nadp), FedSGD with a server step (mpddp)
    nadp = regime("nadp", "digits")
    assert nadp["local-epochs"] == 1 and nadp["batch-size"] >= 100_000
    assert regime("mpddp", "mnist")["mpddp-server-lr"] > 0
    # ddpsa's pure-epsilon Laplace has most signal in one release on small data (docs/methods/ddpsa.md)
    assert all(RunConfig.from_mapping({"method": m}).num_rounds >= 2 for m in METHOD_NAMES if m != "ddpsa")
    assert RunConfig.from_mapping({"method": "ddpsa"}).num_rounds >= 1


def test_client_level_is_asked_for_by_name_and_refused_where_not_implemented():
    assert RunConfig.from_mapping({"method": "ldp", "privacy-unit": "client"}).privacy_unit == "client"
    assert RunConfig.from_mapping({"method": "cdp", "privacy-unit": "client"}).privacy_unit == "client"
    with pytest.raises(ConfigError, match="protects a record, not a 'client': set run-config 'privacy-unit' = "
                                          r"\"record\" or choose a method that protects a 'client' \(ldp, cdp, niss\)"):
        RunConfig.from_mapping({"method": "nadp", "privacy-unit": "client"})
    with pytest.raises(ConfigError, match="privacy-unit"):
        RunConfig.from_mapping({"method": "ldp", "privacy-unit": "user"})


def test_one_federation_per_dataset_for_every_method_and_record_step_methods_publish_an_average():
    for dataset, k in (("digits", 10), ("breast-cancer", 10), ("mnist", 100), ("fashion-mnist", 100)):
        assert {RunConfig.from_mapping({"method": m, "dataset": dataset}).num_clients for m in METHOD_NAMES} == {k}
    assert RunConfig.from_mapping({"method": "nadp", "dataset": "mnist", "num-clients": 7}).num_clients == 7
    ema = {m: RunConfig.from_mapping({"method": m}).model_ema for m in METHOD_NAMES}
    assert {m for m, d in ema.items() if d > 0} == {"ldp", "cdp", "nadp", "niss", "ladp"}  # the record-step regimes
    assert RunConfig.from_mapping({"method": "mpddp", "model-ema": 0.5}).model_ema == 0.5


def test_ladp_epsilon_is_the_whole_run_target():
    for rounds in (1, 3, 20):
        e = ladp_math.round_epsilon(1.0, 1e-5, rounds)
        spent = gdp_epsilon(ladp_math.theorem3_c0_corrected(e, 1e-5) / e, rounds, 1e-5)
        assert spent == pytest.approx(1.0, rel=1e-6) and spent <= 1.0


def test_niss_protects_the_model_by_default():
    cfg = RunConfig.from_mapping({"method": "niss"})
    tau = client_tau(cfg)
    assert tau == pytest.approx(1 / math.sqrt(cfg.clients_per_round))  # the model gets the uploads' multiplier
    assert client_tau(cfg.replace(niss_tau=0.0)) == 0.0  # an explicit setting still wins


def test_noise_estimate_run_ratio():
    est = NoiseEstimate(noise_norm=10.0, signal_norm=1.0, rounds=4)
    assert est.round_ratio == 10.0 and est.run_ratio == 5.0 and est.dwarfs
    assert not NoiseEstimate(1.0, 1.0, 4).dwarfs
    assert "5x" in est.message()


@pytest.mark.slow
def test_default_nadp_trains_on_digits_far_above_ldp_and_outputs_say_what_epsilon_means(tmp_path):
    """Nadp and ldp with only the method set (the regimes apply): both protect a record at epsilon 1.

    Same 10 clients; nadp's pair noise cancels, ldp's independent noise leaves sqrt(10) times more in the model.
    """
    ldp_lines: list[str] = []
    ldp, ldp_rows = _run(tmp_path, "ldp", ldp_lines, method="ldp")
    nadp, nadp_rows = _run(tmp_path, "nadp", method="nadp", clip=1.0)
    # regime applied (and recorded), the user's key kept
    assert nadp["regime"]["local-epochs"] == 1 and "clip" not in nadp["regime"]
    assert nadp["config"]["num-rounds"] == nadp["regime"]["num-rounds"]
    assert nadp["config"]["num-clients"] == ldp["config"]["num-clients"] == 10
    # nadp trains (fedavg reaches ~0.91 here; zero-out adjacency: nadp ~0.89-0.91, record-level ldp ~0.75-0.78)
    assert nadp["final_accuracy"] >= 0.8
    assert nadp["final_accuracy"] >= ldp["final_accuracy"] + 0.05
    assert ldp["final_accuracy"] >= 0.2
    assert ldp["noise_check"]["run_ratio"] > nadp["noise_check"]["run_ratio"]
    # the whole-run target is met and spent (exact RDP calibration), the unit and the directions are stated
    assert 0.99 <= nadp["epsilon"] <= 1.0 + 1e-9 and 0.99 <= ldp["epsilon"] <= 1.0 + 1e-9
    assert nadp["privacy"]["unit"] == ldp["privacy"]["unit"] == "record"
    assert all(r["privacy_unit"] == "record" for r in nadp_rows + ldp_rows)
    assert nadp["privacy"]["downlink"]["adversary"] and nadp["privacy"]["downlink"]["epsilon"] <= 1.0 + 1e-9


@pytest.mark.slow
def test_no_guarantee_direction_is_null_and_ladp_spends_its_target(tmp_path):
    cdp, _ = _run(tmp_path, "cdp", method="cdp", **{"num-rounds": 1})
    assert cdp["epsilon_uplink"] is None and cdp["privacy"]["uplink"] == {
        "view": cdp["privacy"]["uplink"]["view"], "adversary": None, "epsilon": None}
    assert cdp["privacy"]["downlink"]["epsilon"] == pytest.approx(1.0, abs=1e-3)
    ladp, _ = _run(tmp_path, "ladp", method="ladp")
    assert ladp["epsilon"] == pytest.approx(1.0, rel=1e-6)  # per-round epsilon composed to the run's target
    mp, _ = _run(tmp_path, "mpddp", method="mpddp", **{"num-rounds": 2})
    assert mp["epsilon_uplink"] is None and mp["privacy"]["uplink"]["adversary"] is None  # nominal only
    assert mp["epsilon_downlink"] is not None


@pytest.mark.parametrize("method", ["ddpsa", "mpddp", "mpcdp", "mpdp-naive"])
def test_a_full_batch_gradient_method_records_the_step_it_takes_and_warns_on_keys_it_ignores(method):
    # one full-batch gradient per round: "auto" records what the method does, not the field defaults (2 epochs of 32)
    cfg = RunConfig.from_mapping({"method": method})
    assert (cfg.local_epochs, cfg.batch_size) == (1, FULL_BATCH)
    assert {"local-epochs": 1, "batch-size": FULL_BATCH}.items() <= dict(cfg.regime_applied).items()
    assert not [n for n in adjustments(cfg) if "does not read" in n]
    # set explicitly (the benchmarks pass them to every method): kept as given, run, and named once at start
    cfg = RunConfig.from_mapping({"method": method, "local-epochs": 2, "batch-size": 32})
    notes = [n for n in adjustments(cfg) if "does not read" in n]
    assert len(notes) == 1 and "'local-epochs' = 2" in notes[0] and "'batch-size' = 32" in notes[0], notes
    # a method that reads them is not warned
    assert not [n for n in adjustments(RunConfig.from_mapping({"method": "nadp", "local-epochs": 2}))
                if "does not read" in n]
