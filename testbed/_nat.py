# NAT emulation for testbed peers: the namespace of a peer behind NAT drops every inbound TCP
# connection attempt, as a home router without port forwarding does, while the connections it
# opens itself work both ways. Invariants: rules are made only inside the run's own namespaces
# (never the root namespace), in one chain named NAT_CHAIN hooked into INPUT, so the same rule
# serves every link backend (netem's veth and the userspace emulator's TUN device both deliver
# through INPUT); loopback inside the namespace stays open (the node's local status); the chain's
# DROP counter is the number of inbound attempts, read by `inbound_attempts`; the rules go with
# the namespace (`lift` removes them earlier).
from __future__ import annotations

import shutil
from collections.abc import Sequence

from ._namespaces import NamespaceError, NamespaceSet, run_ip

NAT_CHAIN = "GT-NAT"
IPTABLES = "iptables"
_RULES = (
    ("-i", "lo", "-j", "ACCEPT"),  # the namespace's own loopback (local status, tools)
    ("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"),  # what we opened
    ("-p", "tcp", "--syn", "-j", "DROP"),  # a new inbound connection: nobody can dial us
)


class NatUnavailable(RuntimeError):
    """NAT cannot be emulated here (no iptables, or the kernel refused the rules)."""


def check_nat_possible(peers: Sequence[int]) -> None:
    """Raise NatUnavailable now, before any namespace is made, when NAT cannot be emulated."""
    if peers and shutil.which(IPTABLES) is None:
        raise NatUnavailable(
            "scenario.nat needs iptables in the peers' namespaces (Debian: apt-get install "
            "iptables)"
        )


class NatFirewall:
    """The NAT rules of the peers `peers` of `namespaces`. Use as a context manager.

    Args:
        namespaces: the run's namespaces (created).
        peers: indices of the peers behind NAT.

    Raises:
        NatUnavailable: on entering, when iptables is missing or a rule cannot be made.
    """

    def __init__(self, namespaces: NamespaceSet, peers: Sequence[int]) -> None:
        self.namespaces = namespaces
        self.peers = tuple(peers)
        self._active: list[int] = []

    def __enter__(self) -> NatFirewall:
        check_nat_possible(self.peers)
        try:
            for peer in self.peers:
                self._apply(peer)
        except BaseException:
            self.lift()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.lift()

    def _iptables(self, peer: int, *args: str) -> str:
        try:
            return run_ip(["netns", "exec", self.namespaces[peer].name, IPTABLES, "-w", *args])
        except NamespaceError as exc:
            raise NatUnavailable(f"NAT rule for peer {peer}: {exc}") from None

    def _apply(self, peer: int) -> None:
        self._active.append(peer)
        self._iptables(peer, "-N", NAT_CHAIN)
        for rule in _RULES:
            self._iptables(peer, "-A", NAT_CHAIN, *rule)
        self._iptables(peer, "-I", "INPUT", "-j", NAT_CHAIN)

    def inbound_attempts(self) -> dict[int, int]:
        """Inbound connection attempts dropped so far, per peer behind NAT (the DROP counter)."""
        out = {}
        for peer in self._active:
            listing = self._iptables(peer, "-L", NAT_CHAIN, "-v", "-n", "-x")
            drops = [line.split() for line in listing.splitlines() if " DROP " in f" {line} "]
            out[peer] = sum(int(fields[0]) for fields in drops)
        return out

    def lift(self) -> None:
        """Remove the rules (idempotent; the namespace's deletion removes them too)."""
        for peer in self._active:
            ns = self.namespaces[peer].name
            run_ip(["netns", "exec", ns, IPTABLES, "-w", "-D", "INPUT", "-j", NAT_CHAIN],
                   check=False)  # fmt: skip
            run_ip(["netns", "exec", ns, IPTABLES, "-w", "-F", NAT_CHAIN], check=False)
            run_ip(["netns", "exec", ns, IPTABLES, "-w", "-X", NAT_CHAIN], check=False)
        self._active.clear()
