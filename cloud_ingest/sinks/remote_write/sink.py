"""Remote-write 1.0 behind the ``Sink`` protocol: one request per batch, and what the receiver refused
narrowed down to its samples.

A receiver refuses a whole request for one bad sample (Prometheus answers 400 and rolls the rest back),
without naming it. The client's ``rejected`` is therefore not the batch's outcome: the batch is bisected
(``cloud_ingest.isolate``), each part written on its own, until what the receiver refuses is found;
the rest is written for good. A part that gets a "never" 5xx (too old) is refused at the first such
answer: the whole batch already got it ``permanent_after`` times.
"""

from __future__ import annotations

import logging

from cloud_ingest.isolate import isolate
from cloud_ingest.selfmetrics import IngestMetrics
from cloud_ingest.sinks.remote_write.client import RemoteWriteClient
from cloud_ingest.sinks.remote_write.request import request_size_bound
from cloud_ingest.sinks.sink import SinkResult
from schemas.model import Batch

log = logging.getLogger("cloud_ingest")


class RemoteWriteSink:
    """Writes through one ``RemoteWriteClient`` (shared by the workers), at most ``isolate_max_writes``
    requests to find the refused samples of a batch."""

    def __init__(self, client: RemoteWriteClient, *, isolate_max_writes: int, metrics: IngestMetrics) -> None:
        self.client = client
        self.isolate_max_writes = isolate_max_writes
        self.metrics = metrics

    def request_bound(self, batch: Batch, cap: int, *, max_pair_bytes: int) -> int:
        # A v3 node's live label sets are in the client's cache at their encoded size: a tight bound, fast.
        return request_size_bound(
            batch, cap, max_pair_bytes=max_pair_bytes, labels_cache=self.client.labels_cache
        )

    def write(self, batch: Batch) -> SinkResult:
        outcome = self.client.write(batch)
        if outcome.status == "written":
            return SinkResult("done", batch.sample_count)
        if outcome.status == "retry_later":
            return SinkResult("retry_later", retry_reason=outcome.reason)
        log.error("receiver rejected batch %s seq=%d: %s", batch.node, batch.seq, outcome.reason)
        isolation = isolate(
            batch,
            lambda part: self.client.write(part, permanent_after=1),
            outcome.reason or "rejected by the remote-write receiver",
            max_writes=self.isolate_max_writes,
        )
        self.metrics.isolation_writes.inc(isolation.writes)
        if isolation.status == "retry_later":
            return SinkResult("retry_later", retry_reason=isolation.retry_reason)
        if isolation.refused is not None:
            log.error(
                "of batch %s seq=%d, %d samples were written, %d refused in %d requests: %s",
                batch.node,
                batch.seq,
                isolation.written,
                isolation.refused.sample_count,
                isolation.writes + 1,
                "; ".join(isolation.reasons),
            )
        return SinkResult("done", isolation.written, isolation.refused, isolation.reasons)

    def close(self) -> None:
        self.client.close()
