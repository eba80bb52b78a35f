"""The ingester's own metrics (``cloud_ingest_*``), defined once for every stage.

The per-node gauges and counters (``cloud_ingest_node_*{cluster,node}``, ``cloud_ingest_fleet_*``) are
read from the ``Fleet`` model (``cloud_ingest/outcome/fleet.py``) at every scrape, so a node the fleet forgets
(not heard from for 7 days) leaves the exposition with it; see ``FleetCollector`` for the list.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cloud_ingest.outcome.fleet import VERDICTS, Fleet, NodeKey, NodeView
from schemas.model import Batch


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, fleet: Fleet | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.fleet = fleet if fleet is not None else Fleet()
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
        self.samples_refused = Counter(
            "cloud_ingest_samples_refused_total",
            "Samples split off a batch whose other samples were written (the receiver refused them, or "
            "their timestamp was too far in the future) and dead-lettered, by reason.",
            ["node", "reason"],
            registry=r,
        )
        self.isolation_writes = Counter(
            "cloud_ingest_isolation_writes_total",
            "Remote-write requests made to find the samples the receiver refused in a batch.",
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
        self.batch_age = Histogram(
            "cloud_ingest_batch_age_seconds",
            "Age of a batch's newest sample (its scrape's start, by the edge's clock) when the ingester "
            "had decoded it and when the receiver accepted it, by stage (decoded, written); a backlog "
            "after an outage lands in the top buckets.",
            ["stage"],
            buckets=(0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 300, 3600, 86400),
            registry=r,
        )
        self.queue_depth = Gauge(
            "cloud_ingest_queue_depth", "Batches received and not yet finished.", registry=r
        )
        self.mqtt_connected = Gauge(
            "cloud_ingest_mqtt_connected", "1 while connected to the broker.", registry=r
        )
        self.config_errors = Counter(
            "cloud_ingest_remote_write_config_errors",
            "Receiver answers that say its address, credentials or limits are wrong, not the data (3xx, "
            "401, 403, 404, 405, 413, a 400 naming no sample ...), by status; 0: no answer because a "
            "credentials or TLS file cannot be read or the TLS handshake failed; retried, never rejected.",
            ["status"],
            registry=r,
        )
        self.target_dropped = Counter(
            "cloud_ingest_remote_write_target_dropped_batches",
            "Batches an optional remote-write target did not get because its queue was full, by target.",
            ["target"],
            registry=r,
        )
        self.dead_letter_overflow = Counter(
            "cloud_ingest_dead_letter_overflow",
            "Dead letters not stored because the store was full, by reason; a receiver-rejected batch "
            "is then not acknowledged (the edge keeps it).",
            ["reason"],
            registry=r,
        )
        self.dead_letter_bytes = Gauge(
            "cloud_ingest_dead_letter_bytes", "Bytes the dead-letter store uses.", registry=r
        )
        self.dead_letter_max_bytes = Gauge(
            "cloud_ingest_dead_letter_max_bytes",
            "The dead-letter store's cap (dead_letter.max_bytes).",
            registry=r,
        )
        self.identity_overridden = Counter(
            "cloud_ingest_series_identity_overridden",
            "Label sets whose cluster or node label differed from the topic's: written with the topic's, "
            "the sent value kept as exported_cluster / exported_node.",
            ["node"],
            registry=r,
        )
        # Wire format v3 (live mode): pipeline/stream_state.py, intake/mqtt/follow.py.
        self.need_state = Counter(
            "cloud_ingest_need_state_total",
            "v3 frames acked need_state: this replica does not hold the state they were coded against "
            "(the relay publishes them again self-contained); never dead-lettered.",
            registry=r,
        )
        self.frames_followed = Counter(
            "cloud_ingest_frames_followed_total",
            "Batch messages of the follow subscription (every frame, to advance the stream state), by "
            "outcome: decoded, cached (already decoded), need_state (its base is not held), ignored (not "
            "v3), invalid, dropped (follow queues full).",
            ["outcome"],
            registry=r,
        )
        self.stream_nodes = Gauge(
            "cloud_ingest_stream_state_nodes",
            "Nodes whose v3 stream states this replica holds (at most stream.max_nodes).",
            registry=r,
        )
        self.stream_evictions = Counter(
            "cloud_ingest_stream_state_evictions_total",
            "Nodes whose stream states were forgotten to stay within stream.max_nodes (each costs a "
            "need_state later); only nodes idle for 15 minutes are.",
            registry=r,
        )
        self.stream_newcomers_refused = Counter(
            "cloud_ingest_stream_state_newcomers_refused_total",
            "Frames of nodes whose states were not kept because stream.max_nodes nodes were all "
            "active in the last 15 minutes (the node's next delta frame is acked need_state).",
            registry=r,
        )
        self.fleet_collector = FleetCollector(self.fleet)
        r.register(self.fleet_collector)
        self.fleet.on_forget(self._forget)

    def observe_batch_age(self, stage: str, batch: Batch) -> None:
        """``cloud_ingest_batch_age_seconds{stage}``: how old the batch's newest sample is now."""
        self.batch_age.labels(stage).observe(max(0.0, time.time() - batch.last_timestamp_ms / 1000))

    def dropped_for(self, target: str) -> None:
        """An optional target's queue was full: a batch it does not get."""
        self.target_dropped.labels(target).inc()

    def config_error(self, status: int) -> None:
        """A receiver's answer that says its address, credentials or limits are wrong."""
        self.config_errors.labels(str(status)).inc()

    def _forget(self, keys: list[NodeKey]) -> None:
        """Drop the ``{node}``-only series of forgotten nodes (unless a node of that name remains)."""
        remaining = {node for _, node in self.fleet.node_keys()}
        for _, node in keys:
            if node in remaining:
                continue
            for counter in (self.samples_written, self.batches_written, self.identity_overridden):
                with contextlib.suppress(KeyError):
                    counter.remove(node)


