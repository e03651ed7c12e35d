"""The method registry: :func:`register` adds a method; every list of methods and options reads from here."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from protocols.methods.spec import FEDERATION, LARGE_DATASETS, TABULAR_DATASETS, MethodSpec
from protocols.options import MethodOptions

_REGISTRY: dict[str, MethodSpec] = {}
_VARIANTS: dict[str, tuple[str, MappingProxyType]] = {}
#: Loaders of the cards that are not built in, run once before the registry is first read (:func:`on_first_read`).
_PENDING: list[Callable[[], None]] = []
#: Held while the pending cards load: another thread's read waits for them (Flower's simulation runtime reads the
#: registry from the ServerApp's thread and its own at once); the loading thread's own reads pass.
_LOADING = threading.RLock()


def on_first_read(load: Callable[[], None]) -> None:
    """Run ``load`` (it imports cards) before the registry is next read, not now.

    A card of your own may import the project's strategies and client modules, which import the registry
    themselves: importing it while the first of them is still being imported would find that module half
    defined.  A read happens once the process runs code, when every module it imported is whole.
    """
    _PENDING.append(load)


def _loaded() -> None:
    """Run the pending card loaders (each once it succeeds; a card that reads the registry while it loads sees it so far).

    A loader that raises stays pending: every read raises until the broken card is mended or removed.
    """
    with _LOADING:
        while _PENDING:
            load = _PENDING.pop(0)
            try:
                load()
            except BaseException:
                _PENDING.insert(0, load)  # every later read fails the same way, none reads a registry short of it
                raise


class _Live(Mapping):
    """A read-only view of a registry table that loads the pending cards first."""

    def __init__(self, table: dict) -> None:
        self._table = table

    def __getitem__(self, key: str) -> Any:
        _loaded()
        return self._table[key]

    def __iter__(self) -> Iterator[str]:
        _loaded()
        return iter(dict(self._table))

    def __len__(self) -> int:
        _loaded()
        return len(self._table)

    def __contains__(self, key: object) -> bool:
        _loaded()
        return key in self._table

    def __repr__(self) -> str:
        _loaded()
        return repr(self._table)


#: Every registered method by name (a live, read-only view: methods registered later appear in it).
METHODS: Mapping[str, MethodSpec] = _Live(_REGISTRY)
#: Named variants of a method, as its card declares them (:func:`register_variant`): name -> (registered method,
#: the run-config keys it sets).  Run by the benchmarks and ``cancelfl compare`` next to the methods (a variant
#: is a method's setting, not a method).
VARIANTS: Mapping[str, tuple[str, MappingProxyType]] = _Live(_VARIANTS)


class _Registration:
    """What :func:`register` returns: ``unregister()`` it, or use it as a context manager."""

    def __init__(self, name: str) -> None:
        self.name = name

    def unregister(self) -> None:
        """Remove the method (or variant) again (tests; the built-in ones stay)."""
        _REGISTRY.pop(self.name, None)
        _VARIANTS.pop(self.name, None)

    def __enter__(self) -> _Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unregister()


def register(spec: MethodSpec) -> _Registration:
    """Add ``spec`` to the registry: the run config, the server, the ClientApp and the benchmarks then know it.

    Raises:
        ValueError: the name is taken, one of its option keys is another class's key, or it sets ``reference``
            while another registered method does.
    """
    _loaded()
    if spec.name in _REGISTRY or spec.name in _VARIANTS:
        raise ValueError(f"method {spec.name!r} is already registered")
    if spec.reference and any(other.reference for other in _REGISTRY.values()):
        raise ValueError(f"method {spec.name!r}: the reference arm is already {reference_method()!r}")
    taken = {key: cls for cls in options_classes() for key in cls.keys()}
    for cls in spec.options:
        if not (isinstance(cls, type) and issubclass(cls, MethodOptions)):
            raise ValueError(f"method {spec.name!r}: options {cls!r} is not a MethodOptions subclass")
        for key in cls.keys():
            if key in taken and taken[key] is not cls:
                raise ValueError(f"method {spec.name!r}: run-config key {key!r} of {cls.__name__} is already "
                                 f"declared by {taken[key].__name__}")
    _REGISTRY[spec.name] = spec
    return _Registration(spec.name)


def register_variant(name: str, method: str, keys: dict[str, Any]) -> _Registration:
    """Declare ``name`` as registered ``method`` run with the run-config ``keys`` (its card calls this).

    Raises:
        ValueError: ``name`` is a registered method or variant, or ``method`` is not registered.
    """
    _loaded()
    if name in _REGISTRY or name in _VARIANTS:
        raise ValueError(f"variant {name!r}: the name is already registered")
    if method not in _REGISTRY:
        raise ValueError(f"variant {name!r}: unknown method {method!r}")
    _VARIANTS[name] = (method, MappingProxyType(dict(keys)))
    return _Registration(name)


def method_names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(METHODS)


def method_spec(name: str) -> MethodSpec:
    """The spec of ``name`` (ValueError listing the known methods)."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(_REGISTRY)}") from None


