"""Compare the gossip algorithms on one scenario: 4 local nodes over loopback, digits-mlp.

    python -m geotrain.node.bench.algorithms [--target 0.9] [--timeout 150]
        [--algorithms dpsgd,choco]

For each algorithm: start 4 `geotrain node run` processes (open swarm on 127.0.0.1, shards of
digits, one torch thread each), wait until every node's held-out accuracy reaches the target,
and report the seconds from the first step to that moment, the bytes each node sent by then,
and the final accuracies and steps. Loopback has no WAN delay: this measures the algorithms'
own costs (rounds, compression, staleness), not link emulation (the testbed does that).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from ..testing import LocalSwarm

SETTINGS: dict[str, dict] = {
    "adpsgd": {},
    "dpsgd": {},
    "choco": {"codec": "topk:0.01"},
    "diloco": {"diloco": {"inner_steps": 10}, "codec": "int8"},
    "selsync": {"exchange_every": 1},
}
COMMON = {
    "training": {"task": "digits-mlp", "threads": 1, "eval_every": 25},
    # state_sync off: all start from the seed's model at once, none copies another
    "gossip": {"state_sync": False, "probe_interval_s": 0.5, "exchange_every": 2},
    "state": {"status_every_s": 0.25},
}  # fmt: skip


def start_swarm(root: Path, n: int, gossip: dict, special: dict | None = None) -> tuple:
    """n nodes of `gossip` (on top of COMMON's) with n0 as everyone's bootstrap, started."""
    swarm = LocalSwarm(root, common={**COMMON, "gossip": {**COMMON["gossip"], **gossip}})
    nodes, bootstrap = [], []
    for i in range(n):
        extra = (special or {}).get(i, {})
        training = {"shard_index": i, "num_shards": n, "wait_for_peers": n - 1}
        sections = {**extra, "training": {**training, **extra.get("training", {})}}
        if bootstrap:
            sections["network"] = {"bootstrap": bootstrap}
        nodes.append(swarm.start(swarm.add(f"n{i}", **sections)))
        if i == 0:
            bootstrap = [nodes[0].address()]
    return swarm, nodes


def stop(swarm: LocalSwarm, nodes) -> None:
    for node in nodes:
        node.signal(signal.SIGTERM)  # a clean stop: checkpoint, leave
    swarm.wait_all(timeout=60)


def run_one(algorithm: str, target: float, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        swarm, nodes = start_swarm(Path(tmp), 4, {"algorithm": algorithm, **SETTINGS[algorithm]})
        try:
            started = reached = None
            sent: list[int] = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and reached is None:
                statuses = [n.status() or {} for n in nodes]
                if started is None and any(s.get("step", 0) > 0 for s in statuses):
                    started = time.monotonic()
                if started and all((s.get("metric") or 0) >= target for s in statuses):
                    reached = time.monotonic()
                    sent = [s["bytes_out"] for s in statuses]
                time.sleep(0.1)
            stop(swarm, nodes)
            finals = [n.status() or {} for n in nodes]
        finally:
            swarm.stop_all()
    return {
        "algorithm": algorithm,
        "seconds": None if reached is None or started is None else reached - started,
        "bytes_per_node": None if reached is None else sum(sent) / len(sent),
        "final": [f.get("metric") for f in finals],
        "steps": [f.get("step") for f in finals],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--timeout", type=float, default=150.0)
    parser.add_argument("--algorithms", default=",".join(SETTINGS))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the nodes are killed on the way out
    print(f"4 nodes, loopback, digits-mlp, target {args.target:.0%}")
    print(
        f"{'algorithm':<9} {'settings':<38} {'s to target':>11} {'MB/node':>8} "
        f"{'final acc (min-max)':>20} {'steps':>16}"
    )
    for name in args.algorithms.split(","):
        r = run_one(name, args.target, args.timeout)
        secs = "not reached" if r["seconds"] is None else f"{r['seconds']:.1f}"
        mb = "-" if r["bytes_per_node"] is None else f"{r['bytes_per_node'] / 1e6:.2f}"
        acc = [a for a in r["final"] if a is not None]
        accs = f"{min(acc):.3f}-{max(acc):.3f}" if acc else "-"
        steps = f"{min(r['steps'])}-{max(r['steps'])}" if all(r["steps"]) else "-"
        settings = ", ".join(f"{k}={v}" for k, v in SETTINGS[name].items()) or "defaults"
        print(f"{name:<9} {settings:<38} {secs:>11} {mb:>8} {accs:>20} {steps:>16}", flush=True)


if __name__ == "__main__":
    main()
