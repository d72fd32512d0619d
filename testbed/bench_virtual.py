"""Calibration of the virtual-time run against the real testbed, side by side.

    python -m geotrain.testbed.bench_virtual [--scenario demo] [--step-ms 200]
        [--algorithms adpsgd,dpsgd,choco,diloco,selsync] [--duration 60] [--level 0.8]
        [--real-repeats 1] [--out DIR]
    python -m geotrain.testbed.bench_virtual --gloo-probe   (root: a network namespace)
    python -m geotrain.testbed.bench_virtual --ddp-over-ideal homes,geo3,FILE.toml

For each algorithm, the same scenario runs in real time (`geotrain testbed run`: node processes
behind the emulated links, compute pinned by --step-ms; --real-repeats times) and with `--clock
virtual` (the same step time, MTU 65000 as the userspace emulator's TUN devices carry, and DDP as
the testbed runs it: `--allreduce testbed`); DDP is run with the first algorithm's pair. Prints a
markdown table per system: time and bytes to the target and to `--level` (an earlier level, on
the steep part of the curve, where one evaluation's noise moves the time less), the peers' mean
step rate and the bytes per step, each as virtual / real, and the load average during the real
runs. Real runs need root (namespaces); on a busy machine they measure its load too.

--ddp-over-ideal prints what a DDP step costs over the ideal's on each scenario, by the virtual
DDP's own cost model (no jitter): at 1.1M parameters and 100 ms steps, and at 10.9M and 2 s or
1 s steps (x the slowest peer's slowdown), with the all-reduce it takes.

--gloo-probe measures what gloo's DDP puts on a loopback in a private network namespace per
step (IP bytes and packets, 2 and 4 ranks, two model sizes): the framing _allreduce charges.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ._summary import (
    bytes_samples,
    load_jsonl,
    peer_metrics,
    quality_curve,
    steps_per_s,
    time_bytes_to,
    train_start,
)


def _start_spread(real: Path, n: int) -> list[float]:
    """When each real peer began training (its `peers_ready` log event), seconds after the
    first one: the real run's start spread, which the virtual run of the pair is given."""
    from datetime import datetime

    ready = []
    for i in range(n):
        events = load_jsonl(real / "geotrain" / f"peer-{i:02d}.log")
        at = next((e["timestamp"] for e in events if e.get("event") == "peers_ready"), None)
        ready.append(None if at is None else datetime.fromisoformat(at).timestamp())
    known = [t for t in ready if t is not None]
    return [0.0 if t is None else round(t - min(known), 3) for t in ready]


