"""Byzantine peers, robust mixing and differential privacy, measured in the in-memory harness.

    python -m geotrain.testbed.bench_byzantine [--steps 300] [--seeds 3] [--only attacks,dp]

8 digits-mlp peers on geotrain's in-memory network on trio's virtual clock (the node's algorithm
runtimes, tensor work inline; testbed/_byzantine.py), so the figures do not depend on the load of
the machine; runs with the same arguments still differ (trio orders simultaneous tasks
differently each run): a lot under an attack without robust mixing, about 0.01 with it. Prints
markdown tables for docs/benchmarks.md:
- attacks: 2 of 8 peers attack (each kind), adpsgd, robust mixing off and on: the honest peers'
  worst final accuracy and its ratio to the worst with no attack (`--alpha A`, here and in trim:
  on label-skewed Dirichlet(A) shards instead of IID ones);
- trim: the same for dpsgd with its trimmed mean (sign flip, IPM);
- cost: with no attack, virtual seconds until every peer reached accuracy 0.9 (each evaluated
  every 2 steps, 0.02 virtual s), robust off and on, over `--seeds` seeds;
- dp: accuracy at epsilon 1, 3 and 8 (delta 1e-5, max_grad_norm 1.0) against no privacy.
- lm (only when asked: `--only lm`): a second task, a small byte-level transformer (charlm,
  64-wide, 1 layer, Adam), 2 of 8 attacking (sign flip, IPM, ALIE), robust off and on.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from ._byzantine import run_swarm
from ._scenario import ATTACK_KINDS

TWO_OF_EIGHT = (6, 7)
TARGET = 0.9


def _attacks(steps: int, echo, **shards) -> None:  # (shards: partition, alpha and seed)
    echo("| attack (2 of 8) | robust | worst honest acc | mean honest acc | vs no attack |")
    echo("|---|---|---|---|---|")
    clean = {rule: run_swarm(robust=rule, steps=steps, **shards) for rule in ("none", "clip")}
    for rule, r in clean.items():
        echo(f"| none | {rule} | {r.worst:.3f} | {r.mean:.3f} | 1.00 |")
    for kind in ATTACK_KINDS:
        for rule in ("none", "clip"):
            r = run_swarm(attackers=dict.fromkeys(TWO_OF_EIGHT, kind), robust=rule, steps=steps,
                          **shards)  # fmt: skip
            ratio = r.worst / clean["none"].worst
            echo(f"| {kind} | {rule} | {r.worst:.3f} | {r.mean:.3f} | {ratio:.2f} |")


def _trim(steps: int, echo, **shards) -> None:
    echo("| attack (2 of 8), dpsgd | robust | worst honest acc | mean honest acc | vs no attack |")
    echo("|---|---|---|---|---|")
    clean = run_swarm(steps=steps, algorithm="dpsgd", **shards)
    echo(f"| none | none | {clean.worst:.3f} | {clean.mean:.3f} | 1.00 |")
    r = run_swarm(steps=steps, algorithm="dpsgd", robust="trim", **shards)
    echo(f"| none | trim | {r.worst:.3f} | {r.mean:.3f} | {r.worst / clean.worst:.2f} |")
    for kind in ("sign_flip", "ipm", "alie", "label_flip"):
        for rule in ("none", "trim"):
            r = run_swarm(attackers=dict.fromkeys(TWO_OF_EIGHT, kind), robust=rule, steps=steps,
                          algorithm="dpsgd", **shards)  # fmt: skip
            echo(f"| {kind} | {rule} | {r.worst:.3f} | {r.mean:.3f} | "
                 f"{r.worst / clean.worst:.2f} |")  # fmt: skip


LM = {"d_model": 64, "layers": 1, "context": 32, "batch_size": 16, "max_bytes": 200_000}


def _lm(steps: int, echo, seed: int = 0) -> None:
    echo("| attack (2 of 8), charlm | robust | worst honest next-byte acc | mean | vs no attack |")
    echo("|---|---|---|---|---|")
    run = {"task": "charlm", "params": LM, "optimizer": "adam", "steps": steps, "seed": seed}
    clean = run_swarm(**run)
    echo(f"| none | none | {clean.worst:.3f} | {clean.mean:.3f} | 1.00 |")
    r = run_swarm(robust="clip", **run)
    echo(f"| none | clip | {r.worst:.3f} | {r.mean:.3f} | {r.worst / clean.worst:.2f} |")
    for kind in ("sign_flip", "ipm", "alie", "label_flip"):  # label flip: byte y -> 255 - y
        for rule in ("none", "clip"):
            r = run_swarm(attackers=dict.fromkeys(TWO_OF_EIGHT, kind), robust=rule, **run)
            echo(f"| {kind} | {rule} | {r.worst:.3f} | {r.mean:.3f} | "
                 f"{r.worst / clean.worst:.2f} |")  # fmt: skip


def _cost(steps: int, seeds: int, echo) -> None:
    echo(f"| robust | virtual s to accuracy {TARGET} (every peer), per seed | median | ratio |")
    echo("|---|---|---|---|")
    times: dict[str, list[float | None]] = {}
    for rule in ("none", "clip"):
        times[rule] = [run_swarm(robust=rule, steps=steps, seed=s, target=TARGET,
                                 eval_every=2).reached_s for s in range(seeds)]  # fmt: skip
    base = statistics.median(t for t in times["none"] if t is not None)
    for rule, ts in times.items():
        done = [t for t in ts if t is not None]
        med = statistics.median(done) if done else float("nan")
        shown = ", ".join("not reached" if t is None else f"{t:.2f}" for t in ts)
        echo(f"| {rule} | {shown} | {med:.2f} | {med / base:.3f} |")


def _dp(steps: int, echo) -> None:
    echo("| privacy (8 peers, delta 1e-5, max_grad_norm 1.0) | worst acc | mean acc | "
         "epsilon spent |")  # fmt: skip
    echo("|---|---|---|---|")
    r = run_swarm(steps=steps)
    echo(f"| no DP | {r.worst:.3f} | {r.mean:.3f} | - |")
    for eps in (1.0, 3.0, 8.0):
        r = run_swarm(steps=steps, privacy={"epsilon": eps, "delta": 1e-5, "max_grad_norm": 1.0})
        echo(f"| epsilon {eps:g} | {r.worst:.3f} | {r.mean:.3f} | {r.epsilon:.2f} |")


def main(argv: Sequence[str] | None = None) -> int:
    from geotrain.node.cli import configure_logging

    p = argparse.ArgumentParser(prog="python -m geotrain.testbed.bench_byzantine",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--steps", type=int, default=300, help="local steps of every peer")
    p.add_argument("--seeds", type=int, default=3, help="seeds of the cost table")
    p.add_argument("--only", default="attacks,trim,cost,dp", help="tables to make")
    p.add_argument("--alpha", type=float, default=None,
                   help="attacks and trim tables: Dirichlet label skew (default: IID shards)")
    p.add_argument("--seed", type=int, default=0,
                   help="attacks, trim and lm tables: the swarm's seed (shards, models, data)")
    args = p.parse_args(argv)
    configure_logging("error", "console")

    def echo(line: str) -> None:
        print(line, flush=True)

    shards: dict = {} if args.alpha is None else {"partition": "dirichlet", "alpha": args.alpha}
    shards["seed"] = args.seed
    started = time.monotonic()
    tables = {
        "attacks": lambda: _attacks(args.steps, echo, **shards),
        "trim": lambda: _trim(args.steps, echo, **shards),
        "cost": lambda: _cost(args.steps, args.seeds, echo),
        "dp": lambda: _dp(args.steps, echo),
        "lm": lambda: _lm(args.steps, echo, args.seed),
    }
    for name in args.only.split(","):
        echo(f"\n{name} (steps {args.steps})\n")
        tables[name]()
    echo(f"\n({time.monotonic() - started:.0f} s wall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
