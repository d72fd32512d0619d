"""Exchanges beside periodic checkpoints at 10^8: do they fail while a checkpoint is written?

    python -m geotrain.node.bench.checkpoints [--algorithm adpsgd] [--codec auto]
        [--millions 100] [--duration 300] [--checkpoint-every 20] [--exchange-every 2] [--json]

Two `geotrain node run` processes on loopback train the `wide-linear` task (one square float32
layer of `--millions` parameters) with AdamW, write a checkpoint every `--checkpoint-every`
steps and start an exchange every `--exchange-every` steps, for `--duration` seconds from both
nodes' first step; then SIGTERM (each writes its final checkpoint). A checkpoint of a 10^8
model holds the model for seconds: adpsgd, selsync and choco let the exchanges in flight end
first and decline new ones meanwhile ("busy: writing a checkpoint"). Printed per node: steps,
exchanges ok and failed (with the reasons the log gives), the declines that named the
checkpoint, each checkpoint's seconds, and peak memory against the node's own estimate.
Everything it wrote (1.6 GB of checkpoints a node at 10^8) is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..testing import LocalSwarm

START_LIMIT_S = 300.0
"""At most this long for both nodes to take their first step before the measured --duration."""


def run(algorithm: str, codec: str, millions: float, duration_s: float, checkpoint_every: int,
        exchange_every: int) -> dict[str, Any]:  # fmt: skip
    """One run of two nodes (see the module's docstring); what each did."""
    gossip: dict[str, Any] = {"algorithm": algorithm, "codec": codec, "probe_interval_s": 2.0,
                              "exchange_every": exchange_every, "state_sync": False}  # fmt: skip
    if algorithm == "choco":
        gossip["choco"] = {"max_peers": 1}
    common = {
        "training": {"task": "wide-linear", "params": {"millions": millions}, "threads": 1,
                     "optimizer": "adamw", "lr": 1e-4, "eval_every": 10**6, "num_shards": 2,
                     "wait_for_peers": 1},
        "gossip": gossip,
        "state": {"status_every_s": 1.0, "checkpoint_every": checkpoint_every},
    }  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoints."))
    swarm = LocalSwarm(root, common=common)
    try:
        nodes: list[Any] = []
        for name in ("a", "b"):
            joins = {"bootstrap": [nodes[0].address()]} if nodes else {}
            node = swarm.add(name, training={"shard_index": len(nodes)}, network=joins)
            # (debug: every checkpoint's seconds are logged at debug, one in 10 minutes at info)
            node.argv = [*node.argv[:3], "--log-level", "debug", *node.argv[3:]]
            node.start()
            nodes.append(node)
        # the duration counts from both nodes' first step (start-up on a busy box takes seconds)
        started_by = time.monotonic() + START_LIMIT_S
        while time.monotonic() < started_by and not all(
            (n.status() or {}).get("step") for n in nodes
        ):
            for node in nodes:
                node.check_alive()
            time.sleep(0.5)
        ends = time.monotonic() + duration_s
        while time.monotonic() < ends:
            for node in nodes:
                node.check_alive()
            time.sleep(1.0)
        for node in nodes:
            node.signal(signal.SIGTERM)
        codes = [node.wait(300) for node in nodes]
        return {"algorithm": algorithm, "codec": codec, "millions": millions,
                "duration_s": duration_s, "exit_codes": codes,
                "nodes": {n.name: _what_it_did(n) for n in nodes}}  # fmt: skip
    finally:
        swarm.stop_all()
        shutil.rmtree(root, ignore_errors=True)


def _what_it_did(node: Any) -> dict[str, Any]:
    status = node.status() or {}
    events = node.log_events()
    failed = Counter(f"{e['event']}: {e.get('reason') or e.get('error')}" for e in events
                     if e.get("event") in ("exchange_failed", "exchange_abandoned"))  # fmt: skip
    return {
        "steps": status.get("step"),
        "exchanges_ok": status.get("exchanges_ok"),
        "exchanges_failed": status.get("exchanges_failed"),
        "failed_reasons": dict(failed),
        "declined_for_checkpoint": sum("writing a checkpoint" in json.dumps(e) for e in events),
        "checkpoint_seconds": [e.get("seconds") for e in events
                               if e.get("event") == "checkpoint_written"],  # fmt: skip
        "peak_rss_mb": status.get("peak_rss_mb"),
        "memory_estimate_mb": status.get("memory_estimate_mb"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithm", default="adpsgd")
    parser.add_argument("--codec", default="auto")
    parser.add_argument("--millions", type=float, default=100.0)
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--exchange-every", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.algorithm, args.codec, args.millions, args.duration, args.checkpoint_every,
                 args.exchange_every)  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.algorithm} ({args.codec}), {args.millions:g}M parameters, {args.duration:g} s, "
          f"exit codes {result['exit_codes']}")  # fmt: skip
    for name, r in result["nodes"].items():
        seconds = [s for s in r["checkpoint_seconds"] if isinstance(s, int | float)]
        spread = f"{min(seconds):.1f}-{max(seconds):.1f} s" if seconds else "-"
        print(f"  {name}: {r['steps']} steps, exchanges ok {r['exchanges_ok']} failed "
              f"{r['exchanges_failed']} {r['failed_reasons'] or ''}, declined for a checkpoint "
              f"{r['declined_for_checkpoint']}, {len(seconds)} checkpoints of {spread}, peak "
              f"{r['peak_rss_mb'] or 0:.0f} MB (estimated {r['memory_estimate_mb'] or 0:.0f} MB)")


if __name__ == "__main__":
    main()
