"""End to end on real services: simulator -> edge-relay -> mosquitto -> cloud-ingest -> Prometheus / VM.

The simulator serves the three fixture exporters plus node-exporter at a 1 s tick for over 30 s; the
relay scrapes them every second (Kepler in OpenMetrics, the rest in text format). At the end every
series is read back raw from the receiver and compared sample by sample with what the simulator
served: same value, timestamp of the scrape that fetched it, nothing missing, nothing extra.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from schemas.model import is_stale
from testkit.oracle import compare, expected_samples, read_served_log
from testkit.services import Mosquitto, Prometheus, RawSamples, VictoriaMetrics, wait_until
from testkit.stack import EXPORTERS, SimulatorProcess, ingest_config, program, relay_config, spool_rows

RUN_SECONDS = 32
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def run_stack(tmp_path: Path, mosquitto: Mosquitto, remote_write_url: str) -> dict[str, Any]:
    sim = SimulatorProcess(tmp_path, seed=7, interval=1.0, churn_ticks=10).start()
    try:
        relay_cfg = relay_config(tmp_path, urls=sim.urls, mqtt_port=mosquitto.port, interval=1.0)
        ingest_cfg = ingest_config(tmp_path, mqtt_port=mosquitto.port, remote_write_url=remote_write_url)
        ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, tmp_path).start()
        relay = program("edge-relay", "edge_relay.cli", relay_cfg, tmp_path, "--drain-seconds", "20").start()
        try:
            time.sleep(RUN_SECONDS)
            assert relay.alive(), relay.log_tail()
            assert ingest.alive(), ingest.log_tail()
            assert relay.stop() == 0, relay.log_tail()
            # Every batch the relay spooled was acknowledged by the cloud before it exited.
            assert spool_rows(tmp_path / "spool.db") == 0, relay.log_tail()
        finally:
            relay.kill()
            ingest.stop()
    finally:
        sim.stop()
    served = read_served_log(sim.served_log)
    assert Counter(s.exporter for s in served).keys() == set(EXPORTERS)
    assert len(served) >= 4 * (RUN_SECONDS - 5)
    return {"sim": sim, "served": served, "node": "edge-gpu-01"}


def split_synthetic(actual: RawSamples) -> tuple[RawSamples, RawSamples]:
    real = {k: v for k, v in actual.items() if dict(k)["__name__"] not in SYNTHETIC}
    synthetic = {k: v for k, v in actual.items() if dict(k)["__name__"] in SYNTHETIC}
    return real, synthetic


def check(run: dict[str, Any], actual: RawSamples, rel_tol: float = 0.0) -> None:
    sim, served = run["sim"], run["served"]
    instances = {name: f"edge-gpu-01:{url.split(':')[2].split('/')[0]}" for name, url in sim.urls.items()}
    expected = expected_samples(
        sim.simulator,
        served,
        jobs={e: e for e in EXPORTERS},
        instances=instances,
        extra={"cluster": "test", "node": "edge-gpu-01"},
    )
    real, synthetic = split_synthetic(actual)
    problems = compare(expected, real, rel_tol=rel_tol)
    assert not problems, "\n".join(problems[:20])
    total = sum(len(v) for v in expected.values())
    assert total > 30 * 1000, f"only {total} samples served: the test would prove little"
    # `up` is 1 for every scrape of every target, once per served response.
    ups = {dict(k)["job"]: v for k, v in synthetic.items() if dict(k)["__name__"] == "up"}
    for exporter in EXPORTERS:
        n_served = sum(1 for s in served if s.exporter == exporter)
        assert [v for _, v in ups[exporter]] == [1.0] * n_served, exporter


@pytest.mark.timeout(240)
def test_every_sample_reaches_prometheus(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    run = run_stack(tmp_path, mosquitto, prometheus.remote_write_url)
    actual = prometheus.raw_samples('{job=~".+"}', lookback="10m")
    check(run, actual)


@pytest.mark.timeout(240)
def test_every_sample_reaches_victoriametrics(
    tmp_path: Path, mosquitto: Mosquitto, victoria_metrics: VictoriaMetrics
) -> None:
    run = run_stack(tmp_path, mosquitto, victoria_metrics.remote_write_url)
    victoria_metrics.flush()
    actual = wait_until(
        lambda: victoria_metrics.raw_samples('{job=~".+"}'), timeout=30, message="samples in VictoriaMetrics"
    )
    # VictoriaMetrics keeps stale markers (Prometheus hides them); they are checked, then set aside.
    stale = sum(1 for v in actual.values() for _, x in v if is_stale(x))
    assert stale > 0, "containers come and go in the simulator: vanished series must get stale markers"
    actual = {k: [(t, x) for t, x in v if not is_stale(x)] for k, v in actual.items()}
    # VictoriaMetrics stores values as decimals with about 12 significant digits (its documented
    # trade-off), so exactness is Prometheus' test; here values must agree to 1e-11.
    check(run, {k: v for k, v in actual.items() if v}, rel_tol=1e-11)
