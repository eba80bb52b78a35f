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
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

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
    tmp_path: Path, noisy: dict[str, Any], body_for: Callable[[int], str]
) -> tuple[list[int], Path]:
    """The relay with the healthy target and ``noisy`` (a target entry, served ``body_for``) for
    ``WINDOW_S`` seconds after its first healthy scrape (or until that should long have come)."""
    with (
        ScriptedExporter(body_for) as noisy_exporter,
        ScriptedExporter(lambda n: "healthy_metric 1\n") as healthy,
    ):
        cfg = relay_config(
            tmp_path,
            urls={},
            mqtt_port=free_port(),  # nobody listens: batches stay in the spool
            targets=[{"name": "healthy", "url": healthy.url}, {**noisy, "url": noisy_exporter.url}],
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
