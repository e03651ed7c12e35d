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

from protocols.config import ConfigError


class MLP(nn.Module):
    """ReLU multilayer perceptron; flattens image inputs.

    Layers are ``layers.0``, ``layers.1``, ... Linear modules (no other
    parameters), which the layer-expansion method (mpddp) relies on.
    """

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int) -> None:
        super().__init__()
        widths = [in_features, *hidden, num_classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))
        if not hidden:
            # A linear model (multinomial logistic regression) starts at zero: its loss is convex, there is no
            # symmetry to break, and a random start is an error every early step must first undo -- one the
            # noisy methods with few rounds cannot afford.
            nn.init.zeros_(self.layers[0].weight)
            nn.init.zeros_(self.layers[0].bias)

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


def resolve_device(name: str) -> torch.device:
    """Run-config ``device``: ``cpu``, ``cuda`` (fails clearly without a GPU) or ``auto`` (cuda if available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run-config 'device' = 'cuda' but torch sees no CUDA device on this machine; use 'cpu' or "
                          "'auto' (cuda where available)")
    return torch.device(name)


def import_object(path: str, what: str):
    """The object named by ``"package.module:attribute"`` (run-config ``model`` / ``dataset``), or a clear error."""
    import importlib

    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"run-config '{what}' = {path!r}: cannot import {attr!r} from {module!r} ({err}); "
                         "the module must be importable where the ServerApp and the ClientApps run") from err


def user_model(path: str, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """A model from run-config ``model = "package.module:Name"``.

    ``Name`` is an ``nn.Module`` class or a function returning one; it is called with no arguments if it takes
    none, else as ``Name(input_shape=..., num_classes=...)``.
    """
    import inspect

    factory = import_object(path, "model")
    try:
        params = inspect.signature(factory).parameters.values()
        required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        required = []
    model = factory(input_shape=tuple(input_shape), num_classes=num_classes) if required else factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"run-config 'model' = {path!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def seed_torch(seed: int) -> None:
    """Seed torch's CPU generator, and CUDA's where a GPU is present: what ``torch.manual_seed`` does here.

    ``torch.manual_seed`` also queues a seeding call for each device type that is not initialised (CUDA, XPU,
    MTIA), each with a formatted stack trace read through ``linecache``: about a millisecond per call at a
    ClientApp's stack depth, twice per client and round.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def build_model(name: str, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (64,),
                seed: int = 0) -> nn.Module:
    """Build ``mlp``, ``cnn`` or a user model (``"package.module:Name"``) with deterministic initial weights."""
    seed_torch(seed)
    if ":" in name:
        return user_model(name, input_shape, num_classes)
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
