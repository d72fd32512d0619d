# `geotrain testbed run --clock virtual`: the scenario in one process on virtual time. Invariants:
# every peer's model math runs for real (forward, backward, optimizer, codecs, checks, mixing) and
# so does every message, through the daemon's own membership and algorithm code; time, though,
# comes from the scenario alone: a step costs the peer's compute profile (step_ms x its slowdown,
# with seeded jitter), a message what its links give it (testbed/_vnet.py), an evaluation nothing
# (it is the measurement, not training); the run directory has the real testbed's layout, so the
# summary, the report and `testbed compare` read it unchanged; the same scenario and seed give the
# same figures bit for bit (trio's scheduler and every RNG are seeded, no thread runs, no figure
# reads the machine's clock).
from __future__ import annotations

import contextlib
import copy
import hashlib
import heapq
import itertools
import json
import math
import random
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog
import torch
import trio
import trio.testing

from geotrain.node import EvalCadence, config_from_toml, config_to_toml
from geotrain.node.identity import peer_id_from_public_key
from geotrain.node.state import StateDir
from geotrain.node.testing import header_codec, peer_parts
from geotrain.node.training import TaskContext, Trainer, resolve_task

from ._allreduce import ALGORITHMS, allreduce_cost, gloo_ddp_startup_bytes
from ._availability import availability_json
from ._ddp import STOP_CHECK_EVERY, task_optimizer
from ._faults import FaultRunner
from ._run import RunOptions, TestbedError, consensus_of_finite
from ._rundir import write_json
from ._summary import at_or_past, build_summary, render_table
from ._vnet import VirtualNetwork, peer_address

DEFAULT_STEP_MS = 100.0  # a step's cost when the scenario gives no compute profile (said)
VIRTUAL_BASELINES = ("ddp", "localsgd", "ideal")
STATUS_EVERY_S = 1.0  # a peer's metrics line, as a testbed node writes one a second
SAMPLE_EVERY_S = 0.25  # the bytes meter's samples, as the real testbed's supervisor takes them
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default
BACKWARD_SHARE = 2 / 3  # of a step's compute: the backward pass, which DDP's buckets overlap
STOP_FLAGS_BYTES = 12  # the real testbed DDP worker's stop-rule all-reduce: 3 float32 flags
TIE_BREAK_S = 1e-7  # peer i's step costs i x this more: no two peers' steps end at one instant
FINISH_S = 600.0  # virtual seconds a peer gets, once stopped, for its step, exchange, evaluation
PARTNERS = ("policy", "oracle")
# the oracle's partners of a peer: those whose exchange costs at most this many times its
# cheapest one (a near region's peers, not a continent away)
ORACLE_SPREAD = 2.0


@dataclass(frozen=True)
class VirtualOptions:
    """What only a virtual-time run has.

    Attributes:
        seed: seeds trio's scheduler, the jitter and each peer's Random (the models and data
            are seeded by the task, as in a real run).
        step_jitter: each step's cost is drawn uniformly from step x (1 +- this).
        mtu: the path MTU whose TCP/IP headers the byte counts include (1500: the internet's).
        max_steps: stop each system after this many steps of its slowest peer (0: no limit):
            for systems figures at sizes where reaching a target takes too long.
        allreduce: the DDP baselines' all-reduce: "best" (the faster of a ring and a
            hierarchical one: DDP at its strongest), "ring", "hierarchical", or "testbed": the
            real testbed's DDP as it runs (gloo's ring with its framing, DDP's start-up
            broadcast, and the worker's stop-rule all-reduce after step 1 and every
            STOP_CHECK_EVERY steps or local SGD period), which calibration compares against.
        peer_start_s: when each geotrain peer's process starts, seconds (empty: all at once,
            a microsecond apart): calibration gives a real run's spread (its processes start
            as the machine lets them, and diloco's rounds keep that phase).
        partners: "policy" (gossip.policy chooses) or "oracle": each peer chooses uniformly
            among fixed partners computed offline from the links (oracle_partners), the best
            fixed partners a partner policy is measured against.
    """

    seed: int = 0
    step_jitter: float = 0.02
    mtu: int = 1500
    max_steps: int = 0
    allreduce: str = "best"
    peer_start_s: tuple[float, ...] = ()
    partners: str = "policy"

    def __post_init__(self) -> None:
        if not 0 <= self.step_jitter < 1:
            raise ValueError(f"--step-jitter {self.step_jitter!r}: expected a fraction in [0, 1)")
        if not 576 <= self.mtu <= 65_535:
            raise ValueError(f"--mtu {self.mtu!r}: expected 576..65535 bytes")
        if self.allreduce not in ALGORITHMS:
            raise ValueError(f"--allreduce {self.allreduce!r}: expected one of {ALGORITHMS}")
        if not all(math.isfinite(s) and 0 <= s <= 3600 for s in self.peer_start_s):
            raise ValueError(f"--peer-start-s {self.peer_start_s!r}: expected seconds in "
                             "0..3600")  # fmt: skip
        if self.partners not in PARTNERS:
            raise ValueError(f"--partners {self.partners!r}: expected one of {PARTNERS}")
        if self.max_steps < 0:
            raise ValueError(f"--max-steps {self.max_steps!r}: expected >= 0 (0: no limit)")


