"""The public face: every name a package re-exports resolves (trio's export test, in small), the
one `geotrain` namespace gives the public API, and the README's code uses only public names."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = [
    "compress", "gossip", "node", "node/algorithms", "node/cli", "node/identity", "node/state",
    "node/testing", "node/training", "node/transport", "testbed",
]  # fmt: skip


def exported_names(package: str) -> list[str]:
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    names = [
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    ]
    for node in tree.body:  # lazily re-exported names: a module-level tuple or dict of names
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple | ast.Dict):
            elts = node.value.elts if isinstance(node.value, ast.Tuple) else node.value.keys
            names += [e.value for e in elts if isinstance(e, ast.Constant)]
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_every_export_resolves(package):
    module = importlib.import_module("geotrain." + package.replace("/", "."))
    names = exported_names(package)
    assert names, f"{package} exports nothing"
    missing = [name for name in names if getattr(module, name, None) is None]
    assert missing == []


def test_the_geotrain_namespace_is_the_public_api():
    import geotrain

    for name in ("Task", "TaskContext", "NodeConfig", "open_node", "get_codec", "ConfigError",
                 "DecodeError", "TransportError", "ResumeError", "register_algorithm"):  # fmt: skip
        assert name in geotrain.__all__ and getattr(geotrain, name) is not None
    assert all(getattr(geotrain, name) is not None for name in geotrain.__all__)
    with pytest.raises(AttributeError):
        geotrain.no_such_name  # noqa: B018


def shared_error_names(exports: dict[str, list[tuple[str, object]]]) -> list[str]:
    """Names under which two different exception classes are exported."""
    seen: dict[str, object] = {}
    clashes = []
    for names in exports.values():
        for name, value in names:
            if isinstance(value, type) and issubclass(value, Exception):
                if seen.setdefault(name, value) is not value:
                    clashes.append(name)
    return clashes


def test_no_two_public_error_classes_share_a_name():
    exports = {}
    for package in PACKAGES:
        module = importlib.import_module("geotrain." + package.replace("/", "."))
        exports[package] = [(n, getattr(module, n)) for n in exported_names(package)]
    assert sum(isinstance(v, type) and issubclass(v, Exception)
               for names in exports.values() for _, v in names) > 10  # fmt: skip
    assert shared_error_names(exports) == []


def test_two_error_classes_of_one_name_are_found():
    class DecodeError(Exception):
        pass

    from geotrain.compress import DecodeError as Theirs

    exports = {"a": [("DecodeError", Theirs)], "b": [("DecodeError", DecodeError)]}
    assert shared_error_names(exports) == ["DecodeError"]


def test_importing_the_protocol_and_the_testbed_does_not_load_torch():
    code = "import sys, geotrain.gossip, geotrain.testbed; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.S)


def private_imports(code: str) -> list[str]:
    """Modules imported by `code` that are private (a part starting with `_`) or not geotrain's
    public namespace (the old top-level names `node`, `gossip`, ...)."""
    bad = []
    for node in ast.walk(ast.parse(code)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
            modules += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        for module in modules:
            parts = module.split(".")
            if any(p.startswith("_") for p in parts) or parts[0] in (
                "node", "gossip", "compress", "testbed"
            ):  # fmt: skip
                bad.append(module)
    return bad


def test_the_readme_imports_only_public_names():
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert blocks, "the README has no python example"
    assert [m for block in blocks for m in private_imports(block)] == []


@pytest.mark.parametrize(
    "code",
    ["from geotrain.node._tasks import Task\n", "import node\n", "from geotrain import _x\n",
     "from geotrain.node.training import _builtin\n"],  # fmt: skip
)
def test_a_private_import_in_an_example_is_found(code):
    assert private_imports(code) != []
