"""Datasets load offline and partitions are disjoint, complete and reproducible."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.config import ConfigError, RunConfig
from protocols.task.data import (
    client_partition,
    dataset_for,
    find_idx_folder,
    load_dataset,
    max_partitions,
    partition_indices,
    partitions_for,
)


def test_bundled_datasets():
    digits = load_dataset("digits")
    assert digits.x_train.shape[1:] == (1, 8, 8) and digits.num_classes == 10
    assert len(digits.y_train) + len(digits.y_test) == 1797
    bc = load_dataset("breast-cancer")
    assert bc.x_train.shape[1] == 30 and bc.num_classes == 2
    assert abs(float(bc.x_train.mean())) < 1e-5  # standardised with training statistics


def test_mnist_idx_folder():
    try:
        find_idx_folder("mnist", "")
    except ConfigError:
        pytest.skip("MNIST IDX files not present on this machine")
    ds = load_dataset("mnist", "", 0, 0)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(ds.y_test).tolist()[:3] == [980, 1135, 1032]  # official test-set class counts


def test_idx_search_starts_at_the_repository_data_folder(tmp_path, monkeypatch):
    """Without data-dir or CANCELFL_DATA_DIR, <repository root>/data is searched first."""
    from pathlib import Path

    monkeypatch.delenv("CANCELFL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parent.parent
    with pytest.raises(ConfigError) as err:
        find_idx_folder("no-such-dataset", "")
    assert f"tried {root / 'data' / 'no-such-dataset'}, {root / 'data'}," in str(err.value)


def test_missing_idx_folder_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="data-dir"):
        load_dataset("mnist", str(tmp_path), 0, 0)


def test_an_impossible_dirichlet_split_stops_the_run_before_round_1(run_inprocess):
    """dirichlet-alpha 0.05 over 20 clients: no draw gives every client its minimum.

    It used to fail every client in every round ("no participant sent a usable reply"); now the partitioning
    names the keys to change, and the server stops before the first round.
    """
    y = load_dataset("digits").y_train
    with pytest.raises(ConfigError, match="dirichlet-alpha"):
        partition_indices.__wrapped__(y.tobytes(), 20, "dirichlet", 0.05, 42)
    with pytest.raises(ConfigError, match="raise 'dirichlet-alpha' or lower 'num-clients'"):
        run_inprocess(method="fedavg", partitioning="dirichlet", dirichlet_alpha=0.05, num_clients=20, num_rounds=2)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "size-skew"])
def test_partitions_disjoint_complete_reproducible(scheme):
    y = load_dataset("digits").y_train
    parts = partition_indices(y.tobytes(), 10, scheme, 0.3, 7)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx)) == len(y)
    again = partition_indices.__wrapped__(y.tobytes(), 10, scheme, 0.3, 7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    sizes = [len(p) for p in parts]
    if scheme == "iid":
        assert max(sizes) - min(sizes) <= 1
    if scheme == "size-skew":
        assert sizes[-1] > 3 * sizes[0]
    if scheme == "dirichlet":  # label skew: some client's label histogram is far from uniform
        skew = max(np.bincount(y[p], minlength=10).max() / len(p) for p in parts)
        assert skew > 0.3


def test_client_partition_by_id():
    cfg = RunConfig(num_clients=5)
    x0, y0 = client_partition(cfg, 0, 5)
    x1, _ = client_partition(cfg, 1, 5)
    assert len(y0) > 0 and not np.array_equal(x0[:5], x1[:5])
    with pytest.raises(ConfigError):
        client_partition(cfg, 5, 5)
    assert dataset_for(cfg).name == "digits"


def _idx(path, dims: list[int], payload: bytes | None = None, magic: int = 0x08) -> None:
    import gzip

    head = ((magic << 8) | len(dims)).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    body = payload if payload is not None else bytes(int(np.prod(dims)))
    with gzip.open(path, "wb") as fh:
        fh.write(head + body)


def test_broken_idx_files_are_named_with_their_cause(tmp_path):
    from protocols.task.data import read_idx

    good = tmp_path / "good.gz"
    _idx(good, [2, 3])
    assert read_idx(good).shape == (2, 3)
    short = tmp_path / "short.gz"
    _idx(short, [2, 3], payload=bytes(5))
    with pytest.raises(ValueError, match="header says"):
        read_idx(short)
    plain = tmp_path / "plain.gz"
    plain.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="gzip"):
        read_idx(plain)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(good.read_bytes()[:-6])  # a truncated download
    with pytest.raises(ValueError, match="gzip|truncated|header"):
        read_idx(cut)
    wrong = tmp_path / "wrong.gz"
    _idx(wrong, [2], magic=0x0D)  # float IDX
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        read_idx(wrong)


def test_negative_seed_is_refused():
    with pytest.raises(ConfigError, match="'seed'"):
        RunConfig(seed=-1).validate()


def test_input_centering_is_per_record_and_only_for_images():
    """input-centering: each image minus its own mean (no dataset statistic), tabular data as loaded."""
    plain = dataset_for(RunConfig(dataset="digits"))
    centred = dataset_for(RunConfig(dataset="digits", input_centering=True))
    for x, xc in ((plain.x_train, centred.x_train), (plain.x_test, centred.x_test)):
        np.testing.assert_allclose(xc.mean(axis=(1, 2, 3)), 0.0, atol=1e-6)
        np.testing.assert_allclose(xc, x - x.mean(axis=(1, 2, 3), keepdims=True), rtol=0, atol=1e-6)
    # One record's transform does not depend on the others: a client's partition gives the same records.
    part = client_partition(RunConfig(dataset="digits", input_centering=True, num_clients=3), 1, 3)[0]
    np.testing.assert_allclose(part.mean(axis=(1, 2, 3)), 0.0, atol=1e-6)
    tab, tab_c = (dataset_for(RunConfig(dataset="breast-cancer", input_centering=c)) for c in (False, True))
    np.testing.assert_array_equal(tab.x_train, tab_c.x_train)


@pytest.mark.parametrize("scheme", ["iid", "size-skew"])
def test_max_partitions_is_the_most_clients_the_real_partitioner_gives_a_record(scheme):
    """At max_partitions every client of the real (flwr-datasets) split gets a record; one more is refused by name."""
    y = load_dataset("digits").y_train[:300]
    most = max_partitions(len(y), scheme)
    assert most == (300 if scheme == "iid" else 24)
    parts = partition_indices.__wrapped__(y.tobytes(), most, scheme, 0.5, 1)
    assert min(len(p) for p in parts) >= 1 and sum(len(p) for p in parts) == len(y)
    if scheme == "size-skew":  # flwr-datasets itself leaves a client empty at most + 1
        from datasets import Dataset as HFDataset
        from flwr_datasets.partitioner import LinearPartitioner

        part = LinearPartitioner(num_partitions=most + 1)
        part.dataset = HFDataset.from_dict({"idx": np.arange(len(y))})
        with pytest.raises(ValueError, match="not greater than 0"):
            part.load_partition(0)
    with pytest.raises(ConfigError, match=f"'num-clients' = {most + 1}.*at most {most} clients"):
        partition_indices.__wrapped__(y.tobytes(), most + 1, scheme, 0.5, 1)


def test_clients_without_records_are_refused_naming_the_dataset_maximum():
    """A size-skew split with empty clients names 'num-clients', the dataset, its records and the maximum."""
    cfg = RunConfig.from_mapping({"partitioning": "size-skew", "num-clients": 60})
    with pytest.raises(ConfigError) as err:
        partitions_for(cfg)
    msg = str(err.value)
    assert "'num-clients' = 60" in msg and "'digits' has 1437 training records" in msg and "to 53" in msg
    assert len(partitions_for(cfg.replace(num_clients=53))) == 53
    with pytest.raises(ConfigError, match="'num-clients' = 1438.*lower 'num-clients' to 1437"):
        partitions_for(RunConfig.from_mapping({"num-clients": 1438}))
