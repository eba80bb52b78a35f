"""Per-node anomaly detection (``edge_relay.anomaly.node``, run by ``edge_relay.anomaly.detector.Detector``).

- the node's rules on scrapes built by hand (node-exporter + Kepler 0.10 or 0.7): a thermal climb, memory
  exhaustion (available memory, PSI stalls), a power jump and a power limit; the GPUs' own sensors and
  series are not the node's;
- no event on a steady node over a long synthetic run (noise and benign load steps), nor on the
  simulator's node-exporter and Kepler;
- the window: opens with an event ``gpu="node"``, holds exactly the node-level series, closes
  ``post_seconds`` after the last detection; ``match``, the status fields;
- the budget file's ``anomaly.node`` section;
- one in-process ``Relay.cycle()`` run: a budget that holds the node's series at 300 s sends them at
  full resolution while the node's window is open, and the metrics say gpu="node".
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from edge_relay.anomaly.detector import AnomalyConfig, Detector, Event, status_fields
from edge_relay.anomaly.node import NodeConfig, NodeThresholds, is_node_series
from edge_relay.budget.model import ConfigError, load, parse
from edge_relay.collect.shape import ShapedScrape
from schemas.model import Labels, metric_name

T0 = 1_800_000_000_000
STEP_MS = 5000
GIB = 1 << 30


def lab(name: str, **labels: str) -> Labels:
    return (("__name__", name), *sorted(labels.items()), ("instance", "edge-gpu-01"), ("job", "x"))


class FakeNode:
    """A GPU node's node-exporter, Kepler and dcgm-exporter scrapes, built by hand every 5 s: the
    signals are attributes a test changes between scrapes (``kepler``: "0.10" or "0.7")."""

    def __init__(self, seed: int = 1, kepler: str = "0.10", noise: bool = True) -> None:
        self.rng = random.Random(seed)
        self.noise = noise
        self.kepler = kepler
        self.temp = 55.0  # the CPU package
        self.avail = 0.6  # MemAvailable / MemTotal
        self.stall_share = 0.0  # PSI memory full
        self.package_w, self.dram_w = 140.0, 17.0
        self.gpu_temp = 97.0  # an AMD GPU's hwmon sensor: hot, but the GPU detector's business
        self.tick = 0
        self.joules = {"package": 3.4e7, "dram": 4.6e6, "platform": 9.6e7}
        self.stalled = 12.0

    def _n(self, sd: float) -> float:
        return self.rng.gauss(0, sd) if self.noise else 0.0

    def scrapes(self) -> tuple[int, list[ShapedScrape]]:
        ts = T0 + self.tick * STEP_MS
        if self.tick:
            dt = STEP_MS / 1000
            w = self.package_w * (1 + self._n(0.01))
            self.joules["package"] += w * dt
            self.joules["dram"] += self.dram_w * dt
            self.joules["platform"] += (w + self.dram_w + 60.0) * dt
            self.stalled += self.stall_share * dt
        self.tick += 1
        core = "platform_coretemp_0"
        node = [
            (lab("node_hwmon_chip_names", chip="platform_coretemp_0", chip_name="coretemp"), 1.0),
            (lab("node_hwmon_chip_names", chip="0000:c1:00_0", chip_name="amdgpu"), 1.0),
            (lab("node_hwmon_temp_celsius", chip=core, sensor="temp1"), self.temp + self._n(0.4)),
            (lab("node_hwmon_temp_celsius", chip=core, sensor="temp2"), self.temp - 4 + self._n(0.4)),
            (lab("node_hwmon_temp_celsius", chip="nvme_nvme0", sensor="temp1"), 42.0 + self._n(0.1)),
            (lab("node_hwmon_temp_celsius", chip="0000:c1:00_0", sensor="temp1"), self.gpu_temp),
            (lab("node_thermal_zone_temp", type="x86_pkg_temp", zone="0"), self.temp - 1),
            (lab("node_memory_MemTotal_bytes"), 64.0 * GIB),
            (lab("node_memory_MemAvailable_bytes"), round(64 * GIB * max(0.0, self.avail + self._n(0.002)))),
            (lab("node_pressure_memory_stalled_seconds_total"), self.stalled),
            (lab("node_cpu_seconds_total", cpu="0", mode="idle"), 1000.0 + self.tick * 2.5),
            (lab("node_load1"), 7.0 + self._n(0.3)),
        ]  # fmt: skip
        if self.kepler == "0.10":
            kepler = [
                (lab("kepler_node_cpu_joules_total", zone="package"), self.joules["package"]),
                (lab("kepler_node_cpu_joules_total", zone="dram"), self.joules["dram"]),
                (lab("kepler_node_cpu_watts", zone="package"), self.package_w),
                (lab("kepler_node_cpu_usage_ratio"), 0.44),
                (lab("kepler_node_gpu_watts", gpu="0"), 212.0),
                (lab("kepler_node_gpu_joules_total", gpu="0"), 5.6e7 + self.tick * 1060.0),
            ]
        else:  # 0.7: per component, dynamic and idle; the platform (ACPI) includes all
            j, dyn = self.joules, "dynamic"
            kepler = [
                (lab("kepler_node_package_joules_total", mode=dyn, package="0"), j["package"] * 0.6),
                (lab("kepler_node_package_joules_total", mode="idle", package="0"), j["package"] * 0.4),
                (lab("kepler_node_dram_joules_total", mode=dyn, package="0"), j["dram"]),
                (lab("kepler_node_platform_joules_total", mode=dyn, package="energy1"), j["platform"]),
                (lab("kepler_node_gpu_joules_total", mode=dyn, package="0"), 4.0e7 + self.tick * 1060.0),
                (lab("kepler_node_info", source="os"), 1.0),
            ]  # fmt: skip
        dcgm = [
            (lab("DCGM_FI_DEV_GPU_TEMP", gpu="0"), 60.0 + self._n(0.3)),
            (lab("DCGM_FI_DEV_POWER_USAGE", gpu="0"), 212.0 + self._n(2.0)),
        ]
        out = []
        for target, rows in (("node", node), ("kepler", kepler), ("dcgm", dcgm)):
            out.append(ShapedScrape(target, ts, [r[0] for r in rows], array("d", [r[1] for r in rows])))
        return ts, out


def run(det: Detector, node: FakeNode, ticks: int, change: Any = None) -> list[tuple[int, Event]]:
    events = []
    for _ in range(ticks):
        if change is not None:
            change(node)
        tick = node.tick
        ts, raw = node.scrapes()
        events += [(tick, ev) for ev in det.observe(raw, ts)]
    return events


def node_cfg(**thresholds: Any) -> AnomalyConfig:
    return AnomalyConfig(node=NodeConfig(thresholds=NodeThresholds(**thresholds)))


# --- the rules ------------------------------------------------------------------------------------


def test_a_thermal_climb_fires_the_slope_before_the_limit() -> None:
    det, node = Detector(AnomalyConfig(), 5.0), FakeNode()
    assert run(det, node, 40) == []  # warm-up at 55 °C; the AMD GPU's hwmon sensor at 97 °C is not the node's
    node.temp = 72.0
    assert run(det, node, 10) == []  # a load step at a cool temperature: ordinary

    def climb(n: FakeNode) -> None:
        n.temp += 1.5  # +9 °C in 30 s, toward the 90 °C limit

    events = run(det, node, 12, climb)
    assert events, "thermal climb not detected"
    tick, ev = events[0]
    assert (ev.gpu, ev.scope, ev.kind, ev.rule) == ("node", "node", "thermal", "node_temp_slope")
    assert ev.opened and ev.window_end_ms == ev.at_ms + 300_000
    assert 72 + 1.5 * (tick - 49) < 90  # before the limit
    assert [e.gpu for _, e in events] == ["node"]  # one onset: the window follows the climb
    # With the slope rule out of reach, the limit: 2 scrapes at or over 90 °C.
    det, node = Detector(node_cfg(temp_slope_c=50.0), 5.0), FakeNode(noise=False)
    run(det, node, 30)
    node.temp = 91.0
    events = run(det, node, 3)
    assert [(t, e.rule) for t, e in events] == [(31, "node_temp>=90")]


def test_memory_exhaustion_available_memory_and_stalls() -> None:
    rules_only = AnomalyConfig(score="none")
    det, node = Detector(rules_only, 5.0), FakeNode()
    run(det, node, 30)

    def leak(n: FakeNode) -> None:
        n.avail = max(0.01, n.avail - 0.05)

    events = run(det, node, 20, leak)
    assert events
    tick, ev = events[0]
    assert (ev.gpu, ev.kind, ev.rule) == ("node", "memory", "node_mem_available<=0.05")
    assert node.avail <= 0.05 and tick <= 30 + 13
    # PSI: 30 % of the time stalled on memory, with memory still available (swap / reclaim storms).
    det, node = Detector(rules_only, 5.0), FakeNode()
    run(det, node, 30)
    node.stall_share = 0.3
    events = run(det, node, 4)
    assert [(t, e.rule) for t, e in events] == [(31, "node_mem_stall>=0.1")]
    # The default (rules or EWMA): the leak is an event on the node, whichever says it first.
    det, node = Detector(AnomalyConfig(), 5.0), FakeNode()
    run(det, node, 30)
    events = run(det, node, 20, leak)
    assert events and {e.gpu for _, e in events} == {"node"} and events[0][1].kind in ("memory", "score")


@pytest.mark.parametrize("kepler", ["0.10", "0.7"])
def test_a_power_jump_and_a_power_limit(kepler: str) -> None:
    det, node = Detector(AnomalyConfig(score="none"), 5.0), FakeNode(kepler=kepler)
    assert run(det, node, 40) == []
    assert det.node is not None
    node.package_w = 300.0  # +160 W: the 15 s rate crosses +50 % two scrapes later
    events = run(det, node, 6)
    # Kepler 0.10: package + DRAM; 0.7: the platform (ACPI: + the rest of the board), a smaller step.
    assert [(t, e.kind, e.rule) for t, e in events] == [
        (42 if kepler == "0.10" else 43, "power", "node_power_jump")
    ]
    # An absolute limit (off by default: no exporter serves the node's): 3 scrapes at or over it.
    det, node = Detector(node_cfg(power_watts=400.0, power_jump_fraction=None), 5.0), FakeNode(kepler=kepler)
    run(det, node, 10)
    node.package_w = 450.0
    events = run(det, node, 8)
    assert len(events) == 1 and events[0][1].rule == "node_power>=400W"


class BenignLoad:
    """Every 15 min a job starts or stops (or not): CPU power +-20 %, temperature +-6 °C, memory +-8 %;
    the temperature drifts in between."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def __call__(self, n: FakeNode) -> None:
        if n.tick % 180 == 0:
            step = self.rng.choice((-1.0, 0.0, 1.0))
            n.temp = 55.0 + 6 * step
            n.avail = 0.6 - 0.08 * step
            n.package_w = 140.0 * (1 + 0.2 * step)
        n.temp += 0.002 * self.rng.choice((-1, 1))


