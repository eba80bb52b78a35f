"""deploy/grafana: the dashboard and its provisioning.

Grafana itself is not installed here, so the dashboard is checked where it can go wrong: every PromQL
expression in it (panels and variables) runs against a real Prometheus holding a small synthetic
fleet, written through the ingester's own remote-write encoder, and must parse and return series.
The fleet's exporter data is the simulator's Kepler and dcgm-exporter output plus its AMD, Intel and
Jetson exporters on three more nodes, parsed by the relay's parser, with the GPU recording rules
(deploy/prometheus/rules/gpu-vendors.rules.yml) backfilled over it as Prometheus would have recorded
them; the relay and ingester metrics carry the names the product defines.
"""

from __future__ import annotations

import json
import re
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cramjam
import pytest
import requests
import yaml
from prometheus_client import CollectorRegistry

from cloud_ingest.selfmetrics import IngestMetrics
from cloud_ingest.sinks.remote_write.request import build_write_request
from edge_relay.collect.parse import parse
from edge_relay.selfmetrics import RelayMetrics
from schemas.model import Batch, Labels, ScrapeBlock
from simulator import Simulator
from testkit.services import Prometheus

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy/grafana"
DASHBOARD = GRAFANA / "dashboards/kepler-edge-relay.json"
DATASOURCES = GRAFANA / "provisioning/datasources/prometheus.yaml"
PROVIDERS = GRAFANA / "provisioning/dashboards/kepler-edge-relay.yaml"
VENDOR_RULES = ROOT / "deploy/prometheus/rules/gpu-vendors.rules.yml"

CLUSTER = "factory-north"
NODES = ("edge-gpu-01", "edge-gpu-02")  # 01 online and healthy; 02 offline, backlog, losses
# GPU nodes of the other vendors: their exporter only (simulator exporter, job, port).
VENDOR_NODES = {
    "edge-amd-01": ("amd", "amd-device-metrics-exporter", 5000),
    "edge-intel-01": ("intel", "xpumd", 8080),
    "edge-orin-01": ("jetson", "jetson-stats", 9110),
}
VENDORS = {"nvidia", "amd", "intel", "jetson"}
STEP_S = 15
POINTS = 61  # 15 minutes of data, newest at "now"

# What Grafana substitutes before it sends a query.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "10m",
    "$cluster": ".*",
    "$node": ".*",
    "$vendor": ".*",
}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def panel_queries() -> list[tuple[str, str]]:
    return [
        (f"{panel['title']} / {target['refId']}", target["expr"])
        for panel in all_panels(load_dashboard())
        for target in panel.get("targets", [])
    ]


def variable_queries() -> list[tuple[str, str]]:
    out = []
    for var in load_dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((var["name"], query))
    return out


def grafana_expand(expr: str) -> str:
    # Longest names first: $__range must not be eaten by a shorter variable.
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"unknown variable left in {expr!r}"
    return expr


def product_metric_names() -> set[str]:
    names: set[str] = set()
    for registry in (RelayMetrics(CollectorRegistry()).registry, IngestMetrics(CollectorRegistry()).registry):
        for family in registry.collect():
            if family.type == "counter":
                names.add(f"{family.name}_total")
            elif family.type == "histogram":
                names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
            else:
                names.add(family.name)
    return names


# --- static checks --------------------------------------------------------------------------------


def test_dashboard_structure() -> None:
    dash = load_dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    # No two panels overlap on the 24-column grid.
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(dash):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
    types = {p["type"] for p in all_panels(dash)}
    assert {"timeseries", "heatmap", "bargauge", "stat"} <= types


