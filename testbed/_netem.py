# The netem backend (veth + tc per link) and the choice between emulation backends.
# Invariants: command builders are pure (they return argv lists and touch nothing); the topology is
# one hub namespace `<run prefix>hub` holding a bridge, one veth pair per peer (`eth0` in the peer's
# namespace, `hNN` in the hub), and on each peer's egress an htb root with one class per
# destination region (its rate) whose netem child adds that link's delay, jitter and loss, selected
# by u32 filters on the destination address. Like the userspace backend, a link is a
# (source peer, destination region) pair. Every name made carries the run prefix.
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ._linkspec import LinkMatrix, LinkSpec
from ._namespaces import NETWORK, NamespaceError, NamespaceSet, run_ip
from ._tun import tun_available

DEVICE = "eth0"
UNSHAPED_RATE = "100gbit"  # htb needs a rate; far above what a 2-core machine can push
BACKENDS = ("auto", "netem", "userspace", "none")

Command = list[str]


def hub_name(namespaces: NamespaceSet) -> str:
    return f"{namespaces.run_prefix}hub"


def topology_commands(namespaces: NamespaceSet) -> list[Command]:
    """Commands that build the hub, its bridge and one veth pair per peer, addresses set."""
    hub = hub_name(namespaces)
    cmds = [
        ["ip", "netns", "add", hub],
        ["ip", "-n", hub, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", hub, "link", "set", "br0", "up"],
    ]
    for ns in namespaces:
        leg = f"h{ns.index:02d}"
        cmds += [
            ["ip", "-n", ns.name, "link", "add", DEVICE, "type", "veth",
             "peer", "name", leg, "netns", hub],
            ["ip", "-n", hub, "link", "set", leg, "master", "br0", "up"],
            ["ip", "-n", ns.name, "addr", "add", f"{ns.address}/{NETWORK.prefixlen}",
             "dev", DEVICE],
            ["ip", "-n", ns.name, "link", "set", DEVICE, "up"],
        ]  # fmt: skip
    return cmds


def _rate(spec: LinkSpec) -> str:
    return UNSHAPED_RATE if spec.rate_mbit is None else f"{spec.rate_mbit:g}mbit"


def _netem_args(spec: LinkSpec) -> list[str]:
    args = ["netem", "delay", f"{spec.delay_ms:g}ms"]
    if spec.jitter_ms:
        args.append(f"{spec.jitter_ms:g}ms")
    if spec.loss:
        args += ["loss", f"{spec.loss * 100:g}%"]
    return args + ["limit", "100000"]


def _class_id(region_index: int) -> int:
    return 10 + region_index


def shaping_commands(namespaces: NamespaceSet, matrix: LinkMatrix) -> list[Command]:
    """tc commands for every peer's egress: htb class + netem per destination region + filters."""
    if matrix.n_peers != len(namespaces):
        raise ValueError(f"matrix has {matrix.n_peers} peers for {len(namespaces)} namespaces")
    cmds: list[Command] = []
    for ns in namespaces:
        tc = ["tc", "-n", ns.name]
        src_region = matrix.peer_regions[ns.index]
        cmds.append([*tc, "qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "htb"])
        for j, dst_region in enumerate(matrix.regions):
            spec, cid = matrix.spec(src_region, dst_region), _class_id(j)
            rate = _rate(spec)
            cmds += [
                [*tc, "class", "add", "dev", DEVICE, "parent", "1:", "classid", f"1:{cid}",
                 "htb", "rate", rate, "ceil", rate],
                [*tc, "qdisc", "add", "dev", DEVICE, "parent", f"1:{cid}", "handle", f"{cid}:",
                 *_netem_args(spec)],
            ]  # fmt: skip
        for other in namespaces:
            if other.index == ns.index:
                continue
            cid = _class_id(matrix.regions.index(matrix.peer_regions[other.index]))
            cmds.append(
                [*tc, "filter", "add", "dev", DEVICE, "parent", "1:", "protocol", "ip", "prio",
                 "1", "u32", "match", "ip", "dst", f"{other.address}/32", "flowid", f"1:{cid}"]
            )  # fmt: skip
    return cmds


def update_commands(namespaces: NamespaceSet, old: LinkMatrix, new: LinkMatrix) -> list[Command]:
    """tc commands that turn the shaping of `old` into that of `new` (changed links only)."""
    changed = set(old.changed_pairs(new))
    cmds: list[Command] = []
    for ns in namespaces:
        tc = ["tc", "-n", ns.name]
        src_region = new.peer_regions[ns.index]
        for j, dst_region in enumerate(new.regions):
            if (src_region, dst_region) not in changed:
                continue
            spec, cid = new.spec(src_region, dst_region), _class_id(j)
            rate = _rate(spec)
            cmds += [
                [*tc, "class", "change", "dev", DEVICE, "parent", "1:", "classid", f"1:{cid}",
                 "htb", "rate", rate, "ceil", rate],
                [*tc, "qdisc", "change", "dev", DEVICE, "parent", f"1:{cid}", "handle", f"{cid}:",
                 *_netem_args(spec)],
            ]  # fmt: skip
    return cmds


def apply_commands(commands: Sequence[Command]) -> None:
    """Run each command in order; raise NamespaceError (with the kernel's answer) on the first
    failure."""
    for cmd in commands:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise NamespaceError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")


class NetemLinks:
    """Links emulated by the kernel (veth + htb + netem) between a NamespaceSet's peers.

    Use as a context manager inside the NamespaceSet's `with` block; leaving deletes the hub
    namespace, which takes the bridge and every veth pair (and so all shaping) with it.
    """

    def __init__(self, namespaces: NamespaceSet, matrix: LinkMatrix) -> None:
        if matrix.access:
            raise ValueError("netem cannot emulate access links (a peer's own uplink and "
                             "downlink): use the userspace emulator")  # fmt: skip
        self._namespaces = namespaces
        self.matrix = matrix
        self._hub: str | None = None

    def start(self) -> None:
        self._hub = hub_name(self._namespaces)
        apply_commands(topology_commands(self._namespaces))
        apply_commands(shaping_commands(self._namespaces, self.matrix))

    def set_matrix(self, matrix: LinkMatrix) -> None:
        """Change link specs at run time (only the changed links are touched)."""
        apply_commands(update_commands(self._namespaces, self.matrix, matrix))
        self.matrix = matrix

    def close(self) -> None:
        """Delete the hub namespace and with it all veth pairs. Idempotent."""
        hub, self._hub = self._hub, None
        if hub is not None:
            for ns in self._namespaces:
                run_ip(["-n", ns.name, "link", "del", DEVICE], check=False)
            run_ip(["netns", "del", hub], check=False)

    def __enter__(self) -> NetemLinks:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def netem_available() -> tuple[bool, str]:
    """Try `tc qdisc add dev lo root netem delay 1ms` in a throwaway namespace.

    Returns:
        (True, "...") when the kernel accepts it; otherwise False and the kernel's answer (for a
        kernel without sch_netem: "Error: Specified qdisc kind is unknown.").
    """
    if shutil.which("tc") is None or shutil.which("ip") is None:
        return False, "the `ip`/`tc` tools (iproute2) are not installed"
    name = f"gt-{secrets.token_hex(3)}-probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        proc = subprocess.run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
             "delay", "1ms"],
            capture_output=True, text=True,
        )  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if proc.returncode != 0:
        return False, f"tc netem: {proc.stderr.strip() or f'exit status {proc.returncode}'}"
    return True, "tc accepted a netem qdisc"


class BackendUnavailable(RuntimeError):
    """The requested emulation backend cannot run here; the message says why."""


@dataclass(frozen=True)
class BackendChoice:
    """Which link emulation a testbed run gets, and why.

    Attributes:
        backend: "netem", "userspace" or "none".
        reason: one sentence for the run's output; loud (starts with "NO LINK EMULATION") for none.
        user_namespace: True when this needs an unprivileged user+network namespace
            (`unshare -rn`) because we are not root.
    """

    backend: str
    reason: str
    user_namespace: bool = False


class HostProbe(Protocol):
    """What `choose_backend` asks about the machine (a fake stands in for it in tests)."""

    def is_root(self) -> bool: ...
    def user_namespace(self) -> tuple[bool, str]: ...
    def netem(self) -> tuple[bool, str]: ...
    def tun(self) -> tuple[bool, str]: ...
    def namespaces(self) -> tuple[bool, str]: ...


USERNS = ["unshare", "--map-root-user", "--mount", "--net"]


def _probe(argv: list[str], ok: str) -> tuple[bool, str]:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return False, f"{argv[0]}: {lines[-1] if lines else f'exit status {proc.returncode}'}"
    return True, ok


class SystemProbe:
    """Asks this machine. Not root, it asks inside a fresh user+mount+network namespace
    (`unshare -rmn`), where the testbed would then have to run."""

    def is_root(self) -> bool:
        return os.geteuid() == 0

    def user_namespace(self) -> tuple[bool, str]:
        if shutil.which("unshare") is None:
            return False, "`unshare` is not installed"
        return _probe(
            [*USERNS, "ip", "link", "set", "lo", "up"],
            "unshare -rmn gives an unprivileged user+network namespace",
        )

    def netem(self) -> tuple[bool, str]:
        if self.is_root():
            return netem_available()
        ok, why = _probe(
            [*USERNS, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            "tc accepted a netem qdisc in a user namespace",
        )
        return ok, why if ok else f"tc netem: {why.split(': ', 1)[-1]}"

    def tun(self) -> tuple[bool, str]:
        if self.is_root():
            return tun_available()
        tuntap = ["ip", "tuntap", "add", "dev", "gtprobe", "mode", "tun"]  # dies with the netns
        return _probe([*USERNS, *tuntap], "/dev/net/tun opens (user ns)")

    def namespaces(self) -> tuple[bool, str]:
        name = f"gt-{secrets.token_hex(3)}-probe"
        if self.is_root():
            ok, why = _probe(["ip", "netns", "add", name], "named network namespaces work")
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            return ok, why
        script = f"mount -t tmpfs tmpfs /run && ip netns add {name}"  # private /run: nothing leaks
        return _probe([*USERNS, "sh", "-c", script], "named network namespaces work (user ns)")


def choose_backend(requested: str = "auto", probe: HostProbe | None = None, *,
                   access_links: bool = False) -> BackendChoice:  # fmt: skip
    """Pick the link emulation backend.

    auto: netem if the kernel has it, else userspace if /dev/net/tun and namespaces work, else
    none (loopback, said loudly). Without root, an unprivileged user+network namespace
    (`unshare -rn`) is tried first; the choice then says `user_namespace=True`. A scenario with
    per-peer access links (`access_links`) needs the userspace emulator: netem shapes each
    peer's egress per destination region only (a downlink shared by all senders would need
    ingress shaping), so auto skips it and netem asked for is refused.

    Raises:
        ValueError: `requested` is not one of BACKENDS.
        BackendUnavailable: a backend other than auto/none was requested and cannot run here.
    """
    if requested not in BACKENDS:
        raise ValueError(f"emulation={requested!r}: expected one of {BACKENDS}")
    if requested == "none":
        return BackendChoice("none", "NO LINK EMULATION: requested; peers talk over loopback")
    probe = probe or SystemProbe()
    user_ns = False
    if not probe.is_root():
        ok, why = probe.user_namespace()
        if not ok:
            return _fallback(requested, f"not root, and {why}")
        user_ns = True
    ns_ok, ns_why = probe.namespaces()
    if not ns_ok:
        return _fallback(requested, f"no network namespaces ({ns_why})")
    netem_ok, netem_why = probe.netem()
    if access_links and requested == "netem":
        raise BackendUnavailable("netem cannot emulate the scenario's access links (a peer's "
                                 "own uplink and downlink): use --emulation userspace or auto")
    if access_links and netem_ok:
        netem_ok, netem_why = False, "skipped: the scenario has access links (userspace only)"
    if requested in ("auto", "netem") and netem_ok:
        return BackendChoice("netem", f"netem: {netem_why}", user_ns)
    if requested == "netem":
        raise BackendUnavailable(f"netem is not available here: {netem_why}")
    tun_ok, tun_why = probe.tun()
    if tun_ok:
        return BackendChoice("userspace", f"userspace: no netem ({netem_why}); {tun_why}", user_ns)
    return _fallback(requested, f"no netem ({netem_why}) and no TUN ({tun_why})")


def _fallback(requested: str, why: str) -> BackendChoice:
    if requested != "auto":
        raise BackendUnavailable(f"{requested} is not available here: {why}")
    return BackendChoice("none", f"NO LINK EMULATION: {why}; peers talk over plain loopback")
