"""The plain-language help of ``cancelfl``: what it does, the methods and the main run-config keys.

Built from the method registry (:mod:`protocols.methods`) and the app's run-config defaults
(``[tool.flwr.app.config]``), so it lists what a run really uses.  Importing it loads no Flower, torch
or accountant (``cancelfl --help`` answers in well under a second).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from protocols.methods import METHODS, VARIANTS

DESCRIPTION = """\
Federated learning with differential privacy (DP) on Flower, including methods whose
noise cancels when the server adds the clients' updates up: the uploads are protected,
and the model can come close to the accuracy of central DP.

Examples:
  cancelfl run --run-config 'method="nadp" num-rounds=5'        in this process (seconds)
  cancelfl run --engine simulation --run-config 'method="nadp"'  Flower's simulation (Ray)
  cancelfl deploy --supernodes 4 --run-config 'method="nadp"'    real SuperLink + SuperNodes on 127.0.0.1
  cancelfl compare --methods fedavg,cdp,nadp --epsilon 1        side by side, with a report
  cancelfl run --resume runs/<folder>                           continue a crashed run
  cancelfl keys gen --out keys --node node-0                    node identities for a deployment

Every run writes to a new folder runs/<time>-<method> (or run-config out-dir): metrics.jsonl
(one line per round), summary.json, report.md with plots, and the model.  --verbose prints
each round's details (epsilon per direction, clients, bytes, the method's own figures).
"""

#: The run-config keys a new user sets most, with what they mean (defaults come from the app's config).
MAIN_KEYS: dict[str, str] = {
    "method": "the method (list above)",
    "dataset": "digits, breast-cancer (bundled), mnist, fashion-mnist, or hub:<name> (Hugging Face)",
    "num-clients": "clients in the federation",
    "num-rounds": "training rounds (the noise is calibrated for them)",
    "epsilon": "privacy target for the whole run (smaller = more private)",
    "delta": "DP delta of the whole run",
    "privacy-unit": "what epsilon protects: record (one example) or client (all of a client's data)",
    "adjacency": "neighbouring datasets: zero-out (a record zeroed, Opacus' convention) or replace-one (2x noise)",
    "local-epochs": "passes over its data per client and round",
    "batch-size": "examples per local step",
    "lr": "client learning rate",
    "model": "mlp or cnn",
    "partitioning": "how data is split over clients: iid, dirichlet, size-skew",
    "seed": "data split and model initialisation (the DP noise always comes from the OS)",
    "out-dir": '"" = a new folder runs/<time>-<method>',
}


def plain_text(doc: str) -> str:
    """``doc`` without Sphinx markup: ``:mod:`~a.b``` -> ``b``, ``:func:`a.b``` -> ``a.b``, double backquotes dropped."""
    doc = re.sub(r":[a-z]+:`~([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], doc)
    doc = re.sub(r":[a-z]+:`([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def _protects(name: str) -> str:
    spec = METHODS[name]
    g = spec.privacy
    if not spec.units:
        return "no DP guarantee (plain federated averaging)"
    views = [v for v, adversary in (("the uploads", g.uplink), ("the published model", g.downlink)) if adversary]
    text = "protects " + " and ".join(views)
    if g.uplink is None:
        text += " (the server sees the uploads)"
    if spec.family == "pairwise":
        text += "; the noise of the uploads cancels in the sum"
    return text


def methods_text(names: Iterable[str] | None = None) -> str:
    """One line per registered method and variant: name, paper, what its epsilon protects.

    ``names``: only these methods, no variants (``None``: every method and variant).
    """
    width = max(len(n) for n in (*METHODS, *VARIANTS)) + 2
    lines = []
    chosen = METHODS if names is None else tuple(names)
    for name in chosen:
        spec = METHODS[name]
        paper = f"{spec.paper}: " if spec.paper else ""
        lines.append(f"  {name:<{width}}{paper}{_protects(name)}")
    for name, (method, keys) in (VARIANTS.items() if names is None else ()):
        sets = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in keys.items())
        lines.append(f"  {name:<{width}}{method} with {sets}")
    return "\n".join(lines)


def keys_text(defaults: dict) -> str:
    """The main run-config keys with their defaults (from ``defaults``, the app's config) and meaning."""
    width = max(len(k) for k in MAIN_KEYS) + 2
    lines = []
    for key, meaning in MAIN_KEYS.items():
        value = defaults.get(key, "")
        shown = f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else value
        lines.append(f"  {key:<{width}}{str(shown):<10} {meaning}")
    return "\n".join(lines)


def run_epilog(defaults: dict) -> str:
    """The methods and the main run-config keys, for ``cancelfl run/deploy/compare --help``."""
    return (f"methods (run-config method=\"...\"):\n{methods_text()}\n\n"
            "main run-config keys (--run-config 'key=value key2=\"text\"'), with defaults:\n"
            f"{keys_text(defaults)}\n\n"
            '"auto" = the method\'s own setting for the dataset (printed when the run starts; set the key to\n'
            "override it).  Every other key is in the configuration reference (docs/reference).\n")