def test_dashboard_has_the_requested_panels() -> None:
    panels = {p["title"]: p for p in all_panels(load_dashboard())}

    def exprs(title: str) -> str:
        return " ".join(t["expr"] for t in panels[title]["targets"])

    # The GPU panels read the vendor-independent recorded series, by vendor, never an exporter's own.
    assert panels["GPU utilisation"]["type"] == "timeseries" and "gpu:utilization_ratio" in exprs(
        "GPU utilisation"
    )
    assert panels["GPU temperature"]["type"] == "heatmap" and "gpu:temperature_celsius" in exprs(
        "GPU temperature"
    )
    assert panels["GPU memory in use"]["type"] == "bargauge" and "gpu:memory_used_bytes" in exprs(
        "GPU memory in use"
    )
    assert "gpu:power_watts" in exprs("GPU power draw") and "gpu:clock_hertz" in exprs("GPU clock")
    assert "gpu:errors:rate5m" in exprs("GPU hardware errors")
    for title in GPU_PANELS:
        assert "vendor" in exprs(title) and '$vendor"' in exprs(title), title
        assert not re.search(r"DCGM_|\bgpu_[a-z]|\bhw_|xpum_|_kB\b", exprs(title)), title
    assert "pod_namespace" in exprs("Power per namespace (CPU + GPU)")
    assert "pod_name" in exprs("Top pods by power")
    assert "joules" in exprs("Energy per namespace over the time range")
    assert "cloud_ingest_node_online" in exprs("Nodes online")
    assert "backlog" in exprs("Backlog per node")
    # The budget and the spool cap are each relay's own (second query), not a fixed threshold line.
    budget = {t["refId"]: t["expr"] for t in panels["Uplink bytes per second against budget"]["targets"]}
    assert re.match(r"sum by \(cluster, node\) \(rate\(edge_relay_wire_bytes_total\{", budget["A"])
    assert "edge_relay_budget_bytes_per_second" in budget["B"] and "by (cluster, node)" in budget["B"]
    assert "edge_relay_publish_payload_bytes_total" not in " ".join(budget.values())
    assert "edge_relay_spool_max_bytes" in exprs("Spool size per node")
    for title in ("Uplink bytes per second against budget", "Spool size per node"):
        defaults = panels[title]["fieldConfig"]["defaults"]
        steps = defaults.get("thresholds", {}).get("steps", [])
        assert all(s["value"] is None for s in steps), f"{title}: a fixed threshold"
        assert "PLACEHOLDER" not in panels[title]["description"].upper()
    assert "edge_relay_budget_resolution_seconds" in exprs("Budget classes: resolution")
    assert "edge_relay_samples_dropped_total" in exprs("Losses")


