"""A method's own keys in ``method-options``: read as ordinary keys on every end, never a way past the client's checks.

Flower's runtimes take only the keys ``[tool.flwr.app.config]`` declares, so ``cancelfl run/deploy`` carry a
plugin's keys in the declared ``method-options`` (:mod:`protocols.method_options`).  The strategy's settings, the
client's check of them against its own run config (:func:`protocols.wire.settings.settings_of`) and the settings
digest bound into pair keys see the keys it carries as if given one by one.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from protocols.config import ConfigError, RunConfig
from protocols.identity import settings_digest
from protocols.method_options import parse, render
from protocols.methods import METHODS, Guarantee, MethodSpec, register
from protocols.methods import registry as method_registry
from protocols.options import MethodOptions, option
from protocols.wire.settings import KEY, MISMATCH, settings_config, settings_of


@dataclass(frozen=True)
class ToyOptions(MethodOptions):
    prefix = "toy"
    boost: float = option(2.0, "noise boost", low=1.0)
    mode: str = option("plain", "a word", choices=("plain", "fancy"))


TOY = MethodSpec("toy", "strategies.baselines:LocalDPStrategy", "client.methods.baselines:train_ldp",
                 options=(ToyOptions,), privacy=Guarantee("record", "the server", "anyone"))
BASE = {"method": "toy", "num-clients": 3, "num-rounds": 2}


@pytest.fixture(autouse=True)
def toy():
    with register(TOY):
        yield


@pytest.mark.parametrize("text", ["{toy-boost = 3.5, toy-mode = 'fancy'}", '{"toy-boost": 3.5, "toy-mode": "fancy"}'])
def test_carried_keys_are_read_as_the_keys_themselves(text):
    """TOML inline table or JSON object: the same config, settings and settings digest as the keys given one by one."""
    carried = RunConfig.from_mapping({**BASE, "method-options": text})
    plain = RunConfig.from_mapping({**BASE, "toy-boost": 3.5, "toy-mode": "fancy"})
    assert carried == plain and carried.toy_boost == 3.5 and carried.method_options == ""
    assert carried.to_mapping() == plain.to_mapping() and settings_digest(carried) == settings_digest(plain)
    assert parse(render({"toy-boost": 3.5, "toy-mode": "fancy", "x": True, "n": 3})) == {
        "toy-boost": 3.5, "toy-mode": "fancy", "x": True, "n": 3}


@pytest.mark.parametrize(("raw", "needle"), [
    ({"toy-boost": 3.0, "method-options": "{toy-boost = 4.0}"}, "set as itself"),
    ({"method-options": "{epsilon = 50.0}"}, "a key the app declares"),
    ({"method-options": "{method-options = '{toy-boost = 4.0}'}"}, "a key the app declares"),
    ({"method-options": "{toy-boost = 3.0}\nepsilon = 50.0"}, "one table"),
    ({"method-options": '{"toy-boost": 3.0, "toy-boost": 4.0}'}, "written twice"),
    ({"method-options": "{toy-boost = {x = 1}}"}, "number, boolean or string"),
    ({"method-options": "toy-boost=3"}, "TOML inline table"),
    ({"method-options": "{toy-boost = 0.5}"}, "toy-boost"),  # checked as the key itself is
])
def test_a_key_given_twice_a_common_key_or_a_malformed_text_is_refused(raw, needle):
    for strict in (True, False):  # the client reads its run config non-strict: the same refusals
        with pytest.raises(ConfigError, match=needle):
            RunConfig.from_mapping({**BASE, **raw}, strict=strict)
    with pytest.raises(ConfigError, match="from_mapping"):
        RunConfig.of(method="toy", method_options="{toy-boost = 3.0}").validate()


def _sent(**keys) -> dict:
    """A train message's content holding the strategy's settings."""
    return {KEY: settings_config(RunConfig.from_mapping({**BASE, **keys}))}


def test_the_client_holds_the_strategy_to_the_keys_its_method_options_carry():
    """The client's own ``method-options`` keys are its own values: the strategy must send them, as for any key."""
    own = {**BASE, "method-options": "{toy-boost = 3.0}"}
    assert settings_of(_sent(**{"toy-boost": 3.0}), own).toy_boost == 3.0
    with pytest.raises(ConfigError, match=f"{MISMATCH}.*toy-boost"):
        settings_of(_sent(), own)  # the strategy's default 2.0: less noise than this client's run config sets
    with pytest.raises(ConfigError, match=f"{MISMATCH}.*toy-boost"):
        settings_of(_sent(**{"toy-boost": 1.0}), own)


def test_the_strategy_cannot_smuggle_a_value_in_its_own_method_options():
    """Settings sent with a ``method-options`` are read resolved: a value there is compared like any key."""
    forged = {**BASE, "toy-boost": 2.0}
    sent = json.loads(_sent()[KEY]["json"])
    sent.pop("toy-boost")
    sent["method-options"] = "{toy-boost = 1.0}"
    with pytest.raises(ConfigError, match=f"{MISMATCH}.*toy-boost"):
        settings_of({KEY: {"json": json.dumps(sent)}}, forged)
    sent["toy-boost"] = 2.0  # the key itself and in method-options: refused, whichever the client would read
    with pytest.raises(ConfigError, match="set as itself"):
        settings_of({KEY: {"json": json.dumps(sent)}}, forged)


def test_a_registry_read_waits_for_the_cards_another_thread_is_loading():
    """Flower's simulation reads the registry from two threads: neither may see it before the cards are in."""
    started, go, seen = threading.Event(), threading.Event(), []

    def load() -> None:
        started.set()
        go.wait(10)
        register(MethodSpec("late", TOY.strategy, TOY.train))

    method_registry.on_first_read(load)
    first = threading.Thread(target=lambda: list(METHODS))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: seen.append("late" in METHODS))
    second.start()
    time.sleep(0.2)
    go.set()
    first.join(10)
    second.join(10)
    method_registry._REGISTRY.pop("late", None)
    assert seen == [True]


def test_numpy_numbers_travel_as_plain_toml_numbers():
    """A value computed with numpy (np.float64, np.int64) renders as a number the other end parses."""
    assert parse(render({"toy-boost": np.float64(3.0), "n": np.int64(4)})) == {"toy-boost": 3.0, "n": 4}


def test_a_card_loader_that_fails_fails_every_read_until_mended():
    """A broken card is never skipped silently: every read raises, none returns the registry without it."""
    calls = []

    def broken() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise ImportError("broken card")

    method_registry.on_first_read(broken)
    for _ in range(2):
        with pytest.raises(ImportError, match="broken card"):
            list(METHODS)
    list(METHODS)  # mended: the third attempt loads
    assert len(calls) == 3 and not method_registry._PENDING


def test_a_declared_option_in_method_options_names_the_fix_not_a_second_setting():
    """The app's run config always holds its declared keys (their defaults): the message says so and how to set it."""
    from server.defaults import app_defaults

    with pytest.raises(ConfigError, match="a key the app declares always is.*set run-config 'nadp-tau' itself"):
        RunConfig.from_mapping({**app_defaults(), "method": "nadp", "method-options": "{nadp-tau = 0.3}"})
