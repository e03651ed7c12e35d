"""Client-side model math (LMT in Algorithm 4): perturbed gradients and the correction terms Psi, Phi.

Theorem 13 (App. A.2), per sample, for odd expanded layers ``j = 2l-1``::

    dL^/dW^(j) = (1/R^(j)) o dL/dW^(j) + r^T sigma^(j) - v beta^(j)

with ``alpha = sum_i y^_i^(2L-2)`` (constant unit included: R^a also masks the bias column).  Since ``ybar`` is
constant, ``sigma_k`` and ``beta`` are gradients of scalars, so batch means commute with differentiation:
``grad = d/dW mean_b 1/2 ||y^_b - ybar_b||^2``, ``Psi_k = d/dW mean_b alpha_b (y^_{b,k} - ybar_{b,k})``
(stacked on axis 0), ``Phi = d/dW mean_b alpha_b^2 / 2`` (zero for the last layer).  The paper's ``beta`` writes
dalpha/dW where dalpha/dW-hat is meant; tests check the recovery identity against autograd on the original MLP.

One gradient at W-hat per round (FedSGD): local SGD steps in the perturbed space cannot be mapped back by
Eq. 22.  Use float64: recovery cancels terms of size ``|r| * alpha``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from protocols.mpddp.expansion import augment_input, forward_expanded
from protocols.per_example import clip_factors, kept_rows
from protocols.per_example.interface import multiplier_limit
from protocols.per_example.norms import outer_norms_sq, row_max, row_norms

__all__ = ["ClientUpload", "client_gradients", "client_gradients_autograd", "clipped_client_gradients", "keeps_records",
           "per_example_grad_norms"]


@dataclass(frozen=True)
class ClientUpload:
    """What a client returns per round, for each original layer l = 1..L (trainable rows only).

    grads[l]: (n_l, n_{l-1}+1)       perturbed gradient nabla F(W^^(2l-1), D_k) (+ DP noise after DDP_Client)
    psi[l]:   (n_L, n_l, n_{l-1}+1)  Psi_k^(2l-1)
    phi[l]:   (n_l, n_{l-1}+1)       Phi_k^(2l-1)
    Column n_{l-1} (the last) of each block is the bias.
    """

    grads: tuple[Tensor, ...]
    psi: tuple[Tensor, ...]
    phi: tuple[Tensor, ...]

    def __post_init__(self) -> None:
        if not (len(self.grads) == len(self.psi) == len(self.phi)):
            raise ValueError("grads, psi and phi must have one entry per original layer")
        for g, p, f in zip(self.grads, self.psi, self.phi, strict=True):
            if g.shape != f.shape or p.shape[1:] != g.shape:
                raise ValueError(f"inconsistent shapes: grad {tuple(g.shape)} psi {tuple(p.shape)}")

    @property
    def num_layers(self) -> int:
        """L."""
        return len(self.grads)

    def with_grads(self, grads: Sequence[Tensor]) -> ClientUpload:
        """Same Psi/Phi, replaced gradients (used to add DP noise)."""
        return ClientUpload(tuple(grads), self.psi, self.phi)

    def to_arrays(self) -> list[np.ndarray]:
        """3L numpy arrays [grads..., psi..., phi...] for the wire (dtype preserved; keep float64)."""
        return [t.detach().cpu().numpy() for t in (*self.grads, *self.psi, *self.phi)]

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], dtype: torch.dtype = torch.float64) -> ClientUpload:
        """Inverse of `to_arrays`."""
        if len(arrays) % 3:
            raise ValueError("expected 3L arrays")
        t = [torch.as_tensor(np.asarray(a)).to(dtype) for a in arrays]
        n = len(t) // 3
        return cls(tuple(t[:n]), tuple(t[n : 2 * n]), tuple(t[2 * n :]))


def _as_inputs(
    w_hat: Sequence[Tensor | np.ndarray], x: Tensor | np.ndarray, y: Tensor | np.ndarray
) -> tuple[list[Tensor], Tensor, Tensor]:
    if len(w_hat) < 3 or len(w_hat) % 2 == 0:
        raise ValueError("expected an expanded model with 2L-1 >= 3 layers")
    mats = [torch.as_tensor(m).detach() for m in w_hat]
    dtype = mats[0].dtype
    mats = [m.to(dtype) for m in mats]
    return mats, torch.as_tensor(x).to(dtype), torch.as_tensor(y).to(dtype)


def _trim(ts: Sequence[Tensor], stacked: bool = False) -> tuple[Tensor, ...]:
    """Drop the non-trainable constant rows of hidden layers (last row; see expansion.py)."""
    keep = []
    for i, t in enumerate(ts):
        if i < len(ts) - 1:
            t = t[:, :-1] if stacked else t[:-1]
        keep.append(t.detach().contiguous())
    return tuple(keep)


def client_gradients(w_hat: Sequence[Tensor | np.ndarray], x: Tensor | np.ndarray, y: Tensor | np.ndarray,
                     weights: Tensor | None = None) -> ClientUpload:
    """Perturbed gradient and Psi, Phi of the odd layers on a local batch (Theorem 13, batch-averaged).

    w_hat: the 2L-1 matrices received from the server (tensors or numpy arrays); x: (B, n_0) inputs;
    y: (B, n_L) one-hot targets. Runs in w_hat's dtype (use float64).  ``weights`` (B,): per-example
    weights of the sums (default 1/B, the plain mean); :func:`clipped_client_gradients` passes
    ``min(1, C / ||g^_b||) / B``.  Grad, Psi and Phi of an example get the same weight, so recovery
    (Eq. 22, linear per example) returns the same weighted sum of the true per-example gradients.

    The n_L + 2 scalars (loss, Psi_1..Psi_nL, Phi) are back-propagated together by hand: their output
    signals are stacked on an axis after the batch, so each layer costs one matmul instead of n_L + 2
    autograd passes.  :func:`client_gradients_autograd` is the plain autograd reference; tests check that
    both agree to round-off.
    """
    mats, x, y = _as_inputs(w_hat, x, y)
    if x.shape[0] == 0:
        raise ValueError("empty batch")
    fwd = _forward(mats, x, y)
    if weights is None:
        w = torch.full((x.shape[0],), 1.0 / x.shape[0], dtype=fwd.h.dtype)
    else:
        w = torch.as_tensor(weights).to(fwd.h.dtype).reshape(-1)
        if w.shape[0] != x.shape[0]:
            raise ValueError(f"weights has {w.shape[0]} entries for a batch of {x.shape[0]}")
    return _weighted_gradients(mats, fwd, w)


@dataclass(frozen=True)
class _Forward:
    """A forward pass of the expanded model.

    Each layer's input, each hidden layer's ReLU mask, the last input ``h`` and the output error ``h W_L^T - y``
    (the loss signal every backward pass starts from).  ``signals`` keeps :func:`_signals` once computed, ``norms``
    the inputs' row norms (:meth:`input_norms`).
    """

    inputs: list[Tensor]
    masks: list[Tensor]
    h: Tensor
    err: Tensor
    signals: dict[int, Tensor] = field(default_factory=dict, compare=False, repr=False)
    norms: dict[int, Tensor] = field(default_factory=dict, compare=False, repr=False)

    def input_norms(self, j: int) -> Tensor:
        """(B,) :func:`row_norms` of layer ``j``'s input, computed once per forward pass."""
        if j not in self.norms:
            self.norms[j] = row_norms(self.inputs[j])
        return self.norms[j]


