"""The GPU detector on real telemetry: the measured H200 trace (``simulator/data``) served as dcgm-exporter
4.x pages (``bench/anomaly_bench.py --real``), through the detector with the relay's defaults.

- no more than the allowed false events (one per GPU-hour) at 1 s and 5 s scrapes, although the trace's
  job heats the GPU by up to 17 °C in seconds, draws over twice an A100 PCIe's limit and holds the
  software power cap at full load;
- a thermal runaway injected on that real background is still caught, on its GPU;
- each model's own limits: the H200 gets its data sheet's 700 W, an unknown model is reported and learns
  its limit from what it draws, a served limit wins over the model's and a configured one over both.
"""

from __future__ import annotations

import dataclasses

import pytest

from edge_relay.anomaly.detector import LEARN_MARGIN, AnomalyConfig, Detector, status_fields
from edge_relay.anomaly.signals import DEFAULT_THRESHOLDS
from edge_relay.collect.parse import parse as parse_exposition
from edge_relay.collect.shape import TargetShaper
from testkit.gpu_replay import T0_MS, RealIncident, RealTrace, real_page, replay_real

ALLOWED_PER_GPU_HOUR = 1.0
GPUS = 4
TRACE = RealTrace()
DEFAULTS = AnomalyConfig(presets=("dcgm",))


@pytest.mark.parametrize(("interval_s", "minutes"), [(1.0, 15.0), (5.0, 30.0)])
def test_the_real_trace_raises_no_more_than_the_allowed_false_events(
    interval_s: float, minutes: float
) -> None:
    events, _ = replay_real(DEFAULTS, interval_s, minutes * 60, trace=TRACE)
    gpu_hours = GPUS * minutes / 60
    assert len(events) <= ALLOWED_PER_GPU_HOUR * gpu_hours, [ev.describe() for ev in events]


@pytest.mark.parametrize("interval_s", [1.0, 5.0])
def test_a_hotter_gpu_running_the_same_job_raises_nothing(interval_s: float) -> None:
    # 25 °C hotter (an air-cooled board at 60-78 °C): the bursts now heat it near the limit, where the
    # slope counts; the power explains each rise, and a burst sampled at its peak is a single scrape.
    hot = RealTrace()
    for row in hot.rows:
        row["gpu_temp"] += 25
    events, _ = replay_real(DEFAULTS, interval_s, 1800.0, trace=hot)
    assert events == [], [ev.describe() for ev in events]


@pytest.mark.parametrize("interval_s", [1.0, 5.0])
def test_a_thermal_runaway_on_the_real_trace_is_caught_on_its_gpu(interval_s: float) -> None:
    incident = RealIncident("thermal", 2, start=300.0, seconds=180.0)
    events, _ = replay_real(DEFAULTS, interval_s, 540.0, incident, trace=TRACE)
    assert events, "the thermal runaway was not caught"
    first = events[0]
    at_s = (first.at_ms - T0_MS) / 1000
    assert first.gpu == "dcgm:2" and first.kind == "thermal", first.describe()
    assert incident.start <= at_s <= incident.start + incident.seconds, first.describe()
    assert all(ev.gpu == "dcgm:2" for ev in events), [ev.describe() for ev in events]


def test_the_software_power_cap_at_full_load_is_no_fault_a_hardware_slowdown_is() -> None:
    # The trace holds 0x4 (SW power cap) most of every epoch: served, it raises nothing.
    events, _ = replay_real(DEFAULTS, 5.0, 600.0, health_fields=True, trace=TRACE)
    assert events == [], [ev.describe() for ev in events]
    incident = RealIncident("slowdown", 1, start=300.0, seconds=120.0)
    events, _ = replay_real(DEFAULTS, 5.0, 600.0, incident, health_fields=True, trace=TRACE)
    assert events and events[0].gpu == "dcgm:1" and events[0].rule == "throttle=0x8", events


def observe(pages: list[bytes], cfg: AnomalyConfig = DEFAULTS, interval_s: float = 5.0) -> Detector:
    shaper = TargetShaper("dcgm", {"job": "dcgm", "instance": "dcgm"}, {})
    det = Detector(cfg, interval_s)
    for tick, page in enumerate(pages):
        ts = T0_MS + round(tick * interval_s * 1000)
        det.observe([shaper.shape(ts, parse_exposition(page), 0.01)], ts)
    return det


def trace_pages(seconds: float, interval_s: float = 5.0, model: str = "NVIDIA H200") -> list[bytes]:
    pages = [real_page(TRACE, tick * interval_s, gpus=1) for tick in range(int(seconds / interval_s))]
    return [p.replace(b'modelName="NVIDIA H200"', f'modelName="{model}"'.encode()) for p in pages]


def test_the_h200_gets_its_own_power_limit_not_an_a100s() -> None:
    det = observe(trace_pages(60))
    g = det.gpus["dcgm:0"]
    assert g.limits is not None and g.limits.power_limit == 700
    assert g.unknown_model is None and "anomaly_unknown_models" not in status_fields(det, T0_MS)


def test_an_unknown_model_is_reported_and_learns_its_limit_from_what_it_draws() -> None:
    det = observe(trace_pages(300, model="NVIDIA Imaginary X1"))
    g = det.gpus["dcgm:0"]
    assert g.limits is None and status_fields(det, T0_MS)["anomaly_unknown_models"] == "NVIDIA Imaginary X1"
    assert g.power_limit(T0_MS + 300_000, None) is None  # too early: no other model's limit either
    det = observe(trace_pages(720, model="NVIDIA Imaginary X1"))
    g = det.gpus["dcgm:0"]
    learned = g.power_limit(T0_MS + 720_000, None)
    assert learned == pytest.approx(g.learned_max * LEARN_MARGIN) and 500 < g.learned_max <= 640
    assert g.power_limit(T0_MS + 720_000, 450.0) == 450.0  # a served limit wins over the learned one


def test_a_served_limit_wins_over_the_models_and_a_configured_one_over_both() -> None:
    g = observe(trace_pages(30)).gpus["dcgm:0"]
    assert g.power_limit(T0_MS, 500.0) == 500.0 and g.power_limit(T0_MS, None) == 700
    th = dict(DEFAULTS.thresholds)
    th["dcgm"] = dataclasses.replace(DEFAULT_THRESHOLDS["dcgm"], power_limit=400.0)
    g = observe(trace_pages(30), dataclasses.replace(DEFAULTS, thresholds=th)).gpus["dcgm:0"]
    assert g.power_limit(T0_MS, 500.0) == 400.0


def test_an_exporter_that_names_no_model_is_reported_too() -> None:
    pages = [p.replace(b'modelName="NVIDIA H200",', b"") for p in trace_pages(30)]
    det = observe(pages)
    assert det.gpus["dcgm:0"].limits is None
    assert status_fields(det, T0_MS)["anomaly_unknown_models"] == "(no modelName)"
