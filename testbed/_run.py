# The testbed orchestrator: namespaces and emulated links, then the geotrain swarm, then the DDP
# baseline over the same links (one after the other: they would compete for the same cores), then
# run.json, summary.json, plots and the table. Invariants: every namespace, device and process it
# makes is gone when `run_testbed` returns or raises (KeyboardInterrupt included: the CLI turns
# SIGTERM into one); times are wall-clock (time.time()) so they compare with the peers' metrics
# lines; t = 0 of a system is when its first peer took its first step; bytes are measured
# (emulator or interface counters, else the nodes' own counters), never computed.
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geotrain.node import ManagedProcess, config_to_toml
from geotrain.node.state import StateDir

from ._faults import FaultRunner
from ._linkcheck import bulk_bytes_for, measure_link
from ._meter import BytesMeter
from ._namespaces import NamespaceSet
from ._netem import BackendChoice, NetemLinks, choose_backend
from ._peers import (
    DDP_PORT,
    NODE_PORT,
    Peers,
    TestbedError,
    child_env,
    ddp_argv,
    free_port,
    hosts_for,
    last_json_line,
    read_json,
    start_node,
    wait_for_address,
    write_swarm_files,
)
from ._scenario import TestbedScenario
from ._summary import build_summary, render_table
from ._userspace import UserspaceLinks

STARTUP_TIMEOUT_S = 180.0  # launch -> first step, 2 cores shared by every peer's torch import
LINK_CHECK_SECONDS = 0.5
LINK_CHECK_MAX_BYTES = 32 << 20

Echo = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    """One `geotrain testbed run`.

    Attributes:
        scenario: what to emulate and train (peers, task, algorithm, duration already applied).
        out: output directory (created; must be empty or absent).
        target: the metric value to reach, stated before the run.
        metric, higher_is_better: the task's metric and its direction.
        emulation: auto, netem, userspace or none.
        baseline: "ddp" or "none".
        link_check: measure RTT and throughput of each region pair before training.
        eval_every: steps between a geotrain node's evaluations (a node takes hundreds of steps
            a second on small tasks: every 20 steps is a few times a second).
        ddp_eval_every: the same for DDP ranks. Every step by default: a DDP step over WAN links
            takes seconds, and evaluating every 20 would blur its time to target by minutes.
        progress_every_s: seconds between progress lines.
        node_overrides: `--set section.key=value` items for every node (e.g. gossip.policy).
        command: the command line that asked for this run, as the CLI rebuilt it from its
            options (recorded in run.json for the report; empty when run from Python).
        cwd: the working directory that command's relative paths are relative to.
    """

    __test__ = False

    scenario: TestbedScenario
    out: Path
    target: float
    emulation: str = "auto"
    baseline: str = "ddp"
    metric: str = "accuracy"
    higher_is_better: bool = True
    link_check: bool = True
    eval_every: int = 20
    ddp_eval_every: int = 1
    progress_every_s: float = 5.0
    node_overrides: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    cwd: str | None = None

    def __post_init__(self) -> None:
        # Every path handed to a peer is absolute: a peer's config resolves relative paths
        # against the config file's own folder, which would apply a relative `out` twice.
        object.__setattr__(self, "out", Path(self.out).expanduser().resolve())
        if self.baseline not in ("ddp", "none"):
            raise ValueError(f"RunOptions.baseline={self.baseline!r}: expected 'ddp' or 'none'")
        for item in self.node_overrides:
            key = item.partition("=")[0]
            if "=" not in item or "." not in key:
                raise ValueError(f"--node-set {item!r}: expected section.key=value")
        for name in ("eval_every", "ddp_eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunOptions.{name}={getattr(self, name)!r}: expected >= 1")


