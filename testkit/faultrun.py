"""A whole product run for fault tests: the simulator, ``edge-relay run`` and ``cloud-ingest run`` as
processes on real mosquitto and Prometheus (or VictoriaMetrics), 1 s scrapes, short timers, and the
end-of-test oracle that compares what the receiver holds with what the simulator served, sample by
sample: 0 lost, 0 changed values, 0 extra, no duplicate timestamps.

The fault tests (``tests/system/``) break one thing while a ``FaultRun`` runs and call ``finish``; the
``fault_run`` fixture (``tests/system/conftest.py``) starts them and reaps them.
"""

from __future__ import annotations

import itertools
import sqlite3
import time
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from schemas.model import is_stale
from testkit.oracle import compare, expected_samples, read_served_log
from testkit.services import Prometheus, RawSamples, VictoriaMetrics, wait_until
from testkit.stack import (
    EXPORTERS,
    Program,
    SimulatorProcess,
    ingest_config,
    metrics_url,
    program,
    relay_config,
)

NODE = "edge-gpu-01"
CLUSTER = "test"
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
FAULT_SECONDS = 10.0
KEEPALIVE_SECONDS = 3
# Short timers so a fault and the recovery from it fit in a test of well under a minute.
RELAY_OPTIONS: dict[str, Any] = {
    "mqtt__keepalive_seconds": KEEPALIVE_SECONDS,
    "mqtt__ack_timeout_seconds": 5.0,
    "mqtt__reconnect_min_seconds": 0.2,
    "mqtt__reconnect_max_seconds": 1.0,
}
INGEST_OPTIONS: dict[str, Any] = {
    "remote_write__retry_min_seconds": 0.1,
    "remote_write__retry_max_seconds": 1.0,
    "remote_write__max_retry_seconds": 3.0,
    "mqtt__reconnect_min_seconds": 1,
    "mqtt__reconnect_max_seconds": 2,
}
DRAIN_SECONDS = 20
LIVE_AFTER_SECONDS = 3.0
LIVE_EDGE_ROWS = 4  # spool rows of the last second or two, on their way to the cloud
MIN_SAMPLES = 15_000  # about 11 s of scrapes of the four exporters: enough to prove something


