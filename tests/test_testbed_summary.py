"""summary.json and the table, from a run directory's files (fake files written here)."""

from __future__ import annotations

import json
from pathlib import Path

from geotrain.testbed._summary import build_summary, node_bytes_out, render_table, time_to_target

T0 = 1_000_000.0


def _write_lines(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _fake_run(out: Path) -> None:
    run = {
        "scenario": "fake", "emulation": "userspace", "emulation_reason": "test", "peers": 2,
        "task": "digits-mlp", "params": {}, "algorithm": "adpsgd", "target_value": 0.9,
        "metric": "accuracy", "higher_is_better": True, "rate_scale": 1.0, "duration_s": 10,
        "bytes_source": "userspace emulator link counters", "faults": [],
        "links": [{"src": "a", "dst": "b", "spec_rtt_ms": 20, "measured_rtt_ms": 21.0,
                   "spec_mbit": 100, "measured_mbit": 97.0}],
        "consensus_distance_final": 0.01,
        "systems": {"geotrain": {"launch_t": T0 - 5, "stopped": "target"},
                    "ddp": {"launch_t": T0 - 4, "stopped": "exited"}},
    }  # fmt: skip
    (out / "run.json").write_text(json.dumps(run))
    # geotrain: 10 steps/s from T0; peer 0 reaches 0.9 at +2 s, peer 1 at +3 s
    for i, reach in enumerate((2, 3)):
        _write_lines(out / "geotrain" / f"peer-0{i}" / "metrics.jsonl", [
            {"t": T0 + s, "step": 10 * s, "steps_per_s": 10.0,
             "metric": 0.95 if s >= reach else 0.5, "bytes_out": 100 * s}
            for s in range(1, 5)
        ])  # fmt: skip
    for i in range(2):  # ddp: 1 step/s from T0 (first line at +1 s, step 1), never reaches 0.9
        _write_lines(out / "ddp" / f"peer-0{i}.jsonl", [
            {"t": T0 + s, "step": s, "steps_per_s": 1.0, "metric": 0.6} for s in range(1, 6)
        ])  # fmt: skip
    _write_lines(out / "bytes-geotrain.jsonl", [{"t": T0 + 1, "bytes": 10}, {"t": T0 + 4,
                                                                            "bytes": 800}])
    _write_lines(out / "bytes-ddp.jsonl", [{"t": T0 + 5, "bytes": 80_000}])


def test_summary_has_the_issue_shape_and_measured_values(tmp_path: Path):
    _fake_run(tmp_path)
    summary = build_summary(tmp_path)
    assert {"scenario", "emulation", "peers", "task", "target", "systems", "links"} <= set(summary)
    assert summary["target"] == {"metric": "accuracy", "value": 0.9}
    geotrain, ddp = summary["systems"]
    assert geotrain["system"] == "geotrain" and geotrain["algorithm"] == "adpsgd"
    # training began at T0 (first line: step 10 at 10 steps/s, 1 s later); all peers at +3 s
    assert geotrain["time_to_target_s"] == 3.0
    assert geotrain["startup_s"] == 5.0
    assert geotrain["bytes_sent_total"] == 800
    assert geotrain["steps_per_s_by_peer"] == [10.0, 10.0]
    assert geotrain["steps_per_s_median"] == 10.0
    assert geotrain["final_metric"] == 0.95
    assert ddp["time_to_target_s"] is None and ddp["bytes_sent_total"] == 80_000
    assert ddp["final_metric"] == 0.6
    assert summary["links"][0]["measured_rtt_ms"] == 21.0
    table = render_table(summary)
    assert "3.0 s" in table and "not reached" in table
    assert "geotrain reached it, DDP did not" in table


def test_an_attacker_is_no_part_of_the_swarm_quality(tmp_path: Path):
    _fake_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    run["peers"], run["attackers"] = 3, {"2": "label_flip"}
    run["systems"]["ddp"]["stopped"] = "exited"
    (tmp_path / "run.json").write_text(json.dumps(run))
    # peer 2 attacks: its own accuracy stays at 0.1 and its bytes are counted
    _write_lines(tmp_path / "geotrain" / "peer-02" / "metrics.jsonl", [
        {"t": T0 + s, "step": 10 * s, "steps_per_s": 10.0, "metric": 0.1, "bytes_out": 100 * s}
        for s in range(1, 5)
    ])  # fmt: skip
    for i in range(3):  # the baseline's peer 2 is honest (the attack is geotrain's only)
        _write_lines(tmp_path / "ddp" / f"peer-0{i}.jsonl", [
            {"t": T0 + s, "step": s, "steps_per_s": 1.0, "metric": 0.6 + 0.1 * (i == 2)}
            for s in range(1, 6)
        ])  # fmt: skip
    summary = build_summary(tmp_path)
    geotrain, ddp = summary["systems"]
    assert geotrain["attackers"] == [2] and ddp["attackers"] == []
    assert geotrain["time_to_target_s"] == 3.0  # the honest two, as without the attacker
    assert geotrain["final_metric"] == 0.95 and geotrain["final_metric_by_peer"][2] is None
    assert geotrain["best_swarm_metric"] == 0.95
    assert ddp["final_metric_by_peer"] == [0.6, 0.6, 0.7]
    assert summary["equal_quality"]["level"] == 0.6


def test_without_emulator_counters_geotrain_bytes_come_from_the_nodes(tmp_path: Path):
    _fake_run(tmp_path)
    (tmp_path / "bytes-geotrain.jsonl").unlink()
    (tmp_path / "bytes-ddp.jsonl").unlink()
    geotrain, ddp = build_summary(tmp_path)["systems"]
    assert geotrain["bytes_sent_total"] == 800  # 2 peers x 400
    assert "bytes_out" in geotrain["bytes_source"]
    assert ddp["bytes_sent_total"] is None  # not measured, and not made up


def test_node_bytes_survive_a_restart_of_the_counter():
    records = [{"bytes_out": b} for b in (100, 250, 30, 90)]  # restarted after 250
    assert node_bytes_out(records) == 250 + 90


def test_time_to_target_waits_for_every_peer_and_respects_direction():
    peers = [
        [{"t": 1.0, "metric": 0.95}, {"t": 5.0, "metric": 0.97}],
        [{"t": 2.0, "metric": 0.5}, {"t": 4.0, "metric": 0.91}],
    ]
    assert time_to_target(peers, 0.9, True, 0.0) == 4.0
    assert time_to_target(peers, 0.99, True, 0.0) is None
    losses = [[{"t": 1.0, "metric": 0.3}, {"t": 3.0, "metric": 0.01}]]
    assert time_to_target(losses, 0.02, False, 0.0) == 3.0


def _fairness_run(out: Path, finals: list[float | None], higher_is_better: bool = True) -> None:
    """A run of len(finals) geotrain peers whose last evaluation is `finals[i]` (None: never)."""
    n = len(finals)
    run = {
        "scenario": "fake", "emulation": "none", "emulation_reason": "test", "peers": n,
        "task": "digits-mlp", "params": {}, "algorithm": "adpsgd", "target_value": 0.9,
        "metric": "accuracy" if higher_is_better else "loss",
        "higher_is_better": higher_is_better, "rate_scale": 1.0, "duration_s": 10,
        "bytes_source": "-", "faults": [], "links": [], "consensus_distance_final": None,
        "partition": "dirichlet", "alpha": 0.1,
        "systems": {"geotrain": {"launch_t": T0 - 5, "stopped": "duration"}},
    }  # fmt: skip
    (out / "run.json").write_text(json.dumps(run))
    for i, final in enumerate(finals):
        first = None if final is None else 0.5
        _write_lines(out / "geotrain" / f"peer-{i:02d}" / "metrics.jsonl", [
            {"t": T0 + 1, "step": 10, "steps_per_s": 10.0, "metric": first},
            {"t": T0 + 2, "step": 20, "steps_per_s": 10.0, "metric": final},
        ])  # fmt: skip


def test_fairness_is_the_mean_of_the_worst_tenth_by_the_tasks_direction(tmp_path: Path):
    # 12 peers: ceil(1.2) = 2 worst peers, 0.40 (peer 5) and 0.60 (peer 9)
    finals = [0.9, 0.91, 0.92, 0.93, 0.94, 0.40, 0.95, 0.96, 0.97, 0.60, 0.98, 0.99]
    _fairness_run(tmp_path, finals)
    summary = build_summary(tmp_path)
    (geotrain,) = summary["systems"]
    assert geotrain["final_metric_by_peer"] == finals
    assert geotrain["worst_10pct_peers"] == [5, 9]
    assert geotrain["final_metric_worst_10pct"] == 0.5
    assert geotrain["final_metric"] == round(sum(finals) / 12, 4)  # the mean, as before
    assert summary["partition"] == {"kind": "dirichlet", "alpha": 0.1}
    table = render_table(summary)
    header = table.splitlines()[1]
    assert "final accuracy: mean (worst 10%)" in header
    assert f"{geotrain['final_metric']:.4f} (0.5000)" in table.splitlines()[2]
    assert "peer 5, peer 9" in table and "dirichlet label skew, alpha 0.1" in table


def test_fairness_of_a_loss_takes_the_highest_and_skips_peers_never_evaluated(tmp_path: Path):
    finals = [0.2, 0.9, None, 0.1, 0.3]  # a loss: lower is better, so 0.9 (peer 1) is the worst
    _fairness_run(tmp_path, finals, higher_is_better=False)
    (geotrain,) = build_summary(tmp_path)["systems"]
    assert geotrain["final_metric_by_peer"][2] is None
    assert geotrain["worst_10pct_peers"] == [1]  # ceil(0.4) = 1 of the 4 with a figure
    assert geotrain["final_metric_worst_10pct"] == 0.9


def test_an_iid_run_and_an_older_run_say_iid_without_an_alpha(tmp_path: Path):
    _fake_run(tmp_path)  # an older run.json: no partition recorded
    assert build_summary(tmp_path)["partition"] == {"kind": "iid", "alpha": None}
    run = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps({**run, "partition": "iid", "alpha": 0.5}))
    assert build_summary(tmp_path)["partition"] == {"kind": "iid", "alpha": None}
    assert "label skew" not in render_table(build_summary(tmp_path))


