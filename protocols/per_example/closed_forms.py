"""Closed forms of per-example gradient norms and clipped sums from one backward pass.

For a layer with input ``a_i`` and output gradient ``delta_i`` (backpropagating ``sum_i loss_i`` gives every
``delta_i``, examples being independent):

- ``nn.Linear`` on ``(B, in)``: the weight gradient is ``delta_i a_i^T``, so ``||.||_2^2 = |delta_i|^2 |a_i|^2``
  and ``||.||_1 = |delta_i|_1 |a_i|_1`` exactly; the bias gradient is ``delta_i``.
- ``nn.Conv2d`` (and ``nn.Linear`` with extra axes): with the input unfolded into patches ``A_i`` (``K x L``) and
  ``D_i`` (``O x L``), the weight gradient is ``D_i A_i^T``, built per example in chunks (L1, or L2 when cheaper),
  or for L2 its norm from the Gram matrices, ``<A_i^T A_i, D_i^T D_i>`` ("ghost norm"), when
  ``L^2 (K + O) < O K L``.
- The clipped sum is a second contraction with each example's scale folded into its delta:
  ``sum_i s_i D_i A_i^T = (s * D) A^T``, one matmul per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocols.per_example.interface import ClipFactors, Norm, PerExampleLoss, clip_factors, kept_rows
from protocols.per_example.norms import outer_norms_sq, row_max, row_norms
from protocols.per_example.recorder import Recorder, Site

__all__ = ["ClosedForm", "clip_scales", "layerwise_forms"]

#: Elements per chunk of materialised per-example conv gradients or Gram matrices.
_CHUNK_ELEMENTS = 1 << 23


def layerwise_forms(model: nn.Module, layers: list[nn.Module], recorder: Recorder, x: Tensor, y: Tensor,
                     loss: PerExampleLoss) -> tuple[list[ClosedForm], Tensor] | str:
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


def clip_scales(forms: list[ClosedForm], losses: Tensor, clip: float, norm: Norm) -> ClipFactors:
    """Each example's :func:`protocols.per_example.interface.clip_factors` from its norm over the layers and its loss.

    Its ``multipliers``: each example's largest layer input (a weight's clipped sum multiplies it by the scaled output
    gradient).  The examples it drops get their rows zeroed in every form (:meth:`ClosedForm.keep_only`) whenever the rule
    checked them one by one (``keep`` set).
    """
    norms = forms[0].norm_term(norm)
    for f in forms[1:]:
        norms = norms.add_(f.norm_term(norm))
    if norm == "l2":
        norms = norms.sqrt_()
    widest = row_max(forms[0].a)  # each weight's clipped sum multiplies the scaled output gradient by the input
    for f in forms[1:]:
        widest = torch.maximum(widest, row_max(f.a))
    factors = clip_factors(norms, losses, clip, widest)
    if factors.keep is not None:
        for f in forms:
            f.keep_only(factors.keep)
    return factors


class ClosedForm:
    """What every closed form shares: applying its clipped sum to its layer's parameters."""

    module: nn.Module
    #: The layer's input (or unfolded patches) and output gradient, batch axis first.
    a: Tensor
    d: Tensor

    def keep_only(self, keep: Tensor) -> None:
        """Zero the input and output gradient of every example not in ``keep`` (its clipped terms are then exactly 0)."""
        self.a, self.d = kept_rows(keep, self.a), kept_rows(keep, self.d)

    def norm_term(self, norm: Norm) -> Tensor:
        """Per-example ``||g||_2^2`` (l2) or ``||g||_1`` (l1) of the layer's trainable parameters (a new tensor)."""
        raise NotImplementedError

    def clipped_sum(self, scale: Tensor) -> dict[int, Tensor]:
        """Gradient sums of the layer's trainable parameters by ``id``, example i weighted by ``scale[i]``."""
        raise NotImplementedError

    def add_clipped_sum_(self, scale: Tensor, alpha: float, into: Mapping[int, Tensor] | None = None) -> None:
        """``t += alpha * (clipped gradient sum of p)`` for each trainable parameter ``p`` of the layer.

        ``t`` is ``into[id(p)]`` (a tensor of ``p``'s shape and dtype), or ``p`` itself when ``into`` is None.
        """
        sums = self.clipped_sum(scale)
        for p in self.module.parameters(recurse=False):
            g = sums.get(id(p))
            if g is not None:
                _target(p, into).add_(g, alpha=alpha)


