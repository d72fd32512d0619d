"""Compare the gossip algorithms on one scenario: 4 local nodes over loopback, digits-mlp.

    python -m node.bench_algorithms [--target 0.9] [--timeout 150] [--algorithms dpsgd,choco]

For each algorithm: start 4 `geotrain node run` processes (open swarm on 127.0.0.1, shards of
digits, one torch thread each), wait until every node reports the target test accuracy, stop them
cleanly and print time to target (from the first training step of any node), bytes sent per node
(all traffic: models, membership, link probes) at that moment, and the final accuracy. Nodes
start from the same initial model (state_sync off) and wait for each other before training. Loopback
has no WAN delay or bandwidth limit: this ranks the algorithms' compute and message overheads, not
their behaviour on slow links (that is the testbed's job). Every process is killed at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._identity import Identity

SETTINGS = {
    "adpsgd": {},
    "dpsgd": {},
    "choco": {"codec": "topk:0.01"},
    "diloco": {"diloco_inner_steps": 10, "codec": "int8"},
    "selsync": {"exchange_every": 1},
}


def _toml(sections: dict[str, dict]) -> str:
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _status(state: Path) -> dict:
    try:
        return json.loads((state / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _start(root: Path, i: int, algorithm: str, bootstrap: str | None) -> subprocess.Popen:
    Identity.generate().save(root / f"n{i}.key")
    sections = {
        "identity": {"key": str(root / f"n{i}.key"), "open_swarm": True},
        "network": {"bootstrap": [bootstrap] if bootstrap else []},
        "training": {
            "task": "digits-mlp",
            "threads": 1,
            "eval_every": 25,
            "num_shards": 4,
            "shard_index": i,
            "wait_for_peers": 3,
        },
        "gossip": {
            "algorithm": algorithm,
            "state_sync": False,  # all start from the seed's model at once, none copies another
            "probe_interval_s": 0.5,
            "exchange_every": 2,
            **SETTINGS[algorithm],
        },
        "state": {"dir": str(root / f"state-{i}"), "status_every_s": 0.25},
    }
    (root / f"n{i}.toml").write_text(_toml(sections))
    cmd = [
        sys.executable,
        "-m",
        "node",
        "--log-format",
        "json",
        "node",
        "run",
        "--config",
        str(root / f"n{i}.toml"),
    ]
    log = open(root / f"n{i}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _address(state: Path, proc: subprocess.Popen) -> str:
    while True:
        try:
            return json.loads((state / "node.json").read_text())["address"]
        except (OSError, json.JSONDecodeError, KeyError):
            if proc.poll() is not None:
                raise RuntimeError(f"node exited {proc.returncode}") from None
            time.sleep(0.1)


def run_one(algorithm: str, target: float, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        states = [root / f"state-{i}" for i in range(4)]
        procs = [_start(root, 0, algorithm, None)]
        try:
            bootstrap = _address(states[0], procs[0])
            procs += [_start(root, i, algorithm, bootstrap) for i in range(1, 4)]
            started = reached = None
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and reached is None:
                statuses = [_status(s) for s in states]
                if started is None and any(s.get("step", 0) > 0 for s in statuses):
                    started = time.monotonic()
                if started and all((s.get("metric") or 0) >= target for s in statuses):
                    reached = time.monotonic()
                    sent = [s["bytes_out"] for s in statuses]
                time.sleep(0.1)
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(60)
            finals = [_status(s) for s in states]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return {
        "algorithm": algorithm,
        "seconds": None if reached is None else reached - started,
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
