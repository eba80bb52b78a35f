"""The bandwidth budget end to end: simulator -> edge-relay (budget file) -> proxy -> mosquitto ->
cloud-ingest -> Prometheus, asserted on what Prometheus answers and on what the proxy counted.

Time is compressed: the simulator and the relay tick every second, so a 60 s PromQL range holds the
same 60 raw samples that ``rate(x[5m])`` sees at the product's 5 s interval.

- ``test_classes_shape_as_configured``: a budget with room to spare. The critical class arrives at full
  resolution, sample by sample; the 4x-downsampled Kepler counters give ``rate(x[60s])`` within 1% of
  the rate computed the same way from every raw sample the simulator served; a max-aggregated gauge
  carries the peak of each window exactly; an edited budget file is picked up without a restart.
- ``test_tight_budget_is_kept_on_the_wire``: a budget below what the configured classes produce. The
  bytes on the relay's broker connection (counted by an independent proxy) stay within
  ``burst + rate x elapsed`` + 5% over the whole run; the controller degrades the lowest class and
  only it; the critical class still arrives complete at full resolution.
"""

from __future__ import annotations

import bisect
import itertools
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from edge_relay.budget import PRESETS
from testkit.netfaults import LinkProxy
from testkit.oracle import compare, expected_samples, read_served_log
from testkit.services import Mosquitto, Prometheus, RawSamples, wait_until
from testkit.stack import (
    EXPORTERS,
    Program,
    SimulatorProcess,
    ingest_config,
    program,
    relay_config,
    write_yaml,
)

NODE = "edge-gpu-01"
WINDOW_S = 10
CRITICAL = "dcgm-critical"
PEAK_GAUGES = "DCGM_FI_PROF_(GR_ENGINE|PIPE_TENSOR|DRAM)_ACTIVE"
KEPLER_RES_S = 2
BURST_SECONDS = 20
COUNTERS = "kepler_.*_joules_total"
PEAK_RES_S = 4


def budget_doc(rate: int, *, rest_max: int = 0, rest_res: int = 0) -> dict[str, Any]:
    return {
        "version": 1,
        "uplink": {
            "sustained_bytes_per_second": rate,
            "burst_bytes": rate * BURST_SECONDS,
            "batch_window_seconds": WINDOW_S,
        },
        "classes": [
            {"name": "critical", "preset": CRITICAL},
            # up & co. at full resolution: their timestamps are the relay's scrape times.
            {"name": "health", "preset": "scrape-health"},
            {
                "name": "gpu-peaks",
                "match": [{"name": PEAK_GAUGES}],
                "resolution_seconds": PEAK_RES_S,
                "aggregation": "max",
            },
            {"name": "kepler", "preset": "kepler", "resolution_seconds": KEPLER_RES_S},
            {
                "name": "rest",
                "resolution_seconds": rest_res,
                **({"degrade": {"max_resolution_seconds": rest_max}} if rest_max else {}),
            },
        ],
    }


@dataclass
class Run:
    sim: SimulatorProcess
    relay: Program
    ingest: Program
    proxy: LinkProxy
    metrics_url: str
    budget_path: Path
    started: float = 0.0

    def relay_metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = requests.get(self.metrics_url, timeout=5).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = float(s.value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.relay_metrics().get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def stack(tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus) -> Iterator[Any]:
    runs: list[Run] = []

    def start(budget: dict[str, Any]) -> Run:
        sim = SimulatorProcess(tmp_path, seed=11, interval=1.0, churn_ticks=0).start()
        proxy = LinkProxy(mosquitto.port)
        budget_path = write_yaml(tmp_path / "budget.yaml", budget)
        relay_cfg = relay_config(
            tmp_path, urls=sim.urls, mqtt_port=proxy.port, interval=1.0, budget_file=str(budget_path)
        )
        ingest_cfg = ingest_config(
            tmp_path, mqtt_port=mosquitto.port, remote_write_url=prometheus.remote_write_url
        )
        listen = yaml.safe_load(relay_cfg.read_text())["metrics"]["listen"]
        ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, tmp_path).start()
        relay = program("edge-relay", "edge_relay.cli", relay_cfg, tmp_path, "--drain-seconds", "90").start()
        run = Run(sim, relay, ingest, proxy, f"http://{listen}/metrics", budget_path, time.monotonic())
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.relay.kill()
        run.ingest.stop()
        run.sim.stop()
        run.proxy.close()


