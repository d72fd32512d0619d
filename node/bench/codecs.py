"""What a fixed codec does to an algorithm's accuracy: two digits nodes, side by side.

    python -m geotrain.node.bench.codecs [--algorithms adpsgd,dpsgd]
        [--codecs none,int8,topk:0.1,topk:0.01,randk:0.1,unscaled] [--steps 300]
        [--step-ms 20] [--exchange-every 2]

For each algorithm and codec: two `digits-mlp` nodes in this process (geotrain.open_node, open
swarm on 127.0.0.1, shards 0 and 1 of 2, one torch thread each, both waiting for the other
before their first step), `gossip.codec` fixed, every step padded to `--step-ms` (compute
emulation, so that both train at the same pace whatever the box is doing), `--steps` steps;
then each node's held-out accuracy at its last step, its last training loss and the exchanges
it counted. Node a is the one node b bootstraps to.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import trio

CODECS = "none,int8,topk:0.1,topk:0.01,randk:0.1,unscaled"
BASE = """
[identity]
open_swarm = true
[network]
listen = "tcp://127.0.0.1:0"
[training]
task = "digits-mlp"
threads = 1
eval_every = 50
wait_for_peers = 1
num_shards = 2
[gossip]
probe_interval_s = 0.2
state_sync = false
[state]
status_every_s = 0.25
checkpoint_every = 1000000
"""


async def run_pair(algorithm: str, codec: str, steps: int, step_ms: float,
                   exchange_every: int) -> dict:  # fmt: skip
    """Two nodes trained `steps` steps with `codec`; each one's accuracy, loss and exchanges."""
    import geotrain
    from geotrain.node import Admission, Identity, config_from_toml

    admission = Admission.open_swarm("bench-codecs")
    settings = [f'gossip.algorithm="{algorithm}"', f'gossip.codec="{codec}"',
                f"gossip.exchange_every={exchange_every}", f"training.max_steps={steps}",
                f"training.step_time_ms={step_ms}"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:

        def config(name: str, index: int, *extra: str):
            return config_from_toml(BASE, base=Path(tmp), overrides=[
                *settings, f'state.dir="{tmp}/{name}"', f"training.shard_index={index}", *extra])

        async with geotrain.open_node(config("a", 0), identity=Identity.generate(),
                                      admission=admission) as a:  # fmt: skip
            joining = config("b", 1, f'network.bootstrap=["{a.address}"]')
            async with geotrain.open_node(joining, identity=Identity.generate(),
                                          admission=admission) as b:  # fmt: skip
                with trio.fail_after(120 + 3 * steps * step_ms / 1000):
                    while min(a.status().metric_step or 0, b.status().metric_step or 0) < steps:
                        await trio.sleep(0.1)
                ends = [a.status(), b.status()]
    return {
        "algorithm": algorithm, "codec": codec,
        "accuracy": [s.metric for s in ends], "loss": [s.loss for s in ends],
        "exchanges_ok": [s.exchanges_ok for s in ends],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="adpsgd,dpsgd")
    parser.add_argument("--codecs", default=CODECS,
                        help="comma-separated; a codec's own commas follow it (randk:0.1,unscaled)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--exchange-every", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    from ..cli import configure_logging

    configure_logging("error", "console")  # an entry point: keep stdout for the results
    codecs = split_codecs(args.codecs)
    if not args.json:
        print(f"two digits-mlp nodes, {args.steps} steps of {args.step_ms:g} ms, an exchange "
              f"every {args.exchange_every}; accuracy and last loss of node a / node b")
        print(f"{'algorithm':<9} {'codec':<20} {'accuracy a / b':>15} {'loss a / b':>17} "
              f"{'exchanges':>10}")  # fmt: skip
    for algorithm in args.algorithms.split(","):
        for codec in codecs:
            r = trio.run(run_pair, algorithm, codec, args.steps, args.step_ms,
                         args.exchange_every)  # fmt: skip
            if args.json:
                print(json.dumps(r), flush=True)
                continue
            acc = " / ".join(f"{x:.3f}" for x in r["accuracy"])
            loss = " / ".join(f"{x:.3g}" for x in r["loss"])
            print(f"{algorithm:<9} {codec:<20} {acc:>15} {loss:>17} "
                  f"{r['exchanges_ok'][0]:>10}", flush=True)  # fmt: skip


def split_codecs(text: str) -> list[str]:
    """'none,randk:0.1,unscaled,int8' -> ['none', 'randk:0.1,unscaled', 'int8']: a part with no
    ':' that is not a codec's name belongs to the codec before it."""
    from geotrain import compress

    names = set(compress.codec_names())
    out: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if out and ":" not in part and part.split("+")[0] not in names:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


if __name__ == "__main__":
    main()
