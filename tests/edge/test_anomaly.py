"""Anomaly detection (``edge_relay.anomaly.detector``) and the full-resolution windows it opens.

- the detectors on simulator series with injected incidents: each kind on the right GPU within a
  bound, nothing on an incident-free hour with the simulator's default churn;
- the budget file's ``anomaly`` section: defaults, overrides, errors;
- the override in ``BudgetShaper``: the windowed GPU at full resolution, bit-exact, the other GPU
  shaped as before;
- the past part from the flight recorder through the sink, and the status / fleet fields;
- the issue's proof on real mosquitto and Prometheus (``test_thermal_runaway_end_to_end``).
"""

from __future__ import annotations

import re
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from edge_relay.anomaly.detector import AnomalyConfig, Detector, Event, status_fields
from edge_relay.anomaly.pastparts import PastParts
from edge_relay.budget.model import ConfigError, load, parse
from edge_relay.budget.shaper import BudgetShaper
from edge_relay.collect.parse import parse as parse_exposition
from edge_relay.collect.shape import ShapedScrape, TargetShaper
from schemas.model import Labels, metric_name
from simulator import Simulator
from simulator.incidents import Incident

T0 = 1_800_000_000_000
INTERVAL_S = 5.0


Cycle = tuple[int, int, list[ShapedScrape]]


def scrapes(
    sim: Simulator, exporters: tuple[str, ...], ticks: range, interval_s: float = INTERVAL_S
) -> Iterator[Cycle]:
    shapers = {e: TargetShaper(e, {"job": e, "instance": e}, {}) for e in exporters}
    for tick in ticks:
        ts = T0 + round(tick * interval_s * 1000)
        yield tick, ts, [shapers[e].shape(ts, parse_exposition(sim.render(e, tick)), 0.01) for e in exporters]


def detect(
    incidents: list[Incident], ticks: int, cfg: AnomalyConfig | None = None, seed: int = 7
) -> list[tuple[int, Event]]:
    sim = Simulator(seed, exporters=("dcgm", "kepler"), incidents=incidents, dcgm_health_fields=True)
    det = Detector(cfg or AnomalyConfig(), INTERVAL_S)
    out = []
    for tick, ts, raw in scrapes(sim, ("dcgm", "kepler"), range(ticks)):
        out += [(tick, ev) for ev in det.observe(raw, ts)]
    return out


# --- the detectors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "bound_ticks", "rules_only_kind"),
    [("thermal", 2, "thermal"), ("xid", 1, "xid"), ("powercap", 3, "power"), ("memleak", 14, "memory")],
)
def test_each_incident_is_detected_on_its_gpu(kind: str, bound_ticks: int, rules_only_kind: str) -> None:
    start = 150
    for cfg in (AnomalyConfig(), AnomalyConfig(score="none")):
        events = detect([Incident(kind, 1, start, 48)], start + 60, cfg)
        assert events, f"{kind} not detected ({cfg.score})"
        tick, ev = events[0]
        assert ev.gpu == "dcgm:1", events
        assert start <= tick <= start + bound_ticks, (kind, tick)
        assert all(e.gpu == "dcgm:1" for _, e in events), events
        assert ev.opened and ev.window_end_ms == T0 + tick * 5000 + 300_000
        if cfg.score == "none":
            assert ev.kind == rules_only_kind, ev


def test_no_detection_on_an_incident_free_hour() -> None:
    # 720 scrapes of 5 s with the simulator's default churn (pods come and go on the GPUs).
    assert detect([], 720) == []