def _forward(mats: Sequence[Tensor], x: Tensor, y: Tensor) -> _Forward:
    h = augment_input(x)
    inputs, masks = [], []
    for mat in mats[:-1]:
        inputs.append(h)
        z = h @ mat.T
        masks.append(z > 0)  # torch.relu's derivative: 0 at z == 0
        h = z.clamp_min(0)
    return _Forward(inputs, masks, h, h @ mats[-1].T - y)


def _signals(mats: Sequence[Tensor], fwd: _Forward) -> dict[int, Tensor]:
    """Per uploaded block ``j`` (even index of the expanded model): the n_L + 2 unweighted signals at ``z_j``.

    ``(B, n_L + 2, n_j)``: d of [loss, Psi_1..Psi_nL, Phi] (per example, unweighted) with respect to the layer's
    output, back-propagated together (one matmul per layer for all of them).  The per-example norms and the
    weighted sums are read from the same signals: computed once per forward pass and kept in ``fwd.signals``.
    """
    if fwd.signals:
        return fwd.signals
    h, last, err = fwd.h, mats[-1], fwd.err
    n_out, width = last.shape
    alpha = h.sum(dim=1)  # (B,)
    # Signals d scalar / d h_last, stacked: [loss, Psi_1..Psi_nL, Phi] -> (B, n_L + 2, width).
    sig = torch.empty((h.shape[0], n_out + 2, width), dtype=h.dtype)
    torch.matmul(err, last, out=sig[:, 0])
    torch.mul(alpha[:, None, None], last, out=sig[:, 1 : n_out + 1])  # alpha_b W_k
    sig[:, 1 : n_out + 1] += err.unsqueeze(2)  # err_bk * d alpha / d h = err_bk * 1
    sig[:, n_out + 1] = alpha.unsqueeze(1)
    for j in range(len(mats) - 2, -1, -1):  # back through layers 2L-2 .. 1; odd original layers sit at even j
        d = sig.mul_(fwd.masks[j].unsqueeze(1))  # (B, K, n_j) signal at z_j
        if j % 2 == 0:
            fwd.signals[j] = d
        if j > 0:
            sig = d @ mats[j]
    return fwd.signals


