"""Layering rules, checked by reading the source (see ../shared/DESIGN.md).

compress <- gossip <- node <- testbed. `compress` imports no project package; `gossip` imports only
`compress` and no I/O, clock, thread or global-random module; only the transport's modules in `node`
import pynng; nothing imports a package layered above it.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
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
# The transport and its parts; its pynng-free types (node/_transport_types.py) stay out.
PYNNG_OWNERS = (
    "node/_transport.py",
    "node/_transport_wire.py",
    "node/_transport_inbound.py",
    "node/_transport_outbound.py",
)
PYNNG_RULE = "only the transport (node/_transport.py and its parts) may import pynng"


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    reason: str


def _imported_modules(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names imported from it) for every absolute import."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
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


def check_layering(sources: dict[str, str]) -> list[Violation]:
    """Check the layering rules over `{relative path: source text}`."""
    violations: list[Violation] = []
    pynng_importers: list[str] = []
    for path, text in sorted(sources.items()):
        package = path.split("/", 1)[0]
        if package not in ALLOWED_PROJECT_IMPORTS:
            continue
        tree = ast.parse(text, filename=path)
        for line, module, names in _imported_modules(tree):
            top = module.split(".", 1)[0]
            if top in PACKAGES and top != package and top not in ALLOWED_PROJECT_IMPORTS[package]:
                violations.append(Violation(path, line, f"{package} must not import {top}"))
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


def _src(text: str) -> str:
    return textwrap.dedent(text)


@pytest.mark.parametrize(
    ("path", "source", "reason"),
    [
        ("compress/_x.py", "import gossip\n", "compress must not import gossip"),
        ("compress/_x.py", "from node._cli import main\n", "compress must not import node"),
        ("gossip/_x.py", "from node import _cli\n", "gossip must not import node"),
        ("gossip/_x.py", "import testbed.run\n", "gossip must not import testbed"),
        ("node/_x.py", "import testbed\n", "node must not import testbed"),
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
        ("node/_transport_types.py", "import pynng\n", PYNNG_RULE),
        ("testbed/_x.py", "from pynng import Pair0\n", PYNNG_RULE),
    ],
)
def test_a_forbidden_import_is_reported(path, source, reason):
    violations = check_layering({path: _src(source)})
    assert [v.reason for v in violations] == [reason]


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
        ("gossip/_x.py", "from compress import DecodeError\n"),
        ("node/_transport.py", "import pynng\n"),
        ("node/_transport_inbound.py", "import pynng\n"),
        ("testbed/_x.py", "import node\nimport gossip\nimport compress\nimport socket\n"),
        ("compress/_x.py", "from . import _wire\nimport torch\n"),
    ],
)
def test_an_allowed_import_passes(path, source):
    assert check_layering({path: _src(source)}) == []
