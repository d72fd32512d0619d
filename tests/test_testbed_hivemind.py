"""The baselines beyond DDP (issues 15, 19): choosing and configuring them, the error without the
hivemind extra, the comparison at equal quality in the summary, and one real run of DDP + local SGD
and of hivemind.Optimizer workers in namespaces behind the userspace emulator, with a peer killed
(hivemind's rejoins; a DDP job cannot)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from geotrain.node.cli._main import main
from geotrain.testbed._baselines import (
    HIVEMIND_PRESETS,
    baseline_settings,
    describe,
    missing_requirement,
    parse_baselines,
)
from geotrain.testbed._namespaces import list_namespaces
from geotrain.testbed._netem import choose_backend
from geotrain.testbed._run import RunOptions, run_testbed
from geotrain.testbed._scenario import scenario_from_dict
from geotrain.testbed._summary import build_summary, render_table

T0 = 1_000_000.0


def test_baselines_are_a_checked_list():
    assert parse_baselines("ddp") == ("ddp",)
    assert parse_baselines("ddp, hivemind,hivemind-local") == ("ddp", "hivemind", "hivemind-local")
    assert parse_baselines("localsgd,ddp") == ("localsgd", "ddp")
    assert parse_baselines("none") == ()
    with pytest.raises(ValueError, match="'hivemnd'.*ddp, localsgd, hivemind, hivemind-local"):
        parse_baselines("ddp,hivemnd")
    with pytest.raises(ValueError, match="named twice"):
        parse_baselines("hivemind,hivemind")


def test_settings_start_from_the_documented_presets_and_name_a_bad_change():
    got = baseline_settings(("ddp", "hivemind-local"), ["hivemind-local.target_batch_size=4096",
                                                        "hivemind-local.grad_compression=fp16"])
    assert got["ddp"] == {"lr": None}  # the task's rate unless said
    assert got["hivemind-local"]["target_batch_size"] == 4096
    assert got["hivemind-local"]["grad_compression"] == "fp16"
    assert got["hivemind-local"]["matchmaking_time"] == 3.0  # the quick start's value, untouched
    assert HIVEMIND_PRESETS["hivemind-local"]["target_batch_size"] == 10000  # preset not mutated
    assert baseline_settings(("localsgd",), ["localsgd.period=50", "localsgd.lr=0.003"]) == {
        "localsgd": {"period": 50, "lr": 0.003}}
    # each system at its own best rate: DDP averages 8 ranks' batches in a step
    assert baseline_settings(("ddp",), ["ddp.lr=0.0034"]) == {"ddp": {"lr": 0.0034}}
    assert describe("ddp", {"lr": 0.0034}) == "allreduce (gloo DDP), lr 0.0034"
    assert describe("ddp", {"lr": None}) == "allreduce (gloo DDP)"
    with pytest.raises(ValueError, match="localsgd has no setting 'rate'"):
        baseline_settings(("localsgd",), ["localsgd.rate=0.1"])
    for bad in ("0", "inf", "nan"):
        with pytest.raises(ValueError, match="lr must be > 0 and finite"):
            baseline_settings(("ddp",), [f"ddp.lr={bad}"])
    sync = baseline_settings(("hivemind",), [])["hivemind"]
    assert sync["use_local_updates"] is False and sync["target_batch_size"] is None
    cases = [
        ("hivemind.matchmaking_time=2", "not a configurable baseline of this run"),
        ("hivemind-local.matchmaking=2", "no setting 'matchmaking'"),
        ("hivemind-local.target_batch_size=lots", "target_batch_size expects an integer"),
        ("hivemind-local.averaging_timeout=-1", "must be > 0"),
        ("hivemind-local.use_local_updates=yes", "expects true or false"),
        ("hivemind-local.grad_compression=zip", "expects one of"),
        ("hivemind-local", "expected BASELINE.KEY=VALUE"),
    ]
    for item, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            baseline_settings(("hivemind-local",), [item])
        assert item in str(err.value)


def test_asking_for_hivemind_without_the_extra_says_how_to_install_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hivemind" else real(name, *a))
    assert missing_requirement("ddp") is None
    assert "pip install 'geotrain[baselines]'" in missing_requirement("hivemind")
    rc = main(["testbed", "run", "--baseline", "ddp,hivemind-local", "--no-link-check",
               "--out", "/nonexistent/never-made"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "--baseline hivemind-local: hivemind is not installed" in err
    assert not Path("/nonexistent/never-made").exists()


def test_cli_refuses_a_bad_baseline_before_anything_starts(capsys, tmp_path):
    rc = main(["testbed", "run", "--baseline", "hivemind", "--baseline-set",
               "hivemind.lr=fast", "--out", str(tmp_path / "run")])  # fmt: skip
    assert rc == 2
    assert "--baseline-set 'hivemind.lr=fast': lr expects a number" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _lines(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_summary_compares_every_system_at_equal_quality(tmp_path: Path):
    settings = dict(HIVEMIND_PRESETS["hivemind-local"])
    run = {
        "scenario": "fake", "emulation": "userspace", "emulation_reason": "test", "peers": 2,
        "task": "charlm", "params": {}, "algorithm": "adpsgd", "target_value": 0.9,
        "metric": "accuracy", "higher_is_better": True, "rate_scale": 1.0, "duration_s": 10,
        "bytes_source": "userspace emulator link counters", "faults": [], "links": [],
        "consensus_distance_final": None,
        "systems": {"geotrain": {"launch_t": T0 - 5, "stopped": "duration"},
                    "hivemind-local": {"launch_t": T0 - 5, "stopped": "duration",
                                       "algorithm": "hivemind.Optimizer, local updates",
                                       "settings": settings}},
    }  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    # geotrain: the worse peer is at 0.2 s*t; hivemind: at 0.1*t, but reaches 0.6 in the end
    for i in range(2):
        _lines(tmp_path / "geotrain" / f"peer-0{i}" / "metrics.jsonl", [
            {"t": T0 + s, "step": s, "steps_per_s": 1.0, "metric": min(0.5, 0.2 * s) - 0.01 * i}
            for s in range(1, 9)
        ])  # fmt: skip
        _lines(tmp_path / "hivemind-local" / f"peer-0{i}.jsonl", [
            {"t": T0 + s, "step": s, "steps_per_s": 1.0, "metric": 0.1 * s} for s in range(1, 7)
        ])  # fmt: skip
    _lines(tmp_path / "bytes-geotrain.jsonl",
           [{"t": T0 + s, "bytes": 1000 * s} for s in range(0, 9)])  # fmt: skip
    _lines(tmp_path / "bytes-hivemind-local.jsonl",
           [{"t": T0 + s, "bytes": 100 * s} for s in range(0, 9)])  # fmt: skip
    summary = build_summary(tmp_path)
    geotrain, hivemind = summary["systems"]
    assert hivemind["settings"] == settings
    assert hivemind["algorithm"] == "hivemind.Optimizer, local updates"
    assert geotrain["best_swarm_metric"] == pytest.approx(0.49)
    assert hivemind["best_swarm_metric"] == pytest.approx(0.6)
    eq = summary["equal_quality"]
    assert eq["level"] == pytest.approx(0.49)  # the best level both swarms reached
    # geotrain: both peers past 0.49 at T0+3 (0.6, 0.58 -> capped 0.5, 0.49); 3000 bytes by then
    assert eq["systems"]["geotrain"] == {"time_s": 3.0, "bytes": 3000, "held_time_s": 3.0,
                                         "held_bytes": 3000}  # (there for good from then)
    assert eq["systems"]["hivemind-local"] == {"time_s": 5.0, "bytes": 500, "held_time_s": 5.0,
                                               "held_bytes": 500}  # fmt: skip
    # the ladder: from the worst first level (hivemind's 0.1) up to 0.49, a quarter at a time
    ladder = [(round(r["level"], 4), r["systems"]["geotrain"]["time_s"],
               r["systems"]["hivemind-local"]["time_s"]) for r in eq["ladder"]]  # fmt: skip
    assert ladder == [(0.1975, 2.0, 2.0), (0.295, 2.0, 3.0), (0.3925, 3.0, 4.0), (0.49, 3.0, 5.0)]
    assert eq["ladder"][1]["systems"]["hivemind-local"]["bytes"] == 300
    table = render_table(summary)
    assert "accuracy 0.295: geotrain 2.0 s, 2.00 kB; hivemind-local 3.0 s, 300 B" in table
    assert "at equal quality (accuracy 0.49, every peer): geotrain 3.0 s, 3.00 kB; " \
           "hivemind-local 5.0 s, 500 B" in table
    assert "bytes sent: geotrain/hivemind-local = 10 (whole runs)" in table


def _p2pd_pids() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"p2pd" in f.read().split(b"\0")[0]:
                        pids.add(int(entry))
            except OSError:
                continue
    return pids


TWO = {
    "name": "two",
    "description": "2 peers in 2 regions; peer 1 is killed and rejoins",
    "task": "digits-mlp",
    # a bound: the run ends once both peers, the rejoined one too, are at 0.85 (5-15 s). Once in
    # CI hivemind's epoch tracker, after the kill at the first step, began a new epoch (and an
    # averaging round of matchmaking_time) every two steps; its peers climbed at 0.3 steps/s and
    # stood at 0.69-0.72 after 90 s: 180 s lets such a run still reach the target.
    "duration_s": 180,
    "regions": [{"name": "east", "peers": 1}, {"name": "west", "peers": 1}],
    "links": {
        "inside": {"delay_ms": 2, "rate_mbit": 500},
        "between": [{"regions": ["east", "west"], "delay_ms": 10, "rate_mbit": 100}],
    },
    # at the first step: on an idle machine both systems reach the target within 2 s
    "faults": [
        {"at_s": 0, "action": "kill", "peer": 1},
        {"at_s": 1, "action": "restart", "peer": 1},
    ],
}


@pytest.mark.slow
def test_hivemind_workers_train_behind_the_emulator_and_a_killed_one_rejoins(tmp_path: Path):
    # hivemind's local-updates mode with its preset (10000-sample epochs): it learns at compute
    # speed, so a short run reaches the target. The synchronous preset costs at least
    # matchmaking_time (3 s) per optimizer step and a failed round applies a zero gradient
    # (hivemind resets its accumulators before the round), and small epochs (640 samples) made
    # every fast local step an epoch that waited for the last averaging round (the tracker's
    # ETA is 0 s at digits' speed): neither can promise 0.85 within a minute on a loaded 2-core
    # box (CI failed with both). Their settings are tested above, figures in docs/benchmarks.md.
    if os.geteuid() != 0 or choose_backend("auto").backend == "none":
        pytest.skip("the testbed needs root and a link emulator")
    if missing_requirement("hivemind"):
        pytest.fail(missing_requirement("hivemind"))  # CI installs the extra: never skip there
    before = _p2pd_pids()
    out, lines = tmp_path / "run", []
    options = RunOptions(
        scenario=scenario_from_dict(TWO), out=out, target=0.85, emulation="userspace",
        baseline="localsgd,hivemind-local", link_check=False, progress_every_s=5.0, eval_every=5,
        baseline_set=("localsgd.period=4",),
    )  # fmt: skip
    summary = run_testbed(options, echo=lines.append)
    log = "\n".join(lines)
    prefix = next(line.split()[1].split("p00")[0] for line in lines if "namespaces:" in line)
    assert list_namespaces(prefix) == [], log
    assert _p2pd_pids() <= before, "a hivemind daemon outlived the run"

    _, localsgd, hivemind = summary["systems"]
    assert localsgd["system"] == "localsgd" and hivemind["system"] == "hivemind-local", log
    assert localsgd["settings"] == {"period": 4, "lr": None}
    assert "every 4 steps" in localsgd["algorithm"]
    assert all(r is not None and r > 0 for r in localsgd["steps_per_s_by_peer"]), log
    assert localsgd["bytes_sent_total"] > 0, log
    # the target stops local SGD only once both ranks have it (their models differ in between)
    if localsgd["stopped"] == "exited":
        assert all(m is not None and m >= 0.85 for m in localsgd["final_metric_by_peer"]), log
    assert hivemind["settings"] == HIVEMIND_PRESETS["hivemind-local"]
    assert all(r is not None and r > 0 for r in hivemind["steps_per_s_by_peer"]), log
    assert hivemind["stopped"] == "target", log  # the rejoined peer trained up to it too
    assert all(m is not None and m >= 0.85 for m in hivemind["final_metric_by_peer"]), log
    assert hivemind["bytes_sent_total"] > 20_000, "hivemind's traffic crossed the emulator"
    faults = [(f["system"], f["fault"], f["applied"]) for f in summary["faults"]]
    assert ("hivemind-local", "t=0s kill peer 1", True) in faults, log
    assert ("hivemind-local", "t=1s restart peer 1", True) in faults, log
    assert ("localsgd", "t=0s kill peer 1", False) in faults, log  # said, not hidden
    first = (out / "hivemind-local" / "peer-00.jsonl").read_text().splitlines()
    assert json.loads(first[0])["hivemind_peers"] == 2  # the swarm assembled before step 2
    rejoined = (out / "hivemind-local" / "peer-01.log").read_text()
    rejoin = rejoined.index("rejoining: loading the swarm's state")  # after the restart only
    assert "Finished downloading state" in rejoined[rejoin:]  # the swarm's state, not its own
    # it kept its hivemind key: its progress record replaced the killed one's (no ghost peer)
    assert "from 3 peers" not in (out / "hivemind-local" / "peer-00.log").read_text()
    steps = [json.loads(x)["step"]
             for x in (out / "hivemind-local" / "peer-01.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] > steps[0]  # counted on after the restart