def test_no_event_on_a_steady_node_for_six_hours() -> None:
    """6 h of 5 s scrapes: sensor noise, a slow drift and benign load steps (a job starts or stops every
    ~15 min: CPU power +-20 %, temperature +-6 °C, memory +-8 %)."""
    for kepler in ("0.10", "0.7"):
        det, node = Detector(AnomalyConfig(), 5.0), FakeNode(seed=14, kepler=kepler)
        assert run(det, node, 6 * 720, BenignLoad(random.Random(3))) == []
        assert det.node is not None and det.node.score < 8.4


def test_no_event_on_the_simulators_node() -> None:
    from edge_relay.collect.parse import parse as parse_exposition
    from edge_relay.collect.shape import TargetShaper
    from simulator import Simulator

    exporters = ("node", "kepler", "kepler-0.7")
    sim = Simulator(5, exporters=exporters)
    shapers = {e: TargetShaper(e, {"job": e, "instance": e}, {}) for e in exporters}
    det = Detector(AnomalyConfig(), 5.0)
    for tick in range(150):
        ts = T0 + tick * STEP_MS
        raw = [shapers[e].shape(ts, parse_exposition(sim.render(e, tick)), 0.01) for e in exporters]
        assert det.observe(raw, ts) == [], tick
    assert det.node is not None and det.node.series
    assert all(is_node_series(metric_name(ls)) for ls in det.node.series)


