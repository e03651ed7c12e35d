"""Gradient inversion: iDLG with L-BFGS (Zhu et al. 2019; Zhao et al. 2020) and the analytic bias attack.

The attacker (the server) holds the weights it sent and a gradient inferred from one client's upload
(:mod:`benchmarks.adversary.uplink`).  With a one-sample batch:

* :func:`infer_label` (iDLG): the label is the argmin of the last layer's bias gradient;
* :func:`dlg_attack`: optimise a dummy input so that its gradient matches the target (L-BFGS, several random
  starts); ``match="cosine"`` (Geiping et al. 2020) ignores the gradient's scale, for clipped gradients;
* :func:`analytic_attack`: for a first fully connected layer with bias, ``x = dW1[i] / db1[i]`` exactly
  (Phong et al. 2017); only noise defeats it.

Reconstructions are scored by MSE and SSIM (:func:`benchmarks.adversary.ssim.ssim`) after clipping to the data's
range; the best over starts and variants (the defender's worst case) and the attacker's own choice (smallest
gradient distance) are both reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from benchmarks.adversary.ssim import ssim
from protocols.task.training import loss_fn

__all__ = ["Reconstruction", "AttackReport", "infer_label", "param_gradient", "dlg_attack", "analytic_attack",
           "score", "invert"]


@dataclass
class Reconstruction:
    """One reconstruction and its scores against the true sample."""

    variant: str  # "dlg-l2", "dlg-cosine", "dlg-whitened", "analytic" or "analytic-snr"
    x: np.ndarray  # in the model's input shape (clipped to the data range)
    grad_distance: float  # the attacker-observable objective (nan for "analytic")
    mse: float = float("nan")
    ssim: float = float("nan")


@dataclass
class AttackReport:
    """All reconstructions of one target gradient, and the summary figures."""

    label: int
    label_true: int | None
    candidates: list[Reconstruction] = field(default_factory=list)

    @property
    def best(self) -> Reconstruction:
        """Highest SSIM over every start and variant (oracle choice = defender's worst case)."""
        return max(self.candidates, key=lambda r: (np.nan_to_num(r.ssim, nan=-np.inf), -r.mse))

    @property
    def attacker_choice(self) -> Reconstruction:
        """The DLG start with the smallest gradient distance (what an attacker without the truth picks)."""
        dlg = [r for r in self.candidates if np.isfinite(r.grad_distance)]
        return min(dlg, key=lambda r: r.grad_distance) if dlg else self.best


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def param_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, loss: str, num_classes: int,
                   create_graph: bool = False) -> list[torch.Tensor]:
    """Gradient of the batch-mean training loss w.r.t. every trainable parameter (state_dict order)."""
    out = loss_fn(loss, model(x), y, num_classes)
    return list(torch.autograd.grad(out, _params(model), create_graph=create_graph))


