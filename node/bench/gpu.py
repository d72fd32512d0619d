"""The GPU path, checked and measured on the device there is (the CPU where there is none).

    python -m geotrain.node.bench.gpu [--millions 100] [--size 25m] [--steps 30] [--json]

In one process, on `cuda` when torch sees one (else the CPU, said in the output, with a smaller
default model so that it ends in a few minutes):

- step time: the `gpt` task (`--size`) trained by the daemon's trainer, in the precision the
  node picks by default (bf16 autocast on CUDA) and in fp32, `--steps` steps each after a warm-up;
- exchange from device memory: two adpsgd nodes, each on its own secure transport over loopback,
  both models a `wide-linear` of `--millions` parameters on the device, average with codec none
  (chunks through each stream's pinned host buffer); printed are the exchange's goodput, whether
  both models became the mean, each staging buffer's size, and the peak device memory and peak
  host memory (the process's resident memory; both nodes live in it) over the model's bytes;
- joining overhead: the gpt model's steps/s with a partner exchanging every 4 steps (the partner
  answers from this process, on the same device) over the same loop bare, taking turns.

The checks (models averaged, host memory with no copy of the model on a device) are printed as
ok or FAILED; the exit status is 1 when one failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
import trio

from .._allocator import tune_allocator
from .._config import GossipConfig
from .._memory import BUFFERS_PER_CHUNK, peak_rss_mb, reset_peak_rss, rss_mb
from ..algorithms import window_chunks
from ..cli import configure_logging
from ..identity import Identity
from ..training import TaskContext, Trainer, resolve_task
from .exchange import CHUNK_NUMEL, adpsgd_runtime, secure_transports

# On a device, what an exchange may add to host memory per node: the memory estimate's chunks
# in flight and one pinned staging buffer (a host copy of the model would be one more copy)
HOST_BOUND_BYTES = (window_chunks(4 * CHUNK_NUMEL) * BUFFERS_PER_CHUNK + 1) * 4 * CHUNK_NUMEL


def pick_device() -> tuple[torch.device, str]:
    """The device measured, and how the output names it."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return torch.device("cuda"), f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return torch.device("cpu"), "CPU: no CUDA device here, the CPU path measured"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpt_trainer(device: torch.device, size: str, precision: str) -> Trainer:
    ctx = TaskContext(device=device, params={"size": size})
    return Trainer(resolve_task("gpt")(ctx), precision=precision)


def step_time(device: torch.device, size: str, precision: str, steps: int) -> dict:
    """Seconds per step of the gpt task in `precision` (after 3 warm-up steps)."""
    trainer = _gpt_trainer(device, size, precision)
    for _ in range(3):
        trainer.train_step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        loss = trainer.train_step().loss
    _sync(device)
    numel = sum(t.numel() for t in trainer.params().values())
    return {"precision": trainer.precision, "step_s": (time.perf_counter() - started) / steps,
            "loss": loss, "parameters": numel}  # fmt: skip


@dataclass
class _Pair:
    trainers: list[Trainer]
    algos: list
    transports: list


@contextlib.asynccontextmanager
async def _pair(trainers: list[Trainer], exchange_every: int = 4) -> AsyncIterator[_Pair]:
    """Two adpsgd nodes of `trainers` on secure transports over loopback (codec none)."""
    gossip = GossipConfig(codec="none", exchange_every=exchange_every)
    ids = [Identity.generate() for _ in trainers]
    algos: list = [None, None]

    def handler_for(i: int):
        async def handler(peer, header, payload):
            return await algos[i].handle(peer, header, payload)

        return handler

    async with trio.open_nursery() as nursery, secure_transports(ids, handler_for) as transports:
        for i in range(2):
            other = 1 - i
            algos[i], _, _ = adpsgd_runtime(
                trainers[i], gossip, ids[i].peer_id,
                {ids[other].peer_id: transports[other].address}, transports[i], i,
                nursery.start_soon,
            )  # fmt: skip
        yield _Pair(trainers, algos, transports)
        nursery.cancel_scope.cancel()


