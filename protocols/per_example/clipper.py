"""The clipper: ``sum_i clip(g_i, C)`` per batch by the fused MLP step, the layer-wise closed forms, or vmap.

The built-in MLP under the cross-entropy takes :class:`protocols.per_example.fused_mlp.FusedMLP`.  Other models
with any trainable parameter outside a supported layer (or a supported layer called other than once per forward)
take :func:`protocols.per_example.vmap.vmap_clipped_grad_sum`.  Which path a model class takes is logged once
(logger ``protocols.per_example``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from protocols.per_example.closed_forms import ClosedForm, clip_scales, layerwise_forms
from protocols.per_example.fused_mlp import FusedMLP
from protocols.per_example.interface import ClippedSum, Descent, Norm, PerExampleLoss, cross_entropy
from protocols.per_example.recorder import Recorder, trainable_layers
from protocols.per_example.vmap import vmap_clipped_grad_sum

__all__ = ["PerExampleClipper", "clipped_grad_sum", "fast_path_blocker"]

log = logging.getLogger("protocols.per_example")
_logged: set[tuple[str, str]] = set()


def clipped_grad_sum(model: nn.Module, x: Tensor, y: Tensor, clip: float, *, norm: Norm = "l2",
                     loss: PerExampleLoss = cross_entropy) -> ClippedSum:
    """``sum_i g_i / max(1, ||g_i|| / clip)`` over the batch, ``||.||`` the L2 or L1 norm of all parameters jointly.

    An example whose gradient or loss is not finite adds nothing and reports loss 0
    (:func:`protocols.per_example.interface.clip_factors`, every engine).
    Frozen parameters get zero gradients and do not count in the norm. ``clip`` may be
    ``math.inf`` (plain gradient sum). Layer-wise fast path where the model allows it,
    else :func:`vmap_clipped_grad_sum`.  For a training loop, build one
    :class:`PerExampleClipper` and call it per batch (it inspects the model once).
    """
    with PerExampleClipper(model, clip, norm=norm, loss=loss) as clipper:
        return clipper(x, y)


class PerExampleClipper:
    """:func:`clipped_grad_sum` for many batches of one model: the layers are inspected and instrumented once.

    A training loop builds one clipper and calls it (or :meth:`descend`) per batch.  Use as a context
    manager (or call :meth:`close`) to give the layers back their own ``forward``.  ``fused = False`` keeps the
    built-in MLP on the layer-wise engine (for comparisons; the results are the same up to rounding).

    Raises:
        ValueError: ``norm`` not ``l2``/``l1``, ``clip <= 0``, or a model without trainable parameters.
    """

    def __init__(self, model: nn.Module, clip: float, *, norm: Norm = "l2",
                 loss: PerExampleLoss = cross_entropy, fused: bool = True) -> None:
        if norm not in ("l2", "l1"):
            raise ValueError(f"norm must be 'l2' or 'l1', got {norm!r}")
        if not clip > 0:
            raise ValueError(f"clip must be > 0, got {clip!r}")
        self.model, self.clip, self.norm, self.loss = model, float(clip), norm, loss
        self.params = list(model.parameters())
        layers = trainable_layers(model)
        if not layers:
            raise ValueError("the model has no trainable parameters")
        self._layers: list[nn.Module] | None = None if isinstance(layers, str) else layers
        self._blocker: str | None = layers if isinstance(layers, str) else None
        self._recorder: Recorder | None = None
        self._logged = False
        self._fused = FusedMLP.of(model, norm, loss) if fused else None
        if self._fused is not None:
            _log_once(model, "fused MLP")
        elif self._layers is not None:
            self._recorder = Recorder(self._layers)

    def __call__(self, x: Tensor, y: Tensor) -> ClippedSum:
        """``sum_i clip(g_i, C)`` over the batch ``(x, y)`` (see :func:`clipped_grad_sum`)."""
        if self._fused is not None:
            _check_batch(x, y)
            return self._fused.clipped_sum(x, y, self.clip, self.params)
        forms = self._forms(x, y)
        if forms is None:
            return vmap_clipped_grad_sum(self.model, x, y, self.clip, norm=self.norm, loss=self.loss)
        layer_forms, losses = forms
        with torch.no_grad():
            factors = clip_scales(layer_forms, losses, self.clip, self.norm)
            grads = {key: g for f in layer_forms for key, g in f.clipped_sum(factors.scale).items()}
            out = [grads[id(p)] if id(p) in grads else torch.zeros_like(p) for p in self.params]
        return ClippedSum(out, factors.losses, int(factors.clipped))

    def descend(self, x: Tensor, y: Tensor, step: float, into: Sequence[Tensor] | None = None) -> Descent:
        """One SGD step in place: ``p <- p - step * sum_i clip(g_i, C)`` for every trainable parameter.

        The same update as subtracting ``step`` times :meth:`__call__`'s sums (to rounding: the
        weight update is one fused ``addmm_``), without forming the sums as separate tensors
        and without a host synchronisation (the results stay tensors).

        ``into``: one tensor per parameter (``model.parameters()`` order, each of its parameter's shape and dtype)
        that receives ``-step * sum_i clip(g_i, C)`` (added to it) instead of the parameter; the parameters are then
        left as they are (e.g. to apply the step to higher-precision master weights).
        """
        targets = None if into is None else dict(zip(map(id, self.params), into, strict=True))
        if self._fused is not None:
            _check_batch(x, y)
            return self._fused.descend(x, y, self.clip, step, targets)
        forms = self._forms(x, y)
        with torch.no_grad():
            if forms is None:
                r = vmap_clipped_grad_sum(self.model, x, y, self.clip, norm=self.norm, loss=self.loss)
                for p, g in zip(self.params, r.grads, strict=True):
                    if p.requires_grad:
                        (p if targets is None else targets[id(p)]).add_(g, alpha=-step)
                return Descent(r.losses, torch.tensor(r.clipped))
            layer_forms, losses = forms
            factors = clip_scales(layer_forms, losses, self.clip, self.norm)
            for f in layer_forms:
                f.add_clipped_sum_(factors.scale, -step, targets)
        return Descent(factors.losses, factors.clipped)

    def _forms(self, x: Tensor, y: Tensor) -> tuple[list[ClosedForm], Tensor] | None:
        """The layer-wise closed forms and losses of the batch; None when the model takes the vmap path."""
        _check_batch(x, y)
        if self._recorder is not None:
            assert self._layers is not None
            result = layerwise_forms(self.model, self._layers, self._recorder, x, y, self.loss)
            if not isinstance(result, str):
                if not self._logged:
                    _log_once(self.model, "layer-wise")
                    self._logged = True
                return result
            self._blocker = result  # this forward does not fit the fast path: fall back for good
            self.close()
        _log_once(self.model, f"vmap ({self._blocker})")
        return None

    def close(self) -> None:
        """Give the layers back their own ``forward`` (the clipper then takes the vmap path if called again)."""
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None

    def __enter__(self) -> PerExampleClipper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fast_path_blocker(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the layer-wise path (None if every trainable parameter is in a supported layer)."""
    layers = trainable_layers(model)
    return layers if isinstance(layers, str) else None


def _check_batch(x: Tensor, y: Tensor) -> None:
    if y.shape[0] == 0 or x.shape[0] != y.shape[0]:
        raise ValueError("need a non-empty batch with one target per input")


def _log_once(model: nn.Module, path: str) -> None:
    key = (f"{type(model).__module__}.{type(model).__qualname__}", path)
    if key not in _logged:
        _logged.add(key)
        log.info("per-example clipping for %s: %s path", type(model).__name__, path)

