"""The method registry: every method is one card here, and every list of methods reads from the registry.

A method is a unit of five homes: its card ``protocols/methods/<method>.py`` (its options class, regime,
guarantee and the :func:`register` call), its formulas ``protocols/<method>.py`` (imported by both ends),
its server stages ``strategies/<method>.py``, its client handler ``client/methods/<method>.py`` and its
wire messages ``protocols/wire/<method>.py``.  A method of your own needs only a :class:`MethodSpec` and
one :func:`register` call (``tests/test_method_unit.py`` adds one from a test module).
"""

from __future__ import annotations

import importlib

from protocols.methods.pairwise import SPARSE_FROM, auto_graph, sparse_by_default
from protocols.methods.registry import (
    METHODS,
    VARIANTS,
    dataset_size_class,
    local_services,
    method_names,
    method_or_variant,
    method_spec,
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
    Guarantee,
    MethodSpec,
)

for _card in ("baselines", "nadp", "niss", "mpddp", "ladp", "ddpsa"):  # registration order = the README's order
    importlib.import_module(f"protocols.methods.{_card}")
#: The built-in methods, in the order the README and the benchmarks list them (with yours: :func:`method_names`).
METHOD_NAMES: tuple[str, ...] = method_names()

__all__ = ["AUTO", "AUTO_KEYS", "FEDERATION", "FULL_BATCH", "LARGE_DATASETS", "METHODS", "METHOD_NAMES", "NO_COLLUDER",
           "PRIVACY_UNITS", "SPARSE_FROM", "VARIANTS", "Guarantee", "MethodSpec", "auto_graph", "dataset_size_class",
           "local_services", "method_names", "method_or_variant", "method_spec", "options_classes", "query_actions",
           "reference_method", "regime", "register", "register_variant", "sparse_by_default"]
