"""Datasets and partitioning.

Offline sources: scikit-learn's bundled ``load_digits`` (8x8 images) and
``load_breast_cancer`` (30 tabular features), and MNIST-style IDX gzip folders
(``mnist``, ``fashion-mnist``) found under ``data-dir``.  ``hub:<name>`` loads a
Hugging Face dataset through flwr-datasets for users who have a network (never
used by the tests).

Partitioning uses flwr-datasets partitioners over an index dataset, so every
process (simulation worker, SuperNode, container) recomputes exactly the same
split from ``(seed, num-partitions)`` and picks its own slice by partition id.
"""

from __future__ import annotations

import gzip
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from protocols.config import ConfigError, RunConfig

IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


@dataclass(frozen=True)
class Dataset:
    """A train/test split as float32 features and int64 labels.

    ``x`` is (N, C, H, W) for images and (N, D) for tabular data.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample."""
        return tuple(self.x_train.shape[1:])


def _data_dir_candidates(data_dir: str) -> list[Path]:
    if data_dir:
        return [Path(data_dir)]
    here = Path(__file__).resolve().parents[2]  # the repository root
    env = os.environ.get("CANCELFL_DATA_DIR")
    cands = [Path(env)] if env else []
    return [*cands, here / "data", here.parent / "shared" / "data", Path.cwd() / "data",
            Path.cwd().parent / "shared" / "data", Path("/work/shared/data")]


def find_idx_folder(dataset: str, data_dir: str) -> Path:
    """Locate the folder holding ``dataset``'s four IDX files, or raise clearly."""
    needed = [f for pair in IDX_FILES.values() for f in pair]
    tried = []
    for root in _data_dir_candidates(data_dir):
        for folder in (root / dataset, root):
            tried.append(str(folder))
            if all((folder / f).is_file() for f in needed):
                return folder
    raise ConfigError(
        f"dataset '{dataset}': IDX files ({', '.join(needed)}) not found; tried {', '.join(tried)}. "
        "Set run-config 'data-dir' to the folder that holds them (or its parent)."
    )


def read_idx(path: Path) -> np.ndarray:
    """Read one gzip IDX file (images uint8 N x H x W or labels uint8 N)."""
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except (gzip.BadGzipFile, EOFError, OSError) as err:
        raise ValueError(f"{path}: not a complete gzip file ({err}); re-copy the IDX .gz files") from err
    if len(raw) < 4:
        raise ValueError(f"{path}: truncated IDX file ({len(raw)} bytes, no header)")
    magic = int.from_bytes(raw[:4], "big")
    ndim = magic & 0xFF
    if magic >> 8 != 0x08 or not 1 <= ndim <= 4:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {magic:#010x})")
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes for {ndim} dimensions)")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, file holds {data.size} bytes")
    return data.reshape(dims)


def _load_idx(name: str, data_dir: str) -> Dataset:
    folder = find_idx_folder(name, data_dir)
    out = {}
    for split, (img, lab) in IDX_FILES.items():
        x = read_idx(folder / img).astype(np.float32) / 255.0
        # Standard MNIST normalisation keeps inputs centred for SGD.
        x = (x - 0.1307) / 0.3081 if name == "mnist" else (x - 0.2860) / 0.3530
        y = read_idx(folder / lab).astype(np.int64)
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"dataset '{name}' in {folder}: {split} images {img} ({x.shape}) and labels {lab} "
                             f"({y.shape}) do not match (one image of H x W per label)")
        out[split] = (x[:, None, :, :], y)
    return Dataset(name, *out["train"], *out["test"], num_classes=10)


