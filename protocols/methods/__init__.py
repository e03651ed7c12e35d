"""The method registry: every method is one card here, and every list of methods reads from the registry.

A method is a unit of five homes: its card ``protocols/methods/<method>.py`` (its options class, regime,
guarantee and the :func:`register` call), its formulas ``protocols/<method>.py`` (imported by both ends),
its server stages ``strategies/<method>.py``, its client handler ``client/methods/<method>.py`` and its
wire messages ``protocols/wire/<method>.py``.  A method of your own needs only a :class:`MethodSpec` and
one :func:`register` call (``tests/test_method_unit.py`` adds one from a test module); a card module dropped into
this package, or named by an installed package under the ``cancelfl.methods`` entry-point group, is imported with
the registry in every process.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from importlib.metadata import entry_points

from protocols.methods.pairwise import SPARSE_FROM, auto_graph, sparse_by_default
from protocols.methods.registry import (
    METHODS,
    VARIANTS,
    dataset_size_class,
    ignored_settings,
    local_services,
    method_names,
    method_or_variant,
    method_spec,
    on_first_read,
    options_classes,
    query_actions,
    reference_method,
    regime,
    register,
    register_variant,
)
from protocols.methods.spec import (
    AUTO,
    AUTO_KEYS,
    FEDERATION,
    FULL_BATCH,
    LARGE_DATASETS,
    NO_COLLUDER,
    PRIVACY_UNITS,
    TABULAR_DATASETS,
    Guarantee,
    MethodSpec,
)

#: Modules of this package that are not cards.
_NOT_CARDS = frozenset({"common", "pairwise", "registry", "spec"})
#: Entry-point group of installed packages' cards: ``[project.entry-points."cancelfl.methods"] mine = "pkg.card"``.
ENTRY_POINT_GROUP = "cancelfl.methods"


def _load_builtin_cards() -> None:
    """Import the built-in cards (the README's order); their strategies and handlers are named by import path."""
    for card in ("baselines", "nadp", "niss", "mpddp", "ladp", "ddpsa"):
        importlib.import_module(f"{__name__}.{card}")


def _load_other_cards() -> None:
    """Import every other card module of this package (by name), then the installed plugins' cards.

    A card registers its method on import, so a module dropped into ``protocols/methods/`` or a package that names
    its card under :data:`ENTRY_POINT_GROUP` is known to every process that reads the registry (the ServerApp,
    every ClientApp, the benchmarks) without an edit elsewhere.  They are imported on the registry's first read
    (:func:`protocols.methods.registry.on_first_read`), so such a card may import the strategies and client
    modules its method subclasses, whichever module the process imports first.
    """
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_CARDS):
        importlib.import_module(f"{__name__}.{module}")  # the built-in ones are imported already
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as err:  # noqa: BLE001 - one broken plugin must not stop every other method
            warnings.warn(f"cancelfl: the method card {ep.value!r} (entry point {ep.name!r} of "
                          f"{ENTRY_POINT_GROUP!r}) failed to import and is not registered: {err!r}", stacklevel=2)


_load_builtin_cards()
on_first_read(_load_other_cards)


def __getattr__(name: str) -> tuple[str, ...]:
    """``METHOD_NAMES``: every registered method, read when used.

    Built-in cards first, in the README's order, then the cards loaded on the registry's first read.
    """
    if name == "METHOD_NAMES":
        return method_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AUTO", "AUTO_KEYS", "ENTRY_POINT_GROUP", "FEDERATION", "FULL_BATCH", "LARGE_DATASETS",
           "METHODS", "METHOD_NAMES", "NO_COLLUDER", "PRIVACY_UNITS", "SPARSE_FROM", "TABULAR_DATASETS", "VARIANTS",
           "Guarantee",
           "MethodSpec", "auto_graph", "dataset_size_class", "ignored_settings", "local_services", "method_names",
           "method_or_variant",
           "method_spec", "on_first_read", "options_classes", "query_actions", "reference_method", "regime",
           "register", "register_variant", "sparse_by_default"]
