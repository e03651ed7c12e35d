"""Per-example gradient clipping at about the cost of one backward pass (L2 for DP-SGD, L1 for DDP-SA).

Record-level DP needs ``sum_i clip(g_i, C)`` over a batch.  For the supported layers the per-example norms and the
clipped sum follow from one backward pass: the layer input ``a_i`` and the output gradient ``delta_i``.

- ``nn.Linear`` on ``(B, in)``: the weight gradient is ``delta_i a_i^T``, so ``||.||_2^2 = |delta_i|^2 |a_i|^2``
  and ``||.||_1 = |delta_i|_1 |a_i|_1`` exactly; the bias gradient is ``delta_i``.
- ``nn.Conv2d`` (and ``nn.Linear`` with extra axes): with unfolded patches ``A_i`` and ``D_i`` the weight gradient
  is ``D_i A_i^T``, built per example in chunks or, for L2 when cheaper, normed via Gram matrices ("ghost norm").
- The clipped sum is ``(s * D) A^T``: one matmul per layer with each example's scale folded into its delta.

Models with a trainable parameter outside a supported layer (or a layer called other than once per forward)
take the generic ``torch.func`` path, :func:`vmap_clipped_grad_sum`, also the tests' reference.  Both paths need
examples that do not interact in the forward pass (no batch norm in train mode).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ClippedSum",
    "Descent",
    "PerExampleClipper",
    "clipped_grad_sum",
    "cross_entropy",
    "fast_path_blocker",
    "per_example_gradients",
    "vmap_clipped_grad_sum",
]

Norm = Literal["l2", "l1"]
#: ``loss(outputs, targets)`` -> one loss per example, shape ``(B,)``.
PerExampleLoss = Callable[[Tensor, Tensor], Tensor]

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()
#: Examples per chunk of the vmap path (bounds the memory of the materialised gradients).
VMAP_CHUNK = 256
#: Elements per chunk of materialised per-example conv gradients or Gram matrices.
_CHUNK_ELEMENTS = 1 << 23


class Descent(NamedTuple):
    """What :meth:`PerExampleClipper.descend` returns: per-example losses ``(B,)`` and the number clipped (0-dim)."""

    losses: Tensor
    clipped: Tensor


class ClippedSum(NamedTuple):
    """``sum_i clip(g_i, C)`` per parameter (``model.parameters()`` order), per-example losses, #clipped."""

    grads: list[Tensor]
    losses: Tensor
    clipped: int