def _device_peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


async def exchange_from_device(device: torch.device, millions: float, repeats: int) -> dict:
    """Exchanges of two wide-linear models on `device`: goodput, averaging, memory peaks."""
    trainers = [
        Trainer(resolve_task("wide-linear")(TaskContext(
            device=device, shard_index=i, num_shards=2, params={"millions": millions})))
        for i in range(2)
    ]  # fmt: skip
    with torch.no_grad():  # models apart, so that the mean is a check
        for k, t in enumerate(trainers):
            for p in t.params().values():
                p.add_(0.01 * k)
    model_bytes = sum(t.numel() * t.element_size() for t in trainers[0].params().values())
    async with _pair(trainers) as pair:
        a = pair.algos[0]
        before = [{n: p.reshape(-1)[:4096].clone() for n, p in t.params().items()}
                  for t in trainers]  # fmt: skip
        if not await a.exchange_once():  # (warm-up: first touch of every buffer)
            raise RuntimeError("the warm-up exchange failed")
        _sync(device)
        mean = {n: (before[0][n] + before[1][n]) / 2 for n in before[0]}
        averaged = all(torch.allclose(t.params()[n].reshape(-1)[:4096], mean[n], atol=1e-5)
                       for t in trainers for n in mean)  # fmt: skip
        host_before = rss_mb() or 0.0
        host_reset = reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        device_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        times, moved = [], []
        for _ in range(repeats):
            stats = pair.transports[0].statistics()
            started = time.perf_counter()
            if not await a.exchange_once():
                raise RuntimeError("an exchange failed")
            _sync(device)
            times.append(time.perf_counter() - started)
            after = pair.transports[0].statistics()
            moved.append(after.bytes_out - stats.bytes_out + after.bytes_in - stats.bytes_in)
        host_peak = peak_rss_mb()
        device_peak = _device_peak(device)
        staging = [t.chunk_staging("exchange") for t in trainers]
    seconds = statistics.median(times)
    return {
        "model_mb": model_bytes / 1e6, "exchange_s": times, "bytes": statistics.median(moved),
        "gbps": statistics.median(moved) * 8 / seconds / 1e9, "averaged": averaged,
        "host_before_mb": host_before, "host_peak_mb": host_peak, "host_peak_reset": host_reset,
        "host_extra_copies": (host_peak - host_before) * 1e6 / model_bytes,
        "device_before_mb": None if device_before is None else device_before / 1e6,
        "device_peak_mb": None if device_peak is None else device_peak / 1e6,
        "device_extra_copies": None if device_peak is None or device_before is None
        else (device_peak - device_before) / model_bytes,
        "staging": [None if s is None else vars(s.statistics()) for s in staging],
    }  # fmt: skip


