"""A SuperNode runs only the app code its operator pinned: node config ``trusted-fab``.

In a Flower deployment every ClientApp process loads its code from the run's FAB (Flower app bundle), which
whoever submits the run builds.  A server that ships a modified client app sidesteps every check the stock client
makes: it can upload without noise, reveal pair seeds, or ignore the node's policy.  A node whose config sets
``trusted-fab`` (the SHA-256 of each FAB it accepts, comma-separated) checks the FAB of every message before Flower
installs or imports anything from it, and answers a message of any other FAB with an error naming both hashes.
``flwr build`` is reproducible, so an operator builds the release it reviewed and pins its hash
(``cancelfl keys fab-hash --app DIR``).  Flower's own ``--trusted-entities`` needs FABs signed by its platform.

The check runs in the node's ClientApp processes that ``cancelfl-supernode`` starts (:func:`install` in the warm
ClientApp's children, :func:`main` otherwise), that is, in code the node has installed, never the FAB's.  A plain
``flower-supernode`` does not read the key.  ``CANCELFL_TRUSTED_APP=DIR`` has ``cancelfl-supernode`` pin the FAB of
the app in ``DIR`` (:func:`pin_own_app`): a container runs only the app of its own image.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from protocols.node_config import TRUSTED_FAB, trusted_fabs

__all__ = ["TRUSTED_APP_ENV", "UntrustedFab", "check_fab", "fab_hash", "install", "main", "pin_own_app"]

#: Environment variable naming an app folder whose FAB ``cancelfl-supernode`` pins (:func:`pin_own_app`).
TRUSTED_APP_ENV = "CANCELFL_TRUSTED_APP"


class UntrustedFab(RuntimeError):
    """The message's FAB is not one the node's ``trusted-fab`` pins: nothing of it is installed or run."""


def fab_hash(app: Path) -> str:
    """SHA-256 of the FAB ``flwr build`` / ``flwr run`` make of the app in ``app`` (reproducible)."""
    import warnings

    from flwr.cli.build import build_fab_from_disk

    with warnings.catch_warnings():  # pathspec's deprecation notes on Flower's ignore patterns
        warnings.simplefilter("ignore", DeprecationWarning)
        return hashlib.sha256(build_fab_from_disk(Path(app))).hexdigest()


def pin_own_app(argv: list[str], app: Path) -> tuple[list[str], str]:
    """``flower-supernode`` arguments with ``trusted-fab`` set to the FAB of the app in ``app``, and that FAB's hash.

    Adds the key to ``--node-config`` (either form), or the option itself.  Raises ValueError when the node config
    sets ``trusted-fab`` already (one source of the pin).
    """
    digest = fab_hash(app)
    entry = f'{TRUSTED_FAB}="{digest}"'
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--node-config" and i + 1 < len(out):
            at, value = i + 1, out[i + 1]
        elif arg.startswith("--node-config="):
            at, value = i, arg.partition("=")[2]
        else:
            continue
        if TRUSTED_FAB in _parsed(value):
            raise ValueError(f"both {TRUSTED_APP_ENV} and node config '{TRUSTED_FAB}' pin the app: set one")
        joined = f"{value} {entry}".strip()
        out[at] = joined if at == i + 1 else f"--node-config={joined}"
        return out, digest
    return [*out, "--node-config", entry], digest


def _parsed(node_config: str) -> dict[str, Any]:
    """The keys of a ``--node-config`` value as Flower parses them; empty for one Flower will refuse itself."""
    from flwr.common.config import parse_config_args

    try:
        return parse_config_args([node_config]) if node_config.strip() else {}
    except Exception:  # noqa: BLE001 - flower-supernode reports a malformed node config itself
        return {}


def check_fab(content: bytes, claimed: str | None, node_config: Any) -> None:
    """Refuse a FAB whose SHA-256 the node config's ``trusted-fab`` does not list (no key: any FAB).

    ``claimed``: the hash the SuperNode names the FAB by (Flower loads the installed app by it): it must be the
    content's.  Raises :class:`UntrustedFab`.
    """
    pins = trusted_fabs(node_config)
    if pins is None:
        return
    actual = hashlib.sha256(content).hexdigest()
    if actual not in pins or (claimed is not None and claimed != actual):
        raise UntrustedFab(f"the run's FAB {actual} is not one this node's '{TRUSTED_FAB}' lists "
                           f"({', '.join(sorted(pins))}); refused before anything of it is installed or run")


def install() -> None:
    """Check every FAB Flower's ``flwr-clientapp`` in this process receives before it installs it.

    Wraps ``pull_task_input`` (to learn the node config and the FAB's name) and ``install_from_fab`` of
    ``flwr.supernode.runtime.run_clientapp``: the check raises inside Flower's handler, so the message is answered
    with an error reply and the process exits without importing the app.
    """
    import flwr.supernode.runtime.run_clientapp as rc

    seen: dict[str, Any] = {}
    pull, install_fab = rc.pull_task_input, rc.install_from_fab

    def pull_task_input(*args: Any, **kwargs: Any) -> Any:
        out = pull(*args, **kwargs)
        seen["node_config"], seen["hash"] = out[1].node_config, out[3].hash_str
        return out

    def install_from_fab(fab_file: Any, *args: Any, **kwargs: Any) -> Any:
        if "node_config" not in seen:
            raise UntrustedFab("a FAB to install before this node's config was read: refused")
        content = fab_file if isinstance(fab_file, bytes) else Path(fab_file).read_bytes()
        check_fab(content, seen["hash"], seen["node_config"])
        return install_fab(fab_file, *args, **kwargs)

    rc.pull_task_input, rc.install_from_fab = pull_task_input, install_from_fab


def main() -> None:
    """``flwr-clientapp`` with :func:`install` applied (the SuperExec's ClientApp without a warm process)."""
    install()
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    flwr_clientapp()


if __name__ == "__main__":
    main()
