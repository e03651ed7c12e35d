"""A node's own training partition kept on its disk, read in milliseconds by the next message's process.

In a deployment every message runs in a fresh ClientApp process, and :func:`protocols.task.data.client_partition`
loads and splits the whole dataset each time (seconds of CPU for MNIST).  :func:`local_data` keeps the
node's partition (its records only, as ``.npy`` files) in a folder the node names (node config ``data-cache``
or ``$CANCELFL_DATA_CACHE``; ``cancelfl-supernode`` sets the latter to its own temporary folder, removed when
it exits) and reads it back.

Only the built-in datasets are kept.  An entry is keyed by everything the partition depends on: the run
config's data settings, the partition id and count, the source files' size and modification time (MNIST-style
folders) or scikit-learn's version (its bundled sets), the versions of numpy and flwr-datasets, and this
package's data-loading source.  An unreadable entry is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path

import numpy as np

from protocols.config import DATASETS, RunConfig
from protocols.node_config import DATA_CACHE as CACHE_KEY

__all__ = ["CACHE_ENV", "CACHE_KEY", "cache_folder", "local_data", "partition_key"]

#: Environment variable naming the folder when node config ``data-cache`` does not (``off`` or empty: no cache).
CACHE_ENV = "CANCELFL_DATA_CACHE"
#: Datasets whose source this module can identify: the built-in ones.
BUILTIN = DATASETS

#: ``(features or a function reading them, labels, number of classes, input shape)``.
LocalData = tuple[np.ndarray | Callable[[], np.ndarray], np.ndarray, int, tuple[int, ...]]


def cache_folder(node_config: Mapping[str, object]) -> Path | None:
    """The node's cache folder: node config ``data-cache``, else ``$CANCELFL_DATA_CACHE``; None when unset or ``off``."""
    raw = node_config.get(CACHE_KEY, os.environ.get(CACHE_ENV, ""))
    raw = str(raw).strip()
    return None if raw in ("", "off") else Path(raw).expanduser()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def _source_identity(cfg: RunConfig) -> list:
    """What identifies the dataset's source: its files' names, sizes and times, or the library that bundles it."""
    from protocols.task import data

    if cfg.dataset in ("digits", "breast-cancer"):
        return ["sklearn", _version("scikit-learn")]
    folder = data.find_idx_folder(cfg.dataset, cfg.data_dir)
    files = []
    for pair in data.IDX_FILES.values():
        for name in pair:
            st = (folder / name).stat()
            files.append([str((folder / name).resolve()), st.st_size, st.st_mtime_ns])
    return files


def partition_key(cfg: RunConfig, partition_id: int, num_partitions: int) -> str | None:
    """A hex digest naming this partition's cache entry (None: the dataset is not a built-in one)."""
    from protocols.task import data

    if cfg.dataset not in BUILTIN:
        return None
    parts = {
        "dataset": cfg.dataset, "train-subset": cfg.train_subset, "test-subset": cfg.test_subset,
        "input-centering": cfg.input_centering, "partitioning": cfg.partitioning,
        "dirichlet-alpha": cfg.dirichlet_alpha, "seed": cfg.seed, "partition-id": partition_id,
        "num-partitions": num_partitions, "source": _source_identity(cfg),
        "numpy": np.__version__, "flwr-datasets": _version("flwr-datasets"),
        "code": hashlib.sha256(Path(data.__file__).read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _read(entry: Path) -> LocalData | None:
    """The entry's data (features read on first use), or None when it is missing or unreadable."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        y = np.load(entry / "y.npy", allow_pickle=False)
        num_classes, input_shape = int(meta["num_classes"]), tuple(int(s) for s in meta["input_shape"])
        if y.ndim != 1 or len(y) != int(meta["records"]) or not (entry / "x.npy").is_file():
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = entry / "x.npy"

    def features() -> np.ndarray:
        x = np.load(path, allow_pickle=False)
        if len(x) != len(y) or tuple(x.shape[1:]) != input_shape:
            raise ValueError(f"data cache entry {entry} holds {x.shape} features for {len(y)} labels of shape "
                             f"{input_shape}; delete it")
        return x
    return features, y, num_classes, input_shape


def _write(entry: Path, x: np.ndarray, y: np.ndarray, num_classes: int, input_shape: tuple[int, ...]) -> None:
    """Store an entry atomically; a readable entry already there (another process's) is kept."""
    entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        np.save(tmp / "x.npy", np.ascontiguousarray(x), allow_pickle=False)
        np.save(tmp / "y.npy", np.ascontiguousarray(y), allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps({"num_classes": num_classes, "input_shape": list(input_shape),
                                                   "records": len(y)}))
        if entry.exists():
            if _read(entry) is not None:
                return  # another process stored it first: keep that one (a reader may be using it)
            shutil.rmtree(entry, ignore_errors=True)  # unreadable: replace it
        os.replace(tmp, entry)
    except OSError:
        pass  # a cache: the data was loaded anyway
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def local_data(cfg: RunConfig, partition_id: int, num_partitions: int, folder: Path | None) -> LocalData:
    """The node's ``(features or a function reading them, labels, classes, input shape)``, through the cache.

    Without a folder or for a dataset not in :data:`BUILTIN`, the partition is loaded directly
    (:func:`protocols.task.data.client_partition_lazy`).  Raises as that function does.
    """
    from protocols.task.data import client_partition_lazy, dataset_for

    key = partition_key(cfg, partition_id, num_partitions) if folder is not None else None
    if key is not None and (hit := _read(folder / key)) is not None:
        return hit
    features, y = client_partition_lazy(cfg, partition_id, num_partitions)
    ds = dataset_for(cfg)
    if key is None:
        return features, y, ds.num_classes, ds.input_shape
    x = features()
    _write(folder / key, x, y, ds.num_classes, ds.input_shape)
    return x, y, ds.num_classes, ds.input_shape