async def joining_overhead(device: torch.device, size: str, steps: int, repeats: int) -> dict:
    """Steps/s of the gpt task with a partner exchanging (every 4 steps) over the same loop bare,
    in turns; the partner answers from this process."""
    trainers = [_gpt_trainer(device, size, "auto") for _ in range(2)]
    async with _pair(trainers, exchange_every=4) as pair:
        me, algo = trainers[0], pair.algos[0]

        async def run(joined: bool) -> float:
            _sync(device)
            started = time.perf_counter()
            for _ in range(steps):
                result = await trio.to_thread.run_sync(me.train_step)
                if joined:
                    await algo.after_step(result)
            while algo.busy():  # (the last exchange ends inside the measured time)
                await trio.sleep(0.005)
            _sync(device)
            return steps / (time.perf_counter() - started)

        await run(False)  # warm-up
        bare, joined = [], []
        for _ in range(repeats):
            bare.append(await run(False))
            joined.append(await run(True))
        exchanges = algo.counters.statistics().ok
    return {"bare_steps_per_s": bare, "joined_steps_per_s": joined, "exchanges": exchanges,
            "ratio": statistics.median(joined) / statistics.median(bare)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    device, words = pick_device()
    cuda = device.type == "cuda"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, default=100.0 if cuda else 4.0,
                        help="the exchanged wide-linear model (default 100 on CUDA, 4 on CPU)")
    parser.add_argument("--size", default="25m" if cuda else "1m",
                        help="the gpt task's size (default 25m on CUDA, 1m on CPU)")
    parser.add_argument("--steps", type=int, default=30 if cuda else 8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    configure_logging("warning", "console")  # an entry point: keep stdout for the results
    tune_allocator()  # as a node does at start
    if not cuda:  # (two shared cores: torch's many threads made each step wait on the others)
        torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = [{**step_time(device, args.size, p, args.steps), "asked": p} for p in ("auto", "fp32")]
    exchange = trio.run(exchange_from_device, device, args.millions, args.repeats)
    overhead = trio.run(joining_overhead, device, args.size, args.steps, args.repeats)
    checks = {"models averaged": exchange["averaged"]}
    if cuda:
        bound = 2 * HOST_BOUND_BYTES / 1e6  # (both nodes live in this process)
        checks[f"host memory: chunk buffers only (<= {bound:.0f} MB, no copy of the model)"] = (
            exchange["host_peak_mb"] - exchange["host_before_mb"] <= bound)
        checks["staging pinned"] = all(s and s["pinned"] for s in exchange["staging"])
    result = {"device": words, "steps": steps, "exchange": exchange, "overhead": overhead,
              "checks": checks}  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        _print(result, args)
    sys.exit(0 if all(checks.values()) else 1)


def _print(r: dict, args) -> None:
    print(f"device: {r['device']}")
    for s in r["steps"]:
        print(f"step time, gpt {args.size} ({s['parameters'] / 1e6:.1f}M parameters), "
              f"precision {s['asked']} ({s['precision']}): {s['step_s'] * 1e3:.1f} ms "
              f"(loss {s['loss']:.3f})")
    ex = r["exchange"]
    width = round(math.sqrt(args.millions * 1e6))
    print(f"exchange from {'device' if 'CPU' not in r['device'] else 'host'} memory, "
          f"{width}x{width} float32 ({ex['model_mb']:.0f} MB), codec none: "
          f"{statistics.median(ex['exchange_s']):.2f} s median of "
          f"{[round(t, 2) for t in ex['exchange_s']]}, {ex['bytes'] / 1e6:.0f} MB both ways = "
          f"{ex['gbps']:.2f} Gbit/s")
    if ex["device_peak_mb"] is not None:
        print(f"peak device memory during exchanges: {ex['device_peak_mb']:.0f} MB "
              f"(+{ex['device_extra_copies']:.2f} model copies over {ex['device_before_mb']:.0f} "
              "MB, both nodes)")
    peak = "peak" if ex["host_peak_reset"] else "peak since start (not reset)"
    print(f"host memory: {ex['host_before_mb']:.0f} MB before, {peak} {ex['host_peak_mb']:.0f} MB"
          f" during exchanges (+{ex['host_extra_copies']:.2f} model copies, both nodes)")
    for i, s in enumerate(ex["staging"]):
        print(f"node {i} staging buffer: " + ("none (the model is in host memory)" if s is None
              else f"{s['nbytes'] / 2**20:.1f} MiB, pinned {s['pinned']}, "
              f"{s['allocations']} allocation(s), {s['to_host']} chunks out, "
              f"{s['to_device']} in"))  # fmt: skip
    o = r["overhead"]
    print(f"joining overhead: {statistics.median(o['joined_steps_per_s']):.2f} steps/s joined "
          f"({o['exchanges']} exchanges) vs {statistics.median(o['bare_steps_per_s']):.2f} bare: "
          f"{o['ratio']:.3f}x (goal >= 0.95)")
    for name, ok in r["checks"].items():
        print(f"check {name}: {'ok' if ok else 'FAILED'}")


if __name__ == "__main__":
    main()