def test_compute_utilization_per_peer_for_every_system(tmp_path: Path):
    _fake_run(tmp_path)
    summary = build_summary(tmp_path)
    # no compute emulation and no figure from the nodes: not measured, and the table says nothing
    assert all(s["utilization_by_peer"] == [None, None] for s in summary["systems"])
    assert "compute utilization" not in render_table(summary)
    run = json.loads((tmp_path / "run.json").read_text())
    run.update(step_ms=500.0, slowdowns=[1.0, 1.5])  # compute emulation: 0.5 s and 0.75 s steps
    (tmp_path / "run.json").write_text(json.dumps(run))
    for i, own in enumerate((0.97, 0.91)):  # the nodes measured their own
        path = tmp_path / "geotrain" / f"peer-0{i}" / "metrics.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        _write_lines(path, [*lines, {**lines[-1], "utilization": own}])
    geotrain, ddp = build_summary(tmp_path)["systems"]
    assert geotrain["utilization_by_peer"] == [0.97, 0.91] and geotrain["utilization_min"] == 0.91
    # ddp: 1 step/s; steps pinned at 0.5 s (peer 1: 0.75 s) -> half (three quarters) the time
    assert ddp["utilization_by_peer"] == [0.5, 0.75] and ddp["utilization_min"] == 0.5
    assert "compute utilization, lowest peer: geotrain 91%, ddp 50%" in render_table(
        build_summary(tmp_path))


