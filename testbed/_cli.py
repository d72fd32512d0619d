# `geotrain testbed run|report|down`, registered through the "geotrain.commands" entry point (node
# never imports testbed). Invariants: argv is read only here; a bad scenario or option is reported
# in one line naming the field and exits 2 before anything starts; a directory `report` cannot read
# is refused the same way, one line per problem, before anything is written; SIGTERM is turned into
# the same KeyboardInterrupt as Ctrl-C, so every `with` block of the run unwinds and cleans up.
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._baselines import missing_requirement
from ._netem import BACKENDS, BackendUnavailable
from ._scenario import (
    DEFAULT_SCENARIO,
    PARTITIONS,
    ScenarioError,
    TestbedScenario,
    builtin_scenarios,
    load_scenario,
)

if TYPE_CHECKING:
    from ._rundir import RunDir


def _seconds_list(text: str) -> tuple[float, ...]:
    """"0,1.5,0.2" -> (0.0, 1.5, 0.2) (argparse names the flag in its error)."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, comma-separated") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `testbed` and its subcommands to the `geotrain` parser."""
    parser = subparsers.add_parser(
        "testbed", help="many local peers behind emulated WAN links, vs a DDP baseline",
        description="Run many geotrain nodes on this machine behind emulated WAN links.",
    )  # fmt: skip
    sub = parser.add_subparsers(title="testbed commands", metavar="ACTION")
    parser.set_defaults(handler=lambda args: (parser.print_help(), 0)[1])

    run = sub.add_parser("run", help="run a scenario with geotrain and the DDP baseline")
    run.add_argument("--scenario", default=DEFAULT_SCENARIO,
                     help=f"built-in name ({', '.join(builtin_scenarios())}) or a .toml / .json "
                          f"file, such as testbed/scenarios/*.json (default: "
                          f"{DEFAULT_SCENARIO})")  # fmt: skip
    run.add_argument("--peers", type=int, help="number of peers (spread over the regions)")
    run.add_argument("--task", help="training task (default: the scenario's)")
    run.add_argument("--algorithm", help="gossip algorithm (default: the scenario's)")
    run.add_argument("--baseline", default="ddp", metavar="LIST",
                     help="systems to compare with, one after the other on the same links: "
                          "ddp, localsgd (DDP ranks averaging parameters every 16 steps), "
                          "hivemind (hivemind.Optimizer, synchronous), hivemind-local (its "
                          "local-updates mode), comma-separated, or none (default: ddp); hivemind "
                          "needs pip install 'geotrain[baselines]'")  # fmt: skip
    run.add_argument("--baseline-set", action="append", default=[], metavar="NAME.KEY=VALUE",
                     help="change a baseline's setting, e.g. ddp.lr=0.003, localsgd.period=8, "
                          "hivemind-local.target_batch_size=4096 (repeatable)")  # fmt: skip
    run.add_argument("--nat", type=_peer_indices, metavar="I,J,...",
                     help="peers behind NAT (client mode; their namespace drops inbound "
                          "connections); replaces the scenario's nat")  # fmt: skip
    run.add_argument("--emulation", choices=BACKENDS, default="auto")
    run.add_argument("--duration", type=float, help="seconds of training per system at most")
    run.add_argument("--step-ms", type=float, metavar="MS",
                     help="compute emulation: pin every peer's step to MS milliseconds (a "
                          "straggler's times its slowdown) in every system (default: the "
                          "scenario's step_ms, 0: off)")  # fmt: skip
    run.add_argument("--partition", choices=PARTITIONS,
                     help="how every system splits the data over the peers: iid, or dirichlet "
                          "label skew (non-IID, federated-style) (default: the scenario's, iid)")
    run.add_argument("--alpha", type=float, metavar="A",
                     help="Dirichlet concentration for --partition dirichlet; smaller is more "
                          "skewed (default: the scenario's, 0.5)")  # fmt: skip
    run.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                     help="a task parameter for every system (the scenario's [params]), e.g. "
                          "--task gpt --param size=10m --param batch=2 (repeatable; a value "
                          "is TOML, a bare word a string)")  # fmt: skip
    run.add_argument("--target", type=float, help="metric value to reach (default: task's)")
    run.add_argument("--eval-every-s", type=float, metavar="S", default=10.0,
                     help="every system evaluates at least once every S seconds (default: 10; "
                          "0: only every 20 steps, DDP's ranks every step): each "
                          "evaluation is training time lost, which a big model on a busy "
                          "machine notices")  # fmt: skip
    run.add_argument("--out", type=Path, help="output directory (default: testbed-runs/<time>)")
    run.add_argument("--node-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="a node config override for every peer, e.g. gossip.policy=uniform "
                          "(repeatable)")  # fmt: skip
    run.add_argument("--no-link-check", action="store_true",
                     help="skip measuring RTT/throughput of each region pair")  # fmt: skip
    run.add_argument("--clock", choices=("real", "virtual"), default="real",
                     help="real: peers are processes behind emulated links, in wall time; "
                          "virtual: one process on a virtual clock, the model math real and "
                          "time taken from the scenario's links and compute profile, so the "
                          "figures do not depend on this machine (baselines ddp, localsgd and "
                          "ideal: DDP on free links) (default: real)")  # fmt: skip
    run.add_argument("--seed", type=int, default=0,
                     help="--clock virtual: seeds the scheduler and the jitter (default: 0)")
    run.add_argument("--step-jitter", type=float, default=0.02, metavar="F",
                     help="--clock virtual: each step costs step-ms x slowdown x (1 +- F), "
                          "drawn per step (default: 0.02)")  # fmt: skip
    run.add_argument("--mtu", type=int, default=1500,
                     help="--clock virtual: the path MTU whose TCP/IP headers the bytes count "
                          "(default: 1500)")  # fmt: skip
    run.add_argument("--allreduce", choices=("best", "ring", "hierarchical", "testbed"),
                     default="best",
                     help="--clock virtual: the DDP baselines' all-reduce: the faster of a ring "
                          "and a hierarchical one (DDP at its strongest), or the one named; "
                          "testbed: gloo's ring as the real testbed's DDP runs it (its framing, "
                          "its start-up broadcast and stop-rule checks), for calibration "
                          "(default: best)")  # fmt: skip
    run.add_argument("--peer-start-s", type=_seconds_list, default=(), metavar="S,S,...",
                     help="--clock virtual: when each geotrain peer starts, in seconds (one a "
                          "peer; default: all at once), e.g. a real run's start spread for "
                          "calibration")  # fmt: skip
    run.add_argument("--partners", choices=("policy", "oracle"), default="policy",
                     help="--clock virtual: policy (gossip.policy chooses), or oracle: each peer "
                          "exchanges only with fixed partners computed offline from the links "
                          "(its near ones, and the cheapest bridges between the groups), the "
                          "best fixed partners a policy is measured against (default: policy)")
    run.add_argument("--max-steps", type=int, default=0, metavar="N",
                     help="--clock virtual: stop each system after N steps (0: no limit), for "
                          "systems figures of models too big to train to a target")  # fmt: skip
    run.set_defaults(handler=lambda args: cmd_run(args, command=_command_line(run, args)))

    report = sub.add_parser(
        "report", help="re-render plots and print the table of a run (--html: one HTML file)",
        description="Rebuild summary.json, the plots and the comparison table of a finished "
                    "run from its directory alone.",
    )  # fmt: skip
    report.add_argument("dir", type=Path, help="the run's output directory (`testbed run --out`)")
    report.add_argument("--html", action="store_true",
                        help="also write a self-contained HTML file, DIR/report.html")  # fmt: skip
    report.add_argument("--html-out", type=Path, metavar="PATH",
                        help="where to write the HTML report (implies --html)")  # fmt: skip
    report.set_defaults(handler=cmd_report)

    compare = sub.add_parser(
        "compare", help="several runs' systems at equal quality (e.g. two geotrain settings)",
        description="Time and bytes of every system of several finished runs to the same levels "
                    "(every peer at or past each), as one run's table compares its systems: "
                    "run the same scenario with each setting (--baseline none), then compare.",
    )  # fmt: skip
    compare.add_argument("dirs", type=Path, nargs="+", metavar="DIR",
                         help="run folders (`testbed run --out`), two or more")  # fmt: skip
    compare.add_argument("--system", action="append", default=[], metavar="NAME",
                         help="only this system of each run, e.g. geotrain (repeatable)")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.set_defaults(handler=cmd_compare)

    down = sub.add_parser("down", help="remove namespaces/processes left by a crashed run")
    down.add_argument("--run", metavar="PREFIX", type=_run_prefix,
                      help="only this run's leftovers, e.g. gt-3fa9c1 (as printed by `testbed run`"
                           " after 'namespaces:'); default: every testbed run's")  # fmt: skip
    down.set_defaults(handler=cmd_down)

    from ._kubernetes_cli import register_kubernetes  # export, collect: testbed on Kubernetes

    register_kubernetes(sub)


