"""Fine-tuning a frozen base through geotrain.join: what an exchange carries, side by side.

    python -m geotrain.node.bench.frozen [--base-millions 100] [--steps 30] [--json]

Two library-run nodes on loopback, in this process, each train a model of a base of square
4096-wide layers (`--base-millions` parameters, float32) and a 4096 x 256 head (1.05M
parameters), AdamW on what trains, an exchange every 2 steps (adpsgd, codec none). It runs twice:
with the base frozen (requires_grad False before join: only the head travels) and with the whole
model trainable (what an exchange carried before frozen parameters were left out). Printed per
run: bytes each node sent, exchanges, the seconds of the steps, the base unchanged or not, and
this process's peak resident memory so far (both nodes; the second run's includes the first's).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

WIDTH, HEAD = 4096, 256

CONFIG = """
[identity]
open_swarm = true
[gossip]
exchange_every = 2
codec = "none"
[state]
checkpoint_every = 1000000
status_every_s = 0.5
"""


def build(layers: int, frozen: bool) -> nn.Module:
    torch.manual_seed(0)  # every peer loads the same base
    base = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    for layer in base:
        nn.init.normal_(layer.weight, std=WIDTH**-0.5)
    model = nn.Sequential(base, nn.Linear(WIDTH, HEAD))
    if frozen:
        base.requires_grad_(False)
    return model


def run(layers: int, frozen: bool, steps: int) -> dict:
    # Two nodes' checkpoints of a 10^8 base are ~0.4 GB: the folder goes when the run ends.
    with tempfile.TemporaryDirectory(prefix="bench_frozen.") as tmp:
        return _run(Path(tmp), layers, frozen, steps)


def _run(tmp: Path, layers: int, frozen: bool, steps: int) -> dict:
    import geotrain
    from geotrain.node import Admission, Identity, config_from_toml

    from .._memory import peak_rss_mb
    from ..state import read_status

    def join(name: str, model: nn.Module, *overrides: str) -> geotrain.Swarm:
        config = config_from_toml(CONFIG, base=tmp,
                                  overrides=[f'state.dir="{tmp / name}"', *overrides])  # fmt: skip
        return geotrain.join(config, model, identity=Identity.generate(),
                             admission=Admission.open_swarm("bench-frozen"))  # fmt: skip

    models = [build(layers, frozen), build(layers, frozen)]
    corner = models[0][0][0].weight[:64, :64].clone()
    a = join("a", models[0], "training.wait_for_peers=0")
    try:
        b = join("b", models[1], f'network.bootstrap=["{a.address}"]', "training.wait_for_peers=1")
    except BaseException:
        a.close()  # (before its folder goes)
        raise

    def loop(swarm, model: nn.Module, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = swarm.wrap(torch.optim.AdamW(trained, lr=1e-3))
        for _ in range(steps):
            loss = model(torch.randn(8, WIDTH, generator=gen)).pow(2).mean()
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
            time.sleep(0.1)  # room for the exchanges in flight

    started = time.perf_counter()
    try:
        threads = [threading.Thread(target=loop, args=(s, m, i))
                   for i, (s, m) in enumerate([(a, models[0]), (b, models[1])])]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - started
    finally:
        b.close()  # (a mix that arrived after the loops' last steps is applied here)
        a.close()
    # the last statuses, written as the nodes stopped: every exchange counted with its bytes
    statuses = [read_status(s.node.state.status) for s in (a, b)]
    head = sum(p.numel() for p in models[0][1].parameters())
    return {
        "frozen": frozen,
        "base_params": layers * WIDTH * WIDTH,
        "trained_params": head + (0 if frozen else layers * WIDTH * WIDTH),
        "bytes_out_mb": [round(s["bytes_out"] / 1e6, 1) for s in statuses],
        # of which state sync's (a's serving of b's fetch at its join), and the rest: the
        # exchanges' bytes with the membership's and the probes' (small beside a model's)
        "sync_out_mb": [round(s["sync_bytes_out"] / 1e6, 1) for s in statuses],
        "exchange_out_mb": [round((s["bytes_out"] - s["sync_bytes_out"]) / 1e6, 1)
                            for s in statuses],  # fmt: skip
        "exchanges_ok": [s["exchanges_ok"] for s in statuses],
        "exchanges_failed": [s["exchanges_failed"] for s in statuses],
        "steps_s": round(seconds, 1),
        "base_unchanged": bool(torch.equal(models[0][0][0].weight[:64, :64], corner)),
        "peak_rss_gb": round(peak_rss_mb() / 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-millions", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only-frozen", action="store_true", help="skip the trainable run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    layers = max(1, round(args.base_millions * 1e6 / (WIDTH * WIDTH)))
    import structlog

    from ..cli import configure_logging

    if not structlog.is_configured():
        configure_logging("warning", "auto")
    results = [run(layers, True, args.steps)]
    if not args.only_frozen:
        results.append(run(layers, False, args.steps))
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        sent = sum(r["exchange_out_mb"])
        print(f"base {r['base_params'] / 1e6:.1f}M {'frozen' if r['frozen'] else 'trained'}, "
              f"{r['trained_params'] / 1e6:.2f}M trained: {sent:.1f} MB sent in "
              f"{sum(r['exchanges_ok'])} exchanges ({r['exchanges_failed']} failed; state sync "
              f"{sum(r['sync_out_mb']):.1f} MB besides), "
              f"{r['steps_s']} s of steps, base unchanged: {r['base_unchanged']}, "
              f"peak RSS so far {r['peak_rss_gb']} GB")  # fmt: skip
    if args.json or len(results) < 2:
        return
    if sum(results[0]["exchanges_ok"]) and sum(results[1]["exchanges_ok"]):
        per = [sum(r["exchange_out_mb"]) / sum(r["exchanges_ok"]) for r in results]
        print(f"MB sent per exchange: {per[0]:.2f} frozen vs {per[1]:.2f} trained "
              f"({per[1] / per[0]:.0f}x)")


if __name__ == "__main__":
    main()
