"""The GPU rules on AMD, Intel and Jetson exporters (the simulator's), as measured by
``bench/anomaly_bench.py --vendor``: each vendor's incident is caught on its GPU, an incident-free hour
raises nothing, and the mappings the bench found wrong stay right (Jetson's GPU memory and clock, AMD's
violation residency, counters compared without the workload's labels)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from edge_relay.anomaly.detector import AnomalyConfig, Detector, Event
from edge_relay.anomaly.signals import take
from edge_relay.collect.parse import parse as parse_exposition
from edge_relay.collect.shape import ShapedScrape, TargetShaper
from simulator import Simulator
from simulator.incidents import Incident

T0 = 1_800_000_000_000
INTERVAL_S = 5.0


def cycles(sim: Simulator, exporter: str, ticks: range) -> Iterator[tuple[int, int, list[ShapedScrape]]]:
    shaper = TargetShaper(exporter, {"job": exporter, "instance": exporter}, {})
    for tick in ticks:
        ts = T0 + round(tick * INTERVAL_S * 1000)
        yield tick, ts, [shaper.shape(ts, parse_exposition(sim.render(exporter, tick)), 0.01)]


def events(vendor: str, incidents: list[Incident], ticks: int, seed: int = 7) -> list[tuple[int, Event]]:
    sim = Simulator(seed, exporters=(vendor,), incidents=incidents)
    cfg = AnomalyConfig(presets=(vendor,))
    det = Detector(cfg, INTERVAL_S)
    out: list[tuple[int, Event]] = []
    for tick, ts, raw in cycles(sim, vendor, range(ticks)):
        out += [(tick, ev) for ev in det.observe(raw, ts)]
    return out


@pytest.mark.parametrize(
    ("vendor", "kind"),
    [("amd", "thermal"), ("amd", "powercap"), ("amd", "memleak"), ("intel", "thermal"),
     ("intel", "memleak"), ("jetson", "thermal"), ("jetson", "memleak")],
)  # fmt: skip
def test_the_incident_is_caught_on_its_gpu(vendor: str, kind: str) -> None:
    start = 80
    on: dict[int, set[str]] = {}
    for gpu in (0, 1) if vendor != "jetson" else (0,):
        got = events(vendor, [Incident(kind, gpu, start, 60)], start + 60)
        assert got, f"no event for {kind} on {vendor} GPU {gpu}"
        assert min(tick for tick, _ in got) >= start, f"an event before the incident: {got[0][1].describe()}"
        on[gpu] = {ev.gpu for _, ev in got}
        assert len(on[gpu]) == 1, f"events on other GPUs too: {on[gpu]}"
    if len(on) == 2:
        assert on[0] != on[1], "the incident's GPU is not the one the events name"


@pytest.mark.parametrize("vendor", ["amd", "intel", "jetson"])
def test_an_incident_free_hour_raises_nothing(vendor: str) -> None:
    got = events(vendor, [], 720)
    assert not got, [ev.describe() for _, ev in got[:3]]


class _Gpu:
    prev_xid = 0.0

    def __init__(self) -> None:
        self.prev_status: dict[Any, float] = {}
        self.prev_counters: dict[Any, float] = {}


def test_jetson_reads_gpu_memory_and_the_frequency_not_its_bounds() -> None:
    x: dict[str, float] = {}
    g = _Gpu()
    for name, labels, value in (
        ("gpuram_kB", (("nvidia_gpu", "mem"), ("statistic", "gpu")), 812_000.0),
        ("gpu_utilization_percentage_Hz", (("nvidia_gpu", "freq"),), 612_000.0),
        ("gpu_utilization_percentage_Hz", (("nvidia_gpu", "max_freq"),), 1_020_000.0),
        ("gpu_utilization_percentage_Hz", (("nvidia_gpu", "min_freq"),), 306_000.0),
    ):
        take(g, "jetson", name, labels, value, x, [])
    assert x == {"fb": 812_000.0, "clock": 612_000.0}


def test_amd_violation_residency_is_a_signal_the_worst_reason_wins() -> None:
    x: dict[str, float] = {}
    g = _Gpu()
    take(g, "amd", "gpu_violation_ppt_residency_percentage", (("gpu_id", "0"),), 61.0, x, [])
    take(g, "amd", "gpu_violation_socket_thermal_residency_percentage", (("gpu_id", "0"),), 3.0, x, [])
    assert x == {"violation": 61.0}


def test_a_counter_is_compared_without_the_pod_on_the_gpu() -> None:
    g = _Gpu()
    name = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
    first = (("gpu", "0"), ("pod", "a"))
    second = (("gpu", "0"), ("pod", "b"))
    fired: list[tuple[str, str]] = []
    take(g, "dcgm", name, first, 5.0, {}, fired)
    take(g, "dcgm", name, second, 5.0, {}, fired)
    take(g, "dcgm", name, first, 5.0, {}, fired)  # pod a back on the GPU: same count, no event
    assert fired == []
    take(g, "dcgm", name, second, 6.0, {}, fired)
    assert fired == [("ecc", "ecc_sbe")]
