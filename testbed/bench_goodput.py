"""WAN goodput of a model exchange and a state sync, against iperf3 on the same emulated link.

    sudo python -m geotrain.testbed.bench_goodput [--links wan1g,wan100,home] [--loss 0,0.001,0.01]
        [--mb 400] [--wan1g-mbit 1000] [--json]

Needs root (network namespaces, /dev/net/tun) and iperf3 (Debian package `iperf3`); without
either it says so and exits 2. For each link and loss rate, two namespaces are joined by the
testbed's userspace emulator (the same one `geotrain testbed run` uses) and measured in turn, in
one run:
- iperf3, single stream and `-P 4`, for as long as the model takes at the link's rate: both
  ways at once (`--bidir`, the anchor of the exchange, which moves the model both ways) and
  server to client (`-R`, the anchor of the state sync: the client fetches the server's model);
- one pairwise exchange (adpsgd, codec none) of a `--mb` MB model between two geotrain processes
  (python -m geotrain.node.bench.wan), and one state sync of it.
Goodput is model bytes over wall time (the exchange moves the model each way, both at once);
it is printed against the link's capacity (the slower direction for the exchange, the download
for the state sync) and against iperf3's best (the better of 1 and 4 streams). The real time of
a run depends on what else the machine runs: a figure is only meaningful beside the iperf3 runs
of the same link in the same run.

Links (RTT is the round trip; loss applies to each direction):
- wan1g: 1 Gbit/s each way, 150 ms;
- wan100: 100 Mbit/s each way, 80 ms;
- home: the client behind a home line of 20 Mbit/s up and 100 Mbit/s down, 40 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

from ._linkspec import AccessLink, LinkMatrix, LinkSpec
from ._namespaces import NamespaceSet
from ._userspace import UserspaceLinks

IPERF_PORT = 5201
NODE_PORT = 7000
DEFAULT_LOSS = (0.0, 0.001, 0.01)


@dataclass(frozen=True)
class BenchLink:
    """A link of the bench: the client (peer 0) and the server (peer 1) in two namespaces.

    Attributes:
        up_mbit: client -> server rate; down_mbit: server -> client rate; rtt_ms: round trip.
        home: the rates are the client's access link (a home line), not the path's.
    """

    name: str
    up_mbit: float
    down_mbit: float
    rtt_ms: float
    home: bool = False

    def matrix(self, loss: float) -> LinkMatrix:
        if self.home:
            spec = LinkSpec(delay_ms=self.rtt_ms / 2, loss=loss)
            access = AccessLink(up_mbit=self.up_mbit, down_mbit=self.down_mbit)
            return replace(LinkMatrix.uniform(2, spec), access=(access, None))
        if self.up_mbit != self.down_mbit:
            raise ValueError(f"link {self.name}: an asymmetric path must be a home line")
        return LinkMatrix.uniform(2, LinkSpec(delay_ms=self.rtt_ms / 2, loss=loss,
                                              rate_mbit=self.up_mbit))  # fmt: skip

    @property
    def exchange_capacity_mbit(self) -> float:
        return min(self.up_mbit, self.down_mbit)


def bench_links(wan1g_mbit: float = 1000.0) -> dict[str, BenchLink]:
    return {
        "wan1g": BenchLink("wan1g", wan1g_mbit, wan1g_mbit, 150.0),
        "wan100": BenchLink("wan100", 100.0, 100.0, 80.0),
        "home": BenchLink("home", 20.0, 100.0, 40.0, home=True),
    }


def _iperf(nss: NamespaceSet, seconds: int, streams: int, mode: str) -> float:
    """Goodput of one iperf3 test of `seconds`, Mbit/s (bytes received over the test's time,
    its start-up included). mode "bidir": both ways at once, the slower direction's;
    "reverse": server to client. (Not `-n`: it ends when the sender has queued its bytes, before
    they arrived, and a bidirectional test ends with its first direction.)"""
    server = nss.popen(1, ["iperf3", "-s", "-1", "-B", str(nss[1].address), "-p", str(IPERF_PORT)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        argv = ["iperf3", "-c", str(nss[1].address), "-p", str(IPERF_PORT), "-J",
                "-t", str(seconds), "-P", str(streams), "--connect-timeout", "10000",
                "--bidir" if mode == "bidir" else "-R"]  # fmt: skip
        for _ in range(50):  # the server needs a moment to listen
            done = nss.run(0, argv, capture_output=True, text=True, timeout=1200)
            if "unable to connect" not in done.stdout + done.stderr:
                break
            time.sleep(0.1)
        if done.returncode != 0:
            raise RuntimeError(f"iperf3 failed: {done.stdout[-400:]} {done.stderr[-400:]}")
        end = json.loads(done.stdout)["end"]
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
        if server.poll() is None:
            server.kill()
            server.wait()
    rates = [end["sum_received"]["bits_per_second"]]
    if mode == "bidir":
        rates.append(end["sum_received_bidir_reverse"]["bits_per_second"])
    return min(rates) / 1e6


def run_nodes(nss: NamespaceSet, keys: tuple[str, str], mode: str, *, mb: float, rtt_ms: float,
              mbit: float, connections: int = 4, chunk_mb: float = 0.0) -> dict:  # fmt: skip
    """One exchange or state sync between two geotrain processes, the client in namespace 0
    (it starts it) and the server in namespace 1, whose link tables start at `rtt_ms` and
    `mbit`; the client worker's JSON result (see geotrain.node.bench.wan) and its log."""
    worker = [sys.executable, "-m", "geotrain.node.bench.wan"]
    server_url = f"tcp://{nss[1].address}:{NODE_PORT}"
    common = ["--mb", str(mb), "--rtt-ms", str(rtt_ms), "--mbit", str(mbit),
              "--connections", str(connections), "--chunk-mb", str(chunk_mb)]  # fmt: skip
    server = nss.popen(1, [*worker, "serve", "--key", keys[1], "--peer-key", keys[0],
                           "--listen", server_url, *common],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the serving worker did not start (status {server.poll()})")
        done = nss.run(0, [*worker, mode, "--key", keys[0], "--peer-key", keys[1], "--listen",
                           f"tcp://{nss[0].address}:0", "--dial", server_url, *common,
                           "--log-level", "info"],
                       capture_output=True, text=True, timeout=3600)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{mode} worker failed: {done.stderr.strip()[-800:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return {**result, "log": done.stderr.strip()[-1500:]}
    finally:
        if server.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def measure(link: BenchLink, loss: float, mb: float, keys: tuple[str, str],
            connections: int = 4) -> dict:  # fmt: skip
    """Every figure of one link at one loss rate, measured in one namespace pair."""
    nbytes = int(mb * 1e6)
    # iperf3 runs as long as the model takes at the link's rate (its start-up counted as ours is)
    exchange_s = max(3, math.ceil(nbytes * 8 / (link.exchange_capacity_mbit * 1e6)))
    sync_s = max(3, math.ceil(nbytes * 8 / (link.down_mbit * 1e6)))
    out: dict = {"link": link.name, "loss": loss, "mb": mb, "connections": connections,
                 "up_mbit": link.up_mbit,
                 "down_mbit": link.down_mbit, "rtt_ms": link.rtt_ms}  # fmt: skip
    with NamespaceSet(2) as nss, UserspaceLinks(nss, link.matrix(loss)):
        for mode, streams in (("bidir", 1), ("bidir", 4), ("reverse", 1), ("reverse", 4)):
            seconds = exchange_s if mode == "bidir" else sync_s
            out[f"iperf_{mode}_{streams}_mbit"] = _iperf(nss, seconds, streams, mode)
        for mode, iperf in (("exchange", "bidir"), ("sync", "reverse")):
            # the nodes' link tables start at what iperf3 got here (as their own transfers
            # would have measured), never above the link's rate: on a machine that cannot
            # carry the link's rate, deadlines from the rate alone would be too short
            best = max(out[f"iperf_{iperf}_1_mbit"], out[f"iperf_{iperf}_4_mbit"])
            cap = link.exchange_capacity_mbit if mode == "exchange" else link.down_mbit
            rate = min(best, cap)
            r = run_nodes(nss, keys, mode, mb=mb, rtt_ms=link.rtt_ms, mbit=rate,
                          connections=connections)  # fmt: skip
            if not r["ok"]:
                raise RuntimeError(f"the {mode} failed on {link.name} at loss {loss}: "
                                   f"{r.get('log', '')}")
            out[f"{mode}_s"] = r["seconds"]
            out[f"{mode}_mbit"] = r["model_bytes"] * 8 / r["seconds"] / 1e6
    out["exchange_capacity_mbit"] = link.exchange_capacity_mbit
    out["exchange_iperf_best_mbit"] = max(out["iperf_bidir_1_mbit"], out["iperf_bidir_4_mbit"])
    out["sync_capacity_mbit"] = link.down_mbit
    out["sync_iperf_best_mbit"] = max(out["iperf_reverse_1_mbit"], out["iperf_reverse_4_mbit"])
    return out


def _lines(r: dict) -> list[str]:
    head = (f"{r['link']} ({r['up_mbit']:g}/{r['down_mbit']:g} Mbit/s, {r['rtt_ms']:g} ms), "
            f"loss {r['loss']:g}, {r['mb']:g} MB, {r['connections']} connections per peer:")
    lines = [head]
    for mode, iperf in (("exchange", "bidir"), ("sync", "reverse")):
        got, cap, best = r[f"{mode}_mbit"], r[f"{mode}_capacity_mbit"], r[f"{mode}_iperf_best_mbit"]
        lines.append(
            f"  {mode:8s} {got:8.1f} Mbit/s in {r[f'{mode}_s']:6.1f} s = {got / cap:.2f}x capacity "
            f"({cap:g}), {got / best:.2f}x iperf3's best; iperf3 {iperf} 1 stream "
            f"{r[f'iperf_{iperf}_1_mbit']:.1f}, -P 4 {r[f'iperf_{iperf}_4_mbit']:.1f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="wan1g,wan100,home", help="comma-separated")
    parser.add_argument("--loss", default=",".join(f"{x:g}" for x in DEFAULT_LOSS),
                        help="comma-separated loss rates (fractions)")  # fmt: skip
    parser.add_argument("--mb", type=float, default=400.0, help="model size, MB")
    parser.add_argument("--wan1g-mbit", type=float, default=1000.0,
                        help="the wan1g link's rate (lower it where the emulator cannot hold "
                        "1 Gbit/s within 5%%: python -m geotrain.testbed._linkcheck bench)")
    parser.add_argument("--connections", type=int, default=4,
                        help="the nodes' network.connections_per_peer (1: one TCP connection)")
    parser.add_argument("--json", action="store_true", help="one JSON line per result")
    args = parser.parse_args(argv)
    links = bench_links(args.wan1g_mbit)
    names = [n.strip() for n in args.links.split(",") if n.strip()]
    unknown = [n for n in names if n not in links]
    if unknown:
        parser.error(f"--links: unknown {unknown}, expected some of {sorted(links)}")
    try:
        losses = [float(x) for x in args.loss.split(",")]
    except ValueError:
        parser.error(f"--loss: {args.loss!r}, expected comma-separated fractions like 0,0.01")
    if any(not 0 <= x < 1 for x in losses) or args.mb <= 0:
        parser.error("--loss: fractions in [0, 1); --mb: > 0")
    if os.geteuid() != 0 or shutil.which("iperf3") is None:
        print("bench_goodput needs root (network namespaces) and iperf3 (apt-get install iperf3)",
              file=sys.stderr)  # fmt: skip
        return 2
    from geotrain.node import Identity  # (torch: only once the run starts)

    with tempfile.TemporaryDirectory(prefix="gt-goodput-") as tmp:
        keys = (os.path.join(tmp, "client.key"), os.path.join(tmp, "server.key"))
        for path in keys:
            Identity.generate().save(path)
        for name in names:
            for loss in losses:
                r = measure(links[name], loss, args.mb, keys, args.connections)
                print(json.dumps(r) if args.json else "\n".join(_lines(r)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
