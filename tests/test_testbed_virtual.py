"""The virtual-time testbed run: its link model, its all-reduce cost, the run end to end, and the
same figures bit for bit whatever else the machine is doing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from geotrain.testbed._allreduce import (
    GLOO_MESSAGE_BYTES,
    allreduce_cost,
    gloo_ddp_startup_bytes,
)
from geotrain.testbed._linkspec import AccessLink, LinkMatrix, LinkSpec
from geotrain.testbed._vnet import FlowNetwork, wire_bytes

MB = 1_000_000


def _capacities(rates):
    return lambda key: rates.get(key)


async def test_flows_share_a_link_fairly_and_a_lone_flow_takes_it_all(autojump_clock):
    # an uplink of 8 MB/s: one flow of 8 MB alone takes 1 s; two at once take 2 s each
    net = FlowNetwork(_capacities({("up", 0, None): 8 * MB}))
    ends = {}

    async def send(name, nbytes):
        await net.transfer(nbytes, (("up", 0, None),), float("inf"))
        ends[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        await send("alone", 8 * MB)
        start = trio.current_time()
        async with trio.open_nursery() as both:
            both.start_soon(send, "a", 8 * MB)
            both.start_soon(send, "b", 4 * MB)
        nursery.cancel_scope.cancel()
    assert ends["alone"] == pytest.approx(1.0)
    # b's 4 MB at half the link: 1 s; then a alone finishes its remaining 4 MB in 0.5 s
    assert ends["b"] - start == pytest.approx(1.0)
    assert ends["a"] - start == pytest.approx(1.5)


async def test_an_unshaped_path_delivers_at_once(autojump_clock):
    net = FlowNetwork(_capacities({}))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        with trio.fail_after(1):
            await net.transfer(10 * MB, (("link", 0, "b"),), float("inf"))
        assert trio.current_time() == 0
        nursery.cancel_scope.cancel()


async def test_a_flow_is_held_by_its_slowest_resource_and_its_loss_cap(autojump_clock):
    net = FlowNetwork(_capacities({("link", 0, 1): 10 * MB, ("down", 1, None): 2 * MB}))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        t0 = trio.current_time()
        await net.transfer(2 * MB, (("link", 0, 1), ("down", 1, None)), float("inf"))
        assert trio.current_time() - t0 == pytest.approx(1.0)
        t0 = trio.current_time()
        await net.transfer(1 * MB, (("link", 0, 1),), 0.5 * MB)  # its own (loss) cap
        assert trio.current_time() - t0 == pytest.approx(2.0)
        nursery.cancel_scope.cancel()


def test_wire_bytes_count_tcp_ip_headers_and_acks():
    sent, acks = wire_bytes(1448 * 10, 1500)
    assert sent == 1448 * 10 + 10 * 52
    assert acks == 5 * 52


def _two_regions(rate_between):
    inside = {"a": LinkSpec(delay_ms=1, rate_mbit=10_000), "b": LinkSpec(delay_ms=1,
                                                                          rate_mbit=10_000)}
    between = {frozenset({"a", "b"}): LinkSpec(delay_ms=50, rate_mbit=rate_between)}
    return LinkMatrix.symmetric(("a",) * 4 + ("b",) * 4, inside, between)


def test_allreduce_takes_the_faster_algorithm_and_names_it():
    nbytes = 40 * MB
    # a slow link between the regions: the hierarchical all-reduce crosses it with one ring of
    # two leaders instead of a ring of eight whose every step waits on it
    seconds, sent, how = allreduce_cost(_two_regions(100), nbytes)
    assert how == "hierarchical"
    ring_step = 0.05 + wire_bytes(nbytes // 8, 1500)[0] / (100e6 / 8)
    assert seconds < 14 * ring_step
    # on one region's links only a ring is possible: 2 (n - 1) steps of nbytes / n each
    flat = LinkMatrix.uniform(4, LinkSpec(delay_ms=10, rate_mbit=1000))
    seconds, sent, how = allreduce_cost(flat, nbytes)
    piece = wire_bytes(nbytes // 4, 1500)
    assert how == "ring"
    assert seconds == pytest.approx(6 * (0.01 + piece[0] / (1000e6 / 8)))
    assert sent == 6 * 4 * (piece[0] + piece[1])


def test_the_testbeds_allreduce_is_a_ring_with_gloos_framing_on_every_message():
    flat = LinkMatrix.uniform(4, LinkSpec(delay_ms=10, rate_mbit=1000))
    ring = allreduce_cost(flat, 4 * 4810, 65000, "ring")
    testbed = allreduce_cost(flat, 4 * 4810, 65000, "testbed")
    assert testbed[2] == "ring"
    assert testbed[1] == ring[1] + 6 * 4 * GLOO_MESSAGE_BYTES  # (2 (n - 1) n messages)
    assert testbed[0] == pytest.approx(ring[0], rel=0.01)
    # DDP's constructor sends rank 0's parameters to the 3 others before the first step
    assert gloo_ddp_startup_bytes(flat, 4 * 4810, 65000) == 3 * (
        sum(wire_bytes(4 * 4810, 65000)) + GLOO_MESSAGE_BYTES)


def test_the_oracles_partners_are_the_near_peers_and_the_cheapest_bridge():
    from geotrain.testbed._virtual import oracle_partners

    sets = oracle_partners(_two_regions(20), 4 * MB)
    # each peer's own region, and one bridge (the cheapest pair across: the lowest indices)
    assert sets[1] == {0, 2, 3} and sets[5] == {4, 6, 7}
    assert sets[0] == {1, 2, 3, 4} and sets[4] == {0, 5, 6, 7}


def test_allreduce_over_a_home_uplink_runs_at_the_uplink():
    flat = LinkMatrix.uniform(2, LinkSpec(delay_ms=10, rate_mbit=1000))
    homes = LinkMatrix(flat.regions, flat.peer_regions, flat.links,
                       (AccessLink(up_mbit=20, down_mbit=100), None))  # fmt: skip
    assert allreduce_cost(homes, 10 * MB)[0] > 4 * allreduce_cost(flat, 10 * MB)[0]


SCENARIO = """
name = "faults"
description = "two regions, a kill and a restart, then a partition and its heal"
task = "digits-mlp"
duration_s = 20
step_ms = 100
[[regions]]
name = "a"
peers = 2
[[regions]]
name = "b"
peers = 2
[links.inside.a]
delay_ms = 5
rate_mbit = 1000
[links.inside.b]
delay_ms = 5
rate_mbit = 1000
[[links.between]]
regions = ["a", "b"]
delay_ms = 40
rate_mbit = 100
[[faults]]
at_s = 3
action = "kill"
peer = 2
[[faults]]
at_s = 6
action = "restart"
peer = 2
[[faults]]
at_s = 9
action = "partition"
regions = ["a", "b"]
[[faults]]
at_s = 13
action = "heal"
"""


def _virtual_run(out: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "geotrain.node", "testbed", "run", "--clock", "virtual",
         "--duration", "20", "--baseline", "ddp,localsgd,ideal", "--out", str(out), *extra],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_virtual_run_is_the_same_bit_for_bit_beside_a_cpu_load(tmp_path):
    scenario = tmp_path / "faults.toml"
    scenario.write_text(SCENARIO)
    # (a target none reaches: every system runs through every fault)
    first = _virtual_run(tmp_path / "quiet", "--scenario", str(scenario), "--target", "0.995")
    assert first.returncode == 0, first.stderr[-3000:]
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        second = _virtual_run(tmp_path / "loaded", "--scenario", str(scenario), "--target",
                              "0.995")
    finally:
        load.kill()
        load.wait()
    assert second.returncode == 0, second.stderr[-3000:]
    quiet, loaded = tmp_path / "quiet", tmp_path / "loaded"
    files = sorted(p.relative_to(quiet) for p in quiet.rglob("*.json*")
                   if p.name not in ("run.json",))  # fmt: skip
    assert len(files) >= 10  # (every system's metrics, the bytes, the summary)
    for name in files:
        assert (quiet / name).read_bytes() == (loaded / name).read_bytes(), name
    summary = json.loads((quiet / "summary.json").read_text())
    by = {s["system"]: s for s in summary["systems"]}
    assert set(by) == {"geotrain", "ddp", "localsgd", "ideal"}
    # the ideal is DDP on free links: never later, and no bytes
    assert by["ideal"]["bytes_sent_total"] == 0
    assert by["ddp"]["bytes_sent_total"] > 0 and by["geotrain"]["bytes_sent_total"] > 0
    assert by["ideal"]["trained_s"] <= by["ddp"]["trained_s"]
    # a geotrain peer steps at its compute profile's pace (100 ms steps), not this machine's
    rates = [r for r in by["geotrain"]["steps_per_s_by_peer"] if r]
    assert rates and all(r <= 10.5 for r in rates)
    # the faults happened: peer 2 was killed and came back as a new process from its
    # checkpoint; DDP's all-reduce hung over the partition until the heal
    run = json.loads((quiet / "run.json").read_text())
    applied = {(f["system"], f["action"]) for f in run["faults"] if f["applied"]}
    assert {("geotrain", "kill"), ("geotrain", "restart"), ("ddp", "partition"),
            ("ddp", "heal")} <= applied  # fmt: skip
    peer2 = _lines(quiet / "geotrain" / "peer-02" / "metrics.jsonl")
    assert len({r["pid"] for r in peer2}) == 2
    ddp = [r["t"] for r in _lines(quiet / "ddp" / "peer-00.jsonl")]
    assert max(b - a for a, b in zip(ddp, ddp[1:], strict=False)) >= 3.5


def test_a_different_seed_gives_a_different_run(tmp_path):
    a = _virtual_run(tmp_path / "a", "--duration", "5", "--baseline", "none")
    b = _virtual_run(tmp_path / "b", "--duration", "5", "--seed", "1", "--baseline",
                     "ddp,localsgd", "--baseline-set", "localsgd.lr=0.05")  # fmt: skip
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    metrics = "geotrain/peer-01/metrics.jsonl"
    assert (tmp_path / "a" / metrics).read_bytes() != (tmp_path / "b" / metrics).read_bytes()
    run = json.loads((tmp_path / "b" / "run.json").read_text())
    assert run["systems"]["localsgd"]["settings"]["lr"] == 0.05  # (each baseline its own)
    # local SGD's ranks evaluate by the testbed's rule (every 20 steps or 10 s), not every step
    lines = _lines(tmp_path / "b" / "localsgd" / "peer-00.jsonl")
    evaluated = {r["metric_step"] for r in lines if r["metric_step"] is not None}
    assert 1 <= len(evaluated) <= lines[-1]["step"] // 20 + 2


def test_the_testbeds_ddp_waits_for_its_stop_rule_after_step_1_and_every_10_steps(tmp_path):
    # (--allreduce testbed: DDP as the real testbed's worker runs it, for calibration)
    proc = _virtual_run(tmp_path / "r", "--baseline", "ddp", "--allreduce", "testbed",
                        "--step-jitter", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    t = {r["step"]: r["t"] for r in _lines(tmp_path / "r" / "ddp" / "peer-00.jsonl")}
    plain = t[3] - t[2]
    assert t[12] - t[11] == pytest.approx(plain)
    # a check is a small all-reduce: a ring of 4 over the demo's 67 ms link, 6 x 67 ms
    for step in (1, 11, 21):
        longer = (t[step] - t.get(step - 1, 0.0)) - plain
        assert longer == pytest.approx(6 * 0.067, abs=0.01), step


def test_a_peer_given_a_later_start_starts_then(tmp_path):
    proc = _virtual_run(tmp_path / "r", "--duration", "6", "--baseline", "none",
                        "--peer-start-s", "0,0,4,0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = {}
    for i in range(4):
        lines = _lines(tmp_path / "r" / "geotrain" / f"peer-{i:02d}" / "metrics.jsonl")
        first[i] = min(r["t"] for r in lines if r["step"] > 0)
    # (the others wait for every peer, as a testbed node does: nobody steps before it is up)
    assert min(first.values()) > 4.0


@pytest.mark.parametrize(("args", "said"), [
    (["--clock", "virtual", "--baseline", "hivemind"], "not in virtual time"),
    (["--baseline", "ideal"], "only in virtual time"),
    (["--clock", "virtual", "--step-jitter", "2"], "--step-jitter"),
    (["--clock", "virtual", "--peer-start-s", "0,1"], "--peer-start-s"),
])  # fmt: skip
def test_what_a_clock_does_not_model_is_refused_before_anything_starts(tmp_path, args, said):
    proc = subprocess.run([sys.executable, "-m", "geotrain.node", "testbed", "run", "--out",
                           str(tmp_path / "out"), *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert said in proc.stderr
    assert not (tmp_path / "out").exists()