_NODE = ("cluster", "node")

# name -> (help, NodeView attribute or a function of the view); absent (None) values are not exported.
_NODE_GAUGES: dict[str, tuple[str, str]] = {
    "cloud_ingest_node_last_status_timestamp_seconds": (
        "When this ingester last heard the node's status (a retained one counts at the node's own ts).",
        "status_heard",
    ),
    "cloud_ingest_node_last_heard_timestamp_seconds": (
        "When this ingester last heard of the node at all: status, batch or an ack of any replica.",
        "last_heard",
    ),
    "cloud_ingest_node_backlog_batches": ("Spool rows the node reported in its last status.", "spool_rows"),
    "cloud_ingest_node_backlog_bytes": ("Spool bytes the node reported in its last status.", "spool_bytes"),
    "cloud_ingest_node_backlog_samples": (
        "Samples in the node's spool, as reported in its last status.",
        "spool_samples",
    ),
    "cloud_ingest_node_oldest_unsent_timestamp_seconds": (
        "Unix time of the oldest sample the node had not sent, as reported (absent: none).",
        "oldest_unsent",
    ),
    "cloud_ingest_node_inflight_batches": (
        "Batches published and not yet acknowledged, as reported.",
        "inflight",
    ),
    "cloud_ingest_node_quarantined_rows": ("Corrupt spool rows the node reported.", "quarantined_rows"),
    "cloud_ingest_node_reported_lost_samples": (
        "lost_samples of the node's last status that carried it: its loss ledger total over all reasons "
        "(0 when nothing was lost, so growth shows; the breakdown is cloud_ingest_node_lost_samples).",
        "lost_samples",
    ),
    "cloud_ingest_node_budget_bytes_per_second": (
        "The node's uplink budget, as reported.",
        "budget_bytes_per_s",
    ),
    "cloud_ingest_node_wire_bytes_per_second": (
        "The node's uplink rate, as reported.",
        "wire_bytes_per_s",
    ),
    "cloud_ingest_node_degrade_level": ("The node's degrade level, as reported.", "degrade_level"),
    "cloud_ingest_node_anomaly_events": (
        "Anomaly events (window onsets) the node's relay reported since it started.",
        "anomaly_events",
    ),
    "cloud_ingest_node_anomaly_windows": (
        "Anomaly windows open on the node, as reported.",
        "anomaly_windows",
    ),
    "cloud_ingest_node_anomaly_last_event_timestamp_seconds": (
        "Unix time of the node's last anomaly event, as reported.",
        "anomaly_last_event",
    ),
    "cloud_ingest_node_last_batch_timestamp_seconds": (
        "Unix time of the newest sample written for a node.",
        "last_batch_ts",
    ),
    "cloud_ingest_node_last_batch_received_timestamp_seconds": (
        "When this ingester last wrote a batch of the node.",
        "last_batch_received",
    ),
    "cloud_ingest_node_last_seq": ("Highest batch seq written for a node.", "highest_written"),
    "cloud_ingest_node_seq_gaps": (
        "Seqs below the highest seen, missing for over 2 min and not covered by the reported backlog "
        "(a lower bound; absent when this replica cannot see every seq).",
        "seq_gaps",
    ),
}