def test_one_event_per_window_and_the_window_follows_the_last_detection() -> None:
    events = detect([Incident("thermal", 0, 100, 60)], 200)
    assert [e.gpu for _, e in events] == ["dcgm:0"]  # fires every scrape of the incident: one onset
    sim = Simulator(
        7, exporters=("dcgm",), incidents=[Incident("thermal", 0, 100, 60)], dcgm_health_fields=True
    )
    det = Detector(AnomalyConfig(post_seconds=30), INTERVAL_S)
    ends = []
    for _, ts, raw in scrapes(sim, ("dcgm",), range(200)):
        det.observe(raw, ts)
        ends.append(det.gpus["dcgm:0"].window_end_ms if "dcgm:0" in det.gpus else 0)
    assert max(ends) > T0 + 150 * 5000  # extended while the rules keep firing (thermal holds at 88 °C)
    assert det.events_total == 1
    assert det.active_windows(T0 + 199 * 5000) == []


def test_max_windows_bounds_the_windows_not_the_events() -> None:
    incidents = [Incident("xid", 0, 60, 24), Incident("xid", 1, 70, 24)]
    events = detect(incidents, 100, AnomalyConfig(max_windows=1))
    assert [(e.gpu, e.opened) for _, e in events] == [("dcgm:0", True), ("dcgm:1", False)]


def test_a_steady_condition_closes_its_window_at_the_longest_and_frees_the_slot() -> None:
    """Four GPUs simply holding 97.5 % of their memory fire the memory rule every scrape. Their windows
    close at max_window_seconds and stay closed while it lasts, so an XID on another GPU two hours later
    still opens a window (before, all four held the max_windows slots for ever)."""
    interval_ms = 5000

    def labels(name: str, gpu: int) -> Labels:
        return tuple(sorted({"__name__": name, "gpu": str(gpu), "job": "dcgm", "instance": "x"}.items()))

    def cycle(tick: int, xid_gpu: int | None) -> list[ShapedScrape]:
        names: list[Labels] = []
        values = array("d")
        for g in range(8):
            used = 78_000.0 if g < 4 else 20_000.0
            for name, v in (
                ("DCGM_FI_DEV_GPU_TEMP", 60.0 + (tick % 3) * 0.1),
                ("DCGM_FI_DEV_POWER_USAGE", 200.0),
                ("DCGM_FI_DEV_FB_USED", used),
                ("DCGM_FI_DEV_FB_FREE", 80_000.0 - used),
                ("DCGM_FI_DEV_XID_ERRORS", 79.0 if g == xid_gpu else 0.0),
            ):
                names.append(labels(name, g))
                values.append(v)
        return [ShapedScrape("dcgm", T0 + tick * interval_ms, names, values)]

    cfg = AnomalyConfig(score="none", max_window_seconds=600)
    det = Detector(cfg, interval_ms / 1000)
    ticks = 2 * 3600 * 1000 // interval_ms
    events = []
    for t in range(ticks):
        events += det.observe(cycle(t, 5 if t >= ticks - 5 else None), T0 + t * interval_ms)
    now = T0 + (ticks - 1) * interval_ms
    steady = [e for e in events if e.gpu in {f"dcgm:{g}" for g in range(4)}]
    assert len(steady) == 4 and all(e.opened for e in steady)  # one window each, never reopened
    assert all(det.gpus[f"dcgm:{g}"].window_end_ms <= T0 + 600_000 for g in range(4))
    (xid,) = [e for e in events if e.gpu == "dcgm:5"]
    assert xid.opened and det.active_windows(now) == ["dcgm:5"]


def test_disabled_detects_but_opens_no_window() -> None:
    sim = Simulator(7, exporters=("dcgm",), incidents=[Incident("xid", 1, 30, 24)], dcgm_health_fields=True)
    det = Detector(AnomalyConfig(), INTERVAL_S)
    det.set_config(AnomalyConfig(enabled=False))
    for _, ts, raw in scrapes(sim, ("dcgm",), range(40)):
        assert det.observe(raw, ts) == []
        assert det.override == frozenset()


