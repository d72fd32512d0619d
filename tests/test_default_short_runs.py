"""Short runs with the default settings: three peers never end worse than one process alone.

A new user's first run is a few hundred steps. With the default [gossip] settings, three peers
(in memory, on trio's virtual clock: tests/_memory_swarm.py) each take the same number of steps
as one process alone, from the same seed, on a small GPT; every peer must end at a held-out loss
no worse than that process's.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from _memory_swarm import daemon_trainer, node_config, train_in_memory

PEERS = 3
# a small GPT on a small corpus (a few standard-library files: walking all of it takes minutes on
# a busy box), so that a few hundred steps of three peers take seconds
PARAMS = {"d_model": 48, "layers": 2, "heads": 4, "context": 48, "batch_size": 8,
          "eval_windows": 64, "max_bytes": 300_000}  # fmt: skip


def _corpus(root: Path) -> str:
    folder = root / "corpus"
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "dataclasses.py", "typing.py", "pathlib.py", "inspect.py"):
        source = stdlib / name
        if not source.is_file():  # a stdlib laid out otherwise (pathlib became a package)
            source = next(stdlib.glob(f"{name[:-3]}/*.py"))
        (folder / name).write_bytes(source.read_bytes())
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("steps", [100, 200])
async def test_three_default_peers_end_no_worse_than_one_process(tmp_path, autojump_clock, steps):
    params = {**PARAMS, "corpus": _corpus(tmp_path)}
    training = {"task": "gpt", "params": params, "eval_every": 10_000, "num_shards": PEERS}
    peers = await train_in_memory(tmp_path, {"training": training}, PEERS,
                                  lambda ps: all(p.trainer.step >= steps for p in ps),
                                  settle_s=5.0)  # fmt: skip
    swarm = [p.trainer.evaluate() for p in peers]

    alone_config = node_config(tmp_path, {"training": {**training, "num_shards": 1}}, 0)
    alone = daemon_trainer(alone_config)
    for _ in range(max(p.trainer.step for p in peers)):
        alone.train_step()
    one = alone.evaluate()
    # bits per byte: lower is better
    assert max(swarm) <= one, (steps, swarm, one)