def run_testbed(options: RunOptions, echo: Echo = print) -> dict[str, Any]:
    """Run the scenario with geotrain (and the baseline), write the output directory.

    Returns:
        The summary (also written to `out/summary.json`).

    Raises:
        TestbedError, BackendUnavailable, ScenarioError: the run cannot start or go on.
        KeyboardInterrupt: interrupted; everything made so far has been removed.
    """
    sc, out = options.scenario, options.out
    if out.exists() and any(out.iterdir()):
        raise TestbedError(f"--out {str(out)!r}: exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    choice = choose_backend(options.emulation)
    if choice.user_namespace:
        why = "not root, and running peers in an unprivileged user namespace is not built yet"
        if options.emulation != "auto":
            raise TestbedError(f"--emulation {options.emulation}: {why}; run as root")
        choice = BackendChoice("none", f"NO LINK EMULATION: {why}; peers talk over plain loopback")
    echo(f"emulation: {choice.backend} ({choice.reason})")
    if sc.rate_scale != 1.0:
        echo(f"NOTE: link rates scaled to {sc.rate_scale:g}x the published figures")
    (out / "scenario.json").write_text(json.dumps(sc.to_json(), indent=2) + "\n")
    run: dict[str, Any] = {
        "scenario": sc.name, "emulation": choice.backend, "emulation_reason": choice.reason,
        "peers": sc.n_peers, "task": sc.task, "params": dict(sc.params),
        "algorithm": sc.algorithm, "target_value": options.target, "metric": options.metric,
        "higher_is_better": options.higher_is_better, "rate_scale": sc.rate_scale,
        "duration_s": sc.duration_s, "systems": {}, "faults": [], "links": [],
        "node_overrides": list(options.node_overrides),
        "command": list(options.command), "cwd": options.cwd,
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        namespaces = links = None
        if choice.backend != "none":
            namespaces = stack.enter_context(NamespaceSet(sc.n_peers))
            echo(f"namespaces: {namespaces.run_prefix}p00..p{sc.n_peers - 1:02d}")
            emulator = UserspaceLinks if choice.backend == "userspace" else NetemLinks
            links = stack.enter_context(emulator(namespaces, sc.matrix()))
        hosts = hosts_for(namespaces, sc.n_peers, choice.backend)
        if options.link_check and namespaces is not None:
            run["links"] = _check_links(namespaces, sc, echo)
        else:
            run["links"] = _spec_links(sc)
        meter = BytesMeter(choice.backend, links, namespaces, hosts)
        run["bytes_source"] = meter.source
        faults = FaultRunner(sc, links, echo)
        run["systems"]["geotrain"] = _run_geotrain(options, hosts, meter, faults, echo)
        faults.reset()
        if options.baseline == "ddp":
            faults = FaultRunner(sc, links, echo, system="ddp", applied=faults.applied_all)
            run["systems"]["ddp"] = _run_ddp(options, hosts, meter, faults, echo)
            faults.reset()
        run["faults"] = faults.applied_all
    run["consensus_distance_final"] = _final_consensus(out / "geotrain", sc.n_peers)
    (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    summary = build_summary(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(out, echo)
    echo(render_table(summary))
    return summary


def _spec_links(sc: TestbedScenario) -> list[dict[str, Any]]:
    matrix, out = sc.matrix(), []
    for (a, b), spec in matrix.links.items():
        out.append({
            "src": a, "dst": b, "spec_rtt_ms": 2 * spec.delay_ms, "measured_rtt_ms": None,
            "spec_mbit": spec.rate_mbit, "measured_mbit": None,
        })  # fmt: skip
    return out


def _check_links(namespaces: NamespaceSet, sc: TestbedScenario, echo: Echo) -> list[dict]:
    """Measure one peer pair per ordered region pair (a region with one peer has no inner link)."""
    matrix = sc.matrix()
    first: dict[str, list[int]] = {}
    for i, region in enumerate(matrix.peer_regions):
        first.setdefault(region, []).append(i)
    results = _spec_links(sc)
    for item in results:
        srcs, dsts = first[item["src"]], first[item["dst"]]
        if item["src"] == item["dst"] and len(dsts) < 2:
            continue  # a region with one peer has no link inside it
        src, dst = srcs[0], (dsts[1] if item["src"] == item["dst"] else dsts[0])
        size = min(
            LINK_CHECK_MAX_BYTES,
            bulk_bytes_for(item["spec_mbit"], LINK_CHECK_SECONDS, item["spec_rtt_ms"]),
        )
        m = measure_link(namespaces, src, dst, bulk_bytes=size)
        item.update(src_peer=src, dst_peer=dst, measured_rtt_ms=round(m.measured_rtt_ms, 2),
                    measured_mbit=round(m.measured_mbit, 1), check_bytes=size)  # fmt: skip
        echo(
            f"link {item['src']} -> {item['dst']}: RTT {m.measured_rtt_ms:.1f} ms "
            f"(spec {item['spec_rtt_ms']:g}), {m.measured_mbit:.0f} Mbit/s "
            f"(spec {item['spec_mbit']}, {size >> 20} MiB transfer)"
        )
    return results


def _node_config(options: RunOptions, host, files, state: Path, bootstrap: list[str]) -> dict:
    sc = options.scenario
    key, cert, swarm = files
    network: dict[str, Any] = {"bootstrap": bootstrap}
    if host.fixed_port:  # its own namespace and address: a known port
        network["listen"] = network["advertise"] = f"tcp://{host.address}:{NODE_PORT}"
    else:  # shared loopback: the node picks a free port and advertises what it got
        network["listen"] = f"tcp://{host.address}:0"
    return {
        "identity": {"key": key, "certificate": cert, "swarm": swarm},
        "network": network,
        "training": {
            "task": sc.task, "params": dict(sc.params), "seed": 0, "shard_index": host.index,
            "num_shards": sc.n_peers, "wait_for_peers": sc.n_peers - 1,
            "eval_every": options.eval_every, "slowdown": sc.slowdown(host.index), "threads": 1,
        },
        # state_sync off: every peer starts from the same seeded model, as the DDP ranks do (a
        # restarted peer resumes from its own checkpoint either way)
        "gossip": {"algorithm": sc.algorithm, "state_sync": False},
        "state": {"dir": state, "status_every_s": 1.0},
    }  # fmt: skip


def _run_geotrain(options, hosts, meter: BytesMeter, faults: FaultRunner, echo: Echo) -> dict:
    sc, root = options.scenario, options.out / "geotrain"
    root.mkdir()
    files = write_swarm_files(root, sc.n_peers, time.time())
    peers, states = Peers(), [root / f"peer-{h.index:02d}" for h in hosts]
    echo(f"geotrain: starting {sc.n_peers} nodes ({sc.algorithm}, {sc.task})")
    launch = time.time()
    try:
        bootstrap: list[str] = []
        for host, state in zip(hosts, states, strict=True):
            config = root / f"peer-{host.index:02d}.toml"
            doc = _node_config(options, host, files[host.index], state, bootstrap)
            config.write_text(config_to_toml(doc))
            proc = peers.add(start_node(host, config, state, options.node_overrides))
            if host.index == 0:
                bootstrap = [wait_for_address(0, proc)]

        def statuses() -> list[dict | None]:
            return [read_json(StateDir(s).status) for s in states]

        def reached() -> bool:
            if any(not p.running and faults.restart_pending(i) for i, p in enumerate(peers.procs)):
                return False  # a killed peer comes back: the swarm is not done without it
            live = [
                st for p, st in zip(peers.procs, statuses(), strict=True)
                if p.running and st and st.get("pid") == p.proc.pid  # type: ignore[union-attr]
            ]  # fmt: skip
            return len(live) == len(peers.running()) > 0 and all(
                st.get("metric") is not None
                and _reached(st["metric"], options.target, options.higher_is_better)
                for st in live
            )

        def progress() -> list[tuple[int, float | None] | None]:
            return [
                (st["step"], st.get("metric")) if st else None for st in statuses()
            ]

        stopped = _supervise(
            "geotrain", options, peers, meter, faults, echo, reached, progress,
            first_step=lambda: any(st and st.get("step", 0) > 0 for st in statuses()),
            stop_at_duration=True, launch=launch,
        )  # fmt: skip
    finally:
        peers.stop()
    return {"launch_t": launch, "stopped": stopped, "metrics": "geotrain/peer-NN/metrics.jsonl"}


def _run_ddp(options, hosts, meter: BytesMeter, faults: FaultRunner, echo: Echo) -> dict:
    sc, root = options.scenario, options.out / "ddp"
    root.mkdir()
    port = DDP_PORT if hosts[0].fixed_port else free_port()
    master = f"{hosts[0].address}:{port}"
    files = [root / f"peer-{h.index:02d}.jsonl" for h in hosts]
    peers = Peers()
    echo(f"ddp: starting {sc.n_peers} gloo workers (same task, shards, slowdowns, links)")
    launch = time.time()
    try:
        for host, metrics in zip(hosts, files, strict=True):
            argv = ddp_argv(
                rank=host.index, world=sc.n_peers, master=master, task=sc.task,
                params=dict(sc.params), seed=0, slowdown=sc.slowdown(host.index),
                duration=sc.duration_s, target=options.target, eval_every=options.ddp_eval_every,
                metrics=metrics,
            )  # fmt: skip
            env = child_env({"GLOO_SOCKET_IFNAME": host.ifname})
            peers.add(ManagedProcess(argv, metrics.with_suffix(".log"), env, host.prefix)).start()

        def progress() -> list[tuple[int, float | None] | None]:
            lines = [last_json_line(f) for f in files]
            return [(r["step"], r.get("metric")) if r else None for r in lines]

        stopped = _supervise(
            "ddp", options, peers, meter, faults, echo, reached=lambda: False,
            progress=progress, first_step=lambda: any(f.exists() and f.stat().st_size
                                                       for f in files),
            stop_at_duration=False, launch=launch,
        )  # fmt: skip
        failed = [i for i, p in enumerate(peers.procs) if p.proc and p.proc.returncode not in (0,)]
        if failed and stopped == "exited":
            echo(f"ddp: ranks {failed} failed; see {root}/peer-NN.log")
    finally:
        peers.stop()
    return {"launch_t": launch, "stopped": stopped, "metrics": "ddp/peer-NN.jsonl"}


def _reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def _supervise(system, options, peers: Peers, meter, faults, echo, reached, progress, *,
               first_step, stop_at_duration: bool, launch: float) -> str:  # fmt: skip
    """Watch one system until its target, its duration, or its processes' exit.

    Returns why it stopped: "target", "duration", "exited".
    """
    sc = options.scenario
    start, last_line = None, 0.0
    samples = open(options.out / f"bytes-{system}.jsonl", "w")
    base = meter.total()
    with samples:
        while True:
            now = time.time()
            if start is None and first_step():
                start = now
                echo(f"{system}: training started {now - launch:.1f} s after launch")
            if start is None and now - launch > STARTUP_TIMEOUT_S:
                raise TestbedError(f"{system}: no peer took a step in {STARTUP_TIMEOUT_S:g} s")
            if start is not None:
                faults.apply_due(now - start, peers, wall_t=now)
            total = meter.total()
            if total is not None and base is not None:
                samples.write(json.dumps({"t": now, "bytes": total - base}) + "\n")
            if now - last_line >= options.progress_every_s:
                last_line = now
                echo(_progress_line(system, now - launch, progress(), total, base))
            if reached():
                return "target"
            if stop_at_duration and start is not None and now - start >= sc.duration_s:
                return "duration"
            if start is not None and now - start >= sc.duration_s + 120:
                return "deadline"  # the baseline overran its own duration by far: stop it
            if not peers.running():
                return "exited"
            time.sleep(0.25)


def _progress_line(system: str, elapsed: float, states, total, base) -> str:
    parts = []
    for i, st in enumerate(states):
        if st is None:
            parts.append(f"p{i} -")
        else:
            metric = "-" if st[1] is None else f"{st[1]:.3f}"
            parts.append(f"p{i} {st[0]} {metric}")
    sent = "" if total is None or base is None else f" | {(total - base) / 1e6:.2f} MB sent"
    return f"[{system:8s} {elapsed:6.1f}s] step metric: " + ", ".join(parts) + sent


def _final_consensus(root: Path, n: int) -> float | None:
    """Mean relative squared distance of the peers' final checkpoints to their mean."""
    from geotrain.gossip import consensus_distance  # torch: only now, never at import time
    from geotrain.node.state import CheckpointStore

    models = []
    for i in range(n):
        with contextlib.suppress(Exception):  # a peer without a readable checkpoint is skipped
            ckpt, _ = CheckpointStore(StateDir(root / f"peer-{i:02d}").checkpoints).load_latest()
            if ckpt is not None:
                models.append({k: v for k, v in ckpt.tensors.items() if k.startswith("model/")})
    return consensus_distance(models, relative=True) if len(models) >= 2 else None


def _plot(out: Path, echo: Echo) -> None:
    from ._plots import render_plots

    for path in render_plots(out):
        echo(f"plot: {path}")


__all__ = ["BackendChoice", "RunOptions", "TestbedError", "run_testbed"]