# --- the window -----------------------------------------------------------------------------------


def test_the_window_holds_exactly_the_node_level_series_and_closes() -> None:
    det, node = Detector(AnomalyConfig(post_seconds=30), 5.0), FakeNode()
    run(det, node, 30)
    _, raw = FakeNode().scrapes()
    node_series = {
        ls for x in raw for ls in x.labels if metric_name(ls).startswith(("node_", "kepler_node_"))
    }
    node_series -= {ls for ls in node_series if "_gpu_" in metric_name(ls)}  # the GPU's, Kepler's view
    assert det.override == frozenset() and det.active_windows(node.tick * STEP_MS + T0) == []
    node.avail = 0.02
    events = run(det, node, 3)
    assert [e.gpu for _, e in events] == ["node"]
    ev = events[0][1]
    now = T0 + (node.tick - 1) * STEP_MS
    assert det.active_windows(now) == ["node"]
    assert det.override == node_series
    names = {metric_name(ls) for ls in det.override}
    assert "kepler_node_gpu_watts" not in names and not any(n.startswith("DCGM_") for n in names)
    match = det.match(ev.gpu)
    assert all(match(ls) for ls in node_series)
    assert not any(match(ls) for x in raw for ls in x.labels if ls not in node_series)
    fields = status_fields(det, now)
    assert (fields["anomaly_events"], fields["anomaly_windows"], fields["anomaly_open"]) == (1, 1, "node")
    assert fields["anomaly_last"].startswith("gpu=node kind=memory rule=node_mem_available<=0.05")
    # Still low: the window follows the last detection; then 30 s after it, closed.
    run(det, node, 4)
    assert det.node is not None and det.node.window_end_ms == T0 + (node.tick - 1) * STEP_MS + 30_000
    node.avail = 0.6
    run(det, node, 7)
    assert det.override == frozenset()
    assert det.active_windows(T0 + (node.tick - 1) * STEP_MS) == []
    assert det.events_total == 1


