"""A batch the receiver will never take must not block a node's queue: bounded attempts, then rejected."""

from __future__ import annotations

import time
from array import array

from cloud_ingest.sinks.remote_write.client import RemoteWriteClient
from relay_common.backoff import Backoff
from schemas.model import Batch, ScrapeBlock
from testkit.services import Prometheus


def batch(timestamp_ms: int, value: float) -> Batch:
    labels = (("__name__", "too_old_probe"), ("job", "t"))
    return Batch("c", "n", 1, [labels], [ScrapeBlock(timestamp_ms, array("I", [0]), array("d", [value]))])


def test_too_old_sample_is_rejected_after_bounded_attempts(make_service) -> None:  # type: ignore[no-untyped-def]
    prom = make_service(Prometheus, ooo_window="10m")
    client = RemoteWriteClient(prom.remote_write_url, backoff=Backoff(0.01, 0.05), max_retry_s=60)
    now_ms = int(time.time() * 1000)
    assert client.write(batch(now_ms, 1.0)).status == "written"
    # Three hours back is far outside the 10 minute out-of-order window: Prometheus answers 500.
    outcome = client.write(batch(now_ms - 3 * 3600 * 1000, 2.0))
    assert outcome.status == "rejected"
    assert outcome.http_status == 500
    assert "too old" in outcome.reason
    assert outcome.attempts == client.permanent_after


def test_unreachable_receiver_is_not_treated_as_permanent() -> None:
    # Connection refused keeps being retried until max_retry_s: the edge keeps the data meanwhile.
    client = RemoteWriteClient(
        "http://127.0.0.1:9/api/v1/write", backoff=Backoff(0.01, 0.02), max_retry_s=0.3
    )
    outcome = client.write(batch(int(time.time() * 1000), 1.0))
    assert outcome.status == "retry_later"
    assert outcome.attempts > client.permanent_after
