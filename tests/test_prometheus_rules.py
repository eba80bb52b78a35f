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

ROOT = Path(__file__).resolve().parent.parent
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
    assert {p.name for p in RULE_FILES} == {"gpu.rules.yml", "edge-relay.rules.yml"}
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
    rule = next(r for r in alert_rules() if r["alert"] == "GPUHighUtilization")
    assert rule["expr"].strip() == "DCGM_FI_DEV_GPU_UTIL > 90"
    assert rule["for"] == "5m" and rule["labels"]["severity"] == "warning"
    summary = rule["annotations"]["summary"]
    assert "$labels.node" in summary and "$labels.instance" in summary


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