def test_override_holds_the_gpus_series_only() -> None:
    sim = Simulator(
        7, exporters=("dcgm", "kepler"), incidents=[Incident("xid", 1, 5, 24)], dcgm_health_fields=True
    )
    det = Detector(AnomalyConfig(), INTERVAL_S)
    for _, ts, raw in scrapes(sim, ("dcgm", "kepler"), range(8)):
        det.observe(raw, ts)
    assert det.override
    own = {ls for ls in det.override if "gpu" in dict(ls)}
    assert all(dict(ls)["gpu"] == "1" for ls in own)
    names = {metric_name(ls) for ls in own}
    assert "DCGM_FI_DEV_GPU_TEMP" in names and "DCGM_FI_DEV_XID_ERRORS" in names
    assert "kepler_node_gpu_watts" in names
    # Kepler's GPU series of the pod dcgm names on GPU 1 (its pod, container and process), no other pod's.
    pod = next(dict(ls)["pod"] for ls in own if metric_name(ls) == "DCGM_FI_DEV_GPU_TEMP")
    workload = det.override - own
    kinds = {metric_name(ls).split("_")[1] for ls in workload}
    assert kinds == {"pod", "container", "process"}, sorted(metric_name(ls) for ls in workload)
    pod_ids = {dict(ls)["pod_id"] for ls in workload if metric_name(ls).startswith("kepler_pod_")}
    assert all(dict(ls)["pod_name"] == pod for ls in workload if metric_name(ls).startswith("kepler_pod_"))
    assert all(
        dict(ls)["pod_id"] in pod_ids for ls in workload if metric_name(ls).startswith("kepler_container_")
    )
    match = det.match("dcgm:1")
    assert all(match(ls) for ls in det.override)


# --- configuration --------------------------------------------------------------------------------

BASE = {
    "version": 1,
    "uplink": {"sustained_bytes_per_second": 2000},
    "classes": [{"name": "gpu", "preset": "dcgm", "resolution_seconds": 300}],
}


def budget(anomaly: Any = None, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {**BASE, **extra}
    if anomaly is not None:
        doc["anomaly"] = anomaly
    return doc


def test_no_section_no_detection() -> None:
    assert parse(budget(), "b.yaml").anomaly is None


def test_defaults_and_overrides() -> None:
    cfg = parse(budget({}), "b.yaml").anomaly
    assert cfg is not None
    assert (cfg.enabled, cfg.presets, cfg.score, cfg.pre_seconds, cfg.post_seconds) == (
        True, ("dcgm",), "ewma", 120.0, 300.0,
    )  # fmt: skip
    assert (cfg.reserved_share, cfg.max_windows, cfg.score_threshold) == (0.2, 4, 8.4)
    assert cfg.thresholds["dcgm"].gpu_temp_c == 85 and cfg.thresholds["amd"].gpu_temp_c == 95
    cfg = parse(
        budget({"thresholds": {"gpu_temp_c": 80, "power_limit": 250}, "presets": ["dcgm", "amd"]}), "b"
    ).anomaly
    assert cfg is not None and cfg.presets == ("dcgm", "amd")
    assert cfg.thresholds["dcgm"].gpu_temp_c == 80 and cfg.thresholds["amd"].power_limit == 250
    # Without a GPU preset in the classes: every vendor's rules.
    doc = budget({}, classes=[{"name": "all"}])
    cfg = parse(doc, "b").anomaly
    assert cfg is not None and cfg.presets == ("dcgm", "amd", "intel", "jetson")


@pytest.mark.parametrize(
    ("anomaly", "expected"),
    [
        ({"pre_second": 10}, ["unknown key `pre_second` under `anomaly`", "pre_seconds"]),
        ({"pre_seconds": -1}, ["anomaly.pre_seconds", "-1"]),
        ({"reserved_share": 1}, ["anomaly.reserved_share"]),
        ({"reserved_share": 0}, ["anomaly.reserved_share"]),
        ({"max_windows": 0}, ["anomaly.max_windows"]),
        ({"max_window_seconds": 0}, ["anomaly.max_window_seconds"]),
        ({"presets": ["nvidia"]}, ["anomaly.presets[0]"]),
        ({"score": "hst"}, ["anomaly.score"]),
        ({"thresholds": {"gpu_temp": 80}}, ["unknown key `gpu_temp` under `anomaly.thresholds`"]),
        ({"thresholds": {"power_fraction": 2}}, ["anomaly.thresholds.power_fraction"]),
        ({"pre_seconds": 0, "post_seconds": 0}, ["anomaly.post_seconds", "pre_seconds + post_seconds > 0"]),
        ("on", ["anomaly", "object"]),
    ],
)
def test_config_errors(tmp_path: Path, anomaly: Any, expected: list[str]) -> None:
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump(budget(anomaly)))
    with pytest.raises(ConfigError) as err:
        load(path)
    message = str(err.value)
    assert str(path) in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


