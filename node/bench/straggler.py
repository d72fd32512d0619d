"""What a straggler costs the others: two swarms side by side, one with a 10x slower peer.

    python -m geotrain.node.bench.straggler [--peers 3] [--slowdown 10] [--window 8] [--json]

Both swarms (digits-mlp, loopback, one torch thread per node, the default algorithm) run at the
same time, so both see the same load on a shared machine. Once every fast node is past start-up
(300 steps) and the slow one has taken 20, each fast node's step rate is measured from its
status over the same window of wall time. The figure is the ratio of the fast nodes' median rate
with the straggler to without it (1.0: no cost; the goal is >= 0.95). On a machine with fewer
cores than nodes, a sleeping straggler frees CPU for the others, which can push the ratio above
1: the benchmark cannot show a cost smaller than the CPU the straggler gives back.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .algorithms import start_swarm, stop


def rates_over(nodes, seconds: float) -> list[float]:
    """Steps a second of each node over the same `seconds` of wall time (from its status)."""
    before = [n.status() for n in nodes]
    time.sleep(seconds)
    after = [n.status() for n in nodes]
    return [
        (a["step"] - b["step"]) / (a["elapsed_s"] - b["elapsed_s"])
        for a, b in zip(after, before, strict=True)
    ]


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def measure(peers: int, slowdown: float, window_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        try:
            for factor in (1.0, slowdown):
                slow = {peers - 1: {"training": {"slowdown": factor}}}
                runs[factor] = start_swarm(Path(tmp) / f"x{factor}", peers, {}, special=slow)
            fast = [n for _, nodes in runs.values() for n in nodes[:-1]]
            slow_node = runs[slowdown][1][-1]
            wait_until(
                lambda: all((n.status() or {}).get("step", 0) >= 300 for n in fast)
                and (slow_node.status() or {}).get("step", 0) >= 20,
                240, "300 steps on every fast node, 20 on the slow one",
            )  # fmt: skip
            measured = iter(rates_over(fast, window_s))
            rates = {k: [next(measured) for _ in nodes[:-1]] for k, (_, nodes) in runs.items()}
            exchanged = slow_node.status()["exchanges_ok"]
            for swarm, nodes in runs.values():
                stop(swarm, nodes)
        finally:
            for swarm, _ in runs.values():
                swarm.stop_all()
    without, with_slow = statistics.median(rates[1.0]), statistics.median(rates[slowdown])
    return {
        "peers": peers, "slowdown": slowdown, "window_s": window_s,
        "fast_rates_without": rates[1.0], "fast_rates_with": rates[slowdown],
        "ratio": with_slow / without, "straggler_exchanges_ok": exchanged,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--slowdown", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the nodes are killed on the way out
    r = measure(args.peers, args.slowdown, args.window)
    if args.json:
        print(json.dumps(r))
        return
    without = [round(x) for x in r["fast_rates_without"]]
    with_slow = [round(x) for x in r["fast_rates_with"]]
    print(f"{r['peers']} peers a swarm, one {r['slowdown']:g}x slower, {r['window_s']:g} s window")
    print(f"fast nodes' steps/s without the straggler: {without}")
    print(f"fast nodes' steps/s with the straggler:    {with_slow}")
    print(f"median with / without: {r['ratio']:.2f} (goal >= 0.95); the straggler exchanged "
          f"{r['straggler_exchanges_ok']} times")  # fmt: skip


if __name__ == "__main__":
    main()
