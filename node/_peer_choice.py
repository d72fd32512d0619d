# Peer choice: the one object through which an algorithm sees the swarm. Invariants: it reads
# membership (who is live, where) and the link table, and is the only writer of link outcomes and
# partner feedback on behalf of the algorithms; every deadline it gives comes from the link's
# measured estimate; codec choice is per link, from its bandwidth and our step time, unless the
# config fixes one codec; nothing here does I/O; a client-mode peer (its address a client address:
# behind NAT, nobody dials it) is never a partner: it is live, and exchanges only as the initiator.
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from geotrain import compress
from geotrain.gossip import LinkTable, PartnerSelector, choose_codec, is_client_address

from ._config import GossipConfig

# What a pairwise model exchange may be encoded with when the link decides: dense codecs only. A
# sparse codec of a whole model (not of a change) would zero most weights; sparse codecs belong to
# algorithms that send changes (choco, diloco), and only when the config names them.
DENSE_LADDER = ("none", "fp16", "int8", "int4")
HALF_CODECS = {"bfloat16": "bf16", "float16": "fp16"}  # a half-precision model's exact codec


def model_dtype(dtypes: Iterable[object]) -> str | None:
    """The one dtype every parameter has ("bfloat16", "float32", ...), or None when they differ."""
    names = {str(d).removeprefix("torch.") for d in dtypes}
    return names.pop() if len(names) == 1 else None
DEFAULT_STEP_S = 0.05  # before two steps were timed: a guess that only sways the first codec


class MembershipView(Protocol):
    """Who is live and where (the node's membership)."""

    def live_peers(self) -> Sequence[str]: ...

    def address_of(self, peer_id: str) -> str | None: ...


Shapes = Sequence[tuple[str, tuple[int, ...]]]


