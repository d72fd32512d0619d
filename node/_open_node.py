# A node inside the caller's own trio program (`open_node`). Invariants: the block is entered
# once the node listens; leaving it, Ctrl-C, or the node's end stops the node cleanly before the
# block exits; an error of the node reaches the caller as itself, not in an exception group.
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ._config import NodeConfig
from ._credentials import load_identity
from ._node import Node
from ._signals import stop_on_ctrl_c
from .identity import Admission, Identity
from .training import Diverged


@asynccontextmanager
async def open_node(
    config: NodeConfig, *, identity: Identity | None = None, admission: Admission | None = None
) -> AsyncIterator[Node]:
    """Run a node inside the caller's trio program; yields it once it listens.

    Training runs in the background; leaving the block asks the node to stop and waits for its
    clean shutdown (exchange finished or abandoned, checkpoint written, swarm told). Ctrl-C
    stops it the same way, then raises KeyboardInterrupt (see stop_on_ctrl_c).

    Args:
        config: the node's configuration.
        identity, admission: given directly, or (both None) loaded from `config.identity`.

    Raises:
        ConfigError: the identity files are wrong; MemoryBudgetError (a ConfigError): the config
            does not fit limits.memory_gb. ResumeError: the state directory holds another
            algorithm's checkpoint. ValueError: the task cannot be built.
    """
    if identity is None or admission is None:
        identity, admission = load_identity(config)
    node = Node(config, identity, admission)
    await node.prepare()
    interrupted, diverged = trio.Event(), []
    async with trio.open_nursery() as nursery:

        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            try:
                await node.run(task_status=task_status)
            except* Diverged as group:  # raised after the block, not in an exception group
                diverged.extend(leaf_errors(group))
                nursery.cancel_scope.cancel()  # the block ends with the node

        await nursery.start(run)
        watching = trio.CancelScope()
        nursery.start_soon(stop_on_ctrl_c, node, watching, interrupted, nursery.cancel_scope)
        try:
            yield node
        finally:
            watching.cancel()
            node.request_stop()
    if diverged:
        raise diverged[0]
    if interrupted.is_set():  # (raised here, outside the nursery: a plain KeyboardInterrupt)
        raise KeyboardInterrupt


def leaf_errors(group: BaseExceptionGroup) -> list[BaseException]:
    """The errors inside trio's (nested) exception groups, in order."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += leaf_errors(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out
