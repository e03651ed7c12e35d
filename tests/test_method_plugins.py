"""A method of an installed package is known to every process: the ``cancelfl.methods`` entry-point group.

The test installs nothing: it writes a package's ``.dist-info`` (with ``entry_points.txt``) and its card module into
a folder on ``PYTHONPATH`` of a fresh interpreter, as ``pip install`` of a plugin would leave them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocols.config import ConfigError, RunConfig
from protocols.methods import ENTRY_POINT_GROUP

ROOT = Path(__file__).resolve().parent.parent

CARD = '''
from dataclasses import dataclass

from protocols.methods import Guarantee, MethodSpec, register
from protocols.options import MethodOptions, option


@dataclass(frozen=True)
class PluggedOptions(MethodOptions):
    prefix = "plugged"
    boost: float = option(2.0, "noise boost", low=1.0)


register(MethodSpec("plugged", "strategies.baselines:LocalDPStrategy", "client.methods.baselines:train_ldp",
                    options=(PluggedOptions,), privacy=Guarantee("record", "the server", "anyone")))
'''

#: A card that is the whole method in one module, as docs/library.md shows it: its strategy and client handler
#: subclass and import the project's server and client modules at the top of the card.
ONE_MODULE_CARD = '''
import os
from dataclasses import dataclass

from client.env import ClientEnv, record_level_training, reply
from client.floor import release
from client.records import to_record
from protocols.arrays import flatten, unflatten
from protocols.floor import at_least, ldp_noise_multiplier
from protocols.methods import Guarantee, MethodSpec, register
from protocols.options import MethodOptions, option
from protocols.privacy import GaussianEvent, record_sensitivity
from protocols.wire.baselines import LocalDpNoise
from strategies import CancelStrategy
from strategies.baselines import LocalDPStrategy


@dataclass(frozen=True)
class PluggedOptions(MethodOptions):
    prefix = "plugged"
    boost: float = option(2.0, "noise boost", low=1.0)


class PluggedStrategy(LocalDPStrategy):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.z *= cfg.options_of(PluggedOptions).boost


def train_plugged(msg, env: ClientEnv):
    from protocols.prg import gaussian

    z = env.cfg.options_of(PluggedOptions).boost * ldp_noise_multiplier(env.cfg)
    at_least("noise-multiplier", LocalDpNoise.from_config(msg.content["config"]).multiplier, z)
    global_w, local_w, loss, frac = record_level_training(msg, env)
    flat = flatten(local_w)
    noisy = flat + gaussian(os.urandom(32), len(flat), z * record_sensitivity(env.cfg, len(env.y)))
    return reply(msg, to_record(unflatten(noisy, global_w)), len(env.y), train_loss=loss, **release(msg, env, GaussianEvent(z)))


assert issubclass(PluggedStrategy, CancelStrategy)
register(MethodSpec("plugged", PluggedStrategy, train_plugged, options=(PluggedOptions,),
                    privacy=Guarantee("record", "the server", "anyone")))
'''

#: The one-module card for a run under Flower's simulation runtime: its client refuses a noise multiplier other
#: than its own ``plugged-boost`` times ldp's, and its strategy reports the boost it runs with (summary.json), so a
#: run that completes shows the key's value on both ends.
SIM_CARD = ONE_MODULE_CARD.replace(
    "    at_least(", "    assert abs(LocalDpNoise.from_config(msg.content['config']).multiplier - z) < 1e-9 * z, 'boost'\n"
    "    at_least(").replace(
    "        self.z *= cfg.options_of(PluggedOptions).boost\n",
    "        self.z *= cfg.options_of(PluggedOptions).boost\n\n"
    "    def describe(self):\n"
    "        return {**super().describe(), 'plugged_boost': self.cfg.options_of(PluggedOptions).boost}\n")

PROBE = '''
import json
from protocols.config import RunConfig
from protocols.methods import method_names, method_spec
cfg = RunConfig.from_mapping({"method": "plugged", "plugged-boost": 3.0})
print(json.dumps({"names": list(method_names()), "boost": cfg.plugged_boost,
                  "strategy": method_spec("plugged").load(method_spec("plugged").strategy).__name__}))
'''


def _plugin(tmp_path: Path, card: str) -> dict[str, str]:
    """A folder holding an 'installed' plugin package; the environment of an interpreter that sees it."""
    (tmp_path / "myplugin_card.py").write_text(card)
    info = tmp_path / "myplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nplugged = myplugin_card\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_an_installed_packages_card_registers_its_method_in_every_process(tmp_path):
    out = _run(PROBE, _plugin(tmp_path, CARD))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["names"][-1] == "plugged" and "nadp" in got["names"]
    assert got["boost"] == 3.0 and got["strategy"] == "LocalDPStrategy"


@pytest.mark.parametrize("first", ["protocols.config", "protocols.methods", "strategies", "strategies.base",
                                   "client.app", "server.launch"])
def test_a_card_importing_the_projects_strategies_and_client_loads_whatever_is_imported_first(tmp_path, first):
    """A plugin card is imported once the project's modules it needs are whole, whichever the process imports first."""
    probe = f"import warnings\nwarnings.simplefilter('error', UserWarning)\nimport {first}\n" + PROBE
    out = _run(probe, _plugin(tmp_path, ONE_MODULE_CARD))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "plugged" in got["names"] and got["boost"] == 3.0 and got["strategy"] == "PluggedStrategy"


def test_a_broken_plugin_warns_and_leaves_the_other_methods(tmp_path):
    code = "from protocols.methods import method_names; print(','.join(method_names()))"
    out = _run(code, _plugin(tmp_path, "raise RuntimeError('broken card')\n"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "nadp" in out.stdout and "plugged" not in out.stdout
    assert "myplugin_card" in out.stderr and "broken card" in out.stderr


def test_an_unknown_method_names_how_a_method_is_registered():
    with pytest.raises(ConfigError, match="cancelfl.methods' entry point"):
        RunConfig.from_mapping({"method": "plugged"})


@pytest.mark.slow
def test_a_plugins_own_key_runs_under_flowers_simulation_runtime(tmp_path):
    """``cancelfl run --engine simulation`` with a plugin's key: both the ServerApp and the ClientApps act on it.

    Flower's runtime takes only the keys cancelfl's pyproject declares: the key rides in ``method-options``.
    """
    from protocols.floor import ldp_noise_multiplier

    (tmp_path / "plugin").mkdir()
    env = _plugin(tmp_path / "plugin", SIM_CARD)
    out = tmp_path / "run"
    keys = {"num-clients": 3, "num-rounds": 2, "local-epochs": 1, "batch-size": 1_000_000, "lr": 4.0, "hidden": "",
            "dataset": "digits", "train-subset": 300, "test-subset": 100, "epsilon": 4.0, "out-dir": str(out)}
    run_config = " ".join(f"{k}={json.dumps(v)}" for k, v in keys.items())
    proc = subprocess.run([sys.executable, "-m", "server.launch", "run", "--engine", "simulation",
                           "--run-config", f'method="plugged" plugged-boost=4.0 {run_config}'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and not any(r["failed"] for r in rows)
    assert summary["config"]["plugged-boost"] == 4.0 and summary["method_parameters"]["plugged_boost"] == 4.0
    base = ldp_noise_multiplier(RunConfig.from_mapping({**keys, "method": "ldp", "out-dir": ""}))
    assert summary["method_parameters"]["noise_multiplier"] == pytest.approx(4.0 * base)