def _weighted_gradients(mats: Sequence[Tensor], fwd: _Forward, w: Tensor) -> ClientUpload:
    """:func:`client_gradients` from a forward pass, example b weighted ``w[b]`` (every signal is linear in it)."""
    h, batch = fwd.h, fwd.h.shape[0]
    last = mats[-1]
    alpha = h.sum(dim=1)  # (B,)
    n_out, width = last.shape
    k = n_out + 2
    aw, ew = alpha * w, fwd.err * w.unsqueeze(1)
    # Gradients w.r.t. the last matrix: loss -> err^T h / B; Psi_k -> row k = sum_b alpha_b h_b / B; Phi -> 0.
    psi_last = torch.zeros((n_out, n_out, width), dtype=h.dtype)
    psi_last[torch.arange(n_out), torch.arange(n_out)] = aw @ h
    grads: list[Tensor] = [ew.T @ h]
    psis: list[Tensor] = [psi_last]
    phis: list[Tensor] = [torch.zeros_like(last)]
    for j, d in sorted(_signals(mats, fwd).items(), reverse=True):
        n_j = d.shape[2]
        # one matmul for all K signals, the (B, K n_j) view read transposed (no copy), the weights on the inputs
        g = (d.reshape(batch, k * n_j).T @ (fwd.inputs[j] * w.unsqueeze(1))).reshape(k, n_j, -1)
        grads.append(g[0])
        psis.append(g[1 : n_out + 1])
        phis.append(g[n_out + 1])
    grads.reverse()
    psis.reverse()
    phis.reverse()
    return ClientUpload(_trim(grads), _trim(psis, stacked=True), _trim(phis))


def per_example_grad_norms(w_hat: Sequence[Tensor | np.ndarray], x: Tensor | np.ndarray,
                           y: Tensor | np.ndarray) -> Tensor:
    """(B,) L2 norms of each example's perturbed gradient over the uploaded (odd, trimmed) blocks.

    One forward and one backward pass of the loss signal: for a linear layer the per-example gradient is
    the outer product d_b h_b^T, so its squared norm is ||d_b||^2 ||h_b||^2 (no per-example tensors).
    """
    mats, x, y = _as_inputs(w_hat, x, y)
    return _grad_norms(mats, _forward(mats, x, y))


