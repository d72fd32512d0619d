# The testbed orchestrator: namespaces and emulated links, then the geotrain swarm, then each
# baseline (DDP, local SGD, hivemind) over the same links (one after the other: they would compete
# for the same cores), then run.json, summary.json, plots and the table. Invariants: every
# namespace, device and process it makes is gone when `run_testbed` returns or raises
# (KeyboardInterrupt included: the CLI turns SIGTERM into one); times are wall-clock (time.time())
# so they compare with the peers' metrics lines; t = 0 of a system is when its first peer took its
# first step; bytes are measured (emulator or interface counters, else the nodes' own counters),
# never computed.
from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from collections.abc import Callable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geotrain.node import ForkServer, ManagedProcess, config_to_toml
from geotrain.node.state import StateDir

from ._availability import AvailabilityRunner, availability_json
from ._baselines import BASELINES, baseline_settings, describe, parse_baselines
from ._faults import FaultRunner
from ._linkcheck import bulk_bytes_for, measure_link
from ._meter import BytesMeter
from ._namespaces import NamespaceSet
from ._nat import NatFirewall, NatUnavailable, check_nat_possible
from ._netem import BackendChoice, NetemLinks, choose_backend
from ._peers import (
    DDP_PORT,
    HIVEMIND_PORT,
    NODE_PORT,
    Host,
    Peers,
    TestbedError,
    child_env,
    ddp_argv,
    free_port,
    hivemind_argv,
    hosts_for,
    last_json_line,
    read_json,
    start_node,
    wait_for_address,
    write_swarm_files,
)
from ._rundir import write_json
from ._scenario import TestbedScenario
from ._summary import at_or_past, build_summary, load_jsonl, render_table, train_start
from ._userspace import UserspaceLinks

STARTUP_TIMEOUT_S = 180.0  # launch -> first step, 2 cores shared by every peer's torch import
LINK_CHECK_SECONDS = 1.0
LINK_CHECK_MAX_BYTES = 96 << 20

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
        baseline: the systems to compare with, comma-separated (ddp, hivemind, hivemind-local)
            or "none"; each runs after geotrain, alone, on the same links.
        baseline_set: `NAME.KEY=VALUE` changes to a baseline's preset (_baselines.PRESETS).
        link_check: measure RTT and throughput of each region pair before training.
        eval_every: steps between a geotrain node's evaluations (a node takes hundreds of steps
            a second on small tasks: every 20 steps is a few times a second).
        ddp_eval_every: the same for DDP ranks. Every step by default: a DDP step over WAN links
            takes seconds, and evaluating every 20 would blur its time to target by minutes.
        eval_every_s: every system (geotrain's nodes and every baseline's workers) also
            evaluates once this many seconds have passed since its last evaluation. With
            compute emulation a step is a second or more, and 20 of a 4x straggler's steps are
            80 s: a time to a quality level would be known only to within that (0: off).
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
    baseline_set: tuple[str, ...] = ()
    metric: str = "accuracy"
    higher_is_better: bool = True
    link_check: bool = True
    eval_every: int = 20
    ddp_eval_every: int = 1
    eval_every_s: float = 10.0
    progress_every_s: float = 5.0
    node_overrides: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    cwd: str | None = None

    def __post_init__(self) -> None:
        # Every path handed to a peer is absolute: a peer's config resolves relative paths
        # against the config file's own folder, which would apply a relative `out` twice.
        object.__setattr__(self, "out", Path(self.out).expanduser().resolve())
        baselines = parse_baselines(self.baseline)
        object.__setattr__(self, "baselines", baselines)
        object.__setattr__(self, "baseline_settings",
                           baseline_settings(baselines, self.baseline_set))  # fmt: skip
        for item in self.node_overrides:
            key = item.partition("=")[0]
            if "=" not in item or "." not in key:
                raise ValueError(f"--node-set {item!r}: expected section.key=value")
        for name in ("eval_every", "ddp_eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunOptions.{name}={getattr(self, name)!r}: expected >= 1")
        if not 0 <= self.eval_every_s <= 86_400:
            raise ValueError(f"--eval-every-s {self.eval_every_s!r} (RunOptions.eval_every_s): "
                             "expected seconds, 0..86400")  # fmt: skip


# What one peer's process holds at least (the interpreter, torch, the node) beyond the pages
# they share: a floor, so only a run that cannot fit is refused (a bigger task needs more).
PEER_FLOOR_GB = 0.15


