"""Ablation: how many bits diloco's outer updates need, against the quality they cost.

    python -m geotrain.node.bench.outer_codecs [--peers 4] [--steps 600] [--inner-steps 30]
        [--fraction 0.02] [--seeds 2] [--param d_model=64 ...] [--json]

A controlled comparison in one process, with no links and no clock: the `gpt` task (a small
shape by default), `--peers` workers on their shards, each taking the same inner steps (AdamW by
the task's recipe) from the same start. Every `--inner-steps` steps each worker's pseudo-gradient
(round start - its model) goes through the codec with error feedback (a residual per worker and
tensor, as a node keeps), the decoded updates are averaged exactly (as an all-reduce would) and
DiLoCo's outer Nesterov step (the node's defaults, 0.7 / 0.9) moves the round start. Arms:

    one process     one worker alone, the same steps and batch (the baseline every swarm must beat)
    diloco fp32     the pseudo-gradients uncompressed
    topk:F+none     the largest F of each tensor's update, 32-bit values, Rice-coded gaps
    topk:F+int8 / +int4 / +int2 / +sign     8, 4, 2 and 1-bit values

Every arm runs the same seeds (model initialisation, shards, batch order); the table gives the
held-out bits per byte at the end (mean over seeds, and the spread), its gap to diloco fp32 and
to one process, and the bits per parameter per sync measured on the wire (the payload a worker
sends, headers and names included, over the model's parameters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from geotrain import compress
from geotrain.gossip import NesterovOuter

from ..training import TaskContext, gpt, schedule_factor, stdlib_corpus

VALUE_BITS = ("none", "int8", "int4", "int2", "sign")
SMALL = {"d_model": 64, "layers": 2, "heads": 4, "context": 64, "batch_size": 16}


def _task(shard: int, shards: int, seed: int, params: dict):
    return gpt(TaskContext(shard_index=shard, num_shards=shards, seed=seed, params=dict(params)))


class _Worker:
    """One worker's model, data and inner optimizer (AdamW with the task's recipe)."""

    def __init__(self, shard: int, shards: int, seed: int, params: dict, total: int) -> None:
        task = _task(shard, shards, seed, params)
        self.model, self.batches, self.loss = task.model, task.batches, task.loss
        self.evaluate, self.lr, self.recipe = task.evaluate, task.lr, task.recipe
        self.total = total
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=task.lr,
                                     weight_decay=task.recipe.weight_decay)  # fmt: skip
        self.step_count = 0

    def step(self) -> None:
        r = self.recipe
        factor = schedule_factor(self.step_count, r.warmup_steps, self.total, r.schedule,
                                 r.min_lr_ratio)  # fmt: skip
        for group in self.opt.param_groups:
            group["lr"] = self.lr * factor
        x, y = next(self.batches)
        self.opt.zero_grad(set_to_none=True)
        self.loss(self.model, (x, y)).backward()
        if r.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), r.clip_grad_norm)
        self.opt.step()
        self.step_count += 1


def run_arm(arm: str, *, peers: int, steps: int, inner: int, seed: int, params: dict) -> dict:
    """Train one arm; returns its final held-out bits per byte and its bits/param per sync."""
    torch.manual_seed(seed)
    if arm == "one process":
        w = _Worker(0, 1, seed, params, steps)
        for _ in range(steps):
            w.step()
        return {"loss": w.evaluate(w.model), "bits": 0.0}
    workers = [_Worker(i, peers, seed, params, steps) for i in range(peers)]
    names = [n for n, _ in workers[0].model.named_parameters()]
    numel = sum(p.numel() for p in workers[0].model.parameters())
    start = {n: p.detach().clone() for n, p in workers[0].model.named_parameters()}
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    codec = None if arm == "diloco fp32" else compress.get_codec(arm)
    feedback = [compress.ErrorFeedback(codec) for _ in workers] if codec else []
    sent_bits, rounds = 0.0, 0
    for done in range(inner, steps + inner, inner):
        for w in workers:
            for _ in range(min(inner, steps - w.step_count)):
                w.step()
        mean = {n: torch.zeros_like(t) for n, t in start.items()}
        for i, w in enumerate(workers):
            params_now = dict(w.model.named_parameters())
            delta = [(n, start[n] - params_now[n].detach()) for n in names]
            if codec is None:
                got, nbytes = delta, 4 * numel
            else:
                data = compress.encode_named(delta, codec, error_feedback=feedback[i],
                                             seed=seed * 7919 + done * 131 + i)  # fmt: skip
                got, nbytes = compress.decode_named(data, max_numel=numel), len(data)
            sent_bits += 8 * nbytes / numel / peers
            for n, t in got:
                mean[n] += t.float() / peers
        rounds += 1
        outer.step(start, mean)
        for w in workers:
            with torch.no_grad():
                for n, p in w.model.named_parameters():
                    p.copy_(start[n])
        if done >= steps:
            break
    return {"loss": workers[0].evaluate(workers[0].model), "bits": sent_bits / rounds}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600, help="inner steps of every worker")
    ap.add_argument("--inner-steps", type=int, default=30, help="H, steps per outer round")
    ap.add_argument("--fraction", type=float, default=0.02, help="top-k's kept fraction")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a gpt task parameter over the small shape's (e.g. d_model=128)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the arms run one after the other; one thread is the fair unit
    params = dict(SMALL)
    for kv in args.param:
        key, _, value = kv.partition("=")
        params[key] = int(value) if value.isdigit() else value
    with tempfile.TemporaryDirectory() as corpus:
        if "corpus" not in params:  # walk the standard library once, not once per worker
            text = stdlib_corpus(int(params.get("max_bytes", 4_000_000)))
            (Path(corpus) / "corpus.py").write_bytes(text)
            params["corpus"] = corpus
        rows = _run(args, params)
    _print(args, params, rows)


def _run(args, params: dict) -> list[dict]:
    arms = ["one process", "diloco fp32"] + [f"topk:{args.fraction}+{v}" for v in VALUE_BITS]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in range(args.seeds):
        for arm in arms:
            results[arm].append(
                run_arm(
                    arm,
                    peers=args.peers,
                    steps=args.steps,
                    inner=args.inner_steps,
                    seed=seed,
                    params=params,
                )
            )
    return _table(results)


def _print(args, params: dict, rows: list[dict]) -> None:
    params = {k: v for k, v in params.items() if k != "corpus"}
    if args.json:
        print(json.dumps({"args": vars(args), "params": params, "rows": rows}, indent=1))
        return
    print(f"gpt {params}, {args.peers} workers, {args.steps} steps, H={args.inner_steps}, "
          f"{args.seeds} seeds; held-out bits per byte at the end")  # fmt: skip
    print(f"{'arm':<22}{'bits/param/sync':>16}{'loss':>9}{'spread':>8}{'vs fp32':>9}{'vs one':>9}")
    for r in rows:
        print(f"{r['arm']:<22}{r['bits_per_param']:>16.4f}{r['loss']:>9.4f}{r['spread']:>8.4f}"
              f"{r['gap_fp32']:>+9.2%}{r['gap_one']:>+9.2%}")  # fmt: skip


def _table(results: dict[str, list[dict]]) -> list[dict]:
    mean = {arm: statistics.mean(r["loss"] for r in rs) for arm, rs in results.items()}
    rows = []
    for arm, rs in results.items():
        losses = [r["loss"] for r in rs]
        rows.append({
            "arm": arm, "loss": mean[arm], "spread": max(losses) - min(losses),
            "bits_per_param": statistics.mean(r["bits"] for r in rs),
            "gap_fp32": mean[arm] / mean["diloco fp32"] - 1,
            "gap_one": mean[arm] / mean["one process"] - 1,
        })  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
