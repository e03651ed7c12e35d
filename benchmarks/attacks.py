"""Privacy attacks per method: gradient inversion on one upload (uplink), membership inference (downlink).

    cancelfl-bench attacks [--methods all] [--epsilons 1,8,64] [--dlg-clients 10] [--mia-clients 10] ...

Uplink: round 1 of each method with one sample per client (the DLG/iDLG setting), the
victim's upload turned into the gradient the server can infer (:mod:`benchmarks.adversary.uplink`)
and inverted with L-BFGS; scored by SSIM against the truth.  Downlink: a loss-threshold
membership attack on the model a client receives in the last round and on the final model
(:mod:`benchmarks.adversary.membership`).  Writes ``dlg.csv``/``dlg.md``, ``membership.csv``/
``membership.md`` and ``dlg_reconstructions.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.runs import point_config, run_point, short_error

HELP = "uplink DLG and downlink membership inference per method"

DLG_COLUMNS = ("name", "epsilon", "clients", "status", "attacker_sees", "label_ok", "grad_cosine",
               "grad_rel_error", "ssim_best", "mse_best", "best_variant", "ssim_attacker", "mse_attacker",
               "ssim_mean_image", "reconstructed")
MIA_COLUMNS = ("name", "epsilon", "clients", "status", "final_accuracy", "model_attacked", "mia_received_acc",
               "mia_received_auc", "mia_received_yeom", "mia_final_acc", "mia_final_auc", "member_loss",
               "nonmember_loss", "train_test_gap")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench attacks``."""
    common.add_federation_arguments(p, dataset="mnist", train_subset=0, test_subset=1000, rounds=1, hidden="32",
                             out="runs/bench/attacks", methods="all")
    p.add_argument("--epsilons", default="1,8,64")
    p.add_argument("--dlg-clients", type=int, default=10)
    p.add_argument("--dlg-restarts", type=int, default=2)
    p.add_argument("--dlg-iterations", type=int, default=300)
    p.add_argument("--success-ssim", type=float, default=0.8)
    p.add_argument("--mia-clients", type=int, default=10)
    p.add_argument("--mia-train-subset", type=int, default=500)
    p.add_argument("--mia-rounds", type=int, default=10)
    p.add_argument("--mia-local-epochs", type=int, default=5)
    p.add_argument("--mia-hidden", default="128")