def test_datasources_and_provisioning_agree() -> None:
    datasources = yaml.safe_load(DATASOURCES.read_text())
    assert datasources["apiVersion"] == 1
    (prom,) = datasources["datasources"]
    assert prom["type"] == "prometheus" and prom["url"] == "http://prometheus:9090"
    dash = load_dashboard()
    ds_var = next(v for v in dash["templating"]["list"] if v["type"] == "datasource")
    assert ds_var["query"] == "prometheus" and ds_var["current"]["value"] == prom["uid"]
    for panel in all_panels(dash):
        if panel["type"] == "row":
            continue
        for ref in [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]:
            assert ref == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]

    providers = yaml.safe_load(PROVIDERS.read_text())
    (provider,) = providers["providers"]
    path = provider["options"]["path"]
    # docker-compose.yml and the Kubernetes Deployment mount the dashboards where the provider looks.
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert f"./deploy/grafana/dashboards:{path}:ro" in compose["services"]["grafana"]["volumes"]
    k8s = yaml.safe_load_all((ROOT / "deploy/kubernetes/base/cloud/grafana.yaml").read_text())
    deployment = next(d for d in k8s if d["kind"] == "Deployment")
    mounts = {
        m["name"]: m["mountPath"]
        for m in deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    assert mounts["dashboards"] == path


def test_dashboard_uses_only_metrics_that_exist() -> None:
    exposed = product_metric_names()
    sim = Simulator(1, None, 5.0)
    exporter_names = {
        labels[0][1] if labels[0][0] == "__name__" else dict(labels)["__name__"]
        for exporter in ("kepler", "dcgm")
        for labels, _, _ in parse(sim.render(exporter, 0).decode())
    }
    recorded = {r["record"] for r in recording_rules()}
    for where, expr in panel_queries() + variable_queries():
        for name in re.findall(r"\b(?:edge_relay|cloud_ingest|kepler|DCGM)_\w+", expr):
            assert name in exposed | exporter_names, f"{where}: {name} is exposed by nothing we know"
        for name in re.findall(r"\bgpu:[a-z_:0-9]+", expr):
            assert name in recorded, f"{where}: {name} is recorded by no rule of {VENDOR_RULES.name}"


GPU_PANELS = (
    "GPU utilisation",
    "GPU temperature",
    "GPU memory in use",
    "GPU power draw",
    "GPU clock",
    "GPU hardware errors",
)


def recording_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(VENDOR_RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "record" in r]


# --- every expression against a real Prometheus ------------------------------------------------


def _labels(**kv: str) -> Labels:
    return tuple(sorted((k, v) for k, v in kv.items() if v != ""))


class FleetWriter:
    """Collects (labels, timestamp, value) samples and remote-writes them as one batch."""

    def __init__(self) -> None:
        self.index: dict[Labels, int] = {}
        self.blocks: dict[int, ScrapeBlock] = {}

    def add(self, labels: Labels, ts_ms: int, value: float) -> None:
        i = self.index.setdefault(labels, len(self.index))
        block = self.blocks.setdefault(ts_ms, ScrapeBlock(ts_ms, array("I"), array("d")))
        block.series.append(i)
        block.values.append(value)

    def write(self, prom: Prometheus) -> int:
        labelsets = list(self.index)
        scrapes = [self.blocks[t] for t in sorted(self.blocks)]
        body = build_write_request(Batch(CLUSTER, "fleet", 1, labelsets, scrapes))
        resp = requests.post(
            prom.remote_write_url,
            data=bytes(cramjam.snappy.compress_raw(body)),
            headers={
                "Content-Encoding": "snappy",
                "Content-Type": "application/x-protobuf",
                "X-Prometheus-Remote-Write-Version": "0.1.0",
            },
            timeout=60,
        )
        assert resp.status_code in (200, 204), resp.text[:500]
        return sum(len(b.values) for b in scrapes)


def synthetic_fleet(now_s: float) -> FleetWriter:
    fleet = FleetWriter()
    sim = Simulator(1, None, float(STEP_S))
    start = int(now_s) - (POINTS - 1) * STEP_S
    for n, node in enumerate(NODES):
        for exporter, job, port in (("kepler", "kepler", 28282), ("dcgm", "dcgm-exporter", 9400)):
            for tick in range(POINTS):
                ts = (start + tick * STEP_S) * 1000
                # The relay's labels: job, instance = <node>:<port>, cluster and node.
                extra = {"job": job, "instance": f"{node}:{port}", "cluster": CLUSTER, "node": node}
                for labels, value, _ in parse(sim.render(exporter, tick).decode()):
                    fleet.add(_labels(**{**dict(labels), **extra}), ts, value)
        relay = {"job": "edge-relay", "instance": f"{node}:9901", "cluster": CLUSTER, "node": node}
        ingest = {"job": "cloud-ingest", "instance": "10.0.0.5:9902", "cluster": CLUSTER, "node": node}
        offline = n == 1
        for tick in range(POINTS):
            t = start + tick * STEP_S
            ts = t * 1000
            series: list[tuple[str, dict[str, str], float]] = [
                ("edge_relay_spool_bytes", relay, 2e6 + tick * 1e6 if offline else 20_000.0),
                ("edge_relay_spool_rows", relay, 10.0 + tick * 5 if offline else 1.0),
                (
                    "edge_relay_publish_payload_bytes_total",
                    relay,
                    tick * STEP_S * (300.0 if offline else 7000.0),
                ),
                ("edge_relay_samples_dropped_total", {**relay, "reason": "spool_full"}, 40.0 * tick * n),
                ("edge_relay_mqtt_connected", relay, 0.0 if offline else 1.0),
                # The offline node's connection carries nothing: its wire counters stand still.
                (
                    "edge_relay_wire_bytes_total",
                    {**relay, "direction": "sent"},
                    5e6 if offline else tick * STEP_S * 9000.0,
                ),
                (
                    "edge_relay_wire_bytes_total",
                    {**relay, "direction": "received"},
                    2e5 if offline else tick * STEP_S * 600.0,
                ),
                ("edge_relay_budget_bytes_per_second", relay, 16384.0),
                ("edge_relay_spool_max_bytes", relay, 1610612736.0),
                # The offline node's backlog has degraded its lowest class.
                ("edge_relay_budget_resolution_seconds", {**relay, "class": "kepler-energy"}, 15.0),
                (
                    "edge_relay_budget_resolution_seconds",
                    {**relay, "class": "rest"},
                    120.0 if offline else 60.0,
                ),
                ("cloud_ingest_node_online", ingest, 0.0 if offline else 1.0),
                ("cloud_ingest_node_backlog_batches", ingest, 40.0 if offline else 2.0),
                ("cloud_ingest_node_last_batch_timestamp_seconds", ingest, float(start if offline else t)),
                ("cloud_ingest_samples_written_total", {**ingest, "cluster": ""}, tick * STEP_S * 900.0),
            ]
            if n == 0:
                cloud = {"job": "cloud-ingest", "instance": "10.0.0.5:9902"}
                series += [
                    ("cloud_ingest_dead_letters_total", {**cloud, "reason": "too_old"}, float(tick // 10)),
                    ("cloud_ingest_mqtt_connected", cloud, 1.0),
                    ("up", cloud, 1.0),
                ]
            for name, labels, value in series:
                fleet.add(_labels(__name__=name, **labels), ts, value)
    for node, (exporter, job, port) in VENDOR_NODES.items():
        for tick in range(POINTS):
            ts = (start + tick * STEP_S) * 1000
            extra = {"job": job, "instance": f"{node}:{port}", "cluster": CLUSTER, "node": node}
            for labels, value, _ in parse(sim.render(exporter, tick).decode()):
                fleet.add(_labels(**{**dict(labels), **extra}), ts, value)
    return fleet


def backfill_recording_rules(prom: Prometheus, now_s: float) -> int:
    """The GPU recording rules over the fleet's 15 minutes, as Prometheus would have evaluated them
    every STEP_S (they read raw series only), written back through remote write."""
    start = int(now_s) - (POINTS - 1) * STEP_S
    fleet = FleetWriter()
    for rule in recording_rules():
        resp = requests.get(
            f"{prom.url}/api/v1/query_range",
            params={"query": rule["expr"], "start": start, "end": int(now_s), "step": STEP_S},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text[:500]
        for series in resp.json()["data"]["result"]:
            labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
            labels.update(rule.get("labels", {}))
            for ts, value in series["values"]:
                fleet.add(_labels(__name__=rule["record"], **labels), round(ts * 1000), float(value))
    return fleet.write(prom) if fleet.index else 0


@pytest.fixture(scope="module")
def fleet_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], dict[str, Any]]]:
    prom = Prometheus(tmp_path_factory.mktemp("grafana-prom")).start()
    try:
        now = time.time()
        written = synthetic_fleet(now).write(prom)
        assert written > 10_000
        assert backfill_recording_rules(prom, now) > 1_000
        yield lambda promql: prom.query(promql, at=now)
    finally:
        prom.stop()


@pytest.mark.integration
@pytest.mark.parametrize(("where", "expr"), panel_queries(), ids=[w for w, _ in panel_queries()])
def test_panel_query_returns_series(
    fleet_prometheus: Callable[[str], dict[str, Any]], where: str, expr: str
) -> None:
    data = fleet_prometheus(grafana_expand(expr))
    assert data["result"], f"{where}: {expr!r} returned no series on the test fleet"


@pytest.mark.integration
@pytest.mark.parametrize(("name", "query"), variable_queries(), ids=[n for n, _ in variable_queries()])
def test_variable_query_returns_values(
    fleet_prometheus: Callable[[str], dict[str, Any]], name: str, query: str
) -> None:
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
    assert m, f"variable {name}: only label_values(<selector>, <label>) is checked, got {query!r}"
    selector, label = grafana_expand(m.group(1)), m.group(2)
    values = {series["metric"].get(label) for series in fleet_prometheus(selector)["result"]}
    values.discard(None)
    assert values, f"variable {name}: {query!r} yields no values"
    if name == "node":
        assert values == set(NODES)


@pytest.mark.integration
@pytest.mark.parametrize("title", GPU_PANELS)
def test_gpu_panels_show_every_vendor(fleet_prometheus: Callable[[str], dict[str, Any]], title: str) -> None:
    """Each GPU panel shows the NVIDIA, AMD, Intel and Jetson nodes' GPUs, in plausible units (Jetson
    has no utilisation and no error counters: its exporter exports neither)."""
    panel = next(p for p in all_panels(load_dashboard()) if p["title"] == title)
    result = fleet_prometheus(grafana_expand(panel["targets"][0]["expr"]))["result"]
    vendors = {r["metric"]["vendor"] for r in result}
    expected = VENDORS - {"jetson"} if title in ("GPU utilisation", "GPU hardware errors") else VENDORS
    assert vendors == expected, f"{title}: {sorted(vendors)}"
    gpus = {(r["metric"]["node"], r["metric"]["gpu"]) for r in result}
    assert ("edge-orin-01", "0") in gpus or "jetson" not in expected
    assert {("edge-amd-01", "0"), ("edge-amd-01", "1"), ("edge-intel-01", "0000:4d:00.0")} <= gpus
    values = [float(r["value"][1]) for r in result]
    bounds = {
        "GPU utilisation": (0, 100),
        "GPU temperature": (20, 110),
        "GPU memory in use": (0, 100),
        "GPU power draw": (1, 1000),
        "GPU clock": (1e8, 4e9),
        "GPU hardware errors": (0, 1),
    }[title]
    assert all(bounds[0] <= v <= bounds[1] for v in values), f"{title}: {values}"
