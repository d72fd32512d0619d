# Testbed scenarios: regions with their peers, the links between regions, per-peer compute
# slowdowns and a fault timeline. Invariants: a TestbedScenario is immutable and valid once built
# (every error names the field, the value and what was expected); peers are numbered region by
# region in the order the regions are listed; built-in scenarios take their link figures from
# gossip's SCENARIOS (published measurements), so the simulator and the testbed agree.
from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from geotrain.gossip import SCENARIOS, LinkProfile

from ._linkspec import LinkMatrix, LinkSpec

FAULT_ACTIONS = ("kill", "restart", "partition", "heal", "degrade")
LINK_FIELDS = ("delay_ms", "jitter_ms", "loss", "rate_mbit")


class ScenarioError(ValueError):
    """A scenario file or built-in is invalid; the message names the field and the value."""


def _fail(field_name: str, value: object, expected: str) -> ScenarioError:
    return ScenarioError(f"scenario.{field_name} = {value!r}: expected {expected}")


@dataclass(frozen=True)
class Region:
    """A region and how many peers it holds."""

    name: str
    peers: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise _fail("regions.name", self.name, "a non-empty string")
        if not isinstance(self.peers, int) or self.peers < 1:
            raise _fail(f"regions[{self.name}].peers", self.peers, "an integer >= 1")


@dataclass(frozen=True)
class Fault:
    """One event of the fault timeline.

    Attributes:
        at_s: seconds after the system's first training step (start-up is not counted: it
            varies with the machine's load).
        action: "kill" (SIGKILL peer), "restart" (start it again; it resumes from its checkpoint),
            "partition" (regions a and b cannot reach each other), "heal" (every link back to the
            scenario's spec), "degrade" (the link from region a to region b becomes `link`).
        peer: the peer index, for kill and restart.
        regions: (a, b), for partition and degrade.
        link: the new spec, for degrade.
    """

    at_s: float
    action: str
    peer: int | None = None
    regions: tuple[str, str] | None = None
    link: LinkSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.at_s, int | float) or not math.isfinite(self.at_s) or self.at_s < 0:
            raise _fail("faults.at_s", self.at_s, "a finite number of seconds >= 0")
        if self.action not in FAULT_ACTIONS:
            raise _fail("faults.action", self.action, f"one of {FAULT_ACTIONS}")
        if self.action in ("kill", "restart") and not isinstance(self.peer, int):
            raise _fail("faults.peer", self.peer, f"a peer index for action {self.action!r}")
        if self.action in ("partition", "degrade") and (
            self.regions is None or len(self.regions) != 2
        ):
            raise _fail("faults.regions", self.regions, f"two regions for {self.action!r}")
        if self.action == "degrade" and self.link is None:
            raise _fail("faults.link", None, "a link spec (delay_ms, rate_mbit, ...) for degrade")

    def describe(self) -> str:
        what = {"kill": f"kill peer {self.peer}", "restart": f"restart peer {self.peer}"}
        if self.regions:
            what["partition"] = f"partition {self.regions[0]} | {self.regions[1]}"
            what["degrade"] = f"degrade {self.regions[0]} -> {self.regions[1]} to {self.link}"
        return f"t={self.at_s:g}s {what.get(self.action, self.action)}"