def test_compute_utilization_also_of_the_time_not_spent_evaluating(tmp_path: Path):
    """The testbed evaluates every system every 10 s; those seconds are its measurement, not
    the system's waiting: the figure without them stands beside the whole one."""
    _fake_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    run.update(step_ms=500.0, slowdowns=[1.0, 1.0])
    (tmp_path / "run.json").write_text(json.dumps(run))
    for i in range(2):  # ddp at 1 step/s (0.5 s pinned), 0.2 s of each second evaluating
        _write_lines(tmp_path / "ddp" / f"peer-0{i}.jsonl", [
            {"t": T0 + s, "step": s, "steps_per_s": 1.0, "metric": 0.6, "eval_s": 0.2 * s}
            for s in range(1, 6)
        ])  # fmt: skip
        path = tmp_path / "geotrain" / f"peer-0{i}" / "metrics.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        _write_lines(path, [*lines, {**lines[-1], "utilization": 0.9,
                                     "utilization_without_eval": 0.96 + 0.01 * i}])
    geotrain, ddp = build_summary(tmp_path)["systems"]
    assert geotrain["utilization_min"] == 0.9 and geotrain["utilization_without_eval_min"] == 0.96
    assert ddp["utilization_by_peer"] == [0.5, 0.5]
    assert ddp["utilization_without_eval_by_peer"] == [0.625, 0.625]  # 2 s of 3.2 s not evaluating
    table = render_table(build_summary(tmp_path))
    assert "geotrain 90% (96%), ddp 50% (62%)" in table