# --- the override in the shaper -------------------------------------------------------------------


def test_shaper_override_full_resolution_for_that_gpu_only() -> None:
    doc = budget(
        {},
        classes=[
            {
                "name": "gpu",
                "preset": "dcgm",
                "resolution_seconds": 60,
                "degrade": {"max_resolution_seconds": 300},
            },
            {"name": "rest", "resolution_seconds": 30},
        ],
    )
    b = parse(doc, "b")
    ref, shaper = BudgetShaper(b, INTERVAL_S), BudgetShaper(b, INTERVAL_S)
    ref.set_level(0, 3)
    shaper.set_level(0, 3)  # 300 s: what the controller degrades GPU detail to
    sim = Simulator(3, exporters=("dcgm",), churn_ticks=0)
    gpu1: set[Labels] = set()
    sent: dict[Labels, list[tuple[int, float]]] = {}
    sent_ref: dict[Labels, list[tuple[int, float]]] = {}
    raw_gpu1: list[tuple[Labels, int, float]] = []
    for tick, ts, (raw,) in scrapes(sim, ("dcgm",), range(120)):
        if tick == 40:  # a window opens on GPU 1 for 40 scrapes
            gpu1 = {ls for ls in raw.labels if dict(ls).get("gpu") == "1"}
            shaper.override = frozenset(gpu1)
        if tick == 80:
            shaper.override = frozenset()
        if 40 <= tick < 80:
            raw_gpu1 += [(ls, ts, v) for ls, v in zip(raw.labels, raw.values, strict=True) if ls in gpu1]
        for sh, out in ((shaper, sent), (ref, sent_ref)):
            for o in (sh.shape(raw), sh.flush(ts)):
                if o is None:
                    continue
                stamps = o.timestamps or [o.timestamp_ms] * len(o)
                for ls, t, v in zip(o.labels, stamps, o.values, strict=True):
                    out.setdefault(ls, []).append((t, v))
    assert gpu1 and raw_gpu1
    # Every raw sample of GPU 1 in the window went out, at its own timestamp, bit-exact.
    for ls, t, v in raw_gpu1:
        assert (t, v) in sent[ls], (metric_name(ls), t)
    # GPU 0 (and GPU 1 outside the window) shaped exactly as without the override.
    for ls, samples in sent_ref.items():
        if ls in gpu1:
            outside = [s for s in sent[ls] if not T0 + 40 * 5000 <= s[0] < T0 + 80 * 5000]
            assert (
                len(outside) <= len([s for s in samples if not T0 + 40 * 5000 <= s[0] < T0 + 80 * 5000]) + 2
            )
            continue
        assert sent[ls] == samples, metric_name(ls)
    assert shaper.override_samples == len(raw_gpu1)
    st = shaper.stats[0]
    # Each series' window samples are sent once: nothing lost, nothing counted twice.
    assert st.samples_in >= st.samples_out + st.suppressed + st.merged


def test_empty_override_is_the_shaper_unchanged() -> None:
    b = parse(budget({}), "b")
    a, c = BudgetShaper(b, INTERVAL_S), BudgetShaper(b, INTERVAL_S)
    c.override = frozenset()
    sim = Simulator(3, exporters=("dcgm",), churn_ticks=0)
    for _, _ts, (raw,) in scrapes(sim, ("dcgm",), range(30)):
        x, y = a.shape(raw), c.shape(raw)
        assert (x.labels, list(x.values), x.timestamps) == (y.labels, list(y.values), y.timestamps)


