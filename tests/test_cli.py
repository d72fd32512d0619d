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
    assert scripts.get("geotrain") == "geotrain:_console"


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


STUCK_TASK = '''
import sys
import time
import torch
from geotrain import Task


def stuck(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    steps = []

    def loss(m, batch):
        steps.append(1)
        if len(steps) == 3:
            print("stuck_step_entered", file=sys.stderr, flush=True)  # (for the test to wait on)
            time.sleep(600)  # a step that takes forever (a huge accumulate, a hung data source)
        return m(batch).pow(2).mean()

    def batches():
        while True:
            yield torch.randn(4, 2)

    return Task(model=model, batches=batches(), loss=loss, evaluate=lambda m: 0.0,
                metric="zero", default_target=1.0)
'''


def _sighup_default() -> None:
    import signal

    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _node_with(tmp_path, task: str, extra: str = "", **popen) -> subprocess.Popen:
    (tmp_path / "stucktask.py").write_text(STUCK_TASK)
    assert main(["keygen", "--out", str(tmp_path / "identity.key")]) == 0
    (tmp_path / "node.toml").write_text(
        f'[identity]\nopen_swarm = true\n[training]\ntask = "{task}"\n'
        f"wait_for_peers = 0\neval_every = 1000\n{extra}[network]\n"
        'listen = "tcp://127.0.0.1:0"\n'
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    # a terminal's node: SIGHUP at its default, even when the tests run under nohup (whose
    # ignored SIGHUP a child inherits: the hangup tests then saw a node that outlived it)
    popen = {"stderr": subprocess.PIPE, "text": True, "preexec_fn": _sighup_default, **popen}
    return subprocess.Popen([sys.executable, "-m", "geotrain.node", "node", "run", "--config",
                             str(tmp_path / "node.toml")], env=env, cwd=tmp_path,
                            **popen)  # fmt: skip


def _wait_for(proc, needle: str, lines: list[str], timeout_s: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if needle in line:
            return
        assert line or proc.poll() is None, "".join(lines)[-3000:]
    raise AssertionError(f"no {needle!r}: " + "".join(lines)[-3000:])


def _signalled(proc: subprocess.Popen, send) -> str:
    """Once `proc` has started its node, `send(proc)`; then wait for its end: all it said."""
    lines: list[str] = []
    try:
        _wait_for(proc, "node_started", lines)
        send(proc)
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
        proc.wait()
    return "".join(lines) + rest


@pytest.mark.slow
def test_a_third_signal_ends_a_node_stuck_inside_a_step(tmp_path):
    """A node inside a step that never ends logged stop_requested, then stop_forced, and ran on
    for 10 minutes whatever it was sent next: a third signal exits at once now."""
    import signal
    import time

    proc = _node_with(tmp_path, "stucktask:stuck")
    lines: list[str] = []
    try:
        _wait_for(proc, "stuck_step_entered", lines)  # into the third step, which sleeps
        for needle in ("stop_requested", "stop_forced", "stop_immediate"):
            proc.send_signal(signal.SIGTERM)
            _wait_for(proc, needle, lines, 30)
            time.sleep(0.6)  # (a signal within 0.5 s of the first is taken as a duplicate)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_signal_delivered_twice_at_once_still_stops_gracefully(tmp_path):
    """timeout(1) delivers SIGTERM to the process and to its group: the second copy, a moment
    after the first, forced the stop and skipped the checkpoint."""
    import signal
    import time

    def twice(proc):
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # (sent at once, the kernel merges the two into one)
        proc.send_signal(signal.SIGTERM)

    proc = _node_with(tmp_path, "synthetic-linreg", "step_time_ms = 300\n")  # (a slow stop)
    text = _signalled(proc, twice)
    # (a node that had stopped before the second copy came may be ended by it: -SIGTERM)
    assert proc.returncode in (0, -signal.SIGTERM), text[-3000:]
    assert "stop_forced" not in text and "checkpoint_written" in text and "node_stopped" in text


def test_a_hangup_stops_the_daemon_gracefully(tmp_path):
    """A node started in an ssh session without nohup got SIGHUP at logout and died at once: no
    checkpoint, no leave, the steps since the last periodic checkpoint lost."""
    import signal

    proc = _node_with(tmp_path, "synthetic-linreg", "step_time_ms = 20\n")
    text = _signalled(proc, lambda proc: proc.send_signal(signal.SIGHUP))
    assert proc.returncode == 0, text[-3000:]
    assert "SIGHUP" in text and "checkpoint_written" in text and "node_stopped" in text


def test_a_node_under_nohup_outlives_the_hangup(tmp_path):
    """nohup starts a node with SIGHUP ignored, to outlive the terminal: it must stay so."""
    import signal
    import time

    proc = _node_with(tmp_path, "synthetic-linreg", "step_time_ms = 20\n",
                      preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    lines: list[str] = []
    try:
        _wait_for(proc, "node_started", lines)
        proc.send_signal(signal.SIGHUP)
        time.sleep(2.0)
        assert proc.poll() is None, "".join(lines)[-3000:]
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0 and "signal=SIGHUP" not in "".join(lines) + rest


def test_a_node_whose_terminal_hung_up_stops_with_its_checkpoint(tmp_path):
    """After a hangup every write to the terminal fails (EIO): the node's first log line on its
    way out failed it, with no checkpoint and no leave."""
    import os
    import pty
    import select
    import signal
    import time

    master, slave = pty.openpty()
    proc = _node_with(tmp_path, "synthetic-linreg",  # (its only checkpoint: the final one)
                      "step_time_ms = 20\n[state]\ncheckpoint_every = 100000\n", stdout=slave,
                      stderr=slave)  # fmt: skip
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 120
    try:
        while b"node_started" not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 65536)
        assert b"node_started" in seen, seen[-3000:]
        os.close(master)  # the terminal is gone: writes to it fail from here on
        master = -1
        time.sleep(0.3)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(60) == 0
    finally:
        if master >= 0:
            os.close(master)
        proc.kill()
        proc.wait()
    assert list((tmp_path / "state" / "checkpoints").glob("ckpt-*.safetensors"))


def test_a_daemon_whose_final_checkpoint_fails_exits_1_and_says_what_is_lost(
        tmp_path, monkeypatch, capsys):  # fmt: skip
    """A final checkpoint that could not be written (a full or read-only disk) was logged with
    'training goes on' and the daemon exited 0: a supervisor's Restart=on-failure saw nothing."""
    import errno

    from geotrain.node.state import _checkpoint

    def full(f, ckpt):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_checkpoint, "write_checkpoint", full)
    assert main(["keygen", "--out", str(tmp_path / "identity.key")]) == 0
    (tmp_path / "node.toml").write_text(
        '[identity]\nopen_swarm = true\n[training]\ntask = "synthetic-linreg"\n'
        "wait_for_peers = 0\nmax_steps = 5\n[state]\ncheckpoint_every = 1000\n"
        '[network]\nlisten = "tcp://127.0.0.1:0"\n'
    )
    code = main(["node", "run", "--config", str(tmp_path / "node.toml")])
    err = capsys.readouterr().err
    assert code == 1 and "stopped without its final checkpoint" in err
    assert "checkpoint_failed" in err and "WITHOUT its final checkpoint" in err


def test_a_signal_after_a_clean_stop_does_not_kill_the_exiting_node(tmp_path):
    """After node_stopped the interpreter takes ~0.75 s to exit (torch's threads); a SIGTERM
    then (a supervisor's second, a timeout's) killed a cleanly stopped node with 143."""
    import signal
    import time

    proc = _node_with(tmp_path, "synthetic-linreg", "max_steps = 20\n")
    lines: list[str] = []
    try:
        _wait_for(proc, "node_stopped", lines)
        for _ in range(5):  # through the exit
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        assert proc.wait(30) == 0, "".join(lines[-5:])
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_while_the_command_line_imports_exits_130_without_a_traceback(monkeypatch):
    """Ctrl-C in the seconds torch takes to import printed a KeyboardInterrupt traceback of
    import machinery: the console script's entry catches it."""
    import importlib.abc
    import sys

    import geotrain

    class Interrupted(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "geotrain.node.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "geotrain.node.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    assert geotrain._console() == 130


def test_a_librarys_warning_is_a_json_log_line_with_json_logs():
    # Opacus' multi-line UserWarning came out raw among the JSON lines and broke log shippers
    import io
    import json
    import warnings

    from geotrain.node.cli._logging import configure_logging, warnings_as_log_lines

    out = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        configure_logging("info", "json", stream=out)
        warnings_as_log_lines()
        warnings.warn("Full backward hook is firing\nwhen gradients are computed", UserWarning,
                      stacklevel=1)
    [line] = out.getvalue().splitlines()
    record = json.loads(line)
    assert record["event"] == "python_warning" and record["category"] == "UserWarning"
    assert record["message"].startswith("Full backward hook is firing")