def _grad_norms(mats: Sequence[Tensor], fwd: _Forward) -> Tensor:
    """(B,) per example: the L2 norm of its perturbed gradient, each layer's ``||d_b|| ||h_b||`` formed before squaring.

    A tiny output signal times a large input (:func:`protocols.per_example.norms.outer_norms_sq`): formed as
    ``||d||^2 ||h||^2``, a signal of ``1e-23`` at a unit of ``2^63`` would round a record's norm ``6e-5`` to ``6e-8``
    in float32.
    """
    sq = outer_norms_sq(fwd.err, fwd.h, bias=False)  # last layer: err_b h_b^T (not trimmed)
    for j, d in _signals(mats, fwd).items():  # an uploaded block; its last row (constant unit) is trimmed
        sq = sq + outer_norms_sq(d[:, 0, :-1], fwd.inputs[j], bias=False, a_norms=fwd.input_norms(j))
    return sq.sqrt()


def _side_norms(mats: Sequence[Tensor], fwd: _Forward) -> tuple[Tensor, Tensor]:
    """(B,) per example: an upper bound of the spectral norm of Psi_b (its n_L blocks as rows), the L2 norm of Phi_b.

    Over the uploaded blocks.  ``||r^T Psi_b|| <= ||r|| sigma_max(Psi_b)``, ``sigma_max^2`` the largest eigenvalue of
    the n_L x n_L Gram matrix ``<Psi_bk, Psi_bl>`` (bounded by :func:`_top_eigenvalue_bound`).  As
    :func:`_grad_norms`: a linear layer's per-example gradient of a scalar is the outer product ``d_b h_b^T``, so the
    Gram matrix sums ``(d ||h_b||) (d ||h_b||)^T`` over layers (the input's norm multiplied in before squaring).

    Nothing is squared at its own size: the clip multiplies these norms by ``rho`` and ``rho^2``, up to the square
    root of the dtype's largest value, so a Psi_b or Phi_b whose squares underflow (entries below ``1e-19`` in
    float32) can still weigh far above the clip.  The Gram matrix is formed from ``Psi_b`` divided by its largest
    entry ``m_b`` (its bound times ``m_b``), Phi's norm from the per-layer norms ``||d|| ||h_b||``
    (:func:`protocols.per_example.norms.row_norms`): each rounds to 0 only below the dtype's smallest normal number.
    """
    h, last = fwd.h, mats[-1]
    n_out = last.shape[0]
    # Per block: Psi_b's rows (d ||h_b||) and Phi_b's norm; the last matrix's Psi_k has one row, alpha_b h_b, and no Phi.
    last_psi = h.sum(dim=1) * row_norms(h)
    psis, phis = [], []
    for j, d in _signals(mats, fwd).items():  # an uploaded block; its last row (constant unit) is trimmed
        nx = fwd.input_norms(j)
        psis.append(d[:, 1 : n_out + 1, :-1] * nx[:, None, None])
        phis.append(row_norms(d[:, n_out + 1, :-1]) * nx)
    top = torch.stack([last_psi.abs(), *(row_max(p) for p in psis)], dim=1).amax(1)
    scale = torch.where(top > 0, top, 1.0)  # an inf or NaN entry keeps the Gram matrix non-finite
    gram = (last_psi / scale).square()[:, None, None] * torch.eye(n_out, dtype=h.dtype)
    for psi in psis:
        unit = psi / scale[:, None, None]
        gram = gram + unit @ unit.transpose(1, 2)
    return _top_eigenvalue_bound(gram).sqrt() * scale, row_norms(torch.stack(phis, dim=1))


