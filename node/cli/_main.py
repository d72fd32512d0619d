# The `geotrain` command. Invariants: this is the only module that reads argv or the environment;
# logging is configured here once, before any subcommand runs; a subcommand is a function
# `handler(args) -> int` (the exit status) registered by a `register(subparsers)` callable.
# Subcommands of packages layered above `node` (the testbed) arrive through the entry-point group
# "geotrain.commands", so `node` never imports them.
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

import structlog

from .._signals import ignore_stop_signals_at_exit
from ._identity_cli import register_keygen, register_swarm
from ._local import register_local
from ._logging import LOG_FORMATS, LOG_LEVELS, configure_logging, warnings_as_log_lines
from ._node_cli import register_node, register_status

COMMAND_GROUP = "geotrain.commands"

Register = Callable[[argparse._SubParsersAction], None]

# Subcommands that `node` itself provides, in the order `--help` lists them.
BUILTIN_COMMANDS: tuple[Register, ...] = (
    register_node,
    register_status,
    register_keygen,
    register_swarm,
    register_local,
)


def _version() -> str:
    try:
        return metadata.version("geotrain")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def _plugin_commands() -> list[Register]:
    found = metadata.entry_points(group=COMMAND_GROUP)
    return [ep.load() for ep in sorted(found, key=lambda ep: ep.name)]


def build_parser(commands: Sequence[Register] | None = None) -> argparse.ArgumentParser:
    """Build the argument parser with every registered subcommand.

    Args:
        commands: the `register` callables to use; by default the built-in ones plus every entry
            point of the "geotrain.commands" group.
    """
    parser = argparse.ArgumentParser(
        prog="geotrain",
        description="Decentralized, geo-distributed training of PyTorch models.",
    )
    parser.add_argument("--version", action="version", version=f"geotrain {_version()}")
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="lowest level logged (default: info; warning for `status`, whose result is its "
        "output)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="auto",
        help="console on a terminal, JSON lines otherwise (default: auto)",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    if commands is None:
        commands = [*BUILTIN_COMMANDS, *_plugin_commands()]
    for register in commands:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `geotrain` console script. Returns the process exit status."""
    # A task named `module:function` is found in the working directory, as with `python -m`
    # (a console script's sys.path starts at its own folder instead); after site-packages, so a
    # stray file there never shadows an installed module.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    # a command's default level comes with events it says itself (`--log-level` shows them all)
    quiet = frozenset() if args.log_level else getattr(args, "log_quiet_default", frozenset())
    chosen = configure_logging(args.log_level or getattr(args, "log_level_default", None),
                               args.log_format, quiet=quiet)  # fmt: skip
    if chosen == "json":
        warnings_as_log_lines()
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return int(handler(args))
    except KeyboardInterrupt:
        structlog.get_logger().warning("interrupted")
        return 130
    except BrokenPipeError:  # `geotrain status | head`: the reader left, nothing is wrong
        with contextlib.suppress(OSError):  # (Python would complain again flushing stdout)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def console() -> int:
    """The `geotrain` console script (and `python -m geotrain.node`): `main`, then the stop
    signals ignored for the interpreter's exit (see ignore_stop_signals_at_exit)."""
    code = main()
    ignore_stop_signals_at_exit()
    return code


if __name__ == "__main__":
    sys.exit(console())
