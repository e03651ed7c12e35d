"""The launcher refuses bad input before any process starts: exit code 2 and a message naming the key.

Run-config syntax, unreadable datasets, invalid settings, more clients than records or SuperNodes than memory
holds; settings the launcher adjusts are named at start.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from protocols.config import ConfigError, parse_run_config
from server.launch import main, preflight, run_inprocess


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


# ------------------------------------------------------------------ --run-config syntax
@pytest.mark.parametrize(("text", "needle"), [
    ("num-rounds=3 num-rounds=4", "'num-rounds' is given twice"),
    ("method=nadp", 'strings must be quoted, e.g. method="nadp"'),
    ("num-rounds=", "'num-rounds' has no value"),
    ('method="nadp', "no closing"),
    ("epochs", "'epochs' is not a key=value pair"),
    ("lr=1.2.3", "'lr' = 1.2.3 is not a number"),
])
def test_run_config_syntax_errors_name_the_key(text, needle):
    with pytest.raises(ConfigError, match=None) as err:
        parse_run_config(text)
    assert needle in str(err.value)


def test_run_config_syntax_accepts_flowers_forms():
    got = parse_run_config("""method="nadp" epsilon=1.0 hidden="" cancellation-check=true data-dir='/a b' seed=7""")
    assert got == {"method": "nadp", "epsilon": 1.0, "hidden": "", "cancellation-check": True, "data-dir": "/a b",
                   "seed": 7}


# ------------------------------------------------------------------ errors before any process starts
def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def _idx_folder(root: Path, defect: str) -> Path:
    folder = root / "mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("t10k", 20)):
        _write_idx(folder / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)))
        _write_idx(folder / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n - (defect == "mismatched")))
    images = folder / "train-images-idx3-ubyte.gz"
    if defect == "truncated":
        images.write_bytes(images.read_bytes()[:200])
    elif defect == "non-gzip":
        images.write_bytes(b"not gzip at all" * 10)
    return root


@pytest.mark.parametrize(("defect", "needle"), [
    ("truncated", "train-images-idx3-ubyte.gz"),
    ("non-gzip", "not a complete gzip file"),
    ("mismatched", "labels"),
])
def test_bad_idx_files_are_refused_before_any_process(tmp_path, capsys, monkeypatch, defect, needle):
    monkeypatch.setattr("server.deploy.run_simulation", lambda *a, **k: pytest.fail("a process was started"))
    data = _idx_folder(tmp_path / "data", defect)
    code, err = _cli(capsys, "run", "--engine", "simulation", "--run-config",
                     f'dataset="mnist" data-dir="{data}" out-dir="{tmp_path / "out"}"')
    assert code == 2 and needle in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("run_config", "needle"), [
    ("seed=-1", "'seed' = -1"),
    ("seed=9223372036854775808", "'seed' = 9223372036854775808 must be an integer in [0, 2^63 - 1]"),
    ('hidden="0"', "hidden=\"\" gives a linear model"),
    ('hidden="64,,32"', "'hidden' = '64,,32' must be comma-separated integers"),
    ('method="mpddp" num-clients=1', "at least 2 clients per round"),
    ("num-rounds=2 num-rounds=3", "given twice"),
    ('method=fedavg', "strings must be quoted"),
    ('method="ddpsa" num-clients=1', "at least 2 clients per round"),
    ("min-clients=11", "'min-clients' = 11 is above 'num-clients' = 10"),
    ('method="ddpsa" fault-drop-rate=0.2', "more than 'ddpsa-dropout-frac' = 0 lets a round lose"),
    # DDP-SA's own checks come before the intermediate servers the launcher starts later.
    ('method="ddpsa" epsilon=1e6', "'ddpsa-frac-bits' = 24 is too coarse"),
    ('method="ddpsa" epsilon=1e12', "the most it takes is 40: lower 'epsilon' or raise 'clip'"),
    ('method="ddpsa" ddpsa-num-servers=4 ddpsa-threshold=2 ddpsa-dropout-frac=0.3', "needs 'ddpsa-threshold' above half"),
])
def test_config_errors_before_any_process(tmp_path, capsys, monkeypatch, run_config, needle):
    monkeypatch.setattr("server.deploy.run_simulation", lambda *a, **k: pytest.fail("a process was started"))
    code, err = _cli(capsys, "run", "--engine", "simulation", "--run-config", run_config)
    assert code == 2 and needle in err, err


def _no_process(monkeypatch) -> None:
    """Fail the test if any engine starts: the in-process grid, the simulation or the deployment."""
    def started(*_a, **_k):
        pytest.fail("a run was started")

    monkeypatch.setattr("server.deploy.run_simulation", started)
    monkeypatch.setattr("server.deploy.run_deployment", started)
    monkeypatch.setattr("server.local_grid.LocalGrid.__init__", started)


@pytest.mark.parametrize("argv", [
    ("run",), ("run", "--engine", "simulation"), ("deploy",),
])
def test_more_clients_than_records_is_refused_at_once(tmp_path, capsys, monkeypatch, argv):
    """num-clients=100000 on digits (1437 records): refused naming the key and the maximum, on every engine."""
    _no_process(monkeypatch)
    code, err = _cli(capsys, *argv, "--run-config", f'num-clients=100000 out-dir="{tmp_path / "out"}"')
    assert code == 2 and "'num-clients' = 100000" in err and "lower 'num-clients' to 1437" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [("run",), ("run", "--engine", "simulation")])
def test_a_train_subset_larger_than_the_split_is_refused_at_once(tmp_path, capsys, monkeypatch, argv):
    """train-subset=5000 on digits (1437 training records): refused naming the split's size, not trained on 1437."""
    _no_process(monkeypatch)
    code, err = _cli(capsys, *argv, "--run-config", f'train-subset=5000 out-dir="{tmp_path / "out"}"')
    assert code == 2 and "'train-subset' = 5000 is more than the 1437 records" in err, err
    assert not (tmp_path / "out").exists()