def test_a_nan_metric_is_read_as_no_metric(tmp_path: Path):
    """A baseline peer whose evaluation gave NaN made ladder rows of "accuracy nan" and bare
    NaN tokens in summary.json (not JSON)."""
    from geotrain.testbed._summary import load_jsonl

    path = tmp_path / "peer-00.jsonl"
    path.write_text('{"t": 1.0, "step": 5, "metric": NaN, "loss": Infinity}\n'
                    '{"t": 2.0, "step": 9, "metric": 0.5}\n')  # fmt: skip
    records = load_jsonl(path)
    assert records[0]["metric"] is None and records[0]["loss"] is None
    assert records[1]["metric"] == 0.5
    json.dumps(records, allow_nan=False)  # strict JSON from here on


def _kill_peer_1(tmp_path: Path, restart_at: float | None, old_style: bool = False) -> dict:
    """The fake run with peer 1 killed at +2.5 s, after it had reported 0.5; peer 0 is at 0.95
    from +2 s. Restarted at `restart_at` (None: never), from when it writes 0.95 lines."""
    _fake_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    faults = [("kill", 2.5)] + ([] if restart_at is None else [("restart", restart_at)])
    run["faults"] = [{"system": "geotrain", "at_s": at, "applied_at_s": at, "applied": True,
                      "fault": f"t={at}s {action} peer 1", "note": None, "t": T0 + at,
                      **({} if old_style else {"action": action, "peer": 1})}
                     for action, at in faults]  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    lines = [{"t": T0 + s, "step": 10 * s, "steps_per_s": 10.0, "metric": 0.5,
              "bytes_out": 100 * s} for s in (1, 2)]  # fmt: skip
    if restart_at is not None:
        lines += [{"t": T0 + restart_at + s, "step": 20 + 10 * s, "steps_per_s": 10.0,
                   "metric": 0.95, "bytes_out": 50 * s} for s in (1, 2)]  # fmt: skip
    _write_lines(tmp_path / "geotrain" / "peer-01" / "metrics.jsonl", lines)
    return build_summary(tmp_path)["systems"][0]


def test_a_killed_peer_counts_as_the_run_counts_it(tmp_path: Path):
    """A peer killed while a restart was due held the run back (the run waited for it), but the
    summary counted its last metric from before the kill: time to target 15 s in a run that
    stopped at 37 s (a stranger's run). Now the swarm is at no level until the restarted
    process reports, and a peer killed for good leaves the swarm."""
    # restarted at +6 s, first report at +7 s: the swarm is at the target then, not before
    assert _kill_peer_1(tmp_path, restart_at=6.0)["time_to_target_s"] == 7.0
    # a run written before the faults named their peer: read from the description
    assert _kill_peer_1(tmp_path, restart_at=6.0, old_style=True)["time_to_target_s"] == 7.0
    # never restarted: from the kill on, the swarm is peer 0, at 0.95
    assert _kill_peer_1(tmp_path, restart_at=None)["time_to_target_s"] == 2.5


def test_a_restart_due_after_the_run_and_a_second_kill_hold_the_level_as_the_run_did(
    tmp_path: Path,
):
    """A reviewer's cases: a restart scheduled past the run's end (the run waited for it, so the
    swarm never was at the target), and a peer killed, restarted and killed for good before
    it reported (the level froze for ever)."""
    _kill_peer_1(tmp_path, restart_at=None)
    run = json.loads((tmp_path / "run.json").read_text())
    run["faults"].append({"system": "geotrain", "at_s": 99, "applied_at_s": None,
                          "applied": False, "fault": "t=99s restart peer 1",
                          "note": "not reached: the run ended (duration) at 5.0 s",
                          "action": "restart", "peer": 1})  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert build_summary(tmp_path)["systems"][0]["time_to_target_s"] is None
    run["faults"][-1] = {"system": "geotrain", "at_s": 3, "applied_at_s": 3, "applied": True,
                         "fault": "t=3s restart peer 1", "note": None, "t": T0 + 3,
                         "action": "restart", "peer": 1}  # fmt: skip
    run["faults"].append({"system": "geotrain", "at_s": 3.5, "applied_at_s": 3.5,
                          "applied": True, "fault": "t=3.5s kill peer 1", "note": None,
                          "t": T0 + 3.5, "action": "kill", "peer": 1})  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    # gone for good at +3.5 s: peer 0 alone is the swarm from then (its next line, +4 s)
    assert build_summary(tmp_path)["systems"][0]["time_to_target_s"] == 3.5


