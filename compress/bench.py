# Invariants: every row of one run is measured on the same input, thread setting and machine, so
# ratios between rows (codec vs memcpy, topk vs torch.topk) are the meaningful figures; absolute
# GB/s are of float32 input bytes (4 * numel / seconds), best of `repeat` interleaved rounds (the
# box is shared: the minimum is the least disturbed run).
"""Codec speed benchmark: `python -m geotrain.compress.bench [--json] [--sizes N,...] [--quick]`.

Rows per size: every codec in CODECS, plus baselines measured in the same run:
`memcpy` (copy into a fresh buffer, as every encoder must produce one), `memcpy_prealloc` (copy
into a buffer allocated beforehand: the pure bandwidth bound) and `torch.topk` at 1%.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import torch

from ._base import decode
from ._spec import get_codec

CODECS = (
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:stochastic",
    "int4",
    "qsgd:levels=16",
    "sign",
    "topk:0.01",
    "topk:0.01+int8",
    "randk:0.01",
    "powersgd:rank=4",
)
DEFAULT_SIZES = (1_000_000, 10_000_000, 25_000_000)


def _best_times(tasks: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best time of each task over `rounds` rounds; every round runs every task once, so a
    disturbance on the shared machine hits all rows alike instead of one row's whole series."""
    best = dict.fromkeys(tasks, math.inf)
    for _ in range(rounds):
        for name, fn in tasks.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(x))


def _measure_size(x: torch.Tensor, codecs, rounds: int) -> list[dict]:
    n, k = x.numel(), x.numel() // 100
    dst = torch.empty_like(x)
    top = torch.topk(x.abs(), k, sorted=False)

    def scatter():
        out = torch.zeros_like(x)
        out[top.indices] = x[top.indices]
        return out

    rows = {
        "memcpy": dict(ratio=1.0, rel_error=0.0),
        "memcpy_prealloc": dict(ratio=1.0, rel_error=0.0),
        "torch.topk": dict(ratio=4 * n / (8 * k), rel_error=_rel_error(x, scatter())),
    }
    enc = {
        "memcpy": lambda: torch.empty_like(x).copy_(x),
        "memcpy_prealloc": lambda: dst.copy_(x),
        "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
    }
    dec = {
        "memcpy": enc["memcpy"],
        "memcpy_prealloc": enc["memcpy_prealloc"],
        "torch.topk": scatter,
    }
    for spec in codecs:
        codec = get_codec(spec)
        t = x.view(n // 1000, 1000) if codec.name == "powersgd" else x
        data = codec.encode(t, seed=1)
        y = decode(data, max_numel=n)
        rows[spec] = dict(ratio=4 * n / len(data), rel_error=_rel_error(t, y))
        if codec.name == "topk":
            rows[spec]["k_error"] = int((y != 0).sum()) / codec.k_for(n) - 1
        enc[spec] = lambda codec=codec, t=t: codec.encode(t, seed=1)
        dec[spec] = lambda data=data: decode(data, max_numel=n)
    enc_s, dec_s = _best_times(enc, rounds), _best_times(dec, rounds)
    return [
        {
            "codec": name,
            "numel": n,
            "encode_gbps": 4 * n / enc_s[name] / 1e9,
            "decode_gbps": 4 * n / dec_s[name] / 1e9,
            **extra,
        }
        for name, extra in rows.items()
    ]


def run(sizes=DEFAULT_SIZES, codecs=CODECS, repeat: int = 3) -> dict:
    """Measure every codec and baseline; return {"rows": [...], "threads": int}."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        rows += _measure_size(torch.randn(n, generator=gen), codecs, repeat)
    return {"rows": rows, "threads": torch.get_num_threads()}


def _table(result: dict) -> str:
    lines = [
        f"threads={result['threads']}",
        f"{'codec':<18}{'numel':>10}{'enc GB/s':>10}{'dec GB/s':>10}{'ratio':>9}"
        f"{'rel_err':>9}{'enc/copy':>9}",
    ]
    copy = {r["numel"]: r["encode_gbps"] for r in result["rows"] if r["codec"] == "memcpy"}
    for r in result["rows"]:
        lines.append(
            f"{r['codec']:<18}{r['numel']:>10}{r['encode_gbps']:>10.3f}{r['decode_gbps']:>10.3f}"
            f"{r['ratio']:>9.1f}{r['rel_error']:>9.4f}{r['encode_gbps'] / copy[r['numel']]:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m geotrain.compress.bench", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="comma-separated element counts (multiples of 1000)",
    )
    parser.add_argument("--codecs", default=",".join(CODECS), help="semicolon-separated specs")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; best time counts")
    # One thread by default: on a shared 2-core box a 2-thread op stalls at its barrier whenever
    # the other core is taken, which punishes codecs made of many ops far more than one memcpy.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="one small size, one repeat")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    codecs = args.codecs.split(";") if args.codecs != ",".join(CODECS) else CODECS
    if args.quick:
        sizes, args.repeat = [100_000], 1
    if any(n <= 0 or n % 1000 for n in sizes):
        parser.error(f"--sizes {args.sizes!r}: expected positive multiples of 1000")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(args.threads or threads)
        result = run(sizes, codecs, args.repeat)
    finally:
        torch.set_num_threads(threads)
    print(json.dumps(result) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