def test_more_clients_than_records_is_refused_before_the_in_process_grid(monkeypatch):
    """The library call checks before making num-clients identities and contexts (where the time went)."""
    _no_process(monkeypatch)
    with pytest.raises(ConfigError, match="'num-clients' = 100000"):
        run_inprocess({"num-clients": 100000}, progress=lambda _s: None)


def test_size_skew_with_empty_clients_is_refused_at_start(tmp_path, capsys, monkeypatch):
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", 'partitioning="size-skew" num-clients=60 method="nadp"')
    assert code == 2 and "'num-clients' = 60" in err and "'size-skew'" in err and "to 53" in err, err


def refused_before_any_message(raw: dict, clients: int, match: str) -> None:
    """Submitted without the launcher (flwr run): the ServerApp refuses ``raw`` before it asks any node anything."""
    from flwr.app import Context, RecordDict

    from client.app import app as client_app
    from server.app import main as server_main
    from server.local_grid import LocalGrid

    class Counting(LocalGrid):
        sent = 0

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            self.sent += len(messages)
            return super().send_and_receive(messages, timeout=timeout)

    grid = Counting(client_app, clients, raw)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=raw)
    with pytest.raises(ConfigError, match=match):
        server_main(grid, context)
    assert grid.sent == 0


def test_size_skew_with_empty_clients_stops_the_serverapp_before_any_message(tmp_path):
    """The ServerApp refuses before any message and leaves the reason in the output folder."""
    from strategies.run.checkpoint import read_error

    (tmp_path / "out").mkdir()  # the launcher makes it (server.launch.choose_out_dir)
    raw = {"partitioning": "size-skew", "num-clients": 60, "out-dir": str(tmp_path / "out")}
    refused_before_any_message(raw, 2, "'num-clients' = 60")
    assert "'num-clients' = 60" in read_error(tmp_path / "out")


@pytest.mark.parametrize("run_config", ['method="nadp" num-clients=1', 'method="niss" num-clients=10 sample-rate=0.1'])
def test_one_client_per_round_is_refused_at_start(capsys, monkeypatch, run_config):
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", run_config)
    assert code == 2 and "needs at least 2 clients per round" in err and "'num-clients'" in err, err


