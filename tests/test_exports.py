"""Every public name a package's __init__ re-exports resolves (trio's export test, in small)."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def exported_names(package: str) -> list[str]:
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    names = [
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    ]
    for node in tree.body:  # lazily re-exported names, listed in a module-level tuple
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            names += [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return names


@pytest.mark.parametrize("package", ["compress", "gossip", "node"])
def test_every_export_resolves(package):
    module = importlib.import_module(package)
    names = exported_names(package)
    assert names, f"{package} exports nothing"
    missing = [name for name in names if getattr(module, name, None) is None]
    assert missing == []


def test_unknown_attribute_is_an_attribute_error():
    import gossip

    with pytest.raises(AttributeError):
        gossip.no_such_name  # noqa: B018