def _top_eigenvalue_bound(gram: Tensor) -> Tensor:
    """(B,) an upper bound of each symmetric PSD ``gram[b]``'s largest eigenvalue; ``inf`` where it is not finite.

    ``lambda_max <= tr(G^8)^(1/8)`` (the eighth powers of the eigenvalues sum to at least the largest's), at most
    ``n^(1/8) lambda_max`` for an n x n matrix, and equal to it for rank one.  Computed on ``A = G / tr G`` (entries
    at most 1, no overflow): ``tr(A^8) = ||A^4||_F^2``, two batched n x n products, a fraction of an eigensolver's
    time.  Raised by a rounding margin of ``64 eps`` so that rounding keeps it a bound.
    """
    trace = torch.diagonal(gram, dim1=1, dim2=2).sum(1)
    finite = torch.isfinite(trace) & torch.isfinite(gram).flatten(1).all(1)
    scale = torch.where(finite, trace, 1.0).clamp_min(torch.finfo(gram.dtype).tiny)
    a = torch.where(finite[:, None, None], gram, 0.0) / scale[:, None, None]
    a2 = a @ a
    a4 = a2 @ a2
    top = scale * torch.linalg.vector_norm(a4.flatten(1), dim=1).pow(0.25) * (1.0 + 64 * torch.finfo(gram.dtype).eps)
    return torch.where(finite, top, torch.inf)


def _multipliers(mats: Sequence[Tensor], fwd: _Forward, rho: float | None) -> Tensor:
    """(B,) per example: the multipliers :func:`protocols.per_example.clip_factors` bounds (before the factor B).

    The weighted sums multiply ``w_b x_b`` (``w_b = scale_b / B``) by the signals, and ``w_b err_b``, ``w_b alpha_b``
    by ``h_b``: a factor's round-off on the dtype's subnormal grid comes out times the signal, a product's own
    round-off on it as it is.  Given R the server multiplies Psi by ``r`` and Phi by ``v = ||r||^2`` (``rho`` and
    ``rho^2`` at the clip's calibration), so Psi's multipliers count ``rho`` times (at least ``rho``) and Phi's
    ``rho^2`` times (at least ``rho^2``): a float32 Phi term rounded up by one step of the grid (``1.4e-45``) moves
    ``v Phi`` by up to ``1.4e-45 rho^2``, with rho near ``1e19`` more than a clip of ``1e-7``.  ``rho`` None:
    the largest unscaled multiplier.
    """
    n_out = mats[-1].shape[0]
    loss, psi = torch.maximum(row_max(fwd.h), row_max(fwd.err)), row_max(fwd.h)
    phi = torch.zeros_like(loss)
    for d in _signals(mats, fwd).values():
        loss = torch.maximum(loss, row_max(d[:, 0]))
        psi = torch.maximum(psi, row_max(d[:, 1 : n_out + 1]))
        phi = torch.maximum(phi, row_max(d[:, n_out + 1]))
    if rho is None:
        return torch.maximum(loss, torch.maximum(psi, phi))
    return torch.maximum(loss, torch.maximum(psi.clamp_min(1.0) * rho, phi.clamp_min(1.0) * (rho * rho)))


def keeps_records(rho: float, clip: float, dtype: torch.dtype) -> bool:
    """Whether a record can enter a ``dtype`` upload clipped at ``clip`` given the mask reference ``rho``.

    Every record's Psi multiplier is at least ``rho`` and its Phi multiplier at least ``rho^2`` (:func:`_multipliers`);
    above :func:`protocols.per_example.clip_factors`' subnormal-grid limit every record is dropped and the upload is a
    zero.  Public: ``rho`` comes from W-hat (:func:`protocols.mpddp.calibration.mask_reference`), ``clip`` from the
    run config.
    """
    return max(rho, rho * rho) <= multiplier_limit(clip, dtype)  # False for an infinite or NaN rho^2


