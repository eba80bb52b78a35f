"""``edge-relay run``: builds the stages in dependency order and runs the scrape loop.

Stages in the order a sample passes them (one module each):
``scrape`` -> ``parse`` -> ``shape`` (target labels, ``up``, stale markers; with a budget file also
``budget.shaper``'s classes) -> ``encode`` -> ``spool`` (through ``sink``, and with a budget through
``window``'s batch windows) -> ``uplink`` (through ``stream``: v3 frames in publication order).
``Relay`` builds each part once, before the parts that need it, and hands it over: the spool and the
ledger first, the flight recorder (a table of the spool), then retention, the stream coder and the sink
(which hands the coder the batches it spooled), the budget (shaper, controller, and the pacer it shares
with the uplink), the window, the status report, the command inbox and the backfiller (``backfill``:
backfill requests the uplink receives, answered from the recorder through the sink), and last the
uplink.
Data flows one way; no part calls back into ``Relay``.

Scrapes run on a fixed grid of ``interval_seconds``; all targets of one tick are scraped in parallel
and their samples go into the spool before the uplink is woken. A cycle that overruns skips the grid
points it missed instead of scraping in a burst. A cycle waits for its targets until the scrape
timeout (and a little more): fetch and parse end there, and a target still shaping then (tens of
thousands of new series to relabel and check) finishes in the background and joins a later cycle, so
one target's new series never cost the others their scrapes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from edge_relay import settings as settings_mod
from edge_relay.anomaly import detector as anomaly_mod
from edge_relay.anomaly.pastparts import PastParts
from edge_relay.budget.model import PRESET_COUNTERS
from edge_relay.budget.runtime import BudgetRuntime
from edge_relay.collect.parse import (
    ParseDeadlineExceeded,
    ParseError,
    SampleLimitExceeded,
    SeriesCache,
    parse,
)
from edge_relay.collect.scrape import Fetched, Scraper
from edge_relay.collect.shape import ShapedScrape, TargetShaper, fill_labels_for
from edge_relay.commands import checkconfig
from edge_relay.encode.batches import BatchEncoder, dedupe_window
from edge_relay.encode.window import BatchWindow
from edge_relay.ledger import LossLedger, LossReason
from edge_relay.recorder.backfill import Backfiller, CommandInbox
from edge_relay.recorder.flight import FlightRecorder
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import Settings, Target
from edge_relay.store.held import HeldWindows
from edge_relay.store.retention import Policy, Retention
from edge_relay.store.sink import SpoolSink
from edge_relay.store.spool import InFlight, SendQueue, Spool, SpoolError
from edge_relay.uplink.mqtt import Uplink
from edge_relay.uplink.pacer import Pacer
from edge_relay.uplink.status import StatusReport
from edge_relay.uplink.stream import RecentBatches, StreamCoder
from relay_common.httpserver import MetricsServer
from schemas import codec
from schemas.model import Batch

log = logging.getLogger("edge_relay")
# Rows waiting at the end of a cycle up to which the live lane still spools the quick form (v1).
_LIVE_WAITING_ROWS = 4
# At most this long a cycle's housekeeping waits for its row to be published: the pass publishes the
# fresh row first (~0.1 s of stream coding at 20,000 series), then backlog rows, which need not wait.
_PUBLISH_WAIT_S = 0.5
_GC_THRESHOLDS = (50_000, 20, 100)  # gen0 allocations, gen0 passes per gen1, gen1 passes per gen2
# How long past the scrape timeout a cycle waits for a target still at work (at most half of what the
# interval leaves): fetch and parse end at the timeout, so what runs later is shaping (many new series),
# which then finishes in the background.
_SHAPING_GRACE_S = 0.25


class TargetLoop:
    """Scrape -> parse -> shape for one target; state (caches, previous series) lives here."""

    def __init__(self, target: Target, s: Settings, metrics: RelayMetrics) -> None:
        self.target = target
        self.metrics = metrics
        self.sample_limit = s.sample_limit
        self.timeout_s = s.timeout_seconds
        self.scraper = Scraper(
            target.url, fmt=target.format, timeout_s=s.timeout_seconds, body_limit_bytes=s.body_limit_bytes
        )
        self.cache = SeriesCache()
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
        # One wall-clock deadline for fetch and parse: a huge body's parse must not hold up the cycle,
        # and with it every other target, beyond the scrape timeout.
        deadline = time.monotonic() + self.timeout_s
        fetched: Fetched = self.scraper.fetch()
        samples = None
        result = "ok"
        error = fetched.error
        if fetched.ok:
            try:
                samples = parse(
                    fetched.body, fetched.content_type, self.cache, self.sample_limit, deadline=deadline
                )
            except SampleLimitExceeded as e:
                error, result = str(e), "sample_limit"
            except ParseDeadlineExceeded as e:
                error, result = str(e), "timeout"
            except ParseError as e:
                error, result = f"cannot parse exposition: {e}", "parse_error"
        else:
            result = "http_error"
        duration = time.time() - fetched.timestamp_ms / 1000
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
        shaped = self.shaper.shape(fetched.timestamp_ms, samples, duration)
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


class Relay:
    def __init__(self, s: Settings, metrics: RelayMetrics | None = None) -> None:
        self.settings = s
        self.metrics = metrics or RelayMetrics()
        self.spool = Spool(s.spool_path, synchronous=s.spool_synchronous, max_bytes=s.spool_max_bytes or None)
        self.ledger = LossLedger(self.spool.losses)
        # Before anything is shaped: what the last run's open aggregation windows held, if it was killed.
        self.held = HeldWindows(self.spool.meta, self.ledger)
        self.held.recover(sorted({t.job for t in s.targets if t.job}))
        self.metrics.spool_max_bytes.set(s.spool_max_bytes)
        self.metrics.attach_ledger(self.ledger.totals)
        # The flight recorder keeps every raw scrape in the spool file, in room the backlog does not need:
        # it leaves a batch window's worth free (twice batch.max_bytes, at least 2 MiB) under the cap.
        self.recorder = FlightRecorder(
            self.spool.recorder,
            cluster=s.cluster,
            node=s.node,
            max_bytes=s.recorder_max_bytes,
            max_age_ms=int(s.recorder_max_age_seconds * 1000),
            interval_ms=int(s.interval_seconds * 1000),
            block_ms=int(s.recorder_block_seconds * 1000),
            reserve_bytes=max(2 << 20, 2 * s.batch_max_bytes),
            spool_max_bytes=s.spool_max_bytes,
            metrics=self.metrics,
        )
        self.loops = [TargetLoop(t, s, self.metrics) for t in s.targets]
        self.encoder = BatchEncoder(
            s.cluster,
            s.node,
            max_bytes=s.batch_max_bytes,
            zstd_level=s.zstd_level,
            version=s.format_version,
            incarnation=self.spool.incarnation,
        )
        self.inflight = InFlight()
        # What the sink spools, the uplink publishes stream-coded (edge_relay.uplink.stream); the sink hands
        # it the batches it just spooled so that they need no decoding.
        recent = RecentBatches()
        self.stream = StreamCoder(
            s.cluster,
            s.node,
            recent=recent,
            metrics=self.metrics,
            enabled=s.stream_enabled,
            keyframe_every=s.stream_keyframe_every,
            level=s.zstd_level,
            interval_s=s.interval_seconds,
        )
        # Paces the uplink (unlimited unless a budget configures it) and meters its connection's bytes.
        self.pacer = Pacer(self.metrics)
        self.budget: BudgetRuntime | None = None
        if s.budget_file:
            self.budget = BudgetRuntime(
                s.budget_file,
                interval_s=s.interval_seconds,
                batch_max_bytes=s.batch_max_bytes,
                encoder=self.encoder,
                pacer=self.pacer,
                meta=self.spool.meta,
                metrics=self.metrics,
                to_wire=self.stream.wire_bytes,
            )
        self.retention = Retention(
            self.spool,
            Policy(
                cap_bytes=s.spool_cap_bytes,
                max_age_ms=int(s.spool_max_age_seconds * 1000),
                max_factor=s.spool_max_degrade_factor,
                interval_ms=int(s.interval_seconds * 1000),
                busy_ms=int(s.mqtt.ack_timeout_seconds * 1000),
                counters=PRESET_COUNTERS if self.budget is None else self.budget.counters,
            ),
            encoder=self.encoder,
            inflight=self.inflight,
        )
        self.sink = SpoolSink(self.spool, self.retention, self.ledger, self.encoder, self.metrics, recent)
        # Built with or without a budget: cycles staged under an earlier, windowed budget (before a
        # restart without one) must still be resumed and shipped, never left in staging for ever.
        self.window = BatchWindow(
            self.spool.staging,
            self.sink,
            self.encoder,
            self.ledger,
            cluster=s.cluster,
            node=s.node,
            window_ms=self.budget.window_ms if self.budget is not None else int(s.interval_seconds * 1000),
        )
        self.window.resume()
        controller = self.budget.controller if self.budget is not None else None
        # Anomaly windows' past part: the recorder's raw samples of the GPU, spooled through the sink.
        self.past = PastParts(self.recorder, self.sink, s.interval_seconds, self.encoder)
        if self.budget is not None and self.budget.anomaly is not None and not s.recorder_max_bytes:
            log.warning("anomaly windows get no past part: the flight recorder is off (recorder.max_bytes 0)")
        self.status = StatusReport(self.spool, self.ledger, controller, anomaly=self._anomaly_status)
        # Backfill requests: the uplink puts them in the inbox, the loop answers them from the recorder
        # through the sink (a quarter of an interval of work per cycle at most).
        self.commands = CommandInbox(s.cluster, s.node, self.metrics)
        self.backfill = Backfiller(
            self.commands,
            self.recorder,
            self.sink,
            self.encoder,
            self.metrics,
            step_seconds=s.interval_seconds / 4,
            spool_max_age_ms=int(s.spool_max_age_seconds * 1000),
        )
        self.uplink = Uplink(
            s.mqtt,
            cluster=s.cluster,
            node=s.node,
            queue=SendQueue(
                self.spool.batches,
                order=s.mqtt.order,
                inflight_limit=s.mqtt.inflight_batches,
                live_window_s=s.interval_seconds,
            ),
            inflight=self.inflight,
            metrics=self.metrics,
            status=self.status,
            pacer=self.pacer,
            commands=self.commands,
            stream=self.stream,
        )
        self.stop_event = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.loops)), thread_name_prefix="scrape")
        self._running: dict[TargetLoop, Future[ShapedScrape]] = {}  # at most one scrape per target
        self._missed: set[TargetLoop] = set()  # their running scrape missed the cycle it began in
        self._slow: set[str] = set()  # targets said to be slow, until a scrape makes its cycle again
        self.cycles = 0
        self._last_cycle_at: float | None = None
        self._waiting_rows = 0  # spooled rows not acked yet, at the end of the last cycle

    def _spool(self, shaped: list[ShapedScrape]) -> tuple[int, list[bytes]]:
        """One cycle's scrapes into the spool: staged in the open batch window, or as batches of their
        own. Returns the samples spooled and, when every scrape went out as live batches, their
        payloads (the flight recorder keeps those bytes rather than encoding the cycle again)."""
        budget, window = self.budget, self.window
        if budget is not None and budget.windowed:
            window.window_ms = budget.window_ms  # a reload may have changed it
            live, shaped = budget.split_live(shaped)
            spooled = self._append_cycle(live)[0] if live else 0
            try:
                staged, packed = window.add(shaped)
                packed += window.close_if_due(int(time.time() * 1000))
            except SpoolError as e:
                log.error("cannot stage this cycle: %s", e)
                return spooled, []
            budget.produced(packed)
            return spooled + staged, []
        if window.open:
            # Staged under a windowed budget no longer in force (a restart without a budget, a window
            # reloaded down to one interval): pack them now, before this cycle, so they go out first.
            try:
                packed = window.pack()
            except SpoolError as e:
                log.error("cannot pack the staged cycles now (%s): trying again next cycle", e)
            else:
                if budget is not None:
                    budget.produced(packed)
        return self._append_cycle(shaped)

    def _live_version(self) -> int:
        """The format the live lane spools a cycle in. A row that goes out at once is re-coded as a
        v3 frame and deleted on its ack: v1 is the quickest to write (about half v2's CPU) and, like
        every spooled row, self-contained. A row that will wait (no broker connection, rows already
        waiting) is decoded later anyway, and v2 is half v1's size on disk: the configured format."""
        if self.stream.enabled and self.uplink.connected and self._waiting_rows <= _LIVE_WAITING_ROWS:
            return codec.FORMAT_V1
        return self.encoder.version

    def _append_cycle(self, shaped: list[ShapedScrape]) -> tuple[int, list[bytes]]:
        """Scrapes as batches of their own (the live lane): published at once. Returns the samples
        spooled and, when they are all of ``shaped``, the payloads."""
        spooled, payloads = 0, []
        version = self._live_version()
        # Two targets whose labels coincide, scraped in the same millisecond: Prometheus keeps one
        # sample per series and timestamp; v1 would carry both, and the receiver would keep either.
        unique, duplicates = dedupe_window(shaped)
        for target, samples in sorted(duplicates.items()):
            ts = min(s.timestamp_ms for s in shaped if s.target == target)
            self.ledger.record(LossReason.DUPLICATE_SAMPLE, f'{{job="{target}"}}', ts, ts, samples)
        for batch in self._build(unique, version):
            payload = self.sink.append(batch, version)
            if payload is not None:
                spooled += batch.sample_count
                payloads.append(payload)
                if self.budget is not None:
                    self.budget.produced(len(payload), version)
        whole = spooled == sum(len(s) for s in shaped)
        return spooled, payloads if whole else []

    def _build(self, shaped: list[ShapedScrape], version: int) -> list[Batch]:
        """The cycle's batches. When the codec refuses the cycle as a whole, it goes scrape by scrape
        (as ``BatchWindow._encode`` does with a window): a scrape the codec refuses alone is recorded
        as ``encode_error``, and the other scrapes of the cycle still go out."""
        try:
            return self.encoder.build(shaped, version)
        except ValueError as e:
            log.error("cannot encode this cycle as one batch (%s): spooling it scrape by scrape", e)
        batches, refused = self.encoder.build_each(shaped, version)
        for scrape, error in refused:
            log.error(
                "dropping %d samples of %s that cannot be encoded: %s", len(scrape), scrape.target, error
            )
            ts = scrape.timestamp_ms
            self.ledger.record(LossReason.ENCODE_ERROR, f'{{job="{scrape.target}"}}', ts, ts, len(scrape))
        return batches

    def _record_dropped(self, shaped: list[ShapedScrape]) -> None:
        """What ``TargetShaper`` dropped sample by sample, into the loss ledger."""
        for s in shaped:
            job, ts = f'{{job="{s.target}"}}', s.timestamp_ms
            for reason, samples in (
                (LossReason.DUPLICATE_SERIES, s.duplicates),
                (LossReason.LABEL_LIMITS, s.over_label_limits),
                (LossReason.INVALID_TIMESTAMP, s.invalid_timestamps),
            ):
                if samples:
                    self.ledger.record(reason, job, ts, ts, samples)

    def cycle(self) -> int:
        """One scrape of every target, spooled. Returns the number of samples spooled."""
        self._watch_clock(time.time())
        s = self.settings
        grace = min(_SHAPING_GRACE_S, max(0.0, s.interval_seconds - s.timeout_seconds) / 2)
        return self._take(self._scrape(s.timeout_seconds + grace))

    def _scrape(self, timeout: float | None) -> list[ShapedScrape]:
        """The scrapes of this cycle, in config order: every target is scraped unless it is still busy
        with its last scrape. Fetch and parse end at the scrape timeout, but shaping tens of thousands
        of new series (a rollout, pod churn) may take a target longer: the cycle waits ``timeout``
        at most, and a target still at work finishes in the background; its scrape joins the first
        cycle after, and it is not scraped again meanwhile. So its time is its own, never its
        neighbours' (as in Prometheus, where each target has a scrape loop of its own). ``timeout``
        None (shutdown): only the scrapes still running, waited for."""
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
                        "series?): it goes out with a later cycle, and %s is not scraped until it is done",
                        name,
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
        return shaped

    def _take(self, shaped: list[ShapedScrape]) -> int:
        """One cycle's scrapes through the budget into the spool, then the cycle's housekeeping.
        Returns the number of samples spooled."""
        raw = shaped  # what the flight recorder keeps: the scrapes before the budget shapes them
        self.ledger.flush()
        self._record_dropped(shaped)
        if self.budget is not None:
            # On the raw scrapes, before the budget shapes them: a detection exempts the GPU's series
            # from degradation already in this cycle's shaping.
            self._on_anomalies(self.budget.detect(raw, int(time.time() * 1000)), raw)
            shaped = self.budget.shape(shaped, int(time.time() * 1000))
            # Only what the budget's classes dropped: its outputs copy the counts recorded above.
            for s in shaped:
                if s.repeated_timestamps:
                    job, ts = f'{{job="{s.target}"}}', s.timestamp_ms
                    self.ledger.record(LossReason.DUPLICATE_SAMPLE, job, ts, ts, s.repeated_timestamps)
        spooled, payloads = self._spool(shaped)
        if spooled:
            # Published before the recorder (every block_seconds it packs a block: 1.5-2 s at 20,000
            # series on a slow core) and the rest of the cycle's housekeeping start.
            self.uplink.kick_and_wait(_PUBLISH_WAIT_S)
        # After the backlog's rows, in a transaction of its own: the recorder takes what room is left,
        # and never raises (a recorder failure costs neither a batch nor the cycle). The payloads
        # hold the raw scrapes only when nothing shaped them.
        self.recorder.record(raw, payloads if shaped is raw else ())
        if self.budget is not None and self.past.pending:
            self._spool_past(self.budget)
        self.backfill.step()
        if self.budget is not None:
            now_ms = int(time.time() * 1000)
            held, since_ms = self.budget.held(now_ms)
            try:
                self.held.update(held, since_ms, now_ms)
            except SpoolError as e:
                log.error("cannot record what the open aggregation windows hold: %s", e)
        try:
            self.retention.enforce(int(time.time() * 1000))
        except SpoolError as e:
            log.error("cannot apply the spool caps this cycle: %s", e)
        stats = self.spool.stats()
        self._waiting_rows = stats.rows
        if self.budget is not None:
            self.budget.tick(stats.bytes)
            self.metrics.observe_budget_state(self.budget.controller.state)
        self.cycles += 1
        self.metrics.observe_spool(stats, time.time())
        self.uplink.kick()
        return spooled

    def _on_anomalies(self, events: list[anomaly_mod.Event], raw: list[ShapedScrape]) -> None:
        budget = self.budget
        if not events or budget is None or budget.anomaly is None:
            return
        det = budget.anomaly
        end_ms = max((x.timestamp_ms for x in raw if len(x)), default=int(time.time() * 1000))
        for ev in events:
            log.warning(
                "anomaly: %s score=%.1f; %s",
                ev.describe(),
                ev.score,
                f"full resolution from {det.cfg.pre_seconds:g}s before until {ev.window_end_ms}"
                if ev.opened
                else f"not widened: {det.cfg.max_windows} windows open",
            )
            if ev.opened and det.cfg.pre_seconds > 0:
                self.past.start(ev, det.match(ev.gpu), det.cfg.pre_seconds, end_ms)

    def _spool_past(self, budget: BudgetRuntime) -> None:
        """This cycle's share of the anomaly windows' past parts; counted as demand, so the controller
        degrades the other classes (the windowed series themselves never degrade)."""
        share = budget.anomaly.cfg.reserved_share if budget.anomaly is not None else 0.2
        samples, nbytes = self.past.step(budget.controller.rate, share)
        if nbytes:
            budget.produced(nbytes)
            self.metrics.anomaly_window_samples.labels("past").inc(samples)

    def _anomaly_status(self) -> dict[str, Any]:
        if self.budget is None or self.budget.anomaly is None:
            return {}
        return anomaly_mod.status_fields(self.budget.anomaly, int(time.time() * 1000))

    def _watch_clock(self, now: float) -> None:
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

    def run(self) -> None:
        interval = self.settings.interval_seconds
        self.uplink.start()
        next_tick = time.monotonic()
        while not self.stop_event.is_set():
            try:
                self.cycle()
            except Exception:
                log.exception("scrape cycle failed")
            next_tick += interval
            now = time.monotonic()
            if next_tick < now:
                missed = int((now - next_tick) // interval) + 1
                log.warning("scrape cycle overran the %gs interval; skipping %d tick(s)", interval, missed)
                next_tick += missed * interval
            self.stop_event.wait(max(0.0, next_tick - time.monotonic()))

    def shutdown(self, drain_seconds: float = 5.0) -> None:
        self.stop_event.set()
        if self._running:  # scrapes still being shaped: spooled as one last cycle, not dropped
            try:
                self._take(self._scrape(None))
            except Exception:
                log.exception("cannot spool the scrapes still being shaped at shutdown")
        # Open aggregation windows and the open batch window leave now, not after a restart.
        try:
            if self.budget is not None:
                closed = self.budget.flush_all()
                if closed is not None:
                    self._spool([closed])
                self.held.update(0, 0, 0)  # a clean stop: nothing left to record at the next start
            self.window.pack()
            self.uplink.kick()
        except SpoolError as e:
            log.error("cannot close the open windows on shutdown: %s", e)
        self.uplink.stop(drain_seconds)
        self.pool.shutdown(wait=True)
        for loop in self.loops:
            loop.scraper.close()
        self.metrics.observe_spool(self.spool.stats(), time.time())
        self.spool.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="edge relay config file (YAML)")
    parser.add_argument(
        "--drain-seconds", type=float, default=5.0, help="on SIGTERM, wait this long for in-flight acks"
    )


# glibc's mallopt parameter (malloc.h) and the arenas the relay asks for. Each thread that allocates
# while another holds an arena gets one of its own, up to 8 per core, and freed memory stays in the
# arena it came from: the scrape pool's threads each kept their own peak. With one arena, in one
# process (the cycle of bench/live_cpu_bench.py at 1 s, 37 cycles), peak RSS went 56.5 -> 54.2 MiB at
# 2,000 series and 194.8 -> 145.0 MiB at 20,000 (two arenas: 55.4 / 158.5), CPU no higher. The threads
# allocate under the GIL almost always, so they hardly ever wait for the shared arena.
_M_ARENA_MAX = -8
_MALLOC_ARENAS = 1


def limit_malloc_arenas(arenas: int = _MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for the threads started from now on; True when it did. An operator's
    ``MALLOC_ARENA_MAX`` wins, and a libc without ``mallopt`` (or refusing it) is left as it is."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(_M_ARENA_MAX, arenas) == 1


def run(args: argparse.Namespace) -> int:
    limit_malloc_arenas()  # before any thread starts: the pool, the uplink, paho, the metrics server
    s = settings_mod.load(args.config)
    # What `check-config` checks, checked here too: both refuse a config with the same message.
    checkconfig.validate(s)
    logging.getLogger().setLevel(s.log_level)
    relay = Relay(s)
    # Every cycle allocates a tuple per sample and the caches hold hundreds of thousands of long-lived
    # ones, which the default collector (a pass every 700 net allocations) keeps traversing: collect
    # less often, and never the objects that exist once set up. About 10 % of the live path's CPU
    # (bench/live_cpu_bench.py at 2,000 series: 6.2-6.5 -> 5.7 us/sample); the relay makes few cycles.
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)
    server = MetricsServer.start(s.metrics_listen, relay.metrics.registry, ready=lambda: relay.cycles > 0)
    log.info(
        "edge relay %s/%s: %d target(s) every %gs, spool %s, broker %s:%d",
        s.cluster,
        s.node,
        len(s.targets),
        s.interval_seconds,
        s.spool_path,
        s.mqtt.host,
        s.mqtt.port,
    )

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        relay.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        relay.run()
    finally:
        relay.shutdown(args.drain_seconds)
        if server is not None:
            server.stop()
    return 0