def _target(p: Tensor, into: Mapping[int, Tensor] | None) -> Tensor:
    """Where ``p``'s step goes: ``into[id(p)]``, or ``p`` itself."""
    return p if into is None else into[id(p)]


class _LinearForm(ClosedForm):
    """A Linear layer on ``(B, K)``: per-example gradient ``d_i a_i^T`` in closed form.

    ``w`` and ``b`` are the layer's weight and bias where trainable, else None.
    """

    def __init__(self, module: nn.Linear, w: Tensor | None, b: Tensor | None, a: Tensor, d: Tensor) -> None:
        self.module, self.w, self.b, self.a, self.d = module, w, b, a, d

    def norm_term(self, norm: Norm) -> Tensor:
        """Per-example ``||g||_2^2`` (l2) or ``||g||_1`` (l1) of this layer's trainable parameters (a new tensor)."""
        if norm == "l2" and self.w is None:
            return row_norms(self.d).square_()
        if norm == "l2":
            return outer_norms_sq(self.d, self.a, self.b is not None)
        dd = torch.linalg.vector_norm(self.d, 1, dim=1)
        if self.w is None:
            return dd
        aa = torch.linalg.vector_norm(self.a, 1, dim=1)
        return torch.addcmul(dd, dd, aa) if self.b is not None else dd.mul_(aa)

    def clipped_sum(self, scale: Tensor) -> dict[int, Tensor]:
        """Gradient sums of the layer's trainable parameters, example i weighted by ``scale[i]``."""
        sd = self.d * scale[:, None]
        out = {} if self.w is None else {id(self.w): torch.mm(sd.t(), self.a)}
        if self.b is not None:
            out[id(self.b)] = sd.sum(0)
        return out

    def add_clipped_sum_(self, scale: Tensor, alpha: float, into: Mapping[int, Tensor] | None = None) -> None:
        """:meth:`ClosedForm.add_clipped_sum_`: the weight's in one fused ``addmm_``, the bias's in one ``addmv_``."""
        if self.w is not None:
            _target(self.w, into).addmm_((self.d * scale[:, None]).t(), self.a, alpha=alpha)
        if self.b is not None:
            _target(self.b, into).addmv_(self.d.t(), scale, alpha=alpha)  # sum_i scale_i d_i


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
        if ghost:  # each example's A and D scaled to largest entry 1 first: a Gram product does not underflow alone
            ma, md = row_max(a), row_max(d)
            a, d, scale = a / ma[:, None, None, None], d / md[:, None, None, None], ma * md
            terms.append(((a.transpose(2, 3) @ a * (d.transpose(2, 3) @ d)).flatten(1).sum(1) * scale).mul_(scale))
        else:
            g = d @ a.transpose(2, 3)  # (b, G, O, K)
            terms.append((g * g if norm == "l2" else g.abs()).flatten(1).sum(1))
    return torch.cat(terms)


def _bias_norm_term(d: Tensor, norm: Norm) -> Tensor:
    """Per-example ``||d||^2`` (l2) or ``||d||_1`` (l1) of a bias gradient ``d: (B, ...)``."""
    return (d * d if norm == "l2" else d.abs()).flatten(1).sum(1)


class _SequenceLinearForm(ClosedForm):
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


class _ConvForm(ClosedForm):
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


def _form(site: Site, delta: Tensor) -> ClosedForm:
    """The closed form of one layer's per-example gradients from its input and output gradient."""
    m, a = site.module, site.inputs
    assert a is not None
    if isinstance(m, nn.Conv2d):
        return _ConvForm(m, a, delta)
    return _LinearForm(m, *site.trainable, a, delta) if a.dim() == 2 else _SequenceLinearForm(m, a, delta)

