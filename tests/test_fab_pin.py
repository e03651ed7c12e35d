"""Node config ``trusted-fab``: a SuperNode runs only the app code its operator pinned (server/fab_pin.py).

The end-to-end test submits this project's app with ``flwr run`` to real SuperNodes (``cancelfl-supernode``)
that pin another FAB, then the right one: the first refuse every message, the second train.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from protocols.node_config import TRUSTED_FAB, check_node_config, trusted_fabs
from server.defaults import APP_DIR
from server.fab_pin import TRUSTED_APP_ENV, UntrustedFab, check_fab, fab_hash

OTHER = hashlib.sha256(b"an app this node never reviewed").hexdigest()


def test_the_pin_lists_sha256_digests() -> None:
    a, b = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    assert trusted_fabs({}) is None
    assert trusted_fabs({TRUSTED_FAB: f"{a},{b.upper()}"}) == {a, b}
    assert trusted_fabs({TRUSTED_FAB: f" {a} "}) == {a}
    for bad in ("", "abc", a[:-1], a + "0", "g" * 64, f"{a},xyz"):
        with pytest.raises(ValueError, match="trusted-fab"):
            trusted_fabs({TRUSTED_FAB: bad})
    check_node_config({TRUSTED_FAB: a})  # a key the node reads
    with pytest.raises(ValueError, match="did you mean 'trusted-fab'"):
        check_node_config({"trusted_fab": a})


def test_only_a_pinned_fab_named_by_its_own_hash_passes() -> None:
    content = b"the bytes of a FAB"
    digest = hashlib.sha256(content).hexdigest()
    check_fab(content, digest, {})  # no pin: any FAB
    check_fab(content, digest, {TRUSTED_FAB: f"{OTHER},{digest}"})
    with pytest.raises(UntrustedFab, match=digest):
        check_fab(content, digest, {TRUSTED_FAB: OTHER})
    with pytest.raises(UntrustedFab):  # named by a pinned hash, other bytes: Flower would load the pinned install
        check_fab(content, OTHER, {TRUSTED_FAB: f"{OTHER},{digest}"})


def test_cancelfl_supernode_refuses_a_malformed_pin_before_starting_anything() -> None:
    from server.supernode import check_node_config_arg

    with pytest.raises(SystemExit, match="trusted-fab"):
        check_node_config_arg(["--insecure", "--node-config", 'partition-id=0 num-partitions=1 trusted-fab="abc"'])
    check_node_config_arg(["--insecure", "--node-config", f'partition-id=0 num-partitions=1 trusted-fab="{OTHER}"'])


def test_a_pinned_node_refuses_a_model_import_path_outside_its_app(tmp_path, monkeypatch) -> None:
    """The server names run-config ``model``; a node pinning its app imports only the app's own packages."""
    from strategies.registry import build_strategy
    from tests.test_privacy_floor import setup, train_round

    (tmp_path / "outside_models.py").write_text("from tests.test_library_api import TinyNet  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for path, pin, refused in (("outside_models:TinyNet", {TRUSTED_FAB: OTHER}, True),
                               ("outside_models:TinyNet", {}, False),
                               ("tests.test_library_api:TinyNet", {TRUSTED_FAB: OTHER}, False)):
        cfg, grid = setup("ldp", node_config=pin, dataset="digits", model=path, hidden="")
        replies = train_round(build_strategy(cfg), cfg, grid)
        assert replies
        for r in replies:
            if refused:
                assert r.has_error() and "outside this node's pinned app" in r.error.reason, r
            else:
                assert not r.has_error(), r.error.reason


@pytest.mark.deployment
@pytest.mark.slow
@pytest.mark.parametrize("warm", ["1", "0"])  # the warm ClientApp's children, and a flwr-clientapp per message
def test_a_supernode_runs_only_the_fab_its_node_config_pins(tmp_path, capsys, monkeypatch, warm) -> None:
    """Another FAB pinned: every message refused; the app's own FAB pinned (by hash, or by its folder): trained."""
    from server.deploy import LocalCluster

    monkeypatch.setenv("CANCELFL_WARM_CLIENTAPP", warm)
    run = {"method": "fedavg", "dataset": "digits", "num-rounds": 1, "round-timeout": 120.0}
    right = fab_hash(APP_DIR)  # what `flwr run` builds of this app (reproducible)
    own = {TRUSTED_FAB: right} if warm == "0" else {}
    for node_config, trusted_app, trains in (({TRUSTED_FAB: OTHER}, None, False), (own, str(APP_DIR), True)):
        if trusted_app and not own:
            monkeypatch.setenv(TRUSTED_APP_ENV, trusted_app)  # cancelfl-supernode pins the FAB of its own app
        with LocalCluster(2, node_config=node_config) as cluster:
            out = tmp_path / ("trained" if trains else "refused")
            code = cluster.submit({**run, "out-dir": str(out)}, timeout=600)
        monkeypatch.delenv(TRUSTED_APP_ENV, raising=False)
        said = capsys.readouterr().out
        if trains:
            assert code == 0 and json.loads((out / "summary.json").read_text())["final_accuracy"] > 0.3
            assert "UntrustedFab" not in said
        else:
            assert code != 0, "nodes pinning another FAB trained"
            # Each node answered with the refusal, naming the run's FAB and its pin (the ServerApp logs it).
            assert said.count(f"UntrustedFab'>:<'the run's FAB {right} is not one") == 2, said


def test_cancelfl_supernode_pins_its_own_app_into_the_node_config() -> None:
    from server.fab_pin import pin_own_app

    digest = fab_hash(APP_DIR)
    entry = f'{TRUSTED_FAB}="{digest}"'
    args, pinned = pin_own_app(["--insecure", "--node-config", "partition-id=0"], APP_DIR)
    assert pinned == digest and args[-1] == f"partition-id=0 {entry}"
    assert pin_own_app(["--node-config=partition-id=0"], APP_DIR)[0] == [f"--node-config=partition-id=0 {entry}"]
    assert pin_own_app(["--insecure"], APP_DIR)[0] == ["--insecure", "--node-config", entry]
    with pytest.raises(ValueError, match="set one"):
        pin_own_app(["--node-config", f"{TRUSTED_FAB}=\"{OTHER}\""], APP_DIR)
    # a value that merely mentions the key is no pin of its own
    note = 'note="see trusted-fab"'
    assert pin_own_app(["--node-config", note], APP_DIR)[0] == ["--node-config", f"{note} {entry}"]
