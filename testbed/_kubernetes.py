# A testbed scenario as Kubernetes manifests: a pod per peer, Chaos Mesh NetworkChaos for the
# links, a Chaos Mesh Workflow (PodChaos, partitions) for the fault timeline, and a Job that starts
# the run and collects it into a folder `geotrain testbed report` reads. Invariants: the nodes'
# configs are built by the local testbed's own _node_config and checked as `testbed run` checks
# them (only the listen address differs: a pod listens on every interface and advertises its DNS
# name); a scenario part Kubernetes cannot emulate here is refused with the field named, never
# dropped; nothing here talks to a cluster: it returns plain dicts (one list per manifest file).
from __future__ import annotations

import base64
import json
import re
import shlex
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from geotrain.node import config_to_toml

from ._peers import NODE_PORT, Host, write_swarm_files
from ._run import RunOptions, _node_config, _spec_links, check_node_config
from ._scenario import ScenarioError, TestbedScenario

# The files `geotrain testbed export` writes, in the order they are applied (docs/how-to).
FILES = ("00-setup.yaml", "10-peers.yaml", "20-links.yaml", "30-run.yaml")
LABEL = "geotrain.testbed"  # label prefix: run, peer, region, role
DATA = "/data"  # the run folder (a ReadWriteMany volume): peers' state dirs, run.json, summary
CONFIG = "/config"  # peers' node configs, swarm.json, scenario.json, the run.json template
CREDENTIALS = "/credentials"  # one peer's key and certificate (its items of the Secret)
IDENTITY = "/run/geotrain/identity"  # the key copied 0600 (the node warns on a readable key)


class ExportError(ScenarioError):
    """The scenario has a part the Kubernetes export cannot emulate; the message names it."""


@dataclass(frozen=True)
class KubernetesTarget:
    """Where and how the exported run goes.

    Attributes:
        name: the run's name: object names and the `geotrain.testbed/run` label (DNS-1123).
        namespace: the namespace every object lives in (created by 00-setup.yaml).
        image: the geotrain image (examples/deploy/Containerfile) the cluster can pull.
        storage_class: a ReadWriteMany storage class for the run folder (None: the default).
        storage: the run folder's size (checkpoints and metrics of every peer).
        cpu, memory: each peer's requests (memory is also its limit).
        startup_s: seconds allowed for the nodes to start before the scenario's duration counts
            (the local testbed counts from the first step; here the run's end is fixed when the
            Job starts it).
        cluster_domain: the cluster's DNS domain (pods dial each other by name).
    """

    name: str = "geotrain-testbed"
    namespace: str = "geotrain-testbed"
    image: str = "geotrain:cpu"
    storage_class: str | None = None
    storage: str = "20Gi"
    cpu: str = "1"
    memory: str = "2Gi"
    startup_s: float = 120.0
    cluster_domain: str = "cluster.local"

    def __post_init__(self) -> None:
        for field_name in ("name", "namespace"):
            value = getattr(self, field_name)
            if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", value):
                raise ExportError(f"--{field_name} {value!r}: expected a DNS label (lowercase "
                                  "letters, digits and '-', at most 40 characters)")  # fmt: skip
        if not self.startup_s >= 0:
            raise ExportError(f"--startup-s {self.startup_s!r}: expected seconds >= 0")


def check_exportable(sc: TestbedScenario) -> None:
    """Refuse what the export cannot emulate, naming the scenario's field.

    Raises:
        ExportError: attackers, availability windows or a degrade fault.
    """
    if sc.attackers:
        raise ExportError(f"scenario.attackers = {dict(sc.attackers)}: attacker peers run only "
                          "in the local testbed (testbed run)")  # fmt: skip
    if sc.availability:
        raise ExportError("scenario.availability: availability windows run only in the local "
                          "testbed (testbed run)")  # fmt: skip
    for i, fault in enumerate(sc.faults):
        if fault.action == "degrade":
            raise ExportError(f"scenario.faults[{i}] = {fault.describe()!r}: degrade is not "
                              "exported (kill, restart, partition and heal are)")  # fmt: skip


