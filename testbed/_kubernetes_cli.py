# `geotrain testbed export --kubernetes SCENARIO` and `geotrain testbed collect DIR`, registered by
# testbed/_cli.py (this file holds their options so that the run options there stay one block).
# Invariants: the scenario is read and changed by the same code as `testbed run`'s (its options,
# its checks, its node config); a bad scenario, option or output folder is said in one line and
# exits 2 before anything is written; nothing here talks to a cluster.
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ._kubernetes import FILES, KubernetesTarget, with_name


def register_kubernetes(sub: argparse._SubParsersAction) -> None:
    """Add `export` and `collect` to `geotrain testbed`."""
    from ._cli import _peer_indices

    export = sub.add_parser(
        "export", help="write a scenario as Kubernetes manifests (pods, Chaos Mesh links, faults)",
        description="Write a scenario's run as Kubernetes manifests: a pod per peer, Chaos "
                    "Mesh NetworkChaos for every region pair and access link, a Chaos Mesh "
                    "workflow for its kills and partitions, and a Job that starts the run and "
                    "collects its folder for `geotrain testbed report`. Nothing is applied: "
                    "see docs/how-to/kubernetes.md.",
    )  # fmt: skip
    export.add_argument("--kubernetes", required=True, metavar="SCENARIO", dest="scenario",
                        help="built-in name or a .toml / .json scenario file")  # fmt: skip
    export.add_argument("--out", type=Path, help="folder to write (default: testbed-k8s/NAME)")
    export.add_argument("--name", help="the run's name: object names and labels (default: "
                                       "the scenario's name)")  # fmt: skip
    export.add_argument("--namespace", default="geotrain-testbed")
    export.add_argument("--image", default="geotrain:cpu",
                        help="the image built from examples/deploy/Containerfile, as the "
                             "cluster pulls it (default: geotrain:cpu)")  # fmt: skip
    export.add_argument("--storage-class", help="a ReadWriteMany storage class for the run "
                                                "folder (default: the cluster's default)")
    export.add_argument("--cpu", default="1", help="each peer's CPU request (default: 1)")
    export.add_argument("--memory", default="2Gi", help="each peer's memory (default: 2Gi)")
    export.add_argument("--startup-s", type=float, default=120.0, metavar="S",
                        help="seconds the nodes get to start before the duration counts "
                             "(default: 120)")  # fmt: skip
    export.add_argument("--peers", type=int, help="number of peers (spread over the regions)")
    export.add_argument("--task", help="training task (default: the scenario's)")
    export.add_argument("--algorithm", help="gossip algorithm (default: the scenario's)")
    export.add_argument("--duration", type=float, help="seconds of training")
    export.add_argument("--nat", type=_peer_indices, metavar="I,J,...",
                        help="peers behind NAT (client mode, no inbound connections)")
    export.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="a task parameter (repeatable)")
    export.add_argument("--target", type=float, help="metric value to reach (default: task's)")
    export.add_argument("--node-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a node config override for every peer (repeatable)")
    export.add_argument("--eval-every-s", type=float, metavar="S", default=10.0,
                        help="every node evaluates at least once every S seconds (default: 10)")
    export.set_defaults(handler=cmd_export, baseline="none")

    collect = sub.add_parser(
        "collect", help="make run.json of a Kubernetes run's folder (the export's Job runs it)",
        description="Write DIR/run.json from what an exported run's Job and peers wrote, so "
                    "that `geotrain testbed report DIR` reads it.",
    )  # fmt: skip
    collect.add_argument("dir", type=Path, help="the run folder (the Job's /data)")
    collect.set_defaults(handler=cmd_collect)


def cmd_export(args: argparse.Namespace) -> int:
    from ._cli import _scenario_from_args, _task_params, _task_target
    from ._kubernetes import ExportError, export_manifests, run_template
    from ._run import RunOptions, TestbedError
    from ._scenario import ScenarioError

    try:
        sc = _scenario_from_args(args)
        target, metric, higher = _task_target(sc, args.target, _task_params(args.param))
        k8s = KubernetesTarget(
            name=args.name or "geotrain-testbed", namespace=args.namespace, image=args.image,
            storage_class=args.storage_class, cpu=args.cpu, memory=args.memory,
            startup_s=args.startup_s,
        )  # fmt: skip
        if args.name is None:
            k8s = with_name(k8s, sc.name)
        out = args.out or Path("testbed-k8s") / k8s.name
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ExportError(f"--out {str(out)!r}: exists and is not an empty folder")
        options = RunOptions(
            scenario=sc, out=out, target=target, metric=metric, higher_is_better=higher,
            baseline="none", link_check=False, node_overrides=tuple(args.node_set),
            eval_every_s=args.eval_every_s,
            command=("geotrain", "testbed", "export", "--kubernetes", args.scenario),
        )  # fmt: skip
        manifests = export_manifests(options, k8s, run_template(options, k8s), time.time())
    except (ScenarioError, TestbedError, ValueError) as exc:
        print(f"geotrain testbed export: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        docs = manifests[name]
        (out / name).write_text("".join(f"---\n{json.dumps(d, indent=1)}\n" for d in docs))
    print(f"scenario {sc.name}: {sc.n_peers} peers in "
          f"{', '.join(f'{r.name} ({r.peers})' for r in sc.regions)}; "
          f"{len(manifests['20-links.yaml'])} NetworkChaos; written to {out}")  # fmt: skip
    print("no cluster is contacted; apply them in order (docs/how-to/kubernetes.md):")
    for line in apply_steps(out, k8s):
        print(f"  {line}")
    return 0


def apply_steps(out: Path, k8s: KubernetesTarget) -> list[str]:
    """The kubectl commands that run an export, in order (printed, and in the docs)."""
    ns = f"-n {k8s.namespace}"
    peers = f"-l geotrain.testbed/run={k8s.name},geotrain.testbed/role=peer"
    return [
        f"kubectl apply -f {out}/00-setup.yaml -f {out}/10-peers.yaml",
        f"kubectl wait {ns} --for=condition=Ready pod {peers} --timeout=15m",
        f"kubectl apply -f {out}/20-links.yaml",
        f"kubectl wait {ns} --for=condition=AllInjected networkchaos --all --timeout=5m",
        f"kubectl apply -f {out}/30-run.yaml",
        f"kubectl logs {ns} -f job/{k8s.name}-collect",
    ]


def cmd_collect(args: argparse.Namespace) -> int:
    from ._kubernetes import collect_run

    try:
        run = collect_run(args.dir)
    except ValueError as exc:
        print(f"geotrain testbed collect: {exc}", file=sys.stderr)
        return 2
    print(f"run.json written: {run['peers']} peers, scenario {run['scenario']}")
    return 0