def test_a_node_window_and_a_gpu_window_together() -> None:
    det, node = Detector(AnomalyConfig(score="none", max_windows=2), 5.0), FakeNode()
    run(det, node, 30)
    node.avail = 0.02
    run(det, node, 2)
    ts, raw = node.scrapes()
    dcgm = raw[2]
    xid = ShapedScrape(
        "dcgm", ts, [*dcgm.labels, lab("DCGM_FI_DEV_XID_ERRORS", gpu="0")], array("d", [*dcgm.values, 94])
    )
    events = det.observe([raw[0], raw[1], xid], ts)
    assert [(e.gpu, e.kind) for e in events] == [("dcgm:0", "xid")]
    assert sorted(det.active_windows(ts)) == ["dcgm:0", "node"]
    assert any(metric_name(ls) == "kepler_node_gpu_watts" for ls in det.override)  # the GPU's part
    assert any(metric_name(ls) == "node_load1" for ls in det.override)  # the node's part


def test_disabled_node_detection_ignores_the_node_series() -> None:
    det, node = Detector(AnomalyConfig(node=NodeConfig(enabled=False)), 5.0), FakeNode()
    node.avail = 0.01
    assert run(det, node, 40) == [] and det.node is None
    det = Detector(AnomalyConfig(), 5.0)
    det.set_config(AnomalyConfig(enabled=False))  # the dry run: detects, opens nothing
    assert run(det, FakeNode(), 5, lambda n: setattr(n, "avail", 0.01)) == []
    assert det.override == frozenset()
    det.set_config(AnomalyConfig(node=NodeConfig(enabled=False)))
    assert det.node is None


# --- configuration --------------------------------------------------------------------------------

BASE = {"version": 1, "uplink": {"sustained_bytes_per_second": 2000}, "classes": [{"name": "all"}]}


def test_node_config_defaults_and_overrides() -> None:
    cfg = parse({**BASE, "anomaly": {}}, "b").anomaly
    assert cfg is not None and cfg.node == NodeConfig()
    th = cfg.node.thresholds
    assert (th.temp_c, th.temp_slope_c, th.slope_seconds, th.memory_available_fraction) == (90, 6, 30, 0.05)
    assert (th.memory_stall_share, th.power_watts, th.power_jump_fraction) == (0.1, None, 0.5)
    doc = {
        **BASE,
        "anomaly": {
            "node": {
                "score_threshold": 5,
                "thresholds": {"temp_c": 80, "power_watts": 600, "memory_stall_share": None},
            }
        },
    }
    cfg = parse(doc, "b").anomaly
    assert cfg is not None and cfg.node.score_threshold == 5
    assert (cfg.node.thresholds.temp_c, cfg.node.thresholds.power_watts) == (80, 600)
    assert cfg.node.thresholds.memory_stall_share is None
    cfg = parse({**BASE, "anomaly": {"node": {"enabled": False}}}, "b").anomaly
    assert cfg is not None and not cfg.node.enabled


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        ({"thresholds": {"temp": 80}}, ["unknown key `temp` under `anomaly.node.thresholds`"]),
        ({"thresholds": {"memory_available_fraction": 1}}, ["node.thresholds.memory_available_fraction"]),
        ({"thresholds": {"temp_c": None}}, ["anomaly.node.thresholds.temp_c"]),
        ({"enable": True}, ["unknown key `enable` under `anomaly.node`"]),
    ],
)  # fmt: skip
def test_node_config_errors(tmp_path: Path, node: Any, expected: list[str]) -> None:
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump({**BASE, "anomaly": {"node": node}}))
    with pytest.raises(ConfigError) as err:
        load(path)
    for part in expected:
        assert part in str(err.value), f"{part!r} not in {err.value}"


