# The hivemind baseline: one worker per peer running `hivemind.Optimizer` (hivemind 1.1.12) on the
# same task, shard, model initialisation, optimizer, schedule and clipping (the task's recipe at
# its learning rate, as the DDP ranks; the rate follows the local step count as in a geotrain
# node, not hivemind's epochs) and slowdown as the geotrain nodes, in the peer's namespace behind
# the same emulated links. Invariants: settings come whole from the testbed (`--settings`, see
# _baselines.HIVEMIND_PRESETS), never from defaults of our own; a peer's DHT listens on its own
# address only; every peer writes its DHT addresses to `--maddrs-dir/peer-NN.json` before its
# first step and bootstraps from peer 0's; a peer whose file is there already is a restarted one:
# it bootstraps from every other peer's and loads the swarm's state; a first start waits for every
# peer's optimizer, and after its first step until its tracker counts every peer (hivemind
# publishes a peer's progress only once it has samples), so that nobody trains alone while the
# others start (as geotrain nodes wait for their peers); metrics lines use the node's format and
# add hivemind's epoch and peer count; hivemind's own status lines go to the worker's log; a
# peer keeps its hivemind key across restarts (`--maddrs-dir/peer-NN.rsa`);
# SIGTERM ends the loop and shuts hivemind down; only the testbed imports this module (hivemind
# is an optional extra).
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from geotrain.node import EvalCadence, TaskContext, resolve_task

from ._ddp import pad_step

