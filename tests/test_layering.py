"""Layering rules, checked by reading the source (see ../shared/DESIGN.md).

compress <- gossip <- node <- testbed, all inside the one import package `geotrain`. `compress`
imports no project package; `gossip` imports only `compress` and no I/O, clock, thread or
global-random module; only the transport's socket modules import pynng; nothing imports a package
layered above it; and no package reaches into another's private rooms: a module whose path has a
`_private` part may be imported only from inside the package that holds it.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
import tomllib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("compress", "gossip", "node", "testbed")
# What each package may import from the project (besides itself).
ALLOWED_PROJECT_IMPORTS = {
    "compress": set(),
    "gossip": {"compress"},
    "node": {"compress", "gossip"},
    "testbed": {"compress", "gossip", "node"},
}
# gossip/ is sans-I/O: no sockets, clocks, sleeps, threads or ambient randomness.
GOSSIP_FORBIDDEN = {
    "trio",
    "pynng",
    "socket",
    "time",
    "threading",
    "asyncio",
    "selectors",
    "select",
    "subprocess",
}
RANDOM_ALLOWED_NAMES = {"Random"}  # an injected random.Random is fine; random.random() is not
# The transport's socket modules; its pynng-free types (node/transport/_types.py) stay out.
PYNNG_OWNERS = (
    "node/transport/_transport.py",
    "node/transport/_wire.py",
    "node/transport/_inbound.py",
    "node/transport/_outbound.py",
)
PYNNG_RULE = "only the transport's socket modules (node/transport/) may import pynng"


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    reason: str


def module_of(path: str) -> str:
    """`node/transport/_wire.py` -> `geotrain.node.transport._wire` (packages end at __init__)."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["geotrain", *parts])


def _imported_modules(path: str, tree: ast.AST, known: set[str]) -> list[tuple[int, str, list]]:
    """(line, absolute module, names) for every import; relative ones resolved against `path`.

    `from . import _x` names a module: it is reported as `package._x` when that module is known.
    """
    here = module_of(path).split(".")
    package = here if path.endswith("__init__.py") else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [a.name for a in node.names]
            found.append((node.lineno, module, names))
            for name in names:
                if f"{module}.{name}" in known or (module == "geotrain" and name in PACKAGES):
                    found.append((node.lineno, f"{module}.{name}", []))
    return found


def _global_random_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Attribute uses like `random.shuffle` on a module imported as `random` (or an alias)."""
    aliases = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "random"
    }
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and node.attr not in RANDOM_ALLOWED_NAMES
    ]


def private_owner(module: str) -> str | None:
    """The package whose private room `module` is in (`a.b._c.d` -> `a.b`), or None if public."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _project_top(module: str) -> str | None:
    """`geotrain.gossip._links` -> `gossip`; also the old top-level names (`gossip._links`)."""
    parts = module.split(".")
    if parts[0] == "geotrain":
        return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None
    return parts[0] if parts[0] in PACKAGES else None


def check_layering(sources: dict[str, str]) -> list[Violation]:
    """Check the layering rules over `{relative path: source text}`."""
    violations: list[Violation] = []
    pynng_importers: list[str] = []
    known = {module_of(p) for p in sources}
    for path, text in sorted(sources.items()):
        package = path.split("/", 1)[0]
        if package not in ALLOWED_PROJECT_IMPORTS:
            continue
        me = module_of(path)
        tree = ast.parse(text, filename=path)
        for line, module, names in _imported_modules(path, tree, known):
            top = module.split(".", 1)[0]
            project = _project_top(module)
            if project is not None and not module.startswith("geotrain"):
                reason = f"{module}: import it as geotrain.{module}"
                violations.append(Violation(path, line, reason))
            if project and project != package and project not in ALLOWED_PROJECT_IMPORTS[package]:
                violations.append(Violation(path, line, f"{package} must not import {project}"))
            owner = private_owner(module) if project else None
            if owner is not None and not (me == owner or me.startswith(owner + ".")):
                violations.append(Violation(path, line, f"private module {module} outside {owner}"))
            if top == "pynng":
                pynng_importers.append(path)
            if package == "gossip":
                if top in GOSSIP_FORBIDDEN:
                    violations.append(Violation(path, line, f"gossip is sans-I/O: imports {top}"))
                if top == "random":
                    for name in names:
                        if name not in RANDOM_ALLOWED_NAMES:
                            violations.append(
                                Violation(path, line, f"gossip uses global random.{name}")
                            )
        if package == "gossip":
            for line, attr in _global_random_uses(tree):
                violations.append(Violation(path, line, f"gossip uses global random.{attr}"))
    for path in pynng_importers:
        if path not in PYNNG_OWNERS:
            violations.append(Violation(path, 0, PYNNG_RULE))
    return violations


