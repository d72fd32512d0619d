"""Peak memory of a plain torch loop and of a geotrain node pair, as multiples of the model.

    python -m geotrain.node.bench.memory [--millions 100] [--algorithms adpsgd,dpsgd]
        [--steps 20] [--codec none] [--late-joiner] [--json]

One run, side by side: a plain training loop (the `wide-linear` task, SGD with momentum, one torch
thread) in its own process, then, for each algorithm, two `geotrain node run` processes on
loopback training the same model until each has taken `--steps` steps and (for the exchanging
algorithms) exchanged at least once. Each process's peak resident memory (its kernel high-water
mark, reported in status.json) is divided by the model's bytes. The node's extra copies are
(node peak - plain peak) / model bytes; the goal for adpsgd, dpsgd and selsync is <= 1.5. Each
node's bytes sent are printed too (its steps in the `steps` of --json).

With --late-joiner: three nodes with the settings a user starts them with (state sync and
checkpoints on, as by default); the third starts once the first two have exchanged, fetches the
model and the optimizer's state by state sync, then trains and exchanges too. Each node's resident
memory is also sampled every 0.1 s, and the log event nearest its highest sample is printed, to
say where the peak was.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .._config import NetworkConfig
from ..algorithms import chunks_in_flight
from ..testing import LocalSwarm, SwarmNode
from .algorithms import stop

PLAIN = """
import json, sys, torch
torch.set_num_threads(1)
from geotrain.node import TaskContext, Trainer, resolve_task
task = resolve_task("wide-linear")(TaskContext(params={{"millions": {millions}}}))
trainer = Trainer(task)
for _ in range({steps}):
    trainer.train_step()
from geotrain.node._memory import peak_rss_mb
print(json.dumps({{"peak_rss_mb": peak_rss_mb()}}))
"""


def plain_peak_mb(millions: float, steps: int) -> float:
    code = PLAIN.format(millions=millions, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def node_pair_peaks(algorithm: str, millions: float, steps: int, codec: str,
                    timeout_s: float, late: bool = False,
                    logs: Path | None = None) -> dict:  # fmt: skip
    common = {
        "training": {"task": "wide-linear", "params": {"millions": millions}, "threads": 1,
                     "eval_every": 10**6, "wait_for_peers": 1, "num_shards": 2},
        "gossip": {"algorithm": algorithm, "codec": codec, "state_sync": False,
                   "exchange_every": 2, "probe_interval_s": 0.5},
        "state": {"status_every_s": 0.5, "checkpoint_every": 10**6},
    }  # fmt: skip
    if algorithm == "diloco":
        common["gossip"]["diloco"] = {"inner_steps": 4}
    if late:  # as a user starts them: state sync and checkpoints on (their defaults)
        del common["gossip"]["state_sync"], common["state"]["checkpoint_every"]
        common["training"]["num_shards"] = 3
    if late:
        return _late_joiner_peaks(common, algorithm, steps, timeout_s, logs)
    with tempfile.TemporaryDirectory() as tmp:
        swarm = LocalSwarm(Path(tmp), common=common)
        try:
            a = swarm.start(swarm.add("a", training={"shard_index": 0}))
            b = swarm.start(swarm.add("b", training={"shard_index": 1},
                                      network={"bootstrap": [a.address(timeout_s)]}))  # fmt: skip
            nodes = [a, b]
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                st = [n.status() or {} for n in nodes]
                if all(s.get("step", 0) >= steps and s.get("exchanges_ok", 0) >= 1 for s in st):
                    break
                for n in nodes:
                    n.check_alive()
                time.sleep(0.5)
            finals = [n.status() or {} for n in nodes]
            stop(swarm, nodes)
        finally:
            swarm.stop_all()
    return {
        "algorithm": algorithm,
        "peak_rss_mb": [f.get("peak_rss_mb") for f in finals],
        "estimate_mb": finals[0].get("memory_estimate_mb"),
        "steps": [f.get("step") for f in finals],
        "exchanges_ok": [f.get("exchanges_ok") for f in finals],
        "bytes_out": [f.get("bytes_out") for f in finals],
    }


class RssSampler:
    """Each node process's resident memory, sampled every `every_s` from /proc (its highest
    sample and when it was taken, by time.time(), as the node's log lines are stamped)."""

    def __init__(self, nodes: list[SwarmNode], every_s: float = 0.1) -> None:
        self.nodes, self.every_s = nodes, every_s
        self.high: dict[str, tuple[float, float]] = {}  # name -> (MB, when)
        # name -> [(when, MB, of which file-backed MB)]
        self.samples: dict[str, list[tuple[float, float, float]]] = {}
        # name -> the links its status.json reported at its highest sample: [(rtt ms, Mbit/s)]
        self.links_at_high: dict[str, list[tuple[float, float]]] = {}

    def sample(self) -> None:
        for node in self.nodes:
            mb, file_mb = _rss_mb(node.pid), _rss_mb(node.pid, "RssFile:")
            if mb is None:
                continue
            now = time.time()
            self.samples.setdefault(node.name, []).append((now, mb, file_mb or 0.0))
            if mb > self.high.get(node.name, (0.0, 0.0))[0]:
                self.high[node.name] = (mb, now)
                self.links_at_high[node.name] = _links(node)

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(self.every_s)