def served_expectations(run: Run) -> dict[frozenset[tuple[str, str]], list[tuple[int, float]]]:
    served = read_served_log(run.sim.served_log)
    instances = {name: f"{NODE}:{url.split(':')[2].split('/')[0]}" for name, url in run.sim.urls.items()}
    return expected_samples(
        run.sim.simulator,
        served,
        jobs={e: e for e in EXPORTERS},
        instances=instances,
        extra={"cluster": "test", "node": NODE},
    )


def of_class(samples: RawSamples, pattern: str) -> RawSamples:
    rx = re.compile(pattern)
    return {k: v for k, v in samples.items() if rx.fullmatch(dict(k)["__name__"])}


def drain_and_check_critical(run: Run, prometheus: Prometheus) -> tuple[RawSamples, RawSamples]:
    """Stop the relay (it drains, paced), then: every critical sample served is in Prometheus at the
    scrape that fetched it. Returns (served, stored) of every series for further checks."""
    assert run.relay.alive(), run.relay.log_tail()
    assert run.relay.stop(timeout=150) == 0, run.relay.log_tail()
    expected = served_expectations(run)
    actual = prometheus.raw_samples('{job=~".+"}', lookback="10m")
    crit = "|".join(PRESETS[CRITICAL].names)
    problems = compare(of_class(expected, crit), of_class(actual, crit))
    assert not problems, "\n".join(problems[:20])
    assert sum(len(v) for v in of_class(expected, crit).values()) > 60 * 10
    return expected, actual


def scrape_times(actual: RawSamples, job: str) -> list[int]:
    """The relay's scrape timestamps of a target (its full-resolution ``up`` series)."""
    return sorted(
        t
        for k, v in actual.items()
        if dict(k).get("job") == job and dict(k)["__name__"] == "up"
        for t, _ in v
    )


def rebase(raw: list[tuple[int, float]], times: list[int]) -> list[tuple[int, float]]:
    """Served samples moved to the scrape that fetched them: the simulator answers a few ms (under
    load, hundreds of ms) after the relay's scrape timestamp, which is the one Prometheus stores."""
    out = []
    for t_served, v in raw:
        i = bisect.bisect_right(times, t_served) - 1
        assert i >= 0 and t_served - times[i] < 1000, (t_served, times[max(i, 0)])
        out.append((times[i], v))
    return out


def raw_rate(samples: list[tuple[int, float]], at_ms: int, range_ms: int) -> float | None:
    """The rate the raw samples in (at - range, at] say: their increase over the time they span."""
    window = [(t, v) for t, v in samples if at_ms - range_ms < t <= at_ms]
    if len(window) < 2:
        return None
    increase = window[-1][1] - window[0][1]
    increase += sum(a for (_, a), (_, b) in itertools.pairwise(window) if b < a)  # counter resets
    return increase / ((window[-1][0] - window[0][0]) / 1000)