BOOTSTRAP_WAIT_S = 180.0  # peer 0's torch + hivemind import on 2 busy cores
OVERRUN_S = 120.0  # the worker stops itself this long after --duration if nobody stopped it


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m geotrain.testbed._hivemind")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--host", required=True, help="the IPv4 address this peer's DHT listens on")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--maddrs-dir", type=Path, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--settings", required=True, help="JSON: a preset of _baselines, as run")
    p.add_argument("--system", required=True, help="the name in the metrics lines")
    p.add_argument("--task", default="digits-mlp")
    p.add_argument("--params", default="{}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slowdown", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-every-s", type=float, default=0.0)
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--partition", default="iid", help="iid, or dirichlet label skew")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="compute emulation: pad each local step to this (x slowdown)")
    return p.parse_args(argv)


def _compression(name: str) -> Any:
    import hivemind.compression as c

    return {
        "none": c.NoCompression, "fp16": c.Float16Compression,
        "uniform8bit": c.Uniform8BitQuantization, "quantile8bit": c.Quantile8BitQuantization,
    }[name]()  # fmt: skip


def _batch_size(batch: Any) -> int:
    """Samples in one batch: the first dimension of its first tensor (1 if it has none)."""
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 1


def _initial_peers(maddrs_dir: Path, rank: int, rejoining: bool, stop) -> list[str]:
    """Peer 0's DHT addresses (waited for), or on a rejoin every other peer's."""
    if rank == 0 and not rejoining:
        return []
    deadline = time.monotonic() + BOOTSTRAP_WAIT_S
    first = maddrs_dir / "peer-00.json"
    while not first.exists() and not rejoining:
        if time.monotonic() > deadline or stop():
            raise SystemExit(f"hivemind peer {rank}: peer 0 published no DHT address in time")
        time.sleep(0.2)
    found = []
    for path in sorted(maddrs_dir.glob("peer-*.json")):
        if path.name != f"peer-{rank:02d}.json":
            found += json.loads(path.read_text())
    return found


def _barrier(maddrs_dir: Path, world: int, stop) -> None:
    """Wait until every peer has its optimizer (as the geotrain nodes wait for their peers), so
    the first peer up does not train alone for the seconds the others take to import."""
    deadline = time.monotonic() + BOOTSTRAP_WAIT_S
    while len(list(maddrs_dir.glob("peer-*.json"))) < world:
        if time.monotonic() > deadline or stop():
            return  # train with whoever came: the summary shows the late peers' start
        time.sleep(0.1)


def _keep_identity(maddrs_dir: Path, rank: int) -> None:
    """Make this peer's hivemind key (its process-wide RSA key, which signs its progress
    records in the DHT) the same across restarts, as a restarted machine of a real swarm would
    keep its identity: a restarted worker then replaces its own progress record instead of
    leaving the killed one's for the others to count for `metadata_expiration` (60 s), a ghost
    peer that made every local step an epoch. The key is the worker's own file (mode 0600)."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.utils.crypto import RSAPrivateKey

    path = maddrs_dir / f"peer-{rank:02d}.rsa"
    if path.exists():
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = serialization.load_der_private_key(path.read_bytes(), password=None)
    else:
        key = RSAPrivateKey()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.to_bytes())
        tmp.replace(path)
    RSAPrivateKey._process_wide_key = key


def _wait_for_swarm(opt: Any, world: int, stop) -> None:
    """After a first start's first step: wait until hivemind's tracker counts every peer (a peer
    publishes its progress only once it has samples), so that no peer's first epochs are solo."""
    deadline = time.monotonic() + BOOTSTRAP_WAIT_S
    while opt.tracker.global_progress.num_peers < world:
        if time.monotonic() > deadline or stop():
            return  # train with whoever came: the metrics lines show the peer count
        time.sleep(0.1)


def _last_step(metrics: Path) -> int:
    """The step a restarted worker counts on from (its previous run's last line)."""
    for line in reversed(metrics.read_text(errors="replace").splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from the kill
    return 0


def follow_recipe(task: Any, inner: torch.optim.Optimizer, lr: float, step: int) -> None:
    """Before the local step after `step` others: clip this peer's gradients and set the rate
    the task's recipe gives at that step (what a node's Trainer and the DDP ranks do; hivemind's
    own scheduler would follow its epochs instead)."""
    task.recipe.clip(task.model.parameters())
    for group in inner.param_groups:
        group["lr"] = lr * task.recipe.lr_factor(step)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    settings = json.loads(args.settings)
    stopping = False

    def on_term(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    import hivemind  # after the handler: the import takes seconds

    started = time.monotonic()
    ctx = TaskContext(shard_index=args.rank, num_shards=args.world, seed=args.seed,
                      partition=args.partition, alpha=args.alpha,
                      params=json.loads(args.params))  # fmt: skip
    task = resolve_task(args.task)(ctx)
    first_batch = next(task.batches)
    batches = itertools.chain([first_batch], task.batches)
    batch = _batch_size(first_batch)
    target_batch = settings["target_batch_size"] or batch * args.world
    mine = args.maddrs_dir / f"peer-{args.rank:02d}.json"
    # written before the first step of a first start: a kill at any step after that is a rejoin
    rejoining = mine.exists()
    _keep_identity(args.maddrs_dir, args.rank)

    dht = hivemind.DHT(
        initial_peers=_initial_peers(args.maddrs_dir, args.rank, rejoining, lambda: stopping),
        host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
        start=True,
    )
    lr = settings["lr"] or task.lr
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=args.run_id,
        batch_size_per_step=batch,
        target_batch_size=target_batch,
        optimizer=partial(task.recipe.build_optimizer, lr=lr),  # as _ddp.task_optimizer
        params=task.model.parameters(),
        use_local_updates=settings["use_local_updates"],
        matchmaking_time=settings["matchmaking_time"],
        averaging_timeout=settings["averaging_timeout"],
        average_state_every=settings["average_state_every"],
        grad_compression=_compression(settings["grad_compression"]),
        state_averaging_compression=_compression(settings["state_averaging_compression"]),
        verbose=True,  # hivemind's status lines (averaging rounds, state loads) in the log
    )
    tmp = mine.with_suffix(".tmp")
    tmp.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    tmp.replace(mine)
    if rejoining:
        print("rejoining: loading the swarm's state", file=sys.stderr, flush=True)
        opt.load_state_from_peers()
    else:
        _barrier(args.maddrs_dir, args.world, lambda: stopping)
    joined = time.monotonic()
    cadence = EvalCadence(args.eval_every, args.eval_every_s)
    step, metric, metric_step = _last_step(args.metrics) if rejoining and args.metrics.exists() \
        else 0, None, None  # fmt: skip
    step0 = step
    assembled = rejoining
    try:
        with open(args.metrics, "a") as out:
            while not stopping:
                t0 = time.perf_counter()
                loss = task.loss(task.model, next(batches))
                loss.backward()
                follow_recipe(task, opt.state_averager.optimizer, lr, step)
                opt.step()  # accumulates, averages (when the swarm's batch is full) and applies
                opt.zero_grad()
                step += 1
                pad_step(t0, args.step_ms, args.slowdown)
                if not assembled:
                    _wait_for_swarm(opt, args.world, lambda: stopping)
                    assembled, joined, step0 = True, time.monotonic(), step
                if cadence.due(step):
                    with cadence.evaluating(), torch.no_grad():
                        task.model.eval()
                        metric, metric_step = float(task.evaluate(task.model)), step
                        task.model.train()
                elapsed = time.monotonic() - joined
                out.write(json.dumps({
                    "system": args.system, "t": time.time(), "pid": os.getpid(),
                    "elapsed_s": round(time.monotonic() - started, 4), "step": step,
                    "loss": float(loss.detach()), "metric": metric, "metric_step": metric_step,
                    "steps_per_s": (step - step0) / elapsed if elapsed > 0 else 0.0,
                    "eval_s": round(cadence.spent_s, 4), "epoch": opt.local_epoch,
                    "target_batch_size": target_batch,
                    "hivemind_peers": opt.tracker.global_progress.num_peers,
                }) + "\n")  # fmt: skip
                out.flush()
                if args.duration and elapsed >= args.duration + OVERRUN_S:
                    break
    finally:
        opt.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
