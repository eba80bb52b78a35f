"""The ingester's own metrics (``cloud_ingest_*``), defined once for every stage."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.messages = Counter(
            "cloud_ingest_messages_total",
            "MQTT batch messages received, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.refused = Counter(
            "cloud_ingest_batches_refused_total",
            "Batches refused as invalid or hostile, by reason.",
            ["reason"],
            registry=r,
        )
        self.samples_written = Counter(
            "cloud_ingest_samples_written_total",
            "Samples accepted by the remote-write receiver.",
            ["node"],
            registry=r,
        )
        self.batches_written = Counter(
            "cloud_ingest_batches_written_total",
            "Batches accepted by the remote-write receiver.",
            ["node"],
            registry=r,
        )
        self.dead_letters = Counter(
            "cloud_ingest_dead_letters_total",
            "Batches put into the dead-letter store, by reason.",
            ["reason"],
            registry=r,
        )
        self.retry_later = Counter(
            "cloud_ingest_batches_deferred_total",
            "Batches given up after retrying (not acked; the edge publishes them again).",
            registry=r,
        )
        self.acks = Counter(
            "cloud_ingest_acks_published_total", "Application acks sent, by result.", ["result"], registry=r
        )
        self.write_duration = Histogram(
            "cloud_ingest_remote_write_duration_seconds",
            "Time to write one batch, retries included.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.last_batch = Gauge(
            "cloud_ingest_node_last_batch_timestamp_seconds",
            "Unix time of the newest sample written for a node.",
            ["cluster", "node"],
            registry=r,
        )
        self.last_seq = Gauge(
            "cloud_ingest_node_last_seq",
            "Highest batch seq written for a node.",
            ["cluster", "node"],
            registry=r,
        )
        self.node_online = Gauge(
            "cloud_ingest_node_online",
            "1 if the node's retained status says online, 0 if offline (last will).",
            ["cluster", "node"],
            registry=r,
        )
        self.node_backlog_rows = Gauge(
            "cloud_ingest_node_backlog_batches",
            "Spool rows the node reported in its status.",
            ["cluster", "node"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "cloud_ingest_queue_depth", "Batches received and not yet finished.", registry=r
        )
        self.mqtt_connected = Gauge(
            "cloud_ingest_mqtt_connected", "1 while connected to the broker.", registry=r
        )
