"""`geotrain testbed ...` through the real `geotrain` command: registration, bad input refused
before anything starts, and SIGTERM in the middle of a run leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geotrain.node.cli._main import main
from geotrain.testbed._namespaces import list_devices, list_namespaces

TINY = """
name = "tiny"
duration_s = 120
[[regions]]
name = "a"
peers = 2
[links.inside]
delay_ms = 5
rate_mbit = 100
"""


def test_testbed_is_a_geotrain_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["testbed", "run", "--help"])
    assert info.value.code == 0
    assert "--scenario" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--scenario", "mars"], "scenario.name = 'mars'"),
        (["--peers", "1"], "scenario.peers = 1"),
        (["--task", "no-such-task"], "no-such-task"),
        (["--node-set", "policy"], "--node-set 'policy'"),
        # the nodes' config, checked before the namespaces (a bad algorithm or a typo'd key
        # failed once the first node had started, naming its config file)
        (["--algorithm", "bogus"], "nodes' config (scenario, --node-set): gossip.algorithm"),
        (["--node-set", "gossip.polcy=uniform"], "gossip.polcy = 'uniform': expected one of"),
        # geotrain's nodes only, while the baselines kept the scenario's: the table compared
        # geotrain on linear regression with DDP on digits
        (["--node-set", "training.task=synthetic-linreg"], "use --task"),
        (["--node-set", "training.params.hidden=8"], "use --param KEY=VALUE"),
        (["--param", "hidden"], "--param 'hidden': expected KEY=VALUE"),
        (["--param", "hiden=8"], "--param hiden: task 'digits-mlp' has no such parameter"),
        (["--param", "hidden=2024-01-01"], "--param 'hidden=2024-01-01': a date is no task"),
        (["--node-set", "training.slowdown=3"], "use the scenario's [[stragglers]]"),
        (["--node-set", "training.partition=dirichlet"], "use --partition"),
        # the summary is read from each peer's whole metrics.jsonl
        (["--node-set", "state.metrics_max_mb=0"], "the testbed sets this for every node"),
        (["--eval-every-s", "-1"], "--eval-every-s -1.0 (RunOptions.eval_every_s): expected"),
    ],
)
def test_bad_input_exits_2_naming_it_before_anything_starts(argv, needle, capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["testbed", "run", "--out", str(out), *argv]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_a_shared_training_setting_is_geotrains_own_when_no_baseline_runs():
    from geotrain.node.cli._main import build_parser
    from geotrain.testbed._cli import _scenario_from_args

    args = build_parser().parse_args(["testbed", "run", "--baseline", "none", "--node-set",
                                      "training.seed=3"])  # fmt: skip
    _scenario_from_args(args)  # (refused with a baseline: the systems would differ)
    args = build_parser().parse_args(["testbed", "run", "--node-set", "training.params.a.b=1"])
    with pytest.raises(Exception, match=r"use --param KEY=VALUE"):
        _scenario_from_args(args)


def test_task_params_from_the_command_line_reach_the_scenario_every_system_trains_by(tmp_path):
    from geotrain.node.cli._main import build_parser
    from geotrain.testbed._cli import _scenario_from_args

    def scenario(*argv):
        return _scenario_from_args(build_parser().parse_args(["testbed", "run", *argv]))

    # a bare word is a string, a number a number; another task starts from no params
    sc = scenario("--task", "gpt", "--param", "size=10m", "--param", "batch=2",
                  "--param", 'files="*.py"')  # fmt: skip
    assert (sc.task, dict(sc.params)) == ("gpt", {"size": "10m", "batch": 2, "files": "*.py"})
    # the scenario's own params stay, one given here replaces its value
    shipped = scenario("--scenario", "geo3")
    assert shipped.params == {"hidden": 1024, "layers": 2}
    sc = scenario("--scenario", "geo3", "--param", "hidden=64")
    assert dict(sc.params) == {"hidden": 64, "layers": 2}
    assert sc.to_json()["params"] == {"hidden": 64, "layers": 2}  # (what run.json records)


def test_a_task_parameter_the_task_does_not_have_is_refused_before_anything_starts(
        tmp_path, capsys):  # fmt: skip
    # it was refused by peer 0's node, after the namespaces and the nodes had started
    scenario = tmp_path / "typo.toml"
    scenario.write_text(TINY.replace('name = "tiny"', 'name = "tiny"\nparams = { hiden = 64 }'))
    out = tmp_path / "out"
    assert main(["testbed", "run", "--out", str(out), "--scenario", str(scenario)]) == 2
    err = capsys.readouterr().err
    assert "scenario.params.hiden: task 'digits-mlp' has no such parameter" in err, err
    assert not out.exists()


def test_more_peers_than_memory_holds_are_refused_before_anything_starts(
        tmp_path, capsys, monkeypatch):  # fmt: skip
    """200 peers would start 200 node processes of at least 0.15 GB each."""
    from geotrain.testbed import _run

    monkeypatch.setattr(_run, "available_memory_gb", lambda: 20.0)
    out = tmp_path / "out"
    assert main(["testbed", "run", "--out", str(out), "--peers", "200"]) == 2
    said = capsys.readouterr()
    assert "200 peers need at least 30.0 GB" in said.err and "--peers 133 at most" in said.err
    assert said.out == "" and not out.exists()


def test_an_out_folder_in_use_is_refused_before_the_header(tmp_path, capsys):
    """It came after the scenario's header and fault lines, with exit status 1."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert main(["testbed", "run", "--out", str(out)]) == 2
    said = capsys.readouterr()
    assert "exists and is not an empty folder" in said.err and said.out == ""


