"""Availability windows ([[availability]]): the schedule they make, and the runner that turns it
into graceful leaves (SIGTERM) and restarts of fake peer processes."""

from __future__ import annotations

import signal

import pytest

from geotrain.testbed._availability import (
    AvailabilityRunner,
    availability_json,
    availability_schedule,
)
from geotrain.testbed._scenario import Availability, load_scenario, scenario_from_dict

SCENARIO = {
    "regions": [{"name": "a", "peers": 4}],
    "links": {"inside": {"delay_ms": 1}},
    "duration_s": 100,
    "availability": [
        {"peer": 2, "online_s": 30, "offline_s": 10, "offset_s": 5},
        {"peer": 1, "online_s": 20, "offline_s": 20},
    ],
}


class FakeProcess:
    """A peer process: SIGTERM makes it shut down (it runs on until `exit()`, as a node that
    checkpoints and leaves), start() starts it again."""

    def __init__(self) -> None:
        self.running = True
        self.signals: list[int] = []
        self.starts = 0
        self.notes: list[str] = []  # what the testbed wrote to the peer's log

    def signal(self, signum: int) -> None:
        self.signals.append(signum)

    def exit(self) -> None:
        self.running = False

    def start(self) -> None:
        self.starts += 1
        self.running = True

    def note(self, event: str, **fields: object) -> None:
        self.notes.append(event)


class FakePeers:
    def __init__(self, n: int) -> None:
        self.procs = [FakeProcess() for _ in range(n)]


def test_windows_make_the_schedule_of_leaves_and_joins():
    sc = scenario_from_dict(SCENARIO)
    got = [(e.at_s, e.peer, e.action) for e in availability_schedule(sc)]
    # peer 1: online 0-20, away 20-40, online 40-60, away 60-80, online 80-100
    # peer 2: online 0-35 (5 s offset + 30), away 35-45, online 45-75, away 75-85, online 85-
    assert got == [
        (20, 1, "leave"), (35, 2, "leave"), (40, 1, "join"), (45, 2, "join"),
        (60, 1, "leave"), (75, 2, "leave"), (80, 1, "join"), (85, 2, "join"),
    ]  # fmt: skip
    assert [e.at_s for e in availability_schedule(sc, until_s=40)] == [20, 35]
    window = sc.availability[0]
    assert [window.online_at(t) for t in (0, 19.9, 20, 39.9, 40, 65)] == [
        True, True, False, False, True, False]  # fmt: skip


def test_the_churn_builtin_keeps_about_half_the_peers_online():
    sc = load_scenario("churn")
    assert sc.n_peers == 8 and 0 not in {w.peer for w in sc.availability}
    for t in range(20, int(sc.duration_s), 5):  # after the first leave, at any moment
        online = 1 + sum(w.online_at(t + 0.5) for w in sc.availability)
        assert online in (4, 5), (t, online)
    assert scenario_from_dict(sc.to_json()).to_json() == sc.to_json()


def test_runner_leaves_with_sigterm_and_rejoins_once_the_old_process_exited():
    sc = scenario_from_dict(SCENARIO)
    peers, records, said, joined = FakePeers(4), [], [], []

    def join(i: int) -> None:
        joined.append(i)
        peers.procs[i].start()

    runner = AvailabilityRunner(sc, said.append, records, join=join)
    runner.apply_due(19.0, peers)
    assert records == [] and peers.procs[1].signals == []
    runner.apply_due(20.0, peers, wall_t=123.0)
    assert peers.procs[1].signals == [signal.SIGTERM]  # graceful, never SIGKILL
    assert runner.away() == {1}
    assert records[0] | {} == {
        "system": "geotrain", "kind": "availability", "at_s": 20, "applied_at_s": 20.0,
        "fault": "t=20s leave peer 1 (availability window)", "peer": 1, "action": "leave",
        "applied": True, "note": None, "t": 123.0,
    }  # fmt: skip
    runner.apply_due(40.0, peers)  # peer 1 still checkpointing: its join waits
    assert joined == [] and runner.away() == {1, 2}
    peers.procs[1].exit()
    peers.procs[2].exit()
    runner.apply_due(41.0, peers)
    assert joined == [1] and peers.procs[1].starts == 1 and runner.away() == {2}
    assert peers.procs[1].notes == ["testbed_left", "testbed_joined"]  # in the peer's log
    assert records[-1]["fault"] == "t=40s join peer 1 (availability window)"
    assert records[-1]["applied_at_s"] == 41.0  # when it really happened
    runner.apply_due(1000.0, peers)
    actions = [(r["peer"], r["action"], r["applied"]) for r in records]
    assert actions.count((1, "leave", True)) == 2 and actions.count((2, "join", True)) == 1
    assert peers.procs[0].signals == [] and peers.procs[3].signals == []
    assert any("leave peer 1" in line for line in said)


