"""The container image recipe and the site's kustomize base (examples/deploy): the Containerfile
passes hadolint and installs every package folder; each site variant renders with `kubectl
kustomize`, its manifests pass the Kubernetes schemas offline (kubernetes-validate), and the
node.toml it mounts is a valid config whose paths are where the pod mounts the key, the
certificate, the swarm file and the state volume."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from geotrain.node import Identity, config_from_toml
from geotrain.node.cli._main import main

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "examples" / "deploy"
K8S_VERSION = "1.30.0"  # a Kubernetes release the schemas cover and clusters run


def _tool(name: str) -> str:
    """A tool of the dev extra (a wheel puts it beside this Python), or a skip saying why."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} not installed (pip install -e '.[dev]' installs it)")
    return found


def test_the_containerfile_passes_hadolint():
    done = subprocess.run([_tool("hadolint"), str(DEPLOY / "Containerfile")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_installs_every_package_as_a_non_root_user_with_geotrain_as_entrypoint():
    text = (DEPLOY / "Containerfile").read_text()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top = {name.split(".")[1] for name in packages["packages"] if name.count(".") >= 1}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    assert top and top <= copied, f"package folders the image leaves out: {top - copied}"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and not users[-1].startswith(("0", "root")), users
    assert re.search(r'^ENTRYPOINT \["geotrain"\]', text, re.M)
    assert re.search(r"^ARG TORCH=cpu$", text, re.M) and "whl/${TORCH}" in text
    assert "--max-age" in text  # the health check is the staleness probe


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> Path:
    """identity.key, certificate.json and swarm.json made by the CLI, as an operator makes them."""
    d = tmp_path_factory.mktemp("credentials")
    assert main(["keygen", "--out", str(d / "identity.key")]) == 0
    assert main(["swarm", "init", "--out", str(d / "authority")]) == 0
    shutil.copy(d / "authority" / "swarm.json", d / "swarm.json")
    peer = Identity.load(d / "identity.key").peer_id
    assert main(["swarm", "admit", "--swarm", str(d / "authority"), peer, "--expires", "30d",
                 "--out", str(d / "certificate.json")]) == 0  # fmt: skip
    return d


CLIENT_TOML = """
[identity]
key = "/run/geotrain/identity/identity.key"
certificate = "/run/geotrain/secret/certificate.json"
swarm = "/etc/geotrain/swarm.json"
[network]
listen = "tcp://127.0.0.1:7000"
reachable = false
bootstrap = ["tcp://site-a.example.org:7000"]
[state]
dir = "/var/lib/geotrain"
[metrics]
listen = "0.0.0.0:9400"
"""


def _render(tmp_path: Path, credentials: Path, components: list[str],
            node_toml: str | None = None) -> list[dict]:  # fmt: skip
    """An operator's overlay of the base with `components`, rendered by kubectl kustomize."""
    yaml = pytest.importorskip("yaml", reason="pip install -e '.[dev]' installs PyYAML")

    site = tmp_path / "mysite"
    site.mkdir()
    for name in ("identity.key", "certificate.json", "swarm.json"):
        shutil.copy(credentials / name, site / name)
    toml = node_toml or (DEPLOY / "site" / "node.toml").read_text()
    (site / "node.toml").write_text(toml)
    rel = os.path.relpath(DEPLOY, site)
    lines = ["apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization",
             "resources:", f"  - {rel}/site", "components:",
             *[f"  - {rel}/components/{c}" for c in components],
             "secretGenerator:", "  - name: geotrain-identity",
             "    files: [identity.key, certificate.json]",
             "configMapGenerator:", "  - name: geotrain-config", "    behavior: replace",
             "    files: [node.toml, swarm.json]",
             "images:", "  - name: geotrain", "    newName: registry.example.org/geotrain",
             "    newTag: cpu"]  # fmt: skip
    if not components:
        lines.remove("components:")
    (site / "kustomization.yaml").write_text("\n".join(lines) + "\n")
    done = subprocess.run([_tool("kubectl"), "kustomize", str(site)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _validate(docs: list[dict]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]' installs it")
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)  # raises on a field the schema lacks


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind
             and (name is None or d["metadata"]["name"].startswith(name))]  # fmt: skip
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _mounted(container: dict, volumes: dict, path: str) -> tuple[str, dict]:
    """The volume (name, spec) under which `path` lies in `container`."""
    mounts = sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"]))
    for m in mounts:
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            return m["name"], volumes.get(m["name"], {})  # (none: a volumeClaimTemplate)
    raise AssertionError(f"{path}: not under any mount of {container['name']}")


@pytest.mark.parametrize("components", [[], ["reachable"], ["reachable", "gpu"], ["client"]])
def test_a_site_renders_validates_and_mounts_what_its_config_names(
        tmp_path, credentials, components):  # fmt: skip
    docs = _render(tmp_path, credentials, components,
                   CLIENT_TOML if "client" in components else None)  # fmt: skip
    _validate(docs)
    sts = _one(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    node = next(c for c in pod["containers"] if c["name"] == "node")
    assert node["image"] == "registry.example.org/geotrain:cpu"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    volumes = {v["name"]: v for v in pod["volumes"]}
    configmap = _one(docs, "ConfigMap", "geotrain-config")
    secret = _one(docs, "Secret", "geotrain-identity")
    config = config_from_toml(configmap["data"]["node.toml"], base=Path("/etc/geotrain"))
    # the config's files are where the pod mounts them, from the objects that hold them
    name, vol = _mounted(node, volumes, str(config.identity.certificate))
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    assert "certificate.json" in secret["data"] and "identity.key" in secret["data"]
    name, vol = _mounted(node, volumes, str(config.identity.swarm))
    assert vol["configMap"]["name"] == configmap["metadata"]["name"]
    assert "swarm.json" in configmap["data"]
    name, vol = _mounted(node, volumes, str(config.identity.key))
    init = pod["initContainers"][0]
    assert init["command"][-1] == str(config.identity.key) and "0600" in init["command"]
    assert _mounted(init, volumes, str(config.identity.key))[0] == name
    name, _ = _mounted(node, volumes, str(config.state.dir) + "/x")
    assert name in {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    # the health probes are the staleness probe against this config
    for probe in ("startupProbe", "livenessProbe"):
        cmd = node[probe]["exec"]["command"]
        assert cmd[:2] == ["geotrain", "status"] and "--max-age" in cmd
        assert cmd[cmd.index("--node") + 1] == "/etc/geotrain/node.toml"
    # Prometheus scrapes the port the node serves metrics on
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == config.metrics.listen.rpartition(":")[2]
    ports = {p["name"]: p["containerPort"] for p in node.get("ports", [])}
    if "client" in components:
        assert not config.network.reachable and "gossip" not in ports
        _one(docs, "NetworkPolicy")
    else:
        listen_port = int(config.network.listen.rpartition(":")[2])
        assert ports["gossip"] == listen_port
    if "reachable" in components:
        assert _one(docs, "Service", "geotrain-public")["spec"]["type"] == "LoadBalancer"
    gpus = node["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus == 1) == ("gpu" in components)
