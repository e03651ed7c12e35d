"""Datasets load offline and partitions are disjoint, complete and reproducible."""

from __future__ import annotations

import numpy as np
import pytest

from client.data import client_partition, dataset_for, find_idx_folder, load_dataset, partition_indices
from protocols.config import ConfigError, RunConfig


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


def test_missing_idx_folder_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="data-dir"):
        load_dataset("mnist", str(tmp_path), 0, 0)


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
