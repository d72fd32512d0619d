"""`geotrain testbed export --kubernetes`: the manifests a scenario becomes, checked offline (no
cluster is reachable from here). Core kinds pass the Kubernetes schemas (kubernetes-validate);
Chaos Mesh's objects are checked against the fields of its CRDs (chaos-mesh.org/v1alpha1), and
their selectors are evaluated against the exported pods' labels, so that what each pair of peers
would get (delay, jitter, loss, rate) is compared with the scenario's own link matrix. The Job's
`testbed collect` is run on a folder laid out as the Job and the peers leave it, and `testbed
report` reads the result."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest

from geotrain.node import config_from_toml
from geotrain.node.cli._main import main
from geotrain.node.identity import MembershipCertificate
from geotrain.testbed._kubernetes import CONFIG, DATA, FILES
from geotrain.testbed._scenario import load_scenario

K8S_VERSION = "1.30.0"

SCENARIO = """
description = "two regions, homes behind NAT and access links, a kill with a restart, a kill for
good, a partition healed"
task = "synthetic-linreg"
duration_s = 60
[[regions]]
name = "dc"
peers = 2
[[regions]]
name = "Home_Lines"
peers = 3
access = { up_mbit = 20, down_mbit = 100, delay_ms = 10 }
[links.inside]
delay_ms = 5
rate_mbit = 1000
[[links.between]]
regions = ["dc", "Home_Lines"]
delay_ms = 40
jitter_ms = 2
loss = 0.01
rate_mbit = 200
[[access]]
peer = 1
down_mbit = 50
[[stragglers]]
peer = 2
slowdown = 4.0
[[faults]]
at_s = 10
action = "kill"
peer = 1
[[faults]]
at_s = 25
action = "restart"
peer = 1
[[faults]]
at_s = 30
action = "kill"
peer = 4
[[faults]]
at_s = 15
action = "partition"
regions = ["dc", "Home_Lines"]
[[faults]]
at_s = 35
action = "heal"
"""
SCENARIO = SCENARIO.replace("for\ngood", "for good")

# Chaos Mesh's fields (v1alpha1, as its CRD config/crd/bases/chaos-mesh.org_networkchaos.yaml
# and its docs for PodChaos and Workflow state them): what each object may and must hold
NETWORK_SPEC = {"action", "mode", "value", "selector", "direction", "target", "delay", "loss",
                "duplicate", "corrupt", "bandwidth", "duration", "externalTargets"}
NETWORK_ACTIONS = {"netem", "delay", "loss", "duplicate", "corrupt", "partition", "bandwidth"}
MODES = {"one", "all", "fixed", "fixed-percent", "random-max-percent"}
SELECTOR = {"namespaces", "labelSelectors", "annotationSelectors", "fieldSelectors",
            "expressionSelectors", "nodeSelectors", "nodes", "podPhaseSelectors", "pods"}
POD_ACTIONS = {"pod-kill", "pod-failure", "container-kill"}
TEMPLATE_TYPES = {"Task", "Serial", "Parallel", "Suspend", "Schedule", "StatusCheck",
                  "NetworkChaos", "PodChaos", "IOChaos", "StressChaos", "TimeChaos",
                  "KernelChaos", "DNSChaos", "HTTPChaos", "JVMChaos"}  # fmt: skip


def _export(tmp_path: Path, scenario: str, *more: str) -> dict[str, list[dict]]:
    yaml = pytest.importorskip("yaml", reason="pip install -e '.[dev]' installs PyYAML")

    out = tmp_path / "k8s"
    assert main(["testbed", "export", "--kubernetes", scenario, "--out", str(out),
                 "--image", "registry.example.org/geotrain:cpu", *more]) == 0  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    return {name: [d for d in yaml.safe_load_all((out / name).read_text()) if d]
            for name in FILES}  # fmt: skip


def _all(files: dict[str, list[dict]]) -> list[dict]:
    return [d for docs in files.values() for d in docs]


def _kind(files, kind: str) -> list[dict]:
    return [d for d in _all(files) if d["kind"] == kind]


def _validate_core(files) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]' installs it")
    core = [d for d in _all(files) if not d["apiVersion"].startswith("chaos-mesh.org/")]
    assert {d["kind"] for d in core} >= {"Namespace", "PersistentVolumeClaim", "ConfigMap",
                                         "Secret", "Service", "Pod", "Job"}  # fmt: skip
    for doc in core:
        kv.validate(doc, K8S_VERSION, strict=True)


def _matches(selector: dict, pod: dict, namespace: str) -> bool:
    """Whether a Chaos Mesh selector picks `pod` (the parts this export uses)."""
    assert set(selector) <= SELECTOR, set(selector) - SELECTOR
    labels = pod["metadata"]["labels"]
    return (namespace in selector["namespaces"]
            and all(labels.get(k) == v for k, v in selector["labelSelectors"].items()))


def _check_network_chaos(doc: dict) -> None:
    spec = doc["spec"]
    assert set(spec) <= NETWORK_SPEC, set(spec) - NETWORK_SPEC
    assert spec["action"] in NETWORK_ACTIONS and spec["mode"] in MODES
    assert spec.get("direction", "to") in {"to", "from", "both"}
    assert spec["selector"]["labelSelectors"], "an empty selector picks every pod of the namespace"
    if "target" in spec:
        assert set(spec["target"]) <= {"mode", "selector", "value"}
        assert spec["target"]["mode"] in MODES and spec["target"]["selector"]["labelSelectors"]
    if spec["action"] == "bandwidth":
        bw = spec["bandwidth"]
        assert set(bw) <= {"rate", "limit", "buffer", "peakrate", "minburst"}
        assert bw["rate"].endswith("kbps") and float(bw["rate"][:-4]) > 0
        for name in ("limit", "buffer"):  # int32, >= 1
            assert isinstance(bw[name], int) and 1 <= bw[name] < 2**31
    if spec["action"] == "netem":
        assert "delay" in spec or "loss" in spec
        if "delay" in spec:
            assert set(spec["delay"]) <= {"latency", "jitter", "correlation", "reorder"}
            assert spec["delay"]["latency"].endswith("ms")
        if "loss" in spec:
            assert set(spec["loss"]) <= {"loss", "correlation"}


def _ms(text: str) -> float:
    assert text.endswith("ms")
    return float(text[:-2])


def _what_pairs_get(files, namespace: str) -> dict[tuple[int, int], dict[str, float]]:
    """Per ordered pair of peers, what the NetworkChaos objects add up to on the way from i to
    j: delay, jitter and loss (netem objects stack), and the lowest rate (bandwidth)."""
    pods = {int(p["metadata"]["labels"]["geotrain.testbed/peer"]): p for p in _kind(files, "Pod")}
    got: dict[tuple[int, int], dict[str, float]] = {}
    for doc in _kind(files, "NetworkChaos"):
        _check_network_chaos(doc)
        spec = doc["spec"]
        assert spec["direction"] == "to" and spec["mode"] == "all"
        for i, src in pods.items():
            if not _matches(spec["selector"], src, namespace):
                continue
            for j, dst in pods.items():
                if i == j or not _matches(spec["target"]["selector"], dst, namespace):
                    continue
                pair = got.setdefault((i, j), {"delay_ms": 0.0, "jitter_ms": 0.0, "loss": 0.0,
                                               "rate_mbit": float("inf")})  # fmt: skip
                if spec["action"] == "netem":
                    pair["delay_ms"] += _ms(spec["delay"]["latency"])
                    pair["jitter_ms"] += _ms(spec["delay"]["jitter"])
                    if "loss" in spec:
                        pair["loss"] += float(spec["loss"]["loss"]) / 100
                else:
                    rate = float(spec["bandwidth"]["rate"][:-4]) / 125  # kB/s -> Mbit/s
                    pair["rate_mbit"] = min(pair["rate_mbit"], rate)
    return got


@pytest.mark.parametrize("scenario", ["geo3", "homes", "custom"])
def test_every_pair_of_peers_gets_the_scenarios_links(tmp_path, scenario):
    if scenario == "custom":
        (tmp_path / "custom.toml").write_text(SCENARIO)
        scenario = str(tmp_path / "custom.toml")
    files = _export(tmp_path, scenario, "--namespace", "wan-test")
    _validate_core(files)
    sc = load_scenario(scenario)
    matrix = sc.matrix()
    got = _what_pairs_get(files, "wan-test")
    for i in range(sc.n_peers):
        for j in range(sc.n_peers):
            if i == j:
                continue
            want = matrix.path_spec(i, j)
            have = got.get((i, j), {"delay_ms": 0, "jitter_ms": 0, "loss": 0,
                                    "rate_mbit": float("inf")})  # fmt: skip
            where = f"peer {i} -> {j}"
            assert have["delay_ms"] == pytest.approx(want.delay_ms), where
            assert have["jitter_ms"] == pytest.approx(want.jitter_ms), where
            assert have["loss"] == pytest.approx(want.loss), where
            assert have["rate_mbit"] == pytest.approx(want.rate_mbit or float("inf")), where


def _pod_files(pod: dict, configmap: dict, secret: dict) -> dict[str, str]:
    """Path -> content of the files the pod's node sees, from its volumes and mounts."""
    spec = pod["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    out = {}
    for mount in spec["containers"][0]["volumeMounts"]:
        vol = volumes[mount["name"]]
        if "configMap" in vol:
            assert vol["configMap"]["name"] == configmap["metadata"]["name"]
            out.update({f"{mount['mountPath']}/{k}": v for k, v in configmap["data"].items()})
        if "secret" in vol:
            assert vol["secret"]["secretName"] == secret["metadata"]["name"]
            out.update({f"{mount['mountPath']}/{item['path']}":
                        base64.b64decode(secret["data"][item["key"]]).decode()
                        for item in vol["secret"]["items"]})  # fmt: skip
    return out


def test_each_pod_runs_its_peers_node_config_with_its_own_credentials(tmp_path):
    (tmp_path / "custom.toml").write_text(SCENARIO)
    files = _export(tmp_path, str(tmp_path / "custom.toml"), "--nat", "3,4")
    sc = load_scenario(str(tmp_path / "custom.toml"))
    (configmap,) = _kind(files, "ConfigMap")
    (secret,) = _kind(files, "Secret")
    (service,) = _kind(files, "Service")
    pods = sorted(_kind(files, "Pod"), key=lambda p: p["metadata"]["name"])
    assert len(pods) == sc.n_peers
    peer_ids = set()
    for i, pod in enumerate(pods):
        script = pod["spec"]["containers"][0]["command"][2]
        config_path = f"{CONFIG}/peer-{i:02d}.toml"
        assert config_path in script
        seen = _pod_files(pod, configmap, secret)
        config = config_from_toml(seen[config_path], base=Path(CONFIG))
        assert config.training.shard_index == i and config.training.num_shards == sc.n_peers
        assert config.training.slowdown == sc.slowdown(i)
        assert str(config.state.dir) == f"{DATA}/geotrain/peer-{i:02d}"
        assert str(config.identity.certificate) in seen and str(config.identity.swarm) in seen
        # the key is copied 0600 from the secret into the path the config names
        assert f"/credentials/identity.key {config.identity.key}" in script
        cert_file = tmp_path / f"cert-{i}.json"
        cert_file.write_text(seen[str(config.identity.certificate)])
        peer_ids.add(MembershipCertificate.load(cert_file).peer_public_key)
        host = f"p{i:02d}.{service['metadata']['name']}"
        assert pod["spec"]["hostname"] == f"p{i:02d}"
        assert pod["spec"]["subdomain"] == service["metadata"]["name"]
        assert _matches({"namespaces": [pod["metadata"]["namespace"]],
                         "labelSelectors": service["spec"]["selector"]}, pod,
                        pod["metadata"]["namespace"])  # fmt: skip
        if i in (3, 4):  # behind NAT: client mode, and nothing may connect to it
            assert not config.network.reachable
            (policy,) = [p for p in _kind(files, "NetworkPolicy")
                         if p["spec"]["podSelector"]["matchLabels"].items()
                         <= pod["metadata"]["labels"].items()]  # fmt: skip
            assert policy["spec"]["ingress"] == [] and policy["spec"]["policyTypes"] == ["Ingress"]
        else:
            assert config.network.advertise.startswith(f"tcp://{host}.")
            assert config.network.listen == "tcp://0.0.0.0:7000"
        if i:
            assert config.network.bootstrap == (_advertise(configmap, 0),)
    assert len(peer_ids) == sc.n_peers  # each its own identity
    assert len(_kind(files, "NetworkPolicy")) == 2


def _advertise(configmap: dict, i: int) -> str:
    import tomllib

    return tomllib.loads(configmap["data"][f"peer-{i:02d}.toml"])["network"]["advertise"]


def test_the_fault_timeline_is_a_chaos_mesh_workflow_at_the_scenarios_times(tmp_path):
    (tmp_path / "custom.toml").write_text(SCENARIO)
    files = _export(tmp_path, str(tmp_path / "custom.toml"), "--startup-s", "30")
    (workflow,) = _kind(files, "Workflow")
    spec = workflow["spec"]
    templates = {t["name"]: t for t in spec["templates"]}
    assert len(templates) == len(spec["templates"]) and spec["entry"] in templates
    for t in templates.values():
        assert t["templateType"] in TEMPLATE_TYPES
        for child in t.get("children", []):
            assert child in templates
    pods = _kind(files, "Pod")
    ns = workflow["metadata"]["namespace"]
    faults = []  # (at, what, how long, whom)
    for branch in templates[spec["entry"]]["children"]:
        steps = [templates[c] for c in templates[branch]["children"]]
        at = sum(int(s["deadline"][:-1]) for s in steps if s["templateType"] == "Suspend")
        (do,) = [s for s in steps if s["templateType"] != "Suspend"]
        body = do["podChaos"] if do["templateType"] == "PodChaos" else do["networkChaos"]
        whom = sorted(int(p["metadata"]["labels"]["geotrain.testbed/peer"]) for p in pods
                      if _matches(body["selector"], p, ns))  # fmt: skip
        if do["templateType"] == "PodChaos":
            assert set(body) <= {"action", "mode", "value", "selector", "containerNames",
                                 "gracePeriod", "duration"}  # fmt: skip
            assert body["action"] in POD_ACTIONS and body["mode"] in MODES
        else:
            _check_network_chaos({"spec": body})
        faults.append((at, body["action"], int(do["deadline"][:-1]), whom))
    assert sorted(faults) == [
        (10, "pod-failure", 15, [1]),  # killed at 10, back at 25 (its restart)
        (15, "partition", 20, [0, 1]),  # dc | Home_Lines until the heal at 35
        (30, "pod-kill", 10, [4]),  # for good: a bare pod is not recreated
    ]


@pytest.mark.parametrize("change, field", [
    ('\n[[attackers]]\npeer = 2\nkind = "sign_flip"\n', "scenario.attackers"),
    ('\n[[faults]]\nat_s = 40\naction = "degrade"\nregions = ["dc", "Home_Lines"]\n'
     "delay_ms = 100\n", "scenario.faults[5]"),
    ("\n[[availability]]\npeer = 2\nonline_s = 10\noffline_s = 10\n", "scenario.availability"),
])  # fmt: skip
def test_what_kubernetes_cannot_emulate_is_refused_by_name(tmp_path, capsys, change, field):
    (tmp_path / "custom.toml").write_text(SCENARIO + change)
    out = tmp_path / "k8s"
    assert main(["testbed", "export", "--kubernetes", str(tmp_path / "custom.toml"),
                 "--out", str(out)]) == 2  # fmt: skip
    assert field in capsys.readouterr().err
    assert not out.exists()


def test_a_bad_name_or_a_full_folder_is_refused(tmp_path, capsys):
    assert main(["testbed", "export", "--kubernetes", "demo", "--name", "Not_DNS",
                 "--out", str(tmp_path / "a")]) == 2  # fmt: skip
    assert "--name 'Not_DNS'" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    assert main(["testbed", "export", "--kubernetes", "demo", "--out", str(tmp_path / "b")]) == 2


def test_the_scripts_are_valid_shell(tmp_path):
    files = _export(tmp_path, "demo")
    scripts = [c["command"][2] for p in _kind(files, "Pod") for c in p["spec"]["containers"]]
    (job,) = _kind(files, "Job")
    scripts.append(job["spec"]["template"]["spec"]["containers"][0]["command"][2])
    for script in scripts:
        done = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert "geotrain testbed collect /data" in scripts[-1]
    assert "geotrain testbed report /data" in scripts[-1]


def test_collect_makes_a_folder_that_testbed_report_reads(tmp_path, capsys):
    """The run folder as the Job and the peers leave it on the volume: the Job's copies of
    scenario.json and run.json, its start time, each peer's metrics."""
    files = _export(tmp_path, "demo")
    (configmap,) = _kind(files, "ConfigMap")
    run = tmp_path / "run"
    (run / "geotrain").mkdir(parents=True)
    (run / "scenario.json").write_text(configmap["data"]["scenario.json"])
    (run / "kubernetes-run.json").write_text(configmap["data"]["run.json"])
    t0 = 1_000_000.0
    (run / "started-at").write_text(f"{int(t0)}\n")
    n = json.loads(configmap["data"]["run.json"])["peers"]
    for i in range(n):
        peer = run / "geotrain" / f"peer-{i:02d}"
        peer.mkdir()
        (peer / "metrics.jsonl").write_text("".join(
            json.dumps({"t": t0 + 30 + s, "step": 10 * s, "steps_per_s": 10.0,
                        "metric": 0.5 + 0.1 * s, "bytes_out": 1000 * s}) + "\n"
            for s in range(1, 6)))  # fmt: skip
    assert main(["testbed", "report", str(run)]) == 2  # no run.json yet
    assert main(["testbed", "collect", str(run)]) == 0
    doc = json.loads((run / "run.json").read_text())
    assert doc["systems"]["geotrain"]["launch_t"] == t0 and doc["emulation"] == "chaos-mesh"
    capsys.readouterr()
    assert main(["testbed", "report", str(run)]) == 0
    assert "geotrain" in capsys.readouterr().out
    assert json.loads((run / "summary.json").read_text())["peers"] == n


def test_collect_of_a_folder_that_is_no_run_is_refused(tmp_path, capsys):
    assert main(["testbed", "collect", str(tmp_path)]) == 2
    assert "not a Kubernetes run's folder" in capsys.readouterr().err