def test_cuda_without_a_gpu_is_refused_at_start(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", 'device="cuda"')
    assert code == 2 and "run-config 'device' = 'cuda'" in err and "no CUDA device" in err, err


def test_zero_supernodes_is_an_argument_error(capsys, monkeypatch):
    _no_process(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        main(["deploy", "--supernodes", "0"])
    assert stop.value.code == 2 and "--supernodes" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "nodes", "warned"), [
    (["--supernodes", "3", "--run-config", "num-clients=5"], 3, True),  # the flag wins, and says so once
    (["--run-config", "num-clients=5"], 5, False),  # num-clients alone: that many SuperNodes
    (["--supernodes", "5", "--run-config", "num-clients=5"], 5, False),
    ([], 4, False),
])
def test_supernodes_and_num_clients(tmp_path, capsys, monkeypatch, argv, nodes, warned):
    seen: list[tuple[int, int]] = []

    def deployment(overrides, *, num_supernodes, **_):
        seen.append((num_supernodes, overrides["num-clients"]))
        return 0

    monkeypatch.setattr("server.deploy.run_deployment", deployment)
    if argv and argv[-2] == "--run-config":
        argv = [*argv[:-1], f'{argv[-1]} out-dir="{tmp_path / "out"}"']
    else:
        argv = [*argv, "--run-config", f'out-dir="{tmp_path / "out"}"']
    code, err = _cli(capsys, "deploy", *argv)
    assert code == 0 and seen == [(nodes, nodes)], err
    warnings = [line for line in err.splitlines() if "--supernodes" in line and "overrides" in line]
    assert warnings == (["cancelfl: warning: --supernodes 3 overrides run-config 'num-clients' = 5: the run has 3 "
                         "clients"] if warned else []), err


def test_more_supernodes_than_memory_holds_is_refused_at_start(tmp_path, capsys, monkeypatch):
    """``cancelfl deploy`` starts every SuperNode here: more than the available memory holds is refused, naming how many fit."""
    from server.deploy import SUPERNODE_IDLE_MB

    seen: list[int] = []
    monkeypatch.setattr("server.deploy.available_memory_mb", lambda: 7.5 * SUPERNODE_IDLE_MB)  # 7 idle SuperNodes fit
    monkeypatch.setattr("server.deploy.run_deployment", lambda o, *, num_supernodes, **_: seen.append(num_supernodes) or 0)
    code, err = _cli(capsys, "deploy", "--supernodes", "8", "--run-config", f'out-dir="{tmp_path / "a"}"')
    assert code == 2 and "--supernodes / run-config 'num-clients' = 8" in err and "at most 7 fit here" in err, err
    code, err = _cli(capsys, "deploy", "--run-config", f'num-clients=8 out-dir="{tmp_path / "b"}"')
    assert code == 2 and "at most 7 fit here" in err and seen == [], err
    assert _cli(capsys, "deploy", "--supernodes", "7", "--run-config", f'out-dir="{tmp_path / "c"}"')[0] == 0
    assert seen == [7]