def _run_prefix(text: str) -> str:
    """A run's name prefix as `testbed run` prints it (`gt-3fa9c1` or `gt-3fa9c1-`)."""
    from ._namespaces import PREFIX

    prefix = text if text.endswith("-") else text + "-"
    hex_part = prefix[len(PREFIX) : -1]
    if not prefix.startswith(PREFIX) or len(hex_part) != 6 or not _is_hex(hex_part):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a run prefix such as {PREFIX}3fa9c1 (from `testbed run`'s output)"
        )
    return prefix


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _peer_indices(text: str) -> tuple[int, ...]:
    """`--nat 3,4,5` -> (3, 4, 5) (checked against the scenario when it is applied)."""
    try:
        return tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected peer indices like 3,4,5") from None


def _scenario_from_args(args: argparse.Namespace) -> TestbedScenario:
    sc = load_scenario(args.scenario)
    if args.peers is not None:
        spread = sc.with_peers(args.peers)
        for line in sc.peer_moves(spread):  # (it did this silently)
            print(f"warning: --peers {args.peers} spreads the peers over the regions afresh: "
                  f"{line}", file=sys.stderr)  # fmt: skip
        sc = spread
    if getattr(args, "nat", None) is not None:
        sc = replace(sc, nat=args.nat)
    changes = {"task": args.task, "algorithm": args.algorithm, "duration_s": args.duration,
               "step_ms": getattr(args, "step_ms", None),
               "partition": getattr(args, "partition", None),
               "alpha": getattr(args, "alpha", None)}  # fmt: skip
    changes = {k: v for k, v in changes.items() if v is not None}
    for item in getattr(args, "node_set", ()):
        key = item.partition("=")[0].strip()
        shared = SHARED_TRAINING.get(
            "training.params" if key.startswith("training.params.") else key)
        if key in TESTBED_STATE:
            raise ScenarioError(f"--node-set {item!r}: the testbed sets this for every node: "
                                f"{TESTBED_STATE[key]}")  # fmt: skip
        compared = getattr(args, "baseline", "ddp") != "none"  # (a geotrain-only sweep: fine)
        if shared is not None and compared:  # (the table compared geotrain on another job)
            raise ScenarioError(f"--node-set {item!r}: every system of the run gets this from the "
                                f"scenario, and this would change it for geotrain's nodes only; "
                                f"use {shared}")  # fmt: skip
        if key == "gossip.preset" and args.algorithm is None:  # the preset's algorithm is the
            changes.update(_preset_algorithm(item.partition("=")[2].strip()))  # run's too
    given = _task_params(getattr(args, "param", ()))
    if changes or given:
        params = {} if args.task and args.task != sc.task else dict(sc.params)
        sc = replace(sc, params={**params, **given}, **changes)
    return sc