def export_manifests(options: RunOptions, target: KubernetesTarget,
                     run_doc: dict[str, Any], now: float) -> dict[str, list[dict]]:  # fmt: skip
    """The run's manifests, by file name (FILES).

    Args:
        options: the run as `testbed run` would make it (scenario, overrides, evaluation).
        target: where it goes.
        run_doc: run.json's fields known before the run (the Job's collect adds the rest).
        now: wall time, for the throwaway swarm's certificates.

    Raises:
        ExportError: the scenario cannot be exported (see check_exportable).
        TestbedError: the nodes' config is refused (as `testbed run` refuses it).
    """
    from ._chaos_mesh import fault_workflow, link_chaos  # (it builds on the names here)

    sc = options.scenario
    check_exportable(sc)
    check_node_config(options)
    with tempfile.TemporaryDirectory() as tmp:
        files = write_swarm_files(Path(tmp), sc.n_peers, now)
        secret = {f"peer-{i:02d}.{ext}": base64.b64encode(path.read_bytes()).decode()
                  for i, (key, cert, _) in enumerate(files)
                  for ext, path in (("key", key), ("cert", cert))}  # fmt: skip
        swarm = files[0][2].read_text()
    configs = _node_configs(options, target)
    data = {f"peer-{i:02d}.toml": config_to_toml(doc) for i, doc in enumerate(configs)}
    data["swarm.json"] = swarm
    data["scenario.json"] = _json(sc.to_json())
    data["run.json"] = _json(run_doc)
    return {
        "00-setup.yaml": _setup(target, data, secret),
        "10-peers.yaml": [_peer_pod(target, options, i) for i in range(sc.n_peers)]
        + [_nat_policy(target, i) for i in sc.nat],
        "20-links.yaml": link_chaos(target, sc),
        "30-run.yaml": [_collect_job(target, sc)] + fault_workflow(target, sc),
    }


def _json(doc: Any) -> str:
    return json.dumps(doc, indent=2) + "\n"


def peer_host(target: KubernetesTarget, i: int) -> str:
    """Peer i's DNS name: its pod's hostname under the run's headless Service."""
    return f"p{i:02d}.{target.name}.{target.namespace}.svc.{target.cluster_domain}"


def _node_configs(options: RunOptions, target: KubernetesTarget) -> list[dict[str, Any]]:
    """Each peer's node config: the local testbed's, with the pod's paths and addresses."""
    sc = options.scenario
    files = (Path(IDENTITY) / "identity.key", Path(CREDENTIALS) / "certificate.json",
             Path(CONFIG) / "swarm.json")  # fmt: skip
    bootstrap = [f"tcp://{peer_host(target, 0)}:{NODE_PORT}"]
    out = []
    for i in range(sc.n_peers):
        host = Host(i, peer_host(target, i), "eth0", prefix=("pod",))  # its own address
        state = Path(DATA) / "geotrain" / f"peer-{i:02d}"
        doc = _node_config(options, host, files, state, [] if i == 0 else bootstrap)
        if i not in sc.nat:  # every interface of the pod; peers dial its name
            doc["network"]["listen"] = f"tcp://0.0.0.0:{NODE_PORT}"
        out.append(doc)
    return out


def _labels(target: KubernetesTarget, **more: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "geotrain-testbed", f"{LABEL}/run": target.name,
            **{f"{LABEL}/{k}": v for k, v in more.items()}}  # fmt: skip


def _meta(target: KubernetesTarget, name: str, **labels: str) -> dict[str, Any]:
    return {"name": name, "namespace": target.namespace, "labels": _labels(target, **labels)}


def _selector(target: KubernetesTarget, labels: dict[str, str]) -> dict[str, Any]:
    return {"namespaces": [target.namespace], "labelSelectors": _labels(target, **labels)}


def _setup(target: KubernetesTarget, config: dict[str, str],
           secret: dict[str, str]) -> list[dict[str, Any]]:  # fmt: skip
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],  # every peer writes its own folder, the Job reads all
        "resources": {"requests": {"storage": target.storage}},
    }
    if target.storage_class:
        claim["storageClassName"] = target.storage_class
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": target.namespace, "labels": _labels(target)}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": _meta(target, f"{target.name}-data"), "spec": claim},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": _meta(target, f"{target.name}-config"), "data": config},
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": _meta(target, f"{target.name}-credentials"), "data": secret},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(target, target.name),
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                  "selector": _labels(target, role="peer"),
                  "ports": [{"name": "gossip", "port": NODE_PORT}]}},
    ]  # fmt: skip