def check_virtual(options: RunOptions, virtual: VirtualOptions | None = None) -> None:
    """Refuse what a virtual run does not model, naming it, before anything starts."""
    sc = options.scenario
    starts = len(virtual.peer_start_s) if virtual is not None else 0
    if starts and starts != sc.n_peers:
        raise TestbedError(f"--peer-start-s: {starts} times for {sc.n_peers} peers: expected "
                           "one a peer")  # fmt: skip
    unsupported = [b for b in options.baselines if b not in VIRTUAL_BASELINES]
    if unsupported:
        raise TestbedError(f"--baseline {','.join(unsupported)}: not in virtual time (it has "
                           f"{', '.join(VIRTUAL_BASELINES)}); run hivemind with --clock real")
    if sc.attackers:
        raise TestbedError("scenario.attackers: attackers run only in real time (--clock real)")
    if sc.availability:
        raise TestbedError("scenario.availability: availability windows run only in real time "
                           "(--clock real)")  # fmt: skip
    if sc.nat:
        raise TestbedError("scenario.nat: peers behind NAT run only in real time (--clock real)")


class _Clock:
    """The compute profile: what each peer's step costs, drawn from one seeded stream per peer."""

    def __init__(self, options: RunOptions, virtual: VirtualOptions) -> None:
        sc = options.scenario
        self.step_s = (sc.step_ms or DEFAULT_STEP_MS) / 1000
        self._slowdowns = [sc.slowdown(i) for i in range(sc.n_peers)]
        self._jitter = virtual.step_jitter
        self._seed = virtual.seed

    def stream(self, peer: int, system: str) -> Callable[[], float]:
        rng = random.Random(f"{self._seed}/{system}/{peer}")
        base = self.step_s * self._slowdowns[peer] + peer * TIE_BREAK_S

        def cost() -> float:
            return base * (1 + self._jitter * rng.uniform(-1, 1)) if self._jitter else base

        return cost


def run_virtual(options: RunOptions, virtual: VirtualOptions,
                echo: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Run every system of `options` in virtual time and write the run directory.

    Returns:
        The summary (also written to `out/summary.json`).
    """
    check_virtual(options, virtual)
    sc, out = options.scenario, options.out
    if out.exists() and any(out.iterdir()):
        raise TestbedError(f"--out {str(out)!r}: exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    profile = _Clock(options, virtual)
    reason = (f"virtual time: links and compute modelled from the scenario (steps of "
              f"{profile.step_s * 1000:g} ms x slowdown, jitter +-{virtual.step_jitter:g}; MTU "
              f"{virtual.mtu}); real model math")  # fmt: skip
    echo(f"emulation: virtual ({reason})")
    if not sc.step_ms:
        echo(f"NOTE: the scenario has no compute profile (step_ms): every step costs "
             f"{DEFAULT_STEP_MS:g} ms x its slowdown (--step-ms sets it)")  # fmt: skip
    write_json(out / "scenario.json", sc.to_json())
    run: dict[str, Any] = {
        "scenario": sc.name, "emulation": "virtual", "emulation_reason": reason,
        "peers": sc.n_peers, "task": sc.task, "params": dict(sc.params),
        "algorithm": sc.algorithm, "target_value": options.target, "metric": options.metric,
        "higher_is_better": options.higher_is_better, "rate_scale": sc.rate_scale,
        "duration_s": sc.duration_s, "systems": {}, "faults": [],
        "links": _spec_links(sc), "node_overrides": list(options.node_overrides),
        "command": list(options.command), "cwd": options.cwd, "partition": sc.partition,
        "alpha": sc.alpha, "availability": availability_json(sc),
        "step_ms": profile.step_s * 1000, "slowdowns": [sc.slowdown(i) for i in range(sc.n_peers)],
        "eval_every_s": options.eval_every_s, "attackers": {}, "consensus_distance_final": None,
        "bytes_source": f"virtual network: IP bytes at MTU {virtual.mtu} (frames, nng framing, "
                        "TCP/IP headers, ACKs; control plane included)",
        "virtual": {"seed": virtual.seed, "step_jitter": virtual.step_jitter,
                    "mtu": virtual.mtu, "max_steps": virtual.max_steps,
                    "allreduce": virtual.allreduce},
    }  # fmt: skip
    torch.set_num_threads(1)  # (one core's arithmetic: the same bits on any box)
    echo(f"the peers' log: {out / 'virtual.log'} (JSON lines, each with its peer_index)")
    applied: list[dict[str, Any]] = []
    with _peer_log(out / "virtual.log"):
        _run_systems(options, virtual, profile, run, applied, echo)
    run["faults"] = run.pop("applied", applied)
    write_json(out / "run.json", run)
    summary = build_summary(out)
    write_json(out / "summary.json", summary)
    try:
        from ._plots import render_plots

        for path in render_plots(out):
            echo(f"plot: {path}")
    except Exception as exc:  # (plots are a view; the figures are in summary.json)
        echo(f"plots not drawn: {type(exc).__name__}: {exc}")
    echo(render_table(summary))
    return summary


@contextlib.contextmanager
def _peer_log(path: Path):
    """The peers' structlog events go to `path` as JSON lines, stamped with virtual time,
    instead of the terminal (eight peers' events drowned the progress lines)."""
    previous = structlog.get_config()

    def stamp(_logger, _method, event):
        with contextlib.suppress(RuntimeError):  # (outside trio: no virtual time)
            event["virtual_t"] = round(trio.current_time(), 4)
        return event

    with open(path, "a") as f:
        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                        stamp, structlog.processors.JSONRenderer()],
            logger_factory=structlog.WriteLoggerFactory(f), cache_logger_on_first_use=False,
        )  # fmt: skip
        try:
            yield
        finally:
            structlog.configure(**previous)


