"""The deployment manifests: Kustomize builds, Kubernetes schemas, docker-compose.yml, the Dockerfile.

- Every kustomization under deploy/ builds with the real kustomize (``kustomize build`` or
  ``kubectl kustomize``), and every object it renders validates, strictly (no unknown fields),
  against the Kubernetes OpenAPI schemas bundled in ``kubernetes-validate`` (offline).
- The rendered objects keep the promises deploy/README.md makes (unprivileged relay, probes,
  limits, NetworkPolicy, ...), and the configuration files they carry pass the programs' own
  validators and point at the ports and names the manifests really use.
- docker-compose.yml validates against the Compose Specification's JSON Schema
  (deploy/compose-spec/compose-spec.json), and its wiring is consistent.
- The Dockerfile parses with BuildKit's own parser (the ``dockerfile`` package) and builds a
  non-root image of exactly the packages pyproject.toml ships.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dockerfile
import jsonschema
import kubernetes_validate
import pytest
import yaml

from cloud_ingest import settings as ingest_settings
from edge_relay import budget as relay_budget
from edge_relay import settings as relay_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# Oldest Kubernetes we support (KubeEdge 1.19/1.20 pair with 1.29/1.30) and the newest schemas we have.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
KUSTOMIZATIONS = {
    "edge": DEPLOY / "kubernetes/overlays/edge",
    "cloud": DEPLOY / "kubernetes/overlays/cloud",
    "kubeedge-bridge": DEPLOY / "kubeedge/bridge",
    "base-edge": DEPLOY / "kubernetes/base/edge",
    "base-cloud": DEPLOY / "kubernetes/base/cloud",
    # GPU nodes of other vendors: the edge overlay with their exporter in place of dcgm-exporter.
    "edge-amd": DEPLOY / "kubernetes/overlays/edge-amd",
    "edge-intel": DEPLOY / "kubernetes/overlays/edge-intel",
    # The relay as its own DaemonSet, beside exporters the operator runs.
    "relay": DEPLOY / "kubernetes/overlays/relay",
    "base-relay": DEPLOY / "kubernetes/relay/base",
}
# Builds of an overlay with a kustomize Component added, as an operator's own overlay would do it.
VARIANTS = {
    "relay-amd": (KUSTOMIZATIONS["relay"], DEPLOY / "kubernetes/relay/vendors/amd"),
    "relay-intel": (KUSTOMIZATIONS["relay"], DEPLOY / "kubernetes/relay/vendors/intel"),
    "relay-jetson": (KUSTOMIZATIONS["relay"], DEPLOY / "kubernetes/relay/vendors/jetson"),
    # prometheus-operator monitors of the programs' own metrics.
    "relay-monitoring": (KUSTOMIZATIONS["relay"], DEPLOY / "kubernetes/components/monitoring/edge-relay"),
    "cloud-monitoring": (KUSTOMIZATIONS["cloud"], DEPLOY / "kubernetes/components/monitoring/cloud-ingest"),
}
BUILDS = [*KUSTOMIZATIONS, *VARIANTS]
EDGE_SIDE = {"edge", "base-edge", "edge-amd", "edge-intel", "kubeedge-bridge", "relay", "base-relay"} | (
    set(VARIANTS) - {"cloud-monitoring"}
)
# prometheus-operator's CRDs: no schema in kubernetes-validate, their fields are checked by the monitor tests.
MONITORING_API = "monitoring.coreos.com/v1"
EDGE_TOLERATION = {"key": "node-role.kubernetes.io/edge", "operator": "Exists"}
# Created by the operator, never committed (deploy/README.md says how).
EXTERNAL_SECRETS = {
    "edge-relay-mqtt",
    "cloud-ingest-mqtt",
    "mosquitto-tls",
    "mosquitto-passwords",
    "grafana-admin",
}


# --- kustomize -----------------------------------------------------------------------------------


# The project installs its own pinned kubectl here (`./dev tools`, also run by `./dev test`); the manifest
# checks use that one only, with a PATH holding nothing else, so they pass where no kubectl was ever installed
# and never depend on whichever one a machine happens to have.
PROJECT_TOOLS = ROOT / ".tools/bin"


def pinned_kubectl_version() -> str:
    match = re.search(r"^KUBECTL_VERSION=(v[\d.]+)$", (ROOT / "dev").read_text(), re.M)
    assert match, "dev pins no KUBECTL_VERSION"
    return match.group(1)


def project_kubectl() -> Path:
    kubectl = PROJECT_TOOLS / "kubectl"
    if not os.access(kubectl, os.X_OK):
        pytest.fail(f"{kubectl.relative_to(ROOT)} is not installed: run ./dev tools", pytrace=False)
    return kubectl


def project_tools_env() -> dict[str, str]:
    """The environment kustomize runs in: the project's tools and nothing else on the PATH."""
    return {"PATH": str(PROJECT_TOOLS), "HOME": tempfile.gettempdir(), "LANG": "C.UTF-8"}


def kustomize_command() -> list[str]:
    return [str(project_kubectl()), "kustomize"]


def _variant_root(name: str) -> Path:
    """A throw-away kustomization: the overlay as a resource, the component added (relative paths:
    kustomize refuses absolute ones)."""
    overlay, component = VARIANTS[name]
    root = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    atexit.register(shutil.rmtree, root, True)
    k = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(overlay, root)],
        "components": [os.path.relpath(component, root)],
    }
    (root / "kustomization.yaml").write_text(yaml.safe_dump(k))
    return root


def render(name: str, *flags: str) -> tuple[dict[str, Any], ...]:
    root = _variant_root(name) if name in VARIANTS else KUSTOMIZATIONS[name]
    result = subprocess.run(
        [*kustomize_command(), *flags, str(root)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env=project_tools_env(),
    )
    assert result.returncode == 0, (
        f"kustomize build {' '.join(flags)} {name} ({root}) failed:\n{result.stderr}"
    )
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


@functools.cache
def build(name: str) -> tuple[dict[str, Any], ...]:
    """A build with kustomize's defaults, as an operator's `kubectl apply -k` renders it."""
    return render(name)


def find(objs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def configmap(objs: tuple[dict[str, Any], ...], prefix: str) -> dict[str, Any]:
    """A generated ConfigMap by its name before kustomize's hash suffix."""
    found = [
        o
        for o in objs
        if o["kind"] == "ConfigMap" and re.fullmatch(rf"{prefix}-[a-z0-9]{{10}}", o["metadata"]["name"])
    ]
    assert len(found) == 1, f"ConfigMap {prefix}: {len(found)} found"
    return found[0]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)


def volume(obj: dict[str, Any], name: str) -> dict[str, Any]:
    for v in pod_spec(obj).get("volumes", []):
        if v["name"] == name:
            return v
    # A StatefulSet's per-replica claim, mounted by its template's name.
    claims = obj["spec"].get("volumeClaimTemplates", [])
    return {"name": name, "claim": next(t for t in claims if t["metadata"]["name"] == name)}


def gibibytes(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2]) * 2**30


