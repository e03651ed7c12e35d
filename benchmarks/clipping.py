"""Per-example clipping throughput: our clipping (fused MLP step, layer-wise engine) against Opacus and vmap.

    cancelfl-bench clipping [--models mlp,cnn] [--batch-sizes 32,256] [--repeats 5] [--clip 1.0]
    python -m benchmarks.clipping [same options]

Examples per second of ``sum_i clip(g_i, C)`` on MNIST batches (the real images from the
shared data folder, random ones of the same shape if it is missing), one thread, for the
MLP 784-128-10 and the SmallCNN of :mod:`protocols.task.models`:

* L2: :func:`protocols.per_example.clipped_grad_sum` (``ours-fused-mlp`` on the MLP, with the layer-wise engine
  beside it, ``layer-wise-engine``; ``ours-layer-wise`` on the CNN) against Opacus' ``GradSampleModule``
  (``opacus-grad-sample``: per-sample gradients by hooks, then ``DPOptimizer.clip_and_accumulate``) and
  ``GradSampleModuleFastGradientClipping`` with ghost clipping (``opacus-ghost-clipping``, two backward passes);
* L1 (DDP-SA): the same function with ``norm="l1"`` against our ``torch.func`` vmap reference
  (:func:`protocols.per_example.vmap_clipped_grad_sum`, ``vmap-reference``);
* a plain forward and backward of the summed loss as the floor (``plain-forward-backward``; ``x plain`` = time /
  its time);
* one training step: FedAvg's plain SGD step (``plain-sgd-step``: autograd, ``torch.optim.SGD``) against
  record-level training's clipped step (``ours-sgd-step``: :meth:`protocols.per_example.PerExampleClipper.descend`),
  both at step size 0 (``x_plain_sgd`` = time / the plain step's).

Repeats are interleaved and reported as medians; every competitor's clipped sum is checked
against ours on the timed batch (``max rel diff``; Opacus adds 1e-6 to the norm). Opacus is
a benchmark-only dependency (``pip install -e .[bench]``); without it its rows say so.
Also times the DDP-SA client's clipped L1 gradient sum over one client's MNIST examples
(``--ddpsa-examples``), the main cost of its round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from protocols.per_example import (
    PerExampleClipper,
    clipped_grad_sum,
    cross_entropy,
    fast_path_blocker,
    vmap_clipped_grad_sum,
)
from protocols.per_example.fused_mlp import FusedMLP
from protocols.task.models import build_model

HELP = "per-example clipping examples/s: ours vs Opacus (L2) and the vmap reference (L1)"
#: What ``cancelfl-bench reproduce`` compares (column -> relative tolerance) and the row key.
FIGURES: dict[str, float] = {"x_plain": 0.3, "ours_speedup": 0.3, "x_plain_sgd": 0.3}
KEY = ("model", "batch", "norm", "implementation")
COLUMNS = ("model", "batch", "norm", "implementation", "examples_per_s", "x_plain", "ours_speedup", "max_rel_diff",
           "x_plain_sgd")

Step = Callable[[], list[torch.Tensor]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench clipping``."""
    p.add_argument("--models", default="mlp,cnn", help="comma list of mlp (784-128-10) and cnn (SmallCNN)")
    p.add_argument("--batch-sizes", default="32,256", help="nadp trains with batch-size (32); ddpsa sums 256 at a time")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians are reported")
    p.add_argument("--min-time", type=float, default=0.25, help="seconds each timing runs at least")
    p.add_argument("--ddpsa-examples", type=int, default=6000, help="0 skips the DDP-SA client-step timing")
    p.add_argument("--data-dir", default="")
    p.add_argument("--out", default="runs/bench/clipping")


