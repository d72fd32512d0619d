"""The privacy accountant's cost: opacus' RDPAccountant.get_epsilon and geotrain's figures for the
same history, side by side in one run.

    python -m geotrain.node.bench.privacy [--epsilon 50] [--queries 20] [--json]

A digits-mlp trainer (shard 1 of 8, noise multiplier 2.0) is made private with budget `--epsilon`
(`make_private` searches the steps the budget allows: many epsilon queries), takes 5 private
steps, then both ask epsilon for the history plus 100 more steps `--queries` times. Printed: the
seconds of make_private, the mean milliseconds of one query each way, their ratio, and whether
the two figures are equal.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m geotrain.node.bench.privacy")
    parser.add_argument("--epsilon", type=float, default=50.0)
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="one JSON line, not a sentence")
    args = parser.parse_args(argv)
    from opacus.accountants import RDPAccountant

    from geotrain.node import TaskContext, Trainer, resolve_task
    from geotrain.node.training import make_private

    trainer = Trainer(resolve_task("digits-mlp")(TaskContext(shard_index=0, num_shards=8)))
    started = time.perf_counter()
    private = make_private(trainer, epsilon=args.epsilon, noise_multiplier=2.0)
    make_s = time.perf_counter() - started
    for _ in range(5):
        trainer.train_step()

    def opacus() -> float:
        probe = RDPAccountant()
        probe.history = [*private.accountant.history,
                         (private.noise_multiplier, private.sample_rate, 100)]  # fmt: skip
        return probe.get_epsilon(private.delta)

    timed = {}
    for name, query in (("opacus", opacus), ("geotrain", lambda: private._epsilon_after(100))):
        started = time.perf_counter()
        for _ in range(args.queries):
            value = query()
        timed[name] = ((time.perf_counter() - started) / args.queries, value)
    result = {
        "make_private_s": round(make_s, 3), "steps_allowed": private._allowed + 5,
        "opacus_query_ms": round(timed["opacus"][0] * 1000, 3),
        "geotrain_query_ms": round(timed["geotrain"][0] * 1000, 4),
        "ratio": round(timed["opacus"][0] / timed["geotrain"][0], 1),
        "equal": timed["opacus"][1] == timed["geotrain"][1],
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print(f"make_private(epsilon={args.epsilon:g}): {result['make_private_s']} s "
              f"({result['steps_allowed']} steps allowed); one epsilon query: opacus "
              f"{result['opacus_query_ms']} ms, geotrain {result['geotrain_query_ms']} ms "
              f"({result['ratio']}x less), equal: {result['equal']}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