def test_a_level_touched_once_and_left_is_not_said_to_be_held(tmp_path: Path):
    """A noisy metric can touch the equal-quality level once and leave it (DDP on the 10M gpt
    model: 6.41 bits per byte at its step 1, 7.79 at step 3, 6.67 at the end); the first touch
    alone said the system was there from then on."""
    _fake_run(tmp_path)
    for i in range(2):  # ddp touches 0.6 at +2 s, falls back to 0.4, is at 0.6 again from +5 s
        _write_lines(tmp_path / "ddp" / f"peer-0{i}.jsonl", [
            {"t": T0 + s, "step": s, "steps_per_s": 1.0, "metric": m}
            for s, m in zip(range(1, 7), (0.3, 0.6, 0.4, 0.4, 0.6, 0.6), strict=True)
        ])  # fmt: skip
    for i, finals in enumerate(((0.95, 0.5), (0.95, 0.95))):  # geotrain's peer 0 ends at 0.5
        _write_lines(tmp_path / "geotrain" / f"peer-0{i}" / "metrics.jsonl", [
            {"t": T0 + s, "step": 10 * s, "steps_per_s": 10.0,
             "metric": 0.5 if s == 1 else finals[s == 4], "bytes_out": 100 * s}
            for s in range(1, 5)
        ])  # fmt: skip
    summary = build_summary(tmp_path)
    eq = summary["equal_quality"]
    assert eq["level"] == 0.6
    ddp, geotrain = eq["systems"]["ddp"], eq["systems"]["geotrain"]
    assert ddp["time_s"] == 2.0 and ddp["held_time_s"] == 5.0  # (t0: its first step, T0)
    assert geotrain["time_s"] == 2.0 and geotrain["held_time_s"] is None
    table = render_table(summary)
    assert "ddp 2.0 s" in table and "there for good from 5.0 s" in table
    assert "then left it: not there at the end" in table


def test_a_peer_never_back_from_its_restart_and_a_system_past_its_duration_are_said(
        tmp_path: Path):  # fmt: skip
    # a restarted peer that never reported again was shown with its final metric from before
    # its kill, and a baseline that trained 23 s past a 40 s run was counted without a word
    _kill_peer_1(tmp_path, restart_at=3.0)
    lines = [{"t": T0 + s, "step": 10 * s, "steps_per_s": 10.0, "metric": 0.5,
              "bytes_out": 100 * s} for s in (1, 2)]  # fmt: skip
    _write_lines(tmp_path / "geotrain" / "peer-01" / "metrics.jsonl", lines)
    for i in range(2):  # ddp's last line 13 s after its first step, in a 10 s run
        _write_lines(tmp_path / "ddp" / f"peer-0{i}.jsonl", [
            {"t": T0 + s, "step": s, "steps_per_s": 1.0, "metric": 0.6} for s in range(1, 14)
        ])  # fmt: skip
    summary = build_summary(tmp_path)
    geotrain, ddp = summary["systems"]
    assert geotrain["silent_after_restart"] == [1] and ddp["silent_after_restart"] == []
    assert ddp["overran_s"] == 3.0 and geotrain["overran_s"] is None
    table = render_table(summary)
    assert "NOT BACK: geotrain peers [1] were restarted by a fault and never reported" in table
    assert "OVERRAN: ddp stepped 3 s past the run's 10 s" in table
    # geotrain's lines after the testbed stopped it (its stop: an evaluation, the checkpoint,
    # status lines) are no overrun; nor is a baseline's last step within a step and a tenth
    for i in range(2):
        _write_lines(tmp_path / "geotrain" / f"peer-0{i}" / "metrics.jsonl", [
            {"t": T0 + s, "step": 10 * min(s, 4), "steps_per_s": 10.0, "metric": 0.5,
             "bytes_out": 100 * s} for s in range(1, 16)])  # fmt: skip
    for i in range(2):
        _write_lines(tmp_path / "ddp" / f"peer-0{i}.jsonl", [
            {"t": T0 + s, "step": s, "steps_per_s": 1.0, "metric": 0.6} for s in range(1, 13)
        ])  # fmt: skip
    summary = build_summary(tmp_path)
    assert [s["overran_s"] for s in summary["systems"]] == [None, None]
    _kill_peer_1(tmp_path, restart_at=6.0)  # it reported after its restart: nothing said
    summary = build_summary(tmp_path)
    assert summary["systems"][0]["silent_after_restart"] == []
    assert "NOT BACK" not in render_table(summary) and "OVERRAN" not in render_table(summary)


