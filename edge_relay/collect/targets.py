"""Every target scraped, parsed and shaped once a cycle, in parallel.

``TargetLoop`` is one target's read (its source: an exporter's page, scrape -> parse, or the node's GPUs
through NVML) -> shape, with the state that lives across cycles (the source's, the shaper's previous
series for stale markers, the last error logged). ``Collector`` runs every target's loop on a pool, one
thread per target, so a slow target costs only its own scrape (each read is bounded by one wall-clock
deadline); it puts what the shape stage dropped sample by sample into the loss ledger, and says so when
the wall clock stepped back since the last cycle (samples are stamped with it).

A cycle waits for its targets until the scrape timeout and a little more (``SHAPING_GRACE_S``, at most
half of what the interval leaves): reads end at the timeout, so what runs later is shaping, tens of
thousands of new series to relabel and check (a rollout, pod churn). Such a target finishes in the
background and its scrape joins the first cycle after; it is not scraped again meanwhile. Its time is
its own, never its neighbours' (as in Prometheus, where each target has a scrape loop of its own), and
its samples arrive late rather than never: at shutdown a scrape still at work is waited for.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from edge_relay.collect.nvml import NvmlSource
from edge_relay.collect.shape import ShapedScrape, TargetShaper, fill_labels_for
from edge_relay.collect.source import HttpSource
from edge_relay.ledger import LossLedger, LossReason
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import Settings, Target

log = logging.getLogger("edge_relay")
# How long past the scrape timeout a cycle waits for a target still at work.
SHAPING_GRACE_S = 0.25


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

    @property
    def last_error(self) -> str:
        """Why the last scrape failed ("" when it worked): the fetch, the parse or the relabeling."""
        return self._last_error or self._relabel_error

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
        self._wait_s = s.timeout_seconds + min(
            SHAPING_GRACE_S, max(0.0, s.interval_seconds - s.timeout_seconds) / 2
        )
        self._running: dict[TargetLoop, Future[ShapedScrape]] = {}  # at most one scrape per target
        self._missed: set[TargetLoop] = set()  # their running scrape missed the cycle it began in
        self._slow: set[str] = set()  # targets said to be slow, until a scrape makes its cycle again
        self._last_cycle_at: float | None = None

    @property
    def busy(self) -> bool:
        """A target's scrape is still at work (it joins the next cycle)."""
        return bool(self._running)

    def collect(self) -> list[ShapedScrape]:
        """This cycle's scrapes, shaped, in config order: every target not still busy with its last
        scrape is scraped, and a late scrape from an earlier cycle joins; what shaping dropped is in
        the ledger."""
        self.watch_clock(time.time())
        return self._gather(self._wait_s)

    def collect_remaining(self) -> list[ShapedScrape]:
        """At shutdown: the scrapes still at work, waited for (nothing new is scraped)."""
        return self._gather(None)

    def _gather(self, timeout: float | None) -> list[ShapedScrape]:
        if timeout is not None:
            for loop in self.loops:
                if loop not in self._running:
                    self._running[loop] = self.pool.submit(loop.run_once)
        wait(self._running.values(), timeout=timeout)
        shaped = []
        for loop in self.loops:
            future = self._running.get(loop)
            if future is None:
                continue
            name = loop.target.name
            if not future.done():
                self._missed.add(loop)
                if name not in self._slow:
                    self._slow.add(name)
                    log.warning(
                        "target %s is still shaping its scrape after the scrape timeout (many new "
                        "series?): it goes out with a later cycle, and is not scraped until it is done",
                        name,
                    )
                continue
            del self._running[loop]
            if loop in self._missed:
                self._missed.discard(loop)
            elif name in self._slow:
                self._slow.discard(name)
                log.info("target %s is shaped within its cycle again", name)
            shaped.append(future.result())
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
