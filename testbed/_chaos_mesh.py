# A testbed scenario's links and fault timeline as Chaos Mesh objects (chaos-mesh.org/v1alpha1):
# NetworkChaos per ordered region pair and per access link, and one Workflow for the faults.
# Invariants: every object acts only on the run's own pods (selected by the run's labels, in its
# namespace); a link with nothing to emulate makes no object; rates are written in tc's byte units
# (Chaos Mesh's "kbps" is 1000 bytes a second), delays in ms, loss as a percentage; the field
# names are those of Chaos Mesh's CRDs (tests/test_testbed_kubernetes.py checks them).
from __future__ import annotations

from typing import Any

from ._kubernetes import LABEL, KubernetesTarget, _meta, _region_label, _selector
from ._linkspec import LinkSpec
from ._scenario import TestbedScenario

CHAOS_API = "chaos-mesh.org/v1alpha1"
MTU_BYTES = 1500


def _chaos(target: KubernetesTarget, name: str, action: str, source: dict[str, str],
           dest: dict[str, str], describe: str, **spec: Any) -> dict[str, Any]:  # fmt: skip
    """A NetworkChaos on the egress of the pods labelled `source` toward those labelled `dest`
    (direction "to"), until it is deleted (no duration)."""
    meta = _meta(target, name)
    meta["annotations"] = {f"{LABEL}/link": describe}
    return {"apiVersion": CHAOS_API, "kind": "NetworkChaos", "metadata": meta,
            "spec": {"action": action, "mode": "all", "direction": "to",
                     "selector": _selector(target, source),
                     "target": {"mode": "all", "selector": _selector(target, dest)},
                     **spec}}  # fmt: skip


def netem_spec(spec: LinkSpec) -> dict[str, Any] | None:
    """A link's delay, jitter and loss as NetworkChaos "netem" fields (None: nothing to add)."""
    if spec.delay_ms == 0 and spec.jitter_ms == 0 and spec.loss == 0:
        return None
    out: dict[str, Any] = {"delay": {"latency": f"{spec.delay_ms:g}ms",
                                     "jitter": f"{spec.jitter_ms:g}ms", "correlation": "0"}}
    if spec.loss:
        out["loss"] = {"loss": f"{spec.loss * 100:g}", "correlation": "0"}  # (a percentage)
    return out


def bandwidth_spec(rate_mbit: float) -> dict[str, Any]:
    """A rate as NetworkChaos "bandwidth" fields: tc's token bucket, whose units are bytes
    ("kbps" is 1000 bytes a second), with a burst of 4 ms of the rate (one tick at HZ 250, at
    least 10 packets) and 50 ms of queue."""
    per_s = rate_mbit * 1e6 / 8  # bytes a second
    return {"bandwidth": {"rate": f"{rate_mbit * 125:g}kbps",
                          "buffer": max(10 * MTU_BYTES, int(per_s * 0.004)),
                          "limit": max(20 * MTU_BYTES, int(per_s * 0.05))}}  # fmt: skip