@pytest.mark.timeout(400)
def test_classes_shape_as_configured(stack: Any, prometheus: Prometheus) -> None:
    run: Run = stack(budget_doc(200_000))
    time.sleep(75)
    # Reload: the rest class goes from every scrape to 8 s without a restart.
    write_yaml(run.budget_path, budget_doc(200_000, rest_res=8))
    wait_until(
        lambda: run.metric("edge_relay_budget_reloads_total", result="ok") >= 1,
        timeout=20,
        message="the relay reloads its edited budget file",
    )
    assert run.metric("edge_relay_budget_resolution_seconds", **{"class": "rest"}) == 8
    time.sleep(15)
    merged = run.metric("edge_relay_budget_samples_total", **{"class": "kepler", "outcome": "merged"})
    # 1. The critical class: every sample, at the scrape that fetched it.
    expected, actual = drain_and_check_critical(run, prometheus)

    # 2. Kepler counters, downsampled 2x: what Prometheus answers for rate(x[60s]) against the rate of
    #    the raw values the simulator served over the same range.
    assert merged > 0, "the kepler class must have merged samples"
    kepler_act = of_class(actual, COUNTERS)
    assert len(kepler_act) > 50
    for key, got in kepler_act.items():
        ratio = len(expected[key]) / len(got)
        assert 1.8 < ratio < 2.2, f"{dict(key)['__name__']}: {len(expected[key])} raw vs {len(got)} kept"
    newest = max(t for v in kepler_act.values() for t, _ in v)
    errors = []
    names = sorted({dict(k)["__name__"] for k in kepler_act})
    times = {job: scrape_times(actual, job) for job in ("kepler", "kepler-0.7")}
    worst: list[tuple[float, str, int, int]] = []
    for at in (newest - 3_000, newest - 11_000, newest - 23_000):
        for name in names:
            # rate() drops __name__, so one query per name keeps the answers apart.
            answer = prometheus.query(f"rate({name}[60s])", at=at / 1000)["result"]
            for series in answer:
                key = frozenset({**series["metric"], "__name__": name}.items())
                want = raw_rate(rebase(expected[key], times[dict(key)["job"]]), at, 60_000)
                if want:
                    err = abs(float(series["value"][1]) / want - 1)
                    errors.append(err)
                    worst.append((err, name, at, len([t for t, _ in expected[key] if at - 60_000 < t <= at])))
    errors.sort()
    assert len(errors) > 100
    # Prometheus extrapolates a range's edges with the range's average slope; with samples 2 s apart
    # instead of 1 s the edges are up to 2 s wide, so a counter whose rate swings fast (the simulator's
    # containers and processes swing +-60% over 2-20 min) can miss by a little more than 1% at an
    # unlucky moment. Measured here: 99% of answers within 1%, none beyond 1.5% (docs/design.md, "Bandwidth").
    p99 = errors[int(len(errors) * 0.99) - 1]
    assert p99 <= 0.01, f"{sorted(worst)[-8:]}: 99th percentile of |rate error| {p99:.4f}"
    assert errors[-1] <= 0.015, f"{sorted(worst)[-8:]}: worst |rate error| {errors[-1]:.4f}"

    # 3. The max-aggregated gauges: each kept sample is the max of its 4 s window, peaks survive.
    dcgm_times = scrape_times(actual, "dcgm")
    peaks_exp, peaks_act = of_class(expected, PEAK_GAUGES), of_class(actual, PEAK_GAUGES)
    assert peaks_act and set(peaks_act) <= set(peaks_exp)
    windows_checked = 0
    for key, got in peaks_act.items():
        by_window: dict[int, list[float]] = {}
        for scrape_t, v in rebase(peaks_exp[key], dcgm_times):
            by_window.setdefault(scrape_t // (PEAK_RES_S * 1000), []).append(v)
        for t, v in got:
            window = by_window[t // (PEAK_RES_S * 1000)]
            assert v == max(window), (dict(key)["__name__"], t, v, window)
            windows_checked += 1
        # No window's peak is lost: every window up to the last one delivered has its sample.
        delivered = {t // (PEAK_RES_S * 1000) for t, _ in got}
        missing = [i for i in by_window if i < max(delivered) and i not in delivered]
        assert not missing, (dict(key)["__name__"], missing)
    assert windows_checked > 40

    # 4. Nothing waits in the spool; the wire stayed within the (generous) budget.
    assert run.proxy.bytes_total <= 200_000 * BURST_SECONDS + 200_000 * (time.monotonic() - run.started)


@pytest.mark.timeout(400)
def test_tight_budget_is_kept_on_the_wire(stack: Any, prometheus: Prometheus) -> None:
    rate = 1500
    run: Run = stack(budget_doc(rate, rest_max=16))
    burst = rate * BURST_SECONDS
    worst = 0.0
    samples = 0
    end = time.monotonic() + 100
    while time.monotonic() < end:
        elapsed = time.monotonic() - run.started
        worst = max(worst, run.proxy.bytes_total / (burst + rate * elapsed))
        samples += 1
        time.sleep(0.5)
    assert samples > 100
    # At every moment of the run: at most burst + rate x elapsed, +5%.
    assert worst <= 1.05, f"the connection carried {worst:.3f}x the budget"
    # The controller degraded the lowest class, never the critical one.
    assert run.metric("edge_relay_budget_degrade_level", **{"class": "rest"}) >= 1
    assert run.metric("edge_relay_budget_degrade_level", **{"class": "critical"}) == 0
    assert (
        run.metric("edge_relay_budget_degrade_steps_total", **{"class": "rest", "direction": "degrade"}) >= 1
    )
    assert run.metric("edge_relay_budget_bytes_per_second") == rate
    # Late but whole: after the (paced) drain, the critical class is complete at full resolution.
    drain_and_check_critical(run, prometheus)