def run(args: argparse.Namespace) -> int:
    """Uplink DLG per method and downlink membership inference per method."""
    from tqdm import tqdm

    out, notes, methods, msets = common.plan(args)
    t0 = time.perf_counter()
    dlg_rows, images = [], {}
    base = {"dataset": args.dataset, "test-subset": args.test_subset, "hidden": args.hidden, "lr": args.lr,
            "seed": args.seed, **common.parse_sets(args.set)}
    epsilons = [float(e) for e in args.epsilons.split(",")]
    bar = tqdm([(m, e) for e in epsilons for m in methods], desc="DLG (uplink)", unit="run", dynamic_ncols=True)
    for name, eps in bar:
        bar.set_postfix_str(f"{name} eps={eps:g}")
        row, img = dlg_point(name, eps, args.dlg_clients, base, msets, out / "dlg" / f"eps{eps:g}", args)
        dlg_rows.append(row)
        if img is not None:
            images[(name, eps)] = img
        tqdm.write(f"DLG {name:>16} eps={eps:<5g}: ssim_best={common.fmt(row.get('ssim_best'))} "
                   f"ssim_attacker={common.fmt(row.get('ssim_attacker'))} cos={common.fmt(row.get('grad_cosine'))} "
                   f"{row['status']}")
    dlg_notes = notes + [
        "victim = one client holding one sample, batch size 1, one local epoch, round 1 (the DLG/iDLG setting); "
        "every client holds one sample (train-subset = clients)",
        "ssim_best/mse_best: best reconstruction over all L-BFGS starts and variants (dlg-l2, dlg-cosine, analytic; "
        "for mpddp/mpdp-naive also dlg-whitened and analytic-snr, which use the server's knowledge of R, i.e. of "
        "each entry's noise scale) scored against the truth (the defender's worst case); ssim_attacker: the "
        "DLG start the attacker picks (smallest gradient distance)",
        "grad_cosine / grad_rel_error: the inferred gradient against the victim's true gradient "
        "(1 / 0 = the server holds the exact gradient)",
        "ssim_mean_image: SSIM of the dataset's mean image (a guess that uses no upload) = the floor",
        f"reconstructed = ssim_best >= {args.success_ssim}",
    ]
    common.write_table(dlg_rows, DLG_COLUMNS, out, "dlg", title="Uplink: gradient inversion (iDLG, L-BFGS) per method",
                       command=common.command_line(args), notes=dlg_notes)
    plot_reconstructions(images, out / "dlg_reconstructions.png")

    mia_rows = []
    mbase = {"dataset": args.dataset, "train-subset": args.mia_train_subset, "test-subset": args.test_subset,
             "num-rounds": args.mia_rounds, "local-epochs": args.mia_local_epochs, "hidden": args.mia_hidden,
             "lr": args.lr, "seed": args.seed, **common.parse_sets(args.set)}
    bar = tqdm([(m, e) for e in epsilons for m in methods], desc="membership (downlink)", unit="run",
               dynamic_ncols=True)
    for name, eps in bar:
        bar.set_postfix_str(f"{name} eps={eps:g}")
        row = mia_point(name, eps, args.mia_clients, mbase, msets, out / "mia" / f"eps{eps:g}")
        mia_rows.append(row)
        tqdm.write(f"MIA {name:>16} eps={eps:<5g}: acc={common.fmt(row.get('final_accuracy'))} "
                   f"mia={common.fmt(row.get('mia_received_acc'))} auc={common.fmt(row.get('mia_received_auc'))} {row['status']}")
    total = time.perf_counter() - t0
    mia_notes = notes + [
        "loss-threshold attack (Yeom et al.) on the model a client receives in the last round "
        "(mpddp family: the perturbed model the server sends) and on the final global model",
        "balanced: as many members (training samples) as non-members (test samples); 0.5 = guessing; "
        "acc = threshold fitted on one half, scored on the other; yeom = threshold at the mean training loss",
        f"total attack benchmark time {total:.0f} s",
    ]
    common.write_table(mia_rows, MIA_COLUMNS, out, "membership", title="Downlink: membership inference per method",
                       command=common.command_line(args), notes=mia_notes)
    print((out / "dlg.md").read_text())
    print((out / "membership.md").read_text())
    print(f"total time: {total:.1f} s")
    return 0


def dlg_point(name: str, epsilon: float, clients: int, base: dict, msets: dict, out: Path,
              args: argparse.Namespace) -> tuple[dict, np.ndarray | None]:
    """Capture the victim's round-1 upload of one method and invert it."""
    from benchmarks.adversary.ssim import ssim
    from benchmarks.adversary.uplink import capture_first_round, uplink_attack
    from protocols.config import ConfigError
    from protocols.task.data import dataset_for

    _method, ov = point_config(name, epsilon, clients, base, msets, out / name)
    row: dict = {"name": name, "epsilon": epsilon, "clients": clients, "status": "ok"}
    try:
        cap = capture_first_round(ov)
        res = uplink_attack(cap, restarts=args.dlg_restarts, iterations=args.dlg_iterations, seed=args.seed)
    except (ConfigError, ValueError) as err:
        row["status"] = f"refused: {short_error(err)}"
        return row, None
    except Exception as err:  # noqa: BLE001
        row["status"] = f"error: {type(err).__name__}: {short_error(err)}"
        traceback.print_exc(limit=4, file=sys.stderr)
        return row, None
    row["attacker_sees"] = res.note
    if res.report is None:
        row["status"] = "no attacker view"
        return row, None
    ds = dataset_for(cap.cfg)
    data_range = float(ds.x_train.max() - ds.x_train.min())
    best, choice = res.report.best, res.report.attacker_choice
    mean_img = ds.x_train.mean(0)
    row.update(label_ok=res.report.label == res.report.label_true, grad_cosine=res.cosine,
               grad_rel_error=res.rel_error, ssim_best=best.ssim, mse_best=best.mse, best_variant=best.variant,
               ssim_attacker=choice.ssim, mse_attacker=choice.mse,
               ssim_mean_image=ssim(mean_img, cap.x, data_range=data_range),
               reconstructed=bool(best.ssim >= args.success_ssim))
    return row, np.stack([cap.x, best.x])


