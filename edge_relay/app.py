"""``edge-relay run``: builds the relay's parts in dependency order and runs the scrape loop.

The parts, in the order a sample passes them (a package each, with its design in its docstring):
``collect`` (scrape -> parse -> relabel and shape, every target in parallel) -> ``budget`` (with a
budget file: the anomaly detector on the raw scrapes, then the classes) -> ``encode`` (the cycle's
lanes: live batches, or the open batch window) -> ``store`` (the spool through its sink, retention,
held windows) -> ``uplink`` (MQTT, paced, stream-coded at publication). Beside the path: ``recorder``
(every raw scrape for a bounded span, and backfill requests answered from it) and ``anomaly`` (the
past part of each window the detector opens).

``Relay`` builds each part once, before the parts that need it, and hands it what it needs: the spool
and the ledger first, the recorder, retention, the sink, the budget (with the pacer it shares with the
uplink, and the stream coder's wire estimate), the window and the lanes, the status report, the
command inbox and the backfiller, and last the uplink. ``cycle`` calls each part once per tick and
passes what one returns to the next; the decisions are the parts' own. Data flows one way; no part
calls back into ``Relay``.

Scrapes run on a fixed grid of ``interval_seconds``; all targets of one tick are scraped in parallel
and their samples go into the spool before the uplink is woken (a target still shaping after the
scrape timeout joins a later cycle: ``collect.targets``). A cycle that overruns skips the grid points it
missed instead of scraping in a burst.
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
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from edge_relay import settings as settings_mod
from edge_relay.anomaly.pastparts import PastParts
from edge_relay.budget.model import PRESET_COUNTERS
from edge_relay.budget.runtime import BudgetRuntime
from edge_relay.collect.shape import ShapedScrape
from edge_relay.collect.targets import Collector
from edge_relay.commands import checkconfig
from edge_relay.encode.batches import BatchEncoder
from edge_relay.encode.lanes import Lanes
from edge_relay.encode.window import BatchWindow
from edge_relay.ledger import LossLedger
from edge_relay.recorder.backfill import Backfiller, CommandInbox
from edge_relay.recorder.flight import FlightRecorder
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import Settings
from edge_relay.store.held import HeldWindows
from edge_relay.store.recent import RecentBatches
from edge_relay.store.retention import Policy, Retention
from edge_relay.store.sink import SpoolSink
from edge_relay.store.spool import InFlight, SendQueue, Spool, SpoolError
from edge_relay.uplink.mqtt import Uplink
from edge_relay.uplink.pacer import Pacer
from edge_relay.uplink.status import StatusReport
from edge_relay.uplink.stream import StreamCoder
from relay_common.httpserver import MetricsServer, Page

log = logging.getLogger("edge_relay")
# At most this long a cycle's housekeeping waits for its row to be published: the pass publishes the
# fresh row first (~0.1 s of stream coding at 20,000 series), then backlog rows, which need not wait.
_PUBLISH_WAIT_S = 0.5
_GC_THRESHOLDS = (50_000, 20, 100)  # gen0 allocations, gen0 passes per gen1, gen1 passes per gen2


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
        self.collector = Collector(s, self.metrics, self.ledger)
        self.encoder = BatchEncoder(
            s.cluster,
            s.node,
            max_bytes=s.batch_max_bytes,
            zstd_level=s.zstd_level,
            version=s.format_version,
            incarnation=self.spool.incarnation,
        )
        self.inflight = InFlight()
        # What the sink spools, the uplink publishes stream-coded; the batches just spooled wait in
        # ``recent`` so that the stream coder need not decode their rows.
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
                ledger=self.ledger,
                wire=self.stream,
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
        self.lanes = Lanes(self.encoder, self.window, self.sink, self.ledger, self.budget)
        # Anomaly windows' past part: the recorder's raw samples of the GPU, spooled through the sink.
        self.past = PastParts(self.recorder, self.sink, s.interval_seconds, self.encoder, self.metrics)
        if self.budget is not None and self.budget.anomaly is not None and not s.recorder_max_bytes:
            log.warning("anomaly windows get no past part: the flight recorder is off (recorder.max_bytes 0)")
        self.status = StatusReport(self.spool, self.ledger, self.budget)
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
        self.cycles = 0
        self._waiting_rows = 0  # spooled rows not acked yet, at the end of the last cycle

    def cycle(self) -> int:
        """One scrape of every target, spooled. Returns the number of samples spooled."""
        self.ledger.flush()
        return self._take(self.collector.collect())

    def _take(self, raw: list[ShapedScrape]) -> int:
        """A cycle's scrapes through the budget into the spool, then the cycle's housekeeping. ``raw``
        is what the flight recorder keeps: the scrapes before the budget shapes them."""
        budget = self.budget
        shaped = raw
        if budget is not None:
            # On the raw scrapes, before the budget shapes them: a detection exempts the GPU's series
            # from degradation already in this cycle's shaping.
            self.past.open(budget.detect(raw, int(time.time() * 1000)), budget.anomaly, raw)
            shaped = budget.shape(raw, int(time.time() * 1000))
        spooled, payloads = self.lanes.spool(
            shaped, at_once=self.uplink.publishes_at_once(self._waiting_rows)
        )
        if spooled:
            # Published before the recorder (every block_seconds it packs a block: 1.5-2 s at 20,000
            # series on a slow core) and the rest of the cycle's housekeeping start.
            self.uplink.kick_and_wait(_PUBLISH_WAIT_S)
        # After the backlog's rows, in a transaction of its own: the recorder takes what room is left,
        # and never raises. The payloads hold the raw scrapes only when nothing shaped them.
        self.recorder.record(raw, payloads if shaped is raw else ())
        if budget is not None and self.past.pending:
            # Counted as demand, so the controller degrades the other classes (the windowed series
            # themselves never degrade).
            budget.produced(self.past.step(budget.rate, budget.reserved_share)[1])
        self.backfill.step()
        if budget is not None:
            now_ms = int(time.time() * 1000)
            try:
                self.held.update(*budget.held(now_ms), now_ms)
            except SpoolError as e:
                log.error("cannot record what the open aggregation windows hold: %s", e)
        try:
            self.retention.enforce(int(time.time() * 1000))
        except SpoolError as e:
            log.error("cannot apply the spool caps this cycle: %s", e)
        stats = self.spool.stats()
        self._waiting_rows = stats.rows
        if budget is not None:
            budget.tick(stats.bytes)
        self.cycles += 1
        self.metrics.observe_spool(stats, time.time())
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
        if self.collector.busy:  # scrapes still being shaped: spooled as one last cycle, not dropped
            try:
                self._take(self.collector.collect_remaining())
            except Exception:
                log.exception("cannot spool the scrapes still being shaped at shutdown")
        # Open aggregation windows and the open batch window leave now, not after a restart.
        try:
            if self.budget is not None:
                closed = self.budget.flush_all()
                if closed is not None:
                    self.lanes.spool([closed], at_once=self.uplink.publishes_at_once(self._waiting_rows))
                self.held.update(0, 0, 0)  # a clean stop: nothing left to record at the next start
            self.window.pack()
            self.uplink.kick()
        except SpoolError as e:
            log.error("cannot close the open windows on shutdown: %s", e)
        self.uplink.stop(drain_seconds)
        self.collector.close()
        self.metrics.observe_spool(self.spool.stats(), time.time())
        self.spool.close()


class _LazyStatusPage:
    """The ``/status`` page, its code loaded when it is first asked for: the status command's reader and
    renderer cost about 2.7 MiB of a sidecar that may never serve the page."""

    def __init__(self, s: Settings, registry: CollectorRegistry) -> None:
        self._settings, self._registry = s, registry
        self._page: Callable[[], bytes] | None = None

    def __call__(self) -> bytes:
        if self._page is None:
            from edge_relay.commands.status import StatusPage

            self._page = StatusPage(self._settings, self._registry)
        return self._page()


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
    server = MetricsServer.start(
        s.metrics_listen,
        relay.metrics.registry,
        ready=lambda: relay.cycles > 0,
        pages={"/status": Page(_LazyStatusPage(s, relay.metrics.registry))},
    )
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
