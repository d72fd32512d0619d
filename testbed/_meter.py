# Bytes on the wire, measured where the packets pass. Invariants: the userspace emulator's per-link
# counters (IP bytes admitted to a link) are used when it runs; with netem, the transmit counters of
# each peer's device; without emulation there is no shared place to count and `total()` is None
# (the summary then falls back to the nodes' own counters and says so).
from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence

from ._peers import Host

SOURCES = {
    "userspace": "userspace emulator link counters (IP bytes admitted to every link)",
    "netem": "transmit counters of each peer's network device (ip -s link)",
    "none": "the geotrain nodes' own bytes_out counters (no emulation: no shared counter)",
}


class BytesMeter:
    """Total bytes sent by all peers so far, from the best source the backend offers.

    Args:
        backend: "userspace", "netem" or "none".
        links: the UserspaceLinks (for "userspace"), else unused.
        namespaces: the peers' namespaces (for "netem").
        hosts: the peers' hosts (their device names).
    """

    def __init__(self, backend: str, links, namespaces, hosts: Sequence[Host]) -> None:
        self.backend = backend
        self.source = SOURCES[backend]
        self._links = links
        self._namespaces = namespaces
        self._hosts = hosts

    def total(self) -> int | None:
        if self.backend == "userspace":
            return sum(link.bytes for link in self._links.statistics().links)
        if self.backend == "netem":
            return sum(_tx_bytes(ns.name, h.ifname)
                       for ns, h in zip(self._namespaces, self._hosts, strict=True))  # fmt: skip
        return None


def _tx_bytes(namespace: str, device: str) -> int:
    proc = subprocess.run(
        ["ip", "-n", namespace, "-s", "-j", "link", "show", "dev", device],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        return 0  # the device is gone (the run is ending)
    return int(json.loads(proc.stdout)[0]["stats64"]["tx"]["bytes"])
