"""MLP representation, bias handling and the 2L-1 layer expansion of Eq. (12).

The paper's MLP has no biases (``y^(l) = ReLU(W^(l) y^(l-1))``, linear output, loss ``1/2 ||y - ybar||^2``).
Biases are handled by homogeneous coordinates, so the paper applies verbatim to an equivalent bias-free network:
every activation gets a last constant unit 1; hidden layer l becomes ``[[W, b], [0...0, 1]]`` (ReLU(1) = 1
keeps the unit), the output layer ``[W, b]``.  The constant unit gets its own ``r_c, s_c`` in MP_Server like any
hidden unit; its row is not trainable and is dropped from the upload.  A client can read ``1/s_c`` from the
constant unit, so bias columns are hidden only up to the row scale ``r_i``, as the paper accepts for layer 1.

Models are lists of ``(W, b)`` torch tensors in ``torch.nn.Linear`` layout (W: (out, in), b: (out,));
expanded/augmented models are lists of matrices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Layer = tuple[Tensor, Tensor]

__all__ = [
    "Layer",
    "augment",
    "augment_input",
    "dims_of",
    "expand",
    "forward_expanded",
    "forward_mlp",
    "mse_loss",
    "odd_trainable",
    "one_hot",
    "split_blocks",
]


def dims_of(layers: Sequence[Layer]) -> list[int]:
    """[n_0, n_1, ..., n_L] of an MLP given as (W, b) pairs (validated)."""
    if len(layers) < 2:
        raise ValueError("MP_Server needs an MLP with L >= 2 layers (Eq. 14 needs r^(1) and s^(L-1))")
    dims = [int(layers[0][0].shape[1])]
    for i, (w, b) in enumerate(layers):
        if w.ndim != 2 or b.shape != (w.shape[0],) or w.shape[1] != dims[-1]:
            raise ValueError(f"layer {i}: inconsistent shapes W{tuple(w.shape)} b{tuple(b.shape)}")
        dims.append(int(w.shape[0]))
    return dims


def augment(layers: Sequence[Layer]) -> list[Tensor]:
    """Homogeneous matrices of the MLP: [[W, b], [0, 1]] for hidden layers, [W, b] for the last."""
    dims_of(layers)
    out: list[Tensor] = []
    for i, (w, b) in enumerate(layers):
        m = torch.cat([w, b.unsqueeze(1)], dim=1)
        if i < len(layers) - 1:
            const_row = torch.zeros(1, m.shape[1], dtype=m.dtype, device=m.device)
            const_row[0, -1] = 1.0
            m = torch.cat([m, const_row], dim=0)
        out.append(m)
    return out


def split_blocks(blocks: Sequence[Tensor]) -> list[Layer]:
    """Trainable blocks [W, b] (shape (n_l, n_{l-1}+1)) back to (W, b) pairs."""
    return [(m[:, :-1], m[:, -1]) for m in blocks]


def expand(layers: Sequence[Layer]) -> list[Tensor]:
    """Eq. (12): 2L-1 augmented matrices; odd (1-based) = original layers, even = identity (n_l+1)."""
    aug = augment(layers)
    out: list[Tensor] = []
    for i, m in enumerate(aug):
        out.append(m)
        if i < len(aug) - 1:
            out.append(torch.eye(m.shape[0], dtype=m.dtype, device=m.device))
    return out


def augment_input(x: Tensor) -> Tensor:
    """Append the constant-1 unit to a batch of inputs (B, n_0) -> (B, n_0 + 1)."""
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)


def forward_expanded(mats: Sequence[Tensor], x: Tensor, *, return_last_input: bool = False):
    """Forward pass of an (optionally perturbed) expanded model on raw inputs x (B, n_0).

    ReLU after every layer except the last (transitional identity layers included, Eq. 12).
    With return_last_input=True also returns the input of the final layer, y^(2L-2) (B, n_{L-1}+1).
    """
    h = augment_input(x)
    for mat in mats[:-1]:
        h = torch.relu(h @ mat.T)
    out = h @ mats[-1].T
    return (out, h) if return_last_input else out


def forward_mlp(layers: Sequence[Layer], x: Tensor) -> Tensor:
    """Plain forward pass of the original MLP (ReLU hidden layers, linear output)."""
    h = x
    for i, (w, b) in enumerate(layers):
        h = h @ w.T + b
        if i < len(layers) - 1:
            h = torch.relu(h)
    return h


def mse_loss(out: Tensor, target: Tensor) -> Tensor:
    """The paper's loss: 1/2 ||y - ybar||_2^2 per sample, averaged over the batch (F(W, D_k))."""
    return 0.5 * ((out - target) ** 2).sum(dim=1).mean()


def one_hot(labels: Tensor, num_classes: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """One-hot targets ybar for the MSE loss."""
    return torch.nn.functional.one_hot(labels.long(), num_classes).to(dtype)


def odd_trainable(mats: Sequence[Tensor]) -> list[Tensor]:
    """Trainable blocks [W, b] of the odd (original) layers of an expanded model (constant rows dropped)."""
    odd = list(mats[0::2])
    return [m[:-1] if i < len(odd) - 1 else m for i, m in enumerate(odd)]
