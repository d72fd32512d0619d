"""One site of several ranks: DDP (or FSDP2) inside the site, geotrain between sites.

    torchrun --nproc-per-node 2 site_torchrun.py --config node.toml    # a site of 2 ranks
    python site_torchrun.py --ranks 2 --config node.toml               # the same (starts torchrun)
    python site_torchrun.py --ranks 1 --config node.toml               # a site of one process

Every rank runs this script with the site's one node.toml (one identity, one certificate).
Rank r's node listens on network.listen's port + r and dials the bootstrap ports + r: rank r
exchanges its 1/N share of the model with rank r of the partner site. The model learns a fixed
random teacher; each step takes a global batch of --batch rows, split between the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import geotrain


def batch(step: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (the same on every rank and for any rank count)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, 16, generator=gen)
    return x, teacher(x)


def teacher(x: torch.Tensor) -> torch.Tensor:
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    return torch.tanh(x @ w) + 0.1 * x[:, :1]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank and site
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="the site's node.toml (default: geotrain "
                   "local's for this process)")  # fmt: skip
    p.add_argument("--ranks", type=int, default=1, help="start torchrun with this many ranks "
                   "(when not already under torchrun)")  # fmt: skip
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32, help="the site's global batch")
    p.add_argument("--data-seed", type=int, default=1, help="which data this site sees")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--pace-ms", type=float, default=0.0, help="sleep this long per step")
    p.add_argument("--out", default=None, help="write each rank's results to OUT.rank<r> (JSON) "
                   "and the site's model to OUT.model.pt")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=0, help="record the held-out loss every "
                   "this many steps (0: only at the end)")  # fmt: skip
    args = p.parse_args()
    if "RANK" not in os.environ and args.ranks > 1:  # the launcher: torchrun, on this script
        from torch.distributed.run import main as torchrun

        torchrun(["--standalone", f"--nproc-per-node={args.ranks}", sys.argv[0], *sys.argv[1:]])
        return
    rank, world = 0, 1
    # a GPU per rank where there are enough (NCCL inside the site), else CPU and gloo
    cuda = torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        sys.exit(f"--batch {args.batch}: must split evenly between {world} ranks")
    model = make_model().to(device)
    wrapped = model
    if world > 1 and args.fsdp:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    elif world > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None)
    x_eval, y_eval = (t.to(device) for t in batch(-1, 512, seed=999))
    sgd = torch.optim.SGD(wrapped.parameters(), lr=args.lr, momentum=0.9)
    trace: list[float] = []
    with geotrain.join(args.config, wrapped) as swarm:
        opt = swarm.wrap(sgd)
        while swarm.step < args.steps:
            x, y = batch(swarm.step, args.batch, args.data_seed)
            x, y = x[rank::world].to(device), y[rank::world].to(device)  # this rank's part
            loss = F.mse_loss(wrapped(x), y)
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
            time.sleep(args.pace_ms / 1000)
            if args.eval_every and swarm.step % args.eval_every == 0:  # (every rank: FSDP)
                with torch.no_grad():
                    trace.append(round(F.mse_loss(wrapped(x_eval), y_eval).item(), 6))
        with torch.no_grad():  # (FSDP: every rank runs the forward pass)
            held_out = F.mse_loss(wrapped(x_eval), y_eval).item()
        status = swarm.status()
    with torch.no_grad():  # (the whole model on every rank: FSDP gathers its shards)
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        digest = sum(float(t.double().sum()) * (i + 1) for i, t in enumerate(whole))
    if rank == 0:
        print(f"done: step {swarm.step}, held-out mse {held_out:.5f}, "
              f"{status.exchanges_ok} exchanges", flush=True)  # fmt: skip
    if args.out and rank == 0:  # the site's whole model, by name
        names = [n for n, _ in model.named_parameters()]
        torch.save({n: t.detach().cpu() for n, t in zip(names, whole, strict=True)},
                   f"{args.out}.model.pt")  # fmt: skip
    if args.out:
        with open(f"{args.out}.rank{rank}", "w") as f:
            json.dump({"rank": rank, "world": world, "step": swarm.step, "held_out": held_out,
                       "exchanges_ok": status.exchanges_ok, "digest": digest,
                       "held_out_trace": trace}, f)  # fmt: skip
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