_NODE_COUNTERS: dict[str, tuple[str, str]] = {
    "cloud_ingest_node_samples_written": (
        "Samples of the node accepted by the remote-write receiver.",
        "samples_written",
    ),
    "cloud_ingest_node_batches_written": (
        "Batches of the node accepted by the remote-write receiver.",
        "batches_written",
    ),
    "cloud_ingest_node_dead_letters": (
        "Batches of the node put into the dead-letter store (refused or rejected by the receiver).",
        "dead_letters",
    ),
    "cloud_ingest_node_batches_refused": (
        "Batches of the node refused as invalid (a part of the dead letters).",
        "refused",
    ),
}


class FleetCollector(Collector):
    """Exports the fleet model at scrape time.

    Per node (labels ``cluster``, ``node``): the gauges of ``_NODE_GAUGES`` and the counters of
    ``_NODE_COUNTERS``, ``cloud_ingest_node_online`` (1 online / 0 offline, from the last status),
    ``cloud_ingest_node_lost_samples{reason}`` (the node's loss ledger totals; ``unknown`` for a total
    not broken down by reason), ``cloud_ingest_node_budget_info{budget_state}`` and
    ``cloud_ingest_node_state{state}`` (1 for the current verdict, 0 for the other three). Fleet-wide:
    ``cloud_ingest_fleet_nodes{state}`` and ``cloud_ingest_fleet_seq_view_complete``.
    """

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def describe(self) -> Iterable[Metric]:
        return list(self._families([], complete=True))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self.fleet.snapshot(), complete=self.fleet.complete_view))

    def _families(self, views: list[NodeView], *, complete: bool) -> Iterator[Metric]:
        for name, (doc, attr) in _NODE_GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=_NODE)
            for v in views:
                value = getattr(v, attr)
                if value is not None:
                    gauge.add_metric([v.cluster, v.node], float(value))
            yield gauge
        for name, (doc, attr) in _NODE_COUNTERS.items():
            counter = CounterMetricFamily(name, doc, labels=_NODE)
            for v in views:
                counter.add_metric([v.cluster, v.node], float(getattr(v, attr)))
            yield counter
        online = GaugeMetricFamily(
            "cloud_ingest_node_online",
            "1 if the node's retained status says online, 0 if offline (last will).",
            labels=_NODE,
        )
        lost = GaugeMetricFamily(
            "cloud_ingest_node_lost_samples",
            "Samples the node's loss ledger says it dropped or merged away, by reason (as reported).",
            labels=[*_NODE, "reason"],
        )
        budget = GaugeMetricFamily(
            "cloud_ingest_node_budget_info",
            "1, with the budget state the node reported.",
            labels=[*_NODE, "budget_state"],
        )
        state = GaugeMetricFamily(
            "cloud_ingest_node_state",
            "1 for the node's current verdict: ok, offline_buffering, losing_data, offline_unknown.",
            labels=[*_NODE, "state"],
        )
        counts = dict.fromkeys(VERDICTS, 0)
        for v in views:
            labels = [v.cluster, v.node]
            if v.state is not None:
                online.add_metric(labels, 1.0 if v.state == "online" else 0.0)
            for reason, samples in v.lost_reasons.items():
                lost.add_metric([*labels, reason], float(samples))
            rest = (v.lost_samples or 0) - sum(v.lost_reasons.values())
            if rest > 0:
                lost.add_metric([*labels, "unknown"], float(rest))
            if v.budget_state is not None:
                budget.add_metric([*labels, v.budget_state], 1.0)
            for verdict in VERDICTS:
                state.add_metric([*labels, verdict], 1.0 if v.verdict == verdict else 0.0)
            counts[v.verdict] += 1
        yield from (online, lost, budget, state)
        nodes = GaugeMetricFamily(
            "cloud_ingest_fleet_nodes", "Nodes known to this ingester, by verdict.", labels=["state"]
        )
        for verdict, count in counts.items():
            nodes.add_metric([verdict], float(count))
        yield nodes
        yield GaugeMetricFamily(
            "cloud_ingest_fleet_seq_view_complete",
            "1 when this replica sees every seq of every node (all batches, or every replica's acks), "
            "so cloud_ingest_node_seq_gaps is defined.",
            value=1.0 if complete else 0.0,
        )
