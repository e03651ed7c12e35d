"""A node's partition read back from its data cache equals the partition loaded and split from the dataset."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from client.env import ClientEnv
from protocols.config import RunConfig
from protocols.task import data
from protocols.task.data import client_partition
from protocols.task.partition_cache import CACHE_ENV, cache_folder, local_data, partition_key
from server.defaults import app_defaults


def _cfg(**over) -> RunConfig:
    return RunConfig.from_mapping({**app_defaults(), "dataset": "digits", "num-clients": 5, **over})


def _cold(monkeypatch) -> None:
    """As in a fresh process that must not load or split the dataset: the loaders fail if called."""
    data.load_dataset.cache_clear()
    data.partition_indices.cache_clear()

    def refuse(*_a, **_k):
        raise AssertionError("the dataset was loaded although the cache holds the partition")
    monkeypatch.setattr(data, "load_dataset", refuse)
    monkeypatch.setattr(data, "partition_indices", refuse)


def test_a_cached_partition_is_read_back_exactly_without_loading_the_dataset(tmp_path, monkeypatch):
    cfg = _cfg(seed=7, partitioning="dirichlet")
    want_x, want_y = client_partition(cfg, 3, 5)
    first = local_data(cfg, 3, 5, tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    _cold(monkeypatch)
    features, y, classes, shape = local_data(cfg, 3, 5, tmp_path)
    x = features()
    assert np.array_equal(x, want_x) and x.dtype == want_x.dtype
    assert np.array_equal(y, want_y) and y.dtype == want_y.dtype
    assert (classes, shape) == (first[2], first[3]) == (10, (1, 8, 8))


def test_the_key_follows_every_setting_the_partition_depends_on():
    base = _cfg()
    key = partition_key(base, 0, 5)
    assert partition_key(_cfg(), 0, 5) == key
    others = [partition_key(base, 1, 5), partition_key(base, 0, 6), partition_key(_cfg(seed=1), 0, 5),
              partition_key(_cfg(partitioning="size-skew"), 0, 5), partition_key(_cfg(**{"input-centering": True}), 0, 5),
              partition_key(_cfg(**{"train-subset": 500}), 0, 5), partition_key(_cfg(dataset="breast-cancer"), 0, 5)]
    assert key not in others and len(set(others)) == len(others)


def test_a_corrupt_entry_is_rebuilt(tmp_path):
    cfg = _cfg()
    local_data(cfg, 2, 5, tmp_path)
    entry = tmp_path / partition_key(cfg, 2, 5)
    (entry / "y.npy").write_bytes(b"not a numpy file")
    x, y, _, _ = local_data(cfg, 2, 5, tmp_path)
    want_x, want_y = client_partition(cfg, 2, 5)
    assert np.array_equal(x, want_x) and np.array_equal(y, want_y)
    assert np.array_equal(np.load(entry / "y.npy"), want_y)  # rewritten


def test_features_that_do_not_match_their_labels_are_refused(tmp_path):
    cfg = _cfg()
    local_data(cfg, 0, 5, tmp_path)
    entry = tmp_path / partition_key(cfg, 0, 5)
    np.save(entry / "x.npy", np.zeros((3, 1, 8, 8), dtype=np.float32))
    features, *_ = local_data(cfg, 0, 5, tmp_path)
    with pytest.raises(ValueError, match="delete it"):
        features()


def test_only_builtin_datasets_are_kept():
    assert partition_key(_cfg(dataset="hub:ylecun/mnist"), 0, 5) is None


def test_the_folder_comes_from_the_node_config_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_folder({}) == tmp_path / "env"
    assert cache_folder({"data-cache": str(tmp_path / "node")}) == tmp_path / "node"
    assert cache_folder({"data-cache": "off"}) is None
    monkeypatch.setenv(CACHE_ENV, "off")
    assert cache_folder({}) is None


def test_a_client_message_reads_its_partition_through_the_nodes_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    raw = {**app_defaults(), "dataset": "digits", "num-clients": 4}
    ctx = Context(run_id=1, node_id=11, node_config={"partition-id": 1, "num-partitions": 4,
                                                     "data-cache": str(tmp_path)},
                  state=RecordDict(), run_config=raw)
    want_x, want_y = client_partition(RunConfig.from_mapping(raw), 1, 4)
    assert np.array_equal(ClientEnv.from_context(ctx).x, want_x)
    _cold(monkeypatch)
    env = ClientEnv.from_context(ctx)
    assert np.array_equal(env.x, want_x) and np.array_equal(env.y, want_y) and env.num_classes == 10


def test_a_readable_entry_another_process_stored_is_kept(tmp_path):
    from protocols.task.partition_cache import _write

    cfg = _cfg()
    local_data(cfg, 1, 5, tmp_path)
    entry = tmp_path / partition_key(cfg, 1, 5)
    before = np.load(entry / "x.npy")
    _write(entry, np.zeros_like(before), np.zeros(len(before), dtype=np.int64), 10, (1, 8, 8))
    assert np.array_equal(np.load(entry / "x.npy"), before)
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # no temporary folder left behind