def test_a_restarted_peer_is_counted_over_both_of_its_processes(tmp_path: Path):
    """A stranger's run: a peer killed at 15 s and back at 30 s showed 0.669 steps/s (it ran at
    ~9.9; the last step of its new process, counted from 0, minus the first of its old one, over
    the whole run), its utilization was its new process's alone, and a hivemind peer that came
    back, stepped and never evaluated again kept its pre-kill score as the swarm's: every
    system was compared at that barely trained level, with no NOT BACK line."""
    _kill_peer_1(tmp_path, restart_at=6.0)
    _write_lines(tmp_path / "geotrain" / "peer-01" / "metrics.jsonl", [
        {"t": T0 + 1, "pid": 11, "step": 10, "metric": 0.5, "utilization": 0.5, "train_s": 0.5},
        {"t": T0 + 2, "pid": 11, "step": 20, "metric": 0.5, "utilization": 0.5, "train_s": 0.5},
        {"t": T0 + 7, "pid": 12, "step": 5, "metric": None, "utilization": 1.0, "train_s": 1.0},
        {"t": T0 + 8, "pid": 12, "step": 15, "metric": None, "utilization": 1.0, "train_s": 1.0},
        # a third process killed within its first step: nothing to weigh, not a zero
        {"t": T0 + 9, "pid": 13, "step": 0, "metric": None, "utilization": 0.0, "train_s": 0.0},
    ])  # fmt: skip
    summary = build_summary(tmp_path)
    geotrain = summary["systems"][0]
    assert geotrain["steps_per_s_by_peer"][1] == 10.0  # 10 steps in each process's 1 s
    assert geotrain["utilization_by_peer"][1] == 0.75  # 1.5 s of steps in 2 s of its processes
    # it stepped after its restart but never evaluated: said, the run's level unknown from its
    # kill (as the run's own stop rule held it), and the level of the comparison at equal
    # quality is ddp's best (0.6), not geotrain's frozen 0.5
    assert geotrain["silent_after_restart"] == [1]
    assert geotrain["time_to_target_s"] is None and geotrain["best_swarm_metric"] == 0.5
    assert summary["equal_quality"]["level"] == 0.6
    assert summary["equal_quality"]["systems"]["geotrain"]["time_s"] is None
    assert "never reported a metric again" in render_table(summary)


def test_a_level_reached_at_the_exit_evaluation_has_the_runs_bytes():
    # a node evaluates once more at its exit, after the meter's last reading: the level's bytes
    # were shown as "-" (null in summary.json) though every byte of the run was metered
    from geotrain.testbed._summary import bytes_at

    samples = [{"t": 100.0, "bytes": 10}, {"t": 100.25, "bytes": 25}, {"t": 100.5, "bytes": 40}]
    assert bytes_at(samples, 100.1) == 25  # the first reading at or after the time
    assert bytes_at(samples, 100.5) == 40
    assert bytes_at(samples, 101.2) == 40  # past the last reading: all the run put on the links
    assert bytes_at([], 100.0) is None  # nothing metered: not known


def test_geotrains_cell_says_the_learning_rate_its_nodes_were_given():
    # a baseline's cell says its --baseline-set lr; without this the table read as if only DDP
    # had been tuned
    from geotrain.testbed._summary import geotrain_cell

    assert geotrain_cell({"algorithm": "diloco", "node_overrides": []}) == "diloco"
    run = {"algorithm": "diloco",
           "node_overrides": ["gossip.preset=frugal", "training.lr=4e-4", " training.lr = 3e-4"]}
    assert geotrain_cell(run) == "diloco, lr 0.0003"  # the last one, as the nodes take it
    assert geotrain_cell({"algorithm": "adpsgd"}) == "adpsgd"  # an older run.json


