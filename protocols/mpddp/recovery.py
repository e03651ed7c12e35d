"""MU_Server (Algorithm 3): aggregate (Eqs. 20, 21), recover (Eq. 22), update (xi, or a server optimizer).

    grad F(W_org^(l)) = R^(2l-1) o (grad F^(W^^(2l-1)) - r^T Psi^(2l-1) + v Phi^(2l-1)),  l = 1..L,

where r^T Psi contracts Psi's leading n_L axis with r = gamma o r^a. With DDP_Client noise the result is
the true mean gradient + R o mean_k(eta_k) (the Delta's cancel in the plain mean over the K clients).
Algorithm 3 prints the update for "1 <= l < L"; all L layers must be updated (Theorem 4 covers
l = 1..L), so we update every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from protocols.mpddp.expansion import Layer, split_blocks
from protocols.mpddp.gradients import ClientUpload
from protocols.mpddp.perturbation import MPSecret
from protocols.server_optimizers import ServerOptimizer

__all__ = ["aggregate", "mu_server", "optimizer_update", "recover", "recover_blocks"]


def aggregate(uploads: Sequence[ClientUpload]) -> ClientUpload:
    """Eqs. (20), (21): plain (unweighted) mean over the K uploads of grads, Psi and Phi.

    Unweighted on purpose: the pairwise Delta's only cancel in an unweighted sum.
    """
    if not uploads:
        raise ValueError("no uploads to aggregate")
    k = len(uploads)

    def mean(parts: Sequence[Sequence[Tensor]]) -> tuple[Tensor, ...]:
        out = []
        for ts in zip(*parts, strict=True):
            acc = ts[0].clone()  # running sum in upload order: no k-fold stacked copy
            for t in ts[1:]:
                acc.add_(t)
            out.append(acc.div_(k))
        return tuple(out)

    return ClientUpload(mean([u.grads for u in uploads]), mean([u.psi for u in uploads]), mean([u.phi for u in uploads]))


def recover_blocks(agg: ClientUpload, secret: MPSecret) -> list[Tensor]:
    """Eq. (22) on trainable blocks [W, b]: returns the recovered gradient per original layer."""
    if agg.num_layers != secret.num_layers:
        raise ValueError("upload and secret have different numbers of layers")
    dtype = agg.grads[0].dtype
    r = secret.r_vec.to(dtype)
    v = secret.v.to(dtype)
    out = []
    for g, psi, phi, rm in zip(agg.grads, agg.psi, agg.phi, secret.trainable_R(), strict=True):
        if rm.shape != g.shape:
            raise ValueError(f"gradient block {tuple(g.shape)} does not match R {tuple(rm.shape)}")
        correction = -torch.einsum("k,kij->ij", r, psi.to(dtype)) + v * phi.to(dtype)
        out.append(rm.to(dtype) * (g + correction))
    return out


def recover(agg: ClientUpload, secret: MPSecret) -> list[Layer]:
    """Eq. (22): recovered aggregate gradient as (dW, db) per original layer."""
    return split_blocks(recover_blocks(agg, secret))


def optimizer_update(layers: Sequence[Layer], grads: Sequence[Layer], optimizer: ServerOptimizer) -> list[Layer]:
    """One step of a server optimizer (:mod:`protocols.server_optimizers`) on every layer; returns new tensors."""
    flat = optimizer.step([t.detach().cpu().numpy() for layer in layers for t in layer],
                          [t.detach().cpu().numpy() for grad in grads for t in grad])
    new = [torch.from_numpy(a).to(layers[0][0].dtype) for a in flat]
    return [(new[2 * i], new[2 * i + 1]) for i in range(len(layers))]


def mu_server(layers: Sequence[Layer], mean: ClientUpload, secret: MPSecret,
              optimizer: ServerOptimizer) -> tuple[list[Layer], list[Layer]]:
    """Algorithm 3 from the mean upload: recover (Eq. 22), update every layer with ``optimizer``.

    The paper's xi step ``W <- W - xi grad`` is ``make_server_optimizer("sgd", xi)``; Adam is
    post-processing of the released gradient, no privacy cost.  ``mean`` is the unweighted mean of Eqs. (20),
    (21): :func:`aggregate`, or a server's streamed mean of the wire records (bit-identical).
    Returns (new model, recovered aggregate gradient).
    """
    grads = recover(mean, secret)
    return optimizer_update(layers, grads, optimizer), grads
