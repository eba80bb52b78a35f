"""``edge-relay run``: wires the stages together (scrape -> parse -> shape -> encode -> spool -> uplink).

Scrapes run on a fixed grid of ``interval_seconds``; all targets of one tick are scraped in parallel
and their samples go into the spool as one or more batches before the uplink is woken. A cycle that
overruns skips the grid points it missed instead of scraping in a burst.

With a bandwidth-budget file (``budget_file``) the shape stage also applies the budget's classes, the
controller (``edge_relay.controller``) paces the uplink and degrades classes, and cycles are collected
into batch windows of ``uplink.batch_window_seconds``: each cycle is staged durably in the spool, and
when its window closes the window's cycles become one batch (or a few, split by series). Windows are
aligned to wall time with a per-node offset, so a fleet does not publish all at the same second. The
budget file is re-read when it changes; a file that no longer loads keeps the previous budget (logged,
counted in ``edge_relay_budget_reloads_total{result="failed"}``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from edge_relay import budget as budget_mod
from edge_relay import settings as settings_mod
from edge_relay.budget import Budget
from edge_relay.controller import Controller
from edge_relay.encode import BatchEncoder, decode_stage, dedupe_window, encode_stage, to_batch
from edge_relay.parse import ParseError, SampleLimitExceeded, SeriesCache, parse
from edge_relay.retention import Policy, Retention, describe
from edge_relay.scrape import Fetched, Scraper
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import Settings, Target
from edge_relay.shape import BudgetShaper, ShapedScrape, TargetShaper, fill_labels_for
from edge_relay.spool import Replacement, Spool, SpoolError, SpoolFullError
from edge_relay.uplink import Uplink
from relay_common.httpserver import MetricsServer
from schemas.model import Batch

log = logging.getLogger("edge_relay")


class TargetLoop:
    """Scrape -> parse -> shape for one target; state (caches, previous series) lives here."""

    def __init__(self, target: Target, s: Settings, metrics: RelayMetrics) -> None:
        self.target = target
        self.metrics = metrics
        self.sample_limit = s.sample_limit
        self.scraper = Scraper(
            target.url, fmt=target.format, timeout_s=s.timeout_seconds, body_limit_bytes=s.body_limit_bytes
        )
        self.cache = SeriesCache()
        self.shaper = TargetShaper(
            target.name,
            {"job": target.job, "instance": target.instance, **target.labels},
            fill_labels_for(s.cluster, s.node, s.add_node_labels, s.external_labels),
        )
        self._last_error = ""

    def run_once(self) -> ShapedScrape:
        fetched: Fetched = self.scraper.fetch()
        samples = None
        result = "ok"
        error = fetched.error
        if fetched.ok:
            try:
                samples = parse(fetched.body, fetched.content_type, self.cache, self.sample_limit)
            except SampleLimitExceeded as e:
                error, result = str(e), "sample_limit"
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
        elif self._last_error:
            log.info("scrape of %s recovered", self.target.name)
            self._last_error = ""
        self.metrics.scrapes.labels(self.target.name, result).inc()
        self.metrics.scrape_duration.labels(self.target.name).observe(duration)
        if samples is not None:
            self.metrics.samples_scraped.labels(self.target.name).inc(len(samples))
        shaped = self.shaper.shape(fetched.timestamp_ms, samples, duration)
        self.metrics.stale_markers.inc(shaped.stale_markers)
        return shaped


class Relay:
    def __init__(self, s: Settings, metrics: RelayMetrics | None = None) -> None:
        self.settings = s
        self.metrics = metrics or RelayMetrics()
        self.spool = Spool(s.spool_path, synchronous=s.spool_synchronous, max_bytes=s.spool_max_bytes or None)
        self._unrecorded: list[tuple[str, str, int, int, int]] = []
        self.metrics.spool_max_bytes.set(s.spool_max_bytes)
        self.metrics.attach_ledger(self.loss_totals)
        self.retention = Retention(
            self.spool,
            Policy(
                cap_bytes=s.spool_cap_bytes,
                max_age_ms=int(s.spool_max_age_seconds * 1000),
                max_factor=s.spool_max_degrade_factor,
                interval_ms=int(s.interval_seconds * 1000),
                busy_ms=int(s.mqtt.ack_timeout_seconds * 1000),
                batch_max_bytes=s.batch_max_bytes,
                zstd_level=s.zstd_level,
            ),
            cluster=s.cluster,
            node=s.node,
            busy=lambda: self.uplink.inflight_seqs,
        )
        if self.spool.recovery is not None:
            r = self.spool.recovery
            self._record_loss(
                "spool_file_corrupt",
                f"file moved aside to {r.moved_to.name}; {r.salvaged_rows} rows salvaged",
                0,
                0,
                0,
            )
        self.loops = [TargetLoop(t, s, self.metrics) for t in s.targets]
        self.encoder = BatchEncoder(
            s.cluster, s.node, max_bytes=s.batch_max_bytes, zstd_level=s.zstd_level, version=s.format_version
        )
        self.uplink = Uplink(
            s.mqtt,
            cluster=s.cluster,
            node=s.node,
            spool=self.spool,
            metrics=self.metrics,
            status=self.status,
            live_window_s=s.interval_seconds,
        )
        self.stop_event = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.loops)), thread_name_prefix="scrape")
        self.cycles = 0
        self.budget: Budget | None = None
        self.shaper: BudgetShaper | None = None
        self.controller: Controller | None = None
        self._budget_stamp: tuple[int, int] | None = None
        self._shaped_seen: dict[tuple[str, str], int] = {}
        self._paced_seen = 0.0
        # The open batch window: its staged spool ids and scrapes.
        self._window_ids: list[int] = []
        self._window: list[ShapedScrape] = []
        self._window_index: int | None = None
        # Per-node offset of the window grid, so a fleet's windows do not all close at the same second.
        self._window_offset_ms = zlib.crc32(f"{s.cluster}/{s.node}".encode())
        if s.budget_file:
            self._start_budget(budget_mod.load(s.budget_file))

    # --- bandwidth budget ------------------------------------------------------------------------

    def _budget_file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.settings.budget_file)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _start_budget(self, budget: Budget) -> None:
        s = self.settings
        self.budget = budget
        self._budget_stamp = self._budget_file_stamp()
        self.shaper = BudgetShaper(budget, s.interval_seconds)
        self.controller = Controller(
            budget,
            self.shaper,
            self.spool,
            self.metrics,
            interval_s=s.interval_seconds,
            wire_total=lambda: self.uplink.wire.total,
            set_pacing=self.uplink.set_budget,
        )
        up = budget.uplink
        self._fit_batches_to_burst(budget)
        self.uplink.set_budget(self.controller.allowed_rate(time.time()), up.burst_bytes)
        # Cycles staged before a restart belong to the open window.
        for row in self.spool.staged():
            try:
                self._window.extend(decode_stage(row.payload))
            except ValueError as e:
                log.error(
                    "staged cycle %d cannot be read (%s): its %d samples are lost",
                    row.id,
                    e,
                    row.sample_count,
                )
                self._record_loss(
                    "corrupt_row",
                    f"spool staging {row.id}",
                    row.first_ts_ms,
                    row.last_ts_ms,
                    row.sample_count,
                )
                self.spool.promote([row.id], [])
                continue
            self._window_ids.append(row.id)
            if self._window_index is None:
                self._window_index = self._window_of(row.first_ts_ms)
        if self._window_ids:
            log.info("resumed an open batch window of %d staged cycle(s)", len(self._window_ids))

    def _fit_batches_to_burst(self, budget: Budget) -> None:
        self.encoder.max_bytes = budget.uplink.batch_cap(self.settings.batch_max_bytes)
        for warning in budget.warnings(self.settings.batch_max_bytes):
            log.warning("%s", warning)

    def _maybe_reload_budget(self) -> None:
        stamp = self._budget_file_stamp()
        if stamp is None or stamp == self._budget_stamp or self.shaper is None or self.controller is None:
            return
        self._budget_stamp = stamp
        try:
            budget = budget_mod.load(self.settings.budget_file)
        except (budget_mod.ConfigError, OSError) as e:
            self.metrics.budget_reloads.labels("failed").inc()
            log.error("budget file changed but cannot be used; keeping the previous budget: %s", e)
            return
        self.budget = budget
        self._fit_batches_to_burst(budget)
        self.shaper.set_budget(budget)
        self.controller.set_budget(budget)
        self.metrics.budget_reloads.labels("ok").inc()
        log.info("budget file %s reloaded: %d class(es)", self.settings.budget_file, len(budget.classes))

    def _window_ms(self) -> int:
        assert self.budget is not None
        return int(self.budget.uplink.batch_window_seconds * 1000)

    def _window_of(self, ts_ms: int) -> int:
        window = self._window_ms()
        return (ts_ms - self._window_offset_ms % window) // window

    def _windowed(self) -> bool:
        return self.budget is not None and self._window_ms() > self.settings.interval_seconds * 1000

    def _count_shaping(self) -> None:
        assert self.shaper is not None and self.budget is not None
        for i, c in enumerate(self.budget.classes):
            st = self.shaper.stats[i]
            for outcome, total in (
                ("sent", st.samples_out),
                ("suppressed", st.suppressed),
                ("merged", st.merged),
                ("rounded", st.precision_rounded),
            ):
                key = (c.name, outcome)
                delta = total - self._shaped_seen.get(key, 0)
                if delta > 0:
                    if outcome == "rounded":
                        self.metrics.budget_rounded.labels(c.name).inc(delta)
                    else:
                        self.metrics.budget_samples.labels(c.name, outcome).inc(delta)
                self._shaped_seen[key] = total

    def _stage(self, shaped: list[ShapedScrape]) -> int:
        """Stage one cycle into the open window (packing the window first if this cycle starts a new one)."""
        scrapes = [x for x in shaped if len(x)]
        if not scrapes:
            return 0
        first = min(min(x.timestamps) if x.timestamps else x.timestamp_ms for x in scrapes)
        last = max(max(x.timestamps) if x.timestamps else x.timestamp_ms for x in scrapes)
        index = self._window_of(max(x.timestamp_ms for x in scrapes))
        if self._window_index is not None and index != self._window_index:
            self._pack_window()
        count = sum(len(x) for x in scrapes)
        payload = encode_stage(scrapes)
        try:
            staged_id = self.spool.stage(payload, first_ts_ms=first, last_ts_ms=last, sample_count=count)
        except SpoolFullError as e:
            self.metrics.spool_errors.labels("full").inc()
            log.error("spool is full (%s): evicting the oldest batches to make room", e)
            try:
                self.retention.make_room(int(time.time() * 1000), len(payload))
                staged_id = self.spool.stage(payload, first_ts_ms=first, last_ts_ms=last, sample_count=count)
            except SpoolError as e2:
                log.error("spool still full (%s): %d samples of this cycle are lost", e2, count)
                batch = to_batch(self.settings.cluster, self.settings.node, scrapes)
                self._record_loss("spool_full", describe([batch]), first, last, count)
                return 0
        self._window_ids.append(staged_id)
        self._window.extend(scrapes)
        self._window_index = index
        return count

    def _pack_window(self) -> None:
        """Turn the open window's staged cycles into batches (one spool transaction)."""
        if not self._window_ids:
            self._window_index = None
            return
        window, duplicates = dedupe_window(self._window)
        if duplicates:
            # Explicit exporter timestamps that did not advance between scrapes: Prometheus would keep
            # only one sample per series and timestamp too.
            first, last = self._window[0].timestamp_ms, self._window[-1].timestamp_ms
            self._record_loss("duplicate_sample", "{}", first, last, duplicates)
        try:
            batches = self.encoder.build_window(window)
        except ValueError as e:
            # A window the codec refuses must not stay open for ever: ship it cycle by cycle instead.
            log.error("cannot encode the batch window as one batch (%s): sending it cycle by cycle", e)
            batches = []
            for scrape in window:
                try:
                    batches += self.encoder.build([scrape])
                except ValueError as e2:
                    log.error(
                        "dropping %d samples of %s that cannot be encoded: %s", len(scrape), scrape.target, e2
                    )
                    ts = scrape.timestamp_ms
                    self._record_loss("encode_error", f'{{job="{scrape.target}"}}', ts, ts, len(scrape))
        sizes: list[int] = []

        def encoder_for(batch: Batch) -> Any:
            def encode(seq: int) -> bytes:
                payload = self.encoder.encode(batch, seq)
                sizes.append(len(payload))
                return payload

            return encode

        items = [
            Replacement(encoder_for(b), b.first_timestamp_ms, b.last_timestamp_ms, b.sample_count)
            for b in batches
        ]
        try:
            self.spool.promote(self._window_ids, items)
        except SpoolFullError as e:
            self.metrics.spool_errors.labels("full").inc()
            log.error("spool is full (%s) while packing a batch window; retrying next cycle", e)
            # The packed batches need about as much room as the staged cycles they replace.
            with contextlib.suppress(SpoolError):
                self.retention.make_room(int(time.time() * 1000), self.spool.stats().staged_bytes)
            return
        total = sum(sizes)
        self.metrics.batch_bytes.inc(total)
        for b in batches:
            self.metrics.batches_spooled.inc()
            self.metrics.samples_spooled.inc(b.sample_count)
        self._produced(total)
        self._window_ids, self._window, self._window_index = [], [], None

    def status(self) -> dict[str, Any]:
        st = self.spool.stats()
        totals = self.loss_totals()
        status: dict[str, Any] = {
            "spool_rows": st.rows,
            "spool_bytes": st.bytes,
            "spool_samples": st.samples,
            "oldest_unsent_ms": st.oldest_first_ts_ms,
            "quarantined_rows": st.quarantined_rows,
            # "offline, data safe" vs "data lost": the loss ledger's totals travel with the status.
            "lost_samples": sum(totals.values()),
        }
        if st.staged_rows:
            status["staged_samples"] = st.staged_samples
        for reason, samples in totals.items():
            status[f"lost_{reason}"] = samples
        if self.controller is not None:
            status.update(self.controller.status())
        return status

    def _record_loss(self, reason: str, series: str, first_ms: int, last_ms: int, samples: int) -> None:
        self._unrecorded.append((reason, series, first_ms, last_ms, samples))
        self._flush_losses()

    def _flush_losses(self) -> None:
        """Write pending ledger entries; on a full disk they wait in memory (and still count)."""
        while self._unrecorded:
            entry = self._unrecorded[0]
            try:
                self.spool.record_loss(*entry)
            except SpoolError as e:
                log.error(
                    "cannot write %d %s samples of %s to the loss ledger yet: %s",
                    entry[4],
                    entry[0],
                    entry[1],
                    e,
                )
                return
            self._unrecorded.pop(0)

    def loss_totals(self) -> dict[str, int]:
        totals = self.spool.loss_totals()
        for reason, _, _, _, samples in list(self._unrecorded):
            totals[reason] = totals.get(reason, 0) + samples
        return totals

    def _produced(self, nbytes: int) -> None:
        if self.controller is not None:
            self.controller.produced(nbytes)

    def _spool_batch(self, batch: Batch) -> bool:
        size = [self.settings.batch_max_bytes]

        def encode(seq: int) -> bytes:
            payload = self.encoder.encode(batch, seq)
            size[0] = len(payload)
            return payload

        def append() -> None:
            self.spool.append(
                encode,
                first_ts_ms=batch.first_timestamp_ms,
                last_ts_ms=batch.last_timestamp_ms,
                sample_count=batch.sample_count,
            )
            self.metrics.batch_bytes.inc(size[0])

        try:
            append()
            self._produced(size[0])
            return True
        except SpoolFullError as e:
            self.metrics.spool_errors.labels("full").inc()
            log.error("spool is full (%s): evicting the oldest batches to make room", e)
        # New data is what an operator needs first after an outage: the oldest backlog makes room.
        try:
            self.retention.make_room(int(time.time() * 1000), size[0])
        except SpoolError as e:
            log.error("cannot make room in the spool: %s", e)
        try:
            append()
            self._produced(size[0])
            return True
        except SpoolFullError as e:
            log.error("spool still full (%s): %d samples of this cycle are lost", e, batch.sample_count)
            self._record_loss(
                "spool_full",
                describe([batch]),
                batch.first_timestamp_ms,
                batch.last_timestamp_ms,
                batch.sample_count,
            )
            return False

    def _update_spool_metrics(self) -> None:
        st = self.spool.stats()
        m = self.metrics
        m.spool_rows.set(st.rows)
        m.spool_bytes.set(st.bytes)
        m.spool_quarantined.set(st.quarantined_rows)
        age = 0.0 if st.oldest_first_ts_ms is None else max(0.0, time.time() - st.oldest_first_ts_ms / 1000)
        m.spool_oldest_age.set(age)

    def cycle(self) -> int:
        """One scrape of every target, spooled. Returns the number of samples spooled."""
        shaped = list(self.pool.map(lambda loop: loop.run_once(), self.loops))
        self._flush_losses()
        for s in shaped:
            job = f'{{job="{s.target}"}}'
            if s.duplicates:
                self._record_loss("duplicate_series", job, s.timestamp_ms, s.timestamp_ms, s.duplicates)
            if s.over_label_limits:
                self._record_loss("label_limits", job, s.timestamp_ms, s.timestamp_ms, s.over_label_limits)
        spooled = 0
        if self.shaper is not None:
            self._maybe_reload_budget()
            now_ms = int(time.time() * 1000)
            shaped = [self.shaper.shape(x) for x in shaped]
            closed = self.shaper.flush(now_ms)
            if closed is not None:
                shaped.append(closed)
            self._count_shaping()
        if self._windowed():
            try:
                spooled = self._stage(shaped)
                # A window also closes on time, so the last cycles before a quiet spell still go out.
                if (
                    self._window_index is not None
                    and self._window_of(int(time.time() * 1000)) != self._window_index
                ):
                    self._pack_window()
            except SpoolError as e:
                log.error("cannot stage this cycle: %s", e)
        else:
            for batch in self.encoder.build(shaped):
                if self._spool_batch(batch):
                    spooled += batch.sample_count
                    self.metrics.batches_spooled.inc()
                    self.metrics.samples_spooled.inc(batch.sample_count)
        try:
            self.retention.enforce(int(time.time() * 1000))
        except SpoolError as e:
            log.error("cannot apply the spool caps this cycle: %s", e)
        if self.controller is not None:
            self.controller.published(self.uplink.published_payload_bytes)
            self.controller.tick(self.spool.stats().bytes)
            self.metrics.budget_paced.inc(max(0.0, self.uplink.paced_seconds - self._paced_seen))
            self._paced_seen = self.uplink.paced_seconds
        self.cycles += 1
        self._update_spool_metrics()
        self.uplink.kick()
        return spooled

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
        if self.shaper is not None:
            # Open aggregation windows and the open batch window leave now, not after a restart.
            try:
                closed = self.shaper.flush(2**62)
                if closed is not None and self._windowed():
                    self._stage([closed])
                elif closed is not None:
                    for batch in self.encoder.build([closed]):
                        self._spool_batch(batch)
                self._pack_window()
                self.uplink.kick()
            except SpoolError as e:
                log.error("cannot close the open windows on shutdown: %s", e)
        self.uplink.stop(drain_seconds)
        self.pool.shutdown(wait=True)
        for loop in self.loops:
            loop.scraper.close()
        self._update_spool_metrics()
        self.spool.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="edge relay config file (YAML)")
    parser.add_argument(
        "--drain-seconds", type=float, default=5.0, help="on SIGTERM, wait this long for in-flight acks"
    )


def run(args: argparse.Namespace) -> int:
    s = settings_mod.load(args.config)
    logging.getLogger().setLevel(s.log_level)
    relay = Relay(s)
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