def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-example cross-entropy (the default loss)."""
    return F.cross_entropy(outputs, targets, reduction="none")


def clipped_grad_sum(model: nn.Module, x: Tensor, y: Tensor, clip: float, *, norm: Norm = "l2",
                     loss: PerExampleLoss = cross_entropy) -> ClippedSum:
    """``sum_i g_i / max(1, ||g_i|| / clip)`` over the batch, ``||.||`` the L2 or L1 norm of all parameters jointly.

    Frozen parameters get zero gradients and do not count in the norm. ``clip`` may be
    ``math.inf`` (plain gradient sum). Layer-wise fast path where the model allows it,
    else :func:`vmap_clipped_grad_sum`.  For a training loop, build one
    :class:`PerExampleClipper` and call it per batch (it inspects the model once).
    """
    with PerExampleClipper(model, clip, norm=norm, loss=loss) as clipper:
        return clipper(x, y)


class PerExampleClipper:
    """:func:`clipped_grad_sum` for many batches of one model: the layers are inspected and instrumented once.

    At batch 32 on a small MLP, inspecting and instrumenting the model at every step cost as
    much as the step's arithmetic; a training loop builds one clipper and calls it (or
    :meth:`descend`) per batch.  Use as a context manager (or call :meth:`close`) to give the
    layers back their own ``forward``.
    """

    def __init__(self, model: nn.Module, clip: float, *, norm: Norm = "l2",
                 loss: PerExampleLoss = cross_entropy) -> None:
        if norm not in ("l2", "l1"):
            raise ValueError(f"norm must be 'l2' or 'l1', got {norm!r}")
        if not clip > 0:
            raise ValueError(f"clip must be > 0, got {clip!r}")
        self.model, self.clip, self.norm, self.loss = model, float(clip), norm, loss
        self.params = list(model.parameters())
        layers = _trainable_layers(model)
        if not layers:
            raise ValueError("the model has no trainable parameters")
        self._layers: list[nn.Module] | None = None if isinstance(layers, str) else layers
        self._blocker: str | None = layers if isinstance(layers, str) else None
        self._recorder: _Recorder | None = None
        self._logged = False
        if self._layers is not None:
            self._recorder = _Recorder(self._layers)

    def __call__(self, x: Tensor, y: Tensor) -> ClippedSum:
        """``sum_i clip(g_i, C)`` over the batch ``(x, y)`` (see :func:`clipped_grad_sum`)."""
        forms = self._forms(x, y)
        if forms is None:
            return vmap_clipped_grad_sum(self.model, x, y, self.clip, norm=self.norm, loss=self.loss)
        layer_forms, losses = forms
        with torch.no_grad():
            norms, scale = _clip_scales(layer_forms, self.clip, self.norm)
            grads = {key: g for f in layer_forms for key, g in f.clipped_sum(scale).items()}
            out = [grads[id(p)] if id(p) in grads else torch.zeros_like(p) for p in self.params]
        return ClippedSum(out, losses, int((norms > self.clip).sum()))

    def descend(self, x: Tensor, y: Tensor, step: float) -> Descent:
        """One SGD step in place: ``p <- p - step * sum_i clip(g_i, C)`` for every parameter.

        The same update as subtracting ``step`` times :meth:`__call__`'s sums (to rounding: the
        weight update is one fused ``addmm_``), without forming the sums as separate tensors
        and without a host synchronisation (the results stay tensors).
        """
        forms = self._forms(x, y)
        with torch.no_grad():
            if forms is None:
                r = vmap_clipped_grad_sum(self.model, x, y, self.clip, norm=self.norm, loss=self.loss)
                for p, g in zip(self.params, r.grads, strict=True):
                    if p.requires_grad:
                        p.add_(g, alpha=-step)
                return Descent(r.losses, torch.tensor(r.clipped))
            layer_forms, losses = forms
            norms, scale = _clip_scales(layer_forms, self.clip, self.norm)
            for f in layer_forms:
                f.add_clipped_sum_(scale, -step)
        return Descent(losses, (norms > self.clip).sum())

    def _forms(self, x: Tensor, y: Tensor) -> tuple[list[_ClosedForm], Tensor] | None:
        """The layer-wise closed forms and losses of the batch; None when the model takes the vmap path."""
        if y.shape[0] == 0 or x.shape[0] != y.shape[0]:
            raise ValueError("need a non-empty batch with one target per input")
        if self._recorder is not None:
            assert self._layers is not None
            result = _layerwise_forms(self.model, self._layers, self._recorder, x, y, self.loss)
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
    layers = _trainable_layers(model)
    return layers if isinstance(layers, str) else None


def _trainable_layers(model: nn.Module) -> list[nn.Module] | str:
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


def _log_once(model: nn.Module, path: str) -> None:
    key = (f"{type(model).__module__}.{type(model).__qualname__}", path)
    if key not in _logged:
        _logged.add(key)
        log.info("per-example clipping for %s: %s path", type(model).__name__, path)


# ------------------------------------------------------------------ layer-wise path
@dataclass
class _Site:
    """One supported layer's forward: its input (detached) and output (in the graph)."""

    module: nn.Module
    trainable: tuple[Tensor | None, Tensor | None]  # (weight, bias) where trainable, else None
    inputs: Tensor | None  # None when the layer was called without a positional input
    output: Tensor
    version: int
    calls: int = 1


