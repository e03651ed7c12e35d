"""Local training and evaluation loops (on the model's device, deterministic given a seed on CPU)."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from protocols.per_example import Descent, PerExampleClipper
from protocols.task.models import seed_torch


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters live (run-config ``device``; CPU for a model without parameters)."""
    return next(model.parameters(), torch.empty(0)).device


def on_device(model: nn.Module, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    """``arrays`` as tensors on ``model``'s device, floating ones in its dtype (training and evaluation follow it)."""
    first = next(model.parameters(), torch.empty(0))
    with warnings.catch_warnings():  # read-only arrays (the memory-mapped data cache) are never written through
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        out = (torch.as_tensor(a, device=first.device) for a in arrays)
        return tuple(t.to(first.dtype) if t.is_floating_point() else t for t in out)


def _batches(n: int, batch_size: int, rng: np.random.Generator):
    """Shuffled consecutive batches, the last one possibly smaller (as local_sgd_sensitivity assumes)."""
    order = rng.permutation(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


def loss_fn(name: str, logits: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``ce`` (cross-entropy) or ``mse`` on one-hot targets (needed by mpddp's theory)."""
    if name == "ce":
        return nn.functional.cross_entropy(logits, y)
    if name == "mse":
        target = nn.functional.one_hot(y, num_classes).to(logits.dtype)
        return 0.5 * ((logits - target) ** 2).sum(1).mean()
    raise ValueError(f"unknown loss {name!r}")


def train(model: nn.Module, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
          seed: int, grad_clip: float | None = None) -> float:
    """Plain SGD on the cross-entropy for ``epochs`` over (x, y); returns the mean training loss of the last epoch.

    ``grad_clip`` bounds each mini-batch gradient's L2 norm (used by NADP-FL and
    LaDP-FL, whose sensitivity analysis assumes clipped gradients).
    """
    seed_torch(seed)
    rng = np.random.default_rng(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    xt, yt = on_device(model, x, y)
    model.train()
    last = 0.0
    for _ in range(epochs):
        total, count = 0.0, 0
        for idx in _batches(len(y), batch_size, rng):
            opt.zero_grad()
            out = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            out.backward()
            if grad_clip is not None:
                clip_grad_(params, grad_clip)
            opt.step()
            total += float(out.detach()) * len(idx)
            count += len(idx)
        last = total / max(count, 1)
    return last


@torch.no_grad()
def clip_grad_(params: list[torch.Tensor], max_norm: float) -> float:
    """Scale the gradients of ``params`` in place to joint L2 norm <= ``max_norm``; returns the norm before.

    Same result as ``nn.utils.clip_grad_norm_`` (up to its 1e-6 guard) at a third of its per-step
    overhead, which dominated LaDP's small-batch steps on small models.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    if norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, *, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on (x, y)."""
    model.eval()
    xt, yt = on_device(model, x, y)
    loss, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(xt[start:start + batch_size]).float()
        loss += float(nn.functional.cross_entropy(logits, yt[start:start + batch_size], reduction="sum"))
        correct += int((logits.argmax(1) == yt[start:start + batch_size]).sum())
    n = max(len(y), 1)
    return loss / n, correct / n


# ------------------------------------------------- per-example clipped training (record-level DP)
#: Batches gathered together by :func:`clipped_sgd` (one indexing op per block instead of one per batch; the block's
#: copy of the inputs stays small whatever the local dataset's size).
_GATHER_BATCHES = 64


def clipped_sgd(model: nn.Module, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
                clip: float, seed: int, recentre: bool = False) -> tuple[float, float]:
    """SGD where each step uses the mean of per-example gradients clipped to L2 norm ``clip``.

    Batches as :func:`_batches` draws them from ``seed``; each step is
    :meth:`protocols.per_example.PerExampleClipper.descend` with step size ``lr / len(batch)``.
    Returns (mean training loss of the last epoch, fraction of clipped examples).

    ``recentre``: train the update ``u = w - w_0`` from the received weights ``w_0`` (:class:`_Recentred`): the
    steps are added to ``u``, so their rounding is relative to the update, not to the weights, whatever the model's
    norm; forward and backward run at ``w_0 + u`` rounded to the model's dtype.  The model then returns in float64,
    holding ``w_0 + u``.
    """
    rng = np.random.default_rng(seed)
    xt, yt = on_device(model, x, y)  # run-config 'device': the model's device
    n = len(yt)
    block = batch_size * _GATHER_BATCHES
    model.train()
    last, clipped = 0.0, []
    update = _Recentred(model) if recentre else None
    with PerExampleClipper(model, clip) as clipper:  # inspects and instruments the model once, not per step
        for _ in range(epochs):
            order = torch.as_tensor(rng.permutation(n), device=xt.device)  # the order _batches draws
            losses = []
            for first in range(0, n, block):  # one gather per block of batches: each batch is a view of it
                xs, ys = xt[order[first:first + block]], yt[order[first:first + block]]
                for start in range(0, len(ys), batch_size):
                    xb, yb = xs[start:start + batch_size], ys[start:start + batch_size]
                    if update is None:
                        step = clipper.descend(xb, yb, lr / len(yb))
                    else:
                        step = update.descend(clipper, xb, yb, lr / len(yb))
                    losses.append(step.losses)
                    clipped.append(step.clipped)
            last = float(torch.cat(losses).double().sum()) / n if losses else 0.0
    if update is not None:
        update.finish()
    return last, float(torch.stack(clipped).sum()) / (n * epochs) if clipped else 0.0


class _Recentred:
    """Local training of the update ``u = w - w_0`` of a model's trainable parameters, for :func:`clipped_sgd`.

    Each step adds ``-s * sum_i clip(g_i, C)`` to ``u`` (in the parameter's dtype: its rounding is relative to the
    update, at most the training's movement, not to ``w_0``) and sets the parameter to ``w_0 + u`` rounded, where
    the next gradients are evaluated.  Where they are evaluated does not enter the sensitivity
    (:func:`protocols.privacy.local_sgd_sensitivity` bounds every later step by ``2 C lr`` at any weights).  One
    fused addition per parameter and step.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.trained = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            self.start = [p.detach().clone() for p in self.trained]
            self.update = [torch.zeros_like(p) for p in self.trained]
        self.weights = [p.detach() for p in self.trained]  # the parameters' storage, without autograd's dispatch
        by_id = {id(p): u for p, u in zip(self.trained, self.update, strict=True)}
        self.into = [by_id.get(id(p), p) for p in model.parameters()]  # a frozen parameter takes no step

    def descend(self, clipper: PerExampleClipper, x: torch.Tensor, y: torch.Tensor, step: float) -> Descent:
        """One step of ``clipper`` on the batch ``(x, y)``, added to the update (then the parameters moved to it)."""
        out = clipper.descend(x, y, step, into=self.into)
        for w, w0, u in zip(self.weights, self.start, self.update, strict=True):
            torch.add(w0, u, out=w)
        return out

    @torch.no_grad()
    def finish(self) -> None:
        """Convert the model to float64 holding ``w_0 + u`` (no final rounding to the training dtype)."""
        self.model.double()
        for p, w0, u in zip([p for p in self.model.parameters() if p.requires_grad], self.start, self.update,
                            strict=True):
            torch.add(w0.double(), u.double(), out=p)
