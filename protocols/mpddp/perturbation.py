"""MP_Server (Algorithm 1): one-time secrets r, s, gamma, r^a (Eq. 13), R and R^a (Eqs. 14, 5), W-hat (Eq. 15).

Layer indexing: original layers l = 1..L, expanded layers 1..2L-1 (odd 2l-1 = original l, even 2l =
transitional identity). Python lists are 0-based: expanded layer j lives at index j-1.
Hidden widths include the constant bias unit (see expansion.py), so r^(l), s^(l) have n_l + 1 entries.

Distributions (Eq. 13), magnitudes only (r, s must be > 0 for ReLU; the sign lives in eta/Delta):
    r^(1), s^(L-1) ~ |DN*(1)|,  r^(l) ~ |DN*(2)| for 1 < l <= L-1,  s^(l) ~ |DN*(2)| for 1 <= l < L-1.
For L = 2, r^(1) and s^(1) are both |DN*(1)| (each odd layer's R has a single factor).

gamma and r^a (the paper only says "random vectors in R^{n_L}"; only r = gamma o r^a matters):
gamma_i ~ Uniform(0.5, 1.5), r^a_i ~ N(0, additive_scale^2) with the server's :func:`output_scale` (the RMS of
the output layer): large enough to hide those weights, no larger, because the mask inflates the perturbed
gradient the client clips and noises (the excess cancels in recovery, the noise calibrated to it does not).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from protocols import prg
from protocols.mpddp.expansion import Layer, augment, dims_of, expand, odd_trainable
from protocols.mpddp.samplers import DEFAULT_TERMS, sample_dn_star

__all__ = ["MPSecret", "draw_secret", "mp_server", "output_scale", "perturb", "relative_distance"]

#: Smallest additive scale :func:`output_scale` returns (an all-zero output layer still gets a mask).
MIN_ADDITIVE_SCALE = 1e-3


def output_scale(layers: Sequence[Layer]) -> float:
    """RMS of the output layer's weights and bias: the additive mask's scale r^a ~ N(0, scale^2) (module doc)."""
    w, b = layers[-1]
    flat = torch.cat([w.reshape(-1), b.reshape(-1)]).double()
    return max(float(flat.pow(2).mean().sqrt()), MIN_ADDITIVE_SCALE)


@dataclass(frozen=True)
class MPSecret:
    """The server's one-time secret R = ({R^(j)}_{j=1}^{2L-1}, R^a) and the vectors it is built from.

    Never leaves the server. Use a fresh one every round (fresh 32-byte seed).
    """

    dims: tuple[int, ...]  # [n_0, ..., n_L] of the original (unaugmented) MLP
    r: tuple[Tensor, ...]  # r^(l), l = 1..L-1, each (n_l + 1,)
    s: tuple[Tensor, ...]  # s^(l), l = 1..L-1, each (n_l + 1,)
    gamma: Tensor  # (n_L,)
    r_a: Tensor  # (n_L,)
    R: tuple[Tensor, ...]  # 2L-1 augmented matrices (Eq. 14)
    R_a: Tensor  # (n_L, n_{L-1} + 1), R^a_ij = gamma_i r^a_i (Eq. 5)

    @property
    def num_layers(self) -> int:
        """L, the number of original layers."""
        return len(self.dims) - 1

    @property
    def r_vec(self) -> Tensor:
        """The vector r = gamma o r^a (Theorem 4)."""
        return self.gamma * self.r_a

    @property
    def v(self) -> Tensor:
        """The scalar v = r^T r (Theorem 4), a 0-dim tensor."""
        rv = self.r_vec
        return rv @ rv

    def trainable_R(self) -> list[Tensor]:
        """R^(2l-1) restricted to the trainable entries [W, b] of original layer l (constant rows dropped)."""
        return odd_trainable(self.R)


def _tensor(x: np.ndarray, dtype: torch.dtype) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def draw_secret(
    dims: Sequence[int],
    seed: bytes,
    *,
    dtype: torch.dtype = torch.float64,
    additive_scale: float = 1.0,
    terms: int = DEFAULT_TERMS,
) -> MPSecret:
    """Algorithm 1 steps 2-3: draw r, s (Eq. 13), gamma, r^a and build R (Eq. 14), R^a (Eq. 5).

    dims = [n_0, ..., n_L] (L >= 2); seed: 32 bytes (e.g. os.urandom(32)); deterministic given seed.
    """
    dims = tuple(int(d) for d in dims)
    big_l = len(dims) - 1
    if big_l < 2:
        raise ValueError("MP_Server needs L >= 2 layers")
    if additive_scale <= 0:
        raise ValueError("additive_scale must be positive")

    def draw(label: str, size: int, m: int) -> Tensor:
        sub = prg.derive_subseed(seed, label)
        return _tensor(sample_dn_star(sub, size, m, signed=False, terms=terms), dtype)

    # Eq. (13); hidden widths include the constant unit.
    r = tuple(draw(f"mpddp/r/{i}", dims[i] + 1, 1 if i == 1 else 2) for i in range(1, big_l))
    s = tuple(draw(f"mpddp/s/{i}", dims[i] + 1, 1 if i == big_l - 1 else 2) for i in range(1, big_l))
    n_out = dims[-1]
    gamma = _tensor(0.5 + prg.uniform(prg.derive_subseed(seed, "mpddp/gamma"), n_out), dtype)
    r_a = _tensor(prg.gaussian(prg.derive_subseed(seed, "mpddp/r_a"), n_out, additive_scale), dtype)

    # Eq. (14), augmented shapes: hidden odd layers (n_l+1, n_{l-1}+1), last (n_L, n_{L-1}+1).
    mats: list[Tensor] = []
    for li in range(1, big_l + 1):  # original layer li -> expanded 2li-1
        cols = dims[li - 1] + 1
        if li == 1:
            odd = r[0].unsqueeze(1).expand(-1, cols).clone()
        elif li < big_l:
            odd = torch.outer(r[li - 1], s[li - 2])
        else:
            odd = s[big_l - 2].unsqueeze(0).expand(n_out, -1).clone()
        mats.append(odd)
        if li < big_l:  # transitional layer 2li
            mats.append(torch.diag(1.0 / (s[li - 1] * r[li - 1])))
    R_a = (gamma * r_a).unsqueeze(1).expand(-1, dims[-2] + 1).clone()
    return MPSecret(dims=dims, r=r, s=s, gamma=gamma, r_a=r_a, R=tuple(mats), R_a=R_a)


def perturb(layers: Sequence[Layer], secret: MPSecret) -> list[Tensor]:
    """Algorithm 1 steps 1 and 4: expand (Eq. 12) and perturb (Eq. 15). Returns the 2L-1 matrices W-hat.

    This list is what the server sends to clients (together with nothing else).
    """
    if tuple(dims_of(layers)) != secret.dims:
        raise ValueError(f"model dims {dims_of(layers)} do not match secret dims {list(secret.dims)}")
    expanded = expand(layers)
    dtype = secret.R[0].dtype
    w_hat = [rm * w.detach().to(dtype) for rm, w in zip(secret.R, expanded, strict=True)]
    w_hat[-1] = w_hat[-1] + secret.R_a
    return w_hat


def mp_server(layers: Sequence[Layer], seed: bytes | None = None, **kwargs: object) -> tuple[list[Tensor], MPSecret]:
    """Algorithm 1: returns (W-hat to send, secret R to keep). seed=None draws os.urandom(32)."""
    secret = draw_secret(dims_of(layers), os.urandom(prg.SEED_BYTES) if seed is None else seed, **kwargs)
    return perturb(layers, secret), secret


def relative_distance(layers: Sequence[Layer], w_hat: Sequence[Tensor]) -> dict[str, object]:
    """How far what a client receives is from the true model, on the trainable entries [W, b].

    Returns {"overall": ||W-hat_odd - W|| / ||W|| (Frobenius over all layers), "per_layer": the same per
    original layer, "row_cosine": per layer, mean cosine similarity between true and received rows}.
    Transitional layers carry no model information (identity) and are excluded. row_cosine exposes
    what the Frobenius figure hides: layer 1 is only row-scaled (R^(1)_ij = r_i > 0), so its rows keep
    their direction exactly (cosine 1) however large the distance.
    """
    true_blocks = [m[:-1] if i < len(layers) - 1 else m for i, m in enumerate(augment(layers))]
    pert_blocks = odd_trainable(w_hat)
    num = den = 0.0
    per_layer: list[float] = []
    row_cos: list[float] = []
    for t, p in zip(true_blocks, pert_blocks, strict=True):
        t64, p64 = t.detach().double(), p.detach().double()
        d2 = float(((p64 - t64) ** 2).sum())
        n2 = float((t64**2).sum())
        per_layer.append((d2 / n2) ** 0.5 if n2 > 0 else float("inf"))
        row_cos.append(float(torch.nn.functional.cosine_similarity(t64, p64, dim=1).mean()))
        num += d2
        den += n2
    return {
        "overall": (num / den) ** 0.5 if den > 0 else float("inf"),
        "per_layer": per_layer,
        "row_cosine": row_cos,
    }
