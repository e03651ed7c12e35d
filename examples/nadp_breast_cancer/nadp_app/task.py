"""The app's own model, data, partitioning and settings (nothing here comes from cancelfl)."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


class Net(nn.Module):
    """A small MLP: 30 standardized features -> 2 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every node and the server start from the same weights
        self.hidden = nn.Linear(30, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Breast-cancer, standardized with training statistics; a fixed 80/20 train/test split."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    cut = int(0.8 * len(y))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-6
    x = (x - mean) / std
    return x[:cut], y[:cut], x[cut:], y[cut:]


def partition(partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """The node's share of the training set: a label-sorted split into contiguous, interleaved shards."""
    x, y, _, _ = load_data()
    order = np.argsort(y, kind="stable")
    shards = np.array_split(order, 2 * num_partitions)
    mine = np.concatenate([shards[partition_id], shards[2 * num_partitions - 1 - partition_id]])
    return x[mine], y[mine]


def settings(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The method's settings: the run config, or pyproject's [tool.flwr.app.config] where there is none."""
    if run_config:
        return dict(run_config)
    return dict(tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"])
