"""PyTorch models and their (de)serialisation as named numpy arrays.

Parameter names are ``state_dict`` keys; the same names appear in Flower
``ArrayRecord`` payloads and in the saved ``model.npz``, so a final model can be
re-evaluated independently with :func:`load_npz_model`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn


class MLP(nn.Module):
    """ReLU multilayer perceptron; flattens image inputs.

    Layers are ``layers.0``, ``layers.1``, ... Linear modules (no other
    parameters), which the layer-expansion method (mpddp) relies on.
    """

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int) -> None:
        super().__init__()
        widths = [in_features, *hidden, num_classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head; works for 8x8 (digits) and 28x28 inputs."""

    def __init__(self, in_channels: int, side: int, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        pooled = side // 4
        self.fc = nn.Linear(32 * pooled * pooled, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def build_model(name: str, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (64,),
                seed: int = 0) -> nn.Module:
    """Build ``mlp`` or ``cnn`` with deterministic initial weights."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(int(np.prod(input_shape)), hidden, num_classes)
    if name == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"cnn needs image input (C, H, W), got shape {tuple(input_shape)}")
        return SmallCNN(input_shape[0], input_shape[1], num_classes)
    raise ValueError(f"unknown model {name!r}; choose mlp or cnn")


def get_weights(model: nn.Module) -> OrderedDict[str, np.ndarray]:
    """Model parameters as named float64 numpy arrays (copies)."""
    return OrderedDict((k, v.detach().cpu().double().numpy().copy()) for k, v in model.state_dict().items())


def set_weights(model: nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Load named arrays into ``model`` (cast to the model's dtype); key mismatch raises."""
    state = model.state_dict()
    missing = set(state) ^ set(weights)
    if missing:
        raise KeyError(f"weights do not match the model: differing keys {sorted(missing)}")
    model.load_state_dict(
        OrderedDict((k, torch.as_tensor(np.asarray(weights[k]), dtype=state[k].dtype).reshape(state[k].shape))
                    for k in state)
    )


def save_npz_model(path: Path, weights: dict[str, np.ndarray], meta: dict) -> None:
    """Write the model as ``model.npz`` (arrays by layer name) plus ``model.json`` metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{k: np.asarray(v) for k, v in weights.items()})
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2))


def load_npz_model(path: Path) -> tuple[nn.Module, dict]:
    """Rebuild a saved model from ``model.npz`` and its ``model.json``."""
    meta = json.loads(Path(path).with_suffix(".json").read_text())
    model = build_model(meta["model"], meta["input_shape"], meta["num_classes"], meta.get("hidden", (64,)))
    with np.load(path) as data:
        set_weights(model, {k: data[k] for k in data.files})
    return model, meta