def available_memory_gb() -> float | None:
    """MemAvailable from /proc/meminfo, or what this cgroup's memory.max leaves if less (a
    container's limit), in GB (None where neither says)."""
    found: list[float] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 / 1e9 for line in f
                      if line.startswith("MemAvailable:")]  # fmt: skip
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(max(0, int(limit) - used) / 1e9)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_memory_for(peers: int) -> None:
    """Refuse a run whose peers cannot all fit this machine's memory (each a process of its
    own), before anything is made: 200 peers started 200 processes and ran the box out."""
    available = available_memory_gb()
    if available is not None and peers * PEER_FLOOR_GB > available:
        fits = int(available / PEER_FLOOR_GB)
        raise TestbedError(
            f"{peers} peers need at least {peers * PEER_FLOOR_GB:.1f} GB ({PEER_FLOOR_GB} GB "
            f"per node process, more for a bigger model); this machine has {available:.1f} GB "
            "available: " + (f"--peers {fits} at most" if fits >= 2 else "not even 2 fit"))


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
    check_node_config(options)
    check_memory_for(sc.n_peers)
    choice = choose_backend(options.emulation, access_links=bool(sc.matrix().access))
    if choice.user_namespace:
        why = "not root, and running peers in an unprivileged user namespace is not built yet"
        if options.emulation != "auto":
            raise TestbedError(f"--emulation {options.emulation}: {why}; run as root")
        choice = BackendChoice("none", f"NO LINK EMULATION: {why}; peers talk over plain loopback")
    if choice.backend != "none":
        try:  # (before the namespaces and the output directory: it took 4 s to be told)
            check_nat_possible(sc.nat)
        except NatUnavailable as exc:
            raise TestbedError(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    echo(f"emulation: {choice.backend} ({choice.reason})")
    if sc.rate_scale != 1.0:
        echo(f"NOTE: link rates scaled to {sc.rate_scale:g}x the published figures")
    write_json(out / "scenario.json", sc.to_json())
    run: dict[str, Any] = {
        "scenario": sc.name, "emulation": choice.backend, "emulation_reason": choice.reason,
        "peers": sc.n_peers, "task": sc.task, "params": dict(sc.params),
        "algorithm": sc.algorithm, "target_value": options.target, "metric": options.metric,
        "higher_is_better": options.higher_is_better, "rate_scale": sc.rate_scale,
        "duration_s": sc.duration_s, "systems": {}, "faults": [], "links": [],
        "node_overrides": list(options.node_overrides),
        "command": list(options.command), "cwd": options.cwd,
        "partition": sc.partition, "alpha": sc.alpha, "availability": availability_json(sc),
        "step_ms": sc.step_ms, "slowdowns": [sc.slowdown(i) for i in range(sc.n_peers)],
        "eval_every_s": options.eval_every_s,  # (what the times to a level are known within)
        # geotrain's attacker peers: left out of every quality figure (the summary)
        "attackers": {str(p): k for p, k in sorted(sc.attackers.items())},
    }  # fmt: skip
    try:
        _run_systems(options, run, choice, echo)
    except BaseException as exc:  # Ctrl-C, SIGTERM, a failed peer: keep what finished
        _stopped_early(options, run, exc, echo)
        raise
    run["consensus_distance_final"] = _final_consensus(
        out / "geotrain", sc.n_peers, set(sc.attackers))
    write_json(out / "run.json", run)
    summary = build_summary(out)
    write_json(out / "summary.json", summary)
    _plot(out, echo)
    echo(render_table(summary))
    return summary


def _stopped_early(options: RunOptions, run: dict[str, Any], exc: BaseException,
                   echo: Echo) -> None:  # fmt: skip
    """A run stopped before its end: run.json records the systems that finished and the one
    that was running (`stopped`: "interrupted", its figures up to the stop), and the summary of
    those is written and printed, so a long run cut short still says what it measured."""
    out = options.out
    run["interrupted"] = (f"{type(exc).__name__}: {exc}"[:300] if str(exc)
                          else type(exc).__name__)  # (Ctrl-C's has no message)
    running = run.pop("in_progress", None)
    done = ", ".join(run["systems"]) or "none"
    if running is not None:  # (a user's stop, or a failure of the system itself)
        how = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        run["systems"][running["system"]] = {"launch_t": running["launch_t"], "stopped": how}
    if run["systems"]:
        run["consensus_distance_final"] = None
    write_json(out / "run.json", run)  # (first: a second Ctrl-C)
    if "geotrain" in run["systems"]:
        with contextlib.suppress(Exception):  # (the nodes' checkpoints at their stop)
            run["consensus_distance_final"] = _final_consensus(
                out / "geotrain", options.scenario.n_peers, set(options.scenario.attackers))
            write_json(out / "run.json", run)
    stopped = f"; stopped while it ran: {running['system']}" if running is not None else ""
    echo(f"run stopped early ({run['interrupted']}); run.json records the systems that "
         f"finished: {done}{stopped}")  # fmt: skip
    if not run["systems"] or not run.get("links"):
        return
    try:
        summary = build_summary(out)
    except Exception as problem:  # (a partial run: nothing more to say than run.json does)
        echo(f"no summary of the part that ran: {type(problem).__name__}: {problem}")
        return
    write_json(out / "summary.json", summary)
    echo("what ran, up to the stop (`geotrain testbed report` renders it again, with plots):")
    echo(render_table(summary))


def _run_systems(options: RunOptions, run: dict[str, Any], choice: BackendChoice,
                 echo: Echo) -> None:  # fmt: skip
    """geotrain, then each baseline, in the emulated network; their records go into `run`."""
    sc = options.scenario
    with contextlib.ExitStack() as stack:
        namespaces = links = None
        if choice.backend != "none":
            namespaces = stack.enter_context(NamespaceSet(sc.n_peers))
            echo(f"namespaces: {namespaces.run_prefix}p00..p{sc.n_peers - 1:02d}")
            emulator = UserspaceLinks if choice.backend == "userspace" else NetemLinks
            links = stack.enter_context(emulator(namespaces, sc.matrix()))
        nat = _enter_nat(stack, namespaces, sc, echo)
        hosts = hosts_for(namespaces, sc.n_peers, choice.backend)
        # the nodes and DDP's ranks fork from one warm process: each starts in ~0.1 s of CPU
        # instead of ~4 s of importing torch, which on a few shared cores delayed a system's
        # start by peers x 4 s (the ranks' start is not DDP's to pay either)
        fork = stack.enter_context(ForkServer(child_env()))
        if options.link_check and namespaces is not None:
            run["links"] = _check_links(namespaces, sc, echo)
        else:
            run["links"] = _spec_links(sc)
        meter = BytesMeter(choice.backend, links, namespaces, hosts)
        run["bytes_source"] = meter.source
        faults = FaultRunner(sc, links, echo)
        run["faults"] = faults.applied_all  # (kept up to date: a run stopped early has them)
        run["in_progress"] = {"system": "geotrain", "launch_t": time.time()}
        run["systems"]["geotrain"] = _run_geotrain(options, hosts, meter, faults, echo, fork)
        del run["in_progress"]
        faults.reset()
        run["nat"] = _leave_nat(nat, sc, echo)
        if sc.availability and options.baselines:
            echo(f"NOTE: {run['availability']['note']}")
        for baseline in options.baselines:
            faults = FaultRunner(sc, links, echo, system=baseline, applied=faults.applied_all)
            run["faults"] = faults.applied_all
            run["in_progress"] = {"system": baseline, "launch_t": time.time()}
            if baseline in ("ddp", "localsgd"):
                run["systems"][baseline] = _run_ddp(
                    options, hosts, meter, faults, echo, baseline, fork
                )
            else:
                run["systems"][baseline] = _run_hivemind(
                    baseline, options, hosts, meter, faults, echo
                )
            del run["in_progress"]
            faults.reset()
        run["faults"] = faults.applied_all


def _enter_nat(stack, namespaces, sc: TestbedScenario, echo: Echo) -> NatFirewall | None:
    """Put scenario.nat's peers behind NAT (their namespace drops inbound connections)."""
    if not sc.nat:
        return None
    if namespaces is None:
        echo(f"NOTE: peers {list(sc.nat)} run in client mode, but WITHOUT a NAT firewall: "
             "there are no namespaces on plain loopback")  # fmt: skip
        return None
    try:
        nat = stack.enter_context(NatFirewall(namespaces, sc.nat))
    except NatUnavailable as exc:
        raise TestbedError(str(exc)) from None
    echo(f"nat: peers {list(sc.nat)} drop inbound connections and run in client mode")
    return nat


def _leave_nat(nat: NatFirewall | None, sc: TestbedScenario, echo: Echo) -> dict[str, Any]:
    """What the NAT firewall saw during geotrain's run; the baselines run without it (DDP's gloo
    connects every rank to every other and cannot run behind NAT)."""
    if nat is None:
        return {"peers": list(sc.nat), "firewall": False, "inbound_attempts": {}}
    attempts = nat.inbound_attempts()
    nat.lift()
    echo(f"nat: inbound connection attempts dropped during geotrain's run: {attempts}")
    return {"peers": list(sc.nat), "firewall": True,
            "inbound_attempts": {str(p): n for p, n in attempts.items()}}  # fmt: skip


def _link_pairs(matrix) -> dict[tuple[str, str], tuple[int, int]]:
    """The peer pair that stands for each ordered region pair (none inside a one-peer region)."""
    members: dict[str, list[int]] = {}
    for i, region in enumerate(matrix.peer_regions):
        members.setdefault(region, []).append(i)
    pairs = {}
    for a, b in matrix.links:
        if a == b and len(members[a]) < 2:
            continue  # a region with one peer has no link inside it
        pairs[(a, b)] = (members[a][0], members[b][1] if a == b else members[b][0])
    return pairs


def _spec_links(sc: TestbedScenario) -> list[dict[str, Any]]:
    """Each ordered region pair's spec end to end (the access links of the peers that stand for
    it included: what a flow between them should measure)."""
    matrix, out = sc.matrix(), []
    pairs = _link_pairs(matrix)
    for (a, b), spec in matrix.links.items():
        if (a, b) in pairs:
            spec = matrix.path_spec(*pairs[(a, b)])
        out.append({
            "src": a, "dst": b, "spec_rtt_ms": 2 * spec.delay_ms, "measured_rtt_ms": None,
            "spec_mbit": spec.rate_mbit, "measured_mbit": None,
        })  # fmt: skip
    return out


def _check_links(namespaces: NamespaceSet, sc: TestbedScenario, echo: Echo) -> list[dict]:
    """Measure one peer pair per ordered region pair (a region with one peer has no inner link)."""
    pairs = _link_pairs(sc.matrix())
    results = _spec_links(sc)
    for item in results:
        if (item["src"], item["dst"]) not in pairs:
            continue
        src, dst = pairs[(item["src"], item["dst"])]
        size = min(
            LINK_CHECK_MAX_BYTES,
            bulk_bytes_for(item["spec_mbit"], LINK_CHECK_SECONDS, item["spec_rtt_ms"]),
        )
        try:
            m = measure_link(namespaces, src, dst, bulk_bytes=size)
        except RuntimeError as exc:  # a very lossy link can time the check out: say so, go on
            item.update(src_peer=src, dst_peer=dst, check_error=str(exc)[:300])
            echo(f"link {item['src']} -> {item['dst']}: not measured ({exc}); the run goes on")
            continue
        item.update(src_peer=src, dst_peer=dst, measured_rtt_ms=round(m.measured_rtt_ms, 2),
                    measured_mbit=round(m.measured_mbit, 1), check_bytes=size)  # fmt: skip
        echo(
            f"link {item['src']} -> {item['dst']}: RTT {m.measured_rtt_ms:.1f} ms "
            f"(spec {item['spec_rtt_ms']:g}), {m.measured_mbit:.0f} Mbit/s "
            f"(spec {item['spec_mbit']}, {size >> 20} MiB transfer)"
        )
    return results


def check_node_config(options: RunOptions) -> None:
    """The geotrain nodes' config (the scenario's algorithm and task, --node-set), checked before
    anything starts: a bad one failed only once the namespaces and the first node existed, and
    the message named the node's config file instead of the scenario.

    Raises:
        TestbedError: the config a node would get is refused; the message names the field.
    """
    from geotrain.node import ConfigError, config_from_toml

    where = options.out / "peer-00"  # (nothing is read or written there)
    files = (where / "identity.key", where / "certificate.json", where / "swarm.json")
    doc = _node_config(options, Host(0, "127.0.0.1", "lo"), files, where / "state", [])
    try:
        config_from_toml(config_to_toml(doc), base=options.out,
                         overrides=list(options.node_overrides))  # fmt: skip
    except ConfigError as exc:
        raise TestbedError(f"the geotrain nodes' config (scenario, --node-set): {exc}") from None


def _node_config(options: RunOptions, host, files, state: Path, bootstrap: list[str]) -> dict:
    sc = options.scenario
    key, cert, swarm = files
    network: dict[str, Any] = {"bootstrap": bootstrap}
    if host.index in sc.nat:  # behind NAT: a client, dialled by nobody, listening on loopback only
        network.update(listen="tcp://127.0.0.1:0", reachable=False)
    elif host.fixed_port:  # its own namespace and address: a known port
        network["listen"] = network["advertise"] = f"tcp://{host.address}:{NODE_PORT}"
    else:  # shared loopback: the node picks a free port and advertises what it got
        network["listen"] = f"tcp://{host.address}:0"
    return {
        "identity": {"key": key, "certificate": cert, "swarm": swarm},
        "network": network,
        "training": {
            "task": sc.task, "params": dict(sc.params), "seed": 0, "shard_index": host.index,
            "num_shards": sc.n_peers, "wait_for_peers": sc.n_peers - 1,
            "eval_every": options.eval_every, "eval_every_s": options.eval_every_s,
            "slowdown": sc.slowdown(host.index), "threads": 1,
            "step_time_ms": sc.step_ms, "partition": sc.partition, "alpha": sc.alpha,
        },
        # state_sync off: every peer starts from the same seeded model, as the DDP ranks do (a
        # restarted peer resumes from its own checkpoint either way)
        "gossip": {"algorithm": sc.algorithm, "state_sync": False},
        # (the summary reads each peer's whole metrics.jsonl: never rotated, however long the run)
        "state": {"dir": state, "status_every_s": 1.0, "metrics_max_mb": 1e6},
    }  # fmt: skip


def _run_geotrain(options, hosts, meter: BytesMeter, faults: FaultRunner, echo: Echo,
                  fork: ForkServer) -> dict:  # fmt: skip
    from ._attacker import start_attacker

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
            kind = sc.attackers.get(host.index)  # [[attackers]]: the testbed's attacker process
            proc = peers.add(
                start_node(host, config, state, options.node_overrides, fork) if kind is None
                else start_attacker(host, config, state, options.node_overrides, kind, sc)
            )  # fmt: skip
            if host.index == 0:
                bootstrap = [wait_for_address(0, proc)]
        # a peer rejoining from its window waits for one peer (peer 0 never leaves), not for
        # the whole swarm: about half of it may be away
        rejoin = (*options.node_overrides, "training.wait_for_peers=1")
        availability = AvailabilityRunner(
            sc, echo, faults.applied_all, join=lambda i: peers.procs[i].restart_with(*rejoin))
        windowed = {w.peer for w in sc.availability}

        def statuses() -> list[dict | None]:
            return [read_json(StateDir(s).status) for s in states]

        def reached() -> bool:
            if any(not p.running and faults.restart_pending(i) for i, p in enumerate(peers.procs)):
                return False  # a killed peer comes back: the swarm is not done without it
            return swarm_at_target(peers, statuses(), windowed, availability.away(),
                                   options.target, options.higher_is_better,
                                   attackers=set(sc.attackers))  # fmt: skip

        def progress() -> list[tuple[int, float | None] | None]:
            return [
                (st["step"], st.get("metric")) if st else None for st in statuses()
            ]

        stopped = _supervise(
            "geotrain", options, peers, meter, faults, echo, reached, progress,
            first_step=lambda: first_step_began([StateDir(s).metrics for s in states]),
            stop_at_duration=True, launch=launch, availability=availability,
        )  # fmt: skip
    finally:
        peers.stop()
    return {"launch_t": launch, "stopped": stopped, "metrics": "geotrain/peer-NN/metrics.jsonl"}


def _run_ddp(options, hosts, meter: BytesMeter, faults: FaultRunner, echo: Echo,
             name: str = "ddp", fork: ForkServer | None = None) -> dict:  # fmt: skip
    """DDP (`name` ddp) or DDP's ranks doing local SGD (`name` localsgd); the ranks fork from
    `fork` when given (fresh Pythons otherwise)."""
    sc, root = options.scenario, options.out / name
    root.mkdir()
    settings = dict(options.baseline_settings[name])
    period = settings["period"] if name == "localsgd" else 0
    # a port of its own per baseline: the previous one's rendezvous may linger in TIME_WAIT
    port = DDP_PORT + BASELINES.index(name) if hosts[0].fixed_port else free_port()
    master = f"{hosts[0].address}:{port}"
    files = [root / f"peer-{h.index:02d}.jsonl" for h in hosts]
    peers = Peers()
    how = f"local SGD, parameters averaged every {period} steps" if period else "all-reduce"
    echo(f"{name}: starting {sc.n_peers} gloo workers ({how}; same task, shards, slowdowns, links)")
    launch = time.time()
    try:
        for host, metrics in zip(hosts, files, strict=True):
            argv = ddp_argv(
                rank=host.index, world=sc.n_peers, master=master, task=sc.task,
                params=dict(sc.params), seed=0, slowdown=sc.slowdown(host.index),
                duration=sc.duration_s, target=options.target, metrics=metrics, system=name,
                step_ms=sc.step_ms,
                # local steps are as fast as a node's: evaluated as often as a node evaluates
                eval_every=options.eval_every if period else options.ddp_eval_every,
                eval_every_s=options.eval_every_s,
                local_sgd_period=period, partition=sc.partition, alpha=sc.alpha,
                lr=settings["lr"],
            )  # fmt: skip
            env = child_env({"GLOO_SOCKET_IFNAME": host.ifname})
            peers.add(ManagedProcess(argv, metrics.with_suffix(".log"), env, host.prefix,
                                     fork_server=fork or False)).start()  # fmt: skip

        def progress() -> list[tuple[int, float | None] | None]:
            lines = [last_json_line(f) for f in files]
            return [(r["step"], r.get("metric")) if r else None for r in lines]

        def failed_ranks() -> list[int]:
            return [i for i, p in enumerate(peers.procs)
                    if p.proc and p.proc.returncode not in (0,)]  # fmt: skip

        def exited_as() -> str:
            """The ranks' own stop rule ended them at the target, as a geotrain swarm stops
            ("exited" said the two systems ended for different reasons), or otherwise."""
            at_target = not failed_ranks() and all(
                r is not None and r.get("metric") is not None
                and at_or_past(r["metric"], options.target, options.higher_is_better)
                for r in (last_json_line(f) for f in files)
            )  # fmt: skip
            return "target" if at_target else "exited"

        stopped = _supervise(
            name, options, peers, meter, faults, echo, reached=lambda: False,
            progress=progress, first_step=lambda: first_step_began(files),
            stop_at_duration=False, launch=launch, exited_as=exited_as,
        )  # fmt: skip
        # (stopped by the supervisor, the duration or an interruption, no rank failed)
        failed = failed_ranks() if stopped == "exited" else []
        if failed:
            echo(f"{name}: ranks {failed} failed; see {root}/peer-NN.log (its figures are up "
                 "to there)")  # fmt: skip
    finally:
        peers.stop()
    return {"launch_t": launch, "stopped": stopped, "metrics": f"{name}/peer-NN.jsonl",
            "algorithm": describe(name, settings), "settings": settings,
            "failed_peers": failed}  # fmt: skip


def _run_hivemind(name: str, options, hosts, meter: BytesMeter, faults: FaultRunner,
                  echo: Echo) -> dict:  # fmt: skip
    """One hivemind baseline (`name` is hivemind or hivemind-local): a worker per peer, peer 0's
    DHT the bootstrap, stopped like the geotrain swarm (every peer at the target, or the
    duration)."""
    sc, root = options.scenario, options.out / name
    settings = dict(options.baseline_settings[name])
    (root / "dht").mkdir(parents=True)
    files = [root / f"peer-{h.index:02d}.jsonl" for h in hosts]
    peers = Peers()
    mode = "local updates" if settings["use_local_updates"] else "synchronous averaging"
    echo(f"{name}: starting {sc.n_peers} hivemind.Optimizer workers ({mode}; same task, shards, "
         "slowdowns, links)")  # fmt: skip
    launch = time.time()
    try:
        for host, metrics in zip(hosts, files, strict=True):
            argv = hivemind_argv(
                rank=host.index, world=sc.n_peers, host=host.address,
                port=HIVEMIND_PORT if host.fixed_port else 0, maddrs_dir=root / "dht",
                run_id=f"{name}-{int(launch)}", settings=settings, system=name, task=sc.task,
                params=dict(sc.params), seed=0, slowdown=sc.slowdown(host.index),
                duration=sc.duration_s, eval_every=options.eval_every,
                eval_every_s=options.eval_every_s, metrics=metrics,
                step_ms=sc.step_ms, partition=sc.partition, alpha=sc.alpha,
            )  # fmt: skip
            proc = ManagedProcess(argv, metrics.with_suffix(".log"), child_env(), host.prefix)
            peers.add(proc).start()

        def lines() -> list[dict | None]:
            return [last_json_line(f) for f in files]

        def reached() -> bool:
            if any(not p.running and faults.restart_pending(i) for i, p in enumerate(peers.procs)):
                return False  # a killed peer comes back: the swarm is not done without it
            live = [(p, r) for p, r in zip(peers.procs, lines(), strict=True) if p.running]
            return len(live) > 0 and all(
                r is not None and r.get("metric") is not None
                and r.get("pid") == p.proc.pid  # a line of this process, not of a killed one
                and at_or_past(r["metric"], options.target, options.higher_is_better)
                for p, r in live
            )  # fmt: skip

        def progress() -> list[tuple[int, float | None] | None]:
            return [(r["step"], r.get("metric")) if r else None for r in lines()]

        stopped = _supervise(
            name, options, peers, meter, faults, echo, reached, progress,
            first_step=lambda: first_step_began(files),
            stop_at_duration=True, launch=launch,
        )  # fmt: skip
        if stopped == "exited":
            echo(f"{name}: every worker exited; see {root}/peer-NN.log")
    finally:
        peers.stop()
    first = last_json_line(files[0]) or {}
    settings["target_batch_size"] = first.get("target_batch_size", settings["target_batch_size"])
    return {"launch_t": launch, "stopped": stopped, "metrics": f"{name}/peer-NN.jsonl",
            "algorithm": describe(name, settings), "settings": settings}  # fmt: skip


def swarm_at_target(peers: Peers, statuses: list[dict | None], windowed: set[int],
                    away: frozenset[int], target: float, higher_is_better: bool,
                    attackers: Set[int] = frozenset()) -> bool:  # fmt: skip
    """Whether every honest geotrain peer is at the target: a running peer by its current
    process's status; a peer with availability windows (`windowed`) that is away, or rejoining
    and not reporting yet, by the metric it left with (as the summary's time to target counts
    it); a peer that stopped otherwise (killed, crashed) is not counted, nor is an attacker.

    Args:
        peers: the swarm's processes; statuses: each peer's status.json (None: none yet).
        away: the peers their windows took out and have not brought back.
        attackers: the peers running the testbed's attacker (their metric says nothing).
    """
    counted = []
    for i, (p, st) in enumerate(zip(peers.procs, statuses, strict=True)):
        if i in attackers:
            continue
        if p.running and st and st.get("pid") == p.proc.pid:  # type: ignore[union-attr]
            counted.append(st)
        elif i in windowed and (p.running or i in away):
            counted.append(st or {})
        elif p.running:
            return False  # started, not reporting yet
    return len(counted) > 0 and all(
        st.get("metric") is not None and at_or_past(st["metric"], target, higher_is_better)
        for st in counted
    )


def _supervise(system, options, peers: Peers, meter, faults, echo, reached, progress, *,
               first_step: Callable[[], float | bool | None], stop_at_duration: bool,
               launch: float, availability: AvailabilityRunner | None = None,
               exited_as: Callable[[], str] = lambda: "exited") -> str:  # fmt: skip
    """Watch one system until its target, its duration, or its processes' exit (faults and, for
    geotrain, availability windows applied on the way). `exited_as`: why the processes ended
    by themselves (a baseline's ranks stop at the target by their own rule).

    Returns why it stopped: "target", "duration", "exited" (or what `exited_as` said).
    """
    sc = options.scenario
    start, last_line = None, 0.0  # start: when the first step began (the summary's t0)
    samples = open(options.out / f"bytes-{system}.jsonl", "w")
    base = meter.total()
    told: set[int] = set()  # pids of failed processes already reported
    with samples:
        while True:
            now = time.time()
            began = first_step() if start is None else None
            if began:  # (True: now; a time: from the metrics, before the line that showed it)
                start = now if began is True else max(launch, min(now, began))
                echo(f"{system}: training started {start - launch:.1f} s after launch")
            failed = _failed_exits(system, peers, told, echo)
            if start is None and failed:  # (the others would wait for it until the timeout)
                # (a peer's first steps show in its status a moment later: one that failed at
                # step 50 may have been seen at none; "before training started" misled)
                raise TestbedError(f"{system}: {failed[0]}, before the run had seen any peer "
                                   "take a step")  # fmt: skip
            if start is None and now - launch > STARTUP_TIMEOUT_S:
                raise TestbedError(f"{system}: no peer took a step in {STARTUP_TIMEOUT_S:g} s")
            if start is not None:
                faults.apply_due(now - start, peers, wall_t=now)
                if availability is not None:
                    availability.apply_due(now - start, peers, wall_t=now)
            total = meter.total()
            if total is not None and base is not None:
                samples.write(json.dumps({"t": now, "bytes": total - base}) + "\n")
            if now - last_line >= options.progress_every_s:
                last_line = now
                echo(_progress_line(system, now - launch, progress(), total, base))
            stopped = None
            if reached():
                stopped = "target"
            elif stop_at_duration and start is not None and now - start >= sc.duration_s:
                stopped = "duration"
            elif start is not None and now - start >= sc.duration_s + 120:
                stopped = "deadline"  # the baseline overran its own duration by far: stop it
            elif not peers.running():
                stopped = exited_as()
            if stopped is not None:
                faults.not_reached(0.0 if start is None else now - start, stopped)
                return stopped
            time.sleep(0.25)


def first_step_began(files: list[Path]) -> float | None:
    """When a system's first step began (wall time), from the first line with a step of each
    metrics file that has one: its time less its steps at its rate, as the summary's t0 counts
    (geotrain's from its status's first step counted a second or so later). None before
    any line. (The line comes at the end of the step and its evaluation: DDP's first, with the
    all-reduce's connection set up, was 7 s after it began, so faults counted from the line
    came 7 s later into a baseline's run than into geotrain's, on the summary's time axis.)"""
    return train_start([load_jsonl(f) for f in files])  # (read only until a step shows)


def _failed_exits(system: str, peers: Peers, told: set[int], echo: Echo) -> list[str]:
    """Say once for each process that ended by itself with a failure (not stopped or killed by
    the testbed: status 0, SIGTERM or SIGKILL), with its log's last line; return what was said
    now."""
    said = []
    for i, p in enumerate(peers.procs):
        proc = p.proc
        if proc is None or proc.poll() is None or proc.pid in told:
            continue
        told.add(proc.pid)
        if proc.returncode in (0, -signal.SIGTERM, -signal.SIGKILL):
            continue
        lines = [line for line in p.log_tail(4000).splitlines() if line.strip()]
        last = lines[-1].strip()[:300] if lines else "(its log is empty)"
        said.append(f"peer {i} exited with status {proc.returncode}: {last} (log {p.log})")
        echo(f"{system}: {said[-1]}")
    return said


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


def _final_consensus(root: Path, n: int, attackers: set[int]) -> float | None:
    """Mean relative squared distance of the honest peers' final checkpoints to their mean."""
    from geotrain.node.state import CheckpointStore  # torch: only now, never at import time

    models: list[dict] = []
    for i in range(n):
        if i in attackers:
            continue
        with contextlib.suppress(Exception):  # a peer without a readable checkpoint is skipped
            ckpt, _ = CheckpointStore(StateDir(root / f"peer-{i:02d}").checkpoints).load_latest()
            if ckpt is not None:
                models.append({k: v for k, v in ckpt.tensors.items() if k.startswith("model/")})
    shapes = {tuple((k, tuple(v.shape)) for k, v in sorted(m.items())) for m in models}
    if len(models) < 2 or len(shapes) > 1:  # (peers of other models have no consensus)
        return None
    return consensus_of_finite(models)


def consensus_of_finite(models: list[dict]) -> float | None:
    """`consensus_distance` (relative) without the tensors that are the same constant in every
    model and hold values that are not finite (a causal mask of -inf, as the charlm task keeps
    among its buffers), which would make every figure NaN. None when a peer's tensor is not
    finite otherwise (its weights diverged) or nothing is left, so run.json never holds a NaN."""
    from geotrain.gossip import all_finite, consensus_distance

    kept = []
    for name, first in models[0].items():
        if all(all_finite(m[name]) for m in models):
            kept.append(name)
        elif not all(_same_values(first, m[name]) for m in models[1:]):
            return None
    if not kept:
        return None
    distance = consensus_distance([{n: m[n] for n in kept} for m in models], relative=True)
    return distance if math.isfinite(distance) else None


def _same_values(a, b) -> bool:
    """Whether two tensors are equal element by element, NaN equal to NaN."""
    import torch

    if a.shape != b.shape:
        return False
    a, b = a.float(), b.float()  # (peers may hold a constant in different precisions)
    return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def _plot(out: Path, echo: Echo) -> None:
    from ._plots import render_plots

    for path in render_plots(out):
        echo(f"plot: {path}")


__all__ = ["BackendChoice", "RunOptions", "TestbedError", "run_testbed"]
