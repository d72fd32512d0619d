"""Calibration of the virtual-time run against the real testbed, side by side.

    python -m geotrain.testbed.bench_virtual [--scenario demo] [--step-ms 200]
        [--algorithms adpsgd,dpsgd,choco,diloco,selsync] [--duration 60] [--out DIR]

For each algorithm, the same scenario runs twice: `geotrain testbed run` in real time (node
processes behind the emulated links, compute pinned by --step-ms) and with `--clock virtual` (the
same step time, MTU 65000 as the userspace emulator's TUN devices carry, and DDP's all-reduce as
gloo runs it: a ring); DDP is run with the first algorithm's pair. Prints a markdown table: time
to target and bytes to target of each system in both runs, and their ratios (virtual / real).
Real runs need root (namespaces); on a busy machine they measure its load too: run it on a quiet
one, and keep --step-ms well above a step's compute so the pin holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(out: Path, clock: str, args: argparse.Namespace, algorithm: str, baseline: str) -> dict:
    cmd = [sys.executable, "-m", "geotrain.node", "testbed", "run", "--scenario", args.scenario,
           "--algorithm", algorithm, "--step-ms", str(args.step_ms), "--duration",
           str(args.duration), "--baseline", baseline, "--out", str(out), "--clock", clock]
    if clock == "virtual":  # (the emulator's TUN MTU; gloo's ring, as the real DDP runs it)
        cmd += ["--mtu", "65000", "--allreduce", "ring"]
    else:
        cmd += ["--no-link-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{clock} run of {algorithm} failed: {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {s["system"]: s for s in summary["systems"]}


def _ratio(virtual: float | None, real: float | None) -> str:
    return f"{virtual / real:.2f}" if virtual and real else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="demo")
    parser.add_argument("--step-ms", type=float, default=200.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--algorithms", default="adpsgd,dpsgd,choco,diloco,selsync")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temp folder)")
    args = parser.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_virtual."))
    rows = []
    for k, algorithm in enumerate(args.algorithms.split(",")):
        baseline = "ddp" if k == 0 else "none"
        runs = {clock: _run(root / f"{algorithm}-{clock}", clock, args, algorithm, baseline)
                for clock in ("real", "virtual")}  # fmt: skip
        for system in runs["real"]:
            real, virtual = runs["real"][system], runs["virtual"].get(system, {})
            name = algorithm if system == "geotrain" else system
            rows.append((name, real.get("time_to_target_s"), virtual.get("time_to_target_s"),
                         real.get("bytes_to_target"), virtual.get("bytes_to_target")))
            print(f"{name}: real {rows[-1][1]} s, {rows[-1][3]} B; virtual {rows[-1][2]} s, "
                  f"{rows[-1][4]} B", flush=True)  # fmt: skip
    print(f"\n{args.scenario}, steps pinned at {args.step_ms:g} ms, runs in {root}\n")
    print("| system | time to target, real | virtual | virtual / real | bytes to target, real "
          "| virtual | virtual / real |")
    print("|---|---|---|---|---|---|---|")
    for name, t_real, t_virtual, b_real, b_virtual in rows:
        print(f"| {name} | {t_real} s | {t_virtual} s | {_ratio(t_virtual, t_real)} | "
              f"{b_real} | {b_virtual} | {_ratio(b_virtual, b_real)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