class _Recorder:
    """Records the supported layers' sites, only while :meth:`forward` runs.

    Each layer gets an instance attribute ``forward`` that calls the layer's own ``forward`` and
    notes the input and output (undone by :meth:`remove`; clippers on one model nest).  Unlike a forward hook this keeps
    ``nn.Module.__call__`` on its hook-free fast path (a hook sends every call of the layer
    through the slow one).
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        self.sites: dict[int, _Site] | None = None
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
            sites[key] = _Site(module, trainable, None if a is None else a.detach(), output, output._version)
            return output.clone() if self.copy_outputs else output

        forward._records_layer = True  # type: ignore[attr-defined]  # another clipper may wrap it again
        return forward

    def forward(self, model: nn.Module, x: Tensor, y: Tensor, loss: PerExampleLoss, *,
                copy_outputs: bool) -> tuple[dict[int, _Site], Tensor]:
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


def _layerwise_forms(model: nn.Module, layers: list[nn.Module], recorder: _Recorder, x: Tensor, y: Tensor,
                     loss: PerExampleLoss) -> tuple[list[_ClosedForm], Tensor] | str:
    """One forward and one backward to the layer outputs: each layer's closed form and the per-example losses.

    Returns the reason instead when the forward does not fit the fast path.
    """
    n = y.shape[0]
    sites, losses = recorder.forward(model, x, y, loss, copy_outputs=False)
    if any(s.output._version != s.version for s in sites.values()):
        # an in-place op (e.g. ReLU(inplace=True)) overwrote a layer output: keep a copy instead
        sites, losses = recorder.forward(model, x, y, loss, copy_outputs=True)
    recorded = []
    for m in layers:
        site = sites.get(id(m))
        if site is None or site.calls != 1:
            return f"layer {type(m).__name__} ran {0 if site is None else site.calls} times in one forward"
        if site.inputs is None or site.inputs.dim() < 2 or site.inputs.shape[0] != n or site.output.shape[0] != n:
            return f"layer {type(m).__name__} does not keep the batch axis first"
        recorded.append(site)
    if losses.shape != (n,):
        raise ValueError(f"loss must return one value per example, shape ({n},), got {tuple(losses.shape)}")
    deltas = torch.autograd.grad(losses.sum(), [s.output for s in recorded], allow_unused=True)
    forms = [_form(s, torch.zeros_like(s.output) if d is None else d) for s, d in zip(recorded, deltas, strict=True)]
    return forms, losses.detach()


def _clip_scales(forms: list[_ClosedForm], clip: float, norm: Norm) -> tuple[Tensor, Tensor]:
    """Per-example ``(||g_i||, 1 / max(1, ||g_i|| / clip))`` (a zero gradient gets scale 1)."""
    norms = forms[0].norm_term(norm)
    for f in forms[1:]:
        norms = norms.add_(f.norm_term(norm))
    if norm == "l2":
        norms = norms.sqrt_()
    return norms, (clip / norms).clamp_(max=1.0)


class _ClosedForm:
    """What every closed form shares: applying its clipped sum to its layer's parameters."""

    module: nn.Module

    def norm_term(self, norm: Norm) -> Tensor:
        """Per-example ``||g||_2^2`` (l2) or ``||g||_1`` (l1) of the layer's trainable parameters (a new tensor)."""
        raise NotImplementedError

    def clipped_sum(self, scale: Tensor) -> dict[int, Tensor]:
        """Gradient sums of the layer's trainable parameters by ``id``, example i weighted by ``scale[i]``."""
        raise NotImplementedError

    def add_clipped_sum_(self, scale: Tensor, alpha: float) -> None:
        """``p += alpha * (clipped gradient sum of p)`` for each trainable parameter of the layer."""
        sums = self.clipped_sum(scale)
        for p in self.module.parameters(recurse=False):
            g = sums.get(id(p))
            if g is not None:
                p.add_(g, alpha=alpha)


class _LinearForm(_ClosedForm):
    """A Linear layer on ``(B, K)``: per-example gradient ``d_i a_i^T`` in closed form.

    ``w`` and ``b`` are the layer's weight and bias where trainable, else None.
    """

    def __init__(self, module: nn.Linear, w: Tensor | None, b: Tensor | None, a: Tensor, d: Tensor) -> None:
        self.module, self.w, self.b, self.a, self.d = module, w, b, a, d

    def norm_term(self, norm: Norm) -> Tensor:
        """Per-example ``||g||_2^2`` (l2) or ``||g||_1`` (l1) of this layer's trainable parameters (a new tensor)."""
        if norm == "l2":
            dd = torch.linalg.vecdot(self.d, self.d)
            aa = torch.linalg.vecdot(self.a, self.a) if self.w is not None else None
        else:
            dd = torch.linalg.vector_norm(self.d, 1, dim=1)
            aa = torch.linalg.vector_norm(self.a, 1, dim=1) if self.w is not None else None
        if aa is None:
            return dd
        return torch.addcmul(dd, dd, aa) if self.b is not None else dd.mul_(aa)

    def clipped_sum(self, scale: Tensor) -> dict[int, Tensor]:
        """Gradient sums of the layer's trainable parameters, example i weighted by ``scale[i]``."""
        sd = self.d * scale[:, None]
        out = {} if self.w is None else {id(self.w): torch.mm(sd.t(), self.a)}
        if self.b is not None:
            out[id(self.b)] = sd.sum(0)
        return out

    def add_clipped_sum_(self, scale: Tensor, alpha: float) -> None:
        """``p += alpha * (clipped gradient sum of p)``; the weight's in one fused ``addmm_``."""
        sd = self.d * scale[:, None]
        if self.w is not None:
            self.w.addmm_(sd.t(), self.a, alpha=alpha)
        if self.b is not None:
            self.b.add_(sd.sum(0), alpha=alpha)