def _run_script(i: int, overrides: tuple[str, ...]) -> str:
    """A peer waits for the Job's start (DATA/end-at), runs its node until the run's end (SIGTERM:
    a clean stop, its final checkpoint), and ends 0; after a kill it resumes from its checkpoint
    until the same end. Exit 124 is timeout's own, for a node it stopped."""
    return "\n".join([
        "set -u",
        f"install -m 0600 {CREDENTIALS}/identity.key {IDENTITY}/identity.key",
        f"until [ -s {DATA}/end-at ]; do sleep 1; done",
        f"left=$(( $(cat {DATA}/end-at) - $(date +%s) ))",
        '[ "$left" -gt 0 ] || exit 0',
        f'timeout -s TERM -k 60 "$left" geotrain node run --config {CONFIG}/peer-{i:02d}.toml'
        + "".join(f" --set {shlex.quote(item)}" for item in overrides),  # as `testbed run`
        "rc=$?",
        '[ "$rc" -eq 124 ] && exit 0',
        'exit "$rc"',
    ])  # fmt: skip


def _security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip


def _peer_pod(target: KubernetesTarget, options: RunOptions, i: int) -> dict[str, Any]:
    sc = options.scenario
    region = sc.peer_regions[i]
    labels = {"role": "peer", "peer": f"{i:02d}", "region": _region_label(sc, region)}
    pod_meta = _meta(target, f"{target.name}-p{i:02d}", **labels)
    pod_meta["annotations"] = {f"{LABEL}/region-name": region}
    container = {
        "name": "node", "image": target.image,
        "command": ["sh", "-c", _run_script(i, options.node_overrides)],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "ports": [] if i in sc.nat else [{"name": "gossip", "containerPort": NODE_PORT}],
        "resources": {"requests": {"cpu": target.cpu, "memory": target.memory},
                      "limits": {"memory": target.memory}},
        "securityContext": _security(),
        "volumeMounts": [
            {"name": "data", "mountPath": DATA},
            {"name": "config", "mountPath": CONFIG, "readOnly": True},
            {"name": "credentials", "mountPath": CREDENTIALS, "readOnly": True},
            {"name": "identity", "mountPath": IDENTITY},
        ],
    }  # fmt: skip
    items = [{"key": f"peer-{i:02d}.key", "path": "identity.key"},
             {"key": f"peer-{i:02d}.cert", "path": "certificate.json"}]  # fmt: skip
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
        "spec": {
            "hostname": f"p{i:02d}", "subdomain": target.name,
            # a node that crashes or is killed by a PodChaos comes back from its checkpoint;
            # one that ends at the run's end exits 0 and stays done
            "restartPolicy": "OnFailure",
            "terminationGracePeriodSeconds": 90,
            "securityContext": _pod_security(),
            "containers": [container],
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": f"{target.name}-data"}},
                {"name": "config", "configMap": {"name": f"{target.name}-config"}},
                {"name": "credentials", "secret": {"secretName": f"{target.name}-credentials",
                                                   "items": items, "defaultMode": 0o440}},
                {"name": "identity", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            ],
        },
    }  # fmt: skip


def _nat_policy(target: KubernetesTarget, i: int) -> dict[str, Any]:
    """A peer behind NAT: nothing may connect to it (replies to its own dials still arrive, as
    through a home router); its node runs in client mode."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(target, f"{target.name}-nat-p{i:02d}"),
        "spec": {"podSelector": {"matchLabels": _labels(target, peer=f"{i:02d}")},
                 "policyTypes": ["Ingress"], "ingress": []},
    }  # fmt: skip


def _region_label(sc: TestbedScenario, region: str) -> str:
    """A region's label value: its index (names need not be valid label values)."""
    return f"r{[r.name for r in sc.regions].index(region)}"


GRACE_S = 90  # after the run's end: the nodes' final checkpoints, before the Job collects
KEEP_S = 3600  # the Job's pod stays this long after the report, for `kubectl cp`


def _collect_script(sc: TestbedScenario, target: KubernetesTarget) -> str:
    run_s = round(sc.duration_s + target.startup_s)
    return "\n".join([
        "set -eu",
        f"cd {DATA}",
        "if [ ! -s end-at ]; then",  # (a restarted Job keeps the run's start)
        f"  cp {CONFIG}/scenario.json scenario.json",
        f"  cp {CONFIG}/run.json kubernetes-run.json",
        "  date +%s > started-at",
        f"  echo $(( $(cat started-at) + {run_s} )) > end-at.tmp && mv end-at.tmp end-at",
        "fi",
        f'echo "run started; it ends at $(cat end-at) (+{GRACE_S} s for checkpoints)"',
        f"while [ $(date +%s) -lt $(( $(cat end-at) + {GRACE_S} )) ]; do sleep 5; done",
        f"geotrain testbed collect {DATA}",
        f"geotrain testbed report {DATA} --html",
        f'echo "copy the run folder within {KEEP_S} s: kubectl cp '
        f'{target.namespace}/$HOSTNAME:{DATA} ./{target.name}"',
        f"sleep {KEEP_S}",
    ])  # fmt: skip


