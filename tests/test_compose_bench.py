"""The pure parts of the docker-compose engine (:mod:`benchmarks.compose`): no Docker engine is started."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import cli
from benchmarks.compose import (
    CONTAINER_CA,
    CONTAINER_SERVER_KEY,
    DDPSA_SERVERS,
    DOCKER_DIR,
    ComposeStack,
    DockerUnavailable,
    activated_nodes,
    compose_overrides,
    container_path,
    unavailable_reason,
)
from server.flower_commands import run_config_arg

ADDRESSES = [f"127.0.0.1:{20000 + i}" for i in range(DDPSA_SERVERS)]


def test_out_dir_maps_into_the_superlink_container(tmp_path):
    outputs = tmp_path / "runs"
    assert container_path(outputs / "fedavg-r0", outputs) == "/outputs/fedavg-r0"
    assert container_path(outputs / "a" / "b", outputs) == "/outputs/a/b"
    assert container_path(outputs, outputs) == "/outputs"
    with pytest.raises(ValueError):
        container_path(tmp_path / "elsewhere", outputs)  # the ServerApp could not write there


def test_a_run_config_without_intermediate_servers_gets_the_container_out_dir_and_the_node_count(tmp_path):
    outputs = tmp_path / "runs"
    ov = {"method": "nadp", "dataset": "digits", "num-clients": 10, "hidden": "64", "epsilon": 1.0,
          "out-dir": str(outputs / "nadp-r1")}
    out = compose_overrides(ov, outputs=outputs, supernodes=4, ddpsa_addresses=ADDRESSES)
    assert out["out-dir"] == "/outputs/nadp-r1" and out["num-clients"] == 4
    assert not {"ddpsa-servers", "ddpsa-ca", "ddpsa-server-key"} & set(out)
    assert ov["out-dir"] == str(outputs / "nadp-r1")  # the caller's dict is left alone
    assert 'out-dir="/outputs/nadp-r1"' in run_config_arg(out) and 'hidden="64"' in run_config_arg(out)


def test_ddpsa_gets_the_compose_servers_its_card_asks_for_with_the_deployment_ca_and_key(tmp_path):
    outputs = tmp_path / "runs"
    ov = {"method": "ddpsa", "dataset": "digits", "out-dir": str(outputs / "ddpsa-r0")}
    out = compose_overrides(ov, outputs=outputs, supernodes=4, ddpsa_addresses=ADDRESSES)
    assert out["ddpsa-servers"] == ",".join(ADDRESSES)
    assert (out["ddpsa-ca"], out["ddpsa-server-key"]) == (CONTAINER_CA, CONTAINER_SERVER_KEY)
    with pytest.raises(ValueError, match="needs 4 intermediate servers"):
        compose_overrides({**ov, "ddpsa-num-servers": 4}, outputs=outputs, supernodes=4, ddpsa_addresses=ADDRESSES)


def test_the_compose_file_has_the_servers_and_mounts_the_stack_relies_on():
    text = (DOCKER_DIR / "docker-compose.yml").read_text()
    assert sorted(set(re.findall(r"^  (ddpsa-\d+):", text, re.M))) == [f"ddpsa-{i}" for i in range(DDPSA_SERVERS)]
    assert "/outputs" in text and CONTAINER_SERVER_KEY in text and "/ca.crt:/certs/ca.crt:ro" in text


def test_activated_nodes_counts_the_superlinks_activations():
    log = ("superlink-1  | INFO :      [Fleet.ActivateNode] Activated node_id=123\n"
           "superlink-1  | INFO :      [Fleet.CreateNode] Created node_id=456\n"
           "superlink-1  | INFO :      [Fleet.ActivateNode] Activated node_id=456\n")
    assert activated_nodes(log) == 2 and activated_nodes("") == 0


def test_missing_tools_are_named_and_the_stack_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.delenv("CANCELFL_DOCKER_INSTALL", raising=False)
    env = {"CANCELFL_DOCKER_CACHE": str(tmp_path / "empty-cache")}  # no compose plugin there
    reason = unavailable_reason(env)
    assert reason is not None and ("needs root" in reason or "compose plugin" in reason)
    stack = ComposeStack(2, work=tmp_path / "work", say=lambda _m: None)
    stack.env.update(env)
    with pytest.raises(DockerUnavailable):
        stack.start()
    assert stack.env.get("DOCKERD_PID") is None  # no engine was started


def test_no_app_folder_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(DockerUnavailable, match="no Flower app"):
        ComposeStack(2, app_dir=tmp_path, work=tmp_path / "work", say=lambda _m: None).start()


def test_roundtime_takes_the_compose_engine():
    args = cli.build_parser(load=["roundtime"]).parse_args(["roundtime", "--engine", "compose", "--clients", "4"])
    assert (args.engine, args.clients) == ("compose", 4)
    assert Path(DOCKER_DIR / "ci" / "start_dockerd.sh").is_file()