def test_a_join_whose_peer_never_finished_leaving_is_skipped_and_said():
    sc = scenario_from_dict({**SCENARIO, "availability": [
        {"peer": 1, "online_s": 10, "offline_s": 5}]})  # fmt: skip
    peers, records = FakePeers(4), []
    runner = AvailabilityRunner(sc, lambda _: None, records)
    runner.apply_due(10.0, peers)  # leave
    runner.apply_due(25.0, peers)  # join at 15 deferred (still running), next leave at 25
    assert [(r["action"], r["applied"]) for r in records] == [
        ("leave", True), ("join", False), ("leave", False)]  # fmt: skip
    assert "still shutting down" in records[1]["note"]
    assert peers.procs[1].signals == [signal.SIGTERM]  # no second SIGTERM (it cuts a shutdown)


def test_a_peer_that_is_not_running_is_not_signalled():
    sc = scenario_from_dict(SCENARIO)
    peers, records = FakePeers(4), []
    peers.procs[1].exit()  # crashed before its window ended
    AvailabilityRunner(sc, lambda _: None, records).apply_due(20.0, peers)
    assert records[0]["applied"] is False and records[0]["note"] == "the peer was not running"
    assert peers.procs[1].signals == []


def test_run_json_says_whom_the_windows_drive():
    sc = scenario_from_dict(SCENARIO)
    info = availability_json(sc)
    assert info["systems"] == ["geotrain"] and "DDP" in info["note"]
    assert info["windows"][0] == {"peer": 1, "online_s": 20, "offline_s": 20, "offset_s": 0.0}
    assert availability_json(scenario_from_dict({**SCENARIO, "availability": []}))["note"] is None


@pytest.mark.parametrize(
    ("window", "field"),
    [
        ({"peer": 0, "online_s": 10, "offline_s": 10}, "availability.peer"),
        ({"peer": 9, "online_s": 10, "offline_s": 10}, "availability.peer"),
        ({"peer": "1", "online_s": 10, "offline_s": 10}, "availability.peer"),
        ({"peer": 1, "online_s": 0.5, "offline_s": 10}, "availability[1].online_s"),
        ({"peer": 1, "online_s": "long", "offline_s": 10}, "availability[1].online_s"),
        ({"peer": 1, "online_s": 10, "offline_s": -1}, "availability[1].offline_s"),
        ({"peer": 1, "online_s": 10, "offline_s": float("inf")}, "availability[1].offline_s"),
        ({"peer": 1, "online_s": 10, "offline_s": 10, "offset_s": -2}, "availability[1].offset_s"),
        ({"peer": 1, "online_s": 10}, "availability[0].offline_s"),
        ({"online_s": 10, "offline_s": 10}, "availability[0].peer"),
        ({"peer": 1, "online_s": 10, "offline_s": 10, "period": 3}, "availability[0]"),
    ],
)
def test_invalid_windows_name_the_field(window, field):
    with pytest.raises(ValueError) as info:
        scenario_from_dict({**SCENARIO, "availability": [window]})
    assert f"scenario.{field} " in str(info.value)


def test_peer_zero_is_refused_because_it_is_the_bootstrap():
    with pytest.raises(ValueError, match="bootstrap peer and must stay online"):
        scenario_from_dict({**SCENARIO, "availability": [
            {"peer": 0, "online_s": 10, "offline_s": 10}]})  # fmt: skip


def test_windows_refuse_a_second_window_an_attacker_and_a_killed_peer():
    one = {"peer": 1, "online_s": 10, "offline_s": 10}
    with pytest.raises(ValueError, match="each peer at most once"):
        scenario_from_dict({**SCENARIO, "availability": [one, one]})
    with pytest.raises(ValueError, match="attacker"):
        scenario_from_dict({**SCENARIO, "availability": [one],
                            "attackers": [{"peer": 1, "kind": "nan"}]})  # fmt: skip
    with pytest.raises(ValueError, match="kill/restart"):
        scenario_from_dict({**SCENARIO, "availability": [one],
                            "faults": [{"at_s": 1, "action": "kill", "peer": 1}]})  # fmt: skip
    with pytest.raises(ValueError, match=r"scenario\.availability "):
        scenario_from_dict({**SCENARIO, "availability": {"peer": 1}})


def test_with_peers_keeps_only_the_windows_that_fit():
    sc = scenario_from_dict(SCENARIO).with_peers(2)
    assert [w.peer for w in sc.availability] == [1]
    assert Availability(3, 10, 10).events(25) == [(10, "leave"), (20, "join")]


def test_plots_mark_the_events_of_one_moment_with_one_label():
    from geotrain.testbed._plots import availability_groups

    sc = scenario_from_dict({**SCENARIO, "availability": [
        {"peer": 1, "online_s": 10, "offline_s": 10}, {"peer": 2, "online_s": 10,
                                                       "offline_s": 10}]})  # fmt: skip
    peers, records = FakePeers(4), [{"system": "geotrain", "fault": "t=1s kill peer 3"}]
    runner = AvailabilityRunner(sc, lambda _: None, records)
    runner.apply_due(10.2, peers, wall_t=110.2)  # both leave
    for p in peers.procs:
        p.exit()
    runner.apply_due(20.0, peers, wall_t=120.0)  # both join
    numbered = list(enumerate(records, 1))
    assert availability_groups(numbered, t0=100.0) == [
        (pytest.approx(10.2), "#2-#3 leave 1,2"), (20.0, "#4-#5 join 1,2")]  # fmt: skip