class PeerChoice:
    """Partners, codecs and deadlines for one node's algorithm.

    Args:
        config: the gossip section (policy, fixed codec, exchange_every).
        membership: live peers and their addresses.
        links: the node's link estimates (owned by the node; outcomes are recorded here).
        selector: the partner policy.
        shapes: (name, shape) of every model parameter, in a fixed order (sizes of payloads).
        step_interval_s: seconds between two local steps lately (the trainer's measure).
        client: we are a client-mode node (network.reachable = false): nobody asks us, so an
            algorithm whose requests only pull (dpsgd) sends our model along with them.
        model_dtype: "bfloat16" or "float16" when every parameter is of that half precision:
            the codec ladder then starts at that codec, which carries the values exactly in
            half the bytes of "none" (float32 on the wire).
    """

    def __init__(
        self,
        config: GossipConfig,
        membership: MembershipView,
        links: LinkTable,
        selector: PartnerSelector,
        shapes: Shapes,
        step_interval_s: Callable[[], float | None],
        *,
        client: bool = False,
        model_dtype: str | None = None,
    ) -> None:
        self.config = config
        self._exact = HALF_CODECS.get(model_dtype or "")  # a half model's lossless codec
        self.client = client
        self.links = links
        self.selector = selector
        self._membership = membership
        self._shapes = sorted((name, tuple(shape)) for name, shape in shapes)
        self._step_interval_s = step_interval_s
        self._sizes: dict[str, int] = {}
        self.numel = sum(_numel(shape) for _, shape in self._shapes)
        self._dialable: tuple[Sequence[str], tuple[str, ...]] = ((), ())

    # -- who --------------------------------------------------------------------------------
    def live_peers(self) -> Sequence[str]:
        return self._membership.live_peers()

    def address_of(self, peer: str) -> str | None:
        return self._membership.address_of(peer)

    def dialable_peers(self) -> Sequence[str]:
        """Live peers that a request can be sent to: live_peers() less the client-mode ones.
        Whom to ask (partners, round neighbours, state servers) comes from these only."""
        live = self.live_peers()
        if live is not self._dialable[0]:  # membership keeps one tuple until it changes
            dialable = tuple(p for p in live if not is_client_address(self.address_of(p) or ""))
            self._dialable = (live, dialable)
        return self._dialable[1]

    def is_client(self, peer: str) -> bool:
        """Whether `peer` is a client-mode peer (live, never asked: it asks us)."""
        return is_client_address(self.address_of(peer) or "")

    def choose_partner(self, now: float) -> str | None:
        """The next partner under the configured policy (never a client-mode peer), or None
        when nobody dialable is live."""
        return self.selector.choose(
            self.dialable_peers(), self.links, self.payload_nbytes(self.fixed_codec or "int8"),
            now,
        )

    # -- how --------------------------------------------------------------------------------
    @property
    def fixed_codec(self) -> str | None:
        """The codec the config names, or None when each link chooses ("auto")."""
        return None if self.config.codec == "auto" else self.config.codec

    def payload_nbytes(self, spec: str) -> int:
        """Bytes of the whole model encoded with `spec` (cached per spec)."""
        size = self._sizes.get(spec)
        if size is None:
            size = compress.expected_nbytes_named(self._shapes, compress.get_codec(spec))
            self._sizes[spec] = size
        return size

    def choose_codec(self, peer: str, now: float, ladder: Sequence[str] = DENSE_LADDER) -> str:
        """The configured codec, or the least compression of `ladder` whose exchange with `peer`
        fits in the compute it overlaps (see gossip's choose_codec)."""
        if self.fixed_codec is not None:
            return self.fixed_codec
        if self._exact is not None and "none" in ladder:  # float32 adds nothing to half values
            ladder = [self._exact, *(s for s in ladder if s not in ("none", "fp16", "bf16"))]
        return choose_codec(
            self.links.estimate(peer, now),
            self.numel,
            self._step_interval_s() or DEFAULT_STEP_S,
            ladder,
            size_of=lambda spec, _n: self.payload_nbytes(spec),
            steps_per_exchange=self.config.exchange_every,
        )

    def exchange_deadline(self, peer: str, nbytes: int, now: float) -> float:
        """Seconds an exchange of `nbytes` with `peer` may take (estimate, margin, backoff)."""
        return self.links.exchange_deadline(peer, nbytes, now)

    def round_deadline(self, peer: str, nbytes: int, now: float) -> float:
        """The link's transfer deadline without the failure backoff (a round must not grow)."""
        cfg = self.links.config
        est = self.links.estimate(peer, now)
        seconds = cfg.deadline_factor * est.transfer_time(nbytes)
        seconds += cfg.deadline_rttvar_mult * est.rttvar_s
        return min(cfg.deadline_cap_s, max(cfg.deadline_floor_s, seconds))

    # -- outcomes ---------------------------------------------------------------------------
    def succeeded(self, peer: str, nbytes: int, seconds: float, now: float) -> None:
        """An exchange with `peer` moved `nbytes` in `seconds` and was used."""
        self.transferred(peer, nbytes, seconds, now)
        self.selector.record_outcome(peer, True, now)

    def transferred(self, peer: str, nbytes: int, seconds: float, now: float) -> None:
        """Bytes moved (a goodput sample) without judging the exchange. A transfer that took no
        measurable time (a clock tick) says nothing about the link and is not recorded."""
        if nbytes > 0 and seconds > 0:
            self.links.record_transfer(peer, nbytes, seconds, now)

    def failed(self, peer: str, now: float) -> None:
        """`peer` did not answer in time or answered with an error: back off from it."""
        self.links.record_failure(peer, now)
        self.selector.record_outcome(peer, False, now)

    def unreliable(self, peer: str, now: float) -> None:
        """`peer` answered, but with something we refused: choose it less (the link is fine)."""
        self.selector.record_outcome(peer, False, now)

    def answered(self, peer: str, ok: bool, now: float) -> None:
        """A round-based algorithm heard (or did not hear) from `peer` by its deadline."""
        self.selector.record_outcome(peer, ok, now)

    def busy(self, peer: str, now: float) -> None:
        """`peer` declined because it is busy: skip it for a short while, no failure counted."""
        self.selector.record_busy(peer, now)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
