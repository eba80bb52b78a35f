"""One target's work never costs another target its scrapes: the real ``edge-relay run``, two scripted
exporters, a 1 s interval, and what the relay spooled (no broker: every batch stays in the spool, which is
read beside the running relay).

A relabel rule Prometheus matches in linear time, ``([a-z0-9]+-?)*-canary``, took a backtracking engine
about 4 s per 34-character pod name; the cycle waits for every target, so a healthy target beside one
exposing 1,000 such pods was scraped once in 20 s. And however fast each series is, a target that brings
tens of thousands of new series at once (a rollout, pod churn) takes its time to relabel and check them:
that time is its own, not its neighbours'.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from edge_relay.app import Relay
from edge_relay.collect.shape import ShapedScrape
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import load
from schemas import codec
from testkit.exporters import ScriptedExporter
from testkit.services import free_port
from testkit.stack import Program, program, relay_config

WINDOW_S = 20
CANARY_RULE = {"source_labels": ["pod"], "regex": "([a-z0-9]+-?)*-canary", "action": "drop"}


def pods_body(n: int, pods: int = 1000) -> str:
    """Scrape ``n``: ``pods`` pods of a deployment whose ReplicaSet hash changes every scrape (churn:
    every name is new), one in a hundred a canary."""
    rs = f"{n:010x}"
    return "".join(
        f'kube_pod_info{{namespace="ai",pod="llm-triton-server-{rs}-'
        f'{"canary" if i % 100 == 0 else f"x{i:04d}"}"}} 1\n'
        for i in range(pods)
    )


def spooled_samples(spool: Path) -> Iterator[tuple[dict[str, str], int]]:
    """(labels, timestamp) of every sample in the spool's batches, read beside the running relay."""
    with closing(sqlite3.connect(f"file:{spool}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT payload FROM batches").fetchall()
    for (payload,) in rows:
        batch = codec.decode_batch(payload)
        for block in batch.scrapes:
            stamps = block.timestamps or [block.timestamp_ms] * len(block.series)
            for idx, ts in zip(block.series, stamps, strict=True):
                yield dict(batch.labelsets[idx]), ts


def healthy_scrapes(spool: Path) -> list[int]:
    """The timestamps of the healthy target's ``up`` samples (one per scrape), in order."""
    return sorted(
        ts
        for labels, ts in spooled_samples(spool)
        if labels["__name__"] == "up" and labels["job"] == "healthy"
    )


def run_beside(
    tmp_path: Path, noisy: dict[str, Any], body_for: Callable[[int], str], **overrides: Any
) -> tuple[list[int], Path]:
    """The relay with the healthy target and ``noisy`` (a target entry, served ``body_for``) for
    ``WINDOW_S`` seconds after its first healthy scrape (or until that should long have come);
    ``overrides`` as ``testkit.stack.relay_config`` takes them."""
    with (
        ScriptedExporter(body_for) as noisy_exporter,
        ScriptedExporter(lambda n: "healthy_metric 1\n") as healthy,
    ):
        cfg = relay_config(
            tmp_path,
            urls={},
            mqtt_port=free_port(),  # nobody listens: batches stay in the spool
            targets=[{"name": "healthy", "url": healthy.url}, {**noisy, "url": noisy_exporter.url}],
            **overrides,
        )
        relay: Program = program("edge-relay", "edge_relay.cli", cfg, tmp_path).start()
        spool = tmp_path / "spool.db"
        try:
            started = time.monotonic()
            first: int | None = None
            while time.monotonic() - started < WINDOW_S + 15:
                assert relay.alive(), relay.log_tail()
                time.sleep(1)
                scrapes = healthy_scrapes(spool) if spool.exists() else []
                if scrapes and first is None:
                    first = scrapes[0]
                if first is not None and scrapes and scrapes[-1] >= first + (WINDOW_S + 1) * 1000:
                    break
            assert relay.alive(), relay.log_tail()
            in_window = [
                ts for ts in healthy_scrapes(spool) if first is not None and ts < first + WINDOW_S * 1000
            ]
            return in_window, spool
        finally:
            relay.kill()


@pytest.mark.timeout(120)
def test_a_relabel_regex_that_backtracks_costs_no_target_its_scrapes(tmp_path: Path) -> None:
    """1,000 new pod names every scrape under the canary rule, beside a healthy target: the healthy
    target is scraped every interval, and the rule drops exactly the canaries."""
    noisy = {"name": "pods", "metric_relabel_configs": [CANARY_RULE]}
    scrapes, spool = run_beside(tmp_path, noisy, pods_body)
    assert len(scrapes) >= WINDOW_S - 2, f"the healthy target was scraped {len(scrapes)} times in {WINDOW_S}s"
    pods = [labels["pod"] for labels, _ in spooled_samples(spool) if labels["__name__"] == "kube_pod_info"]
    assert pods and not [p for p in pods if p.endswith("-canary")]
    assert len(pods) % 990 == 0


@pytest.mark.timeout(120)
def test_a_target_bringing_many_new_series_costs_the_others_no_scrapes(tmp_path: Path) -> None:
    """40,000 new series every scrape through five rules that keep one in ten (an allowlist over pod
    churn): relabeling them takes this target about the interval or longer, every time. It is scraped
    when it is done; the healthy target still every interval. (The flight recorder is off: packing its
    blocks is the cycle's own work, measured by bench/live_cpu_bench.py, not a target's.)"""
    pod_parts = {"source_labels": ["pod"], "regex": "(.*)-([a-z0-9]+)-([a-z0-9]+)"}
    noisy = {
        "name": "churn",
        "metric_relabel_configs": [
            {**pod_parts, "target_label": "deployment"},
            {**pod_parts, "target_label": "replicaset", "replacement": "$1-$2"},
            {"source_labels": ["pod"], "regex": ".*-x(\\d+)", "target_label": "ordinal"},
            {"source_labels": ["deployment", "ordinal"], "regex": "(.+);(.*)", "target_label": "slot"},
            {"source_labels": ["ordinal"], "regex": ".*1", "action": "keep"},
        ],
    }
    scrapes, spool = run_beside(tmp_path, noisy, lambda n: pods_body(n, pods=40_000), recorder__max_bytes=0)
    assert len(scrapes) >= WINDOW_S - 2, f"the healthy target was scraped {len(scrapes)} times in {WINDOW_S}s"
    churned = {labels["replicaset"] for labels, _ in spooled_samples(spool) if "replicaset" in labels}
    assert len(churned) >= 3  # it was scraped too, when it was done


def test_a_target_still_shaping_joins_a_later_cycle_and_is_not_scraped_meanwhile(tmp_path: Path) -> None:
    """The cycle itself: a target whose scrape is still at work after the scrape timeout is left out of
    the cycle, not scraped again while busy, and its scrape joins the first cycle after it is done; at
    shutdown it is waited for and spooled, not dropped."""
    with ScriptedExporter(bodies={"good": "good 1\n", "slow": "slow 1\n"}) as ex:
        config = tmp_path / "relay.yaml"
        config.write_text(
            "node: n1\nscrape: {interval_seconds: 1, timeout_seconds: 0.5}\n"
            f"targets: [{{name: good, url: '{ex.url_of('good')}'}}, "
            f"{{name: slow, url: '{ex.url_of('slow')}'}}]\n"
            f"spool: {{path: {tmp_path / 'spool.db'}}}\nmqtt: {{port: 9}}\nmetrics: {{listen: ''}}\n"
        )
        relay = Relay(load(str(config)), RelayMetrics())
        cycles: list[list[str]] = []

        def spool(shaped: list[ShapedScrape], *, at_once: bool = False) -> tuple[int, list[bytes]]:
            cycles.append([s.target for s in shaped])
            return sum(len(s) for s in shaped), []

        relay.lanes.spool = spool  # type: ignore[method-assign]  # the cycles' contents are under test
        slow_loop = relay.collector.loops[1]
        scrape_slow = slow_loop.run_once
        release = threading.Event()

        def shaping_for_long() -> ShapedScrape:
            shaped = scrape_slow()
            release.wait(10)  # as if shaping tens of thousands of new series
            return shaped

        slow_loop.run_once = shaping_for_long  # type: ignore[method-assign]
        relay.uplink.start()
        relay.cycle()
        relay.cycle()
        assert cycles == [["good"], ["good"]]
        assert ex.requests == 3  # the slow target was scraped once, not again while busy
        release.set()
        time.sleep(0.2)
        relay.cycle()
        assert cycles[-1] == ["good", "slow"]
        release.clear()
        relay.cycle()
        assert cycles[-1] == ["good"]
        threading.Timer(0.5, release.set).start()
        relay.shutdown(0)
        assert cycles[-1] == ["slow"]