def _task_params(items: Iterable[str]) -> dict[str, Any]:
    """`--param KEY=VALUE` items as the scenario's params: a value is TOML (`2`, `0.5`, `true`,
    `"10m"`), a bare word a string (`size=10m`), as a node's --set reads it."""
    from geotrain.node import override_value

    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or "." in key or not raw.strip():
            raise ScenarioError(f"--param {item!r}: expected KEY=VALUE, a task parameter such "
                                "as size=10m")  # fmt: skip
        out[key] = override_value(raw.strip())
        try:  # (written to scenario.json and run.json: a TOML date would end the run there)
            json.dumps(out[key])
        except (TypeError, ValueError):
            raise ScenarioError(f"--param {item!r}: a {type(out[key]).__name__} is no task "
                                "parameter: give a number, true/false, a string or a "
                                "list") from None  # fmt: skip
    return out


# [training] settings the testbed gives every system alike, and what sets them for all
SHARED_TRAINING = {
    "training.task": "--task (or the scenario's task)",
    "training.params": "--param KEY=VALUE (or the scenario's [params])",
    "training.partition": "--partition",
    "training.alpha": "--alpha",
    "training.step_time_ms": "--step-ms (or the scenario's step_ms)",
    "training.slowdown": "the scenario's [[stragglers]]",
    "training.seed": "nothing: every system starts from the same seeded model",
    "training.shard_index": "nothing: peer i trains shard i in every system",
    "training.num_shards": "--peers",
    "training.threads": "nothing: every peer of every system trains on one thread",
}  # (not the recipe's lr, optimizer, ...: each system may be run at its own best settings)


