"""Planted faults for the audit's own tests: what a fault is (:class:`Fault`) and the tools adapters build them from.

A method's audit adapter (:attr:`server.audit_adapter.AuditAdapter.faults`) names the faults planted in its
release code; ``cancelfl audit --fault NAME`` runs one, and the audit must flag it.  Shared here:
:func:`patched` (module attributes replaced for the duration) and :data:`HALVE_GAUSSIAN` (the Gaussian std
halved where clients draw it from :func:`protocols.prg.gaussian` or :func:`protocols.prg.gaussian_many`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = ["HALVE_GAUSSIAN", "HALVE_NOISE", "SELF_TEST_TRIALS", "Fault", "SelfTest", "halved_std", "halved_stds",
           "patched"]

#: The fault every noising method plants: its noise std halved where its real code draws it (clients or server).
HALVE_NOISE = "halve-noise"
#: Trials of a benchmark self-test row whose fault halves the noise (caught within a few releases).
SELF_TEST_TRIALS = 16_000


@dataclass(frozen=True)
class Fault:
    """One fault planted in a method's release code.

    Attributes:
        plant: ``plant(victim) -> context manager`` that patches the release code for one release; ``victim()``
            is the node id of the client a per-client fault hits (the release's first participant).  ``None``:
            a server-side fault the adapter's view runs itself (it reads ``spec.fault``).
        per_client: only the victim's canaries are audited (a fault that hits one client).
        run_config: run-config keys the fault's releases set (e.g. a protection the fault needs switched off).
    """

    plant: Callable[[Callable[[], int | None]], AbstractContextManager] | None = None
    per_client: bool = False
    run_config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


class SelfTest(NamedTuple):
    """A self-test row ``cancelfl-bench audit`` adds for a method (``AuditAdapter.self_tests``).

    ``view``: the direction whose claim the fault breaks (``model`` where the uploads claim nothing, e.g. cdp's
    server noise); ``trials``: ``None`` = the row's default; ``min_epsilon``: the row runs at the benchmark's
    epsilons from this one on (below it the fault's view needs more canaries than a self-test spends).
    """

    fault: str
    trials: int | None = None
    view: str = "upload"
    min_epsilon: float = 0.0


@contextlib.contextmanager
def patched(*patches: tuple[object, str, Callable[[Any], Any]]) -> Iterator[None]:
    """Set each ``module.name`` to ``wrap(original)`` for the duration; every original is restored on exit.

    Handlers look these attributes up at call time, so the patch reaches the real release code.
    """
    saved: list[tuple[object, str, Any]] = []
    try:
        for mod, name, wrap in patches:
            orig = getattr(mod, name)
            saved.append((mod, name, orig))
            setattr(mod, name, wrap(orig))
        yield
    finally:
        for mod, name, orig in reversed(saved):
            setattr(mod, name, orig)


def halved_std(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``orig(seed, size, std, ...)`` with ``std`` halved (the signature of :func:`protocols.prg.gaussian`)."""
    return lambda seed, size, std=1.0, *a, **k: orig(seed, size, std / 2, *a, **k)


def halved_stds(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``orig(seeds, size, std, ...)`` with every std halved (:func:`protocols.prg.gaussian_many`: one std or one per seed)."""
    def wrapped(seeds: Any, size: Any, std: Any = 1.0, *a: Any, **k: Any) -> Any:
        return orig(seeds, size, [s / 2 for s in std] if hasattr(std, "__len__") else std / 2, *a, **k)

    return wrapped


def _halve_gaussian(victim: Callable[[], int | None]) -> AbstractContextManager:
    import protocols.prg as prg

    return patched((prg, "gaussian", halved_std), (prg, "gaussian_many", halved_stds))


#: ``halve-noise`` of a method whose clients draw their Gaussian noise from :func:`protocols.prg.gaussian` (or
#: several streams at once from :func:`protocols.prg.gaussian_many`).
HALVE_GAUSSIAN = Fault(_halve_gaussian)