def plot_reconstructions(images: dict[tuple[str, float], np.ndarray], path: Path) -> None:
    """One row per epsilon, one column per method: best reconstruction; the truth in the first column."""
    plt = common.pyplot()
    if not images:
        return
    names = list(dict.fromkeys(n for n, _ in images))
    eps = sorted({e for _, e in images})
    fig, axes = plt.subplots(len(eps), len(names) + 1, figsize=(1.3 * (len(names) + 1), 1.5 * len(eps) + 0.4),
                             squeeze=False)
    for i, e in enumerate(eps):
        for j, name in enumerate([None, *names]):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            pair = images.get((name, e)) if name else next((v for (n, ee), v in images.items() if ee == e), None)
            if pair is None:
                ax.axis("off")
                continue
            img = pair[0] if name is None else pair[1]
            ax.imshow(img.reshape(img.shape[-2:]), cmap="gray")
            if i == 0:
                ax.set_title("truth" if name is None else name, fontsize=7)
        axes[i][0].set_ylabel(f"eps={e:g}", fontsize=8)
    fig.tight_layout()
    common.save_figure(fig, path)


def received_forward(method: str, msg, cfg) -> tuple[Callable, str]:
    """Forward function of the model a client receives in ``msg``, and what it is."""
    from benchmarks.adversary.uplink import adapter_of
    from protocols.task.data import dataset_for
    from protocols.task.models import build_model, set_weights
    from protocols.wire.arrays import from_record

    arrays = from_record(msg.content["arrays"])
    ds = dataset_for(cfg)
    if (received := adapter_of(method).received_forward(arrays, cfg)) is not None:
        return received
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed).double()
    set_weights(model, arrays)
    model.eval()
    return (lambda t: model(t.double())), "global model sent to clients"


def mia_point(name: str, epsilon: float, clients: int, base: dict, msets: dict, out: Path) -> dict:
    """Train one method in an overfitting-prone setting; attack what clients receive and the final model."""
    import torch

    from benchmarks.adversary.membership import loss_threshold_attack, per_sample_loss
    from benchmarks.adversary.uplink import training_loss
    from protocols.config import RunConfig
    from protocols.task.data import dataset_for
    from protocols.task.models import load_npz_model

    method = common.method_config(name)[0]
    last: dict = {}

    def hook(msgs, _replies) -> None:
        if msgs and msgs[0].metadata.message_type == "train":
            last["msg"] = msgs[0]

    res = run_point(name, epsilon, clients, base, msets, out / name, hooks=[hook])
    row = {"name": name, "epsilon": epsilon, "clients": clients, "status": res.status,
           "final_accuracy": res.final_accuracy}
    if not res.status.startswith(("ok", "failed")) or "msg" not in last:
        return row
    cfg = RunConfig.from_mapping(json.loads((out / name / "summary.json").read_text())["config"])
    ds = dataset_for(cfg)
    loss = training_loss(method)
    fwd, what = received_forward(method, last["msg"], cfg)
    row["model_attacked"] = what
    m_loss = per_sample_loss(fwd, ds.x_train, ds.y_train, loss=loss, num_classes=ds.num_classes)
    n_loss = per_sample_loss(fwd, ds.x_test, ds.y_test, loss=loss, num_classes=ds.num_classes)
    r = loss_threshold_attack(m_loss, n_loss, seed=cfg.seed)
    row.update(mia_received_acc=r.accuracy, mia_received_auc=r.auc, mia_received_yeom=r.yeom_accuracy,
               member_loss=r.member_loss, nonmember_loss=r.nonmember_loss)
    final, _ = load_npz_model(out / name / "model.npz")
    final = final.double().eval()
    with torch.no_grad():
        fm = per_sample_loss(lambda t: final(t.double()), ds.x_train, ds.y_train, loss="ce", num_classes=ds.num_classes)
        fn = per_sample_loss(lambda t: final(t.double()), ds.x_test, ds.y_test, loss="ce", num_classes=ds.num_classes)
    rf = loss_threshold_attack(fm, fn, seed=cfg.seed)
    row.update(mia_final_acc=rf.accuracy, mia_final_auc=rf.auc, train_test_gap=rf.nonmember_loss - rf.member_loss)
    return row