# [state] settings the testbed sets itself (its figures are read from what they make)
TESTBED_STATE = {
    "state.dir": "each peer's folder in the run's output directory",
    "state.status_every_s": "1 s: each peer's curves are sampled from its metrics.jsonl",
    "state.metrics_max_mb": "the summary reads each peer's whole metrics.jsonl",
}


def _preset_algorithm(name: str) -> dict[str, str]:
    """{"algorithm": ...} of gossip preset `name` (nothing for an unknown one: the nodes' config
    check names it)."""
    from geotrain.node import GOSSIP_PRESETS

    preset = GOSSIP_PRESETS.get(name.strip('"'), {})
    return {"algorithm": preset["algorithm"]} if "algorithm" in preset else {}


def _task_target(
    sc: TestbedScenario, target: float | None, given: Iterable[str] = ()
) -> tuple[float, str, bool]:
    """(target, metric name, higher is better) from the task itself (imports torch); `given`:
    the params --param set (an unknown one is named as the option)."""
    from geotrain.node import TaskContext, resolve_task
    from geotrain.node.training import UnknownTaskParam

    ctx = TaskContext(params=dict(sc.params))
    task = resolve_task(sc.task)(ctx)
    try:  # (as a node checks them, but before anything runs)
        unasked = ctx.check_unasked(sc.task)
    except UnknownTaskParam as exc:
        where = f"--param {exc.key}" if exc.key in set(given) else f"scenario.params.{exc.key}"
        raise ScenarioError(f"{where}: {exc}") from None
    if unasked:  # a task of the user's own may read ctx.params itself: said, not refused
        print(f"warning: task {sc.task!r} never read params {', '.join(unasked)} through "
              f"ctx.param (it read: {', '.join(sorted(ctx.asked)) or 'none'}): a typo?",
              file=sys.stderr)  # fmt: skip
    if target is not None and not math.isfinite(target):
        raise ScenarioError(f"--target {target}: expected a finite number (the metric to reach)")
    value = target if target is not None else sc.target
    if value is None:
        value = task.default_target
    if value is None:
        raise ScenarioError(f"task {sc.task!r} states no default target: pass --target")
    return float(value), task.metric, task.higher_is_better


