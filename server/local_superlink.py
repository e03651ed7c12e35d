"""Flower's managed local SuperLink: found from the ServerApp's process, so the run can say how to stop it.

``flwr run`` with the ``:local:`` connection (plain ``flwr run .`` on a fresh ``FLWR_HOME``) starts a
detached ``flower-superlink --simulation ... --log-file $FLWR_HOME/local-superlink/superlink.log`` and leaves
it running for later runs.  The ServerApp runs below it (SuperLink -> SuperExec -> ``flwr-simulation``);
:func:`stop_hint` names it and the command that stops it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

#: The ``--log-file`` Flower's CLI gives the SuperLink it starts (``flwr.cli.local_superlink``).
LOG_SUFFIX = ("local-superlink", "superlink.log")
#: Ancestors looked at (the ServerApp's grandparent is the SuperLink).
MAX_DEPTH = 6


@dataclass(frozen=True)
class LocalSuperLink:
    """A running SuperLink that ``flwr run`` started."""

    pid: int
    address: str


def _cmdline(pid: int) -> list[str]:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")


def _parent(pid: int) -> int:
    stat = (Path("/proc") / str(pid) / "stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state; the name may hold spaces


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def managed_superlink(pid: int | None = None) -> LocalSuperLink | None:
    """The ancestor of ``pid`` (default: this process) that is Flower's managed local SuperLink, or None.

    None also where ``/proc`` cannot be read (not Linux) or the nearest ``flower-superlink`` ancestor was
    started by someone else (``cancelfl run``/``deploy`` stop theirs; a user's own is theirs to stop).
    """
    pid = os.getpid() if pid is None else pid
    with contextlib.suppress(OSError, ValueError, IndexError):
        for _ in range(MAX_DEPTH):
            pid = _parent(pid)
            if pid <= 1:
                return None
            argv = _cmdline(pid)
            if not any(Path(a).name == "flower-superlink" for a in argv[:2]):
                continue
            log_file = _option(argv, "--log-file")
            if log_file is None or Path(log_file).parts[-2:] != LOG_SUFFIX:
                return None
            return LocalSuperLink(pid, f"{_option(argv, '--host') or '127.0.0.1'}:{_option(argv, '--port') or '?'}")
    return None


def stop_hint(link: LocalSuperLink) -> str:
    """One line: what keeps running after the run, and the command that stops it."""
    return (f"Flower's local SuperLink (pid {link.pid}, {link.address}), started by flwr run, keeps running for "
            f"the next flwr run; stop it with: kill {link.pid}")
