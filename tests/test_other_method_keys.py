"""Keys the run does not read (another method's option, a bundled dataset's data-dir) are named at start, not ignored silently."""

from __future__ import annotations

from protocols.adjustments import adjustments
from protocols.config import RunConfig
from server.defaults import app_defaults


def _notes(**raw) -> list[str]:
    return [n for n in adjustments(RunConfig.from_mapping({**app_defaults(), **raw})) if "does not read" in n]


def test_an_option_of_another_method_is_named():
    notes = _notes(method="ldp", **{"nadp-tau": 0.3, "dropout-rate": 0.2})
    assert any("'nadp-tau' = 0.3 (a key of nadp)" in n for n in notes), notes
    assert any("'dropout-rate' = 0.2 (a key of nadp, niss, mpddp)" in n for n in notes), notes


def test_defaults_and_the_methods_own_options_are_not_named():
    for method in ("fedavg", "ldp", "cdp", "nadp", "niss", "mpddp", "ladp", "ddpsa"):
        assert not _notes(method=method, **{"num-clients": 200}), method
    assert not _notes(method="nadp", **{"nadp-tau": 0.3, "dropout-rate": 0.2})


def test_a_data_dir_the_dataset_does_not_read_is_named():
    notes = adjustments(RunConfig.from_mapping({**app_defaults(), "dataset": "digits", "data-dir": "/data/idx"}))
    assert any("'data-dir' = '/data/idx'" in n and "'digits' does not read it" in n for n in notes), notes
    assert not adjustments(RunConfig.from_mapping({**app_defaults(), "dataset": "mnist", "data-dir": "/data/idx"}))


def test_fedavg_names_an_epsilon_it_does_not_read():
    from protocols.adjustments import adjustments
    from protocols.config import RunConfig

    cfg = RunConfig.from_mapping({"method": "fedavg", "epsilon": 8.0})
    assert any("'fedavg' adds no noise" in n and "'epsilon' = 8" in n for n in adjustments(cfg))
    assert not any("adds no noise" in n for n in adjustments(RunConfig.from_mapping({"method": "fedavg"})))
    assert not any("adds no noise" in n for n in adjustments(RunConfig.from_mapping({"method": "ldp", "epsilon": 8.0})))


def test_a_ladp_norm_threshold_that_skips_layers_is_named_at_start():
    from protocols.adjustments import adjustments
    from protocols.config import RunConfig

    notes = adjustments(RunConfig.from_mapping({"method": "ladp", "ladp-norm-threshold": 1e300}))
    assert any("'ladp-norm-threshold' = 1e+300" in n and "without noise" in n for n in notes), notes
    assert not any("ladp-norm-threshold" in n for n in adjustments(RunConfig.from_mapping({"method": "ladp"})))