# --- in the relay's cycle -------------------------------------------------------------------------


def node_body(avail: float) -> str:
    total = 64 * GIB
    return (
        "# TYPE node_memory_MemTotal_bytes gauge\n"
        f"node_memory_MemTotal_bytes {total}\n"
        "# TYPE node_memory_MemAvailable_bytes gauge\n"
        f"node_memory_MemAvailable_bytes {round(total * avail)}\n"
        'node_hwmon_temp_celsius{chip="platform_coretemp_0",sensor="temp1"} 55\n'
    )


@pytest.fixture
def exporters() -> Iterator[Any]:
    from testkit.exporters import ScriptedExporter

    with ScriptedExporter(bodies={"node": node_body(0.6), "app": "app_gauge 1\n"}) as ex:
        yield ex


def open_relay(tmp_path: Path, exporters: Any, budget: str) -> Any:
    """A relay on the scripted exporters, its uplink never started (as test_relay_cycles.py)."""
    from edge_relay import settings as relay_settings
    from edge_relay.app import Relay
    from edge_relay.selfmetrics import RelayMetrics

    (tmp_path / "budget.yaml").write_text(budget)
    targets = ", ".join(f"{{name: {n}, url: '{exporters.url_of(n)}'}}" for n in ("node", "app"))
    config = tmp_path / "relay.yaml"
    config.write_text(
        "node: n1\ncluster: c1\nscrape: {interval_seconds: 1, timeout_seconds: 0.8}\n"
        f"targets: [{targets}]\nspool: {{path: {tmp_path / 'spool.db'}}}\n"
        "mqtt: {port: 9}\nmetrics: {listen: ''}\nbudget_file: budget.yaml\n"
    )
    return Relay(relay_settings.load(str(config)), RelayMetrics())


def close(relay: Any) -> None:
    relay.collector.pool.shutdown(wait=True)
    for loop in relay.collector.loops:
        loop.scraper.close()
    relay.spool.close()


COARSE_BUDGET = """version: 1
uplink: {sustained_bytes_per_second: 100000, batch_window_seconds: 1}
classes: [{name: rest, resolution_seconds: 300}]
anomaly: {pre_seconds: 0, post_seconds: 60}
"""


def test_relay_cycle_sends_the_node_series_at_full_resolution_in_the_window(
    tmp_path: Path, exporters: Any
) -> None:
    from prometheus_client import generate_latest

    from schemas import codec

    relay = open_relay(tmp_path, exporters, COARSE_BUDGET)

    def sent() -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in relay.spool.batches.pending(10_000):
            batch = codec.decode_batch(row.payload)
            for block in batch.scrapes:
                for idx in block.series:
                    name = dict(batch.labelsets[idx])["__name__"]
                    counts[name] = counts.get(name, 0) + 1
        return counts

    try:
        for _ in range(3):
            relay.cycle()
            time.sleep(0.02)
        before = sent()
        assert before == {}  # coarse: 300 s, nothing out yet
        exporters.bodies["node"] = node_body(0.02)  # the node runs out of memory
        for _ in range(5):
            relay.cycle()
            time.sleep(0.02)
        after = sent()
        det = relay.budget.anomaly if relay.budget is not None else None
        assert det is not None and det.events_total == 1 and det.last_event is not None
        assert det.last_event.gpu == "node"
        # Detected on the 2nd low scrape: that cycle and the 3 after it at full resolution, plus the
        # coarse sample whose aggregation window the override closed.
        for name in (
            "node_memory_MemAvailable_bytes",
            "node_memory_MemTotal_bytes",
            "node_hwmon_temp_celsius",
        ):
            assert after.get(name) == 5, after
        assert "app_gauge" not in after  # the other series stay coarse
        text = generate_latest(relay.metrics.registry).decode()
        assert (
            'edge_relay_anomaly_events_total{gpu="node",kind="memory",rule="node_mem_available<=0.05"} 1.0'
            in text
        )
        assert 'edge_relay_anomaly_window_active{gpu="node"} 1.0' in text
        assert 'edge_relay_anomaly_score{gpu="node",vendor="node"} 0.0' in text  # still warming up
    finally:
        close(relay)