# --- past part and status -------------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []

    def read(self, start_ms: int, end_ms: int, match: Any) -> Any:
        from edge_relay.recorder.flight import Gap, Readout

        self.reads.append((start_ms, end_ms))
        batches = [_Batch(100), _Batch(100), _Batch(100)]
        return Readout(
            start_ms,
            end_ms,
            (start_ms + 1000, end_ms),
            [Gap(start_ms, start_ms + 999, "older_than_recorder")],
            iter(batches),
        )  # type: ignore[arg-type]


class _Batch:
    def __init__(self, n: int) -> None:
        self.sample_count = n


class _Sink:
    def __init__(self) -> None:
        self.batches: list[Any] = []

    def append(self, batch: Any) -> bytes:
        self.batches.append(batch)
        return bytes(1000)  # the payload spooled


def test_past_part_is_paced_and_reports_what_is_missing() -> None:
    rec, sink = _Recorder(), _Sink()
    past = PastParts(rec, sink, interval_s=1.0)
    ev = Event("dcgm:1", "thermal", "temp_slope", T0, 3.0, T0 + 300_000)
    past.start(ev, lambda ls: True, 120, T0)
    assert rec.reads == []  # read at the first step: after the event's scrape is recorded
    # 2000 B/s x 0.25 x 1 s = 500 B a cycle: a 1000 B batch, then a cycle of rest to pay for it.
    assert past.step(2000, 0.25) == (100, 1000)
    assert rec.reads == [(T0 - 120_000, T0)]
    assert "older_than_recorder" in ev.missing
    assert past.step(2000, 0.25) == (0, 0)
    assert past.step(2000, 0.25) == (100, 1000)  # 1000 B every other cycle: 500 B/s
    assert past.step(2000, 0.25) == (0, 0)
    while past.pending:
        past.step(2000, 0.25)
    assert len(sink.batches) == 3


def test_status_fields_are_flat_and_decodable() -> None:
    from schemas.codec.control import decode_status, encode_status

    sim = Simulator(7, exporters=("dcgm",), incidents=[Incident("xid", 1, 5, 24)], dcgm_health_fields=True)
    det = Detector(AnomalyConfig(), INTERVAL_S)
    for _, ts, raw in scrapes(sim, ("dcgm",), range(8)):
        det.observe(raw, ts)
    fields = status_fields(det, T0 + 8 * 5000)
    assert fields["anomaly_events"] == 1 and fields["anomaly_windows"] == 1
    assert fields["anomaly_last_ms"] == T0 + 5 * 5000
    assert "gpu=dcgm:1 kind=xid" in fields["anomaly_last"]
    status = {"node": "n", "cluster": "c", "state": "online", "ts_ms": T0, **fields}
    assert decode_status(encode_status(status)) == {"v": 1, **status}


def test_fleet_shows_anomalies_per_node() -> None:
    from cloud_ingest.outcome.fleet import Fleet

    fleet = Fleet()
    now_ms = int(time.time() * 1000)
    fleet.observe_status(
        "c",
        "n",
        {"state": "online", "ts_ms": now_ms, "anomaly_events": 2, "anomaly_windows": 1,
         "anomaly_last_ms": now_ms - 1000, "anomaly_last": "gpu=dcgm:1 kind=thermal rule=temp_slope"},
    )  # fmt: skip
    view = fleet.get("c", "n")
    assert view is not None
    assert (view.anomaly_events, view.anomaly_windows) == (2, 1)
    assert view.anomaly_last_event == (now_ms - 1000) / 1000
    assert view.anomaly_last is not None and "thermal" in view.anomaly_last
    from prometheus_client import generate_latest

    from cloud_ingest.selfmetrics import IngestMetrics

    text = generate_latest(IngestMetrics(fleet=fleet).registry).decode()
    assert re.search(r'cloud_ingest_node_anomaly_events\{cluster="c",node="n"\} 2\.0', text), text


