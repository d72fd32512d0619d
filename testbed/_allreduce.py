# What an all-reduce of a model's bytes costs on a scenario's links, for the virtual-time DDP
# baselines. Invariants: two algorithms are costed and the faster is taken (named in the result):
# a ring over every peer (ordered region by region, so the ring crosses each region boundary
# once), and a hierarchical one (a ring inside each region, a ring of one leader per region, a
# broadcast inside each region); each hop runs at the lowest of the region link's rate, the
# sender's uplink and the receiver's downlink, capped by TCP's loss limit, and costs its one-way
# delay per step; a ring's step waits for its slowest hop; bytes are IP bytes (_vnet.wire_bytes);
# "testbed" is the ring as the real testbed's gloo runs it: each message also carries gloo's
# framing (GLOO_MESSAGE_BYTES).
from __future__ import annotations

import math

from ._linkspec import LinkMatrix
from ._vnet import MATHIS_C, TCP_IP_HEADERS, wire_bytes

INF = math.inf
# IP bytes a gloo message of a ring all-reduce costs beyond its payload's TCP/IP segments and
# ACKs: its op header and the small control messages beside it, with their ACKs (about 5.5
# packets more than the data's). Measured on loopback in a private network namespace, DDP with
# gloo (`python -m geotrain.testbed.bench_virtual --gloo-probe`, load ~22): with 4 ranks, as the
# calibration runs, 473-489 bytes a message at 4,810 and 100,000 parameters; with 2 ranks
# 467-1,036 (when ACKs go varies with the machine's load). At sizes where a message is megabytes
# any of these is noise
GLOO_MESSAGE_BYTES = 480


def _hop(matrix: LinkMatrix, src: int, dst: int, mtu: int) -> tuple[float, float]:
    """(bytes/s, one-way delay s) of src -> dst; rate 0 when partitioned."""
    path = matrix.path_spec(src, dst)
    if path.loss >= 1.0:
        return 0.0, INF
    rate = INF if path.rate_mbit is None else path.rate_mbit * 1e6 / 8
    back = matrix.path_spec(dst, src)
    rtt = (path.delay_ms + back.delay_ms) / 1000
    if path.loss > 0 and rtt > 0:
        rate = min(rate, (mtu - TCP_IP_HEADERS) / rtt * MATHIS_C / math.sqrt(path.loss))
    return rate, path.delay_ms / 1000


def _ring(matrix: LinkMatrix, members: list[int], nbytes: int, mtu: int,
          framing: int = 0) -> tuple[float, int]:  # fmt: skip
    """(seconds, IP bytes) of a ring all-reduce (reduce-scatter then all-gather: 2 (n - 1) steps
    of nbytes / n each) among `members`; `framing`: bytes each message adds (gloo's)."""
    n = len(members)
    if n < 2:
        return 0.0, 0
    piece = -(-nbytes // n)
    wire, acks = wire_bytes(piece, mtu)
    acks += framing
    step = 0.0
    for k, src in enumerate(members):
        rate, delay = _hop(matrix, src, members[(k + 1) % n], mtu)
        step = max(step, INF if rate == 0 else delay + wire / rate)
    steps = 2 * (n - 1)
    return steps * step, steps * n * (wire + acks)


def _broadcast(matrix: LinkMatrix, leader: int, members: list[int], nbytes: int,
               mtu: int) -> tuple[float, int]:  # fmt: skip
    """A pipelined chain broadcast of nbytes from `leader` through `members`."""
    chain = [leader, *(m for m in members if m != leader)]
    if len(chain) < 2:
        return 0.0, 0
    wire, acks = wire_bytes(nbytes, mtu)
    rates, delay = [], 0.0
    for a, b in zip(chain, chain[1:], strict=False):
        rate, d = _hop(matrix, a, b, mtu)
        rates.append(rate)
        delay += d
    slowest = min(rates)
    seconds = INF if slowest == 0 else delay + wire / slowest
    return seconds, (len(chain) - 1) * (wire + acks)


ALGORITHMS = ("best", "ring", "hierarchical", "testbed")


def allreduce_cost(matrix: LinkMatrix, nbytes: int, mtu: int = 1500,
                   algorithm: str = "best") -> tuple[float, int, str]:  # fmt: skip
    """(seconds, IP bytes on the wire, "ring" | "hierarchical") of an all-reduce of `nbytes`
    (the model's fp32 gradients) among every peer of `matrix`: the faster of the two ("best"),
    or the one named ("testbed": the ring with gloo's framing, as the real testbed's DDP runs
    it)."""
    peers = list(range(matrix.n_peers))
    order = sorted(peers, key=lambda p: (matrix.regions.index(matrix.peer_regions[p]), p))
    if algorithm == "testbed":
        seconds, sent = _ring(matrix, order, nbytes, mtu, GLOO_MESSAGE_BYTES)
        return seconds, sent, "ring"
    ring = _ring(matrix, order, nbytes, mtu)
    groups = [[p for p in order if matrix.peer_regions[p] == r] for r in matrix.regions]
    groups = [g for g in groups if g]
    if len(groups) < 2 or algorithm == "ring":
        return ring[0], ring[1], "ring"
    inside = [_ring(matrix, g, nbytes, mtu) for g in groups]
    leaders = _ring(matrix, [g[0] for g in groups], nbytes, mtu)
    spread = [_broadcast(matrix, g[0], g, nbytes, mtu) for g in groups]
    hier = (max(s for s, _ in inside) + leaders[0] + max(s for s, _ in spread),
            sum(b for _, b in inside) + leaders[1] + sum(b for _, b in spread))  # fmt: skip
    if algorithm == "hierarchical" or hier[0] < ring[0]:
        return hier[0], hier[1], "hierarchical"
    return ring[0], ring[1], "ring"


def gloo_ddp_startup_bytes(matrix: LinkMatrix, nbytes: int, mtu: int = 1500) -> int:
    """IP bytes the real testbed's DDP sends before its first step: torch DDP's constructor
    broadcasts rank 0's parameters (`nbytes`) to every other rank, each a gloo message. (The
    rendezvous and the shape check's few hundred bytes are left out.)"""
    wire, acks = wire_bytes(nbytes, mtu)
    return (matrix.n_peers - 1) * (wire + acks + GLOO_MESSAGE_BYTES)