@dataclass(frozen=True)
class TestbedScenario:
    """Everything a testbed run emulates.

    Attributes:
        name: built-in name or file stem.
        description: one line for humans.
        regions: regions in order; peers are numbered region by region.
        inside: link spec between two peers of the same region (per region; every region has one).
        between: spec per unordered pair of distinct regions, keyed by frozenset({a, b}).
        slowdowns: compute slowdown per peer index (1.0 = full speed) for the stragglers.
        faults: the fault timeline, sorted by time.
        task, params, algorithm: what the peers train and how.
        duration_s: each system stops after this long at the latest.
        target: the metric value to reach (None: the task's default).
        rate_scale: factor applied to every published link rate (1.0 = as published); a run that
            scales says so in its output and summary.
    """

    __test__ = False  # not a pytest test class despite its name

    name: str
    description: str
    regions: tuple[Region, ...]
    inside: Mapping[str, LinkSpec]
    between: Mapping[frozenset[str], LinkSpec]
    slowdowns: Mapping[int, float] = field(default_factory=dict)
    faults: tuple[Fault, ...] = ()
    task: str = "digits-mlp"
    params: Mapping[str, Any] = field(default_factory=dict)
    algorithm: str = "adpsgd"
    duration_s: float = 60.0
    target: float | None = None
    rate_scale: float = 1.0

    def __post_init__(self) -> None:
        names = [r.name for r in self.regions]
        if not names or len(set(names)) != len(names):
            raise _fail("regions", names, "a non-empty list of distinct region names")
        for name in names:
            if name not in self.inside:
                raise _fail(f"links.inside.{name}", None, "a link spec for every region")
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if frozenset((a, b)) not in self.between:
                    raise _fail("links.between", f"{a}/{b}", "a link spec for every region pair")
        for peer, factor in self.slowdowns.items():
            if not 0 <= peer < self.n_peers:
                raise _fail("stragglers.peer", peer, f"a peer index in 0..{self.n_peers - 1}")
            if not isinstance(factor, int | float) or not factor >= 1.0:
                raise _fail(f"stragglers[{peer}].slowdown", factor, "a number >= 1.0")
        for fault in self.faults:
            self._check_fault(fault, names)
        object.__setattr__(self, "faults", tuple(sorted(self.faults, key=lambda f: f.at_s)))
        if not isinstance(self.duration_s, int | float) or not self.duration_s > 0:
            raise _fail("duration_s", self.duration_s, "a number of seconds > 0")
        if not isinstance(self.rate_scale, int | float) or not 0 < self.rate_scale <= 1:
            raise _fail("rate_scale", self.rate_scale, "a factor in (0, 1]")

    def _check_fault(self, fault: Fault, names: list[str]) -> None:
        if fault.peer is not None and not 0 <= fault.peer < self.n_peers:
            raise _fail("faults.peer", fault.peer, f"a peer index in 0..{self.n_peers - 1}")
        if fault.peer == 0 and fault.action == "kill":
            raise _fail("faults.peer", 0, "a peer other than 0 (peer 0 is the bootstrap peer)")
        for region in fault.regions or ():
            if region not in names:
                raise _fail("faults.regions", region, f"one of {names}")

    @property
    def n_peers(self) -> int:
        return sum(r.peers for r in self.regions)

    @property
    def peer_regions(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions for _ in range(r.peers))

    def slowdown(self, peer: int) -> float:
        return float(self.slowdowns.get(peer, 1.0))

    def matrix(self) -> LinkMatrix:
        """The link matrix this scenario emulates (rates times rate_scale)."""

        def scaled(spec: LinkSpec) -> LinkSpec:
            if spec.rate_mbit is None or self.rate_scale == 1.0:
                return spec
            return replace(spec, rate_mbit=spec.rate_mbit * self.rate_scale)

        inside = {r.name: scaled(self.inside[r.name]) for r in self.regions}
        between = {pair: scaled(spec) for pair, spec in self.between.items()}
        return LinkMatrix.symmetric(self.peer_regions, inside, between)

    def with_peers(self, n: int) -> TestbedScenario:
        """The same scenario with `n` peers spread over its regions round robin."""
        if not isinstance(n, int) or n < 2:
            raise _fail("peers", n, "an integer >= 2")
        counts = [0] * len(self.regions)
        for i in range(n):
            counts[i % len(counts)] += 1
        regions = tuple(Region(r.name, c) for r, c in zip(self.regions, counts, strict=True) if c)
        kept = {r.name for r in regions}
        return replace(
            self,
            regions=regions,
            inside={k: v for k, v in self.inside.items() if k in kept},
            between={k: v for k, v in self.between.items() if k <= kept},
            slowdowns={p: s for p, s in self.slowdowns.items() if p < n},
            faults=tuple(f for f in self.faults if self._fault_fits(f, n, kept)),
        )

    @staticmethod
    def _fault_fits(fault: Fault, n: int, regions: set[str]) -> bool:
        return (fault.peer is None or fault.peer < n) and set(fault.regions or ()) <= regions

    def to_json(self) -> dict[str, Any]:
        """The scenario as run, JSON-ready (written to the output directory)."""
        return {
            "name": self.name,
            "description": self.description,
            "task": self.task,
            "params": dict(self.params),
            "algorithm": self.algorithm,
            "duration_s": self.duration_s,
            "target": self.target,
            "rate_scale": self.rate_scale,
            "regions": [{"name": r.name, "peers": r.peers} for r in self.regions],
            "links": {
                "inside": {k: v.to_json() for k, v in self.inside.items()},
                "between": [
                    {"regions": sorted(pair), **spec.to_json()}
                    for pair, spec in self.between.items()
                ],
            },
            "stragglers": [{"peer": p, "slowdown": s} for p, s in sorted(self.slowdowns.items())],
            "faults": [_fault_json(f) for f in self.faults],
        }