def link_chaos(target: KubernetesTarget, sc: TestbedScenario) -> list[dict[str, Any]]:
    """NetworkChaos for every ordered region pair (inside a region too): netem for delay,
    jitter and loss, bandwidth for the rate; and each access link: the peer's uplink and
    access delay on its own egress, its downlink and access delay on every other peer's
    egress toward it."""
    matrix, out = sc.matrix(), []
    for (a, b), spec in matrix.links.items():
        ra, rb = _region_label(sc, a), _region_label(sc, b)
        src, dst, what = {"region": ra}, {"region": rb}, f"{a} -> {b}: {spec}"
        netem = netem_spec(spec)
        if netem:
            out.append(_chaos(target, f"{target.name}-link-{ra}-{rb}", "netem", src, dst, what,
                              **netem))  # fmt: skip
        if spec.rate_mbit is not None:
            out.append(_chaos(target, f"{target.name}-rate-{ra}-{rb}", "bandwidth", src, dst,
                              what, **bandwidth_spec(spec.rate_mbit)))  # fmt: skip
    for i, access in enumerate(matrix.access):
        if access is None:
            continue
        me, peers, p = {"peer": f"{i:02d}"}, {"role": "peer"}, f"p{i:02d}"
        what = f"peer {i}'s access link: {access}"
        if access.up_mbit is not None:
            out.append(_chaos(target, f"{target.name}-up-{p}", "bandwidth", me, peers, what,
                              **bandwidth_spec(access.up_mbit)))  # fmt: skip
        if access.down_mbit is not None:  # (each sender's own bucket: not one shared downlink)
            out.append(_chaos(target, f"{target.name}-down-{p}", "bandwidth", peers, me, what,
                              **bandwidth_spec(access.down_mbit)))  # fmt: skip
        delay = netem_spec(LinkSpec(delay_ms=access.delay_ms))
        if delay:
            out.append(_chaos(target, f"{target.name}-out-{p}", "netem", me, peers, what, **delay))
            out.append(_chaos(target, f"{target.name}-in-{p}", "netem", peers, me, what, **delay))
    return out


def _deadline(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def fault_workflow(target: KubernetesTarget, sc: TestbedScenario) -> list[dict[str, Any]]:
    """The fault timeline as one Chaos Mesh Workflow, counted from when it is applied (with the
    Job that starts the run): a kill that a restart follows is a PodChaos pod-failure lasting
    until the restart (the container is replaced by a pause image, then comes back and resumes
    from its checkpoint); a kill for good is a pod-kill (a bare pod is not recreated); a
    partition is a NetworkChaos partition between the two regions until the next heal."""
    end_s = sc.duration_s + target.startup_s
    steps: list[tuple[float, str, dict[str, Any], float]] = []  # (at, kind, spec, lasting)
    for i, fault in enumerate(sc.faults):
        if fault.action == "kill":
            restart = next((f.at_s for f in sc.faults[i + 1:]
                            if f.action == "restart" and f.peer == fault.peer), None)  # fmt: skip
            action = "pod-kill" if restart is None else "pod-failure"
            lasting = 10.0 if restart is None else restart - fault.at_s
            steps.append((fault.at_s, "PodChaos", {
                "action": action, "mode": "all",
                "selector": _selector(target, {"peer": f"{fault.peer:02d}"})}, lasting))
        elif fault.action == "partition":
            a, b = fault.regions or ("", "")
            heal = next((f.at_s for f in sc.faults[i + 1:] if f.action == "heal"), end_s)
            steps.append((fault.at_s, "NetworkChaos", {
                "action": "partition", "mode": "all", "direction": "both",
                "selector": _selector(target, {"region": _region_label(sc, a)}),
                "target": {"mode": "all",
                           "selector": _selector(target, {"region": _region_label(sc, b)})},
            }, heal - fault.at_s))  # fmt: skip
    if not steps:
        return []
    templates: list[dict[str, Any]] = [
        {"name": "faults", "templateType": "Parallel",
         "children": [f"fault-{k}" for k in range(len(steps))]}]  # fmt: skip
    for k, (at_s, kind, spec, lasting) in enumerate(steps):
        field_name = kind[0].lower() + kind[1:]  # podChaos, networkChaos
        children = [f"fault-{k}-do"] if at_s <= 0 else [f"fault-{k}-wait", f"fault-{k}-do"]
        templates.append({"name": f"fault-{k}", "templateType": "Serial", "children": children})
        if at_s > 0:
            templates.append({"name": f"fault-{k}-wait", "templateType": "Suspend",
                              "deadline": _deadline(at_s)})  # fmt: skip
        templates.append({"name": f"fault-{k}-do", "templateType": kind,
                          "deadline": _deadline(lasting), field_name: spec})  # fmt: skip
    return [{"apiVersion": CHAOS_API, "kind": "Workflow",
             "metadata": _meta(target, f"{target.name}-faults"),
             "spec": {"entry": "faults", "templates": templates}}]  # fmt: skip


