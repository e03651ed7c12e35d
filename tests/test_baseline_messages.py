"""Baseline message parts: ldp's noise std and cdp's clipping norm reach the client as the strategy meant them."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from client.messages.baselines import ClippingNorm, LocalDpNoise
from client.messages.common import TrainIns
from protocols.config import RunConfig
from server.defaults import app_defaults
from strategies.baselines import CentralDPStrategy, LocalDPStrategy


def _cfg(method: str) -> RunConfig:
    return RunConfig.from_mapping({**app_defaults(), "method": method, "num-clients": 5, "num-rounds": 3})


def test_ldp_train_config_carries_the_calibrated_std() -> None:
    strategy = LocalDPStrategy(_cfg("ldp"))
    rec = strategy.train_config(2)
    assert TrainIns.from_config(rec).round == 2
    assert LocalDpNoise.from_config(rec).std == pytest.approx(strategy.z * strategy.cfg.clip)


def test_cdp_train_config_carries_the_clip_under_flowers_key() -> None:
    strategy = CentralDPStrategy(_cfg("cdp"))
    rec = strategy.train_config(1)
    assert rec[KEY_CLIPPING_NORM] == pytest.approx(strategy.cfg.clip)  # what fixedclipping_mod reads


@pytest.mark.parametrize("bad", [-0.1, float("inf"), "1.0"])
def test_noise_std_decoder_names_the_key(bad) -> None:
    with pytest.raises(ValueError, match="noise-std"):
        LocalDpNoise.from_config(ConfigRecord({"noise-std": bad}))


def test_clipping_norm_must_be_positive() -> None:
    with pytest.raises(ValueError, match=KEY_CLIPPING_NORM):
        ClippingNorm(0.0)