def _command_line(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    """`geotrain testbed run` with every option set away from its default, rebuilt from the
    parsed options (main() may be handed its argv by a caller: sys.argv is not the command)."""
    words = ["geotrain", "testbed", "run"]
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # a flag such as --no-link-check
            words.append(flag)
        elif isinstance(value, list):  # a repeatable option such as --node-set
            words += [w for item in value for w in (flag, str(item))]
        else:
            words += [flag, str(value)]
    return tuple(words)


def _sigterm_as_interrupt() -> None:
    def handler(signum, frame):  # noqa: ARG001
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup
        raise KeyboardInterrupt("SIGTERM")  # (run.json says which: a Ctrl-C's has no message)

    signal.signal(signal.SIGTERM, handler)


def _run_options(args: argparse.Namespace, command: tuple[str, ...], emulation: str,
                 link_check: bool):  # fmt: skip
    """The run's options from the command line (raises ScenarioError or ValueError)."""
    from ._run import RunOptions

    out = (args.out or Path("testbed-runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    sc = _scenario_from_args(args)
    target, metric, higher = _task_target(sc, args.target, _task_params(args.param))
    return RunOptions(
        scenario=sc, out=out, target=target, metric=metric, higher_is_better=higher,
        emulation=emulation, baseline=args.baseline, baseline_set=tuple(args.baseline_set),
        link_check=link_check, node_overrides=tuple(args.node_set),
        eval_every_s=args.eval_every_s, command=command, cwd=os.getcwd(),
    )  # fmt: skip


def cmd_run(args: argparse.Namespace, command: tuple[str, ...] = ()) -> int:
    from ._run import TestbedError, check_memory_for, check_node_config, run_testbed

    if getattr(args, "clock", "real") == "virtual":
        return cmd_run_virtual(args, command)

    try:
        options = _run_options(args, command, args.emulation, not args.no_link_check)
        sc, out, target, metric = options.scenario, options.out, options.target, options.metric
        check_node_config(options)
        check_memory_for(sc.n_peers)
        # refused here, before the header (they came after it, with status 1)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise TestbedError(f"--out {str(out)!r}: exists and is not an empty folder")
        if args.emulation == "netem" and sc.matrix().access:
            raise TestbedError("--emulation netem cannot emulate the scenario's access links (a "
                               "peer's own uplink and downlink): use userspace or auto")
    except (ScenarioError, TestbedError, ValueError) as exc:
        print(f"geotrain testbed run: {exc}", file=sys.stderr)
        return 2
    for why in filter(None, map(missing_requirement, options.baselines)):
        print(f"geotrain testbed run: {why}", file=sys.stderr)
        return 2
    print(f"scenario {sc.name}: {sc.description}")
    print(f"{sc.n_peers} peers in {', '.join(f'{r.name} ({r.peers})' for r in sc.regions)}; "
          f"task {sc.task}, target {metric} {target:g}, at most {sc.duration_s:g} s per system; "
          f"output {out}")  # fmt: skip
    for fault in sc.faults:
        print(f"fault: {fault.describe()}")
        if fault.at_s >= sc.duration_s:  # (its clock starts at a system's first step)
            print(f"warning: the fault at t={fault.at_s:g}s is due at or after the run's "
                  f"{sc.duration_s:g} s (--duration, the scenario's duration_s): it will not "
                  "happen", file=sys.stderr)  # fmt: skip
    for w in sc.availability:
        print(f"availability: peer {w.peer} online {w.online_s:g} s, away {w.offline_s:g} s, "
              f"first window delayed {w.offset_s:g} s (geotrain only)")  # fmt: skip
    if sc.partition != "iid":
        print(f"data: {sc.partition} label skew, alpha {sc.alpha:g}, the same split in every "
              "system")  # fmt: skip
    _sigterm_as_interrupt()
    started = time.monotonic()
    try:
        run_testbed(options, echo=lambda line: print(line, flush=True))
    except (TestbedError, BackendUnavailable, ValueError) as exc:
        print(f"geotrain testbed run: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print(f"done in {time.monotonic() - started:.0f} s; results in {out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ._plots import render_plots
    from ._rundir import RunDirError, open_run_dir, write_json
    from ._summary import build_summary, render_table

    try:
        rundir = open_run_dir(args.dir)
        summary = build_summary(args.dir)
    except RunDirError as exc:
        for problem in exc.problems:
            print(f"geotrain testbed report: {problem}", file=sys.stderr)
        return 2
    write_json(args.dir / "summary.json", summary)
    for path in render_plots(args.dir):
        print(f"plot: {path}")
    print(render_table(summary))
    for part in rundir.missing:
        print(f"missing: {part}")
    # a Namespace built by hand (tests, scripts) may predate the HTML options
    html_out = getattr(args, "html_out", None)
    if html_out is None and getattr(args, "html", False):
        html_out = args.dir / "report.html"
    return 0 if html_out is None else _write_html(rundir, summary, html_out)


def cmd_compare(args: argparse.Namespace) -> int:
    from ._summary import compare_runs, render_comparison

    try:
        doc = compare_runs(list(args.dirs), tuple(args.system))
    except ValueError as exc:
        print(f"geotrain testbed compare: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2) if args.json else render_comparison(doc))
    return 0


def _write_html(rundir: RunDir, summary: dict[str, Any], dest: Path) -> int:
    from ._html import write_html_report

    try:
        write_html_report(rundir, summary, dest)
    except OSError as exc:
        print(f"geotrain testbed report: --html-out {str(dest)!r}: {exc.strerror or exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"html: {dest}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from ._namespaces import PREFIX, cleanup_leftovers, list_namespaces

    prefix = args.run or PREFIX
    running = list_namespaces(prefix)
    if running and args.run is None:
        print(f"WARNING: this removes every testbed namespace ({len(running)} found), including "
              "those of a testbed run that is still going; its peers are killed "
              "(--run PREFIX limits it to one run).")  # fmt: skip
    removed = []
    with contextlib.suppress(KeyboardInterrupt):
        removed = cleanup_leftovers(prefix)
    for item in removed:
        print(f"removed {item}")
    if not removed:
        print("nothing left over")
    return 0


def _same_hash_seed() -> None:
    """A virtual run is the same bit for bit only with one string hash seed (set iteration
    order): without PYTHONHASHSEED, run this command again with it set to 0."""
    if os.environ.get("PYTHONHASHSEED") is not None or os.environ.get("GEOTRAIN_NO_REEXEC"):
        return
    argv = sys.orig_argv
    as_command = "-m" in argv[1:3] or Path(argv[1] if len(argv) > 1 else "").name == "geotrain"
    if not as_command:  # (called inside someone's own process: it is not ours to replace)
        print("warning: PYTHONHASHSEED is not set: this virtual run repeats only in a process "
              "with the same hash seed", file=sys.stderr)  # fmt: skip
        return
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)


def cmd_run_virtual(args: argparse.Namespace, command: tuple[str, ...] = ()) -> int:
    from ._run import TestbedError
    from ._virtual import VirtualOptions, check_virtual, run_virtual

    try:
        options = _run_options(args, command, "none", False)
        sc, out, target, metric = options.scenario, options.out, options.target, options.metric
        virtual = VirtualOptions(seed=args.seed, step_jitter=args.step_jitter, mtu=args.mtu,
                                 max_steps=args.max_steps, allreduce=args.allreduce,
                                 peer_start_s=args.peer_start_s,
                                 partners=args.partners)  # fmt: skip
        check_virtual(options, virtual)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise TestbedError(f"--out {str(out)!r}: exists and is not an empty folder")
    except (ScenarioError, TestbedError, ValueError) as exc:
        print(f"geotrain testbed run: {exc}", file=sys.stderr)
        return 2
    _same_hash_seed()
    print(f"scenario {sc.name}: {sc.description}")
    print(f"{sc.n_peers} peers in {', '.join(f'{r.name} ({r.peers})' for r in sc.regions)}; "
          f"task {sc.task}, target {metric} {target:g}, at most {sc.duration_s:g} virtual s per "
          f"system; output {out}")  # fmt: skip
    for fault in sc.faults:
        print(f"fault: {fault.describe()}")
    started = time.monotonic()
    try:
        run_virtual(options, virtual, echo=lambda line: print(line, flush=True))
    except (TestbedError, ValueError) as exc:
        print(f"geotrain testbed run: {exc}", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - started:.0f} s of wall time; results in {out}")
    return 0
