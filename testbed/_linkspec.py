# What a WAN link between two regions looks like, and which link carries a packet between two peers.
# Invariants: a LinkSpec is one-way (the way back is its own spec); a LinkMatrix is immutable and
# total (every ordered pair of its regions has a spec; every peer sits in one of its regions), so a
# run-time change ("degrade a link", "partition two regions", "heal") returns a new matrix.
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class LinkSpec:
    """One direction of an emulated link.

    Attributes:
        delay_ms: one-way propagation delay; a round trip over a symmetric pair is twice this.
        jitter_ms: each packet's delay is drawn uniformly from delay_ms ± jitter_ms (never below 0);
            packets of one link still arrive in the order they were sent.
        loss: probability that a packet is dropped, 0..1 (1.0 = partitioned).
        rate_mbit: link rate in Mbit/s (10**6 bit/s) of IP bytes, or None for unshaped.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float | None = None

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "loss"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LinkSpec.{name}={value!r}: expected a finite number >= 0")
        if self.loss > 1:
            raise ValueError(f"LinkSpec.loss={self.loss!r}: expected a probability in [0, 1]")
        if self.rate_mbit is not None and (
            not isinstance(self.rate_mbit, int | float)
            or not math.isfinite(self.rate_mbit)
            or self.rate_mbit <= 0
        ):
            raise ValueError(
                f"LinkSpec.rate_mbit={self.rate_mbit!r}: expected a finite number > 0, "
                "or None for an unshaped link"
            )

    @property
    def partitioned(self) -> bool:
        """True when nothing gets through (loss 1.0)."""
        return self.loss >= 1.0

    def to_json(self) -> dict[str, float | None]:
        """The spec as a JSON-ready dict (the emulator process receives it this way)."""
        return {
            "delay_ms": self.delay_ms,
            "jitter_ms": self.jitter_ms,
            "loss": self.loss,
            "rate_mbit": self.rate_mbit,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> LinkSpec:
        """Inverse of `to_json`; raises ValueError on unknown keys or bad values."""
        unknown = set(data) - {"delay_ms", "jitter_ms", "loss", "rate_mbit"}
        if unknown:
            raise ValueError(f"LinkSpec: unknown fields {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]


PARTITIONED = LinkSpec(loss=1.0)


@dataclass(frozen=True)
class AccessLink:
    """A peer's own access link (a home's cable or DSL line, a datacenter's port), shaped on top
    of the region links: everything the peer sends leaves through its uplink, everything it
    receives arrives through its downlink, whoever the other end is.

    Attributes:
        up_mbit / down_mbit: rates in Mbit/s (None: not limited by the access link).
        delay_ms: one-way delay of the access link, added each way (a home's last mile).
    """

    up_mbit: float | None = None
    down_mbit: float | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("up_mbit", "down_mbit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)
                                      or not math.isfinite(value) or value <= 0):  # fmt: skip
                raise ValueError(f"AccessLink.{name}={value!r}: expected Mbit/s > 0, or None "
                                 "for no limit")  # fmt: skip
        d = self.delay_ms
        if not isinstance(d, int | float) or isinstance(d, bool) or not math.isfinite(d) or d < 0:
            raise ValueError(f"AccessLink.delay_ms={d!r}: expected a finite number >= 0")

    def to_json(self) -> dict[str, float | None]:
        return {"up_mbit": self.up_mbit, "down_mbit": self.down_mbit, "delay_ms": self.delay_ms}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> AccessLink:
        """Inverse of `to_json`; raises ValueError on unknown keys or bad values."""
        unknown = set(data) - {"up_mbit", "down_mbit", "delay_ms"}
        if unknown:
            raise ValueError(f"AccessLink: unknown fields {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]


def _min_rate(*rates: float | None) -> float | None:
    known = [r for r in rates if r is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class LinkMatrix:
    """Per ordered pair of regions a LinkSpec, and the region of every peer.

    A peer's egress toward another peer uses `links[(its region, other's region)]`, after its
    own uplink and before the other's downlink when they have access links.

    Attributes:
        regions: region names, in order.
        peer_regions: for peer index i, the name of its region.
        links: spec for every ordered (src region, dst region) pair, including (r, r).
        access: per peer index, its access link or None; empty: no peer has one.
    """

    regions: tuple[str, ...]
    peer_regions: tuple[str, ...]
    links: Mapping[tuple[str, str], LinkSpec] = field(default_factory=dict)
    access: tuple[AccessLink | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.regions or len(set(self.regions)) != len(self.regions):
            raise ValueError(
                f"LinkMatrix.regions={self.regions!r}: expected unique, non-empty names"
            )
        for i, region in enumerate(self.peer_regions):
            if region not in self.regions:
                raise ValueError(
                    f"LinkMatrix.peer_regions[{i}]={region!r}: expected one of {self.regions}"
                )
        missing = [(a, b) for a in self.regions for b in self.regions if (a, b) not in self.links]
        if missing:
            raise ValueError(f"LinkMatrix.links: no spec for region pairs {missing}")
        extra = [
            pair
            for pair in self.links
            if pair[0] not in self.regions or pair[1] not in self.regions
        ]
        if extra:
            raise ValueError(f"LinkMatrix.links: pairs {extra} name unknown regions")
        for pair, spec in self.links.items():
            if not isinstance(spec, LinkSpec):
                raise ValueError(f"LinkMatrix.links[{pair}]={spec!r}: expected a LinkSpec")
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        access = tuple(self.access)
        if access and len(access) != len(self.peer_regions):
            raise ValueError(f"LinkMatrix.access: {len(access)} entries for "
                             f"{len(self.peer_regions)} peers (expected one per peer, or none)")
        for i, a in enumerate(access):
            if a is not None and not isinstance(a, AccessLink):
                raise ValueError(f"LinkMatrix.access[{i}]={a!r}: expected an AccessLink or None")
        object.__setattr__(self, "access", access if any(a is not None for a in access) else ())

    @classmethod
    def uniform(cls, n_peers: int, spec: LinkSpec, region: str = "all") -> LinkMatrix:
        """All `n_peers` peers in one region, every link `spec`."""
        return cls((region,), (region,) * n_peers, {(region, region): spec})

    @classmethod
    def symmetric(
        cls,
        peer_regions: tuple[str, ...],
        inside: Mapping[str, LinkSpec],
        between: Mapping[frozenset[str], LinkSpec],
    ) -> LinkMatrix:
        """Build a matrix whose links are the same both ways.

        Args:
            peer_regions: region of each peer.
            inside: spec within each region.
            between: spec for each unordered pair of distinct regions, keyed by frozenset({a, b}).
        """
        regions = tuple(inside)
        links = {(r, r): s for r, s in inside.items()}
        for pair, spec in between.items():
            a, b = sorted(pair)
            links[(a, b)] = links[(b, a)] = spec
        return cls(regions, tuple(peer_regions), links)

    @property
    def n_peers(self) -> int:
        return len(self.peer_regions)

    def spec(self, src_region: str, dst_region: str) -> LinkSpec:
        """The one-way spec from `src_region` to `dst_region`."""
        return self.links[(src_region, dst_region)]

    def peer_spec(self, src_peer: int, dst_peer: int) -> LinkSpec:
        """The spec of `src_peer`'s egress toward `dst_peer` (the region link alone)."""
        return self.links[(self.peer_regions[src_peer], self.peer_regions[dst_peer])]

    def access_of(self, peer: int) -> AccessLink | None:
        return self.access[peer] if self.access else None

    def path_spec(self, src_peer: int, dst_peer: int) -> LinkSpec:
        """What one flow from `src_peer` to `dst_peer` sees end to end: the delays added up,
        the lowest of the sender's uplink, the region link and the receiver's downlink rates
        (a flow alone on its access links; flows that share one share its rate)."""
        link = self.peer_spec(src_peer, dst_peer)
        up, down = self.access_of(src_peer), self.access_of(dst_peer)
        delay = link.delay_ms + (up.delay_ms if up else 0.0) + (down.delay_ms if down else 0.0)
        rate = _min_rate(link.rate_mbit, up.up_mbit if up else None,
                         down.down_mbit if down else None)  # fmt: skip
        return replace(link, delay_ms=delay, rate_mbit=rate)

    def with_link(self, src_region: str, dst_region: str, spec: LinkSpec) -> LinkMatrix:
        """A copy with one direction changed (e.g. a degraded link)."""
        if (src_region, dst_region) not in self.links:
            raise ValueError(f"LinkMatrix.with_link: unknown pair ({src_region!r}, {dst_region!r})")
        return replace(self, links={**self.links, (src_region, dst_region): spec})

    def partitioned(self, a: str, b: str) -> LinkMatrix:
        """A copy where regions `a` and `b` cannot reach each other (loss 1.0 both ways)."""
        return self.with_link(a, b, replace(self.spec(a, b), loss=1.0)).with_link(
            b, a, replace(self.spec(b, a), loss=1.0)
        )

    def changed_pairs(self, other: LinkMatrix) -> list[tuple[str, str]]:
        """Ordered region pairs whose spec differs in `other` (same regions required)."""
        if other.regions != self.regions:
            raise ValueError("LinkMatrix.changed_pairs: the matrices have different regions")
        return [pair for pair, spec in self.links.items() if other.links[pair] != spec]

    def to_json(self) -> dict:
        """The matrix as a JSON-ready dict (the emulator process receives it this way)."""
        return {
            "regions": list(self.regions),
            "peer_regions": list(self.peer_regions),
            "links": [[a, b, spec.to_json()] for (a, b), spec in self.links.items()],
            "access": [None if a is None else a.to_json() for a in self.access],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LinkMatrix:
        """Inverse of `to_json`; raises ValueError (or KeyError/TypeError) on malformed data."""
        links = {(a, b): LinkSpec.from_json(spec) for a, b, spec in data["links"]}
        access = tuple(None if a is None else AccessLink.from_json(a)
                       for a in data.get("access", ()))  # fmt: skip
        return cls(tuple(data["regions"]), tuple(data["peer_regions"]), links, access)
