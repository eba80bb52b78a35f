"""A heterogeneous fleet: AMD, Intel and Jetson GPU exporters in the simulator, the presets, one run.

- Each simulated exporter is its fixture (simulator/data/*.prom, built from the exporter's source) at
  tick 0, parses with the relay's parser at any tick with the fixture's names, types and label names,
  keeps the exporter's quirks and moves plausibly (counters and accumulators never decrease).
- Every preset, and its ``*-critical`` subset, matches its vendor's series and no other exporter's;
  the unsuffixed accumulators the exporters type gauge are declared counters; a budget on each preset
  validates.
- ``simulate --vendor`` serves the vendor's node; one run of ``--vendor amd`` goes through the real
  relay, broker and ingester into Prometheus, sample for sample, and the GPU recording rules read it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from edge_relay.budget import PRESET_COUNTERS, PRESETS
from edge_relay.budget.model import parse as parse_budget
from edge_relay.collect.parse import parse
from schemas.model import is_counter, metric_name
from simulator import ALL_EXPORTERS, EXPORTERS, GPU_EXPORTERS, VENDORS, Simulator, data_path, start_in_thread
from simulator.base import DEFAULT_PORTS
from testkit.oracle import compare, expected_samples, read_served_log
from testkit.services import Mosquitto, Prometheus, free_port
from testkit.stack import SimulatorProcess, ingest_config, relay_config, run_relay_and_ingester

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_OF = {
    "amd": "amd-device-metrics-exporter-sample.prom",
    "intel": "intel-xpumd-sample.prom",
    "jetson": "jetson-stats-exporter-sample.prom",
    "dcgm": "dcgm-exporter-sample.prom",
    "kepler": "kepler-current-sample.prom",
}
# The vendor's presets, and the series of its exporter they leave out (generic client-library ones).
PRESET_OF = {"amd": "amd", "intel": "intel", "jetson": "jetson", "dcgm": "dcgm"}
GENERIC = re.compile(r"promhttp_.+|process_.+|python_.+")
# Families each exporter declares a gauge that only ever grow (the presets must know them as counters).
ACCUMULATORS = {
    "amd": {
        "gpu_energy_consumed",
        "gpu_violation_current_accumulated_counter",
        "gpu_violation_ppt_residency_accumulated",
        "gpu_violation_socket_thermal_residency_accumulated",
        "gpu_violation_hbm_thermal_residency_accumulated",
        "gpu_ecc_correct_umc",
        "gpu_ecc_uncorrect_umc",
    },
    "jetson": {"uptime_s"},
}
TICKS = (0, 1, 7, 40, 200)

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def sim() -> Simulator:
    return Simulator(3, None, 5.0, exporters=ALL_EXPORTERS)


def series_of(body: bytes) -> Series:
    out: Series = {}
    for labels, value, _ in parse(body.decode()):
        key = (metric_name(labels), tuple(kv for kv in labels if kv[0] != "__name__"))
        assert key not in out, f"duplicate series {key}"
        out[key] = value
    return out


def families(text: str) -> dict[str, tuple[str, frozenset[tuple[str, ...]]]]:
    """family -> (type, the label-name tuples of its samples), as prometheus_client reads it."""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, frozenset(tuple(s.labels) for s in fam.samples))
    return out


def values(series: Series, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in series.items() if n == name}


# --- the simulated exporters -------------------------------------------------------------------------


@pytest.mark.parametrize("exporter", GPU_EXPORTERS)
def test_tick_zero_is_the_fixture_byte_for_byte(sim: Simulator, exporter: str) -> None:
    assert sim.render(exporter, 0) == data_path(FIXTURE_OF[exporter]).read_bytes()


@pytest.mark.parametrize("exporter", GPU_EXPORTERS)
def test_payloads_parse_and_keep_the_fixtures_names_types_and_labels(sim: Simulator, exporter: str) -> None:
    fixture = data_path(FIXTURE_OF[exporter]).read_text()
    expected = families(fixture)
    headers = [line for line in fixture.splitlines() if line.startswith("#")]
    for tick in TICKS:
        text = sim.render(exporter, tick).decode()
        assert families(text) == expected, tick
        assert [line for line in text.splitlines() if line.startswith("#")] == headers
        series = series_of(text.encode())
        assert len(series) == len(parse(fixture)), tick
        assert all(math.isfinite(v) for v in series.values())


@pytest.mark.parametrize("exporter", GPU_EXPORTERS)
def test_counters_and_accumulators_never_decrease_and_gauges_move(sim: Simulator, exporter: str) -> None:
    fixture = data_path(FIXTURE_OF[exporter]).read_text()
    counters = {f for f, (t, _) in families(fixture).items() if t == "counter"}
    counters |= ACCUMULATORS.get(exporter, set())
    ticks = list(range(0, 120, 3))
    runs = [series_of(sim.render(exporter, t)) for t in ticks]
    grew = set()
    for prev, cur in itertools.pairwise(runs):
        for key, v in cur.items():
            name = key[0]
            family = name.removesuffix("_total") if name.endswith("_total") and name not in counters else name
            if name in counters or family in counters:
                assert v >= prev[key], f"{key} went from {prev[key]} to {v}"
                if v > prev[key]:
                    grew.add(name)
    assert grew, "no counter grew"
    moved = {k[0] for k, v in runs[-1].items() if v != runs[0][k] and k[0] not in counters}
    assert len(moved) >= 5, f"only {sorted(moved)} move"


def test_amd_quirks_energy_in_microjoules_at_the_package_powers_rate(sim: Simulator) -> None:
    a, b = series_of(sim.render("amd", 10)), series_of(sim.render("amd", 11))
    fixture = data_path(FIXTURE_OF["amd"]).read_text()
    # Every family the exporter writes is a gauge, accumulators included (its only counter: promhttp's).
    types = {f: t for f, (t, _) in families(fixture).items()}
    assert {f for f, t in types.items() if t != "gauge"} == {"promhttp_metric_handler_errors"}
    energy_a, energy_b = values(a, "gpu_energy_consumed"), values(b, "gpu_energy_consumed")
    power = values(b, "gpu_package_power")
    for labels, e in energy_b.items():
        watts = (e - energy_a[labels]) / 1e6 / 5.0
        assert abs(watts - power[labels]) <= 0.05 * power[labels] + 1, (watts, power[labels])
    # Free VRAM is what used VRAM leaves of the total ("MB" that are MiB: 196592 = 192 GiB).
    used, free, total = (values(b, f"gpu_{k}_vram") for k in ("used", "free", "total"))
    assert all(used[k] + free[k] == total[k] == 196592 for k in total)
    # The idle GPU's series carry empty pod labels, which sort first (the relay, like Prometheus,
    # drops empty labels).
    text = sim.render("amd", 11).decode()
    activity = [line for line in text.splitlines() if line.startswith("gpu_gfx_activity{")]
    assert ',pod="",' in activity[0] and ',pod="vllm-server-' in activity[1]
    assert [("pod" in dict(labels)) for labels in values(b, "gpu_gfx_activity")] == [False, True]
    assert all(0 <= v <= 100 for v in values(b, "gpu_gfx_activity").values())


def test_intel_quirks_ratios_and_energy(sim: Simulator) -> None:
    a, b = series_of(sim.render("intel", 30)), series_of(sim.render("intel", 31))
    size = {dict(k)["pci_bdf"]: v for k, v in values(b, "hw_memory_size_bytes").items()}
    for labels, used in values(b, "hw_memory_usage_bytes").items():
        ratio = values(b, "hw_memory_utilization_ratio")[labels]
        assert math.isclose(ratio, used / size[dict(labels)["pci_bdf"]], rel_tol=1e-6)
    for labels, e in values(b, "hw_energy_joules_total").items():
        watts = (e - values(a, "hw_energy_joules_total")[labels]) / 5.0
        assert math.isclose(watts, values(b, "hw_power_watts")[labels], rel_tol=0.05)
    assert all(0 <= v <= 1 for v in values(b, "hw_gpu_utilization_ratio").values())
    # Every series carries the OpenTelemetry scope; none a host identity (the relay adds `node`).
    assert all(("otel_scope_version", "0.0.0") in labels for _, labels in b)
    assert not any(k in ("hostname", "node", "instance") for _, labels in b for k, _ in labels)


def test_jetson_quirks_khz_swapped_labels_offline_sensors(sim: Simulator) -> None:
    for tick in (0, 25, 90):
        s = series_of(sim.render("jetson", tick))
        freq = values(s, "gpu_utilization_percentage_Hz")
        # The GPU's frequency in kHz (Orin Nano: 306-1020 MHz), under swapped labels; no load at all.
        cur = freq[(("nvidia_gpu", "freq"), ("statistic", "gpu"))]
        assert 306_000 <= cur <= 1_020_000
        cpu = [v for k, v in values(s, "cpu_Hz").items() if ("statistic", "freq") in k]
        assert cpu and all(115_200 <= v <= 1_728_000 for v in cpu)
        temps = values(s, "temperature_C")
        assert [v for k, v in temps.items() if k[0][1].startswith("cv")] == [-256.0] * 3
        assert all(20 <= v <= 105 for k, v in temps.items() if not k[0][1].startswith("cv"))
        assert values(s, "disk_GB")[(("mountpoint", "percent"),)] == 3.6e-08
        ram = {dict(k)["statistic"]: v for k, v in values(s, "ram_kB").items()}
        assert ram["used"] + ram["free"] <= ram["total"]
    # Python's spelling of floats, not Go's.
    text = sim.render("jetson", 3).decode()
    assert 'cpu_Hz{core="0",statistic="min_freq"} 115200.0\n' in text
    assert re.search(r'^uptime_s\{statistic="alive"\} \d+\.\d+$', text, re.M)


def test_kepler_has_no_gpu_series_off_nvidia() -> None:
    nvidia = Simulator(1, None, 5.0)
    amd = Simulator(1, None, 5.0, exporters=VENDORS["amd"], kepler_gpu=False)
    gpu = re.compile(r"^kepler_\w*gpu\w*", re.M)
    assert gpu.search(nvidia.render("kepler", 0).decode())
    assert not gpu.search(amd.render("kepler", 0).decode())
    assert not gpu.search(amd.render("kepler-0.7", 0).decode())
    assert amd.planned_series["kepler"] < nvidia.planned_series["kepler"]


# --- presets -----------------------------------------------------------------------------------------


def matches(preset: str, name: str) -> bool:
    return any(re.fullmatch(p, name) for p in PRESETS[preset].names)


@pytest.fixture(scope="module")
def names_by_exporter(sim: Simulator) -> dict[str, set[str]]:
    return {e: {n for n, _ in series_of(sim.render(e, 5))} for e in ALL_EXPORTERS}


@pytest.mark.parametrize("vendor", ["amd", "intel", "jetson"])
def test_each_preset_matches_its_vendors_series_and_no_others(
    names_by_exporter: dict[str, set[str]], vendor: str
) -> None:
    preset = PRESET_OF[vendor]
    own = names_by_exporter[vendor]
    assert {n for n in own if matches(preset, n)} == {n for n in own if not GENERIC.fullmatch(n)}
    for other, names in names_by_exporter.items():
        if other != vendor:
            assert not {n for n in names if matches(preset, n)}, f"{preset} matches {other}'s series"
    # The critical subset: part of the preset, with temperature, utilisation, memory, power (and errors).
    critical = {n for n in own if matches(f"{preset}-critical", n)}
    assert critical and all(matches(preset, n) for n in critical)
    for other, names in names_by_exporter.items():
        if other != vendor:
            assert not {n for n in names if matches(f"{preset}-critical", n)}, other
    signals = {
        "amd": {"gpu_junction_temperature", "gpu_gfx_activity", "gpu_used_vram", "gpu_package_power"},
        "intel": {"hw_temperature_celsius", "hw_gpu_utilization_ratio", "hw_memory_usage_bytes"},
        "jetson": {"temperature_C", "gpuram_kB", "integrated_power_mW", "gpu_utilization_percentage_Hz"},
    }[vendor]
    assert signals <= critical
    extra = {"amd": {"gpu_ecc_uncorrect_total"}, "intel": {"hw_errors_total", "hw_power_watts"}}
    assert extra.get(vendor, set()) <= critical
    assert len(critical) < len({n for n in own if matches(preset, n)})


def test_presets_know_the_intel_1x_and_amd_helm_names() -> None:
    for name in (
        "xpum_power_watts",
        "xpum_engine_ratio",
        "xpum_cache_errors_total",
        "xpum_memory_used_bytes",
    ):
        assert matches("intel", name) and matches("intel-critical", name)
    assert matches("intel", "xpum_frequency_mhz") and not matches("intel-critical", "xpum_frequency_mhz")
    for name in ("amd_gpu_package_power", "amd_gpu_junction_temperature", "amd_gpu_used_vram"):
        assert matches("amd", name) and matches("amd-critical", name)
    assert is_counter("amd_gpu_energy_consumed", PRESET_COUNTERS)
    # Kepler's GPU series: in kepler and kepler-gpu; CPU ones only in kepler.
    for name in ("kepler_node_gpu_watts", "kepler_pod_gpu_joules_total", "kepler_node_gpu_info"):
        assert matches("kepler", name) and matches("kepler-gpu", name)
    assert matches("kepler", "kepler_pod_cpu_watts") and not matches("kepler-gpu", "kepler_pod_cpu_watts")


@pytest.mark.parametrize("exporter", ["amd", "jetson"])
def test_accumulators_typed_gauge_are_preset_counters(exporter: str) -> None:
    for name in ACCUMULATORS[exporter]:
        assert is_counter(name, PRESET_COUNTERS), name
        assert is_counter(name, PRESETS[PRESET_OF[exporter]].counters), name
    # Their gauges are not.
    for name in ("gpu_package_power", "gpu_gfx_activity", "temperature_C", "integrated_power_mW"):
        assert not is_counter(name, PRESET_COUNTERS), name


def test_a_budget_on_every_preset_validates_and_classifies(names_by_exporter: dict[str, set[str]]) -> None:
    classes = [{"name": p, "preset": p} for p in PRESETS if p.endswith("-critical")]
    classes += [{"name": f"all-{p}", "preset": p} for p in PRESETS if not p.endswith("-critical")]
    budget = parse_budget(
        {"version": 1, "uplink": {"sustained_bytes_per_second": 16384}, "classes": classes}, "fleet.yaml"
    )
    names = [c.name for c in budget.classes]
    for vendor in ("amd", "intel", "jetson"):
        for name in {n for n in names_by_exporter[vendor] if not GENERIC.fullmatch(n)}:
            cls = budget.classes[budget.classify((("__name__", name),))].name
            critical = matches(f"{vendor}-critical", name)
            assert cls == (f"{vendor}-critical" if critical else f"all-{vendor}"), f"{name} in {cls}"
    assert "other" in names and len(names) == len(PRESETS) + 1


# --- simulate --vendor -------------------------------------------------------------------------------


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return bytes(resp.read())


@pytest.mark.parametrize("vendor", list(VENDORS))
def test_start_in_thread_serves_the_vendors_node(vendor: str) -> None:
    server = start_in_thread(seed=2, interval_s=3600.0, vendor=vendor)
    try:
        assert set(server.urls) == set(VENDORS[vendor])
        for exporter, url in server.urls.items():
            assert fetch(url) == server.simulator.render(exporter, 0)
    finally:
        server.stop()


@contextlib.contextmanager
def _simulate(*args: str, cwd: Path) -> Iterator[dict[str, Any]]:
    argv = [sys.executable, "-m", "edge_relay.cli", "simulate", "--interval", "3600", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_simulate_vendor_cli_picks_the_exporters_and_keeps_explicit_ports(tmp_path: Path) -> None:
    port = free_port()
    with _simulate("--vendor", "jetson", "--node-port", "0", "--jetson-port", str(port), cwd=ROOT) as ready:
        assert ready["vendor"] == "jetson" and set(ready["exporters"]) == {"jetson", "node"}
        assert ready["exporters"]["jetson"].endswith(f":{port}/metrics")
        twin = Simulator(1, exporters=VENDORS["jetson"])
        assert fetch(ready["exporters"]["jetson"]) == twin.render("jetson", 0)
    # An explicit port adds an exporter to the vendor's set; -1 removes one.
    ports = ("--kepler-port", "-1", "--node-port", "0", "--intel-port", "0", "--dcgm-port", "0")
    with _simulate("--vendor", "intel", *ports, cwd=ROOT) as ready:
        assert set(ready["exporters"]) == {"intel", "node", "dcgm"}
    assert DEFAULT_PORTS["jetson"] != DEFAULT_PORTS["node"]  # both run on one Jetson
    assert VENDORS["nvidia"] == EXPORTERS  # the default: today's four


# --- one vendor end to end ---------------------------------------------------------------------------

RUN_SECONDS = 12


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_amd_node_reaches_prometheus_sample_for_sample(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    """``simulate --vendor amd`` -> edge-relay -> mosquitto -> cloud-ingest -> Prometheus: every sample
    served arrives, and the AMD recording rules find both GPUs in what arrived."""
    sim = SimulatorProcess(tmp_path, seed=5, interval=1.0, churn_ticks=10, vendor="amd").start()
    twin, urls = sim.simulator, sim.urls
    try:
        assert set(urls) == {"kepler", "amd", "node"}
        relay_cfg = relay_config(
            tmp_path, urls=urls, mqtt_port=mosquitto.port, interval=1.0, node="edge-gpu-02"
        )
        rw_url = prometheus.remote_write_url
        ingest_cfg = ingest_config(tmp_path, mqtt_port=mosquitto.port, remote_write_url=rw_url)
        run_relay_and_ingester(tmp_path, relay_cfg, ingest_cfg, RUN_SECONDS)
    finally:
        sim.stop()
    served = read_served_log(sim.served_log)
    assert {s.exporter for s in served} == {"kepler", "amd", "node"}
    instances = {name: f"edge-gpu-02:{url.split(':')[2].split('/')[0]}" for name, url in urls.items()}
    extra = {"cluster": "test", "node": "edge-gpu-02"}
    expected = expected_samples(twin, served, jobs={e: e for e in urls}, instances=instances, extra=extra)
    actual = prometheus.raw_samples('{job=~".+"}', lookback="10m")
    synthetic = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
    real = {k: v for k, v in actual.items() if dict(k)["__name__"] not in synthetic}
    problems = compare(expected, real)
    assert not problems, "\n".join(problems[:20])
    amd = [k for k in expected if dict(k)["job"] == "amd"]
    fixture_families = families(data_path(FIXTURE_OF["amd"]).read_text())
    assert len({dict(k)["__name__"] for k in amd}) == len(fixture_families)
    assert len(amd) == twin.planned_series["amd"]
    # The recording rules on what arrived: both MI300X, in watts, bytes and °C.
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules/gpu-vendors.rules.yml").read_text())["groups"][0]
    for rule in (r for r in rules["rules"] if r["labels"]["vendor"] == "amd" and "rate" not in r["expr"]):
        result = prometheus.query(rule["expr"])["result"]
        assert sorted(r["metric"]["gpu"] for r in result) == ["0", "1"], rule["record"]