def _rss_mb(pid: int | None, field: str = "VmRSS:") -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024 / 1e6
    except (OSError, ValueError, IndexError):
        return None
    return None


def _links(node: SwarmNode) -> list[tuple[float, float]]:
    """The (round trip ms, goodput Mbit/s) of each peer link `node` measured, as its status
    file says now (written every state.status_every_s)."""
    peers = (node.status() or {}).get("peers", [])
    return [(p["rtt_ms"], p["goodput_mbit"]) for p in peers
            if p.get("rtt_ms") is not None and p.get("goodput_mbit") is not None]  # fmt: skip


def widest_window(links: list[tuple[float, float]], model_bytes: float) -> int | None:
    """The most chunk requests a stream of a model of `model_bytes` in chunks of the default
    size (network.chunk_mb) keeps in flight on any of `links` ((round trip ms, goodput
    Mbit/s)), as the node sizes its window (chunks_in_flight); None without a measured link."""
    chunk_bytes = 4 * NetworkConfig().chunk_numel
    chunks = max(1, math.ceil(model_bytes / chunk_bytes))
    widths = [chunks_in_flight(rtt / 1000, mbit / 8e-6, chunk_bytes, chunks)
              for rtt, mbit in links]  # fmt: skip
    return max(widths, default=None)


def _event_near(node: SwarmNode, when: float) -> str:
    """The node's last log event at or before `when` (its JSON lines' `timestamp`)."""
    from datetime import datetime

    last = ""
    for event in node.log_events():
        stamp = event.get("timestamp")
        try:
            at = datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        if at > when:
            break
        last = str(event.get("event", ""))
    return last