def mount_of(obj: dict[str, Any], cont: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The volume a file path lives on in ``cont``, and the path inside the volume."""
    best: dict[str, Any] | None = None
    for m in cont.get("volumeMounts", []):
        if (path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")) and (
            best is None or len(m["mountPath"]) > len(best["mountPath"])
        ):
            best = m
    assert best is not None, f"{path} is on no volume of container {cont['name']}"
    rest = path[len(best["mountPath"]) :].lstrip("/") or best.get("subPath", "")
    return volume(obj, best["name"]), rest


def load_config_from(objs: tuple[dict[str, Any], ...], prefix: str, key: str, tmp_path: Path) -> Path:
    path = tmp_path / f"{prefix}.yaml"
    path.write_text(configmap(objs, prefix)["data"][key])
    return path


# --- schemas --------------------------------------------------------------------------------------


def all_objects() -> Iterator[tuple[str, int, dict[str, Any]]]:
    for name in BUILDS:
        for i, obj in enumerate(build(name)):
            yield name, i, obj


def test_kustomize_is_the_projects_own_pinned_kubectl() -> None:
    """The manifests are rendered by the kubectl `dev` installs into the project, whatever else is on the
    machine: the binary lives in the checkout, its version is the pinned one, and it runs with a PATH that
    holds only the project's tools."""
    kubectl = project_kubectl().resolve()
    assert kubectl.is_relative_to(ROOT), kubectl
    for system_dir in ("/usr/bin", "/usr/local/bin", "/bin"):
        assert not kubectl.is_relative_to(system_dir), kubectl
    env = project_tools_env()
    assert env["PATH"].split(os.pathsep) == [str(PROJECT_TOOLS)]
    assert shutil.which("kubectl", path=env["PATH"]) == str(PROJECT_TOOLS / "kubectl")
    result = subprocess.run(
        [str(kubectl), "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )
    version = json.loads(result.stdout)
    assert version["clientVersion"]["gitVersion"] == pinned_kubectl_version()
    assert version["kustomizeVersion"].startswith("v5.")
    assert kustomize_command()[0] == str(PROJECT_TOOLS / "kubectl")


@pytest.mark.parametrize("name", BUILDS)
def test_kustomization_builds(name: str) -> None:
    objs = build(name)
    assert objs
    kinds = {o["kind"] for o in objs}
    if name in EDGE_SIDE:
        assert {"DaemonSet", "NetworkPolicy", "ConfigMap"} <= kinds
    else:
        assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget"} <= kinds


def test_every_kustomization_is_built_here() -> None:
    """A new overlay cannot go unvalidated: every kustomization under deploy/ is built above, is a
    Component built into a variant, or is reached through resources: or components: of one that is built."""
    components = {c.resolve() for _, c in VARIANTS.values()}
    reached = {p.resolve() for p in KUSTOMIZATIONS.values()} | components
    frontier = list(reached)
    while frontier:
        base = frontier.pop()
        k = yaml.safe_load((base / "kustomization.yaml").read_text())
        for entry in k.get("resources", []) + k.get("components", []):
            target = (base / entry).resolve()
            if entry in k.get("components", []):
                components.add(target)
            if target.is_dir() and target not in reached:
                reached.add(target)
                frontier.append(target)
    found = {k.parent.resolve() for k in DEPLOY.rglob("kustomization.yaml")}
    missing = sorted(str(d.relative_to(ROOT)) for d in found - reached)
    assert not missing, f"kustomizations no test builds (add them to KUSTOMIZATIONS or VARIANTS): {missing}"
    for d in found:
        if yaml.safe_load((d / "kustomization.yaml").read_text()).get("kind") == "Component":
            assert d in components, f"{d.relative_to(ROOT)} is a Component nothing builds"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", BUILDS)
def test_every_object_validates_against_the_kubernetes_schema(name: str, version: str) -> None:
    errors = []
    for obj in build(name):
        if obj["apiVersion"] == MONITORING_API:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(
                f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}"
            )
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", BUILDS)
def test_references_resolve(name: str) -> None:
    """Every ConfigMap a pod mounts is in the build; every Secret is one the README tells you to create."""
    objs = build(name)
    configmaps = {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
    for obj in objs:
        if "template" not in obj.get("spec", {}):
            continue
        spec = pod_spec(obj)
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{obj['metadata']['name']}: {v}"
            if "secret" in v:
                assert v["secret"]["secretName"] in EXTERNAL_SECRETS, v
        for c in spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in EXTERNAL_SECRETS and ref.get("optional"), env
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
            assert mounts <= {v["name"] for v in spec["volumes"]} | claims, c["name"]
    readme = (DEPLOY / "README.md").read_text()
    for secret in EXTERNAL_SECRETS:
        assert secret in readme, f"deploy/README.md does not explain the Secret {secret}"


def test_no_manifest_is_left_out_of_every_kustomization() -> None:
    """A YAML file under deploy/kubernetes or deploy/kubeedge that no kustomization uses is never checked."""
    used: set[Path] = set()
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        k = yaml.safe_load(kustomization.read_text())
        base = kustomization.parent
        entries = list(k.get("resources", [])) + [p["path"] for p in k.get("patches", []) if "path" in p]
        for gen in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
            entries += [f.split("=", 1)[-1] for f in gen.get("files", [])]
        used |= {(base / e).resolve() for e in entries}
    # Read by people or by other tools, and checked by tests of their own.
    documents_only = {
        DEPLOY / "kubeedge/edgecore.yaml",
    }
    for tree in ("kubernetes", "kubeedge"):
        for path in (DEPLOY / tree).rglob("*.yaml"):
            if path.name == "kustomization.yaml" or path in documents_only:
                continue
            assert path.resolve() in used, f"{path.relative_to(ROOT)} is in no kustomization"


# --- the edge ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["edge", "kubeedge-bridge"])
def test_edge_daemonset_keeps_its_promises(name: str, tmp_path: Path) -> None:
    objs = build(name)
    ds = find(objs, "DaemonSet", "kepler-edge-relay")
    spec = pod_spec(ds)
    assert spec["nodeSelector"]["kubernetes.io/os"] == "linux"
    assert spec["nodeSelector"]["feature.node.kubernetes.io/gpu"] == "true"
    assert "node-role.kubernetes.io/edge" in spec["nodeSelector"]
    assert EDGE_TOLERATION in spec["tolerations"]
    assert spec["hostPID"] is True

    # Kepler: privileged, the host's /sys and /proc, current port, sampling interval set.
    kepler = container(ds, "kepler")
    assert kepler["securityContext"]["privileged"] is True
    assert kepler["ports"][0]["containerPort"] == 28282
    host_paths = {
        volume(ds, m["name"]).get("hostPath", {}).get("path"): m["mountPath"] for m in kepler["volumeMounts"]
    }
    assert host_paths["/sys"] == "/host/sys" and host_paths["/proc"] == "/host/proc"
    kepler_cfg = yaml.safe_load(configmap(objs, "kepler-config")["data"]["config.yaml"])
    assert kepler_cfg["monitor"]["interval"] == "5s"
    assert kepler_cfg["host"] == {"sysfs": "/host/sys", "procfs": "/host/proc"}
    assert kepler_cfg["web"]["listenAddresses"] == [":28282"]

    # The relay: nothing privileged about it.
    relay = container(ds, "edge-relay")
    sc = relay["securityContext"]
    assert sc["privileged"] is False and sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    res = relay["resources"]
    assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])

    # Its configuration comes from the ConfigMap, passes the relay's validator, and fits the pod.
    config_path = relay["args"][relay["args"].index("--config") + 1]
    vol, key = mount_of(ds, relay, config_path)
    assert vol["configMap"]["name"].startswith("edge-relay-config-")
    cfg_file = tmp_path / "relay.yaml"
    cfg_file.write_text(
        next(o for o in objs if o["metadata"]["name"] == vol["configMap"]["name"])["data"][key]
    )
    env = {e["name"]: e for e in relay["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["EDGE_RELAY_MQTT_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "edge-relay-mqtt"
    s = relay_settings.load(str(cfg_file))
    raw = yaml.safe_load(cfg_file.read_text())
    assert "node" not in raw, "the node name must come from NODE_NAME, not the shared ConfigMap"

    # The budget file the config names is the budget ConfigMap, and passes the relay's loader.
    budget_vol, budget_key = mount_of(ds, relay, s.budget_file)
    assert budget_vol["configMap"]["name"].startswith("edge-relay-budget-")
    budget_file = tmp_path / "budget.yaml"
    budget_file.write_text(configmap(objs, "edge-relay-budget")["data"][budget_key])
    budget = relay_budget.load(budget_file)
    assert budget.classes and budget.warnings(s.batch_max_bytes) == []

    # The spool's volume: test_spool_outlives_the_pod.
    assert spec["securityContext"]["fsGroup"] == sc["runAsGroup"]

    # Probes hit the relay's metrics endpoint, which must listen beyond loopback for the kubelet.
    metrics_port = int(s.metrics_listen.rsplit(":", 1)[1])
    assert not s.metrics_listen.startswith("127.")
    port_by_name = {p["name"]: p["containerPort"] for p in relay["ports"]}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        http = relay[probe]["httpGet"]
        assert http["path"] == path and port_by_name[http["port"]] == metrics_port

    # Targets: Kepler in the pod, dcgm-exporter through its node-local Service, the relay itself.
    urls = {t.name: urlsplit(t.url) for t in s.targets}
    assert urls["kepler"].hostname == "127.0.0.1" and urls["kepler"].port == 28282
    dcgm_svc = find(objs, "Service", urls["dcgm"].hostname)
    assert dcgm_svc["spec"]["internalTrafficPolicy"] == "Local"
    assert urls["dcgm"].port in [p["port"] for p in dcgm_svc["spec"]["ports"]]
    assert urls["edge-relay"].port == metrics_port

    # Every file the relay reads is on a volume of its container.
    if s.mqtt.tls is not None:
        for path in (s.mqtt.tls.ca_file, s.mqtt.tls.cert_file, s.mqtt.tls.key_file):
            assert path
            mount_of(ds, relay, path)
        assert s.mqtt.port == 8883

    # dcgm-exporter as NVIDIA runs it.
    dcgm = find(objs, "DaemonSet", "dcgm-exporter")
    assert "SYS_ADMIN" in container(dcgm, "dcgm-exporter")["securityContext"]["capabilities"]["add"]
    assert EDGE_TOLERATION in pod_spec(dcgm)["tolerations"]
    assert pod_spec(dcgm)["nodeSelector"] == spec["nodeSelector"]


# (PCI vendor id in node-feature-discovery's label, exporter, its port, relay target, budget presets)
GPU_OVERLAYS = {
    "edge": ("10de", "dcgm-exporter", 9400, "dcgm", "dcgm"),
    "edge-amd": ("1002", "amd-device-metrics-exporter", 5000, "amd-gpu", "amd"),
    "edge-intel": ("8086", "xpumd", 8080, "intel-gpu", "intel"),
}


@pytest.mark.parametrize("name", list(GPU_OVERLAYS))
def test_gpu_overlays_run_their_vendors_exporter(name: str, tmp_path: Path) -> None:
    """Each GPU overlay: its exporter (and no other vendor's) on the nodes NFD labels with the vendor,
    Kepler + relay beside it, the relay scraping it through a node-local Service, the NetworkPolicy
    open to it alone, the budget on the vendor's presets, Kepler's GPU power switched on."""
    pci, exporter, port, target, preset = GPU_OVERLAYS[name]
    objs = build(name)
    daemonsets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DaemonSet"}
    assert set(daemonsets) == {"kepler-edge-relay", exporter}
    ds, exp = daemonsets["kepler-edge-relay"], daemonsets[exporter]
    selector = pod_spec(ds)["nodeSelector"]
    if name == "edge":
        assert selector["feature.node.kubernetes.io/gpu"] == "true"
    else:
        assert selector[f"feature.node.kubernetes.io/pci-{pci}.present"] == "true"
        assert "feature.node.kubernetes.io/gpu" not in selector
        # No NVML here: Kepler keeps no NVIDIA runtime settings, nor its toleration.
        assert not any(e["name"].startswith("NVIDIA_") for e in container(ds, "kepler")["env"])
        assert all(t.get("key") != "nvidia.com/gpu" for t in pod_spec(ds)["tolerations"])
    assert pod_spec(exp)["nodeSelector"] == selector
    assert EDGE_TOLERATION in pod_spec(ds)["tolerations"] and EDGE_TOLERATION in pod_spec(exp)["tolerations"]
    assert [p["containerPort"] for p in pod_spec(exp)["containers"][0]["ports"]] == [port]

    cfg_file = load_config_from(objs, "edge-relay-config", "config.yaml", tmp_path)
    s = relay_settings.load(str(cfg_file))
    urls = {t.name: urlsplit(t.url) for t in s.targets}
    assert set(urls) == {"kepler", target, "edge-relay"}
    svc = find(objs, "Service", urls[target].hostname)
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["selector"].items() <= exp["spec"]["template"]["metadata"]["labels"].items()
    assert urls[target].port == port == svc["spec"]["ports"][0]["port"]

    policy = find(objs, "NetworkPolicy", "kepler-edge-relay")["spec"]
    # Pods of its own namespace (the DNS rule selects kube-dns in any namespace).
    to_exporter = [r for r in policy["egress"] if any(set(p) == {"podSelector"} for p in r["to"])]
    assert [[p["port"] for p in r["ports"]] for r in to_exporter] == [[port]]
    labels = to_exporter[0]["to"][0]["podSelector"]["matchLabels"]
    assert labels.items() <= exp["spec"]["template"]["metadata"]["labels"].items()

    budget_file = load_config_from(objs, "edge-relay-budget", "budget.yaml", tmp_path)
    budget = relay_budget.load(budget_file)
    presets = [c.get("preset") for c in yaml.safe_load(budget_file.read_text())["classes"]]
    assert presets[0] == f"{preset}-critical" and preset in presets
    assert budget.warnings(s.batch_max_bytes) == []

    kepler_cfg = yaml.safe_load(configmap(objs, "kepler-config")["data"]["config.yaml"])
    # Off by default in Kepler 0.11: without it, no GPU energy at all (Kepler finds none off NVIDIA).
    assert kepler_cfg["experimental"]["gpu"]["enabled"] is True
    levels = kepler_cfg["exporter"]["prometheus"]["metricsLevel"]
    assert {"node", "container", "pod"} <= set(levels) <= {"node", "process", "container", "vm", "pod"}


def test_network_policy_allows_only_exporters_broker_dns_and_api() -> None:
    objs = build("edge")
    ds = find(objs, "DaemonSet", "kepler-edge-relay")
    policy = find(objs, "NetworkPolicy", "kepler-edge-relay")["spec"]
    assert (
        policy["podSelector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    assert policy["ingress"] == []
    ports = []
    for rule in policy["egress"]:
        assert rule.get("to") and rule.get("ports"), f"egress rule without peer or ports: {rule}"
        ports += [p["port"] for p in rule["ports"]]
        for peer in rule["to"]:
            if "ipBlock" in peer:
                assert not peer["ipBlock"]["cidr"].endswith("/0"), "no open egress"
    assert sorted(ports) == [53, 53, 6443, 8883, 8884, 9400, 10550]
    dcgm_labels = find(objs, "DaemonSet", "dcgm-exporter")["spec"]["template"]["metadata"]["labels"]
    to_dcgm = next(r for r in policy["egress"] if r["ports"][0]["port"] == 9400)["to"][0]["podSelector"][
        "matchLabels"
    ]
    assert to_dcgm.items() <= dcgm_labels.items()


def test_bridge_sidecar_renders_the_shipped_template(tmp_path: Path) -> None:
    """Run the edge-broker container's own start script (with mosquitto replaced by cat)."""
    objs = build("kubeedge-bridge")
    ds = find(objs, "DaemonSet", "kepler-edge-relay")
    broker = container(ds, "edge-broker")
    sc = broker["securityContext"]
    assert sc["privileged"] is False and sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"]["type"] == "RuntimeDefault"
    template = configmap(objs, "edge-broker-config")["data"]["bridge.conf"]
    assert template == (DEPLOY / "mosquitto/edge/bridge.conf").read_text()

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/bridge.conf").write_text(template)
    (tmp_path / "run").mkdir()
    assert broker["command"][:2] == ["/bin/sh", "-c"]
    body = broker["args"][0]
    body = body.replace("/etc/edge-broker/", f"{tmp_path}/etc/").replace(
        "/run/edge-broker/", f"{tmp_path}/run/"
    )
    body = body.replace("/var/lib/edge-relay/mosquitto", f"{tmp_path}/spool/mosquitto")
    body = body.replace("exec mosquitto -c", "exec cat")
    env = {e["name"]: e.get("value", "") for e in broker["env"]}
    env["NODE_NAME"] = "edge-gpu-07"
    rendered = subprocess.run(
        ["/bin/sh", "-c", body], capture_output=True, text=True, check=True, env={**os.environ, **env}
    ).stdout
    assert "${" not in rendered
    assert "clientid edge-bridge-edge-gpu-07\n" in rendered
    assert f"address {env['CLOUD_BROKER']}\n" in rendered
    assert "topic edgemetrics/v1/+/edge-gpu-07/ack in 1\n" in rendered
    assert (tmp_path / "spool/mosquitto").is_dir()
    # The certificates the bridge uses are on the pod's volumes.
    for line in rendered.splitlines():
        if line.startswith(("bridge_cafile", "bridge_certfile", "bridge_keyfile")):
            mount_of(ds, broker, line.split()[1])
        if line.startswith("persistence_location"):
            vol, _ = mount_of(ds, broker, line.split()[1].rstrip("/"))
            assert vol["name"] == "spool"

    relay_cfg = tmp_path / "relay.yaml"
    relay_cfg.write_text(configmap(objs, "edge-relay-config")["data"]["config.yaml"])
    s = relay_settings.load(str(relay_cfg))
    assert (s.mqtt.host, s.mqtt.port, s.mqtt.tls) == ("127.0.0.1", 1883, None)
    assert "listener 1883 127.0.0.1" in template


# The relay's DaemonSet in each edge build and the node directory it keeps its spool in (the sidecar's
# and the standalone relay's differ: the two may run on one node); what the manifests reserve there.
RELAY_DAEMONSETS = {
    name: ("edge-relay", "/var/lib/edge-relay-standalone")
    if "relay" in name
    else ("kepler-edge-relay", "/var/lib/kepler-edge-relay")
    for name in sorted(EDGE_SIDE)
}
SPOOL_RESERVED = "2 GiB"


def relay_config_file(objs: tuple[dict[str, Any], ...], ds: dict[str, Any], tmp_path: Path) -> Path:
    """The relay configuration as the container reads it: the ConfigMap's file, or, where the container
    renders a template at start, what its start script renders (NODE_IP 192.0.2.7, the env's values)."""
    relay = container(ds, "edge-relay")
    if relay.get("command") != ["/bin/sh", "-c"]:
        return load_config_from(objs, "edge-relay-config", "config.yaml", tmp_path)
    script = relay["args"][0]
    run = re.search(r"^\s*exec edge-relay run --config (\S+)", script, re.M)
    assert run, "the start script must exec the relay"
    rendered = Path(run.group(1))
    template_vol, template_key = mount_of(ds, relay, "/etc/edge-relay/config/config.yaml")
    assert template_vol["configMap"]["name"].startswith("edge-relay-config-")
    assert mount_of(ds, relay, str(rendered))[0]["emptyDir"]["medium"] == "Memory"
    (tmp_path / "template").mkdir(exist_ok=True)
    (tmp_path / "template/config.yaml").write_text(configmap(objs, "edge-relay-config")["data"][template_key])
    body = script[: run.start()].replace("/etc/edge-relay/config/", f"{tmp_path}/template/")
    body = body.replace(str(rendered.parent) + "/", f"{tmp_path}/")
    env = {e["name"]: e.get("value", "") for e in relay["env"] if "value" in e}
    env["NODE_IP"] = "192.0.2.7"
    subprocess.run(["/bin/sh", "-c", body], check=True, timeout=30, env={**os.environ, **env})
    out = tmp_path / rendered.name
    assert "${" not in out.read_text(), out.read_text()
    return out


@pytest.mark.parametrize("name", list(RELAY_DAEMONSETS))
def test_spool_outlives_the_pod(name: str, tmp_path: Path) -> None:
    """The unacknowledged backlog survives a rollout, an eviction and a reboot: the spool is a directory
    of the node (never an emptyDir, which dies with the pod), the same one for every pod the DaemonSet
    puts on that node, one pod at a time, owned by the relay, and what is kept there fits what the
    manifests reserve."""
    objs = build(name)
    ds_name, host_dir = RELAY_DAEMONSETS[name]
    ds = find(objs, "DaemonSet", ds_name)
    relay = container(ds, "edge-relay")
    s = relay_settings.load(str(relay_config_file(objs, ds, tmp_path)))
    spool_vol, _ = mount_of(ds, relay, s.spool_path)
    assert "emptyDir" not in spool_vol
    assert spool_vol["hostPath"] == {"path": host_dir, "type": "DirectoryOrCreate"}
    # A new pod starts only once the old one is gone: never two relays on one spool.
    rolling = ds["spec"]["updateStrategy"]
    assert rolling["type"] == "RollingUpdate" and rolling["rollingUpdate"]["maxSurge"] == 0

    # Sized: the relay's cap, plus the bridge broker's queue where it shares the directory.
    used = s.spool_max_bytes
    assert used > 0
    spec = pod_spec(ds)
    for c in spec["containers"]:
        mounted = {volume(ds, m["name"]).get("hostPath", {}).get("path") for m in c.get("volumeMounts", [])}
        if c["name"] != "edge-relay" and host_dir in mounted:
            bridge = configmap(objs, "edge-broker-config")["data"]["bridge.conf"]
            match = re.search(r"^max_queued_bytes (\d+)$", bridge, re.M)
            assert match, "a broker sharing the spool directory must bound its queue"
            used += int(match.group(1))
            # It writes there through the relay's group (fsGroup, a supplemental group of every container).
            assert spec["securityContext"]["fsGroup"] == relay["securityContext"]["runAsGroup"]
    assert used <= 2 * 2**30, f"{used} bytes kept on the node, {SPOOL_RESERVED} reserved"
    readme = (DEPLOY / "README.md").read_text()
    assert host_dir in readme and f"{SPOOL_RESERVED}" in readme

    # The kubelet creates the directory as root: the init container hands it to the relay, with
    # nothing but the capabilities to do so.
    [init] = [c for c in spec["initContainers"] if c["name"] == "spool-owner"]
    isc = init["securityContext"]
    assert set(isc["capabilities"]["add"]) <= {"CHOWN", "FOWNER"} and isc["capabilities"]["drop"] == ["ALL"]
    assert isc["readOnlyRootFilesystem"] is True and isc["allowPrivilegeEscalation"] is False
    assert [volume(ds, m["name"]) for m in init["volumeMounts"]] == [spool_vol]
    [mount] = init["volumeMounts"]
    assert mount["mountPath"] == str(Path(s.spool_path).parent)
    if os.geteuid() != 0:
        return
    node_dir = tmp_path / "node-dir"
    node_dir.mkdir(mode=0o755)
    script = init["args"][0].replace(mount["mountPath"], str(node_dir))
    for _ in range(2):  # a new pod on a directory that a former one already owns changes nothing
        subprocess.run([*init["command"], script], check=True, timeout=30)
        st = node_dir.stat()
        rsc = relay["securityContext"]
        assert (st.st_uid, st.st_gid) == (rsc["runAsUser"], rsc["runAsGroup"])
        assert st.st_mode & 0o7777 == 0o2770


# build -> the GPU exporter's job, the build of the sidecar overlay for the same nodes, the vendor's presets
STANDALONE = {
    "relay": ("dcgm-exporter", "edge", "dcgm"),
    "relay-amd": ("amd-device-metrics-exporter", "edge-amd", "amd"),
    "relay-intel": ("xpumd", "edge-intel", "intel"),
    "relay-jetson": ("jetson", None, "jetson"),
}
# Jetson has no sidecar overlay to compare with: its placement and its exporter's port (the simulator's,
# jetson_stats_node_exporter started with --port 9110), and no Kepler (no NVML, no RAPL there).
JETSON_NODE_SELECTOR = {
    "kubernetes.io/os": "linux",
    "kubernetes.io/arch": "arm64",
    "feature.node.kubernetes.io/jetson": "true",
    "node-role.kubernetes.io/edge": "",
}
JETSON_EXPORTER_PORT = 9110


@pytest.mark.parametrize("name", list(STANDALONE))
def test_standalone_relay_scrapes_its_nodes_exporters(name: str, tmp_path: Path) -> None:
    """The relay as its own DaemonSet: nothing but the relay, unprivileged, reading the exporters the
    operator already runs on the node's IP (downward API), with the vendor's exporter and presets."""
    job, sidecar_build, preset = STANDALONE[name]
    objs = build(name)
    assert {o["kind"] for o in objs if "template" in o.get("spec", {})} == {"DaemonSet"}
    ds = find(objs, "DaemonSet", "edge-relay")
    spec = pod_spec(ds)
    assert [c["name"] for c in spec["containers"]] == ["edge-relay"]
    assert not spec.get("hostPID") and not spec.get("hostNetwork") and not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    relay = container(ds, "edge-relay")
    sc = relay["securityContext"]
    assert sc["privileged"] is False and sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e for e in relay["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"

    if sidecar_build is None:
        assert spec["nodeSelector"] == JETSON_NODE_SELECTOR
        assert spec["tolerations"] == pod_spec(find(build("relay"), "DaemonSet", "edge-relay"))["tolerations"]
        exporter_port = JETSON_EXPORTER_PORT
        node_exporters = ["gpu", "node"]
    else:
        # The same nodes as the sidecar overlay of that vendor, and its exporter's port.
        sidecar_objs = build(sidecar_build)
        sidecar = find(sidecar_objs, "DaemonSet", "kepler-edge-relay")
        assert spec["nodeSelector"] == pod_spec(sidecar)["nodeSelector"]
        assert spec["tolerations"] == pod_spec(sidecar)["tolerations"]
        exporter = find(sidecar_objs, "DaemonSet", job)
        [exporter_port] = [p["containerPort"] for p in pod_spec(exporter)["containers"][0]["ports"]]
        node_exporters = ["kepler", "gpu", "node"]

    s = relay_settings.load(str(relay_config_file(objs, ds, tmp_path)))
    targets = {t.name: t for t in s.targets}
    urls = {name: urlsplit(t.url) for name, t in targets.items()}
    assert set(targets) == {*node_exporters, "edge-relay"}
    for target in node_exporters:
        assert urls[target].hostname == "192.0.2.7", "the node's exporters, on the node's IP"
    assert (targets["gpu"].job, urls["gpu"].port) == (job, exporter_port)
    assert urls["node"].port == 9100 and urls.get("kepler", urlsplit("http://x:28282")).port == 28282
    metrics_port = int(s.metrics_listen.rsplit(":", 1)[1])
    assert urls["edge-relay"].hostname == "127.0.0.1" and urls["edge-relay"].port == metrics_port
    if s.mqtt.tls is not None:
        for path in (s.mqtt.tls.ca_file, s.mqtt.tls.cert_file, s.mqtt.tls.key_file):
            assert path
            mount_of(ds, relay, path)

    # The vendor's presets, and node-exporter's.
    budget_vol, budget_key = mount_of(ds, relay, s.budget_file)
    assert budget_vol["configMap"]["name"].startswith("edge-relay-budget-")
    budget_file = load_config_from(objs, "edge-relay-budget", budget_key, tmp_path)
    presets = [c.get("preset") for c in yaml.safe_load(budget_file.read_text())["classes"]]
    assert presets[0] == f"{preset}-critical" and {preset, "node"} <= set(presets)
    assert ("kepler" in presets) == ("kepler" in targets)
    assert relay_budget.load(budget_file).warnings(s.batch_max_bytes) == []

    # It may reach every exporter it scrapes, the broker and DNS; nothing may reach it.
    policy = find(objs, "NetworkPolicy", "edge-relay")["spec"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["ingress"] == []
    allowed = {p["port"] for rule in policy["egress"] for p in rule["ports"]}
    assert {urls[t].port for t in node_exporters} | {s.mqtt.port, 53} <= allowed


def test_one_place_sets_the_image() -> None:
    """Every overlay runs the project's image as the image component names it, and nothing else names it."""
    component = yaml.safe_load((DEPLOY / "kubernetes/components/image/kustomization.yaml").read_text())
    [image] = component["images"]
    expected = f"{image['newName']}:{image['newTag']}"
    for k in DEPLOY.rglob("kustomization.yaml"):
        if k.parent.name != "image":
            names = [i["name"] for i in yaml.safe_load(k.read_text()).get("images", [])]
            assert image["name"] not in names, f"{k.relative_to(ROOT)} sets the image too"
    seen = 0
    for name in BUILDS:
        if name.startswith("base-"):
            continue
        for obj in build(name):
            if "template" not in obj.get("spec", {}):
                continue
            spec = pod_spec(obj)
            for c in spec.get("initContainers", []) + spec["containers"]:
                if c["image"].rsplit(":", 1)[0].endswith(image["name"]):
                    assert c["image"] == expected, f"{name}: {obj['metadata']['name']}/{c['name']}"
                    seen += 1
    assert seen >= 10


# --- the cloud ----------------------------------------------------------------------------------------


def test_cloud_objects_fit_together(tmp_path: Path) -> None:
    objs = build("cloud")
    ingest = find(objs, "StatefulSet", "cloud-ingest")
    c = container(ingest, "cloud-ingest")
    env = {e["name"]: e for e in c["env"]}
    assert env["CLOUD_INGEST_CLIENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert (
        c["securityContext"]["readOnlyRootFilesystem"] and pod_spec(ingest)["securityContext"]["runAsNonRoot"]
    )
    labels = ingest["spec"]["template"]["metadata"]["labels"]

    cfg_path = c["args"][c["args"].index("--config") + 1]
    vol, key = mount_of(ingest, c, cfg_path)
    cfg_file = tmp_path / "ingest.yaml"
    cfg_file.write_text(
        next(o for o in objs if o["metadata"]["name"] == vol["configMap"]["name"])["data"][key]
    )
    s = ingest_settings.load(str(cfg_file))
    metrics_port = int(s.metrics_listen.rsplit(":", 1)[1])

    svc = find(objs, "Service", "cloud-ingest-metrics")
    assert svc["spec"]["clusterIP"] == "None", "headless: Prometheus must see every replica"
    assert svc["spec"]["selector"].items() <= labels.items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [metrics_port]
    pdb = find(objs, "PodDisruptionBudget", "cloud-ingest")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items() <= labels.items() and pdb["spec"]["minAvailable"] >= 1
    )
    assert ingest["spec"]["replicas"] > pdb["spec"]["minAvailable"]

    # The ingester reaches the broker and Prometheus through their Services.
    broker_svc = find(objs, "Service", s.mqtt_host)
    assert s.mqtt_port in [p["port"] for p in broker_svc["spec"]["ports"]]
    rw = urlsplit(s.remote_write_url)
    prom_svc = find(objs, "Service", rw.hostname)
    assert rw.port in [p["port"] for p in prom_svc["spec"]["ports"]] and rw.path == "/api/v1/write"
    assert s.tls is not None and all((s.tls.ca_file, s.tls.cert_file, s.tls.key_file))
    for path in (s.tls.ca_file, s.tls.cert_file, s.tls.key_file):
        mount_of(ingest, c, path)
    # Dead letters survive the pod: each replica's own claim, with room beyond the store's cap.
    dead_letters, _ = mount_of(ingest, c, s.dead_letter_path)
    assert "claim" in dead_letters, f"dead letters on {dead_letters}, not a PersistentVolumeClaim"
    claim = dead_letters["claim"]["spec"]
    assert claim["accessModes"] == ["ReadWriteOnce"]
    assert s.dead_letter_max_bytes <= gibibytes(claim["resources"]["requests"]["storage"]) // 2
    assert ingest["spec"]["serviceName"] == svc["metadata"]["name"]

    # Prometheus: the remote-write receiver on, the out-of-order window and every rule file loaded.
    prom = find(objs, "StatefulSet", "prometheus")
    pc = container(prom, "prometheus")
    assert "--web.enable-remote-write-receiver" in pc["args"]
    config_arg = next(a for a in pc["args"] if a.startswith("--config.file="))
    prom_cfg_vol, prom_key = mount_of(prom, pc, config_arg.split("=", 1)[1])
    prom_cfg = yaml.safe_load(
        next(o for o in objs if o["metadata"]["name"] == prom_cfg_vol["configMap"]["name"])["data"][prom_key]
    )
    assert prom_cfg["storage"]["tsdb"]["out_of_order_time_window"] == "2h"
    assert [
        j["dns_sd_configs"][0]["names"] for j in prom_cfg["scrape_configs"] if j["job_name"] == "cloud-ingest"
    ] == [[svc["metadata"]["name"]]]
    rules_vol, _ = mount_of(prom, pc, "/etc/prometheus/rules/x.rules.yml")
    rules_cm = next(o for o in objs if o["metadata"]["name"] == rules_vol["configMap"]["name"])
    shipped = {p.name: p.read_text() for p in (DEPLOY / "prometheus/rules").glob("*.rules.yml")}
    assert rules_cm["data"] == shipped, "deploy/prometheus/kustomization.yaml must list every rule file"

    # The broker runs the shipped configuration.
    broker = find(objs, "Deployment", "mosquitto")
    mosq_cfg = configmap(objs, "mosquitto-config")["data"]
    assert mosq_cfg["mosquitto.conf"] == (DEPLOY / "mosquitto/cloud/mosquitto.conf").read_text()
    assert mosq_cfg["acl"] == (DEPLOY / "mosquitto/cloud/acl").read_text()
    assert mosq_cfg["ingest.acl"] == (DEPLOY / "mosquitto/cloud/ingest.acl").read_text()
    mc = container(broker, "mosquitto")
    public = find(objs, "Service", "mosquitto")
    assert public["spec"]["type"] == "LoadBalancer"
    # The ingester listener is in-cluster only (ClusterIP), the edge listeners are public.
    assert (
        broker_svc["metadata"]["name"] == "mosquitto-ingest" and broker_svc["spec"].get("type") == "ClusterIP"
    )
    listeners = []
    for line in mosq_cfg["mosquitto.conf"].splitlines():
        word = line.split(" ", 1)
        if word[0] in ("cafile", "certfile", "keyfile", "acl_file", "password_file", "persistence_location"):
            mount_of(broker, mc, word[1].rstrip("/"))
        if word[0] == "listener":
            listeners.append(int(word[1]))
            assert int(word[1]) in [p["containerPort"] for p in mc["ports"]]
    public_ports = [p["port"] for p in public["spec"]["ports"]]
    assert [p["port"] for p in broker_svc["spec"]["ports"]] == [s.mqtt_port]
    assert sorted([*public_ports, s.mqtt_port]) == sorted(listeners)

    grafana_cm = configmap(objs, "grafana-dashboards")
    assert (
        grafana_cm["data"]["kepler-edge-relay.json"]
        == (DEPLOY / "grafana/dashboards/kepler-edge-relay.json").read_text()
    )


def test_kubeedge_edgecore_notes_are_valid_yaml_with_the_keys_that_matter() -> None:
    core = yaml.safe_load((DEPLOY / "kubeedge/edgecore.yaml").read_text())
    assert core["apiVersion"] == "edgecore.config.kubeedge.io/v1alpha2" and core["kind"] == "EdgeCore"
    modules = core["modules"]
    assert modules["eventBus"]["mqttMode"] in (0, 1, 2)
    assert modules["eventBus"]["mqttServerExternal"].endswith(":1883")
    assert modules["eventBus"]["mqttServerInternal"].endswith(":1884")
    assert modules["metaManager"]["metaServer"]["enable"] is True
    assert modules["edgeHub"]["heartbeat"] > 0


# --- docker-compose.yml ----------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_validates_against_the_compose_specification() -> None:
    schema = json.loads((DEPLOY / "compose-spec/compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = [
        f"{'/'.join(map(str, e.path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(compose())
    ]
    assert not errors, "\n".join(errors)


def test_compose_stack_is_complete_and_wired() -> None:
    services = compose()["services"]
    assert {
        "simulator",
        "mosquitto-edge",
        "mosquitto-cloud",
        "edge-relay",
        "cloud-ingest",
        "prometheus",
        "grafana",
    } <= set(services)

    def networks(name: str) -> set[str]:
        # A list of names or a mapping name -> options: set() of either is the names.
        return set(services[name].get("networks", []))

    def reachable(client: str, server: str) -> bool:
        return bool(networks(client) & networks(server))

    def mounted(service: str, target: str) -> Path:
        for v in services[service].get("volumes", []):
            src, dst = v.split(":")[:2]
            if dst == target:
                assert src.startswith("./"), f"{service}: {target} is not a file of the repository"
                return ROOT / src
        raise AssertionError(f"{service} mounts nothing at {target}")

    for name, svc in services.items():
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name}: {src} does not exist"

    relay = relay_settings.load(str(mounted("edge-relay", "/etc/edge-relay/config.yaml")))
    # A relative budget_file: beside the config, in the repository as in the container.
    assert Path(relay.budget_file) == mounted("edge-relay", "/etc/edge-relay/budget.yaml")
    budget = relay_budget.load(relay.budget_file)
    assert budget.classes and budget.warnings(relay.batch_max_bytes) == []
    for target in relay.targets:
        host = urlsplit(target.url).hostname
        assert host == "127.0.0.1" or reachable("edge-relay", host), target.url
    assert reachable("edge-relay", relay.mqtt.host)
    ingest = ingest_settings.load(str(mounted("cloud-ingest", "/etc/cloud-ingest/config.yaml")))
    assert reachable("cloud-ingest", ingest.mqtt_host)
    assert reachable("cloud-ingest", urlsplit(ingest.remote_write_url).hostname or "")
    assert not reachable("edge-relay", "mosquitto-cloud"), (
        "the edge reaches the cloud only through the bridge"
    )

    bridge = mounted("mosquitto-edge", "/mosquitto/config/mosquitto.conf").read_text()
    address = re.search(r"^address (\S+):(\d+)$", bridge, re.M)
    assert address and reachable("mosquitto-edge", address.group(1))
    assert "cleansession false" in bridge

    prom_cfg = yaml.safe_load(mounted("prometheus", "/etc/prometheus/prometheus.yml").read_text())
    assert "--web.enable-remote-write-receiver" in services["prometheus"]["command"]
    (job,) = [j for j in prom_cfg["scrape_configs"] if j["job_name"] == "cloud-ingest"]
    aliases = services["cloud-ingest"]["networks"]["cloud"]["aliases"]
    assert job["dns_sd_configs"][0]["names"][0] in aliases
    assert mounted("prometheus", "/etc/prometheus/rules") == DEPLOY / "prometheus/rules"
    assert mounted("grafana", "/etc/grafana/dashboards") == DEPLOY / "grafana/dashboards"
    for name in ("simulator", "edge-relay", "cloud-ingest"):
        assert services[name]["build"]["context"] == "." and services[name]["read_only"] is True


# --- Dockerfile --------------------------------------------------------------------------------------


def test_dockerfile_builds_a_slim_non_root_image_of_the_shipped_packages() -> None:
    commands = dockerfile.parse_file(str(ROOT / "Dockerfile"))
    stages = [c for c in commands if c.cmd == "FROM"]
    assert len(stages) == 2, "a build stage and a runtime stage"
    args = {c.value[0].split("=", 1)[0]: c.value[0].split("=", 1)[1] for c in commands if c.cmd == "ARG"}
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.1[1-9]-slim-\w+", base), base
    for stage in stages:
        assert stage.value[0] == "${PYTHON_IMAGE}"
    final = commands[commands.index(stages[-1]) :]
    user = [c for c in final if c.cmd == "USER"]
    assert user and re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", user[-1].value[0]), (
        "the runtime user must be a non-root uid"
    )
    assert not any(c.cmd == "ADD" for c in commands)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set()
    for c in commands:
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags):
            sources = c.value[:-1]
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: no such file"
            copied |= set(sources)
    # The test, bench and demo tooling stays out of the product's wheel and out of the image.
    assert "testkit" not in packages and "testkit" not in copied
    shipped = packages
    assert shipped <= copied, f"packages not copied into the build stage: {shipped - copied}"
    assert {"pyproject.toml", "README.md"} <= copied
    entry = next(c for c in final if c.cmd == "ENTRYPOINT").value[0]
    assert entry in project["project"]["scripts"]
    assert "cloud-ingest" in project["project"]["scripts"]


ARCHITECTURE_WORDS = re.compile(r"amd64|x86[_-]64|aarch64|arm64|armv\d|i[3-6]86|--platform", re.I)


def test_dockerfile_has_no_architecture_specific_step() -> None:
    """One Dockerfile for linux/amd64 and linux/arm64 (buildx, as deploy/README.md documents): the base image
    is the official multi-arch Python one, no stage is pinned to a platform, and no step names an
    architecture or downloads a binary (which would be one architecture's)."""
    commands = dockerfile.parse_file(str(ROOT / "Dockerfile"))
    for c in commands:
        if c.cmd in {"FROM", "RUN", "ARG", "ENV", "COPY"}:
            text = " ".join([*c.flags, *c.value])
            assert not ARCHITECTURE_WORDS.search(text), f"{c.original}: architecture-specific"
        if c.cmd == "RUN":
            assert not re.search(r"\b(curl|wget)\b", " ".join(c.value)), f"{c.original}: downloads a binary"
    readme = (DEPLOY / "README.md").read_text()
    build = re.search(r"^docker buildx build --platform (\S+) .* \.$", readme, re.M)
    assert build, "deploy/README.md documents no multi-arch buildx command"
    assert set(build.group(1).split(",")) == {"linux/amd64", "linux/arm64"}


# --- prometheus-operator monitors ----------------------------------------------------------------------


# build -> (monitor kind, its name, the pod controller it must find, the Service it goes through or None)
MONITORS = {
    "relay-monitoring": ("PodMonitor", "edge-relay", ("DaemonSet", "edge-relay"), None),
    "cloud-monitoring": (
        "ServiceMonitor",
        "cloud-ingest",
        ("StatefulSet", "cloud-ingest"),
        "cloud-ingest-metrics",
    ),
}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels is checked here"
    return bool(selector["matchLabels"]) and selector["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("name", list(MONITORS))
def test_monitors_select_the_pods_and_ports_that_exist(name: str) -> None:
    """kubernetes-validate has no schema for the CRDs: the fields prometheus-operator relies on are checked
    here against the rendered objects: the selector matches the real pods (or Service), the named port
    exists on them, the monitor is in the same namespace, and the NetworkPolicy lets the scrape in."""
    kind, monitor_name, (controller_kind, controller_name), service_name = MONITORS[name]
    objs = build(name)
    monitor = find(objs, kind, monitor_name)
    assert monitor["apiVersion"] == MONITORING_API
    assert set(monitor["spec"]) <= {"selector", "podMetricsEndpoints", "endpoints"}, monitor["spec"]
    controller = find(objs, controller_kind, controller_name)
    namespace = controller["metadata"]["namespace"]
    assert monitor["metadata"]["namespace"] == namespace
    pod_labels = controller["spec"]["template"]["metadata"]["labels"]
    container_ports = {
        p["name"]: p["containerPort"] for c in pod_spec(controller)["containers"] for p in c.get("ports", [])
    }
    selected = [
        o
        for o in objs
        if o["kind"] == ("Service" if service_name else controller_kind)
        and selects(monitor["spec"]["selector"], o["metadata"].get("labels", {}))
    ]
    if service_name is None:
        assert selected == [controller]
        endpoints = monitor["spec"]["podMetricsEndpoints"]
        for e in endpoints:
            assert e["port"] in container_ports, e
        scraped = {container_ports[e["port"]] for e in endpoints}
    else:
        assert [s["metadata"]["name"] for s in selected] == [service_name]
        service = selected[0]
        assert service["metadata"]["namespace"] == namespace
        assert service["spec"]["selector"].items() <= pod_labels.items()
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        endpoints = monitor["spec"]["endpoints"]
        scraped = set()
        for e in endpoints:
            assert e["port"] in service_ports, e
            target = service_ports[e["port"]]["targetPort"]
            scraped.add(container_ports[target] if isinstance(target, str) else target)
    assert endpoints and all(e["path"] == "/metrics" for e in endpoints)
    for policy in (o for o in objs if o["kind"] == "NetworkPolicy"):
        if not selects(policy["spec"]["podSelector"], pod_labels):
            continue
        allowed = {p["port"] for rule in policy["spec"].get("ingress", []) for p in rule.get("ports", [])}
        assert scraped <= allowed, f"NetworkPolicy {policy['metadata']['name']} keeps the scrape out"


# --- remote bases ----------------------------------------------------------------------------------------


def _file_entries(k: dict[str, Any]) -> list[str]:
    """The files (not kustomization directories) a kustomization loads: kustomize's load restrictor
    keeps these inside its own directory."""
    entries = [p["path"] for p in k.get("patches", []) if "path" in p]
    entries += k.get("patchesStrategicMerge", []) + k.get("configurations", []) + k.get("crds", [])
    for gen in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
        entries += [f.split("=", 1)[-1] for f in gen.get("files", [])]
        entries += gen.get("envs", []) + ([gen["env"]] if "env" in gen else [])
    return entries


def test_every_kustomization_loads_only_files_of_its_own_root() -> None:
    """`kubectl apply -k 'https://github.com/<org>/<repo>//deploy/kubernetes/overlays/relay?ref=<tag>'`
    builds with kustomize's default load restrictor (LoadRestrictionsRootOnly): a kustomization may name
    other kustomization directories of the repository, but may load no file outside its own directory."""
    for path in DEPLOY.rglob("kustomization.yaml"):
        base = path.parent.resolve()
        k = yaml.safe_load(path.read_text())
        for entry in _file_entries(k):
            assert (base / entry).resolve().is_relative_to(base), f"{path.relative_to(ROOT)} loads {entry}"
        for entry in k.get("resources", []) + k.get("components", []):
            assert "://" not in entry, f"{path.relative_to(ROOT)}: a remote resource {entry}"
            target = (base / entry).resolve()
            assert target.is_relative_to(ROOT), f"{path.relative_to(ROOT)} leaves the repository: {entry}"
            assert target.is_dir() or target.is_relative_to(base), f"{path.relative_to(ROOT)} loads {entry}"


@pytest.mark.parametrize("name", BUILDS)
def test_every_build_renders_with_the_default_load_restrictor(name: str) -> None:
    """The builds above use kustomize's defaults; the same render with the root-only restrictor named
    explicitly is identical (as a remote base is built)."""
    assert not any(arg.startswith("--load-restrictor") for arg in kustomize_command())
    assert render(name, "--load-restrictor", "LoadRestrictionsRootOnly") == build(name)
