"""Step overhead of geotrain in your own loop: steps/s of a wrapped loop vs the same loop bare.

    python -m geotrain.node.bench.loop [--model mlp|gpt] [--hidden 1024] [--batch N]
        [--comm-fraction F] [--steps 400] [--repeats 3] [--json]

One core for the loop (this process is pinned to core 0 with one torch thread), a peer in another
process on core 1 running the same loop through geotrain.join. The loop: AdamW and gradient clipping
on generated batches, of either an MLP of `--hidden` wide layers (1024: 1.1M parameters; batches of
`--batch` 64 by default) or (`--model gpt`) the `gpt` task's 1m decoder (1.07M parameters, context
128; batches of `--batch` 16 sequences by default: 2,048 tokens a step). The two models have the
same size, so the same exchanges, and a step of very different cost: what the wrapper costs is the
exchanges' work over the step's compute. Bare and wrapped runs of `--steps` steps take turns,
`--repeats` times each; the wrapped node exchanges every 4 steps (adpsgd, codec none) with the peer
over loopback, and the peer with it (both start exchanges: each node takes part in about one every 2
of its steps), and its network and tensor work runs on the same core as the loop. During a bare run
the peer steps its own optimizer without the swarm (SIGUSR1; SIGUSR2 back), so that nobody starts an
exchange and the bare loop, which runs in the same process as the joined node, shares its core with
nothing of geotrain's, while the other core carries the same training load in both runs. Before
2026-12-02 the node went on answering the peer's exchanges during the bare runs, which hid about
half the cost; from then until 2026-12-05 the peer was stopped (SIGSTOP) during them, which left the
bare loop the whole machine's shared cache and memory bandwidth: its forward and backward passes ran
8-10% faster than the same loop's beside a busy neighbour, which counted against the wrapper, and
the peer's pauses made the number of exchanges in a wrapped run vary 4x. The figure is the median
wrapped rate over the median bare rate (goal >= 0.95).

With `--comm-fraction F` both nodes pace their exchanges by gossip.comm_fraction instead: the
next exchange waits until the last one's time is at most F of the steps' time between them (from
every 4 steps up to every 1000). That is the setting that bounds the wrapper's cost when a step
is short.

Both processes flush denormal floats to zero (torch.set_flush_denormal): on random batches the
model learns nothing, its values decay into denormals, and a plain loop here slowed from 117 to
53 steps/s within 4,000 steps, bare and wrapped alike, which made every run slower than the one
before it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

CONFIG = """
[identity]
open_swarm = true
[training]
wait_for_peers = 1
eval_every = 1000000
[gossip]
exchange_every = 4
codec = "none"
probe_interval_s = 1.0
[state]
checkpoint_every = 1000000
"""


CONTEXT = 128  # the gpt model's sequence length here


def make_model(kind: str, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from ..training import GPT, GPT_SIZES

        size = GPT_SIZES["1m"]
        return GPT(CONTEXT, size.d_model, size.layers, size.heads)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))  # fmt: skip


def _batch(kind: str, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Generated inputs and targets (flattened for cross_entropy) for `kind`."""
    if kind == "gpt":
        tokens = torch.randint(0, 256, (batch, CONTEXT + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)
    return torch.randn(batch, 64, generator=gen), torch.randint(0, 10, (batch,), generator=gen)


def run_loop(model: nn.Module, opt, steps: int, gen: torch.Generator, kind: str = "mlp",
             batch: int = 64) -> float:  # fmt: skip
    """Steps a second of `steps` steps of the loop (opt: the optimizer or the wrapped one)."""
    started = time.perf_counter()
    for _ in range(steps):
        x, y = _batch(kind, batch, gen)
        loss = nn.functional.cross_entropy(model(x).reshape(y.numel(), -1), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return steps / (time.perf_counter() - started)


def _config(root: Path, name: str, bootstrap: str | None, comm_fraction: float = 0.0) -> Path:
    """A node config (and key) for this benchmark under `root`."""
    from geotrain.node import Identity

    Identity.generate().save(root / f"{name}.key")
    text = CONFIG.replace("[identity]\n", f'[identity]\nkey = "{root / name}.key"\n')
    text = text.replace("[state]\n", f'[state]\ndir = "{root / name}"\n')
    text = text.replace("[gossip]\n", f"[gossip]\ncomm_fraction = {comm_fraction}\n")
    if bootstrap:
        text += f'[network]\nbootstrap = ["{bootstrap}"]\n'
    else:  # the first node: nobody to wait for (it prints its address once joined)
        text = text.replace("wait_for_peers = 1", "wait_for_peers = 0")
    path = root / f"{name}.toml"
    path.write_text(text)
    return path


def _one_core(core: int) -> None:
    """This process on `core` with one torch thread, denormals flushed (see above)."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


def peer(root: Path, kind: str, hidden: int, batch: int, comm_fraction: float) -> None:
    """The other node: the same loop, joined, until SIGTERM; from SIGUSR1 to SIGUSR2 it steps
    its optimizer itself (the swarm hears of no step, so it starts no exchanges)."""
    import geotrain

    _one_core(1)
    model = make_model(kind, hidden)
    bare = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGUSR1, lambda *_: bare.set())
    signal.signal(signal.SIGUSR2, lambda *_: bare.clear())
    with geotrain.join(_config(root, "peer", None, comm_fraction), model) as swarm:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = swarm.wrap(inner)
        print(swarm.address, flush=True)  # (the signals' handlers are in place)
        gen = torch.Generator().manual_seed(1)
        while True:  # (bare, a mix that arrives waits for the next wrapped step: timing only)
            run_loop(model, inner if bare.is_set() else opt, 1, gen, kind, batch)


def measure(kind: str, hidden: int, batch: int, steps: int, repeats: int,
            comm_fraction: float = 0.0) -> dict:  # fmt: skip
    import geotrain

    _one_core(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        other = subprocess.Popen(
            [sys.executable, "-m", "geotrain.node.bench.loop", "--role", "peer", "--root",
             str(root), "--model", kind, "--hidden", str(hidden), "--batch", str(batch),
             "--comm-fraction", str(comm_fraction)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            address = other.stdout.readline().strip()  # type: ignore[union-attr]
            bare_model, joined_model = make_model(kind, hidden), make_model(kind, hidden)
            bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-3)
            gen = torch.Generator().manual_seed(0)
            run_loop(bare_model, bare_opt, 20, gen, kind, batch)  # warm-up
            with geotrain.join(_config(root, "me", address, comm_fraction), joined_model) as swarm:
                opt = swarm.wrap(torch.optim.AdamW(joined_model.parameters(), lr=1e-3))
                run_loop(joined_model, opt, 20, gen, kind, batch)
                bare, wrapped = [], []
                for _ in range(repeats):
                    other.send_signal(signal.SIGUSR1)  # the peer steps bare too: no exchanges
                    time.sleep(0.5)  # (those in flight end)
                    bare.append(run_loop(bare_model, bare_opt, steps, gen, kind, batch))
                    other.send_signal(signal.SIGUSR2)
                    wrapped.append(run_loop(joined_model, opt, steps, gen, kind, batch))
                status = swarm.status()
        finally:
            other.send_signal(signal.SIGTERM)
            peer_exit = other.wait(60)  # 0: it ran the whole time and left on SIGTERM
    numel = sum(p.numel() for p in bare_model.parameters())
    return {
        "model": kind, "batch": batch, "comm_fraction": comm_fraction, "parameters": numel,
        "steps": steps,
        "bare_steps_per_s": bare, "wrapped_steps_per_s": wrapped,
        "ratio": statistics.median(wrapped) / statistics.median(bare),
        "exchanges_ok": status.exchanges_ok, "exchanges_failed": status.exchanges_failed,
        "peer_exit": peer_exit,
    }  # fmt: skip


def _rate(steps_per_s: float) -> float:
    """A rate as printed: 3 significant digits."""
    return float(f"{steps_per_s:.3g}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "gpt"))
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's width")
    parser.add_argument("--batch", type=int, help="samples (mlp: 64) or sequences (gpt: 16) a step")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--comm-fraction", type=float, default=0.0,
                        help="gossip.comm_fraction of both nodes (0: an exchange every 4 steps)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", default="main", choices=("main", "peer"))
    parser.add_argument("--root", type=Path)
    args = parser.parse_args(argv)
    from ..cli import configure_logging

    configure_logging("warning", "console")
    batch = args.batch if args.batch is not None else 16 if args.model == "gpt" else 64
    if batch < 1:
        parser.error(f"--batch {batch}: expected at least 1")
    if args.role == "peer":
        peer(args.root, args.model, args.hidden, batch, args.comm_fraction)
        return
    r = measure(args.model, args.hidden, batch, args.steps, args.repeats, args.comm_fraction)
    if args.json:
        print(json.dumps(r))
        return
    what = "MLP" if r["model"] == "mlp" else f"GPT (context {CONTEXT})"
    print(f"{what} of {r['parameters']:,} parameters, batches of {r['batch']}, {r['steps']} "
          "steps a run, one core")
    print(f"bare loop:    {[_rate(x) for x in r['bare_steps_per_s']]} steps/s")
    print(f"with geotrain: {[_rate(x) for x in r['wrapped_steps_per_s']]} steps/s "
          f"({r['exchanges_ok']} exchanges, {r['exchanges_failed']} failed)")
    print(f"wrapped / bare: {r['ratio']:.2f} (goal >= 0.95)")


if __name__ == "__main__":
    main()
