"""Membership inference by loss threshold (Yeom et al., CSF 2018) against a released model.

The attacker holds the model a client receives (the global model, or for the
mpddp family the perturbed model the server sends) and a candidate sample; it
guesses "member" when the model's loss on the sample is small.  Evaluation is
balanced: as many members (training samples of the federation) as non-members
(test samples), so 0.5 is guessing.  Reported:

* ``accuracy`` -- threshold chosen on one half of the members/non-members (an
  attacker with some labelled examples, the strong setting) and evaluated on the
  other half (no optimistic bias);
* ``yeom_accuracy`` -- Yeom's rule, threshold = the mean training loss (what a
  client learns from the reported ``train_loss``); evaluated on all samples;
* ``auc`` -- threshold-free ranking quality (0.5 = guessing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["MembershipResult", "per_sample_loss", "loss_threshold_attack", "auc"]


@dataclass(frozen=True)
class MembershipResult:
    """Balanced loss-threshold attack figures (0.5 = guessing)."""

    accuracy: float
    yeom_accuracy: float
    auc: float
    member_loss: float  # median loss on members (robust to the huge losses of noisy models)
    nonmember_loss: float  # median loss on non-members
    samples: int  # members evaluated (= non-members evaluated)


@torch.no_grad()
def per_sample_loss(forward: Callable[[torch.Tensor], torch.Tensor], x: np.ndarray, y: np.ndarray, *,
                    loss: str = "ce", num_classes: int = 10, batch_size: int = 1024) -> np.ndarray:
    """Per-sample loss of a model given as its forward function (``ce`` or ``mse`` on one-hot targets)."""
    out = []
    for start in range(0, len(y), batch_size):
        xb = torch.as_tensor(x[start:start + batch_size])
        yb = torch.as_tensor(y[start:start + batch_size])
        logits = forward(xb).double()
        if loss == "ce":
            out.append(nn.functional.cross_entropy(logits, yb, reduction="none").numpy())
        elif loss == "mse":
            target = nn.functional.one_hot(yb, num_classes).double()
            out.append((0.5 * ((logits - target) ** 2).sum(1)).numpy())
        else:
            raise ValueError(f"unknown loss {loss!r}")
    return np.concatenate(out) if out else np.zeros(0)


def auc(member_losses: np.ndarray, nonmember_losses: np.ndarray) -> float:
    """P(loss of a random member < loss of a random non-member), ties counted 1/2 (Mann-Whitney)."""
    m = np.asarray(member_losses, dtype=np.float64)
    n = np.asarray(nonmember_losses, dtype=np.float64)
    allv = np.concatenate([m, n])
    ranks = _average_ranks(allv)
    r_non = ranks[len(m):].sum()
    return float((r_non - len(n) * (len(n) + 1) / 2) / (len(m) * len(n)))


def _average_ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(1, len(v) + 1)
    sv = v[order]
    # average the ranks of ties
    _, first, counts = np.unique(sv, return_index=True, return_counts=True)
    for f, c in zip(first, counts, strict=True):
        if c > 1:
            ranks[order[f:f + c]] = (2 * f + c + 1) / 2
    return ranks


def _balanced_accuracy(member: np.ndarray, nonmember: np.ndarray, threshold: float) -> float:
    """Mean of TPR (members with loss <= t) and TNR (non-members with loss > t)."""
    return 0.5 * (float(np.mean(member <= threshold)) + float(np.mean(nonmember > threshold)))


def _best_threshold(member: np.ndarray, nonmember: np.ndarray) -> float:
    """Threshold maximising balanced accuracy on (member, nonmember); -inf if nothing beats guessing."""
    cands = np.unique(np.concatenate([member, nonmember]))
    tpr = np.searchsorted(np.sort(member), cands, side="right") / len(member)
    tnr = 1.0 - np.searchsorted(np.sort(nonmember), cands, side="right") / len(nonmember)
    acc = 0.5 * (tpr + tnr)
    i = int(np.argmax(acc))
    return float(cands[i]) if acc[i] > 0.5 else -np.inf


def loss_threshold_attack(member_losses: np.ndarray, nonmember_losses: np.ndarray, *,
                          train_loss: float | None = None, seed: int = 0) -> MembershipResult:
    """Balanced loss-threshold attack; ``train_loss`` (mean training loss) is Yeom's threshold.

    Equal numbers of members and non-members are drawn (seeded); the threshold
    of ``accuracy`` is fitted on a random half of each and scored on the rest.
    """
    rng = np.random.default_rng(seed)
    # A diverged model gives nan losses; count them as "very large" (= predicted non-member), not as errors.
    m = np.nan_to_num(np.asarray(member_losses, dtype=np.float64), nan=np.inf)
    n = np.nan_to_num(np.asarray(nonmember_losses, dtype=np.float64), nan=np.inf)
    k = min(len(m), len(n))
    if k < 2:
        raise ValueError("need at least 2 members and 2 non-members")
    m, n = rng.permutation(m)[:k], rng.permutation(n)[:k]
    h = k // 2
    t = _best_threshold(m[:h], n[:h])
    acc = _balanced_accuracy(m[h:], n[h:], t)
    yeom_t = float(np.mean(m)) if train_loss is None else float(train_loss)
    return MembershipResult(
        accuracy=acc,
        yeom_accuracy=_balanced_accuracy(m, n, yeom_t),
        auc=auc(m, n),
        member_loss=float(np.median(m)),
        nonmember_loss=float(np.median(n)),
        samples=k,
    )