def _fault_json(fault: Fault) -> dict[str, Any]:
    out: dict[str, Any] = {"at_s": fault.at_s, "action": fault.action}
    if fault.peer is not None:
        out["peer"] = fault.peer
    if fault.regions is not None:
        out["regions"] = list(fault.regions)
    if fault.link is not None:
        out.update(fault.link.to_json())
    return out


def _link(data: Any, where: str) -> LinkSpec:
    if not isinstance(data, Mapping):
        raise _fail(where, data, "a table with delay_ms, jitter_ms, loss, rate_mbit")
    unknown = set(data) - set(LINK_FIELDS)
    if unknown:
        raise _fail(where, sorted(unknown), f"only the fields {LINK_FIELDS}")
    try:
        return LinkSpec(**data)
    except (ValueError, TypeError) as exc:
        raise ScenarioError(f"scenario.{where}: {exc}") from exc


def scenario_from_dict(data: Mapping[str, Any], name: str = "custom") -> TestbedScenario:
    """Build a scenario from its TOML/JSON form (the shape `to_json` writes).

    Raises:
        ScenarioError: a field is missing, unknown or out of range; the message names it.
    """
    known = {
        "name", "description", "task", "params", "algorithm", "duration_s", "target",
        "rate_scale", "regions", "links", "stragglers", "faults",
    }  # fmt: skip
    unknown = set(data) - known
    if unknown:
        raise _fail("<top level>", sorted(unknown), f"only the fields {sorted(known)}")
    regions_data = data.get("regions")
    if not isinstance(regions_data, list) or not regions_data:
        raise _fail("regions", regions_data, "a list of {name, peers} tables")
    regions = tuple(Region(r.get("name", ""), r.get("peers", 0)) for r in regions_data)
    links = data.get("links", {})
    inside_data = links.get("inside", {})
    if isinstance(inside_data, Mapping) and set(inside_data) <= set(LINK_FIELDS):
        inside = {r.name: _link(inside_data, "links.inside") for r in regions}  # one for all
    else:
        inside = {k: _link(v, f"links.inside.{k}") for k, v in inside_data.items()}
    between = {}
    for i, item in enumerate(links.get("between", [])):
        pair = item.get("regions") if isinstance(item, Mapping) else None
        if not isinstance(pair, list) or len(pair) != 2:
            raise _fail(f"links.between[{i}].regions", pair, "two region names")
        spec = {k: v for k, v in item.items() if k != "regions"}
        between[frozenset(pair)] = _link(spec, f"links.between[{i}]")
    slowdowns = {s.get("peer"): s.get("slowdown") for s in data.get("stragglers", [])}
    faults = tuple(_fault_from(f, i) for i, f in enumerate(data.get("faults", [])))
    try:
        return TestbedScenario(
            name=data.get("name", name),
            description=data.get("description", ""),
            regions=regions,
            inside=inside,
            between=between,
            slowdowns=slowdowns,
            faults=faults,
            task=data.get("task", "digits-mlp"),
            params=dict(data.get("params", {})),
            algorithm=data.get("algorithm", "adpsgd"),
            duration_s=data.get("duration_s", 60.0),
            target=data.get("target"),
            rate_scale=data.get("rate_scale", 1.0),
        )
    except TypeError as exc:
        raise ScenarioError(f"scenario: {exc}") from exc


