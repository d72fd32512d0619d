# `geotrain node init DIR`: one machine's node folder (a key and a commented node.toml), and what
# to do next. Invariants: nothing is overwritten (an existing node.toml or node.key stops it before
# anything is written); the config it writes is parsed with the node's own config code before it
# is written, so a bad address or shard fails here, naming the option, and never at `node run`.
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .._config import ConfigError, config_from_toml
from ..identity import Identity, KeyFileError

TEMPLATE = """\
# A geotrain node: `geotrain node run --config {config}`. Every key and its default:
# node/_config.py in the geotrain source; relative paths are relative to this file.

[identity]
key = "node.key"                     # this machine's identity (never share it)
swarm = "swarm.json"                 # the swarm's public file, from the operator
certificate = "member.cert.json"     # this node's membership, from `geotrain swarm admit`

[network]
{network}
[training]
# a built-in task, or "my_package.tasks:my_task" (see docs/how-to/own-task.md)
task = "{task}"
# this machine's part of the data, out of num_shards
shard_index = {shard_index}
num_shards = {num_shards}
# device = "auto"                    # CUDA when present, else CPU

[gossip]
algorithm = "adpsgd"

[state]
dir = "state"                        # checkpoints, status.json, metrics.jsonl

# [metrics]
# listen = "127.0.0.1:9400"          # Prometheus metrics (no authentication: keep it local)
"""


REACHABLE = """\
listen = "{listen}"
# the address other machines dial to reach this one
advertise = "{advertise}"
# running members to join through; empty for the first machine
bootstrap = [{bootstrap}]
# behind NAT (nobody can dial this machine)? `geotrain node init --client`, or reachable =
# false, listen = "tcp://127.0.0.1:0", no advertise, and a bootstrap list of reachable members
# (docs/how-to/nat.md)
"""

CLIENT = """\
# client mode (docs/how-to/nat.md): nobody can dial this machine, so it dials the members
# below, keeps those connections and starts every exchange itself
reachable = false
listen = "tcp://127.0.0.1:0"         # loopback only: for `geotrain status` on this machine
# reachable members to join through (at least one)
bootstrap = [{bootstrap}]
"""


def _shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected INDEX/COUNT with INDEX from 0 "
                                         "to COUNT - 1, e.g. 0/3 (shards 0, 1 and 2 of 3)")
    return int(index), int(count)


def node_init(args: argparse.Namespace) -> int:
    folder: Path = args.dir
    config_path, key_path = folder / "node.toml", folder / "node.key"
    bootstrap = ", ".join(f'"{b}"' for b in args.bootstrap)
    if args.client:
        if args.advertise or args.listen:
            print("geotrain node init: --client: a client is dialled by nobody, so it takes no "
                  "--advertise and listens on loopback (no --listen)", file=sys.stderr)
            return 2
        network = CLIENT.format(bootstrap=bootstrap)
    elif not args.advertise:
        print("geotrain node init: --advertise tcp://HOST:PORT (the address other machines "
              "dial), or --client for a machine nobody can dial (behind NAT)", file=sys.stderr)
        return 2
    else:
        port = args.advertise.rpartition(":")[2]
        network = REACHABLE.format(listen=args.listen or f"tcp://0.0.0.0:{port}",
                                   advertise=args.advertise, bootstrap=bootstrap)  # fmt: skip
    text = TEMPLATE.format(
        config=config_path, network=network, task=args.task, shard_index=args.shard[0],
        num_shards=args.shard[1],
    )  # fmt: skip
    try:
        config_from_toml(text, base=folder)
        if ":" not in args.task:  # a module of the user's own may only import on the machine
            from ..training import resolve_task  # torch: only here, not for every command

            resolve_task(args.task)
    except (ConfigError, ValueError) as exc:
        print(f"geotrain node init: {exc}", file=sys.stderr)
        return 2
    existing = [str(p) for p in (config_path, key_path) if p.exists()]
    if existing:
        print(f"geotrain node init: {', '.join(existing)}: already there, refusing to overwrite",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        folder.mkdir(parents=True, exist_ok=True)
        identity = Identity.generate()
        identity.save(key_path)
        config_path.write_text(text)
    except (OSError, KeyFileError) as exc:
        print(f"geotrain node init: {exc}", file=sys.stderr)
        return 1
    print(f"peer_id {identity.peer_id}")
    print(f"config {config_path.resolve()}")
    print(f"next: send the peer ID to the swarm operator, who runs\n"
          f"  geotrain swarm admit --swarm AUTHORITY_DIR {identity.peer_id} --expires 30d\n"
          f"and sends back the certificate and swarm.json; save them as\n"
          f"  {folder / 'member.cert.json'} and {folder / 'swarm.json'}\n"
          f"then start the node:\n"
          f"  geotrain node run --config {config_path}")  # fmt: skip
    return 0


def register_node_init(node_sub: argparse._SubParsersAction) -> None:
    """Add `geotrain node init` to the `node` command's subcommands."""
    p = node_sub.add_parser("init", help="create a node folder: a key and a commented node.toml")
    p.add_argument("dir", type=Path, help="the folder to create (or an empty one)")
    p.add_argument("--advertise", metavar="tcp://HOST:PORT",
                   help="the address other machines dial to reach this node (or --client)")
    p.add_argument("--client", action="store_true",
                   help="a machine nobody can dial (behind NAT): client mode, with --bootstrap")
    p.add_argument("--listen", default=None, metavar="tcp://HOST:PORT",
                   help="where to listen (default: 0.0.0.0, the advertised port)")  # fmt: skip
    p.add_argument("--bootstrap", action="append", default=[], metavar="tcp://HOST:PORT",
                   help="a running member to join through (repeat for more)")  # fmt: skip
    p.add_argument("--task", default="digits-mlp", help="the training task (default digits-mlp)")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="INDEX/COUNT",
                   help="this machine's part of the data, e.g. 0/3 (default 0/1)")  # fmt: skip
    p.set_defaults(handler=node_init)
