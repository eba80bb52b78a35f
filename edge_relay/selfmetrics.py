"""The relay's own metrics (``edge_relay_*``), defined once for every stage.

Each relay process gets its own registry so tests can run several relays in one interpreter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class SpoolReading(Protocol):
    """What the spool gauges read (``edge_relay.store.spool.SpoolStats``)."""

    rows: int
    bytes: int
    quarantined_rows: int
    oldest_first_ts_ms: int | None


# The budget controller's states (``Controller.state``), each a series of edge_relay_budget_state.
BUDGET_STATES = ("ok", "degraded", "backlogged", "quota_exhausted")
# A scrape error as a label value: long enough to tell errors apart, short enough for a label.
ERROR_LABEL_CHARS = 120
# Why the broker connection failed, as a label value (``edge_relay.uplink.mqtt`` classifies): a fixed
# set, so every reason's series exists from the start and a dashboard can rely on it.
MQTT_ERROR_REASONS = (
    "connection_refused",  # nothing listens on the broker's port
    "dns",  # the broker's host name does not resolve
    "timeout",  # no TCP connection, no CONNACK, or no keepalive answer in time
    "tls",  # the TLS handshake failed (an untrusted or expired certificate, a wrong host name)
    "not_authorized",  # CONNACK: bad user name or password, not authorised
    "protocol",  # CONNACK: the broker does not speak the MQTT version asked for
    "closed",  # the broker closed the connection (before its CONNACK, or while connected)
    "other",
)


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.scrapes = Counter(
            "edge_relay_scrapes_total", "Scrapes by target and result.", ["target", "result"], registry=r
        )
        self.scrape_duration = Histogram(
            "edge_relay_scrape_duration_seconds",
            "Time to fetch and parse one target.",
            ["target"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.samples_scraped = Counter(
            "edge_relay_samples_scraped_total", "Samples parsed from targets.", ["target"], registry=r
        )
        self.samples_relabel_dropped = Counter(
            "edge_relay_samples_relabel_dropped_total",
            "Scraped samples metric_relabel_configs dropped (by choice, so not in the loss ledger).",
            ["target"],
            registry=r,
        )
        self.samples_spooled = Counter(
            "edge_relay_samples_spooled_total",
            "Samples written to the spool (scraped, synthetic and stale markers).",
            registry=r,
        )
        # edge_relay_samples_dropped_total comes from the loss ledger (see attach_ledger), so it survives
        # restarts and can never disagree with `edge-relay ledger`.
        self._ledger_totals: Callable[[], dict[str, int]] = dict
        r.register(_LedgerCollector(self))
        self.stale_markers = Counter(
            "edge_relay_stale_markers_total", "Stale markers emitted for vanished series.", registry=r
        )
        self.clock_steps_back = Counter(
            "edge_relay_clock_steps_back_total",
            "Times the wall clock went back between two scrape cycles (NTP after boot, a manual fix).",
            registry=r,
        )
        self.batches_spooled = Counter(
            "edge_relay_batches_spooled_total", "Batches written to the spool.", registry=r
        )
        self.batch_bytes = Counter(
            "edge_relay_batch_bytes_total", "Encoded bytes of batches written to the spool.", registry=r
        )
        self.spool_rows = Gauge("edge_relay_spool_rows", "Batches waiting in the spool.", registry=r)
        self.spool_bytes = Gauge(
            "edge_relay_spool_bytes", "Bytes of batches waiting in the spool.", registry=r
        )
        self.spool_max_bytes = Gauge(
            "edge_relay_spool_max_bytes",
            "The spool's size cap (spool.max_bytes; 0 = only the disk limits it).",
            registry=r,
        )
        self.spool_oldest_age = Gauge(
            "edge_relay_spool_oldest_sample_age_seconds",
            "Age of the oldest sample not yet acknowledged by the cloud.",
            registry=r,
        )
        self.spool_quarantined = Gauge(
            "edge_relay_spool_quarantined_rows", "Corrupt spool rows moved to quarantine.", registry=r
        )
        self.spool_errors = Counter(
            "edge_relay_spool_errors_total", "Spool write failures by reason.", ["reason"], registry=r
        )
        self.published = Counter(
            "edge_relay_batches_published_total",
            "Batch publications (first attempts and republications).",
            ["kind"],
            registry=r,
        )
        self.publish_bytes = Counter(
            "edge_relay_publish_payload_bytes_total", "MQTT payload bytes of published batches.", registry=r
        )
        self.stream_frames = Counter(
            "edge_relay_stream_frames_total",
            "Publications by coding: delta and key frames of the v3 stream, or the spooled batch as it is "
            "(self-contained: after need_state, with stream coding off or paused).",
            ["kind"],
            registry=r,
        )
        self.stream_need_state = Counter(
            "edge_relay_stream_need_state_total",
            "Acks need_state: an ingester lacked the state a frame was coded against (the batch is "
            "published again self-contained).",
            registry=r,
        )
        self.stream_enabled = Gauge(
            "edge_relay_stream_enabled",
            "1 while publications are stream-coded (0: off, or paused after an ingester refused v3).",
            registry=r,
        )
        self.acked = Counter(
            "edge_relay_batches_acked_total",
            "Application acks from the cloud by result.",
            ["result"],
            registry=r,
        )
        self.acks_ignored = Counter(
            "edge_relay_acks_ignored_total",
            "Acks the relay did not apply, by reason (other_incarnation: for a spool since recreated).",
            ["reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "edge_relay_inflight_batches", "Batches published and not yet acked.", registry=r
        )
        self.mqtt_connected = Gauge(
            "edge_relay_mqtt_connected", "1 while connected to the broker.", registry=r
        )
        self.mqtt_connects = Counter(
            "edge_relay_mqtt_connect_attempts_total", "Connection attempts by result.", ["result"], registry=r
        )
        # Since when the link is up or down (`edge-relay status` shows it; `time() - x` in PromQL).
        self.mqtt_connected_since = Gauge(
            "edge_relay_mqtt_connected_since_timestamp_seconds",
            "Unix time the current broker connection was established; 0 while disconnected.",
            registry=r,
        )
        self.mqtt_disconnected_since = Gauge(
            "edge_relay_mqtt_disconnected_since_timestamp_seconds",
            "Unix time the broker connection was lost (or the relay started, if never connected since); "
            "0 while connected.",
            registry=r,
        )
        self.mqtt_disconnected_since.set(time.time())
        self._mqtt_up = False
        self.mqtt_errors = Counter(
            "edge_relay_mqtt_connection_errors_total",
            "Failed connection attempts and lost connections to the broker, by reason ("
            + ", ".join(MQTT_ERROR_REASONS)
            + ").",
            ["reason"],
            registry=r,
        )
        self.mqtt_last_error_time = Gauge(
            "edge_relay_mqtt_last_error_timestamp_seconds",
            "Unix time of the last broker connection error of each reason; 0 if none since the relay "
            "started.",
            ["reason"],
            registry=r,
        )
        self.mqtt_last_error = Gauge(
            "edge_relay_mqtt_last_error_info",
            "1, labelled with the reason of the last broker connection error and its message (the first "
            f"{ERROR_LABEL_CHARS} characters); one series, replaced by the next error, kept after the "
            "link is back; absent before the first error.",
            ["reason", "message"],
            registry=r,
        )
        for reason in MQTT_ERROR_REASONS:
            self.mqtt_errors.labels(reason)
            self.mqtt_last_error_time.labels(reason).set(0)
        self._mqtt_error_labels: tuple[str, str] | None = None
        self.last_ack = Gauge(
            "edge_relay_last_ack_timestamp_seconds",
            "Unix time the last application ack from the cloud arrived; 0 if none since the relay started.",
            registry=r,
        )
        self.scrape_last_error = Gauge(
            "edge_relay_scrape_last_error_timestamp_seconds",
            "Unix time of a target's last failed scrape, labelled with that error (its first "
            f"{ERROR_LABEL_CHARS} characters): one series per target, replaced when the error changes and "
            "kept after the target recovers.",
            ["target", "error"],
            registry=r,
        )
        self._error_label: dict[str, str] = {}
        # With ack_latency the two halves of scrape-to-queryable: this one the edge's (scrape, shaping,
        # encoding, spool; a windowed class adds its window, an outage its backlog), that one the rest.
        self.publish_delay = Histogram(
            "edge_relay_publish_delay_seconds",
            "Age of a batch's newest sample (its scrape's start) when the batch is first published.",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 300, 3600),
            registry=r,
        )
        self.ack_latency = Histogram(
            "edge_relay_ack_latency_seconds",
            "Time from the last publication of a batch to its application ack.",
            buckets=(0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 300),
            registry=r,
        )

        # Bandwidth budget (edge_relay.budget: the controller and the pacer).
        self.wire_bytes = Counter(
            "edge_relay_wire_bytes_total",
            "Bytes on the relay's broker connections (TCP payload per the kernel: MQTT framing, batches, "
            "acks, status, TLS), by direction.",
            ["direction"],
            registry=r,
        )
        self.budget_rate = Gauge(
            "edge_relay_budget_bytes_per_second",
            "Uplink bytes/s the budget allows now (time window and daily quota applied); 0 without a budget "
            "file, and once a daily quota is used up (the relay then sends nothing until the next day).",
            registry=r,
        )
        self.budget_burst = Gauge("edge_relay_budget_burst_bytes", "Burst the budget allows.", registry=r)
        self.budget_quota_used = Gauge(
            "edge_relay_budget_quota_used_bytes", "Wire bytes counted against today's quota.", registry=r
        )
        self.budget_paced = Counter(
            "edge_relay_budget_paced_seconds_total",
            "Time batches waited because the budget's byte rate was used up.",
            registry=r,
        )
        self.budget_level = Gauge(
            "edge_relay_budget_degrade_level",
            "Degrade level of a budget class (0 = as configured; each level doubles the resolution).",
            ["class"],
            registry=r,
        )
        self.budget_resolution = Gauge(
            "edge_relay_budget_resolution_seconds",
            "Resolution a budget class runs at now.",
            ["class"],
            registry=r,
        )
        self.budget_steps = Counter(
            "edge_relay_budget_degrade_steps_total",
            "Controller steps by class and direction (degrade / restore).",
            ["class", "direction"],
            registry=r,
        )
        self.budget_samples = Counter(
            "edge_relay_budget_samples_total",
            "Samples through the budget's classes by outcome: sent, suppressed (unchanged value within the "
            "heartbeat), merged (folded into an aggregate or dropped by the class resolution).",
            ["class", "outcome"],
            registry=r,
        )
        self.budget_rounded = Counter(
            "edge_relay_budget_precision_rounded_total",
            "Samples whose value the class precision changed.",
            ["class"],
            registry=r,
        )
        self.budget_reloads = Counter(
            "edge_relay_budget_reloads_total", "Budget file reloads by result.", ["result"], registry=r
        )
        self.budget_state = Gauge(
            "edge_relay_budget_state",
            "1 for the budget controller's state now (ok, degraded, backlogged, quota_exhausted), 0 for the "
            "others; absent without a budget file.",
            ["state"],
            registry=r,
        )

        # The flight recorder (edge_relay.recorder.flight): raw scrapes kept on the node, not sent.
        self.recorder_samples = Counter(
            "edge_relay_recorder_samples_total",
            "Samples the flight recorder stored at full resolution (raw scrapes, before the budget).",
            registry=r,
        )
        self.recorder_evicted = Counter(
            "edge_relay_recorder_evicted_samples_total",
            "Samples the flight recorder gave up, by reason (max_age, max_bytes, backlog_room: the unsent "
            "backlog or a full disk needed the room). Not losses: they were sent at the budget's resolution.",
            ["reason"],
            registry=r,
        )
        self.recorder_bytes = Gauge(
            "edge_relay_recorder_bytes", "Bytes of blocks the flight recorder holds (payloads).", registry=r
        )
        self.recorder_oldest = Gauge(
            "edge_relay_recorder_oldest_timestamp_seconds",
            "Unix time of the oldest sample the flight recorder holds; 0 when it holds none.",
            registry=r,
        )
        self.recorder_errors = Counter(
            "edge_relay_recorder_errors_total",
            "Flight recorder operations that failed (best effort: the cycle and the backlog go on), by op.",
            ["op"],
            registry=r,
        )
        # Anomaly detection (edge_relay.anomaly.detector), with a budget file's `anomaly` section only.
        self.anomaly_score = Gauge(
            "edge_relay_anomaly_score",
            "The GPU's EWMA z-score over its signals this scrape (max over signals; dimensionless); "
            'gpu="node", vendor="node": the node\'s own detector.',
            ["gpu", "vendor"],
            registry=r,
        )
        self.anomaly_events = Counter(
            "edge_relay_anomaly_events_total",
            "Anomaly events (onsets: a detection that opens a window, or would with fewer open), by GPU "
            '(gpu="node": the node\'s detector), '
            "kind (thermal, power, memory, xid, ecc, remap, throttle, score) and the rule that fired.",
            ["gpu", "kind", "rule"],
            registry=r,
        )
        self.anomaly_window_active = Gauge(
            "edge_relay_anomaly_window_active",
            "1 while the GPU's series go at full resolution because of an anomaly window "
            '(gpu="node": the node-level series).',
            ["gpu"],
            registry=r,
        )
        self.anomaly_window_samples = Counter(
            "edge_relay_anomaly_window_samples_total",
            "Samples sent at full resolution for anomaly windows: past (from the flight recorder) and "
            "live (exempt from the budget's degradation).",
            ["part"],
            registry=r,
        )
        # Commands from the ingester (edge_relay.recorder.backfill): backfill requests and what became
        # of them.
        self.commands = Counter(
            "edge_relay_commands_total",
            "Commands received on the node's cmd topic, by kind (backfill; unknown when undecodable) and "
            "result (done, refused, busy, malformed, failed).",
            ["kind", "result"],
            registry=r,
        )
        self.backfill_samples = Counter(
            "edge_relay_backfill_samples_total",
            "Raw samples the flight recorder supplied to backfill requests, spooled as ordinary batches.",
            registry=r,
        )

    def observe_mqtt(self, connected: bool, now_s: float) -> None:
        """The broker connection is up or down; the since-gauges move only when that changes."""
        self.mqtt_connected.set(1 if connected else 0)
        if connected == self._mqtt_up:
            return
        self._mqtt_up = connected
        self.mqtt_connected_since.set(now_s if connected else 0)
        self.mqtt_disconnected_since.set(0 if connected else now_s)

    def mqtt_failed(self, reason: str, message: str, now_s: float) -> None:
        """A connection attempt failed or the connection was lost, for ``reason`` (MQTT_ERROR_REASONS)."""
        if reason not in MQTT_ERROR_REASONS:
            reason = "other"
        labels = (reason, " ".join(message.split())[:ERROR_LABEL_CHARS])
        if self._mqtt_error_labels is not None and self._mqtt_error_labels != labels:
            self.mqtt_last_error.remove(*self._mqtt_error_labels)
        self._mqtt_error_labels = labels
        self.mqtt_last_error.labels(*labels).set(1)
        self.mqtt_last_error_time.labels(reason).set(now_s)
        self.mqtt_errors.labels(reason).inc()

    def scrape_failed(self, target: str, error: str, now_s: float) -> None:
        """A failed scrape of ``target``: its one last-error series now carries ``error``."""
        label = " ".join(error.split())[:ERROR_LABEL_CHARS]
        previous = self._error_label.get(target)
        if previous is not None and previous != label:
            self.scrape_last_error.remove(target, previous)
        self._error_label[target] = label
        self.scrape_last_error.labels(target, label).set(now_s)

    def observe_budget_state(self, state: str) -> None:
        for s in BUDGET_STATES:
            self.budget_state.labels(s).set(1 if s == state else 0)

    def observe_spool(self, st: SpoolReading, now_s: float) -> None:
        """The spool gauges, from one ``Spool.stats()`` reading."""
        self.spool_rows.set(st.rows)
        self.spool_bytes.set(st.bytes)
        self.spool_quarantined.set(st.quarantined_rows)
        oldest = st.oldest_first_ts_ms
        self.spool_oldest_age.set(0.0 if oldest is None else max(0.0, now_s - oldest / 1000))

    def attach_ledger(self, totals: Callable[[], dict[str, int]]) -> None:
        """Where edge_relay_samples_dropped_total reads its numbers: samples by reason."""
        self._ledger_totals = totals


class _LedgerCollector(Collector):
    def __init__(self, metrics: RelayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "edge_relay_samples_dropped",
            "Samples dropped or merged away on purpose or by force, by reason (the loss ledger's totals).",
            labels=["reason"],
        )
        try:
            totals = self.metrics._ledger_totals()
        except Exception:  # a scrape of /metrics must not fail because the spool is busy
            totals = {}
        for reason, samples in sorted(totals.items()):
            family.add_metric([reason], samples)
        yield family