def spool_file_rows(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT count(*) FROM batches").fetchone()[0])


class FaultRun:
    """Simulator, ``edge-relay run`` and ``cloud-ingest run`` as processes, plus the end-of-test oracle."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        broker_port: int,
        remote_write_url: str,
        relay_broker_port: int | None = None,
        relay_options: dict[str, Any] | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.relay_options = {**RELAY_OPTIONS, **(relay_options or {})}
        self.sim = SimulatorProcess(tmp_path, seed=11, interval=1.0, churn_ticks=10)
        self.broker_port = broker_port
        self.relay_broker_port = broker_port if relay_broker_port is None else relay_broker_port
        self.remote_write_url = remote_write_url
        self.spool_path = tmp_path / "spool.db"
        self.relay: Program | None = None
        self.ingest: Program | None = None
        self.metrics_url = ""

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> FaultRun:
        self.sim.start()
        relay_cfg = relay_config(
            self.tmp_path,
            urls=self.sim.urls,
            mqtt_port=self.relay_broker_port,
            interval=1.0,
            node=NODE,
            **self.relay_options,
        )
        self.metrics_url = metrics_url(relay_cfg)
        ingest_cfg = ingest_config(
            self.tmp_path,
            mqtt_port=self.broker_port,
            remote_write_url=self.remote_write_url,
            **INGEST_OPTIONS,
        )
        self.ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, self.tmp_path).start()
        self.relay = program(
            "edge-relay", "edge_relay.cli", relay_cfg, self.tmp_path, "--drain-seconds", str(DRAIN_SECONDS)
        ).start()
        # The fault must hit a pipeline that works: batches acknowledged end to end.
        wait_until(
            lambda: (self.metric("edge_relay_batches_acked_total", result="ok") or 0) >= 3, 30, 0.2, "acks"
        )
        return self

    def close(self) -> None:
        """Teardown after a failure: nothing of ours may outlive the test."""
        for proc in (self.relay, self.ingest):
            if proc is not None:
                proc.kill()
        self.sim.stop()

    def assert_alive(self) -> None:
        assert self.relay is not None and self.ingest is not None
        assert self.relay.alive(), f"edge-relay died:\n{self.relay.log_tail()}"

    # -- the relay's self-metrics -----------------------------------------------------------------------

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample of the relay's /metrics; None if it is absent or the endpoint does not answer."""
        self.assert_alive()
        try:
            text = requests.get(self.metrics_url, timeout=2).text
        except requests.RequestException:
            return None
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return None

    def spool_rows(self) -> int:
        rows = self.metric("edge_relay_spool_rows")
        assert rows is not None, "the relay's /metrics has no edge_relay_spool_rows"
        return int(rows)

    def wait_disconnected(self, timeout: float) -> float:
        """Seconds until the relay reports its MQTT connection down."""
        t0 = time.monotonic()
        wait_until(lambda: self.metric("edge_relay_mqtt_connected") == 0, timeout, 0.1, "relay disconnected")
        return time.monotonic() - t0

    # -- the end ------------------------------------------------------------------------------------

    def finish(self, prometheus: Prometheus | VictoriaMetrics) -> int:
        """Drain, stop the relay (SIGTERM), check the spool is empty, compare Prometheus with the oracle.

        Returns the number of compared samples.
        """
        assert self.relay is not None and self.ingest is not None
        self.assert_alive()
        # The backlog drains while the relay keeps scraping: only the live edge may remain.
        wait_until(lambda: self.spool_rows() <= LIVE_EDGE_ROWS, 45, 0.2, "the relay's backlog drained")
        # ... and live data keeps flowing after the recovery.
        time.sleep(LIVE_AFTER_SECONDS)
        assert self.spool_rows() <= LIVE_EDGE_ROWS, "batches pile up again after the recovery"
        self.assert_alive()
        assert self.ingest.alive(), f"cloud-ingest died:\n{self.ingest.log_tail()}"
        code = self.relay.stop()
        assert code == 0, f"edge-relay exited with {code}:\n{self.relay.log_tail()}"
        # Every batch the relay spooled was acknowledged by the cloud before it exited.
        assert spool_file_rows(self.spool_path) == 0, self.relay.log_tail()
        code = self.ingest.stop()
        assert code == 0, f"cloud-ingest exited with {code}:\n{self.ingest.log_tail()}"
        self.sim.stop()
        return self.check(prometheus)

    def check(self, prometheus: Prometheus | VictoriaMetrics) -> int:
        served = read_served_log(self.sim.served_log)
        assert {s.exporter for s in served} == set(EXPORTERS)
        instances = {name: f"{NODE}:{url.split(':')[2].split('/')[0]}" for name, url in self.sim.urls.items()}
        expected = expected_samples(
            self.sim.simulator,
            served,
            jobs={e: e for e in EXPORTERS},
            instances=instances,
            extra={"cluster": CLUSTER, "node": NODE},
        )
        rel_tol = 0.0
        if isinstance(prometheus, VictoriaMetrics):
            # VictoriaMetrics keeps stale markers (Prometheus hides them), keeps a replayed sample twice
            # unless -dedup.minScrapeInterval is set, and stores values as decimals with about 12
            # significant digits: set the markers aside, fold identical replays (a replay with another
            # value stays and fails the check below), compare values to 1e-11.
            vm = prometheus
            vm.flush()
            raw = wait_until(lambda: vm.raw_samples('{job=~".+"}'), 30, 0.5, "samples in VictoriaMetrics")
            actual: RawSamples = {}
            for k, v in raw.items():
                kept = [p for i, p in enumerate(v) if not is_stale(p[1]) and (i == 0 or p != v[i - 1])]
                if kept:
                    actual[k] = kept
            rel_tol = 1e-11
        else:
            actual = prometheus.raw_samples('{job=~".+"}', lookback="10m")
        # No duplicates: every series' raw samples have strictly increasing timestamps.
        unordered = [
            f"{dict(k).get('__name__')} {dict(k)}"
            for k, v in actual.items()
            if any(a >= b for (a, _), (b, _) in itertools.pairwise(v))
        ]
        assert not unordered, "series with repeated or unordered timestamps:\n" + "\n".join(unordered[:10])
        real = {k: v for k, v in actual.items() if dict(k)["__name__"] not in SYNTHETIC}
        synthetic = {k: v for k, v in actual.items() if dict(k)["__name__"] in SYNTHETIC}
        problems = compare(expected, real, max_skew_ms=1000, rel_tol=rel_tol)
        assert not problems, "\n".join(problems[:20])
        total = sum(len(v) for v in expected.values())
        assert total > MIN_SAMPLES, f"only {total} samples served: the test would prove little"
        # `up` is 1 for every scrape of every target, once per served response.
        ups = {dict(k)["job"]: v for k, v in synthetic.items() if dict(k)["__name__"] == "up"}
        for exporter in EXPORTERS:
            n_served = sum(1 for s in served if s.exporter == exporter)
            assert [v for _, v in ups[exporter]] == [1.0] * n_served, exporter
        return total


def sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))
