"""Which layers the closed forms cover, and recording their inputs and outputs during one forward.

Supported: a plain ``nn.Linear`` or ``nn.Conv2d`` (its class's ``forward``) that owns its trainable parameters
alone; :func:`trainable_layers` names the first obstacle otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from protocols.per_example.interface import PerExampleLoss

__all__ = ["Recorder", "Site", "trainable_layers"]


def trainable_layers(model: nn.Module) -> list[nn.Module] | str:
    """The modules holding trainable parameters, all supported layers; else why not."""
    layers: list[nn.Module] = []
    owners: set[int] = set()
    for name, module in model.named_modules():
        own = [id(p) for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if not _supported(module):
            return f"{type(module).__name__} {name!r} has no fast path"
        if not owners.isdisjoint(own):
            return f"a parameter of {name!r} is shared with another layer"
        owners.update(own)
        layers.append(module)
    return layers


def _supported(module: nn.Module) -> bool:
    """A plain Linear or Conv2d: its class's ``forward`` (or a clipper's recording wrapper of it)."""
    own = vars(module).get("forward")
    if own is not None and not getattr(own, "_records_layer", False):
        return False
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    if isinstance(module, nn.Conv2d):
        return type(module).forward is nn.Conv2d.forward
    return False


@dataclass
class Site:
    """One supported layer's forward: its input (detached) and output (in the graph)."""

    module: nn.Module
    trainable: tuple[Tensor | None, Tensor | None]  # (weight, bias) where trainable, else None
    inputs: Tensor | None  # None when the layer was called without a positional input
    output: Tensor
    version: int
    calls: int = 1


class Recorder:
    """Records the supported layers' sites, only while :meth:`forward` runs.

    Each layer gets an instance attribute ``forward`` that calls the layer's own ``forward`` and
    notes the input and output (undone by :meth:`remove`; clippers on one model nest).  Unlike a forward hook this keeps
    ``nn.Module.__call__`` on its hook-free fast path (a hook sends every call of the layer
    through the slow one).
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        self.sites: dict[int, Site] | None = None
        self.copy_outputs = False
        #: (layer, the instance ``forward`` it had before, if any): restored by :meth:`remove`.
        self.wrapped: list[tuple[nn.Module, Callable[..., Tensor] | None]] = []
        for m in layers:
            previous = vars(m).get("forward")
            m.forward = self._recording_forward(m, previous)
            self.wrapped.append((m, previous))

    def _recording_forward(self, module: nn.Module, previous: Callable[..., Tensor] | None) -> Callable[..., Tensor]:
        base = previous if previous is not None else type(module).forward.__get__(module)
        key = id(module)
        w, b = module.weight, module.bias
        trainable = (w if w.requires_grad else None, b if b is not None and b.requires_grad else None)

        def forward(*args: Tensor, **kwargs: Tensor) -> Tensor:
            output = base(*args, **kwargs)
            sites = self.sites
            if sites is None:  # a forward outside the clipper (e.g. evaluation): not recorded
                return output
            site = sites.get(key)
            if site is not None:
                site.calls += 1
                return output
            a = args[0] if args else kwargs.get("input")
            sites[key] = Site(module, trainable, None if a is None else a.detach(), output, output._version)
            return output.clone() if self.copy_outputs else output

        forward._records_layer = True  # type: ignore[attr-defined]  # another clipper may wrap it again
        return forward

    def forward(self, model: nn.Module, x: Tensor, y: Tensor, loss: PerExampleLoss, *,
                copy_outputs: bool) -> tuple[dict[int, Site], Tensor]:
        """Run the model once; returns the recorded sites and the per-example losses."""
        self.sites, self.copy_outputs = {}, copy_outputs
        try:
            with torch.enable_grad():
                losses = loss(model(x), y)
            return self.sites, losses
        finally:
            self.sites = None

    def remove(self) -> None:
        """Give the layers back the ``forward`` they had (their class's, or an instance one set before)."""
        for m, previous in reversed(self.wrapped):
            if previous is None:
                vars(m).pop("forward", None)
            else:
                m.forward = previous
        self.wrapped = []

