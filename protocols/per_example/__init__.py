"""Per-example gradient clipping at about the cost of one backward pass (L2 for DP-SGD, L1 for DDP-SA).

Record-level DP methods need ``sum_i clip(g_i, C)`` over a batch, ``g_i`` the gradient of example i's loss and
``clip`` rescaling it to norm ``<= C``.  Three engines compute it:

* the fused step of the built-in MLP under the cross-entropy (:mod:`.fused_mlp`: explicit forward, backward and
  clipped update, no autograd graph), faster than a plain autograd step;
* layer-wise closed forms (:mod:`.closed_forms`, on the layer inputs and output gradients that
  :mod:`.recorder` notes during one forward and one backward) for models whose trainable parameters are all in
  ``nn.Linear`` / ``nn.Conv2d`` layers, each called once per forward;
* materialised per-example gradients (:mod:`.vmap`, ``torch.func``), for every other model and as the reference
  the tests compare against.

:class:`PerExampleClipper` (:mod:`.clipper`) picks the engine per model and logs the choice once per model class.
All need a forward pass in which examples do not interact (no batch norm in train mode).  All weigh each example by
:func:`.interface.clip_factors`, the one rule for an example whose gradient or loss is not finite: it adds nothing.
"""

from protocols.per_example.clipper import PerExampleClipper, clipped_grad_sum, fast_path_blocker
from protocols.per_example.interface import (
    ClipFactors,
    ClippedSum,
    Descent,
    Norm,
    PerExampleLoss,
    clip_factors,
    cross_entropy,
    kept_rows,
)
from protocols.per_example.vmap import per_example_gradients, vmap_clipped_grad_sum

__all__ = [
    "ClipFactors",
    "ClippedSum",
    "Descent",
    "Norm",
    "PerExampleClipper",
    "PerExampleLoss",
    "clip_factors",
    "clipped_grad_sum",
    "cross_entropy",
    "fast_path_blocker",
    "kept_rows",
    "per_example_gradients",
    "vmap_clipped_grad_sum",
]