def reference_method() -> str:
    """The method whose card sets ``reference``: the arm the benchmarks measure the others against.

    Raises:
        ValueError: no registered method sets it.
    """
    for name, spec in METHODS.items():
        if spec.reference:
            return name
    raise ValueError("no registered method sets MethodSpec.reference")


def options_classes() -> tuple[type[MethodOptions], ...]:
    """Every registered options class, once each, in registration order."""
    out: dict[type[MethodOptions], None] = {}
    for spec in METHODS.values():
        out.update(dict.fromkeys(spec.options))
    return tuple(out)


def local_services(cfg: Any) -> int:
    """Intermediate servers ``cancelfl`` must start for the run config ``cfg`` (its method's ``local_services``)."""
    hook = method_spec(cfg.method).local_services
    return int(hook(cfg)) if hook is not None else 0


def method_or_variant(name: str) -> tuple[str, dict]:
    """(registered method, run-config the variant sets) of a method or variant name (ValueError if neither)."""
    if name in VARIANTS:
        method, extra = VARIANTS[name]
        return method, dict(extra)
    if name in METHODS:
        return name, {}
    raise ValueError(f"unknown method {name!r}; known: {', '.join((*_REGISTRY, *VARIANTS))}")


def query_actions() -> set[str]:
    """Every extra phase name any method uses (registered once on the ClientApp)."""
    return {a for spec in METHODS.values() for a in spec.queries}


def dataset_size_class(dataset: str) -> str:
    """``"large"`` for :data:`LARGE_DATASETS` and Hugging Face datasets (``hub:...``), else ``"small"``."""
    return "large" if dataset in LARGE_DATASETS or dataset.startswith("hub:") else "small"


def regime(method: str, dataset: str) -> dict[str, Any]:
    """The run-config values ``method`` trains with on ``dataset``.

    :data:`FEDERATION`, the method's regime, then the values of the keys it does not read (:attr:`MethodSpec.fixed`).
    """
    spec = method_spec(method)
    out = dict(FEDERATION[dataset_size_class(dataset)])
    out.update(spec.regime.get("small", {}))
    if dataset_size_class(dataset) == "large":
        out.update(spec.regime.get("large", {}))
    out.update(spec.fixed)
    if dataset in TABULAR_DATASETS:  # centring is a per-image transform
        out.pop("input-centering", None)
    return out


def ignored_settings(cfg: Any) -> dict[str, Any]:
    """The run-config keys of ``cfg`` its method does not read (:attr:`MethodSpec.fixed`) set to another value."""
    fixed = method_spec(cfg.method).fixed
    return {k: getattr(cfg, k.replace("-", "_")) for k, v in fixed.items() if getattr(cfg, k.replace("-", "_")) != v}