def _project_sources() -> dict[str, str]:
    sources = {}
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            sources[file.relative_to(ROOT).as_posix()] = file.read_text()
    return sources


def test_project_keeps_the_layering():
    sources = _project_sources()
    assert any(p.startswith("gossip/") for p in sources)  # the walk found the packages
    assert check_layering(sources) == []


def test_every_package_folder_is_installed():
    # pyproject lists the packages by hand (the root folder is `geotrain`): a new folder must be
    # listed, or an installed (non-editable) geotrain would lack it.
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {module_of(p.relative_to(ROOT).as_posix()) for package in PACKAGES
               for p in (ROOT / package).rglob("__init__.py")}  # fmt: skip
    data = set(tool["package-data"]) - folders  # (folders of data files only, no code)
    assert all((ROOT / module.removeprefix("geotrain.").replace(".", "/")).is_dir()
               for module in data), data  # fmt: skip
    assert folders and folders | {"geotrain"} | data == listed


def _src(text: str) -> str:
    return textwrap.dedent(text)


@pytest.mark.parametrize(
    ("path", "source", "reason"),
    [
        ("compress/_x.py", "from geotrain import gossip\n", "compress must not import gossip"),
        ("compress/_x.py", "from ..node import cli\n", "compress must not import node"),
        ("gossip/_x.py", "from geotrain.node import cli\n", "gossip must not import node"),
        ("gossip/_x.py", "import geotrain.testbed\n", "gossip must not import testbed"),
        ("node/_x.py", "from geotrain import testbed\n", "node must not import testbed"),
        ("node/x/_y.py", "from ...testbed import run\n", "node must not import testbed"),
        ("testbed/_x.py", "import node\n", "node: import it as geotrain.node"),
        ("gossip/_x.py", "import trio\n", "gossip is sans-I/O: imports trio"),
        ("gossip/_x.py", "import time\n", "gossip is sans-I/O: imports time"),
        ("gossip/_x.py", "from socket import socket\n", "gossip is sans-I/O: imports socket"),
        ("gossip/_x.py", "import threading\n", "gossip is sans-I/O: imports threading"),
        ("gossip/_x.py", "from random import shuffle\n", "gossip uses global random.shuffle"),
        (
            "gossip/_x.py",
            "import random as r\n\ndef f():\n    return r.random()\n",
            "gossip uses global random.random",
        ),
        ("node/_other.py", "import pynng\n", PYNNG_RULE),
        ("node/transport/_types.py", "import pynng\n", PYNNG_RULE),
        ("testbed/_x.py", "from pynng import Pair0\n", PYNNG_RULE),
        (
            "node/_x.py",
            "from geotrain.gossip._links import LinkTable\n",
            "private module geotrain.gossip._links outside geotrain.gossip",
        ),
        (
            "node/_x.py",
            "from .training._trainer import Trainer\n",
            "private module geotrain.node.training._trainer outside geotrain.node.training",
        ),
        (
            "node/algorithms/_x.py",
            "from ..transport._wire import _Channel\n",
            "private module geotrain.node.transport._wire outside geotrain.node.transport",
        ),
    ],
)
def test_a_forbidden_import_is_reported(path, source, reason):
    violations = check_layering({path: _src(source)})
    assert [v.reason for v in violations] == [reason]


def test_private_module_named_in_from_import_is_reported():
    sources = {"gossip/_links.py": "", "node/_x.py": "from geotrain.gossip import _links\n"}
    assert [v.reason for v in check_layering(sources)] == [
        "private module geotrain.gossip._links outside geotrain.gossip"
    ]


def test_pynng_in_gossip_breaks_two_rules():
    violations = check_layering({"gossip/_x.py": "import pynng\n"})
    assert sorted(v.reason for v in violations) == [
        "gossip is sans-I/O: imports pynng",
        PYNNG_RULE,
    ]


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("gossip/_x.py", "import random\n\ndef f(seed):\n    return random.Random(seed)\n"),
        ("gossip/_x.py", "from random import Random\n"),
        ("gossip/_x.py", "from geotrain.compress import DecodeError\n"),
        ("gossip/_x.py", "from ..compress import DecodeError\n"),
        ("node/transport/_transport.py", "import pynng\n"),
        ("node/transport/_inbound.py", "import pynng\n"),
        ("testbed/_x.py", "from geotrain import node, gossip, compress\nimport socket\n"),
        ("compress/_x.py", "from . import _wire\nimport torch\n"),
        ("node/algorithms/_x.py", "from .._config import NodeConfig\n"),  # a parent's room
        ("node/algorithms/_x.py", "from ._base import Algorithm\n"),
    ],
)
def test_an_allowed_import_passes(path, source):
    assert check_layering({path: _src(source)}) == []