def _fault_from(item: Any, i: int) -> Fault:
    if not isinstance(item, Mapping):
        raise _fail(f"faults[{i}]", item, "a table with at_s and action")
    link_part = {k: v for k, v in item.items() if k in LINK_FIELDS}
    rest = set(item) - set(LINK_FIELDS) - {"at_s", "action", "peer", "regions"}
    if rest:
        raise _fail(f"faults[{i}]", sorted(rest), "only at_s, action, peer, regions, link fields")
    regions = item.get("regions")
    return Fault(
        at_s=item.get("at_s", -1),
        action=item.get("action", ""),
        peer=item.get("peer"),
        regions=tuple(regions) if regions is not None else None,  # type: ignore[arg-type]
        link=_link(link_part, f"faults[{i}]") if link_part else None,
    )


def _spec(profile: LinkProfile) -> LinkSpec:
    return LinkSpec(delay_ms=profile.one_way_delay_s * 1000, rate_mbit=profile.bandwidth_bps / 1e6)


def _from_gossip(name: str, counts: tuple[int, ...], **kwargs: Any) -> TestbedScenario:
    """A testbed scenario whose links are gossip scenario `name`'s published figures."""
    source = SCENARIOS[name]
    regions = tuple(Region(r, c) for r, c in zip(source.regions, counts, strict=True))
    inside = {r: _spec(source.intra) for r in source.regions}
    between = {frozenset(pair): _spec(p) for pair, p in source.inter}
    return TestbedScenario(
        name=name, description=source.description, regions=regions, inside=inside,
        between=between, **kwargs,
    )  # fmt: skip


def builtin_scenarios() -> dict[str, TestbedScenario]:
    """Built-ins: `demo` (the default), `geo3`, `us2`, `lan`."""
    us2 = SCENARIOS["us2"]
    oregon = dict(SCENARIOS["geo3"].inter)[("virginia", "oregon")]
    demo = TestbedScenario(
        name="demo",
        description=(
            "2 regions (virginia, oregon), 2 peers each, published AWS figures (10 ms inside, "
            "67 ms / 790 Mbit/s between); peer 3 computes 2x slower; digits-mlp"
        ),
        regions=(Region("virginia", 2), Region("oregon", 2)),
        inside={"virginia": _spec(us2.intra), "oregon": _spec(us2.intra)},
        between={frozenset(("virginia", "oregon")): _spec(oregon)},
        slowdowns={3: 2.0},
        duration_s=45.0,
    )
    geo3 = _from_gossip(
        "geo3", (3, 3, 2), slowdowns={7: 4.0}, params={"hidden": 1024, "layers": 2},
        duration_s=300.0,
    )  # fmt: skip
    return {
        "demo": demo,
        "geo3": geo3,
        "us2": _from_gossip("us2", (2, 2)),
        "lan": _from_gossip("lan", (4,)),
    }


DEFAULT_SCENARIO = "demo"


def load_scenario(name_or_path: str) -> TestbedScenario:
    """A built-in scenario by name, or a scenario from a .toml (or .json) file.

    Raises:
        ScenarioError: unknown name, unreadable file or invalid content (the field is named).
    """
    builtins = builtin_scenarios()
    if name_or_path in builtins:
        return builtins[name_or_path]
    path = Path(name_or_path)
    if path.suffix not in (".toml", ".json"):
        raise _fail("name", name_or_path, f"a built-in ({', '.join(builtins)}) or a .toml file")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except OSError as exc:
        raise ScenarioError(f"scenario file {str(path)!r}: {exc.strerror}") from exc
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"scenario file {str(path)!r}: {exc}") from exc
    return scenario_from_dict(data, name=path.stem)