def _geotrain_only(out: Path, reach_s: tuple[int, int], bytes_per_s: int) -> None:
    """A fake run of geotrain alone (--baseline none): peer i at 0.95 from reach_s[i] s."""
    out.mkdir(parents=True)
    _fake_run(out)
    run = json.loads((out / "run.json").read_text())
    del run["systems"]["ddp"]
    run["command"] = ["geotrain", "testbed", "run", "--baseline", "none"]
    (out / "run.json").write_text(json.dumps(run))
    for i, reach in enumerate(reach_s):
        _write_lines(out / "geotrain" / f"peer-0{i}" / "metrics.jsonl", [
            {"t": T0 + s, "step": 10 * s, "steps_per_s": 10.0,
             "metric": 0.95 if s >= reach else 0.5} for s in range(1, 9)
        ])  # fmt: skip
    _write_lines(out / "bytes-geotrain.jsonl",
                 [{"t": T0 + s, "bytes": bytes_per_s * s} for s in range(9)])


def test_compare_puts_two_runs_systems_at_equal_quality(tmp_path: Path, capsys):
    from geotrain.node.cli._main import main

    _geotrain_only(tmp_path / "default", (2, 4), 1000)  # all at 0.95 from +4 s: 4000 bytes
    _geotrain_only(tmp_path / "frugal", (6, 7), 10)  # from +7 s: 70 bytes
    assert main(["testbed", "compare", str(tmp_path / "default"), str(tmp_path / "frugal")]) == 0
    out = capsys.readouterr().out
    # (time counts from each system's first step: T0, one step before its first line)
    assert "default/geotrain 4.0 s, 4.00 kB; frugal/geotrain 7.0 s, 70 B" in out, out
    assert "frugal/geotrain / default/geotrain: 1.75x the time, 0.0175x the bytes" in out, out
    assert main(["testbed", "compare", "--json", "--system", "geotrain",
                 str(tmp_path / "default"), str(tmp_path / "frugal")]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    eq = doc["equal_quality"]
    assert eq["level"] == 0.95 and eq["systems"]["frugal/geotrain"]["time_s"] == 7.0
    assert [r["command"] for r in doc["runs"]] == ["geotrain testbed run --baseline none"] * 2


def test_compare_refuses_runs_of_another_task_or_one_system(tmp_path: Path, capsys):
    from geotrain.node.cli._main import main

    _geotrain_only(tmp_path / "a", (2, 4), 1000)
    _geotrain_only(tmp_path / "b", (2, 4), 1000)
    assert main(["testbed", "compare", str(tmp_path / "a")]) == 2
    assert "1 system(s) to compare: give two runs or more" in capsys.readouterr().err
    run = json.loads((tmp_path / "b" / "run.json").read_text())
    (tmp_path / "b" / "run.json").write_text(json.dumps({**run, "task": "charlm"}))
    assert main(["testbed", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert 'the runs differ in task ("charlm", "digits-mlp")' in capsys.readouterr().err
    assert main(["testbed", "compare", str(tmp_path / "a"), str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no testbed run there" in capsys.readouterr().err
    (tmp_path / "b" / "run.json").write_text(json.dumps({**run, "bytes_source": "none"}))
    assert main(["testbed", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "the runs differ in bytes_source" in capsys.readouterr().err  # other counters
    (tmp_path / "b" / "run.json").write_text(json.dumps({**run, "systems": {}}))
    assert main(["testbed", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "b: no system finished in that run (interrupted)" in capsys.readouterr().err
    (tmp_path / "b" / "run.json").write_text(json.dumps({"scenario": "x"}))
    assert main(["testbed", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "no testbed run there (KeyError" in capsys.readouterr().err


def test_a_system_the_run_was_stopped_in_sets_no_level_and_no_ratio(tmp_path: Path):
    """A run interrupted 3 s into DDP: its summary had DDP's barely trained level set the
    comparison for every system, and 'geotrain reached it, DDP did not' beside it."""
    _fake_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    run["systems"]["ddp"]["stopped"] = "interrupted"
    run["interrupted"] = "KeyboardInterrupt"
    (tmp_path / "run.json").write_text(json.dumps(run))
    summary = build_summary(tmp_path)
    assert summary["equal_quality"]["level"] == 0.95  # geotrain's best, not ddp's 0.6
    table = render_table(summary)
    assert "INTERRUPTED: ddp was running when the run was stopped" in table
    assert "DDP did not" not in table and "geotrain/DDP" not in table
