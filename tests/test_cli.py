"""The `geotrain` command: version, help, logging options."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import structlog

from geotrain.node.cli._main import build_parser, main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geotrain.node", *args], capture_output=True, text=True, timeout=120
    )


def test_version_prints_the_installed_version():
    from importlib import metadata

    done = run_cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"geotrain {metadata.version('geotrain')}"


def test_help_lists_the_global_options():
    done = run_cli("--help")
    assert done.returncode == 0
    assert "--log-level" in done.stdout and "--log-format" in done.stdout


def test_console_script_is_installed():
    from importlib import metadata

    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("geotrain") == "geotrain.node.cli:main"


def test_unknown_log_level_is_a_usage_error():
    done = run_cli("--log-level", "loud")
    assert done.returncode == 2
    assert "loud" in done.stderr


def test_json_log_format_writes_one_json_object_per_line(capsys):
    def register(sub):
        p = sub.add_parser("hello")
        p.set_defaults(handler=lambda args: structlog.get_logger().info("said_hello", who="x") or 0)

    parser = build_parser([register])
    args = parser.parse_args(["--log-format", "json", "hello"])
    from geotrain.node.cli._logging import configure_logging

    configure_logging(args.log_level, args.log_format)
    assert args.handler(args) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    record = json.loads(line)
    assert record["event"] == "said_hello" and record["who"] == "x" and record["level"] == "info"


def test_log_level_filters_lower_levels(capsys):
    from geotrain.node.cli._logging import configure_logging

    configure_logging("warning", "json")
    structlog.get_logger().info("not_shown")
    structlog.get_logger().warning("shown")
    err = capsys.readouterr().err
    assert "not_shown" not in err and "shown" in err


@pytest.mark.parametrize("bad", [("loud", "json"), ("info", "xml")])
def test_configure_logging_rejects_unknown_values(bad):
    from geotrain.node.cli._logging import configure_logging

    with pytest.raises(ValueError, match="expected one of"):
        configure_logging(*bad)


def test_main_without_a_command_prints_help(capsys):
    assert main(["--log-format", "json"]) == 0
    assert "usage: geotrain" in capsys.readouterr().out
