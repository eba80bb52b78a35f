"""Every target scraped, parsed and shaped once a cycle, in parallel.

``TargetLoop`` is one target's read (its source: an exporter's page, scrape -> parse, or the node's GPUs
through NVML) -> shape, with the state that lives across cycles (the source's, the shaper's previous
series for stale markers, the last error logged). ``Collector`` runs every target's loop on a pool, one
thread per target, so a slow target costs only its own scrape (each is bounded by one wall-clock deadline
for the whole read); it puts what the shape stage
dropped sample by sample into the loss ledger, and says so when the wall clock stepped back since the
last cycle (samples are stamped with it).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from edge_relay.collect.nvml import NvmlSource
from edge_relay.collect.shape import ShapedScrape, TargetShaper, fill_labels_for
from edge_relay.collect.source import HttpSource
from edge_relay.ledger import LossLedger, LossReason
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import Settings, Target

log = logging.getLogger("edge_relay")


class TargetLoop:
    """Read -> shape for one target; state (the source's, previous series) lives here."""

    def __init__(self, target: Target, s: Settings, metrics: RelayMetrics) -> None:
        self.target = target
        self.metrics = metrics
        self.sample_limit = s.sample_limit
        self.timeout_s = s.timeout_seconds
        # What the target is read from: an exporter's page, or the node's GPUs through NVML.
        self.scraper: HttpSource | NvmlSource
        if target.kind == "nvml":
            self.scraper = NvmlSource(s.node, s.timeout_seconds)
        else:
            self.scraper = HttpSource(
                target.url,
                fmt=target.format,
                timeout_s=s.timeout_seconds,
                body_limit_bytes=s.body_limit_bytes,
            )
        target_labels = {"job": target.job, "instance": target.instance, **target.labels}
        self.shaper = TargetShaper(
            target.name,
            {k: v for k, v in target_labels.items() if v},  # relabel_configs may have removed `job`
            fill_labels_for(s.cluster, s.node, s.add_node_labels, s.external_labels),
            metric_relabel=target.metric_relabel,
        )
        self._last_error = ""
        self._relabel_error = ""

    def run_once(self) -> ShapedScrape:
        # One wall-clock deadline for the whole read (fetch and parse, or NVML): a huge body's parse must
        # not hold up the cycle, and with it every other target, beyond the scrape timeout.
        deadline = time.monotonic() + self.timeout_s
        reading = self.scraper.read(deadline, self.sample_limit)
        samples, error, result = reading.samples, reading.error, reading.result
        duration = time.time() - reading.timestamp_ms / 1000
        if samples is None:
            # Log a failing target once per distinct error, not every interval.
            if error != self._last_error:
                log.error("scrape of %s (%s) failed: %s", self.target.name, self.target.url, error)
            self._last_error = error
            self.metrics.scrape_failed(self.target.name, error, time.time())
        elif self._last_error:
            log.info("scrape of %s recovered", self.target.name)
            self._last_error = ""
        self.metrics.scrapes.labels(self.target.name, result).inc()
        self.metrics.scrape_duration.labels(self.target.name).observe(duration)
        if samples is not None:
            self.metrics.samples_scraped.labels(self.target.name).inc(len(samples))
        shaped = self.shaper.shape(reading.timestamp_ms, samples, duration)
        self.metrics.stale_markers.inc(shaped.stale_markers)
        if shaped.relabel_dropped:
            self.metrics.samples_relabel_dropped.labels(self.target.name).inc(shaped.relabel_dropped)
        if shaped.relabel_error:
            self.metrics.scrape_failed(self.target.name, shaped.relabel_error, time.time())
        if shaped.relabel_error != self._relabel_error:  # logged once per distinct error
            if shaped.relabel_error:
                log.error("scrape of %s failed: %s", self.target.name, shaped.relabel_error)
            self._relabel_error = shaped.relabel_error
        return shaped


class Collector:
    def __init__(self, s: Settings, metrics: RelayMetrics, ledger: LossLedger) -> None:
        self.metrics = metrics
        self.ledger = ledger
        self.loops = [TargetLoop(t, s, metrics) for t in s.targets]
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.loops)), thread_name_prefix="scrape")
        self._last_cycle_at: float | None = None

    def collect(self) -> list[ShapedScrape]:
        """One scrape of every target, shaped; what shaping dropped is in the ledger."""
        self.watch_clock(time.time())
        shaped = list(self.pool.map(lambda loop: loop.run_once(), self.loops))
        self._record_dropped(shaped)
        return shaped

    def _record_dropped(self, shaped: list[ShapedScrape]) -> None:
        for s in shaped:
            job, ts = f'{{job="{s.target}"}}', s.timestamp_ms
            for reason, samples in (
                (LossReason.DUPLICATE_SERIES, s.duplicates),
                (LossReason.LABEL_LIMITS, s.over_label_limits),
                (LossReason.INVALID_TIMESTAMP, s.invalid_timestamps),
            ):
                if samples:
                    self.ledger.record(reason, job, ts, ts, samples)

    def watch_clock(self, now: float) -> None:
        """Say so when the wall clock went back (samples are stamped with it, so the receiver gets
        them at the stepped time; the budget shaper resets its series state on its own)."""
        last, self._last_cycle_at = self._last_cycle_at, now
        if last is not None and now < last - 1.0:
            self.metrics.clock_steps_back.inc()
            log.warning(
                "the wall clock went back by %.1fs since the last cycle (NTP, a manual fix?): samples are "
                "stamped with the new time; Prometheus needs its out-of-order window for the overlap",
                last - now,
            )

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for loop in self.loops:
            loop.scraper.close()
