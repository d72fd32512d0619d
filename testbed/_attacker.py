# The testbed's attacker process: a real `geotrain node run` whose trainer is armed with an
# attack (testbed/_attacks.py) after the node built it and before it runs. Invariants: the only
# way to start one is this module's entry point, which the testbed launches for the peers of a
# scenario's [[attackers]]; the node's config, CLI and code know nothing of it (the attack is not
# a config key: a node config naming one is refused); the process is otherwise a node like the
# others (same config, same launcher, same state directory layout, same status and logs).
# Importing this module does not import torch (the testbed's launcher imports it).
from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from geotrain.node import NodeProcess

from ._peers import Host, child_env
from ._scenario import ATTACK_KINDS, TestbedScenario


def attacker_argv(config: Path, overrides: Sequence[str], kind: str, n_peers: int,
                  n_attackers: int) -> list[str]:  # fmt: skip
    """The attacker entry point's command line (the node's own arguments after `--`)."""
    argv = [sys.executable, "-m", "geotrain.testbed._attacker", "--attack", kind,
            "--n-peers", str(n_peers), "--n-attackers", str(n_attackers), "--config", str(config)]
    for item in overrides:  # fmt: skip
        argv += ["--set", item]
    return argv


def start_attacker(host: Host, config: Path, state: Path, overrides: Sequence[str], kind: str,
                   scenario: TestbedScenario) -> NodeProcess:  # fmt: skip
    """Start peer `host` as an attacker of `kind` (its log beside its state directory, as a
    node's). Only the testbed calls this, for the scenario's [[attackers]]."""
    argv = attacker_argv(config, overrides, kind, scenario.n_peers, len(scenario.attackers))
    proc = NodeProcess(argv, state.with_suffix(".log"), child_env(), host.prefix,
                       config=config, state=state)  # fmt: skip
    proc.start()
    return proc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m geotrain.testbed._attacker",
                                description="a testbed peer that attacks (never for production)")
    p.add_argument("--attack", required=True, choices=ATTACK_KINDS)
    p.add_argument("--n-peers", type=int, required=True)
    p.add_argument("--n-attackers", type=int, required=True)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--set", action="append", default=[])
    return p  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run a node armed with an attack until SIGINT/SIGTERM (or its max_steps)."""
    import structlog
    import trio

    from geotrain.node import ConfigError, Node, load_config, load_identity
    from geotrain.node.cli import configure_logging

    args = _parser().parse_args(argv)
    configure_logging("info", "json")
    try:
        config = load_config(args.config, args.set)
        node = Node(config, *load_identity(config))
    except ConfigError as exc:
        print(f"attacker: {exc}", file=sys.stderr)
        return 2
    log = structlog.get_logger()

    async def run() -> None:
        from ._attacks import Attack, arm

        await node.prepare()
        trainer = node.trainer  # the node's own, armed in place
        attack = Attack(args.attack, trainer.snapshot(), n_peers=args.n_peers,
                        n_attackers=args.n_attackers, seed=config.training.shard_index)
        arm(trainer, attack)  # fmt: skip
        log.warning("attacker_armed", attack=args.attack, peer=config.training.shard_index)
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        node.request_stop()

            nursery.start_soon(stop_on_signal)
            await node.run()
            nursery.cancel_scope.cancel()

    trio.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