def _load_sklearn(name: str, seed: int) -> Dataset:
    from sklearn.datasets import load_breast_cancer, load_digits
    from sklearn.model_selection import train_test_split

    if name == "digits":
        bunch = load_digits()
        x = (bunch.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    else:
        bunch = load_breast_cancer()
        x = bunch.data.astype(np.float32)
    y = bunch.target.astype(np.int64)
    # A fixed split (seed 0) so the test set never depends on the run seed.
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    if name == "breast-cancer":  # standardise with training statistics only
        mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-8
        x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
    return Dataset(name, x_tr, y_tr, x_te, y_te, num_classes=int(y.max()) + 1)


def _load_hub(name: str) -> Dataset:  # pragma: no cover - needs network
    from flwr_datasets import FederatedDataset

    fds = FederatedDataset(dataset=name, partitioners={"train": 1})
    split = {}
    for part in ("train", "test"):
        ds = fds.load_split(part).with_format("numpy")
        img_key = next(k for k in ds.column_names if k in ("image", "img", "pixels"))
        lab_key = next(k for k in ds.column_names if k in ("label", "labels", "fine_label"))
        x = np.asarray(ds[img_key], dtype=np.float32) / 255.0
        x = x[:, None] if x.ndim == 3 else np.moveaxis(x, -1, 1)
        split[part] = (x, np.asarray(ds[lab_key], dtype=np.int64))
    return Dataset(name, *split["train"], *split["test"], num_classes=int(split["train"][1].max()) + 1)


def _load_user(path: str) -> Dataset:
    """A dataset from run-config ``dataset = "package.module:load"``.

    ``load()`` takes no arguments and returns ``(x_train, y_train, x_test, y_test)``: features as arrays of shape
    (N, ...) (images (N, C, H, W)), labels as integers 0..C-1 (or a :class:`Dataset`).  It must return the same
    data in every process: the server evaluates on the test split and every client takes its partition of the
    training split by ``partition-id``.
    """
    from protocols.task.models import import_object

    loaded = import_object(path, "dataset")()
    if isinstance(loaded, Dataset):
        return loaded
    try:
        x_tr, y_tr, x_te, y_te = loaded
    except (TypeError, ValueError) as err:
        raise ValueError(f"run-config 'dataset' = {path!r} must return (x_train, y_train, x_test, y_test)") from err
    x_tr, x_te = np.asarray(x_tr, dtype=np.float32), np.asarray(x_te, dtype=np.float32)
    y_tr, y_te = np.asarray(y_tr, dtype=np.int64), np.asarray(y_te, dtype=np.int64)
    if len(x_tr) != len(y_tr) or len(x_te) != len(y_te) or x_tr.shape[1:] != x_te.shape[1:]:
        raise ValueError(f"run-config 'dataset' = {path!r}: features and labels do not match "
                         f"(train {x_tr.shape} / {y_tr.shape}, test {x_te.shape} / {y_te.shape})")
    return Dataset(path, x_tr, y_tr, x_te, y_te, num_classes=int(max(y_tr.max(), y_te.max())) + 1)


def center_images(x: np.ndarray) -> np.ndarray:
    """Each image (N, C, H, W) minus its own mean pixel value; other inputs unchanged (run-config input-centering).

    A function of one record alone (no statistic of the dataset), so it costs no privacy and needs no
    coordination: every client and the server's evaluation apply it to their own records.  Tabular features are
    left as loaded: a row's mean over unrelated features means nothing.
    """
    if x.ndim != 4:
        return x
    return (x - x.mean(axis=(1, 2, 3), keepdims=True)).astype(x.dtype, copy=False)


#: The datasets read from IDX files under run-config ``data-dir`` (:func:`find_idx_folder`); no other reads it.
IDX_DATASETS = ("mnist", "fashion-mnist")


@lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", train_subset: int = 0, test_subset: int = 0,
                 center: bool = False) -> Dataset:
    """Load a dataset by run-config name (cached per process); ``center``: :func:`center_images`.

    ``train_subset``: the first N training records (0 = all; more than the split holds: ``ConfigError``);
    ``test_subset``: at most the first N test records (0 = all).
    """
    if name in ("digits", "breast-cancer"):
        ds = _load_sklearn(name, 0)
    elif name in IDX_DATASETS:
        ds = _load_idx(name, data_dir)
    elif name.startswith("hub:"):
        ds = _load_hub(name[4:])
    elif ":" in name:
        ds = _load_user(name)
    else:
        raise ConfigError(f"unknown dataset {name!r}")
    if train_subset > len(ds.y_train):  # test-subset only caps the evaluation: "at most"
        raise ConfigError(f"run-config 'train-subset' = {train_subset} is more than the {len(ds.y_train)} records of "
                          f"dataset {name!r}'s training split: set it to at most {len(ds.y_train)} (0 = all)")
    if train_subset or test_subset:
        ntr = train_subset or len(ds.y_train)
        nte = test_subset or len(ds.y_test)
        ds = Dataset(ds.name, ds.x_train[:ntr], ds.y_train[:ntr], ds.x_test[:nte], ds.y_test[:nte], ds.num_classes)
    if center:
        ds = Dataset(ds.name, center_images(ds.x_train), ds.y_train, center_images(ds.x_test), ds.y_test,
                     ds.num_classes)
    return ds


