"""One batch message through the pipeline: decode -> sink -> finish, to its ``Outcome``.

The pipeline takes a ``Delivery`` (what the edge published, and where) and returns the outcome; it
never settles a message itself: the intake that received it does, by the outcome (``outcome.answer``).
Nothing here knows the transport.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from cloud_ingest.isolate import joined
from cloud_ingest.once import OncePerKey
from cloud_ingest.outcome.answer import Outcome
from cloud_ingest.pipeline.decode import Refused, decode
from cloud_ingest.pipeline.finish import Finisher
from cloud_ingest.pipeline.stream_state import StreamState
from cloud_ingest.selfmetrics import IngestMetrics
from cloud_ingest.sinks.sink import Sink
from schemas.codec import Limits

log = logging.getLogger("cloud_ingest")


@dataclass(frozen=True, slots=True)
class Delivery:
    """One batch message as an intake received it. ``topic``: where the edge published it, in the topic
    grammar of ``schemas.topics`` (an intake on another transport writes its address so); the node's
    identity is taken from it, and the dead-letter store keeps it for a replay."""

    topic: str
    payload: bytes


class Pipeline:
    """Thread-safe: the intake's workers run ``handle`` in parallel (one batch of a node at a time)."""

    def __init__(
        self,
        *,
        prefix: str,
        limits: Limits,
        max_future_seconds: float,
        stream: StreamState,
        sink: Sink,
        finish: Finisher,
        metrics: IngestMetrics,
        stopping: threading.Event,
    ) -> None:
        self.prefix = prefix
        self.limits = limits
        self.max_future_seconds = max_future_seconds
        self.stream = stream
        self.sink = sink
        self.finish = finish
        self.metrics = metrics
        self.stopping = stopping
        self._overrides_logged = OncePerKey()

    def handle(self, delivery: Delivery) -> Outcome:
        """Process one batch message to its final outcome."""
        payload = bytes(delivery.payload)
        try:
            decoded = decode(
                delivery.topic,
                payload,
                prefix=self.prefix,
                limits=self.limits,
                max_future_seconds=self.max_future_seconds,
                decoder=self.stream.decode,
                request_bound=self.sink.request_bound,
            )
        except Refused as r:
            if r.reason == "need_state" and r.cluster is not None and r.node is not None and r.seq:
                return self.finish.need_state(r.cluster, r.node, r.seq, r.incarnation)
            return self.finish.refused(delivery.topic, payload, r)
        batch = decoded.batch
        self.metrics.observe_batch_age("decoded", batch)
        if decoded.identity_overridden:
            self.metrics.identity_overridden.labels(decoded.node).inc(decoded.identity_overridden)
            if self._overrides_logged.first(decoded.node):
                log.warning(
                    "batch on %s has series labelled with another cluster or node: written with the topic's, "
                    "the sent values kept as exported_cluster / exported_node (logged once per node; counted "
                    "in cloud_ingest_series_identity_overridden_total)",
                    delivery.topic,
                )
        started = time.monotonic()
        result = self.sink.write(batch)
        self.metrics.write_duration.observe(time.monotonic() - started)
        if result.status == "retry_later":
            if self.stopping.is_set():
                # Shutting down mid-retry: not released, so the broker gives the batch to another replica.
                return Outcome("abandoned", hold=True)
            return self.finish.deferred(decoded, result.retry_reason)
        refused = joined(result.refused, decoded.refused)
        reasons = result.reasons + ([decoded.refused_reason] if decoded.refused is not None else [])
        return self.finish.finished(delivery.topic, payload, decoded, result.written, refused, reasons)
