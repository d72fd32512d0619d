# The algorithm registry. Invariants: every public module of this package is an algorithm and
# registers exactly one AlgorithmSpec when imported (adding an algorithm is adding one module);
# names and message tags are unique across algorithms; the built-ins are loaded on first use.
from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Mapping
from types import MappingProxyType

from ..transport import Header
from ._base import AlgorithmSpec

_REGISTRY: dict[str, AlgorithmSpec] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_loaded = False


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Make `spec` available as `gossip.algorithm = spec.name` (call it at import time).

    Raises:
        ValueError: a bad or taken name, or a message tag another algorithm already uses.
    """
    if not _NAME.match(spec.name):
        raise ValueError(f"algorithm name {spec.name!r}: expected [a-z][a-z0-9_]*, at most 32")
    known = _REGISTRY.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"algorithm {spec.name!r} is registered twice")
    taken = {m.__struct_config__.tag: (name, m) for name, s in _REGISTRY.items()
             for m in s.messages if name != spec.name}  # fmt: skip
    for message in spec.messages:
        tag = message.__struct_config__.tag
        if tag in taken and taken[tag][1] is not message:  # sharing a message class is fine
            raise ValueError(f"{spec.name}: message tag {tag!r} is {taken[tag][0]}'s already")
    _REGISTRY[spec.name] = spec
    return spec


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    package = __name__.rsplit(".", 1)[0]
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")


def algorithm_specs() -> Mapping[str, AlgorithmSpec]:
    """Every registered algorithm by name (the built-ins and any registered since)."""
    _load_builtins()
    return MappingProxyType(_REGISTRY)


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec of algorithm `name`.

    Raises:
        KeyError: no such algorithm (the message lists the known ones).
    """
    specs = algorithm_specs()
    if name not in specs:
        raise KeyError(f"unknown algorithm {name!r}: expected one of {sorted(specs)}")
    return specs[name]


def algorithm_messages() -> tuple[type[Header], ...]:
    """The header types of every registered algorithm, each once."""
    seen: dict[type[Header], None] = {}
    for spec in algorithm_specs().values():
        seen.update(dict.fromkeys(spec.messages))
    return tuple(seen)