def dataset_for(cfg: RunConfig) -> Dataset:
    """The dataset a run config names, each image centred on its own mean if ``input-centering``."""
    return load_dataset(cfg.dataset, cfg.data_dir, cfg.train_subset, cfg.test_subset, cfg.input_centering)


def _linear_sizes(num_records: int, num_partitions: int) -> np.ndarray:
    """Partition sizes of flwr-datasets' ``LinearPartitioner`` (client i gets ~ i / sum of 1..n of the records)."""
    units = np.linspace(start=1, stop=num_partitions, num=num_partitions)
    sizes = np.array(units / units.sum() * num_records, dtype=np.int64)
    sizes[-1] += num_records - sizes.sum()
    return sizes


def max_partitions(num_records: int, scheme: str) -> int:
    """The most clients ``scheme`` can split ``num_records`` records into, each client getting at least one.

    ``iid`` and ``dirichlet``: one record per client (a Dirichlet split may need fewer clients still: its draws
    must give every client its minimum, see :func:`partition_indices`).  ``size-skew``: client ``i`` of ``n``
    gets about ``i / (n (n + 1) / 2)`` of the records, rounded down, so ``n (n + 1) / 2 <= num_records`` roughly.
    """
    if scheme != "size-skew" or num_records < 1:
        return max(num_records, 0)
    n = math.isqrt(2 * num_records) + 1
    while n > 1 and _linear_sizes(num_records, n).min() < 1:
        n -= 1
    return n


def partitions_for(cfg: RunConfig) -> tuple[np.ndarray, ...]:
    """Indices of every client's training records for ``cfg`` (:func:`partition_indices`).

    Raises:
        ConfigError: naming 'num-clients', the dataset and the most clients it can serve, when some client
            would get no record; or the Dirichlet split's own refusal (:func:`partition_indices`).
    """
    ds = dataset_for(cfg)
    records = len(ds.y_train)
    most = max_partitions(records, cfg.partitioning)
    if cfg.num_clients > most:
        where = f"dataset {cfg.dataset!r} has {records} training records" + (
            f" (run-config 'train-subset' = {cfg.train_subset})" if cfg.train_subset else "")
        how = (f"'partitioning' = 'size-skew' gives client i of n about i / (n (n + 1) / 2) of them, so at most "
               f"{most} clients get a record; lower 'num-clients' to {most} or use 'partitioning' = 'iid' (at most "
               f"{records})" if cfg.partitioning == "size-skew"
               else f"at most {most} clients get a record each; lower 'num-clients' to {most} or fewer")
        raise ConfigError(f"run-config 'num-clients' = {cfg.num_clients} leaves clients without training data: "
                          f"{where}; {how}")
    idx = partition_indices(ds.y_train.tobytes(), cfg.num_clients, cfg.partitioning, cfg.dirichlet_alpha, cfg.seed)
    empty = [i for i, part in enumerate(idx) if len(part) == 0]
    if empty:
        raise ConfigError(f"run-config 'num-clients' = {cfg.num_clients} with 'partitioning' = {cfg.partitioning!r} "
                          f"leaves {len(empty)} client(s) without training records (partition ids {empty[:5]}); "
                          "lower 'num-clients'")
    return idx


