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
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.exporters import ScriptedExporter
from testkit.oracle import compare, expected_samples, read_served_log
from testkit.services import Mosquitto, Prometheus
from testkit.stack import (
    EXPORTERS,
    SimulatorProcess,
    ingest_config,
    ledger_totals,
    relay_config,
    run_relay_and_ingester,
)

RUN_SECONDS = 10
NODE = "edge-gpu-01"
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def faulty_body(n: int) -> str:
    """Request n: two good series (values n and n/2) around one sample stamped -1 ms."""
    return f'ok_before {n}\nbad_metric 1 -1\nok_after{{a="b"}} {n / 2}\n'


@pytest.fixture
def faulty() -> Iterator[ScriptedExporter]:
    with ScriptedExporter(faulty_body) as exporter:
        yield exporter


def spool_rows(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT count(*) FROM batches").fetchone()[0])


@pytest.mark.timeout(180)
def test_a_negative_timestamp_loses_only_itself(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus, faulty: ScriptedExporter
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
        relay = run_relay_and_ingester(tmp_path, relay_cfg, ingest_cfg, RUN_SECONDS)
        assert spool_rows(tmp_path / "spool.db") == 0, relay.log_tail()
        assert "cannot be encoded" not in relay.log_path.read_text()
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