def clipped_client_gradients(w_hat: Sequence[Tensor | np.ndarray], x: Tensor | np.ndarray, y: Tensor | np.ndarray,
                             clip: float, rho: float | None = None) -> tuple[ClientUpload, float]:
    """:func:`client_gradients` of the mean of per-example-clipped uploads; also the clipped fraction.

    Example b is weighted ``min(1, clip / N_b) / B`` (its gradient, Psi and Phi alike, so recovery stays exact for
    the clipped mean), ``N_b = ||g^_b|| + rho sigma_max(Psi_b) + rho^2 ||Phi_b||`` with ``rho`` from
    :func:`protocols.mpddp.calibration.mask_reference` (None: ``N_b = ||g^_b||``, the perturbed gradient alone).
    Replacing one of the B records moves the uploaded gradient by at most ``2 clip / B`` in L2, and given the
    server's secret R its recovered gradient divided by R (``g^_b - r^T Psi_b + v Phi_b``, Theorem 1) by at most
    ``kappa 2 clip / B`` (:func:`protocols.mpddp.calibration.secret_factor`); with ``rho = None`` the latter has
    no bound.  The norms and the sums share one forward pass.  An example whose ``N_b`` or loss is not finite adds
    nothing (:func:`protocols.per_example.clip_factors`, its forward zeroed), and so does one whose weighted terms,
    Psi's times ``rho`` and Phi's times ``rho^2``, would round on the dtype's subnormal grid (:func:`_multipliers`).

    Raises:
        ValueError: ``clip`` or ``rho`` not finite and positive, an empty batch, or a W-hat that is not finite in its
            dtype (it would make every example's terms NaN).
    """
    if not (clip > 0 and np.isfinite(clip)):
        raise ValueError(f"clip must be finite and > 0, got {clip!r}")
    if rho is not None and not (rho > 0 and np.isfinite(rho)):
        raise ValueError(f"rho must be finite and > 0, got {rho!r}")
    mats, x, y = _as_inputs(w_hat, x, y)
    if x.shape[0] == 0:
        raise ValueError("empty batch")
    if not all(bool(torch.isfinite(m).all()) for m in mats):
        raise ValueError(f"the perturbed model W-hat is not finite in {mats[0].dtype}")
    fwd = _forward(mats, x, y)
    norms = _grad_norms(mats, fwd)
    if rho is not None:
        psi_n, phi_n = _side_norms(mats, fwd)
        norms = norms + rho * psi_n + rho * rho * phi_n
    factors = clip_factors(norms, 0.5 * torch.linalg.vecdot(fwd.err, fwd.err), clip,
                           _multipliers(mats, fwd, rho) * norms.shape[0])
    if (keep := factors.keep) is not None:
        fwd = _Forward([kept_rows(keep, a) for a in fwd.inputs], [m & keep[:, None] for m in fwd.masks],
                       kept_rows(keep, fwd.h), kept_rows(keep, fwd.err))
    up = _weighted_gradients(mats, fwd, factors.scale / norms.shape[0])
    return up, float(factors.clipped) / norms.shape[0]


def client_gradients_autograd(
    w_hat: Sequence[Tensor | np.ndarray], x: Tensor | np.ndarray, y: Tensor | np.ndarray
) -> ClientUpload:
    """Reference implementation of :func:`client_gradients` with plain autograd (n_L + 2 backward passes)."""
    mats, x, y = _as_inputs(w_hat, x, y)
    mats = [m.clone() for m in mats]
    odd = mats[0::2]
    for m in odd:
        m.requires_grad_(True)
    out, last_in = forward_expanded(mats, x, return_last_input=True)
    alpha = last_in.sum(dim=1)  # (B,)
    err = out - y  # dL^/dy^ per sample
    loss = 0.5 * (err**2).sum(dim=1).mean()
    psi_scalars = (alpha.unsqueeze(1) * err).mean(dim=0)  # (n_L,)
    phi_scalar = 0.5 * (alpha**2).mean()

    def grad(scalar: Tensor) -> list[Tensor]:
        gs = torch.autograd.grad(scalar, odd, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(m) if g is None else g for m, g in zip(odd, gs, strict=True)]

    grads = grad(loss)
    phi = grad(phi_scalar)
    psi_rows = [grad(psi_scalars[k]) for k in range(psi_scalars.shape[0])]
    psi = [torch.stack([row[i] for row in psi_rows]) for i in range(len(odd))]

    return ClientUpload(_trim(grads), _trim(psi, stacked=True), _trim(phi))
