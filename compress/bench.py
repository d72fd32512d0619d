# Invariants: every row of one run is measured on the same input, thread setting and machine, so
# ratios between rows (codec vs memcpy, topk vs torch.topk) are the meaningful figures; absolute
# GB/s are of float32 input bytes (4 * numel / seconds), best of `repeat` runs after a warm-up (the
# box is shared: the minimum is the least disturbed run).
"""Codec speed benchmark: `python -m compress.bench [--json] [--sizes 1000000,...] [--quick]`.

Rows per size: every codec in CODECS, plus baselines measured in the same run:
`memcpy` (copy into a fresh buffer, as every encoder must produce one), `memcpy_prealloc` (copy
into a buffer allocated beforehand: the pure bandwidth bound) and `torch.topk` at 1%.
"""

from __future__ import annotations

import argparse
import json
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


def _timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    result = fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def _row(codec: str, n: int, enc_s: float, dec_s: float, ratio: float, err: float) -> dict:
    return {
        "codec": codec,
        "numel": n,
        "encode_gbps": 4 * n / enc_s / 1e9,
        "decode_gbps": 4 * n / dec_s / 1e9,
        "ratio": ratio,
        "rel_error": err,
    }


def _rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(x))


def _baselines(x: torch.Tensor, repeat: int) -> list[dict]:
    n = x.numel()
    copy_s, _ = _timed(lambda: torch.empty_like(x).copy_(x), repeat)
    dst = torch.empty_like(x)
    pre_s, _ = _timed(lambda: dst.copy_(x), repeat)
    k = n // 100
    top_s, top = _timed(lambda: torch.topk(x.abs(), k, sorted=False), max(1, repeat // 2))

    def scatter():
        out = torch.zeros_like(x)
        out[top.indices] = x[top.indices]
        return out

    scat_s, sparse = _timed(scatter, repeat)
    return [
        _row("memcpy", n, copy_s, copy_s, 1.0, 0.0),
        _row("memcpy_prealloc", n, pre_s, pre_s, 1.0, 0.0),
        _row("torch.topk", n, top_s, scat_s, 4 * n / (8 * k), _rel_error(x, sparse)),
    ]


def _codec_row(spec: str, x: torch.Tensor, repeat: int) -> dict:
    codec = get_codec(spec)
    n = x.numel()
    t = x.view(n // 1000, 1000) if codec.name == "powersgd" else x
    enc_s, data = _timed(lambda: codec.encode(t, seed=1), repeat)
    dec_s, y = _timed(lambda: decode(data, max_numel=n), repeat)
    row = _row(spec, n, enc_s, dec_s, 4 * n / len(data), _rel_error(t, y))
    if codec.name == "topk":
        row["k_error"] = int((y != 0).sum()) / codec.k_for(n) - 1
    return row


def run(sizes=DEFAULT_SIZES, codecs=CODECS, repeat: int = 3) -> dict:
    """Measure every codec and baseline; return {"rows": [...], "threads": int}."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        x = torch.randn(n, generator=gen)
        rows += _baselines(x, repeat)
        rows += [_codec_row(spec, x, repeat) for spec in codecs]
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
    parser = argparse.ArgumentParser(prog="python -m compress.bench", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="comma-separated element counts (multiples of 1000)",
    )
    parser.add_argument("--codecs", default=",".join(CODECS), help="semicolon-separated specs")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one small size, one repeat")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    codecs = args.codecs.split(";") if args.codecs != ",".join(CODECS) else CODECS
    if args.quick:
        sizes, args.repeat = [100_000], 1
    if any(n <= 0 or n % 1000 for n in sizes):
        parser.error(f"--sizes {args.sizes!r}: expected positive multiples of 1000")
    result = run(sizes, codecs, args.repeat)
    print(json.dumps(result) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
