"""mkdocs hook: the node.toml, CLI and API reference pages, generated from the code at every build.

Invariants: every key of node.toml comes from the config dataclasses (`geotrain.NodeConfig`'s
sections and each registered algorithm's settings), with its type, its default and the text the
class docstring gives it; every command comes from the `geotrain` argparse parser
(`geotrain.node.cli.build_parser()`); the API page lists every public name of `geotrain` (its
`_EXPORTS`, grouped as its comments group them) for mkdocstrings to render. Nothing here is
written by hand, so the pages cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

CONFIG_PAGE = "reference/node-toml.md"
CLI_PAGE = "reference/cli.md"
API_PAGE = "reference/api.md"
_KEY_LINE = re.compile(r"^    ([a-z_]+(?: / [a-z_]+)*): ?(.*)$")


@event_priority(100)  # before mkdocstrings' own on_config
def on_config(config):
    # `mkdocs` started from a venv's bin/ has that folder first on sys.path, where mkdocstrings
    # (which reads sys.path when it first renders) would take the console script `geotrain` for
    # the package; without it the package is found where it is installed (an editable install
    # maps `geotrain` to the repository root).
    sys.path[:] = [p for p in sys.path if not (Path(p or ".") / "geotrain").is_file()]
    _prune_unimportable_folders()
    return config


def _prune_unimportable_folders() -> None:
    """griffe walks every folder below a package for modules; the package here is the repository
    root, where a local .venv holds thousands of files none of which can be geotrain's. Folders
    whose names are not identifiers (.venv, .git, *.egg-info) cannot hold a submodule, so the
    walk skips them. A speed-up only: if griffe's internals change, the build is slower, not
    different."""
    try:
        from griffe._internal.finder import ModuleFinder
    except ImportError:
        return
    walk = getattr(ModuleFinder, "_filter_py_modules", None)
    if walk is None or getattr(walk, "pruned", False):
        return

    def pruned(self, path: Path):
        for root, dirs, files in os.walk(path, topdown=True, followlinks=True):
            dirs[:] = [d for d in dirs if d.isidentifier() and d != "__pycache__"]
            for name in files:
                if os.path.splitext(name)[1] in self.extensions_set:  # noqa: PTH122
                    yield Path(root, name)

    pruned.pruned = True
    ModuleFinder._filter_py_modules = pruned


def on_files(files, config):
    files.append(File.generated(config, CONFIG_PAGE, content=config_page()))
    files.append(File.generated(config, CLI_PAGE, content=cli_page()))
    files.append(File.generated(config, API_PAGE, content=api_page()))
    return files


# --- node.toml ------------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """Each field's text from a class docstring written as `name: text` (or `a / b: text`, one
    text for several fields), continued on deeper-indented lines."""
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in (cls.__doc__ or "").splitlines():
        found = _KEY_LINE.match(line)
        if found:
            names = found.group(1).split(" / ")
            for name in names:
                docs[name] = found.group(2).strip()
        elif names and line.startswith("        "):
            for name in names:
                docs[name] += " " + line.strip()
        elif not line.strip():
            names = []
    return docs


def _type_name(hint) -> str:
    text = str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))
    text = text.replace("pathlib.", "").replace("typing.", "").replace("NoneType", "None")
    return text.replace("Path", "path")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "unset"
    if isinstance(value, Path):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple | list):
        return "`[]`" if not value else f"`{list(value)}`"
    if isinstance(value, dict):
        return "`{}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section_table(cls: type, section: str, skip: frozenset[str] = frozenset()) -> list[str]:
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    lines = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        text = docs.get(f.name, "")
        lines.append(f"| `{section}.{f.name}` | `{_cell(_type_name(hints[f.name]))}` | "
                     f"{_cell(_default(f))} | {_cell(text)} |")
    return lines


def _summary(cls: type) -> str:
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in doc.splitlines() if not line.startswith("["))


def config_page() -> str:
    from geotrain.node import NodeConfig
    from geotrain.node.algorithms import algorithm_specs

    out = [
        "# node.toml",
        "",
        "<!-- generated from geotrain's config dataclasses by docs/mkdocs/reference_pages.py -->",
        "",
        "Every key a node's `node.toml` takes, generated from the code at each build: the config",
        "dataclasses in `node/_config.py` and each algorithm's settings in",
        "`node/algorithms/<name>.py`. Relative paths are relative to the `node.toml` file. A bad",
        "value stops the node before anything starts, naming the field, the value and what was",
        "expected. Any key can be overridden on the command line:",
        "`geotrain node run --config node.toml --set section.key=value`.",
        "",
    ]
    for f in dataclasses.fields(NodeConfig):
        cls = f.default_factory
        out += [f"## `[{f.name}]`", "", _summary(cls), ""]
        out += section_table(cls, f.name, skip=frozenset({"algorithm_settings"}))
        out.append("")
        if f.name == "gossip":
            for name, spec in sorted(algorithm_specs().items()):
                if spec.settings is None:
                    continue
                out += [f"### `[gossip.{name}]`", "",
                        f"Settings of the `{name}` algorithm (read when `gossip.algorithm = "
                        f'"{name}"`).', ""]  # fmt: skip
                out += section_table(spec.settings, f"gossip.{name}")
                out.append("")
    return "\n".join(out)


# --- the geotrain command ---------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name), sub


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(action.option_strings) or (action.metavar or action.dest)
        if action.choices and not isinstance(action.choices, dict):
            names += " {" + ",".join(str(c) for c in action.choices) + "}"
        text = (action.help or "") % {"default": action.default, "prog": parser.prog}
        rows.append(f"| `{_cell(str(names))}` | {_cell(text)} |")
    if not rows:
        return []
    return ["| argument | what it does |", "|---|---|", *rows, ""]


def _command_section(name: str, help_text: str | None, parser, depth: int) -> list[str]:
    usage = " ".join(parser.format_usage().split())
    usage = usage.removeprefix("usage: ")
    out = [f"{'#' * depth} `{name}`", ""]
    if help_text or parser.description:
        out += [_cell(parser.description or help_text), ""]
    out += ["```text", usage, "```", ""]
    out += _argument_rows(parser)
    for sub_name, sub_help, sub in _subcommands(parser):
        out += _command_section(f"{name} {sub_name}", sub_help, sub, min(depth + 1, 4))
    return out


def cli_page() -> str:
    from geotrain.node.cli import build_parser

    parser = build_parser()
    out = [
        "# The `geotrain` command",
        "",
        "<!-- generated from geotrain's argparse parser by docs/mkdocs/reference_pages.py -->",
        "",
        "Every command and option, generated from the `geotrain` parser at each build",
        "(`geotrain COMMAND --help` prints the same). Logs go to standard error: readable on a",
        "terminal, one JSON object per line otherwise.",
        "",
        "## Global options",
        "",
        *_argument_rows(parser),
    ]
    for name, help_text, sub in _subcommands(parser):
        out += _command_section(f"geotrain {name}", help_text, sub, 2)
    return "\n".join(out)


# --- the Python API ---------------------------------------------------------------------------


def api_page() -> str:
    """One mkdocstrings block per public name, at the module that defines it (`geotrain` loads
    its names lazily, which static analysis cannot follow)."""
    import geotrain

    source = Path(geotrain.__file__).read_text()
    body = source[source.index("_EXPORTS = {") : source.index("\n}\n")]
    out = [
        "# Python API",
        "",
        "<!-- generated from geotrain.__all__ by docs/mkdocs/reference_pages.py -->",
        "",
        "`import geotrain` is the front door: every name below is `geotrain.<name>`",
        "(`geotrain.join`, `geotrain.Task`, ...). Generated from the docstrings.",
        "",
    ]
    for line in body.splitlines()[1:]:
        line = line.strip()
        if line.startswith("#"):
            out += [f"## {line.lstrip('# ').capitalize()}", ""]
        elif line.startswith('"'):
            name = line.split('"')[1]
            module = getattr(geotrain, name).__module__
            out += [f"::: {module}.{name}", "    options:", "      heading_level: 3", ""]
    return "\n".join(out)