def mnist_batch(n: int, data_dir: str, notes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` MNIST training images (N, 1, 28, 28) and labels; random ones if MNIST is missing."""
    from protocols.task.data import load_dataset

    try:
        ds = load_dataset("mnist", data_dir, train_subset=n)
        x, y = ds.x_train[:n].reshape(-1, 1, 28, 28), ds.y_train[:n]
    except (FileNotFoundError, ValueError) as err:
        notes.append(f"MNIST not found ({err}); random images of MNIST shape")
        rng = np.random.default_rng(0)
        x, y = rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)
    return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64)


def model_for(name: str) -> nn.Module:
    """``mlp`` (784-128-10) or ``cnn`` (SmallCNN) with fixed initial weights."""
    return build_model(name, (1, 28, 28), 10, (128,), seed=0)


def seconds_per_call(step: Step, min_time: float) -> float:
    """Mean wall time of ``step`` over as many calls as fit in ``min_time`` (at least one, after a warm-up)."""
    step()
    calls, t0 = 0, time.perf_counter()
    while True:
        step()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            return elapsed / calls


# ------------------------------------------------------------------ competitors
def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    """One forward and backward of the summed loss (no clipping): the floor."""
    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        return [p.grad for p in model.parameters()]

    return step


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    """One plain SGD step as FedAvg's local training takes it (autograd on the mean loss, ``torch.optim.SGD``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step() -> list[torch.Tensor]:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return [p.grad for p in model.parameters()]

    return step


def descend_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> Step:
    """One clipped SGD step as record-level training takes it (:meth:`PerExampleClipper.descend`, one clipper)."""
    clipper = PerExampleClipper(model, clip)
    return lambda: [clipper.descend(x, y, 0.0).losses]


def ours_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, norm: str) -> Step:
    """:func:`protocols.per_example.clipped_grad_sum`."""
    return lambda: clipped_grad_sum(model, x, y, clip, norm=norm).grads


def layerwise_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, norm: str) -> Step:
    """The recorded layer-wise engine on a model the fused MLP step would take (for comparison)."""
    def step() -> list[torch.Tensor]:
        with PerExampleClipper(model, clip, norm=norm, fused=False) as clipper:
            return clipper(x, y).grads

    return step


def ours_label(model: nn.Module) -> str:
    """The implementation column of our rows: the engine :class:`protocols.per_example.PerExampleClipper` takes."""
    if FusedMLP.of(model, "l2", cross_entropy) is not None:
        return "ours-fused-mlp"
    return "ours-layer-wise" if fast_path_blocker(model) is None else "ours-vmap"


def vmap_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, norm: str) -> Step:
    """:func:`protocols.per_example.vmap_clipped_grad_sum` (materialised per-example gradients)."""
    return lambda: vmap_clipped_grad_sum(model, x, y, clip, norm=norm).grads


def opacus_steps(model_name: str, x: torch.Tensor, y: torch.Tensor, clip: float) -> dict[str, Step]:
    """Opacus' clipped sums: ``GradSampleModule`` + ``clip_and_accumulate``, and ghost clipping."""
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    # Opacus' hooks warn on every backward when the input does not require a gradient (it need not here).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    hooks = GradSampleModule(model_for(model_name), loss_reduction="sum")
    dp_opt = DPOptimizer(torch.optim.SGD(hooks.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=clip,
                         expected_batch_size=len(y), loss_reduction="sum")

    def grad_sample() -> list[torch.Tensor]:
        dp_opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(hooks(x), y, reduction="sum").backward()
        dp_opt.clip_and_accumulate()
        return [p.summed_grad for p in hooks.parameters()]

    ghost_model = GradSampleModuleFastGradientClipping(model_for(model_name), max_grad_norm=clip,
                                                       use_ghost_clipping=True, loss_reduction="sum")
    ghost_opt = DPOptimizerFastGradientClipping(torch.optim.SGD(ghost_model.parameters(), lr=0.0), noise_multiplier=0.0,
                                                max_grad_norm=clip, expected_batch_size=len(y), loss_reduction="sum")
    criterion = DPLossFastGradientClipping(ghost_model, ghost_opt, nn.CrossEntropyLoss(reduction="sum"), "sum")

    def ghost() -> list[torch.Tensor]:
        ghost_opt.zero_grad(set_to_none=True)
        criterion(ghost_model(x), y).backward()
        return [p.grad for p in ghost_model.parameters()]

    return {"opacus-grad-sample": grad_sample, "opacus-ghost-clipping": ghost}


def max_rel_diff(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Largest per-parameter ``||got - ref|| / ||ref||``."""
    return max(float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, ref, strict=True))


# ------------------------------------------------------------------ measurement
def measure(model_name: str, batch: int, x_all: torch.Tensor, y_all: torch.Tensor, args: argparse.Namespace,
            notes: list[str]) -> list[dict]:
    """Rows of one model and batch size: plain, then L2 (ours, Opacus x2), then L1 (ours, vmap)."""
    x, y = x_all[:batch], y_all[:batch]
    model = model_for(model_name)
    label = ours_label(model)
    candidates: list[tuple[str, str, Step]] = [("-", "plain-forward-backward", plain_step(model, x, y))]
    for norm in ("l2", "l1"):
        candidates.append((norm, label, ours_step(model, x, y, args.clip, norm)))
        if label == "ours-fused-mlp":
            candidates.append((norm, "layer-wise-engine", layerwise_step(model, x, y, args.clip, norm)))
        if norm == "l2":
            try:
                candidates += [("l2", name, step) for name, step in opacus_steps(model_name, x, y, args.clip).items()]
            except ImportError as err:
                note = f"Opacus not installed ({err}); pip install -e .[bench]"
                notes += [] if note in notes else [note]
    candidates.append(("l1", "vmap-reference", vmap_step(model, x, y, args.clip, "l1")))
    candidates.append(("-", "plain-sgd-step", sgd_step(model, x, y)))
    candidates.append(("l2", "ours-sgd-step", descend_step(model, x, y, args.clip)))
    times: dict[int, list[float]] = {i: [] for i in range(len(candidates))}
    for _ in range(args.repeats):
        for i, (_, _, step) in enumerate(candidates):
            times[i].append(seconds_per_call(step, args.min_time))
    median = {i: statistics.median(t) for i, t in times.items()}
    ours = {norm: median[i] for i, (norm, name, _) in enumerate(candidates) if name == label}
    reference = {norm: step() for norm, name, step in candidates if name == label}
    rows = []
    plain_sgd = next(i for i, c in enumerate(candidates) if c[1] == "plain-sgd-step")
    for i, (norm, name, step) in enumerate(candidates):
        row = {"model": model_name, "batch": batch, "norm": norm, "implementation": name,
               "examples_per_s": batch / median[i], "x_plain": median[i] / median[0]}
        if norm in ours and not name.endswith("sgd-step"):
            row["ours_speedup"] = median[i] / ours[norm]
            row["max_rel_diff"] = max_rel_diff(step(), reference[norm])
        if name.endswith("sgd-step"):
            row["x_plain_sgd"] = median[i] / median[plain_sgd]
        rows.append(row)
    return rows


def ddpsa_client_seconds(x: torch.Tensor, y: torch.Tensor, clip: float) -> float:
    """Wall time of the DDP-SA client's clipped L1 gradient sum over ``len(y)`` examples (MLP 784-128-10)."""
    from client.methods.ddpsa import clipped_gradient_sum

    model = model_for("mlp")
    t0 = time.perf_counter()
    clipped_gradient_sum(model, x.numpy(), y.numpy(), clip)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    """Measure, print the Markdown table and write ``clipping.csv``/``clipping.md`` into ``--out``."""
    from benchmarks.common import command_line, write_table

    notes: list[str] = []
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    x_all, y_all = mnist_batch(max([*batches, args.ddpsa_examples]), args.data_dir, notes)
    for name in models:
        notes.append(f"{name}: {ours_label(model_for(name)).removeprefix('ours-')} path")
    rows: list[dict] = []
    for name in models:
        for batch in batches:
            rows += measure(name, batch, x_all, y_all, args, notes)
            print(f"  {name} batch {batch}: done", file=sys.stderr, flush=True)
    if args.ddpsa_examples:
        secs = ddpsa_client_seconds(x_all[:args.ddpsa_examples], y_all[:args.ddpsa_examples], args.clip)
        notes.append(f"DDP-SA client step (clipped L1 gradient sum, MLP 784-128-10) over {args.ddpsa_examples:,} "
                     f"MNIST examples: {secs:.2f} s")
    notes.append(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), clip {args.clip}, "
                 f"medians of {args.repeats} interleaved repeats")
    table = write_table(rows, COLUMNS, Path(args.out), "clipping", title="Per-example clipping throughput",
                        command=command_line(args), notes=notes)
    print(table)
    for n in notes:
        print(f"- {n}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.clipping``: the same as ``cancelfl-bench clipping``."""
    from benchmarks.common import setup_process

    parser = argparse.ArgumentParser(prog="python -m benchmarks.clipping", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = "python -m benchmarks.clipping " + " ".join(argv)
    undo = setup_process()
    try:
        return run(args)
    finally:
        undo()


if __name__ == "__main__":
    sys.exit(main())