def _as_tensors(model: nn.Module, target: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Target gradient as tensors aligned with the model's trainable parameters."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    arrays = [target[n] for n in names] if isinstance(target, Mapping) else list(target)
    if len(arrays) != len(names):
        raise ValueError(f"target gradient has {len(arrays)} arrays, the model has {len(names)} parameters")
    dtype = next(model.parameters()).dtype
    return [torch.as_tensor(np.asarray(a), dtype=dtype).reshape(p.shape) for a, p in zip(arrays, _params(model), strict=True)]


def infer_label(model: nn.Module, target: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> int:
    """Label inference of iDLG: argmin of the last layer's bias gradient (one-sample batch)."""
    grads = _as_tensors(model, target)
    bias = grads[-1]
    if bias.ndim != 1:  # last parameter is a weight: use its row sums (same sign as the output error)
        bias = bias.reshape(bias.shape[0], -1).sum(1)
    return int(torch.argmin(bias))


def _distance(dummy: list[torch.Tensor], target: list[torch.Tensor], match: str,
              weights: list[torch.Tensor] | None = None) -> torch.Tensor:
    if match == "l2":
        return sum(((d - t) ** 2).sum() for d, t in zip(dummy, target, strict=True))
    if match == "whitened":  # Gaussian log-likelihood when the attacker knows each entry's noise scale
        return sum((((d - t) * w) ** 2).sum() for d, t, w in zip(dummy, target, weights, strict=True))
    if match == "cosine":
        dot = sum((d * t).sum() for d, t in zip(dummy, target, strict=True))
        nd = torch.sqrt(sum((d * d).sum() for d in dummy))
        nt = torch.sqrt(sum((t * t).sum() for t in target))
        return 1.0 - dot / (nd * nt + 1e-30)
    raise ValueError(f"unknown gradient match {match!r}; choose l2, cosine or whitened")


def _inverse_scales(model: nn.Module, noise_scale: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """1/scale per entry, normalised to mean square 1 (scale 0 = exact entry: capped at 1e6 x the median)."""
    scales = [torch.as_tensor(np.abs(np.asarray(s, dtype=np.float64))).reshape(p.shape)
              for s, p in zip(noise_scale, _params(model), strict=True)]
    flat = torch.cat([s.reshape(-1) for s in scales])
    floor = float(flat[flat > 0].median()) * 1e-6 if bool((flat > 0).any()) else 1.0
    inv = [1.0 / s.clamp_min(floor) for s in scales]
    norm = torch.sqrt(torch.cat([w.reshape(-1) for w in inv]).pow(2).mean())
    return [w / norm for w in inv]


def dlg_attack(model: nn.Module, target: Mapping[str, np.ndarray] | Sequence[np.ndarray], *, label: int,
               input_shape: Sequence[int], num_classes: int, loss: str = "ce", match: str = "l2",
               restarts: int = 2, iterations: int = 300, seed: int = 0,
               value_range: tuple[float, float] | None = None,
               noise_scale: Sequence[np.ndarray] | None = None) -> list[Reconstruction]:
    """iDLG: one L-BFGS gradient-matching run per random start; returns every start's result.

    ``match="whitened"`` needs ``noise_scale`` (per-entry noise std known to the attacker, any common factor).
    """
    model = model.double()
    tgt = [t.double() for t in _as_tensors(model, target)]
    weights = _inverse_scales(model, noise_scale) if match == "whitened" else None
    if match == "whitened" and noise_scale is None:
        raise ValueError("match='whitened' needs noise_scale")
    y = torch.tensor([label])
    gen = torch.Generator().manual_seed(seed)
    results = []
    for _ in range(restarts):
        x = torch.randn((1, *input_shape), generator=gen, dtype=torch.float64).requires_grad_(True)
        opt = torch.optim.LBFGS([x], lr=1.0, max_iter=iterations, history_size=100, tolerance_grad=1e-12,
                                tolerance_change=1e-16, line_search_fn="strong_wolfe")

        def closure(x=x, opt=opt) -> torch.Tensor:
            opt.zero_grad()
            d = _distance(param_gradient(model, x, y, loss=loss, num_classes=num_classes, create_graph=True), tgt, match,
                          weights)
            d.backward()
            return d

        try:
            opt.step(closure)
        except RuntimeError:  # a diverging start (nan in the line search) is a failed start, not an error
            pass
        with torch.no_grad():
            xr = x.detach().clone()
            if not torch.isfinite(xr).all():
                xr = torch.zeros_like(xr)
            if value_range is not None:
                xr = xr.clamp(*value_range)
        dist = float(_distance(param_gradient(model, xr, y, loss=loss, num_classes=num_classes), tgt, match, weights))
        results.append(Reconstruction(f"dlg-{match}", xr[0].numpy(), dist if np.isfinite(dist) else float("inf")))
    return results


def analytic_attack(model: nn.Module, target: Mapping[str, np.ndarray] | Sequence[np.ndarray], *,
                    input_shape: Sequence[int], value_range: tuple[float, float] | None = None,
                    noise_scale: Sequence[np.ndarray] | None = None) -> Reconstruction | None:
    """Exact one-sample inversion through the first Linear layer with bias (None if the model has none).

    Uses the row with the largest ``|db1[i]|``, or, when the attacker knows the
    per-entry noise scale, the largest ``|db1[i]| / scale`` (best signal-to-noise).
    """
    grads = _as_tensors(model, target)
    if len(grads) < 2:
        return None
    gw, gb = grads[0].double(), grads[1].double()
    if gw.ndim != 2 or gb.ndim != 1 or gw.shape[1] != int(np.prod(input_shape)):
        return None
    snr = gb.abs()
    variant = "analytic"
    if noise_scale is not None:
        sb = torch.as_tensor(np.abs(np.asarray(noise_scale[1], dtype=np.float64))).reshape(gb.shape)
        snr = gb.abs() / sb.clamp_min(1e-300)
        variant = "analytic-snr"
    i = int(torch.argmax(snr))
    if gb[i] == 0:
        return None
    x = (gw[i] / gb[i]).reshape(tuple(input_shape))
    if value_range is not None:
        x = x.clamp(*value_range)
    return Reconstruction(variant, x.numpy(), float("nan"))


def score(rec: Reconstruction, truth: np.ndarray, data_range: float) -> Reconstruction:
    """Fill in MSE and SSIM of ``rec`` against the true sample."""
    truth = np.asarray(truth, dtype=np.float64).reshape(rec.x.shape)
    rec.mse = float(np.mean((rec.x - truth) ** 2))
    img_a = rec.x if rec.x.ndim >= 2 else rec.x[None]
    img_b = truth if truth.ndim >= 2 else truth[None]
    rec.ssim = ssim(img_a, img_b, data_range=data_range)
    return rec


def invert(model: nn.Module, target: Mapping[str, np.ndarray] | Sequence[np.ndarray], *, truth: np.ndarray,
           label_true: int | None, num_classes: int, loss: str = "ce", value_range: tuple[float, float],
           restarts: int = 2, iterations: int = 300, seed: int = 0,
           matches: Sequence[str] = ("l2", "cosine"),
           noise_scale: Sequence[np.ndarray] | None = None) -> AttackReport:
    """Run every attack variant on one target gradient and score all reconstructions.

    With ``noise_scale`` (the per-entry noise std the attacker knows, e.g. the
    mpddp server's own R) the noise-aware variants ``dlg-whitened`` and
    ``analytic-snr`` run as well.
    """
    input_shape = tuple(np.shape(truth))
    label = infer_label(model, target)
    report = AttackReport(label=label, label_true=label_true)
    data_range = float(value_range[1] - value_range[0])
    all_matches = list(matches) + (["whitened"] if noise_scale is not None else [])
    for match in all_matches:
        for rec in dlg_attack(model, target, label=label, input_shape=input_shape, num_classes=num_classes,
                              loss=loss, match=match, restarts=restarts, iterations=iterations, seed=seed,
                              value_range=value_range, noise_scale=noise_scale):
            report.candidates.append(score(rec, truth, data_range))
    for scales in (None, noise_scale) if noise_scale is not None else (None,):
        rec = analytic_attack(model, target, input_shape=input_shape, value_range=value_range, noise_scale=scales)
        if rec is not None:
            report.candidates.append(score(rec, truth, data_range))
    return report
