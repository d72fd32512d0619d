# A training node whose exchanges the swarm refuses as another model's: a node that resumed from
# its own checkpoint (or started a swarm first) is not checked by state sync, and with other
# parameter names, shapes or frozen values every exchange it started failed at info level while
# it trained alone. Invariants: only the algorithms' requests are watched (state sync checks its
# own); the node is stopped only when MISMATCH_PEERS distinct peers refused and none accepted an
# exchange since the start (a node that exchanges with anyone is in a mixed swarm, not the odd
# one out: it says so once and trains on); nothing here changes what a request returns.
from __future__ import annotations

from collections.abc import Callable

import structlog

from ._state_sync import MISMATCH_PEERS, ModelMismatch
from .algorithms import MODELS_DIFFER, Network
from .transport import ErrorReply, Header, PeerInfo

log = structlog.get_logger()


class MismatchWatch:
    """The transport as the algorithms see it, watching their replies for refusals of our model.

    Args:
        network: the transport.
        ours: describes our model for the error ("N tensors, M parameters ...").
        stop: called once with the ModelMismatch when the node must stop.
    """

    def __init__(
        self, network: Network, ours: Callable[[], str], stop: Callable[[ModelMismatch], None]
    ) -> None:
        self._network = network
        self._ours = ours
        self._stop = stop
        self.refused: set[str] = set()  # peers that refused an exchange as another model's
        self.accepted: set[str] = set()  # peers that answered an exchange
        self._said: set[str] = set()
        self.stopped = False

    async def request(
        self,
        address: str,
        header: Header,
        payload: bytes | bytearray | memoryview = b"",
        *,
        deadline_s: float,
        expect_peer: str | None = None,
    ) -> tuple[Header, bytearray, PeerInfo]:
        reply, data, peer = await self._network.request(
            address, header, payload, deadline_s=deadline_s, expect_peer=expect_peer
        )
        if isinstance(reply, ErrorReply):
            if reply.reason.startswith(MODELS_DIFFER):
                self._refused_by(peer.peer_id)
        else:
            self.accepted.add(peer.peer_id)
        return reply, data, peer

    def _refused_by(self, peer: str) -> None:
        self.refused.add(peer)
        if self.stopped:
            return
        if len(self.refused) >= MISMATCH_PEERS and not self.accepted:
            self.stopped = True
            names = ", ".join(sorted(p[:12] for p in self.refused))
            self._stop(ModelMismatch(
                f"the model differs from the swarm's: {len(self.refused)} peer(s) ({names}) "
                "refused this node's exchanges as another model's and none accepted one "
                f"(ours: {self._ours()}): other parameter names or shapes, or other frozen "
                "parameters or values. Every peer must build the same model, freeze the same "
                "parameters (requires_grad False) and load the same frozen values before "
                "joining; this node stopped (checkpoint, leave)"
            ))  # fmt: skip
        elif peer not in self._said:
            self._said.add(peer)
            log.error("exchange_refused_model", peer=peer[:12], refused=len(self.refused),
                      accepted=len(self.accepted),
                      detail="this peer refuses our exchanges as another model's (other "
                      "parameter names, shapes or frozen values): we do not mix with it. "
                      f"With {MISMATCH_PEERS} such peers and none that accepts, this node "
                      "stops")  # fmt: skip