@lru_cache(maxsize=8)
def partition_indices(labels_key: bytes, num_partitions: int, scheme: str, alpha: float,
                      seed: int) -> tuple[np.ndarray, ...]:
    """Indices of every partition (deterministic in all arguments).

    ``labels_key`` is the label vector as bytes (hashable for the cache).
    """
    from datasets import Dataset as HFDataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, LinearPartitioner

    labels = np.frombuffer(labels_key, dtype=np.int64)
    if num_partitions > (most := max_partitions(len(labels), scheme)):
        raise ConfigError(f"run-config 'num-clients' = {num_partitions}: {scheme} partitioning of the {len(labels)} "
                          f"training records gives at most {most} clients a record each; lower 'num-clients'")
    # Shuffle once with the run seed so contiguous partitioners see random order.
    order = np.random.default_rng(seed).permutation(len(labels))
    index_ds = HFDataset.from_dict({"idx": order, "label": labels[order]})
    if scheme == "iid":
        part = IidPartitioner(num_partitions=num_partitions)
    elif scheme == "dirichlet":
        min_size = max(1, min(10, len(labels) // (4 * num_partitions)))
        part = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                    min_partition_size=min_size, self_balancing=True, seed=seed)
    elif scheme == "size-skew":
        part = LinearPartitioner(num_partitions=num_partitions)
    else:
        raise ConfigError(f"run-config 'partitioning' = {scheme!r}; choose iid, dirichlet or size-skew")
    part.dataset = index_ds
    try:
        with warnings.catch_warnings():  # flwr-datasets warns on every failed Dirichlet draw; the error below says it
            warnings.simplefilter("ignore", UserWarning)
            return tuple(np.asarray(part.load_partition(i)["idx"], dtype=np.int64) for i in range(num_partitions))
    except ValueError as err:  # flwr-datasets: Dirichlet draws never gave every client its minimum
        if scheme == "size-skew":  # an empty client (max_partitions refuses it first)
            raise ConfigError(f"run-config 'num-clients' = {num_partitions} with 'partitioning' = 'size-skew' leaves "
                              f"a client without training records (flwr-datasets: {err}); lower 'num-clients'") from err
        if scheme != "dirichlet":
            raise
        raise ConfigError(
            f"run-config 'partitioning' = 'dirichlet' with 'dirichlet-alpha' = {alpha} cannot give each of the "
            f"{num_partitions} clients at least {min_size} of the {len(labels)} training records (flwr-datasets: "
            f"{err}); raise 'dirichlet-alpha' or lower 'num-clients'") from err


def client_partition(cfg: RunConfig, partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """Training features and labels of one client."""
    features, y = client_partition_lazy(cfg, partition_id, num_partitions)
    return features(), y


def client_partition_lazy(cfg: RunConfig, partition_id: int,
                          num_partitions: int) -> tuple[Callable[[], np.ndarray], np.ndarray]:
    """(a function returning the training features, the labels) of one client, as :func:`client_partition`.

    The labels are gathered at once; the features (a copy of the client's share of the dataset) only when the
    function is called, so a message that needs only the client's size (e.g. a key or share phase) skips the copy.
    Raises ConfigError for a partition id outside ``[0, num_partitions)``.
    """
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition-id {partition_id} outside [0, {num_partitions})")
    ds = dataset_for(cfg)
    idx = partition_indices(ds.y_train.tobytes(), num_partitions, cfg.partitioning, cfg.dirichlet_alpha, cfg.seed)
    mine = idx[partition_id]
    return (lambda: ds.x_train[mine]), ds.y_train[mine]
