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