def _run_systems(options: RunOptions, virtual: VirtualOptions, profile: _Clock,
                 run: dict[str, Any], applied: list, echo: Callable[[str], None]) -> None:
    sc = options.scenario
    # DDP and the ideal are one model's steps on two clocks: trained once
    groups = [("geotrain",)] + [(b,) for b in options.baselines if b not in ("ddp", "ideal")]
    pair = tuple(b for b in ("ddp", "ideal") if b in options.baselines)
    if pair:
        groups.insert(1, pair)
    for group in groups:
        started = time.monotonic()
        faults = {}
        for system in group:
            faults[system] = FaultRunner(sc, None, echo, system=system, applied=applied)
            applied = faults[system].applied_all
        if group == ("geotrain",):
            entry = _run_geotrain(options, virtual, profile, faults["geotrain"], echo)
            models = entry.pop("models")
            run["consensus_distance_final"] = consensus_of_finite(models) if models else None
            del models  # (the peers' models: gone before the baselines build theirs)
            entries = {"geotrain": entry}
        else:
            entries = _run_allreduce(options, virtual, profile, faults, echo, group)
        applied = list(applied)
        for system in group:  # (each runner holds what came before it and its own faults)
            applied = [*applied, *(f for f in faults[system].applied_all if f not in applied)]
        for system, entry in entries.items():
            run["systems"][system] = entry
            echo(f"{system}: {entry['stopped']} after {entry['virtual_s']:.1f} virtual s "
                 f"({time.monotonic() - started:.0f} s of wall time)")  # fmt: skip
    run["applied"] = applied


def _spec_links(sc) -> list[dict[str, Any]]:
    m = sc.matrix()
    out = []
    for (a, b), spec in sorted(m.links.items()):
        out.append({"src": a, "dst": b, "spec": spec.to_json(), "measured": None,
                    "note": "virtual: the spec is what the model gives"})  # fmt: skip
    return out


def _virtual_trio(fn: Callable[[], Any], seed: int) -> Any:
    """Run `fn` under trio on a virtual clock, with trio's two tie-breaks made repeatable: its
    scheduler's coin flips (seeded) and the order of deadlines that fall at one instant (by
    when they were set, instead of by the cancel scopes' memory addresses, which differ from
    one process to the next)."""
    from trio._core import _run as trio_run  # (trio's private scheduler: no public knob)

    trio_run._r.seed(seed)
    deadlines = getattr(trio_run, "Deadlines", None)
    original = getattr(deadlines, "add", None)
    order = itertools.count()

    def add(self, deadline: float, cancel_scope) -> None:
        heapq.heappush(self._heap, (deadline, next(order), cancel_scope))
        self._active += 1

    if original is not None:
        deadlines.add = add  # type: ignore[union-attr]
    try:
        return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        if original is not None:
            deadlines.add = original  # type: ignore[union-attr]


# -- geotrain --------------------------------------------------------------------------------


def oracle_partners(matrix, nbytes: int) -> list[set[int]]:
    """Each peer's best fixed partners, computed offline from the links: those whose exchange
    (a round trip, and `nbytes` at the path's rate) costs at most ORACLE_SPREAD x its cheapest
    one's, both ways; then the cheapest bridge between the groups this leaves, until they are
    one graph (else the groups never mix)."""
    n = matrix.n_peers

    def cost(i: int, j: int) -> float:
        there, back = matrix.path_spec(i, j), matrix.path_spec(j, i)
        rate = min(math.inf if s.rate_mbit is None else s.rate_mbit * 1e6 / 8
                   for s in (there, back))  # fmt: skip
        return (there.delay_ms + back.delay_ms) / 1000 + nbytes / rate

    sets = []
    for i in range(n):
        costs = {j: cost(i, j) for j in range(n) if j != i}
        cheapest = min(costs.values())
        sets.append({j for j, c in costs.items() if c <= ORACLE_SPREAD * cheapest})
    for i in range(n):
        for j in list(sets[i]):
            sets[j].add(i)
    while True:
        group, todo = {0}, [0]
        while todo:
            for j in sets[todo.pop()] - group:
                group.add(j)
                todo.append(j)
        if len(group) == n:
            return sets
        i, j = min(((i, j) for i in sorted(group) for j in range(n) if j not in group),
                   key=lambda pair: cost(*pair))  # fmt: skip
        sets[i].add(j)
        sets[j].add(i)


