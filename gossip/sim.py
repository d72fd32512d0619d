# `python -m geotrain.gossip.sim`: the averaging simulator's command line. Invariants: this module
# only parses arguments and prints; the simulation itself is gossip._simulator, which has no I/O.
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._partners import POLICIES
from ._scenarios import SCENARIOS
from ._simulator import SimConfig, compare_policies


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m geotrain.gossip.sim",
        description="Simulate pure gossip averaging under every partner-choice policy.",
    )
    parser.add_argument("--scenario", default="geo3", choices=sorted(SCENARIOS))
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--payload-mb", type=float, default=100.0, help="MB per exchange, each way")
    parser.add_argument("--eps", type=float, default=1e-4, help="eps relative to the start")
    parser.add_argument("--max-rounds", type=float, default=None)
    parser.add_argument("--warmup-rounds", type=float, default=SimConfig.warmup_rounds)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        print(f"--policies: unknown {unknown}; expected some of {POLICIES}", file=sys.stderr)
        return 2
    try:
        kwargs = {} if args.max_rounds is None else {"max_rounds": args.max_rounds}
        config = SimConfig(
            peers=args.peers,
            payload_nbytes=int(args.payload_mb * 1e6),
            eps_relative=args.eps,
            warmup_rounds=args.warmup_rounds,
            seed=args.seed,
            **kwargs,
        )
    except ValueError as exc:
        print(f"bad argument: {exc}", file=sys.stderr)
        return 2
    report = compare_policies(SCENARIOS[args.scenario], config, policies)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{report['scenario']}, {report['peers']} peers, eps = {report['eps']:.3g} "
        f"({report['eps_relative']:g} of the initial {report['initial_distance']:.3g})"
    )
    print(f"{'policy':<12}{'rounds':>9}{'time s':>10}{'GB':>10}{'cross':>8}{'vs uniform':>12}")
    for row in report["policies"]:
        rounds = "-" if row["rounds_to_eps"] is None else f"{row['rounds_to_eps']:.1f}"
        time_s = "-" if row["time_to_eps_s"] is None else f"{row['time_to_eps_s']:.2f}"
        ratio = "-" if row["time_vs_uniform"] is None else f"{row['time_vs_uniform']:.3f}"
        print(
            f"{row['policy']:<12}{rounds:>9}{time_s:>10}{row['bytes_total'] / 1e9:>10.2f}"
            f"{row['cross_region_share']:>8.2f}{ratio:>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