def test_out_dir_that_cannot_be_created(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, err = _cli(capsys, "run", "--run-config", f'out-dir="{tmp_path / "afile" / "run"}"')
    assert code == 2 and "cannot be created" in err and "afile" in err, err


def test_adjusted_settings_are_named_at_start():
    notes: list[str] = []
    preflight({"method": "nadp", "graph": "n-out", "n-out": 3, "num-clients": 4, "num-rounds": 5}, warn=notes.append)
    assert any("'n-out' = 3" in n and "complete graph" in n for n in notes), notes


def test_keys_a_method_does_not_read_are_named_at_start():
    notes: list[str] = []
    preflight({"method": "mpddp", "local-epochs": 2, "batch-size": 32, "num-clients": 4, "num-rounds": 2},
              warn=notes.append)
    assert any("'mpddp' does not read run-config 'local-epochs' = 2, 'batch-size' = 32" in n for n in notes), notes


@pytest.mark.parametrize(("model", "needle"), [
    ("foo:bar", "run-config 'model' = 'foo:bar': cannot import 'bar' from 'foo'"),
    ("json:dumps", "run-config 'model' = 'json:dumps' could not be built for input shape (30,) and 2 classes"),
    ("json:JSONDecoder", "returned JSONDecoder, not a torch.nn.Module"),
])
def test_bad_model_import_path_is_refused_at_start(capsys, monkeypatch, model, needle):
    """A ``model`` that cannot be imported or built for the dataset: exit 2 naming the key, as a bad dataset."""
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", f'model="{model}" dataset="breast-cancer" num-rounds=1')
    assert code == 2 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize(("run_config", "needle"), [
    ("num-clients=3 dropout-rate=0.05", "up to 2 of 3 participants may drop"),
    ("num-clients=5 dropout-rate=0.2", "up to 4 of 5 participants may drop"),
    ("num-clients=9 sample-rate=0.4 dropout-rate=0.1", "up to 3 of 4 participants may drop"),
])
def test_niss_dropouts_that_remove_all_shares_are_refused_at_start(capsys, monkeypatch, run_config, needle):
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", f'method="niss" dataset="breast-cancer" num-rounds=2 {run_config}')
    assert code == 2 and needle in err and "'dropout-rate'" in err and "--resume" not in err, err


def test_niss_with_two_clients_per_round_is_refused_at_start_naming_the_keys(capsys, monkeypatch):
    _no_process(monkeypatch)
    code, err = _cli(capsys, "run", "--run-config", 'method="niss" num-clients=2 num-rounds=1')
    assert code == 2 and "niss needs 3 or more: set run-config 'num-clients' x 'sample-rate' >= 3" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_niss_dropout_rate_a_round_can_plan_stays_allowed():
    preflight({"method": "niss", "dataset": "breast-cancer", "num-clients": 10, "dropout-rate": 0.05}, warn=print)


@pytest.mark.parametrize(("raw", "needle"), [
    ({"method": "nadp", "clip": 1e308}, "clip = 1e+308"),
    ({"method": "niss", "clip": 1e308}, "clip = 1e+308"),
    ({"method": "ladp", "epsilon": 1e-300}, "epsilon = 1e-300"),
    ({"method": "ladp", "clip": 1e308}, "clip = 1e+308"),
])
def test_settings_no_calibration_can_meet_are_refused_at_start(raw, needle):
    """Extreme numbers: the method's calibration is tried at start and its failure is a ConfigError naming them."""
    with pytest.raises(ConfigError, match="cannot (plan|calibrate)") as err:
        preflight({"dataset": "breast-cancer", "num-clients": 4, "num-rounds": 1, **raw}, warn=print)
    assert needle in str(err.value)


@pytest.mark.parametrize(("failure", "hinted"), [
    (ConfigError("run-config 'clip' = 1: refused in round 1"), False),
    (ValueError("run-config 'dropout-rate' = 0.1: refused in round 1"), False),
    (RuntimeError("a crash"), True),
])
def test_resume_hint_only_where_resuming_can_help(tmp_path, capsys, monkeypatch, failure, hinted):
    """A round-1 failure the same config repeats gets no ``--resume`` hint; a crash keeps it."""
    def fail(*_a, **_k):
        raise failure

    monkeypatch.setattr("strategies.base.CancelStrategy.plan", fail)
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", "--run-config", f'dataset="breast-cancer" num-rounds=2 num-clients=2 out-dir="{out}"')
    assert code == 1 and str(failure) in err, err
    assert (f"continue it with: cancelfl run --resume {out}" in err) is hinted, err


# ------------------------------------------------------------------ the start notes: shown once on every engine
NOTED = {"method": "nadp", "graph": "n-out", "n-out": 3, "num-clients": 4, "num-rounds": 1, "dataset": "breast-cancer"}
NOTE = "'n-out' = 3 >= clients per round - 1"


def test_the_launchers_in_process_run_shows_each_start_note_once(tmp_path, capsys):
    """The launcher's preflight shows the notes; the run it starts (run_inprocess, checked) does not repeat them."""
    code, out = _cli(capsys, "run", "--run-config", 'method="nadp" graph="n-out" n-out=3 num-clients=4 num-rounds=1 '
                     f'dataset="breast-cancer" out-dir="{tmp_path / "o"}"')
    assert code == 0 and out.count(NOTE) == 1, out


def test_a_library_in_process_run_shows_the_start_notes_before_any_grid(tmp_path):
    class NoGrid(Exception):
        pass

    def no_grid(*_a):
        raise NoGrid

    lines: list[str] = []
    with pytest.raises(NoGrid):
        run_inprocess({**NOTED, "out-dir": str(tmp_path / "o")}, progress=lines.append, grid_factory=no_grid)
    assert [line for line in lines if NOTE in line and line.startswith("warning: ")], lines


@pytest.mark.parametrize("shown", [False, True])
def test_the_serverapp_logs_the_start_notes_unless_the_launcher_showed_them(tmp_path, monkeypatch, caplog, shown):
    """A plain ``flwr run`` gets them from the ServerApp; under ``cancelfl run``/``deploy`` the launcher showed them."""
    from flwr.app import Context, RecordDict

    from client.app import app as client_app
    from protocols.start_checks import START_NOTES_SHOWN_ENV
    from server.app import main as server_main
    from server.local_grid import LocalGrid

    class Silent(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            raise RuntimeError("stop before round 1")

    monkeypatch.setenv(START_NOTES_SHOWN_ENV, "1" if shown else "0")
    raw = {**NOTED, "out-dir": str(tmp_path)}
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=raw)
    with pytest.raises(RuntimeError, match="stop before round 1"):
        server_main(Silent(client_app, 4, raw), context)
    assert sum(NOTE in r.getMessage() for r in caplog.records) == (0 if shown else 1), caplog.text
