"""The fault timeline against a fake emulator and fake peer processes."""

from __future__ import annotations

import signal

from geotrain.testbed._faults import FaultRunner
from geotrain.testbed._linkspec import LinkMatrix, LinkSpec
from geotrain.testbed._scenario import scenario_from_dict

SCENARIO = {
    "regions": [{"name": "a", "peers": 1}, {"name": "b", "peers": 2}],
    "links": {"inside": {"delay_ms": 1}, "between": [{"regions": ["a", "b"], "delay_ms": 30}]},
    "faults": [
        {"at_s": 3, "action": "partition", "regions": ["a", "b"]},
        {"at_s": 1, "action": "kill", "peer": 2},
        {"at_s": 5, "action": "heal"},
        {"at_s": 6, "action": "degrade", "regions": ["b", "a"], "delay_ms": 200, "rate_mbit": 1},
        {"at_s": 2, "action": "restart", "peer": 2},
    ],
}


class FakeLinks:
    def __init__(self, matrix: LinkMatrix) -> None:
        self.matrix = matrix
        self.history: list[LinkMatrix] = []

    def set_matrix(self, matrix: LinkMatrix) -> None:
        self.matrix = matrix
        self.history.append(matrix)


class FakeProcess:
    def __init__(self) -> None:
        self.running = True
        self.signals: list[int] = []
        self.starts = 0
        self.notes: list[str] = []  # what the testbed wrote to the peer's log
        self.proc = self

    def signal(self, signum: int) -> None:
        self.signals.append(signum)
        self.running = False

    def wait(self) -> int:
        return -9

    def start(self) -> None:
        self.starts += 1
        self.running = True

    def note(self, event: str, **fields: object) -> None:
        self.notes.append(event)


class FakePeers:
    def __init__(self, n: int) -> None:
        self.procs = [FakeProcess() for _ in range(n)]


def test_faults_apply_in_time_order_once_each():
    sc = scenario_from_dict(SCENARIO)
    links, peers, said = FakeLinks(sc.matrix()), FakePeers(3), []
    runner = FaultRunner(sc, links, said.append)
    runner.apply_due(0.5, peers)
    assert runner.applied_all == [] and runner.restart_pending(2)
    runner.apply_due(1.0, peers)
    assert peers.procs[2].signals == [signal.SIGKILL] and not peers.procs[2].running
    runner.apply_due(3.5, peers)  # restart and partition, in order
    assert peers.procs[2].starts == 1 and not runner.restart_pending(2)
    assert peers.procs[2].notes == ["testbed_killed", "testbed_restarted"]  # in the peer's log
    assert links.matrix.spec("a", "b").partitioned and links.matrix.spec("b", "a").partitioned
    assert not links.matrix.spec("b", "b").partitioned
    runner.apply_due(5.0, peers)
    assert links.matrix == sc.matrix()
    runner.apply_due(100.0, peers)
    assert links.matrix.spec("b", "a") == LinkSpec(delay_ms=200, rate_mbit=1)
    assert links.matrix.spec("a", "b") == LinkSpec(delay_ms=30)  # one direction only
    runner.apply_due(200.0, peers)
    assert [f["at_s"] for f in runner.applied_all] == [1, 2, 3, 5, 6]
    assert all(f["applied"] for f in runner.applied_all)
    runner.reset()
    assert links.matrix == sc.matrix()


def test_ddp_run_skips_process_faults_and_says_so():
    sc = scenario_from_dict(SCENARIO)
    links, peers, said = FakeLinks(sc.matrix()), FakePeers(3), []
    runner = FaultRunner(sc, links, said.append, system="ddp")
    runner.apply_due(10.0, peers)
    skipped = [f for f in runner.applied_all if not f["applied"]]
    assert [f["fault"] for f in skipped] == ["t=1s kill peer 2", "t=2s restart peer 2"]
    assert all("DDP" in f["note"] for f in skipped)
    assert peers.procs[2].signals == [] and any("SKIPPED" in line for line in said)
    assert links.matrix.spec("b", "a").delay_ms == 200  # link faults still apply


def test_without_emulation_link_faults_are_recorded_as_skipped():
    sc = scenario_from_dict(SCENARIO)
    runner = FaultRunner(sc, None, lambda _: None)
    runner.apply_due(10.0, FakePeers(3))
    notes = {f["fault"].split()[1]: f["note"] for f in runner.applied_all}
    assert notes["partition"] == "no link emulation" and notes["kill"] is None


