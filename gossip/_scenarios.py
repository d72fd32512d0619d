# Network scenarios: regions, and one-way delay and bandwidth per pair of regions, from published
# measurements. Invariants: a scenario is immutable data with a delay and a bandwidth for every
# pair of its regions (both orders, and each region with itself); peers are assigned to regions
# deterministically. The testbed reuses these definitions to emulate the same links.
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link between two regions.

    Attributes:
        one_way_delay_s: propagation delay, one way.
        bandwidth_bps: bits per second one flow gets.
        source: where the figure comes from.
    """

    one_way_delay_s: float
    bandwidth_bps: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.one_way_delay_s >= 0:
            raise ValueError(f"LinkProfile.one_way_delay_s = {self.one_way_delay_s!r}: >= 0")
        if not self.bandwidth_bps > 0:
            raise ValueError(f"LinkProfile.bandwidth_bps = {self.bandwidth_bps!r}: > 0")


@dataclass(frozen=True)
class Scenario:
    """Regions and the links between them.

    Attributes:
        name: what `--scenario` accepts.
        description: one line for humans.
        regions: region names; peers are spread over them round robin.
        intra: the link between two peers of one region.
        inter: ((region_a, region_b), profile) for every pair of distinct regions (either order).
    """

    name: str
    description: str
    regions: tuple[str, ...]
    intra: LinkProfile
    inter: tuple[tuple[tuple[str, str], LinkProfile], ...] = ()

    def __post_init__(self) -> None:
        if not self.regions or len(set(self.regions)) != len(self.regions):
            raise ValueError(f"Scenario.regions = {self.regions!r}: distinct names expected")
        pairs = {frozenset(pair) for pair, _ in self.inter}
        for i, a in enumerate(self.regions):
            for b in self.regions[i + 1 :]:
                if frozenset((a, b)) not in pairs:
                    raise ValueError(f"Scenario {self.name!r}: no link between {a} and {b}")

    def link(self, region_a: str, region_b: str) -> LinkProfile:
        """The profile between two regions (the intra profile when they are the same)."""
        if region_a == region_b:
            return self.intra
        for pair, profile in self.inter:
            if set(pair) == {region_a, region_b}:
                return profile
        raise KeyError(f"{self.name}: no link between {region_a} and {region_b}")

    def region_of(self, peer_index: int) -> str:
        """The region of the peer_index-th peer (round robin)."""
        return self.regions[peer_index % len(self.regions)]


_AWS = "measured AWS pair, one-way ms / Gbit/s, as cited in DESIGN.md"
GBIT = 1e9

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="geo3",
            description="3 AWS regions: Virginia, Oregon, Tokyo; 10 ms / 2 Gbit/s inside a region",
            regions=("virginia", "oregon", "tokyo"),
            intra=LinkProfile(0.010, 2.0 * GBIT, "within a region: " + _AWS),
            inter=(
                (("virginia", "oregon"), LinkProfile(0.067, 0.79 * GBIT, _AWS)),
                (("oregon", "tokyo"), LinkProfile(0.096, 0.523 * GBIT, _AWS)),
                # Not measured: no Virginia-Tokyo figure was at hand, so this pair is derived as
                # the path through Oregon (67 + 96 ms) at the slower of its two legs.
                (("virginia", "tokyo"), LinkProfile(0.163, 0.523 * GBIT, "derived, not measured")),
            ),
        ),
        Scenario(
            name="us2",
            description="2 AWS regions close together: Virginia and Ohio",
            regions=("virginia", "ohio"),
            intra=LinkProfile(0.010, 2.0 * GBIT, "within a region: " + _AWS),
            inter=((("virginia", "ohio"), LinkProfile(0.011, 1.12 * GBIT, _AWS)),),
        ),
        Scenario(
            name="lan",
            description="one region, every link 10 ms / 2 Gbit/s (no geography)",
            regions=("local",),
            intra=LinkProfile(0.010, 2.0 * GBIT, "within a region: " + _AWS),
        ),
    )
}
"""Every scenario by name."""
