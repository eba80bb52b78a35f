"""Remote-write 1.0 behind the ``Sink`` protocol: a batch in requests of bounded size, and what the
receiver refused narrowed down to its samples.

Building a request costs about 190 bytes of memory per sample while it exists, so a legal batch of
``max_samples`` (2,000,000) as one request would cost a worker some 370 MiB. A batch of more than
``request_samples`` samples is therefore written as several requests, its scrape blocks taken in time
order and cut where a request is full; each request is built only when it is sent and dropped before
the next is built, so a worker's memory per batch is bounded by ``request_samples`` whatever the
batch's size. The requests of one batch go one after another; the batch's result is their sum (what
each refused is joined into one refused part). If one must be retried later, so is the whole batch:
what was written of it is written again when the edge publishes it again, which changes nothing.
Cutting by blocks in time order keeps each series' samples in time order across the requests (the
order a receiver without an out-of-order window needs), as a scrape's samples share its timestamp.

A receiver refuses a whole request for one bad sample (Prometheus answers 400 and rolls the rest back),
without naming it. The client's ``rejected`` is therefore not the batch's outcome: the batch is bisected
(``cloud_ingest.isolate``), each part written on its own, until what the receiver refuses is found;
the rest is written for good. A part that gets a "never" 5xx (too old) is refused at the first such
answer: the whole batch already got it ``permanent_after`` times.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Final

from cloud_ingest.isolate import isolate, joined
from cloud_ingest.selfmetrics import IngestMetrics
from cloud_ingest.sinks.remote_write.client import RemoteWriteClient
from cloud_ingest.sinks.remote_write.request import request_size_bound
from cloud_ingest.sinks.sink import SinkResult
from schemas.model import Batch, ScrapeBlock

log = logging.getLogger("cloud_ingest")

# Samples per remote-write request: about 19 MiB while it is built, and what Prometheus' own senders
# use per request is far below (2,000 by default), so receivers take it.
REQUEST_SAMPLES: Final = 100_000


def requests_of(batch: Batch, request_samples: int) -> Iterator[Batch]:
    """``batch`` as parts of at most ``request_samples`` samples each (``batch`` itself when it fits),
    its blocks in time order, made one at a time as they are asked for. The parts share the batch's
    label-set table (a request carries only the series that have samples in it)."""
    if batch.sample_count <= request_samples:
        yield batch
        return
    blocks: list[ScrapeBlock] = []
    room = request_samples
    for block in sorted(batch.scrapes, key=lambda b: b.timestamp_ms):
        lo = 0
        while lo < len(block.values):
            hi = min(len(block.values), lo + room)
            blocks.append(block if (lo, hi) == (0, len(block.values)) else block.slice(lo, hi))
            room -= hi - lo
            lo = hi
            if room == 0:
                yield Batch(batch.cluster, batch.node, batch.seq, batch.labelsets, blocks, batch.incarnation)
                blocks, room = [], request_samples
    if blocks:
        yield Batch(batch.cluster, batch.node, batch.seq, batch.labelsets, blocks, batch.incarnation)


class RemoteWriteSink:
    """Writes through one ``RemoteWriteClient`` (shared by the workers), at most ``isolate_max_writes``
    requests to find the refused samples of a batch."""

    def __init__(
        self,
        client: RemoteWriteClient,
        *,
        isolate_max_writes: int,
        metrics: IngestMetrics,
        request_samples: int = REQUEST_SAMPLES,
    ) -> None:
        self.client = client
        self.isolate_max_writes = isolate_max_writes
        self.metrics = metrics
        self.request_samples = max(1, request_samples)

    def request_bound(self, batch: Batch, cap: int, *, max_pair_bytes: int) -> int:
        # A v3 node's live label sets are in the client's cache at their encoded size: a tight bound, fast.
        return request_size_bound(
            batch, cap, max_pair_bytes=max_pair_bytes, labels_cache=self.client.labels_cache
        )

    def write(self, batch: Batch) -> SinkResult:
        written = 0
        refused: Batch | None = None
        reasons: list[str] = []
        for part in requests_of(batch, self.request_samples):
            result = self._write_request(part)
            if result.status == "retry_later":
                return result
            written += result.written
            refused = joined(refused, result.refused)
            reasons += [r for r in result.reasons if r not in reasons]
        return SinkResult("done", written, refused, reasons)

    def _write_request(self, batch: Batch) -> SinkResult:
        """One request's worth of a batch (or a whole batch that fits in one)."""
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
