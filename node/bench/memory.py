"""Peak memory of a plain torch loop and of a geotrain node pair, as multiples of the model.

    python -m geotrain.node.bench.memory [--millions 100] [--algorithms adpsgd,dpsgd]
        [--steps 20] [--codec none] [--json]

One run, side by side: a plain training loop (the `wide-linear` task, SGD with momentum, one torch
thread) in its own process, then, for each algorithm, two `geotrain node run` processes on
loopback training the same model until each has taken `--steps` steps and (for the exchanging
algorithms) exchanged at least once. Each process's peak resident memory (its kernel high-water
mark, reported in status.json) is divided by the model's bytes. The node's extra copies are
(node peak - plain peak) / model bytes; the goal for adpsgd, dpsgd and selsync is <= 1.5. Each
node's bytes sent are printed too (its steps in the `steps` of --json).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..testing import LocalSwarm
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
                    timeout_s: float) -> dict:  # fmt: skip
    common = {
        "training": {"task": "wide-linear", "params": {"millions": millions}, "threads": 1,
                     "eval_every": 10**6, "wait_for_peers": 1, "num_shards": 2},
        "gossip": {"algorithm": algorithm, "codec": codec, "state_sync": False,
                   "exchange_every": 2, "probe_interval_s": 0.5},
        "state": {"status_every_s": 0.5, "checkpoint_every": 10**6},
    }  # fmt: skip
    if algorithm == "diloco":
        common["gossip"]["diloco"] = {"inner_steps": 4}
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, default=100.0)
    parser.add_argument("--algorithms", default="adpsgd")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the nodes are killed on the way out
    width = round(math.sqrt(args.millions * 1e6))
    model_mb = width * width * 4 / 1e6
    plain = plain_peak_mb(args.millions, args.steps)
    rows = [node_pair_peaks(a, args.millions, args.steps, args.codec, args.timeout)
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


if __name__ == "__main__":
    main()