def _collect_job(target: KubernetesTarget, sc: TestbedScenario) -> dict[str, Any]:
    lifetime = round(sc.duration_s + target.startup_s) + GRACE_S + KEEP_S + 600
    container = {
        "name": "collect", "image": target.image,
        "command": ["sh", "-c", _collect_script(sc, target)],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": _security(),
        "volumeMounts": [{"name": "data", "mountPath": DATA},
                         {"name": "config", "mountPath": CONFIG, "readOnly": True}],
    }  # fmt: skip
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _meta(target, f"{target.name}-collect", role="collect"),
        "spec": {
            "backoffLimit": 3, "activeDeadlineSeconds": lifetime,
            "template": {
                "metadata": {"labels": _labels(target, role="collect")},
                "spec": {
                    "restartPolicy": "OnFailure", "securityContext": _pod_security(),
                    "containers": [container],
                    "volumes": [
                        {"name": "data",
                         "persistentVolumeClaim": {"claimName": f"{target.name}-data"}},
                        {"name": "config", "configMap": {"name": f"{target.name}-config"}},
                    ],
                },
            },
        },
    }  # fmt: skip


def run_template(options: RunOptions, target: KubernetesTarget) -> dict[str, Any]:
    """run.json's fields known before the run; collect_run adds systems, faults and consensus."""
    sc = options.scenario
    return {
        "scenario": sc.name, "emulation": "chaos-mesh",
        "emulation_reason": f"Kubernetes, namespace {target.namespace}: Chaos Mesh NetworkChaos "
                            "(netem and tbf per pod, toward each region's pods)",
        "peers": sc.n_peers, "task": sc.task, "params": dict(sc.params),
        "algorithm": sc.algorithm, "target_value": options.target, "metric": options.metric,
        "higher_is_better": options.higher_is_better, "rate_scale": sc.rate_scale,
        "duration_s": sc.duration_s, "startup_s": target.startup_s, "systems": {},
        "faults": [], "links": _spec_links(sc), "node_overrides": list(options.node_overrides),
        "command": list(options.command), "cwd": None, "partition": sc.partition,
        "alpha": sc.alpha, "step_ms": sc.step_ms,
        "slowdowns": [sc.slowdown(i) for i in range(sc.n_peers)],
        "eval_every_s": options.eval_every_s, "attackers": {},
        "bytes_source": "the nodes' own counters (no emulator counts bytes on Kubernetes)",
    }  # fmt: skip


def collect_run(out: Path) -> dict[str, Any]:
    """run.json of a finished Kubernetes run, from the folder the Job and the peers wrote
    (kubernetes-run.json, started-at, end-at, scenario.json, geotrain/peer-NN/); written to
    out/run.json and returned.

    Raises:
        ValueError: a file the Job writes at the start is missing or unreadable.
    """
    import json

    from ._run import _final_consensus
    from ._rundir import write_json
    from ._scenario import scenario_from_dict

    try:
        run = json.loads((out / "kubernetes-run.json").read_text())
        started = float((out / "started-at").read_text())
        sc = scenario_from_dict(json.loads((out / "scenario.json").read_text()), run["scenario"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{out}: not a Kubernetes run's folder (the collect Job writes "
                         f"kubernetes-run.json, started-at and scenario.json): {exc}") from None
    run["systems"] = {"geotrain": {"launch_t": started, "stopped": "duration",
                                   "metrics": "geotrain/peer-NN/metrics.jsonl"}}  # fmt: skip
    note = "scheduled by the Chaos Mesh workflow, counted from the run's start (not its first step)"
    run["faults"] = [
        {"system": "geotrain", "at_s": f.at_s, "applied_at_s": f.at_s, "t": started + f.at_s,
         "fault": f.describe(), "applied": True, "note": note, "action": f.action,
         "peer": f.peer}
        for f in sc.faults
    ]  # fmt: skip
    run["consensus_distance_final"] = _final_consensus(out / "geotrain", sc.n_peers, set())
    write_json(out / "run.json", run)
    return run


def with_name(target: KubernetesTarget, scenario_name: str) -> KubernetesTarget:
    """`target` named after the scenario when no name was given (a valid DNS label)."""
    name = re.sub(r"[^a-z0-9-]+", "-", scenario_name.lower()).strip("-")[:40].strip("-")
    return replace(target, name=name or "geotrain-testbed")