def _virtual_peer_id(index: int, seed: int) -> str:
    return peer_id_from_public_key(hashlib.sha256(f"virtual/{seed}/{index}".encode()).digest())


class _Proc:
    """What the fault runner handles as a peer's process: a virtual peer that runs, is killed
    (SIGKILL: gone mid-step, its network with it) and restarted from its last checkpoint."""

    def __init__(self, swarm: _Swarm, index: int) -> None:
        self.swarm, self.index = swarm, index
        self.peer: _Peer | None = None
        self.incarnation = 0
        self.proc = self  # (the fault runner waits on proc.proc)
        self.snapshot: dict[str, Any] | None = None

    @property
    def running(self) -> bool:
        return self.peer is not None

    def signal(self, signum: int) -> None:
        if self.peer is not None:
            self.peer.kill()
            self.peer = None

    def wait(self) -> int:
        return 0

    def note(self, event: str, **fields: object) -> None:
        pass

    def start(self) -> None:
        self.incarnation += 1
        self.swarm.start(self.index)


class _Peers:
    def __init__(self, procs: list[_Proc]) -> None:
        self.procs = procs


class _Swarm:
    """The geotrain peers of one virtual run, their network and their metrics files."""

    def __init__(self, options: RunOptions, virtual: VirtualOptions, profile: _Clock,
                 nursery: trio.Nursery) -> None:  # fmt: skip
        sc = options.scenario
        self.options, self.virtual, self.profile = options, virtual, profile
        self.nursery = nursery
        self.net = VirtualNetwork(sc.matrix(), header_codec(), random.Random(virtual.seed),
                                  nursery, mtu=virtual.mtu)  # fmt: skip
        self.root = options.out / "geotrain"
        self.procs = [_Proc(self, i) for i in range(sc.n_peers)]
        self.first_step: float | None = None
        self.stop = trio.Event()

    def config(self, index: int):
        sc, options = self.options.scenario, self.options
        doc = {
            "identity": {"open_swarm": True},  # (no handshake in memory: nothing to admit)
            "network": {"bootstrap": [] if index == 0 else [peer_address(0)],
                        "listen": peer_address(index)},
            "training": {
                "task": sc.task, "params": dict(sc.params), "seed": 0, "shard_index": index,
                "num_shards": sc.n_peers, "wait_for_peers": sc.n_peers - 1,
                "eval_every": options.eval_every, "eval_every_s": options.eval_every_s,
                "partition": sc.partition, "alpha": sc.alpha,
            },
            "gossip": {"algorithm": sc.algorithm, "state_sync": False},
        }  # fmt: skip
        return config_from_toml(config_to_toml(doc), base=self.root,
                                overrides=list(options.node_overrides))  # fmt: skip

    def start(self, index: int) -> None:
        proc = self.procs[index]
        peer = _Peer(self, index, proc.incarnation, proc.snapshot)
        proc.peer = peer
        self.nursery.start_soon(peer.run)