# --- the proof on real mosquitto and Prometheus ---------------------------------------------

NODE = "edge-gpu-01"
PRE_S, POST_S = 8, 8
RATE = 6000
BURST_S = 20
INCIDENT_AT, INCIDENT_FOR = 25, 12  # ticks of 1 s


@pytest.mark.timeout(240)
def test_thermal_runaway_end_to_end(tmp_path: Path, mosquitto: Any, prometheus: Any) -> None:
    """A budget that holds GPU detail at 300 s; a thermal runaway on GPU 1. Every raw sample of GPU 1's
    dcgm series from PRE_S before the event to POST_S after it is in Prometheus, bit-exact (past part
    from the flight recorder, live part exempt from the budget); GPU 0 stays coarse; the relay's wire
    bytes stay within burst + rate x elapsed, +5%."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    from testkit.oracle import expected_samples, read_served_log, same_value
    from testkit.stack import (
        EXPORTERS,
        SimulatorProcess,
        incident_budget,
        ingest_config,
        metrics_url,
        program,
        relay_config,
        write_yaml,
    )

    incident = Incident("thermal", 1, INCIDENT_AT, INCIDENT_FOR)
    sim = SimulatorProcess(
        tmp_path, seed=11, interval=1.0, churn_ticks=0, incidents=[incident], dcgm_health_fields=True
    ).start()
    budget_doc = incident_budget(
        rate=RATE,
        burst_seconds=BURST_S,
        gpu_resolution_seconds=300,
        anomaly={"pre_seconds": PRE_S, "post_seconds": POST_S, "reserved_share": 0.2},
    )
    budget_path = write_yaml(tmp_path / "budget.yaml", budget_doc)
    relay_cfg = relay_config(
        tmp_path,
        urls=sim.urls,
        mqtt_port=mosquitto.port,
        interval=1.0,
        budget_file=str(budget_path),
        recorder={"max_bytes": 50_000_000, "block_seconds": 5},
    )
    ingest_cfg = ingest_config(
        tmp_path, mqtt_port=mosquitto.port, remote_write_url=prometheus.remote_write_url
    )
    relay_metrics = metrics_url(relay_cfg)
    ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, tmp_path).start()
    relay = program("edge-relay", "edge_relay.cli", relay_cfg, tmp_path, "--drain-seconds", "60").start()
    started = time.monotonic()
    event = re.compile(r"anomaly: gpu=dcgm:(\d+) kind=(\w+) rule=(\S+) at_ms=(\d+)")
    worst = 0.0
    try:
        deadline = started + INCIDENT_AT + INCIDENT_FOR + POST_S + 20
        found: list[tuple[str, ...]] = []
        last_metrics = ""
        while time.monotonic() < deadline:
            try:
                text = requests.get(relay_metrics, timeout=2).text
            except requests.RequestException:
                text = ""
            wire = sum(
                s.value
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
                if s.name == "edge_relay_wire_bytes_total"
            )
            worst = max(worst, wire / (RATE * BURST_S + RATE * (time.monotonic() - started)))
            if text:
                last_metrics = text
            found = event.findall(relay.log_path.read_text())
            # Done once the window is over: POST_S after the incident ends (it fires while it lasts).
            if found and time.time() * 1000 > int(found[0][3]) + (INCIDENT_FOR + POST_S + 4) * 1000:
                break
            time.sleep(0.5)
        assert found, relay.log_tail()
        assert relay.alive(), relay.log_tail()
        assert relay.stop(timeout=120) == 0, relay.log_tail()
    finally:
        relay.kill()
        ingest.stop()
        sim.stop()
    assert worst <= 1.05, f"the relay's connection carried {worst:.3f}x the budget"
    assert {f[0] for f in found} == {"1"}, found  # one event, on GPU 1
    parts = {
        s.labels["part"]: s.value
        for fam in text_string_to_metric_families(last_metrics)
        for s in fam.samples
        if s.name == "edge_relay_anomaly_window_samples_total"
    }
    assert parts.get("past", 0) > 0 and parts.get("live", 0) > 0, parts  # both parts of the window
    assert re.search(
        r'edge_relay_anomaly_events_total\{gpu="1",kind="thermal",rule="temp_slope"\} 1\.0', last_metrics
    )
    at_ms = int(found[0][3])
    served = read_served_log(sim.served_log)
    instances = {name: f"{NODE}:{url.split(':')[2].split('/')[0]}" for name, url in sim.urls.items()}
    expected = expected_samples(
        sim.simulator, served, jobs={e: e for e in EXPORTERS}, instances=instances,
        extra={"cluster": "test", "node": NODE},
    )  # fmt: skip
    actual = prometheus.raw_samples('{job="dcgm"}', lookback="10m")
    ups = sorted(t for k, v in actual.items() if dict(k)["__name__"] == "up" for t, _ in v)
    assert ups, "no up series of dcgm in Prometheus"

    def scrape_time(t_served: int) -> int:
        # The relay stamps a sample with its scrape's start; the simulator logs when it answered.
        before = [t for t in ups if t <= t_served]
        assert before and t_served - before[-1] < 1000, t_served
        return before[-1]

    lo, hi = at_ms - PRE_S * 1000, at_ms + POST_S * 1000
    checked = coarse_gpu0 = raw_gpu0 = 0
    for key, samples in expected.items():
        labels = dict(key)
        if not labels["__name__"].startswith("DCGM_FI_"):
            continue
        have = dict(actual.get(key, []))
        if labels.get("gpu") == "1":
            for t_served, value in samples:
                t = scrape_time(t_served)
                if lo <= t <= hi:
                    assert t in have, (labels["__name__"], t, at_ms)
                    assert same_value(have[t], value), (labels["__name__"], t, have[t], value)
                    checked += 1
        else:
            raw_gpu0 += len(samples)
            coarse_gpu0 += len(have)
    assert checked >= (PRE_S + POST_S) * 20, checked  # ~16 s of every GPU 1 dcgm series
    # GPU 0 stayed coarse: a counter's first sample and the 300 s windows closed on shutdown.
    assert raw_gpu0 > 40 * 20 and coarse_gpu0 <= raw_gpu0 / 10, (coarse_gpu0, raw_gpu0)


def test_a_past_part_goes_in_batches_within_batch_max_bytes() -> None:
    """A recorder block holds block_seconds of cycles: the past part cuts it, as backfill does, so no
    message exceeds what the broker takes (batch.max_bytes)."""
    from edge_relay.encode.batches import BatchEncoder
    from schemas.model import Batch, ScrapeBlock

    labelsets = [
        tuple(sorted({"__name__": "DCGM_FI_DEV_GPU_TEMP", "gpu": str(g), "uuid": f"GPU-{g:032x}"}.items()))
        for g in range(200)
    ]
    blocks = [
        ScrapeBlock(
            T0 - 60_000 + k * 1000, array("I", range(200)), array("d", [k + g / 7 for g in range(200)])
        )
        for k in range(60)
    ]
    block = Batch("test", "n1", 0, labelsets, blocks)  # type: ignore[arg-type]
    encoder = BatchEncoder("test", "n1", max_bytes=4096)
    assert len(encoder.encode(block, 1)) > 4096
    rec = _Recorder()
    rec.read = lambda start, end, match: iter([block])  # type: ignore[method-assign]
    sink = _Sink()
    past = PastParts(rec, sink, interval_s=1.0, encoder=encoder)
    past.start(Event("dcgm:1", "thermal", "temp_slope", T0, 3.0, T0 + 300_000), lambda ls: True, 120, T0)
    while past.pending:
        past.step(1e9, 0.5)
    assert len(sink.batches) > 1
    assert all(len(encoder.encode(b, 1)) <= 4096 for b in sink.batches)
    assert sum(b.sample_count for b in sink.batches) == 60 * 200