class Running:
    """A running process with a pid, as the swarm check sees it."""

    def __init__(self, pid: int, running: bool = True) -> None:
        self.running, self.proc = running, self
        self.pid = pid


def test_the_swarm_target_counts_an_away_peer_with_the_metric_it_left_with():
    from geotrain.testbed._run import swarm_at_target

    class Procs:
        procs = [Running(10), Running(11, running=False), Running(12)]

    good = [{"pid": 10, "metric": 0.95}, {"pid": 1, "metric": 0.93}, {"pid": 12, "metric": 0.91}]
    assert swarm_at_target(Procs, good, {1}, frozenset({1}), 0.9, True)
    left_low = [good[0], {"pid": 1, "metric": 0.5}, good[2]]
    assert not swarm_at_target(Procs, left_low, {1}, frozenset({1}), 0.9, True)
    # no window: a peer that stopped is not counted (a killed peer, as before)
    assert swarm_at_target(Procs, left_low, set(), frozenset(), 0.9, True)
    # rejoining, not reporting yet: its old status (another pid) counts until it reports
    Procs.procs[1] = Running(21)
    assert swarm_at_target(Procs, good, {1}, frozenset(), 0.9, True)
    assert not swarm_at_target(Procs, left_low, {1}, frozenset(), 0.9, True)
    # a peer without a window that runs but does not report yet: not there
    assert not swarm_at_target(Procs, good, set(), frozenset(), 0.9, True)
    assert not swarm_at_target(Procs, [good[0], None, good[2]], {1}, frozenset({1}), 0.9, True)
    # an attacker's own metric says nothing about the swarm: it is not waited for
    Procs.procs[1] = Running(21)
    attacked = [good[0], {"pid": 21, "metric": 0.1}, good[2]]
    assert not swarm_at_target(Procs, attacked, set(), frozenset(), 0.9, True)
    assert swarm_at_target(Procs, attacked, set(), frozenset(), 0.9, True, attackers={1})


@pytest.mark.slow
def test_windows_drive_real_nodes_out_gracefully_and_back_from_their_checkpoint(tmp_path):
    from geotrain.testbed._run import RunOptions, run_testbed

    sc = scenario_from_dict({
        "name": "comego", "task": "digits-mlp", "duration_s": 26, "step_ms": 50,
        "regions": [{"name": "a", "peers": 3}], "links": {"inside": {"delay_ms": 1}},
        # (10 s online: a restarted node's start-up takes seconds on a busy box, and the next
        # window would stop it again before it said node_started)
        "availability": [{"peer": 2, "online_s": 10, "offline_s": 4}],
    })  # fmt: skip
    out, lines = tmp_path / "run", []
    options = RunOptions(scenario=sc, out=out, target=1.01, emulation="none", baseline="none",
                         link_check=False, progress_every_s=5.0)  # fmt: skip
    summary = run_testbed(options, echo=lines.append)  # the target cannot be reached: 26 s
    log = "\n".join(lines)
    events = [(f["fault"], f["applied"]) for f in summary["faults"]]
    assert ("t=10s leave peer 2 (availability window)", True) in events, log
    assert ("t=14s join peer 2 (availability window)", True) in events, log
    names = [r.get("event") for r in _json_lines(out / "geotrain" / "peer-02.log")]
    assert names.count("node_started") >= 2, names  # started, then started again
    first_stop = names.index("stop_requested")  # SIGTERM: a clean stop, not a kill
    assert "checkpoint_written" in names[first_stop:] and "node_stopped" in names[first_stop:]
    assert "resumed" in names[first_stop:]  # the rejoin started from that checkpoint
    steps = [r["step"] for r in _json_lines(out / "geotrain" / "peer-02" / "metrics.jsonl")]
    assert max(steps) > steps[0] and steps == sorted(steps), steps  # it went on from there
    # peer 1 had no window: started once, stopped only at the end
    assert [r.get("event") for r in _json_lines(out / "geotrain" / "peer-01.log")
            ].count("node_started") == 1  # fmt: skip


def _json_lines(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_the_html_report_lists_the_windows_and_the_data_split():
    from geotrain.testbed._html import _scenario

    page = _scenario({**load_scenario("churn").to_json(), "partition": "dirichlet", "alpha": 0.3})
    assert '<table id="availability">' in page and page.count("<tr>") >= 7 + 1
    assert "dirichlet label skew, alpha 0.3" in page
    plain = _scenario(load_scenario("demo").to_json())
    assert '<table id="availability">' not in plain and "IID shards" in plain


def test_the_html_report_writes_a_tasks_params_as_a_scenario_does():
    from geotrain.testbed._html import _params

    assert _params({"size": "10m", "batch": 2}) == 'size = "10m", batch = 2'  # not {'size': ...}
    assert _params(None) == ""