class _Peer:
    """One geotrain peer: the daemon's trainer, membership and algorithm, its steps on the
    compute profile's clock."""

    def __init__(self, swarm: _Swarm, index: int, incarnation: int,
                 snapshot: dict[str, Any] | None) -> None:  # fmt: skip
        self.swarm, self.index = swarm, index
        self.config = cfg = swarm.config(index)
        t = cfg.training
        ctx = TaskContext(shard_index=t.shard_index, num_shards=t.num_shards, seed=t.seed,
                          partition=t.partition, alpha=t.alpha, params=t.params)  # fmt: skip
        self.task = task = resolve_task(t.task)(ctx)
        self.trainer = Trainer(
            task, optimizer=t.optimizer, lr=t.lr, precision=t.precision,
            weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, schedule=t.schedule,
            total_steps=t.total_steps, min_lr_ratio=t.min_lr_ratio,
            clip_grad_norm=t.clip_grad_norm, accumulate=t.accumulate,
        )  # fmt: skip
        if snapshot is not None:
            self._restore(snapshot)
        self.pid = index * 1000 + incarnation  # (the summary splits a peer's lines by pid)
        self.peer_id = _virtual_peer_id(index, swarm.virtual.seed)
        partners = None
        if swarm.virtual.partners == "oracle":
            nbytes = 4 * sum(p.numel() for p in self.trainer.params().values())
            chosen = oracle_partners(swarm.net.matrix, nbytes)[index]
            partners = {_virtual_peer_id(j, swarm.virtual.seed) for j in chosen}
        self.cost = swarm.profile.stream(index, f"geotrain/{incarnation}")
        self.step_ends: list[float] = []
        self.transport = swarm.net.attach(index, self.peer_id, self._handle)
        self.parts = peer_parts(
            cfg, self.peer_id, peer_address(index), self.transport, self.trainer,
            swarm.nursery.start_soon, rng=random.Random(f"{swarm.virtual.seed}/rng/{index}"),
            step_interval_s=self._step_interval, clock=trio.current_time,
            incarnation=1 + incarnation, partners=partners,
        )  # fmt: skip
        self.scope = trio.CancelScope()
        self.finished = trio.Event()  # its last evaluation and line are written
        self.metric: float | None = None
        self.metric_step: int | None = None
        self.train_s = 0.0
        self.training_since: float | None = None
        self.metrics = StateDir(swarm.root / f"peer-{index:02d}").metrics

    async def _handle(self, peer, header, payload):
        return await self.parts.handle(peer, header, payload)

    def _step_interval(self) -> float | None:
        ends = self.step_ends[-50:]
        return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) >= 2 else None

    def kill(self) -> None:
        self.swarm.net.detach(self.index, self._handle)
        self.scope.cancel()
        self.finished.set()  # (nothing more comes from a killed peer)

    def _restore(self, snapshot: dict[str, Any]) -> None:
        tr = self.trainer
        tr.model.load_state_dict(snapshot["model"])
        tr.optimizer.load_state_dict(snapshot["optimizer"])
        tr.scheduler.load_state_dict(snapshot["scheduler"])
        tr.step = snapshot["step"]

    def _checkpoint(self) -> None:
        tr = self.trainer
        self.swarm.procs[self.index].snapshot = copy.deepcopy({
            "model": tr.model.state_dict(), "optimizer": tr.optimizer.state_dict(),
            "scheduler": tr.scheduler.state_dict(), "step": tr.step})  # fmt: skip

    async def run(self) -> None:
        swarm = self.swarm
        structlog.contextvars.bind_contextvars(peer_index=self.index, virtual_t=None)
        with self.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.parts.membership.run)
                want = self.config.training.wait_for_peers if self.trainer.step == 0 else 1
                await self.parts.membership.wait_for_peers(
                    want, self.config.training.wait_for_peers_s, swarm.stop)
                nursery.start_soon(self._report)
                try:
                    await self._train()
                finally:  # (its process ends: nobody answers at its address any more)
                    self.swarm.net.detach(self.index, self._handle)
                    nursery.cancel_scope.cancel()

    async def _train(self) -> None:
        swarm, tr = self.swarm, self.trainer
        cadence = EvalCadence(self.config.training.eval_every,
                              self.config.training.eval_every_s, clock=trio.current_time)
        every = self.config.state.checkpoint_every
        self.training_since = trio.current_time()
        if swarm.first_step is None:
            swarm.first_step = self.training_since
        while not swarm.stop.is_set():
            result = tr.train_step()  # (real math, inline: virtual time stands still)
            cost = self.cost()
            await trio.sleep(cost)
            self.train_s += cost
            self.step_ends.append(trio.current_time())
            await self.parts.algorithm.after_step(replace(result, seconds=cost))
            if cadence.due(result.step):
                self._evaluate(cadence)
            if result.step % every == 0:
                self._checkpoint()
        self._evaluate(cadence)
        self._line()
        self.finished.set()

    def _evaluate(self, cadence: EvalCadence) -> None:
        with cadence.evaluating():
            metric = self.trainer.evaluate()
        if metric is not None:
            self.metric, self.metric_step = metric, self.trainer.step
        self._line()

    async def _report(self) -> None:
        while True:
            await trio.sleep(STATUS_EVERY_S)
            self._line()

    def _line(self) -> None:
        now = trio.current_time()
        stats = self.transport.statistics()
        exchanges = self.parts.algorithm.counters.statistics()
        step = self.trainer.step
        since = self.training_since
        wall = None if since is None else now - since
        busy = None if not wall else round(min(1.0, self.train_s / wall), 4)
        record = {
            "t": now, "pid": self.pid, "step": step, "loss": self.trainer.last_loss,
            "metric": self.metric, "metric_step": self.metric_step,
            "steps_per_s": step / wall if wall else 0.0,
            "bytes_in": stats.bytes_in, "bytes_out": stats.bytes_out,
            "train_s": round(self.train_s, 4), "eval_s": 0.0, "utilization": busy,
            "utilization_without_eval": busy,
            "exchanges_ok": exchanges.ok, "exchanges_failed": exchanges.failed,
            # seconds of the exchanges this peer started (as a node's status gives them)
            "exchange_last_s": exchanges.last_s, "exchange_mean_s": exchanges.mean_s,
        }  # fmt: skip
        self.metrics.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics, "a") as f:
            f.write(json.dumps(record) + "\n")


