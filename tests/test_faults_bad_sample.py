"""One bad sample costs itself only (issue 12 item 1), end to end on real mosquitto and Prometheus.

Beside the simulator's four exporters, a fifth target serves `bad_metric 1 -1` (an explicit negative
timestamp, which the wire cannot carry) between two good series, and the relay runs without a budget
file, as `edge-relay run` does in production. Before the fix the encoder refused every cycle, so every
target's samples were lost every interval with an empty loss ledger. Now: every good sample of every
target is in Prometheus, sample by sample (the simulator's through the oracle, the faulty target's by
request number), `bad_metric` is not, and the loss ledger holds exactly one `invalid_timestamp` per
scrape of the faulty target.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from testkit.oracle import compare, expected_samples, read_served_log
from testkit.services import Mosquitto, Prometheus
from testkit.stack import EXPORTERS, SimulatorProcess, ingest_config, ledger_totals, program, relay_config

RUN_SECONDS = 10
NODE = "edge-gpu-01"
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


class FaultyExporter:
    """Serves request n as two good series (values n and n/2) around one sample stamped -1 ms."""

    def __init__(self) -> None:
        self.requests = 0
        lock = threading.Lock()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:
                    exporter.requests += 1
                    n = exporter.requests
                body = f'ok_before {n}\nbad_metric 1 -1\nok_after{{a="b"}} {n / 2}\n'.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def faulty() -> Iterator[FaultyExporter]:
    exporter = FaultyExporter()
    try:
        yield exporter
    finally:
        exporter.close()


def spool_rows(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT count(*) FROM batches").fetchone()[0])


@pytest.mark.timeout(180)
def test_a_negative_timestamp_loses_only_itself(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus, faulty: FaultyExporter
) -> None:
    sim = SimulatorProcess(tmp_path, seed=5, interval=1.0, churn_ticks=10).start()
    try:
        # No budget_file: the per-cycle path, where one refused sample used to take the whole cycle.
        relay_cfg = relay_config(
            tmp_path, urls={**sim.urls, "faulty": faulty.url}, mqtt_port=mosquitto.port, interval=1.0
        )
        ingest_cfg = ingest_config(
            tmp_path, mqtt_port=mosquitto.port, remote_write_url=prometheus.remote_write_url
        )
        ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, tmp_path).start()
        relay = program("edge-relay", "edge_relay.cli", relay_cfg, tmp_path, "--drain-seconds", "20").start()
        try:
            time.sleep(RUN_SECONDS)
            assert relay.alive(), relay.log_tail()
            assert relay.stop() == 0, relay.log_tail()
            assert spool_rows(tmp_path / "spool.db") == 0, relay.log_tail()
            assert "cannot be encoded" not in relay.log_path.read_text()
        finally:
            relay.kill()
            ingest.stop()
    finally:
        sim.stop()
    served = read_served_log(sim.served_log)
    scrapes = faulty.requests
    assert scrapes >= RUN_SECONDS - 4

    actual = prometheus.raw_samples('{job=~".+"}', lookback="10m")
    by_job: dict[str, dict[frozenset[tuple[str, str]], list[tuple[int, float]]]] = {}
    for key, got in actual.items():
        by_job.setdefault(dict(key)["job"], {})[key] = got

    # The other targets: whole, sample by sample, as in test_e2e.
    instances = {name: f"{NODE}:{url.split(':')[2].split('/')[0]}" for name, url in sim.urls.items()}
    expected = expected_samples(
        sim.simulator,
        served,
        jobs={e: e for e in EXPORTERS},
        instances=instances,
        extra={"cluster": "test", "node": NODE},
    )
    real = {
        k: v
        for job in EXPORTERS
        for k, v in by_job.get(job, {}).items()
        if dict(k)["__name__"] not in SYNTHETIC
    }
    problems = compare(expected, real)
    assert not problems, "\n".join(problems[:20])
    for exporter in EXPORTERS:
        ups = [v for k, got in by_job[exporter].items() if dict(k)["__name__"] == "up" for _, v in got]
        assert ups == [1.0] * sum(1 for s in served if s.exporter == exporter), exporter

    # The faulty target: every scrape is up, with both good series at the scrape's timestamp.
    faulty_series = {dict(k)["__name__"]: got for k, got in by_job["faulty"].items()}
    assert "bad_metric" not in faulty_series
    up = faulty_series["up"]
    assert [v for _, v in up] == [1.0] * scrapes
    stamps = [t for t, _ in up]
    assert faulty_series["ok_before"] == [(t, float(n)) for n, t in enumerate(stamps, start=1)]
    assert faulty_series["ok_after"] == [(t, n / 2) for n, t in enumerate(stamps, start=1)]
    assert [v for _, v in faulty_series["scrape_samples_scraped"]] == [3.0] * scrapes

    # And the bad sample is accounted for: once per scrape, nothing else lost.
    assert ledger_totals(relay_cfg) == {"invalid_timestamp": scrapes}