def _run(out: Path, clock: str, args: argparse.Namespace, algorithm: str, baseline: str,
         extra: tuple[str, ...] = ()) -> dict:  # fmt: skip
    cmd = [sys.executable, "-m", "geotrain.node", "testbed", "run", "--scenario", args.scenario,
           "--algorithm", algorithm, "--step-ms", str(args.step_ms), "--duration",
           str(args.duration), "--baseline", baseline, "--out", str(out), "--clock", clock]
    if clock == "virtual":  # (the emulator's TUN MTU; DDP as the real testbed runs it)
        cmd += ["--mtu", "65000", "--allreduce", "testbed"]
    else:
        cmd += ["--no-link-check"]
    cmd += extra
    load = os.getloadavg()[0]
    if clock == "real" and args.reuse_real and (out / "summary.json").exists():
        load = json.loads((out / "run.json").read_text()).get("load_average", float("nan"))
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        load = max(load, os.getloadavg()[0])
        if proc.returncode != 0:
            raise SystemExit(f"{clock} run of {algorithm} failed: {proc.stderr[-2000:]}")
        if clock == "real":  # (kept beside the run, for --reuse-real)
            run = json.loads((out / "run.json").read_text())
            (out / "run.json").write_text(json.dumps({**run, "load_average": load}, indent=1))
    run = json.loads((out / "run.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    figures = {s["system"]: _figures(out, run, s, args.level, load) for s in summary["systems"]}
    if clock == "real":
        figures["spread"] = _start_spread(out, run["peers"])
    return figures


def _figures(out: Path, run: dict, entry: dict, level: float, load: float) -> dict:
    """A system's calibration figures from its run directory."""
    system, higher = entry["system"], run.get("higher_is_better", True)
    peers = peer_metrics(out, system, run["peers"])
    curve, samples, t0 = quality_curve(run, system, peers), bytes_samples(out, system), \
        train_start(peers)  # fmt: skip
    at_level = None if t0 is None else time_bytes_to(curve, samples, level, higher, t0)
    rates = [r for r in (steps_per_s(rs) for rs in peers) if r]
    steps = sum(max((r.get("step", 0) for r in rs), default=0) for rs in peers)
    sent = entry.get("bytes_sent_total")
    return {"time": entry.get("time_to_target_s"), "bytes": entry.get("bytes_to_target"),
            "time_level": at_level and at_level[0], "bytes_level": at_level and at_level[1],
            "steps_per_s": sum(rates) / len(rates) if rates else None,
            "bytes_per_step": sent / steps if sent and steps else None, "load": load}  # fmt: skip


FIGURES = ("time", "bytes", "time_level", "bytes_level", "steps_per_s", "bytes_per_step")


def _ratio(virtual: float | None, reals: list[float | None]) -> str:
    known = [r for r in reals if r]
    if not virtual or not known:
        return "-"
    low, high = virtual / max(known), virtual / min(known)
    return f"{low:.2f}" if len(known) == 1 else f"{low:.2f}-{high:.2f}"


def _reals(reals: list[float | None]) -> str:
    known = [r for r in reals if r is not None]
    return "-" if not known else "/".join(f"{r:.4g}" for r in known)


def _ddp_over_ideal(scenarios: str) -> int:
    from ._allreduce import allreduce_cost
    from ._scenario import load_scenario
    from ._virtual import BACKWARD_SHARE, DDP_BUCKET_BYTES

    for name in scenarios.split(","):
        sc = load_scenario(name)
        slowest = max(sc.slowdown(i) for i in range(sc.n_peers))
        for numel, step_s in ((1_126_410, 0.1), (10_872_576, 2.0), (10_872_576, 1.0)):
            comm, _, how = allreduce_cost(sc.matrix(), 4 * numel)
            compute = step_s * slowest
            buckets = max(1, -(-4 * numel // DDP_BUCKET_BYTES))  # (as _virtual._advance)
            exposed = max(comm / buckets, comm - BACKWARD_SHARE * compute)
            print(f"{sc.name}: {numel:,} parameters, {step_s * 1000:g} ms steps (slowest x"
                  f"{slowest:g}): all-reduce {comm:.2f} s ({how}); DDP pays "
                  f"{(compute + exposed) / compute:.2f}x the ideal")  # fmt: skip
    return 0


def _gloo_probe() -> int:
    """Bytes and packets of gloo's DDP per step on a namespace's loopback."""
    ns = f"geotrain-gloo-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        for world in (2, 4):
            for numel in (4810, 100_000):
                subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m",
                                "geotrain.testbed.bench_virtual", "--gloo-rank-main",
                                str(world), str(numel)], check=True, timeout=600)  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    return 0


def _lo() -> tuple[int, int]:
    stats = Path("/sys/class/net/lo/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "tx_packets").read_text())


def _gloo_rank(rank: int, world: int, numel: int, steps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=rank,
                            world_size=world)  # fmt: skip
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(numel, 1, bias=False))
    x = torch.randn(2, numel)
    model(x).sum().backward()  # (the first step: buckets built, connections open)
    dist.barrier()
    queue.put(_lo()) if rank == 0 else None
    for _ in range(steps):
        model(x).sum().backward()
    dist.barrier()
    queue.put(_lo()) if rank == 0 else None
    dist.barrier()
    dist.destroy_process_group()


def _gloo_rank_main(world: int, numel: int, steps: int = 50) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, numel, steps, queue))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    (b0, p0), (b1, p1) = queue.get(timeout=600), queue.get(timeout=600)
    for p in procs:
        p.join()
    packets = p1 - p0
    ip_bytes = b1 - b0 - 14 * packets  # (lo counts a 14-byte Ethernet header a packet)
    from ._vnet import wire_bytes

    messages = 2 * (world - 1) * world  # a ring's messages per all-reduce
    piece = -(-numel // world) * 4
    modelled = messages * sum(wire_bytes(piece, 65536))  # (lo's MTU: segments and ACKs)
    print(json.dumps({"ranks": world, "params": numel, "steps": steps,
                      "ip_bytes_per_step": round(ip_bytes / steps),
                      "packets_per_step": round(packets / steps, 1),
                      "beyond_payload_per_message": round((ip_bytes / steps - messages * piece)
                                                          / messages),
                      # what GLOO_MESSAGE_BYTES stands for
                      "beyond_segments_per_message": round((ip_bytes / steps - modelled)
                                                           / messages)}), flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="demo")
    parser.add_argument("--step-ms", type=float, default=200.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--algorithms", default="adpsgd,dpsgd,choco,diloco,selsync")
    parser.add_argument("--level", type=float, default=0.8,
                        help="an earlier level than the target, also reported (default: 0.8)")
    parser.add_argument("--real-repeats", type=int, default=1,
                        help="real runs of each algorithm (their spread is the noise floor)")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temp folder)")
    parser.add_argument("--reuse-real", action="store_true",
                        help="take the real runs already in --out (with their summary.json)")
    parser.add_argument("--gloo-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ddp-over-ideal", metavar="SCENARIOS", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-rank-main", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gloo_rank_main:
        _gloo_rank_main(*args.gloo_rank_main)
        return 0
    if args.gloo_probe:
        return _gloo_probe()
    if args.ddp_over_ideal:
        return _ddp_over_ideal(args.ddp_over_ideal)
    if args.real_repeats < 1:
        parser.error(f"--real-repeats {args.real_repeats}: expected >= 1")
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_virtual."))
    rows = []
    for k, algorithm in enumerate(args.algorithms.split(",")):
        baseline = "ddp" if k == 0 else "none"
        reals = [_run(root / f"{algorithm}-real{r}", "real", args, algorithm, baseline)
                 for r in range(args.real_repeats)]  # fmt: skip
        # a virtual run with each real run's start spread, and one with none (starts at once)
        virtuals = [_run(root / f"{algorithm}-virtual{r}", "virtual", args, algorithm, baseline,
                         ("--peer-start-s", ",".join(map(str, real.pop("spread")))))
                    for r, real in enumerate(reals)]  # fmt: skip
        at_once = _run(root / f"{algorithm}-virtual", "virtual", args, algorithm, baseline)
        for system in reals[0]:
            name = algorithm if system == "geotrain" else system
            for r, (real, virtual) in enumerate(zip(reals, virtuals, strict=True)):
                rows.append((f"{name} (real run {r + 1}, its start spread)", [real.get(system, {})],
                             virtual.get(system, {})))  # fmt: skip
            rows.append((f"{name} (peers start at once)", [r.get(system, {}) for r in reals],
                         at_once.get(system, {})))  # fmt: skip
            print(f"{name}: real {[r.get(system) for r in reals]}; virtual "
                  f"{[v.get(system) for v in virtuals]}, at once {at_once.get(system)}",
                  flush=True)  # fmt: skip
    print(f"\n{args.scenario}, steps pinned at {args.step_ms:g} ms, runs in {root}; each cell: "
          f"virtual / real (a range over the real runs), real figures after it\n")
    print(f"| system | time to target | bytes to target | time to {args.level:g} | bytes to "
          f"{args.level:g} | steps/s | bytes per step | load (real runs) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, reals, virtual in rows:
        cells = [f"{_ratio(virtual.get(f), [r.get(f) for r in reals])} "
                 f"({_reals([r.get(f) for r in reals])})" for f in FIGURES]  # fmt: skip
        loads = "/".join(f"{r['load']:.1f}" for r in reals if "load" in r)
        print(f"| {name} | " + " | ".join(cells) + f" | {loads} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