def _run_geotrain(options: RunOptions, virtual: VirtualOptions, profile: _Clock,
                  faults: FaultRunner, echo: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    sc = options.scenario
    echo(f"geotrain: {sc.n_peers} peers ({sc.algorithm}, {sc.task}) in virtual time")
    holder: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            swarm = _Swarm(options, virtual, profile, nursery)
            faults._links = swarm.net  # (partitions and degrades change the virtual links)
            holder["swarm"] = swarm
            await nursery.start(swarm.net.flows.run)
            starts = virtual.peer_start_s or (0.0,) * sc.n_peers
            for i in sorted(range(sc.n_peers), key=lambda i: (starts[i], i)):
                await trio.sleep_until(max(starts[i], trio.current_time()))
                swarm.start(i)
                await trio.sleep(1e-6)  # (a microsecond apart at least: no two timers tie)
            holder["stopped"] = await _supervise(swarm, options, virtual, faults, echo)
            swarm.stop.set()
            with trio.move_on_after(FINISH_S):  # each peer ends its step, exchange and evaluation
                for proc in swarm.procs:
                    if proc.peer is not None:
                        await proc.peer.finished.wait()
            holder["virtual_s"] = trio.current_time()
            nursery.cancel_scope.cancel()

    _virtual_trio(main, virtual.seed)
    swarm = holder["swarm"]
    models = [dict(p.peer.trainer.model.state_dict()) for p in swarm.procs if p.peer is not None]
    return {"launch_t": 0.0, "stopped": holder["stopped"], "virtual_s": holder["virtual_s"],
            "metrics": "geotrain/peer-NN/metrics.jsonl", "models": models,
            "bytes_wire": swarm.net.total_bytes()}  # fmt: skip


async def _supervise(swarm: _Swarm, options: RunOptions, virtual: VirtualOptions,
                     faults: FaultRunner, echo: Callable[[str], None]) -> str:  # fmt: skip
    """Faults, byte samples and progress lines until the target, the duration or max_steps."""
    sc = options.scenario
    samples = open(options.out / "bytes-geotrain.jsonl", "w")
    peers = _Peers(swarm.procs)
    last_echo, wall = -math.inf, time.monotonic()
    with samples:
        while True:
            await trio.sleep(SAMPLE_EVERY_S)
            now = trio.current_time()
            samples.write(json.dumps({"t": now, "bytes": swarm.net.total_bytes()}) + "\n")
            if swarm.first_step is None:
                continue
            elapsed = now - swarm.first_step
            faults.apply_due(elapsed, peers, wall_t=now)
            live = [p.peer for p in swarm.procs if p.peer is not None]
            if time.monotonic() - last_echo >= options.progress_every_s:
                last_echo = time.monotonic()
                echo(_progress("geotrain", now, time.monotonic() - wall,
                               [(p.trainer.step, p.metric) for p in live],
                               swarm.net.total_bytes()))  # fmt: skip
            if live and all(p.metric is not None and at_or_past(
                    p.metric, options.target, options.higher_is_better) for p in live) and (
                    not any(f.action == "restart" for f in faults._pending)):  # fmt: skip
                faults.not_reached(elapsed, "target")
                return "target"
            if elapsed >= sc.duration_s:
                faults.not_reached(elapsed, "duration")
                return "duration"
            slowest = min((p.trainer.step for p in live), default=0)
            if virtual.max_steps and slowest >= virtual.max_steps:
                faults.not_reached(elapsed, "max_steps")
                return "max_steps"


def _progress(system: str, now: float, wall: float, states, sent: int | None) -> str:
    parts = [f"p{i} {step} {'-' if m is None else f'{m:.3f}'}" for i, (step, m) in
             enumerate(states)]  # fmt: skip
    mb = "" if sent is None else f" | {sent / 1e6:.2f} MB sent"
    return (f"[{system:8s} virtual {now:7.1f}s, wall {wall:5.0f}s] step metric: "
            + ", ".join(parts) + mb)


# -- the all-reduce baselines ------------------------------------------------------------------


class _Links:
    """The all-reduce baselines' view of the links (a fault changes them)."""

    def __init__(self, matrix) -> None:
        self.matrix = matrix

    def set_matrix(self, matrix) -> None:
        self.matrix = matrix


@dataclass
class _Track:
    """One all-reduce system's clocks, bytes and files (DDP and the ideal share one model)."""

    name: str
    t: list[float]
    files: list[Any]
    samples: Any
    cadence: list[EvalCadence]
    faults: FaultRunner
    links: _Links
    sent: int = 0
    faults_horizon: float = math.inf  # the run's duration: a hung all-reduce waits until then
    next_check: int = 0  # the step after which the testbed's stop rule all-reduces (0: never)
    how: str | None = None
    stopped: str | None = None
    metrics: list[float | None] = field(default_factory=list)
    metric_steps: list[int | None] = field(default_factory=list)

    def now(self) -> float:
        return min(self.t)


def _run_allreduce(options: RunOptions, virtual: VirtualOptions, profile: _Clock,
                   faults: dict[str, FaultRunner], echo: Callable[[str], None],
                   systems: tuple[str, ...]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """DDP and the ideal (DDP on links that cost nothing: one model, the same math, two clocks),
    or DDP + local SGD (parameters averaged every `period` steps), on virtual clocks: the ranks'
    math as DDP does it, the all-reduce's time and bytes from the links."""
    from ._baselines import baseline_settings, describe

    sc, n = options.scenario, options.scenario.n_peers
    chosen = baseline_settings(options.baselines, options.baseline_set)
    settings = {s: dict(chosen[s]) for s in systems}
    period = settings["localsgd"]["period"] if "localsgd" in systems else 0
    lr = settings[systems[0]].get("lr")
    tasks = [resolve_task(sc.task)(TaskContext(shard_index=i, num_shards=n, seed=0,
                                               partition=sc.partition, alpha=sc.alpha,
                                               params=dict(sc.params)))
             for i in range(n)]  # fmt: skip
    models = [t.model for t in tasks] if period else [tasks[0].model]
    opts = [task_optimizer(tasks[i], models[i].parameters(), lr) for i in range(len(models))]
    numel = sum(p.numel() for p in models[0].parameters())
    costs = [profile.stream(i, "+".join(systems)) for i in range(n)]
    tracks = []
    with ExitStack() as stack:
        for name in systems:
            (options.out / name).mkdir()
            files = [stack.enter_context(open(options.out / name / f"peer-{i:02d}.jsonl", "w"))
                     for i in range(n)]  # fmt: skip
            samples = stack.enter_context(open(options.out / f"bytes-{name}.jsonl", "w"))
            links = _Links(sc.matrix())
            faults[name]._links = links
            track = _Track(name, [0.0] * n, files, samples, [], faults[name], links,
                           metrics=[None] * n, metric_steps=[None] * n,
                           faults_horizon=sc.duration_s)  # fmt: skip
            if virtual.allreduce == "testbed" and name != "ideal":  # (StopRule's first check)
                track.next_check = 1 + period if period else 1
                if not period:  # DDP's constructor broadcasts rank 0's parameters
                    track.sent += gloo_ddp_startup_bytes(links.matrix, 4 * numel, virtual.mtu)
            track.cadence = [EvalCadence(options.eval_every if period else options.ddp_eval_every,
                                         options.eval_every_s, clock=track.now)
                             for _ in range(n)]  # fmt: skip
            tracks.append(track)
            what = "ideal: DDP on free links" if name == "ideal" else describe(name, settings[name])
            echo(f"{name}: {n} ranks ({what}) in virtual time")
        _allreduce_loop(options, virtual, tracks, tasks, models, opts, costs, numel, period, echo)
    out = {}
    for track in tracks:
        name, how = track.name, track.how or "none"
        algorithm = {"ideal": "ideal: DDP on links that cost nothing",
                     "ddp": f"allreduce ({how}; DDP, virtual)",
                     "localsgd": f"DDP + local SGD every {period} steps, allreduce ({how})"}[name]
        out[name] = {"launch_t": 0.0, "stopped": track.stopped, "virtual_s": track.now(),
                     "metrics": f"{name}/peer-NN.jsonl", "algorithm": algorithm,
                     "settings": {**settings[name], "allreduce": track.how},
                     "failed_peers": []}  # fmt: skip
    return out


def _allreduce_loop(options, virtual, tracks, tasks, models, opts, costs, numel, period,
                    echo) -> None:  # fmt: skip
    n = options.scenario.n_peers
    wall, last_echo, step = time.monotonic(), -math.inf, 0
    while any(track.stopped is None for track in tracks):
        step += 1
        spent = [cost() for cost in costs]
        if period:
            for i in range(n):
                _local_step(tasks[i], models[i], *opts[i])
        else:
            _ddp_step(tasks, models[0], *opts[0])
        due: dict[str, list[bool]] = {}
        for track in (tr for tr in tracks if tr.stopped is None):
            _advance(track, spent, step, period, numel, virtual.mtu, models, virtual.allreduce)
            now = track.now()
            track.faults.apply_due(now, _Peers([]), wall_t=now)
            track.samples.write(json.dumps({"t": now, "bytes": track.sent}) + "\n")
            due[track.name] = [c.due(step) for c in track.cadence]
        wanted = any(any(d) for d in due.values())
        shared = _evaluate(tasks[0], models[0]) if wanted and not period else None
        for track in (tr for tr in tracks if tr.stopped is None):
            for i in range(n):
                if due[track.name][i]:
                    track.metrics[i] = _evaluate(tasks[i], models[i]) if period else shared
                    track.metric_steps[i] = step
                    track.cadence[i].evaluated()
                t = track.t[i]
                track.files[i].write(json.dumps({
                    "system": track.name, "t": t, "step": step, "metric": track.metrics[i],
                    "metric_step": track.metric_steps[i], "steps_per_s": step / t if t else 0.0,
                    "eval_s": 0.0}) + "\n")  # fmt: skip
            track.stopped = _stop_rule(track, options, virtual, step)
            if track.stopped is not None:
                track.faults.not_reached(track.now(), track.stopped)
        if time.monotonic() - last_echo >= options.progress_every_s:
            last_echo = time.monotonic()
            for track in tracks:
                echo(_progress(track.name, track.now(), time.monotonic() - wall,
                               [(step, m) for m in track.metrics], track.sent))  # fmt: skip


def _advance(track: _Track, spent: list[float], step: int, period: int, numel: int, mtu: int,
             models, algorithm: str) -> None:  # fmt: skip
    """One step on `track`'s clocks: the ranks' compute, and the all-reduce when there is one."""
    n = len(spent)
    if period:
        track.t = [track.t[i] + spent[i] for i in range(n)]
        if step % period == 0:  # the ranks meet and average their parameters
            _average(models)
            comm = _allreduce(track, max(track.t), 4 * numel, mtu, algorithm)
            track.t = [max(track.t) + comm] * n
        _stop_check(track, step, period, mtu, algorithm)
        return
    compute = max(spent)  # (the ranks meet at every step: the slowest decides)
    if track.name != "ddp":
        track.t = [max(track.t) + compute] * n
        return
    nbytes = 4 * numel
    comm = _allreduce(track, max(track.t), nbytes, mtu, algorithm)
    # DDP all-reduces its gradients in buckets of DDP_BUCKET_BYTES as the backward pass fills
    # them: all but the last bucket's overlap the backward pass (BACKWARD_SHARE of a step)
    buckets = max(1, -(-nbytes // DDP_BUCKET_BYTES))
    exposed = max(comm / buckets, comm - BACKWARD_SHARE * compute)
    track.t = [max(track.t) + compute + exposed] * n
    _stop_check(track, step, period, mtu, algorithm)


def _stop_check(track: _Track, step: int, period: int, mtu: int, algorithm: str) -> None:
    """The real testbed's DDP worker agrees when to stop by an all-reduce of three flags after
    step 1 (local SGD: 1 + period) and every STOP_CHECK_EVERY steps (local SGD: every period)
    after: a barrier every rank waits at (its StopRule; "testbed" only)."""
    if not track.next_check or step != track.next_check:
        return
    unit = max(1, period)
    track.next_check = step + max(STOP_CHECK_EVERY // unit, 1) * unit
    comm = _allreduce(track, max(track.t), STOP_FLAGS_BYTES, mtu, algorithm)
    track.t = [max(track.t) + comm] * len(track.t)


def _allreduce(track: _Track, now: float, nbytes: int, mtu: int, algorithm: str) -> float:
    """Seconds from `now` until an all-reduce of `nbytes` on `track`'s links is done. Over a
    partition it cannot complete: it waits for the next fault that changes the links (a heal),
    or for ever (the run's duration ends it), as gloo's ranks hang on a cut link."""
    waited = 0.0
    while True:
        seconds, sent, track.how = allreduce_cost(track.links.matrix, nbytes, mtu, algorithm)
        if math.isfinite(seconds):
            track.sent += sent
            return waited + seconds
        pending = [f for f in track.faults._pending if f.action in ("heal", "degrade")]
        if not pending:
            return max(0.0, track.faults_horizon - now)
        waited = max(waited, pending[0].at_s - now)
        track.faults.apply_due(pending[0].at_s, _Peers([]), wall_t=pending[0].at_s)


def _stop_rule(track: _Track, options: RunOptions, virtual: VirtualOptions,
               step: int) -> str | None:  # fmt: skip
    if all(m is not None and at_or_past(m, options.target, options.higher_is_better)
           for m in track.metrics):  # fmt: skip
        return "target"
    if track.now() >= options.scenario.duration_s:
        return "duration"
    if virtual.max_steps and step >= virtual.max_steps:
        return "max_steps"
    return None


def _ddp_step(tasks, model: torch.nn.Module, optimizer, scheduler) -> None:
    """One DDP step: every rank's batch, gradients averaged (what the all-reduce gives)."""
    optimizer.zero_grad(set_to_none=True)
    for task in tasks:
        (task.loss(model, next(task.batches)) / len(tasks)).backward()
    tasks[0].recipe.clip(model.parameters())
    optimizer.step()
    scheduler.step()


def _local_step(task, model, optimizer, scheduler) -> None:
    optimizer.zero_grad(set_to_none=True)
    task.loss(model, next(task.batches)).backward()
    task.recipe.clip(model.parameters())
    optimizer.step()
    scheduler.step()


@torch.no_grad()
def _average(models: list[torch.nn.Module]) -> None:
    for params in zip(*(m.parameters() for m in models), strict=True):
        mean = torch.stack([p.data for p in params]).mean(0)
        for p in params:
            p.data.copy_(mean)


def _evaluate(task, model: torch.nn.Module) -> float:
    model.eval()
    try:
        return float(task.evaluate(model))
    finally:
        model.train()
