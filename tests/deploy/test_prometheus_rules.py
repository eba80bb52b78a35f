"""deploy/prometheus: the Prometheus configuration, the alert rules and their unit tests, Alertmanager.

Checked with the real tools: ``promtool check config``, ``promtool check rules``, ``promtool test
rules`` (Debian package ``prometheus``) and ``amtool check-config`` (``prometheus-alertmanager``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from cloud_ingest.selfmetrics import IngestMetrics
from edge_relay.selfmetrics import RelayMetrics

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy/prometheus"
RULE_FILES = sorted((PROM_DIR / "rules").glob("*.rules.yml"))
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.test.yml"))
RELAY_K8S_CONFIG = ROOT / "deploy/kubernetes/base/edge/config/edge-relay.yaml"
BUDGET_FILE = ROOT / "deploy/kubernetes/base/edge/config/budget.yaml"
SEVERITIES = {"warning", "critical"}


def tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} missing: install the Debian package `{package}`", pytrace=False)
    return found


def run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}"


def alert_rules() -> list[dict[str, Any]]:
    rules = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules += [r for r in group["rules"] if "alert" in r]
    return rules


def product_metric_names() -> set[str]:
    """Every sample name the relay and the ingester expose, from their own metric definitions."""
    names: set[str] = set()
    for registry in (RelayMetrics(CollectorRegistry()).registry, IngestMetrics(CollectorRegistry()).registry):
        for family in registry.collect():
            if family.type == "counter":
                names |= {f"{family.name}_total", f"{family.name}_created"}
            elif family.type == "histogram":
                names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
            else:
                names.add(family.name)
    return names


PRODUCT_METRIC = re.compile(r"\b(?:edge_relay|cloud_ingest)_[a-z_]+\b")


def test_rule_files_exist() -> None:
    assert {p.name for p in RULE_FILES} == {"gpu-vendors.rules.yml", "gpu.rules.yml", "edge-relay.rules.yml"}
    assert RULE_TESTS, "no promtool unit tests"


def test_promtool_check_config() -> None:
    # Also parses every rule file the configuration loads (rule_files: rules/*.rules.yml).
    run([tool("promtool", "prometheus"), "check", "config", str(PROM_DIR / "prometheus.yml")])
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert config["storage"]["tsdb"]["out_of_order_time_window"], "the backlog needs an out-of-order window"


def test_promtool_check_rules() -> None:
    run([tool("promtool", "prometheus"), "check", "rules", *map(str, RULE_FILES)])


def test_promtool_unit_tests() -> None:
    run([tool("promtool", "prometheus"), "test", "rules", *map(str, RULE_TESTS)])


def test_amtool_check_config() -> None:
    run([tool("amtool", "prometheus-alertmanager"), "check-config", str(PROM_DIR / "alertmanager.yml")])
    config = yaml.safe_load((PROM_DIR / "alertmanager.yml").read_text())
    names = {r["alert"] for r in alert_rules()}
    for inhibit in config.get("inhibit_rules", []):
        for matcher in inhibit.get("source_matchers", []) + inhibit.get("target_matchers", []):
            m = re.fullmatch(r'alertname(=~?)"(.*)"', matcher)
            if m:
                pattern = m.group(2) if m.group(1) == "=~" else re.escape(m.group(2))
                assert any(re.fullmatch(pattern, n) for n in names), f"{matcher} matches no alert"


def test_every_alert_has_severity_summary_description_and_a_unit_test() -> None:
    tested: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            tested |= {t["alertname"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    for rule in alert_rules():
        name = rule["alert"]
        assert rule.get("labels", {}).get("severity") in SEVERITIES, name
        assert {"summary", "description"} <= set(rule.get("annotations", {})), name
        assert name in tested, f"{name} has no promtool test in which it fires"


def test_gpu_utilisation_rule_is_the_practice_one() -> None:
    # NVIDIA's practice (DCGM_FI_DEV_GPU_UTIL > 90 for 5m), on the vendor-independent ratio.
    rule = next(r for r in alert_rules() if r["alert"] == "GPUHighUtilization")
    assert rule["expr"].strip() == "gpu:utilization_ratio > 0.9"
    assert rule["for"] == "5m" and rule["labels"]["severity"] == "warning"
    summary = rule["annotations"]["summary"]
    assert "$labels.node" in summary and "$labels.instance" in summary and "$labels.vendor" in summary


def test_rules_use_only_metrics_the_product_exposes() -> None:
    exposed = product_metric_names()
    for rule in alert_rules():
        for name in PRODUCT_METRIC.findall(rule["expr"]):
            assert name in exposed, f"{rule['alert']}: {name} is not a relay/ingester metric"


def test_budget_and_spool_cap_come_from_each_relay() -> None:
    """The rules once hard-coded the shipped budget and spool cap; each relay now exports its own."""
    budget = yaml.safe_load(BUDGET_FILE.read_text())["uplink"]["sustained_bytes_per_second"]
    spool_cap = yaml.safe_load(RELAY_K8S_CONFIG.read_text())["spool"]["max_bytes"]
    text = "\n".join(p.read_text() for p in RULE_FILES)
    assert "placeholder" not in text.lower()
    assert str(budget) not in text and str(spool_cap) not in text
    rules = {r["alert"]: r for r in alert_rules()}
    for name in ("EdgeRelayBudgetExceeded", "EdgeRelaySpoolNearCap"):
        expr = rules[name]["expr"]
        # No byte figure at all (shipped or any other): only ratios, tolerances and ranges.
        figures = [float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:e\d+)?(?![\w.])", expr)]
        assert all(f <= 2 for f in figures), f"{name}: a fixed threshold in {expr!r}"

    exceeded = rules["EdgeRelayBudgetExceeded"]["expr"]
    assert "edge_relay_wire_bytes_total" in exceeded and "edge_relay_budget_bytes_per_second" in exceeded
    # The budget limits the connection's bytes, not the batches' payload.
    assert "edge_relay_publish_payload_bytes_total" not in exceeded
    assert "edge_relay_spool_max_bytes" in rules["EdgeRelaySpoolNearCap"]["expr"]
    # A budget or cap of 0 means none: those nodes must not be compared with 0.
    assert re.search(r"edge_relay_budget_bytes_per_second\s*>\s*0\b", exceeded)
    assert re.search(r"edge_relay_spool_max_bytes\s*>\s*0\b", rules["EdgeRelaySpoolNearCap"]["expr"])


def test_annotation_queries_use_only_metrics_the_product_exposes() -> None:
    # Annotations look figures up with `query` (the budget, the cap, the degrade level).
    exposed = product_metric_names()
    for rule in alert_rules():
        for text in rule["annotations"].values():
            for name in PRODUCT_METRIC.findall(text):
                assert name in exposed, f"{rule['alert']}: {name} (annotation) is not a relay/ingester metric"


# --- the GPU rules across vendors ------------------------------------------------------------------

VENDOR_RULES = PROM_DIR / "rules/gpu-vendors.rules.yml"
GPU_SIGNALS = {
    "gpu:temperature_celsius",
    "gpu:utilization_ratio",
    "gpu:memory_used_bytes",
    "gpu:memory_total_bytes",
    "gpu:power_watts",
    "gpu:power_limit_watts",
    "gpu:clock_hertz",
    "gpu:errors:rate5m",
}
# Jetson's exporter has no GPU load and no error counters.
NOT_EXPORTED = {("jetson", "gpu:utilization_ratio"), ("jetson", "gpu:errors:rate5m")}
# The vendor's preset (and *-critical subset) that must match every series its rules read.
VENDOR_PRESET = {"nvidia": "dcgm", "amd": "amd", "intel": "intel", "jetson": "jetson"}
VENDOR_EXPORTER = {"nvidia": "dcgm", "amd": "amd", "intel": "intel", "jetson": "jetson"}
# Counters: rate() over them is exact at any class resolution (sent as their last value), so the
# remapped-row counters need not be in dcgm-critical (tests/edge/test_budget.py pins that preset).
NOT_CRITICAL = {"DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"}
PROMQL_WORDS = {
    "label_replace",
    "max",
    "sum",
    "without",
    "rate",
    "changes",
    "or",
    "by",
    "on",
    "unless",
    "and",
}


def recording_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(VENDOR_RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "record" in r]


def source_metrics(expr: str) -> set[str]:
    """Metric names an expression selects (label names, strings and functions stripped)."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(?:without|by|on|ignoring)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    names = set(re.findall(r"\b[a-zA-Z_][a-zA-Z0-9_:]*\b(?!\s*\()", expr))
    return {n for n in names if n not in PROMQL_WORDS and not re.fullmatch(r"\d+e\d+|e\d+", n)}


def test_gpu_alerts_read_only_the_vendor_independent_series() -> None:
    gpu_alerts = [r for r in alert_rules() if r["alert"].startswith("GPU")]
    signals = set()
    for rule in gpu_alerts:
        names = set(re.findall(r"\bgpu:[a-z_:0-9]+", rule["expr"]))
        assert names and names <= GPU_SIGNALS, rule["alert"]
        vendor_names = re.search(r"DCGM_|\bgpu_[a-z]|\bhw_|xpum_|_kB\b|temperature_C", rule["expr"])
        assert not vendor_names, rule["alert"]
        signals |= names
        assert "$labels.vendor" in rule["annotations"]["summary"], rule["alert"]
    # One alert per signal (temperature has a warning and a critical level), every signal alerted.
    assert sorted(r["alert"] for r in gpu_alerts) == [
        "GPUHardwareErrors",
        "GPUHighTemperature",
        "GPUHighUtilization",
        "GPUMemoryNearlyFull",
        "GPUPowerDrawHigh",
        "GPUTemperatureCritical",
    ]
    assert signals == GPU_SIGNALS - {"gpu:clock_hertz"}


def test_every_vendor_records_every_signal_it_can() -> None:
    have: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rule in recording_rules():
        assert rule["record"] in GPU_SIGNALS, rule["record"]
        vendor = rule["labels"]["vendor"]
        have.setdefault((vendor, rule["record"]), []).append(rule)
    for vendor in VENDOR_PRESET:
        for signal in GPU_SIGNALS:
            assert ((vendor, signal) in have) != ((vendor, signal) in NOT_EXPORTED), (vendor, signal)


def test_recording_rules_read_only_series_the_vendor_presets_match() -> None:
    from edge_relay.budget.model import PRESETS

    def matches(preset: str, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in PRESETS[preset].names)

    for rule in recording_rules():
        vendor = rule["labels"]["vendor"]
        preset = VENDOR_PRESET[vendor]
        for name in source_metrics(rule["expr"]):
            assert matches(preset, name), f"{rule['record']} ({vendor}): {name} is not in preset {preset}"
            if rule["record"] != "gpu:clock_hertz" and name not in NOT_CRITICAL:
                critical = f"{preset}-critical"
                assert matches(critical, name), f"{rule['record']} ({vendor}): {name} not in {critical}"


def _promtool_series(body: list[bytes], extra: dict[str, str]) -> list[dict[str, str]]:
    """One promtool input series per exposition series, its values one per tick (1 min apart)."""
    from edge_relay.collect.parse import parse

    values: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for tick, payload in enumerate(body):
        for labels, value, _ in parse(payload.decode()):
            # Prometheus drops empty labels on ingestion (AMD's idle GPU sends pod="" ...).
            kept = tuple((k, v) for k, v in labels if v != "")
            values.setdefault(kept, ["_"] * len(body))[tick] = repr(value)
    out = []
    for labels, vals in values.items():
        d = dict(labels)
        name = d.pop("__name__")
        inner = ",".join(f'{k}="{v}"' for k, v in {**d, **extra}.items())
        out.append({"series": f"{name}{{{inner}}}", "values": " ".join(vals)})
    return out


@pytest.mark.parametrize(("vendor", "gpus"), [("nvidia", 2), ("amd", 2), ("intel", 2), ("jetson", 1)])
def test_recording_rules_on_the_simulated_exporters(vendor: str, gpus: int, tmp_path: Path) -> None:
    """The rules on each simulated exporter's real label sets: one gpu:* series per GPU and signal."""
    from simulator import Simulator

    exporter = VENDOR_EXPORTER[vendor]
    sim = Simulator(1, None, 60.0, churn_ticks=0, exporters=[exporter])
    bodies = [sim.render(exporter, t) for t in range(12)]
    extra = {"cluster": "factory-north", "node": f"edge-{vendor}", "job": exporter, "instance": "x:1"}
    exprs = []
    for signal in sorted(GPU_SIGNALS):
        if (vendor, signal) in NOT_EXPORTED:
            continue
        if signal == "gpu:errors:rate5m":
            # Every error type a GPU reports, at least its uncorrectable ones.
            query = f'count(gpu:errors:rate5m{{vendor="{vendor}", error_type="uncorrectable"}})'
        else:
            query = f'count({signal}{{vendor="{vendor}"}})'
        exprs.append({"expr": query, "eval_time": "11m", "exp_samples": [{"labels": "{}", "value": gpus}]})
    # The units come out plausible: °C, 0..1, bytes, watts, hertz.
    checks = {
        "gpu:temperature_celsius": (20, 110),
        "gpu:utilization_ratio": (0, 1),
        "gpu:memory_used_bytes": (1e6, 1e12),
        "gpu:power_watts": (1, 1000),
        "gpu:clock_hertz": (1e8, 4e9),
    }
    for signal, (lo, hi) in checks.items():
        if (vendor, signal) in NOT_EXPORTED:
            continue
        out_of_range = f'count({signal}{{vendor="{vendor}"}} < {lo} or {signal}{{vendor="{vendor}"}} > {hi})'
        exprs.append({"expr": out_of_range, "eval_time": "11m", "exp_samples": []})
    test = {
        "rule_files": [str(VENDOR_RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": _promtool_series(bodies, extra), "promql_expr_test": exprs}
        ],
    }
    path = tmp_path / f"{vendor}.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    run([tool("promtool", "prometheus"), "test", "rules", str(path)])