def _unfolded_norm_term(patches: Callable[[int, int], tuple[Tensor, Tensor]], batch: int, shape: tuple[int, int, int, int],
                        norm: Norm) -> Tensor:
    """Per-example ``||sum_g D_g A_g^T||`` (squared for l2) from chunks ``A: (b, G, K, L)``, ``D: (b, G, O, L)``.

    ``patches(start, stop)`` returns the chunk's ``(A, D)``. The weight gradient ``D A^T`` is
    formed chunk by chunk, or for L2 when cheaper, its norm is the Gram product ``<A^T A, D^T D>``.
    """
    groups, k, o, positions = shape
    ghost = norm == "l2" and positions * (k + o) < o * k
    step = max(1, _CHUNK_ELEMENTS // (groups * (positions * positions if ghost else o * k)))
    terms = []
    for s in range(0, batch, step):
        a, d = patches(s, min(s + step, batch))
        if ghost:
            term = a.transpose(2, 3) @ a * (d.transpose(2, 3) @ d)
        else:
            g = d @ a.transpose(2, 3)  # (b, G, O, K)
            term = g * g if norm == "l2" else g.abs()
        terms.append(term.flatten(1).sum(1))
    return torch.cat(terms)


def _bias_norm_term(d: Tensor, norm: Norm) -> Tensor:
    """Per-example ``||d||^2`` (l2) or ``||d||_1`` (l1) of a bias gradient ``d: (B, ...)``."""
    return (d * d if norm == "l2" else d.abs()).flatten(1).sum(1)


class _SequenceLinearForm(_ClosedForm):
    """A Linear layer on ``(B, T..., K)``: per-example weight gradient ``sum_t d_t a_t^T``."""

    def __init__(self, module: nn.Linear, a: Tensor, d: Tensor) -> None:
        batch = a.shape[0]
        self.module = module
        self.a = a.reshape(batch, -1, a.shape[-1])  # (B, T, K)
        self.d = d.reshape(batch, -1, d.shape[-1])  # (B, T, O)

    def norm_term(self, norm: Norm) -> Tensor:
        """Per-example ``||g||_2^2`` (l2) or ``||g||_1`` (l1) of this layer's trainable parameters."""
        (batch, positions, k), o = self.a.shape, self.d.shape[-1]
        w, b = self.module.weight, self.module.bias
        total = self.d.new_zeros(batch)
        if b is not None and b.requires_grad:
            total += _bias_norm_term(self.d.sum(1), norm)
        if w.requires_grad:
            def patches(s: int, e: int) -> tuple[Tensor, Tensor]:
                return self.a[s:e].transpose(1, 2).unsqueeze(1), self.d[s:e].transpose(1, 2).unsqueeze(1)

            total += _unfolded_norm_term(patches, batch, (1, k, o, positions), norm)
        return total

    def clipped_sum(self, scale: Tensor) -> dict[int, Tensor]:
        """Gradient sums of the layer's trainable parameters, example i weighted by ``scale[i]``."""
        sd = (self.d * scale[:, None, None]).reshape(-1, self.d.shape[-1])
        w, b = self.module.weight, self.module.bias
        out = {id(w): sd.t() @ self.a.reshape(-1, self.a.shape[-1])} if w.requires_grad else {}
        if b is not None and b.requires_grad:
            out[id(b)] = sd.sum(0)
        return out


class _ConvForm(_ClosedForm):
    """A Conv2d layer: per-example weight gradient ``D_i A_i^T`` with ``A_i`` the unfolded input patches."""

    def __init__(self, module: nn.Conv2d, a: Tensor, d: Tensor) -> None:
        self.module, self.d = module, d
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            self.a, self.padding = F.pad(a, module._reversed_padding_repeated_twice, mode=mode), (0, 0)
        else:
            self.a, self.padding = a, module.padding

    def norm_term(self, norm: Norm) -> Tensor:
        """Per-example ``||g||_2^2`` (l2) or ``||g||_1`` (l1) of this layer's trainable parameters."""
        m, batch = self.module, self.a.shape[0]
        w, b = m.weight, m.bias
        groups, o = m.groups, m.out_channels // m.groups
        total = self.d.new_zeros(batch)
        if b is not None and b.requires_grad:
            total += _bias_norm_term(self.d.flatten(2).sum(2), norm)
        if not w.requires_grad:
            return total
        k, positions = w[0].numel(), self.d[0, 0].numel()
        if norm == "l2" and positions * (k + o) < o * k:  # ghost norm from the unfolded patches
            def patches(s: int, e: int) -> tuple[Tensor, Tensor]:
                cols = F.unfold(self.a[s:e], m.kernel_size, dilation=m.dilation, padding=self.padding, stride=m.stride)
                return cols.reshape(e - s, groups, -1, positions), self.d[s:e].reshape(e - s, groups, o, positions)

            return total + _unfolded_norm_term(patches, batch, (groups, k, o, positions), norm)
        step = max(1, _CHUNK_ELEMENTS // w.numel())
        for s in range(0, batch, step):
            total[s:s + step] += _bias_norm_term(self._weight_grads(s, min(s + step, batch)), norm)
        return total

    def _weight_grads(self, start: int, stop: int) -> Tensor:
        """Per-example weight gradients ``(b, O, C/G, kh, kw)`` of examples ``start:stop``.

        One convolution-weight backward with the examples as extra groups (the native kernel;
        about twice as fast on CPU as unfolding the input and multiplying).
        """
        m, b = self.module, stop - start
        a, d = self.a[start:stop], self.d[start:stop]
        g = torch.nn.grad.conv2d_weight(a.reshape(1, -1, *a.shape[2:]), (b * m.out_channels, *m.weight.shape[1:]),
                                        d.reshape(1, -1, *d.shape[2:]), stride=m.stride, padding=self.padding,
                                        dilation=m.dilation, groups=b * m.groups)
        return g.reshape(b, *m.weight.shape)

    def clipped_sum(self, scale: Tensor) -> dict[int, Tensor]:
        """Gradient sums of the layer's trainable parameters, example i weighted by ``scale[i]`` (native conv kernel)."""
        m = self.module
        sd = self.d * scale[:, None, None, None]
        out = {}
        if m.weight.requires_grad:
            out[id(m.weight)] = torch.nn.grad.conv2d_weight(self.a, m.weight.shape, sd, stride=m.stride,
                                                            padding=self.padding, dilation=m.dilation, groups=m.groups)
        if m.bias is not None and m.bias.requires_grad:
            out[id(m.bias)] = sd.sum((0, 2, 3))
        return out


def _form(site: _Site, delta: Tensor) -> _ClosedForm:
    """The closed form of one layer's per-example gradients from its input and output gradient."""
    m, a = site.module, site.inputs
    assert a is not None
    if isinstance(m, nn.Conv2d):
        return _ConvForm(m, a, delta)
    return _LinearForm(m, *site.trainable, a, delta) if a.dim() == 2 else _SequenceLinearForm(m, a, delta)


# ------------------------------------------------------------------ vmap reference / fallback
def per_example_gradients(model: nn.Module, x: Tensor, y: Tensor, loss: PerExampleLoss = cross_entropy
                          ) -> dict[str, Tensor]:
    """Per-example gradients ``(B, *p.shape)`` of every trainable parameter, by name, via ``torch.func.vmap``."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0)).sum()

    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def vmap_clipped_grad_sum(model: nn.Module, x: Tensor, y: Tensor, clip: float, *, norm: Norm = "l2",
                          loss: PerExampleLoss = cross_entropy) -> ClippedSum:
    """:func:`clipped_grad_sum` by materialising per-example gradients, ``VMAP_CHUNK`` examples at a time."""
    named = dict(model.named_parameters())
    total = {k: torch.zeros_like(p) for k, p in named.items()}
    clipped = 0
    for start in range(0, len(y), VMAP_CHUNK):
        xs, ys = x[start:start + VMAP_CHUNK], y[start:start + VMAP_CHUNK]
        g = per_example_gradients(model, xs, ys, loss)
        flat = [t.reshape(len(ys), -1) for t in g.values()]
        if norm == "l2":
            norms = sum((t * t).sum(1) for t in flat).sqrt()
        else:
            norms = sum(t.abs().sum(1) for t in flat)
        scale = 1.0 / torch.clamp(norms / clip, min=1.0)
        clipped += int((norms > clip).sum())
        for k, t in g.items():
            total[k] += torch.einsum("b,b...->...", scale.to(t.dtype), t)
    with torch.no_grad():
        losses = loss(model(x), y)
    return ClippedSum(list(total.values()), losses, clipped)