def _late_joiner_peaks(common: dict, algorithm: str, steps: int, timeout_s: float,
                       logs: Path | None = None) -> dict:  # fmt: skip
    """Three daemon nodes: a and b start together, c once they have exchanged (state sync);
    their logs are copied into `logs` when given."""
    with tempfile.TemporaryDirectory() as tmp:
        swarm = LocalSwarm(Path(tmp), common=common)
        try:
            a = swarm.start(swarm.add("a", training={"shard_index": 0}))
            boot = {"bootstrap": [a.address(timeout_s)]}
            b = swarm.start(swarm.add("b", training={"shard_index": 1}, network=boot))
            c = swarm.add("c", training={"shard_index": 2, "wait_for_peers": 0}, network=boot)
            nodes = [a, b, c]
            sampler = RssSampler(nodes)
            deadline = time.monotonic() + timeout_s

            def done(group: list[SwarmNode], least: int) -> bool:
                st = [n.status() or {} for n in group]
                return all(s.get("step", 0) >= least and s.get("exchanges_ok", 0) >= 1
                           for s in st)  # fmt: skip

            while time.monotonic() < deadline and not done([a, b], 2):
                sampler.wait(0.5)
                a.check_alive(), b.check_alive()
            swarm.start(c)
            while time.monotonic() < deadline and not done(nodes, steps):
                sampler.wait(0.5)
                for n in nodes:
                    n.check_alive()
            for n in nodes:  # a clean stop (its final checkpoint) is sampled too
                n.signal(signal.SIGTERM)
            while any(n.running for n in nodes) and time.monotonic() < deadline + 60:
                sampler.wait(0.2)
            swarm.wait_all(timeout=60)
            finals = [n.status() or {} for n in nodes]
            where = {n.name: _event_near(n, sampler.high[n.name][1])
                     for n in nodes if n.name in sampler.high}  # fmt: skip
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                for n in nodes:
                    shutil.copy(n.log, logs / f"{algorithm}-{n.name}.log")
                samples = json.dumps(sampler.samples)
                (logs / f"{algorithm}-rss.json").write_text(samples)
        finally:
            swarm.stop_all()
    return {
        "algorithm": algorithm,
        "late_joiner": True,
        "peak_rss_mb": [f.get("peak_rss_mb") for f in finals],
        "sampled_peak_mb": [sampler.high.get(n, (None, 0))[0] for n in "abc"],
        "peak_near_event": [where.get(n, "") for n in "abc"],
        "links_at_peak": [sampler.links_at_high.get(n, []) for n in "abc"],
        "estimate_mb": finals[0].get("memory_estimate_mb"),
        "steps": [f.get("step") for f in finals],
        "exchanges_ok": [f.get("exchanges_ok") for f in finals],
        "bytes_out": [f.get("bytes_out") for f in finals],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, default=100.0)
    parser.add_argument("--algorithms", default="adpsgd")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--timeout", type=float, default=600.0)
    late = "three nodes, user defaults, the third joining late by state sync"
    parser.add_argument("--late-joiner", action="store_true", help=late)
    parser.add_argument("--logs", type=Path, help="with --late-joiner: copy the nodes' logs here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the nodes are killed on the way out
    width = round(math.sqrt(args.millions * 1e6))
    model_mb = width * width * 4 / 1e6
    plain = plain_peak_mb(args.millions, args.steps)
    rows = [node_pair_peaks(a, args.millions, args.steps, args.codec, args.timeout,
                            args.late_joiner, args.logs)
            for a in args.algorithms.split(",")]  # fmt: skip
    if args.json:
        print(json.dumps({"model_mb": model_mb, "plain_peak_mb": plain, "nodes": rows}))
        return
    print(f"model {model_mb:.0f} MB ({width}x{width} float32); codec {args.codec}")
    print(f"plain loop peak: {plain:.0f} MB = {plain / model_mb:.2f} x model")
    print(f"{'algorithm':<9} {'node peaks MB':>16} {'x model':>12} {'extra copies':>13} "
          f"{'estimate MB':>12} {'exchanges':>10} {'MB sent':>12}")  # fmt: skip
    for r in rows:
        peaks = [p for p in r["peak_rss_mb"] if p is not None]
        if not peaks:
            print(f"{r['algorithm']:<9} no status")
            continue
        worst = max(peaks)
        print(f"{r['algorithm']:<9} {'/'.join(f'{p:.0f}' for p in peaks):>16} "
              f"{worst / model_mb:>12.2f} {(worst - plain) / model_mb:>13.2f} "
              f"{r['estimate_mb'] or 0:>12.0f} {'/'.join(map(str, r['exchanges_ok'])):>10} "
              f"{'/'.join(f'{(b or 0) / 1e6:.0f}' for b in r['bytes_out']):>12}",
              flush=True)  # fmt: skip
        if r.get("late_joiner"):
            near = r["peak_near_event"]
            said = ", ".join(f"{n}: {e or '?'}" for n, e in zip("abc", near, strict=True))
            print(f"{'':<9} nodes a/b/c (c joined late); highest sample near: {said}")
            windows = [widest_window(links, model_mb * 1e6) for links in r["links_at_peak"]]
            print(f"{'':<9} chunks in flight a stream may keep then (8 MiB each, both ways): "
                  + "/".join("?" if w is None else str(w) for w in windows))  # fmt: skip


if __name__ == "__main__":
    main()