def test_faults_the_run_ended_before_are_recorded_and_said():
    """A fault at t=300 s of a 30 s run was printed at the start, then never applied, and
    run.json's faults said nothing of it."""
    from geotrain.testbed._plots import fault_x

    sc = scenario_from_dict(SCENARIO)
    runner, said = FaultRunner(sc, FakeLinks(sc.matrix()), None), []
    runner._echo = said.append
    runner.apply_due(2.5, FakePeers(3))  # kill and restart happened
    runner.not_reached(2.9, "target")
    late = [f for f in runner.applied_all if f["applied_at_s"] is None]
    assert [f["at_s"] for f in late] == [3, 5, 6] and not any(f["applied"] for f in late)
    assert all("not reached: the run ended (target) at 2.9 s" in f["note"] for f in late)
    assert sum("not reached" in line for line in said) == 3
    assert fault_x(late[0], 0.0) == 3.0  # (the report's table places it where it was due)
    runner.not_reached(3.0, "target")  # nothing left to say
    assert len(runner.applied_all) == 5


def test_a_baselines_faults_count_from_when_its_first_step_began(tmp_path):
    """The fault clock started when the supervisor first saw a metrics line, at the end of the
    first step and its evaluation: DDP's came 7 s after its first step began, so its faults
    fell 7 s later into its run than into geotrain's, on the summary's time axis (t0: the first
    step's start, from the same line)."""
    import json
    import time
    from types import SimpleNamespace

    from geotrain.testbed import _run

    began = time.time() - 7.0  # the first line says: step 1 at 0.14 steps/s, written now
    metrics = tmp_path / "peer-00.jsonl"
    metrics.write_text(json.dumps({"t": began + 7.0, "step": 1, "steps_per_s": 1 / 7.0}) + "\n")
    assert abs(_run.first_step_began([metrics, tmp_path / "peer-01.jsonl"]) - began) < 1e-6

    seen = []

    class Faults:
        def apply_due(self, elapsed_s, peers, wall_t=None):
            seen.append(elapsed_s)

        def not_reached(self, ended_s, why):
            seen.append(why)

    options = SimpleNamespace(scenario=SimpleNamespace(duration_s=7.5), out=tmp_path,
                              progress_every_s=60.0)  # fmt: skip
    peers = SimpleNamespace(procs=[], running=lambda: True)
    meter = SimpleNamespace(total=lambda: None)
    stopped = _run._supervise(
        "ddp", options, peers, meter, Faults(), lambda line: None, lambda: False, lambda: [],
        first_step=lambda: _run.first_step_began([metrics]), stop_at_duration=True,
        launch=began - 10.0,
    )  # fmt: skip
    assert stopped == "duration" and seen[-1] == "duration"
    assert seen[0] >= 7.0  # its clock began with its first step, not with the line


def test_geotrains_first_step_is_read_past_its_step_0_lines_and_an_exit_at_target_is_said(
        tmp_path):  # fmt: skip
    """geotrain's fault clock began when the supervisor saw a step in a status, a second or so
    after the summary's t0: a fault "not reached: the run ended (target) at 0.8 s" beside a
    table that said 1.6 s. And DDP's ranks stopping at the target were noted as "exited",
    relabelled "target" only after the note was written."""
    import json
    import time
    from types import SimpleNamespace

    from geotrain.testbed import _run

    began = time.time() - 3.0
    metrics = tmp_path / "metrics.jsonl"  # a node's first line comes before its first step
    metrics.write_text(json.dumps({"t": began - 1.0, "step": 0, "steps_per_s": 0.0}) + "\n"
                       + json.dumps({"t": began + 3.0, "step": 6, "steps_per_s": 2.0}) + "\n")
    assert abs(_run.first_step_began([metrics]) - began) < 1e-6

    said = []

    class Faults:
        def apply_due(self, elapsed_s, peers, wall_t=None):
            pass

        def not_reached(self, ended_s, why):
            said.append((round(ended_s), why))

    options = SimpleNamespace(scenario=SimpleNamespace(duration_s=60), out=tmp_path,
                              progress_every_s=60.0)  # fmt: skip
    peers = SimpleNamespace(procs=[], running=lambda: False)  # the ranks ended by themselves
    stopped = _run._supervise(
        "ddp", options, peers, SimpleNamespace(total=lambda: None), Faults(), lambda line: None,
        lambda: False, lambda: [], first_step=lambda: _run.first_step_began([metrics]),
        stop_at_duration=False, launch=began - 10.0, exited_as=lambda: "target",
    )  # fmt: skip
    assert stopped == "target" and said == [(3, "target")]
