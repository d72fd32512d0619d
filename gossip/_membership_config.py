# Configuration of SWIM-style membership. Invariant: every timer the state machine uses is derived
# from these fields and the current swarm size, so a config fully states the timing behaviour.
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ._errors import require_config
from ._messages import MAX_MEMBERS, MAX_UPDATES

_require = functools.partial(require_config, "MembershipConfig")


@dataclass(frozen=True)
class MembershipConfig:
    """Timers and fan-outs of membership and failure detection, set for WAN links.

    Attributes:
        probe_interval_s: one protocol period: each node probes one member per period. 2 s leaves
            room for the worst measured WAN round trip (Sydney–Frankfurt, 0.53 s) plus helpers.
        probe_timeout_s: wait this long for a direct Ack before asking helpers; above a WAN RTT.
        indirect_probes: helpers asked to probe a silent target (SWIM's k); also the number of
            independent suspicions after which suspicion runs for its minimum time (Lifeguard).
        suspicion_mult: Lifeguard's alpha: the shortest suspicion lasts
            suspicion_mult * max(1, log10(n)) * probe_interval_s.
        suspicion_max_mult: Lifeguard's beta: the longest suspicion (no confirmations) is this
            multiple of the shortest; confirmations shrink it logarithmically.
        retransmit_mult: each membership update is piggybacked retransmit_mult * ceil(log10(n+1))
            times (memberlist's default), enough to reach every member with high probability.
        max_piggyback: most updates on one message (bounded by the wire limit).
        peer_exchange_interval_s: how often a node swaps member samples with a random member, so
            it learns the swarm beyond its bootstrap list.
        peer_exchange_max_interval_s: while its member table does not change, a node doubles
            the time to its next swap, up to this (None: 16 x peer_exchange_interval_s), each
            swap at a random point of the second half of its interval so that nodes that heard
            the same news do not swap in step (Trickle's back-off, RFC 6206); any change
            (a member joins, leaves, dies, is suspected, refutes, moves) brings it back to
            peer_exchange_interval_s. A settled swarm then spends next to nothing on swaps (in
            an 8-node swarm they were half the steady control-plane bytes). A client keeps the
            short interval: swaps are how it hears the news. Set it to peer_exchange_interval_s
            for a fixed interval.
        peer_exchange_size: members per peer-exchange message (bounded by the wire limit).
        join_retry_s: resend Join to the bootstrap addresses this often until someone answers
            (the first resends come sooner: 0.25 s, then twice as long each time up to this).
        reconnect_interval_s: how often a node contacts a dead member (or a bootstrap address when
            it knows nobody alive), so that a partitioned swarm re-merges after healing.
        dead_retention_s: dead and left members are remembered (and tried for re-merge) this long.
        leave_fanout: members told directly of a graceful leave; they spread it further.
        verify_batch: members heard of only second-hand that are pinged at once per probe period
            (each at most once per 4 periods), besides the round-robin probe, so a new swarm's
            members verify each other within a period or two instead of one member a period;
            also the most a listed stranger can make this node dial per period.
        max_members: most members remembered, in any state. Members learned second-hand beyond it
            are ignored; one heard from directly replaces the oldest never-verified record. 4096
            is far above the swarms this targets (tens to hundreds of nodes) and bounds the memory
            and the probing that a peer listing made-up members can cause.
    """

    probe_interval_s: float = 2.0
    probe_timeout_s: float = 0.8
    indirect_probes: int = 3
    suspicion_mult: float = 4.0
    suspicion_max_mult: float = 6.0
    retransmit_mult: float = 4.0
    max_piggyback: int = 16
    peer_exchange_interval_s: float = 10.0
    peer_exchange_max_interval_s: float | None = None
    peer_exchange_size: int = 64
    join_retry_s: float = 5.0
    reconnect_interval_s: float = 15.0
    dead_retention_s: float = 900.0
    leave_fanout: int = 8
    verify_batch: int = 8
    max_members: int = 4096

    @property
    def exchange_max_interval_s(self) -> float:
        """peer_exchange_max_interval_s, None resolved."""
        if self.peer_exchange_max_interval_s is None:
            return 16 * self.peer_exchange_interval_s
        return self.peer_exchange_max_interval_s

    def __post_init__(self) -> None:
        _require(self.probe_interval_s > 0, "probe_interval_s", self.probe_interval_s, "> 0")
        _require(
            0 < self.probe_timeout_s < self.probe_interval_s,
            "probe_timeout_s",
            self.probe_timeout_s,
            f"in (0, probe_interval_s={self.probe_interval_s})",
        )
        _require(self.indirect_probes >= 0, "indirect_probes", self.indirect_probes, ">= 0")
        _require(self.suspicion_mult > 0, "suspicion_mult", self.suspicion_mult, "> 0")
        _require(
            self.suspicion_max_mult >= 1, "suspicion_max_mult", self.suspicion_max_mult, ">= 1"
        )
        _require(self.retransmit_mult > 0, "retransmit_mult", self.retransmit_mult, "> 0")
        _require(
            1 <= self.max_piggyback <= MAX_UPDATES,
            "max_piggyback",
            self.max_piggyback,
            f"in [1, {MAX_UPDATES}]",
        )
        _require(
            1 <= self.peer_exchange_size <= MAX_MEMBERS,
            "peer_exchange_size",
            self.peer_exchange_size,
            f"in [1, {MAX_MEMBERS}]",
        )
        for name in (
            "peer_exchange_interval_s",
            "join_retry_s",
            "reconnect_interval_s",
            "dead_retention_s",
        ):
            _require(getattr(self, name) > 0, name, getattr(self, name), "> 0")
        _require(
            self.peer_exchange_max_interval_s is None
            or self.peer_exchange_max_interval_s >= self.peer_exchange_interval_s,
            "peer_exchange_max_interval_s",
            self.peer_exchange_max_interval_s,
            f"None or >= peer_exchange_interval_s ({self.peer_exchange_interval_s})",
        )
        _require(self.leave_fanout >= 1, "leave_fanout", self.leave_fanout, ">= 1")
        _require(self.verify_batch >= 0, "verify_batch", self.verify_batch, ">= 0")
        _require(self.max_members >= 1, "max_members", self.max_members, ">= 1")

    def suspicion_timeouts(self, n_members: int) -> tuple[float, float]:
        """(shortest, longest) suspicion in seconds for a swarm of `n_members` (Lifeguard)."""
        shortest = self.suspicion_mult * max(1.0, math.log10(max(1, n_members)))
        shortest *= self.probe_interval_s
        return shortest, shortest * self.suspicion_max_mult

    def suspicion_timeout(self, n_members: int, confirmations: int) -> float:
        """Suspicion length after `confirmations` independent suspicions beyond the first. At
        most n - 2 members can confirm (not the suspect, not the first suspecter): a small
        swarm's confirmations reach the shortest suspicion too."""
        shortest, longest = self.suspicion_timeouts(n_members)
        expected = max(1, min(self.indirect_probes, n_members - 2))
        frac = math.log(confirmations + 1) / math.log(expected + 1)
        return max(shortest, longest - (longest - shortest) * frac)

    def retransmits(self, n_members: int) -> int:
        """How many times one update is piggybacked in a swarm of `n_members`."""
        return max(1, math.ceil(self.retransmit_mult * math.ceil(math.log10(n_members + 1))))

    def client_silence_s(self, n_members: int) -> float:
        """How long a client-mode member may stay silent towards this node before it suspects it.

        A client is never probed: it probes the dialable members one per period in shuffled round
        robin, so each hears from it at least once per two cycles (2 * (n - 1) periods); two
        periods more absorb a lost message.
        """
        return (2 * max(1, n_members - 1) + 2) * self.probe_interval_s

    def detection_bound_s(self, n_members: int) -> float:
        """Worst case, without message loss, from a crash to every live member declaring it dead.

        A member is probed at least once per two shuffled round-robin cycles of any prober
        (2 * (n - 1) periods), the failed probe takes one period, the suspicion at most its longest
        timeout, and the dead rumour reaches everyone within retransmits(n) periods.
        """
        n = max(2, n_members)
        periods = 2 * (n - 1) + 1 + self.retransmits(n)
        return periods * self.probe_interval_s + self.suspicion_timeouts(n)[1]