def test_report_of_a_directory_without_a_run_exits_2(tmp_path, capsys):
    assert main(["testbed", "report", str(tmp_path)]) == 2
    assert "run.json" in capsys.readouterr().err


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.mark.slow
def test_sigterm_mid_run_stops_cleanly_and_leaves_nothing(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("the testbed needs root (network namespaces)")
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "geotrain.node", "testbed", "run", "--scenario", str(scenario),
           "--baseline", "none", "--target", "1.01", "--no-link-check", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, prefix = [], None
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("namespaces:"):
                prefix = line.split()[1].split("p00")[0]
            if "training started" in line or time.monotonic() > deadline:
                break
        assert prefix is not None and "training started" in lines[-1], "".join(lines)
        time.sleep(3)  # (a few status lines of its nodes to report)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines) + rest
    assert proc.returncode == 130, log
    assert list_namespaces(prefix) == [] and list_devices(prefix) == [], log
    # the folder says what happened (it held no run.json: nothing told an interrupted run)
    run = json.loads((out / "run.json").read_text())
    assert run["interrupted"] == "KeyboardInterrupt: SIGTERM", run
    # ... and what ran until then is reported: a long run cut short kept no figures at all
    assert run["systems"]["geotrain"]["stopped"] == "interrupted", run
    assert "run stopped early" in log and "stopped while it ran: geotrain" in log
    assert "INTERRUPTED: geotrain was running when the run was stopped" in log, log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["systems"][0]["stopped"] == "interrupted"
    assert summary["systems"][0]["steps_per_s_median"], summary["systems"][0]
    assert main(["testbed", "report", str(out)]) == 0
    assert _processes_mentioning(str(out)) == [], log
    # the nodes were stopped, not just killed: they had time to say so
    node_log = (out / "geotrain" / "peer-00.log").read_text()
    assert "stop_requested" in node_log, node_log[-2000:]
    assert json.loads((out / "scenario.json").read_text())["name"] == "tiny"


def _readme_task_example() -> str:
    page = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "own-task.md"
    return page.read_text().split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_relative_out_scenario_and_task_module_from_another_directory(tmp_path: Path):
    # A user's own folder, not the clone: a scenario file, a task module and an output directory,
    # all named relative to it, through the installed `geotrain` command (whose sys.path does not
    # start at the working directory, unlike `python -m`).
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "tiny.toml").write_text(TINY.replace("duration_s = 120", "duration_s = 20"))
    (work / "my_tasks.py").write_text(_readme_task_example())
    geotrain = Path(sys.executable).parent / "geotrain"
    cmd = [str(geotrain), "testbed", "run", "--scenario", "tiny.toml", "--task",
           "my_tasks:my_task", "--emulation", "none", "--baseline", "none", "--target", "0.6",
           "--out", "runs/first"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    out = work / "runs" / "first"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["systems"][0]["time_to_target_s"] is not None, log
    # every path a peer was handed is absolute, and inside the run's folder
    config = (out / "geotrain" / "peer-00.toml").read_text()
    paths = [line.split(" = ")[1].strip('"') for line in config.splitlines()
             if line.split(" = ")[0] in ("key", "certificate", "swarm", "dir")]  # fmt: skip
    assert len(paths) == 4 and all(Path(p).is_absolute() and str(out) in p for p in paths), config


def test_a_param_a_task_of_your_own_never_read_is_warned_about(tmp_path, monkeypatch, capsys):
    from dataclasses import replace

    from geotrain.testbed._cli import _task_target
    from geotrain.testbed._scenario import load_scenario

    (tmp_path / "plug_tasks.py").write_text(
        "from geotrain.node import resolve_task\n\n"
        "def make(ctx):\n"
        "    return resolve_task('digits-mlp')(ctx)  # reads hidden, layers, batch_size\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sc = replace(load_scenario("demo"), task="plug_tasks:make", params={"hiden": 3, "layers": 1})
    assert _task_target(sc, None, ["hiden"])[1] == "accuracy"  # not refused: it may read more
    err = capsys.readouterr().err
    assert "task 'plug_tasks:make' never read params hiden through ctx.param" in err
    assert "(it read: batch_size, hidden, layers)" in err


def test_a_fault_due_after_the_duration_is_warned_about(tmp_path, capsys, monkeypatch):
    """A fault at 400 s in a 60 s run was printed like any other and never happened."""
    from geotrain.testbed import _run

    def stop_here(options, echo):
        raise _run.TestbedError("stopped by the test")

    monkeypatch.setattr(_run, "run_testbed", stop_here)
    out = tmp_path / "out"
    faults = ("\n[[faults]]\nat_s = 5\naction = \"kill\"\npeer = 1\n"
              "[[faults]]\nat_s = 400\naction = \"restart\"\npeer = 1\n")  # fmt: skip
    scenario = tmp_path / "late.toml"
    scenario.write_text(TINY + faults)
    assert main(["testbed", "run", "--out", str(out), "--scenario", str(scenario),
                 "--duration", "60", "--no-link-check"]) == 1  # fmt: skip
    said = capsys.readouterr()
    assert "fault: t=400s restart peer 1" in said.out
    assert said.err.count("will not happen") == 1, said.err
    assert "fault at t=400s is due at or after the run's 60 s" in said.err
