"""The budget in force on a running relay: its file, shaper and controller, built once and reloaded.

``BudgetRuntime`` is what the relay loop holds when a budget file is configured. It loads the file,
builds the shaper and the controller on the shared pacer, fits the encoder's batch cap to the burst,
re-reads the file when it changes (a file that no longer loads keeps the previous budget: logged, and
counted in ``edge_relay_budget_reloads_total{result="failed"}``), shapes each cycle, and turns the
shaper's running totals into self-metrics. Without a budget file the relay has no runtime at all.

A file that disappears also keeps the previous budget (logged once): a ConfigMap update swaps the file
under a symlink, and a budget that came and went with it would flap the batch window. The budget ends
only with a restart without ``budget_file``; the cycles that window had staged are then packed by the
relay's first cycle (``Relay._spool``), so they are never stranded.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from dataclasses import replace
from typing import Any, Protocol

from edge_relay.anomaly.detector import Detector, Event, gpu_label, status_fields
from edge_relay.anomaly.node import NODE_KEY
from edge_relay.budget.controller import Controller
from edge_relay.budget.model import PRESET_COUNTERS, ConfigError, load
from edge_relay.budget.shaper import BudgetShaper
from edge_relay.collect.shape import ShapedScrape
from edge_relay.ledger import LossLedger, LossReason
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.spool import MetaTable
from edge_relay.uplink.pacer import Pacer
from schemas.codec import FORMAT_V2

log = logging.getLogger("edge_relay.budget")

_OUTCOMES = (("sent", "samples_out"), ("suppressed", "suppressed"), ("merged", "merged"))
_DEFAULT_RESERVED_SHARE = 0.2  # of the allowed rate, for past parts, when no detector is configured


class WireEstimate(Protocol):
    """What the uplink's stream coding makes of spooled bytes on the wire (``StreamCoder``)."""

    def wire_bytes(self, spooled_bytes: int, version: int) -> int: ...


class BatchCap(Protocol):
    """The encoder whose batches the budget caps (``edge_relay.encode.batches.BatchEncoder``): a small
    burst lowers ``batch.max_bytes`` so that one batch never waits for more tokens than the bucket holds."""

    max_bytes: int


class _AsSpooled:
    def wire_bytes(self, spooled_bytes: int, version: int) -> int:
        return spooled_bytes


class BudgetRuntime:
    def __init__(
        self,
        path: str,
        *,
        interval_s: float,
        batch_max_bytes: int,
        encoder: BatchCap,
        pacer: Pacer,
        meta: MetaTable,
        metrics: RelayMetrics,
        ledger: LossLedger | None = None,
        wire: WireEstimate | None = None,
    ) -> None:
        self.path = path
        self._wire = wire or _AsSpooled()
        self._ledger = ledger
        self._interval_s = interval_s
        self._batch_max_bytes = batch_max_bytes
        self._encoder = encoder
        self._metrics = metrics
        self._stamp = self._file_stamp()
        self._missing = False  # the file is gone (logged once) and the previous budget stays in force
        self.budget = load(path)
        self.shaper = BudgetShaper(self.budget, interval_s)
        self.controller = Controller(
            self.budget, self.shaper, meta, metrics, interval_s=interval_s, pacer=pacer
        )
        self._fit_batches_to_burst()
        pacer.configure(self.controller.allowed_rate(time.time()), self.budget.uplink.burst_bytes)
        self._shaped_seen: dict[tuple[str, str], int] = {}
        self._paced_seen = 0.0
        self._pacer = pacer
        # Anomaly detection only with the file's `anomaly` section: without it the cycle is unchanged.
        self.anomaly: Detector | None = None
        self._set_anomaly()
        self._override_seen = 0
        self._windows_shown: set[str] = set()

    @property
    def counters(self) -> frozenset[str]:
        """Metric names the budget treats as counters although they have no counter suffix."""
        return PRESET_COUNTERS.union(*(c.counters for c in self.budget.classes))

    @property
    def window_ms(self) -> int:
        return int(self.budget.uplink.batch_window_seconds * 1000)

    @property
    def windowed(self) -> bool:
        """Cycles are collected into batch windows (a window longer than one interval)."""
        return self.window_ms > self._interval_s * 1000

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _fit_batches_to_burst(self) -> None:
        self._encoder.max_bytes = self.budget.uplink.batch_cap(self._batch_max_bytes)
        for warning in self.budget.warnings(self._batch_max_bytes):
            log.warning("%s", warning)

    def maybe_reload(self) -> None:
        stamp = self._file_stamp()
        if stamp is None:
            if not self._missing:
                log.warning("budget file %s is gone; keeping the budget in force until it is back", self.path)
            self._missing = True
            return
        self._missing = False
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            budget = load(self.path)
        except (ConfigError, OSError) as e:
            self._metrics.budget_reloads.labels("failed").inc()
            log.error("budget file changed but cannot be used; keeping the previous budget: %s", e)
            return
        self.budget = budget
        self._fit_batches_to_burst()
        self.shaper.set_budget(budget)
        self.controller.set_budget(budget)
        self._set_anomaly()
        self._metrics.budget_reloads.labels("ok").inc()
        log.info("budget file %s reloaded: %d class(es)", self.path, len(budget.classes))

    def _set_anomaly(self) -> None:
        cfg = self.budget.anomaly
        if cfg is None:
            self.anomaly = None
            self.shaper.override = frozenset()
        elif self.anomaly is None:
            self.anomaly = Detector(cfg, self._interval_s)
        else:
            self.anomaly.set_config(cfg)  # the GPUs' baselines and open windows stay

    def detect(self, raw: list[ShapedScrape], now_ms: int) -> list[Event]:
        """The cycle's raw scrapes through the detectors (before ``shape``): new events, and the series
        the open windows hold at full resolution handed to the shaper."""
        det = self.anomaly
        if det is None:
            return []
        events = det.observe(raw, now_ms)
        self.shaper.override = det.override
        m = self._metrics
        if det.cfg.score != "none":
            for key, g in det.gpus.items():
                vendor, _, gpu = key.partition(":")
                m.anomaly_score.labels(gpu, vendor).set(g.score)
            if det.node is not None:  # the node's detector: gpu="node", vendor="node"
                m.anomaly_score.labels(NODE_KEY, NODE_KEY).set(det.node.score)
        for ev in events:
            m.anomaly_events.labels(gpu_label(ev.gpu), ev.kind, ev.rule).inc()
        active = set(det.active_windows(now_ms))
        for key in active | self._windows_shown:
            m.anomaly_window_active.labels(gpu_label(key)).set(1 if key in active else 0)
        self._windows_shown = active
        return events

    def shape(self, shaped: list[ShapedScrape], now_ms: int) -> list[ShapedScrape]:
        """A cycle's scrapes through the budget's classes, plus what aggregation windows closed. What
        the classes dropped (a series' samples with one timestamp) goes into the ledger."""
        self.maybe_reload()
        out = [self.shaper.shape(x) for x in shaped]
        closed = self.shaper.flush(now_ms)
        if closed is not None:
            out.append(closed)
        if self._ledger is not None:
            # Only what the classes dropped: their outputs copy the counts the collect stage recorded.
            for s in out:
                if s.repeated_timestamps:
                    job, ts = f'{{job="{s.target}"}}', s.timestamp_ms
                    self._ledger.record(LossReason.DUPLICATE_SAMPLE, job, ts, ts, s.repeated_timestamps)
        self._count_shaping()
        live = self.shaper.override_samples - self._override_seen
        if live > 0:
            self._metrics.anomaly_window_samples.labels("live").inc(live)
            self._override_seen = self.shaper.override_samples
        return out

    def split_live(self, shaped: list[ShapedScrape]) -> tuple[list[ShapedScrape], list[ShapedScrape]]:
        """A shaped cycle as (what leaves now, what waits for the batch window): the samples of the
        ``latency: live`` classes, and the rest (which keeps the scrapes' counts)."""
        live = self.budget.live_classes
        if not live:
            return [], shaped
        classify = self.budget.classify
        now: list[ShapedScrape] = []
        later: list[ShapedScrape] = []
        for x in shaped:
            picks = [classify(labels) in live for labels in x.labels]
            if all(picks):
                now.append(x)
                later.append(replace(x, labels=[], values=array("d"), timestamps=None))
            elif not any(picks):
                later.append(x)
            else:
                now.append(_subset(x, picks, True))
                later.append(_subset(x, picks, False))
        return now, later

    def held(self, now_ms: int) -> tuple[int, int]:
        """Samples in open aggregation windows, and the earliest time they can be from."""
        return self.shaper.held(now_ms)

    def flush_all(self) -> ShapedScrape | None:
        """Every open aggregation window, closed now (on a clean stop)."""
        return self.shaper.flush(2**62)

    def produced(self, nbytes: int, version: int = FORMAT_V2) -> None:
        """Encoded bytes just added to the spool (as format ``version``): the demand the controller
        weighs, as the wire will carry them (stream-coded frames are smaller than the spooled
        batches)."""
        self.controller.produced(self._wire.wire_bytes(nbytes, version))

    @property
    def reserved_share(self) -> float:
        """The share of the allowed rate anomaly windows' past parts may take."""
        return self.anomaly.cfg.reserved_share if self.anomaly is not None else _DEFAULT_RESERVED_SHARE

    def status_fields(self) -> dict[str, Any]:
        """The budget's part of the node's status message: the controller's state and the detector's."""
        fields = self.controller.status()
        if self.anomaly is not None:
            # Flat scalars the status decoder takes as unknown fields (older ingesters ignore them).
            fields.update(status_fields(self.anomaly, int(time.time() * 1000)))
        return fields

    def tick(self, backlog_bytes: int) -> None:
        """Once per cycle, after the cycle is spooled."""
        self.controller.tick(backlog_bytes)
        paced = self._pacer.paced_seconds
        self._metrics.budget_paced.inc(max(0.0, paced - self._paced_seen))
        self._paced_seen = paced
        self._metrics.observe_budget_state(self.controller.state)

    @property
    def rate(self) -> float:
        """The rate the uplink may use now, bytes/s (the controller's, from the budget's windows)."""
        return self.controller.rate

    def _count_shaping(self) -> None:
        for i, c in enumerate(self.budget.classes):
            st = self.shaper.stats[i]
            for outcome, attr in (*_OUTCOMES, ("rounded", "precision_rounded")):
                key = (c.name, outcome)
                total = getattr(st, attr)
                delta = total - self._shaped_seen.get(key, 0)
                if delta > 0:
                    if outcome == "rounded":
                        self._metrics.budget_rounded.labels(c.name).inc(delta)
                    else:
                        self._metrics.budget_samples.labels(c.name, outcome).inc(delta)
                self._shaped_seen[key] = total


def _subset(x: ShapedScrape, picks: list[bool], keep: bool) -> ShapedScrape:
    """The samples of ``x`` whose pick is ``keep``; the scrape's counts go with the windowed part."""
    idx = [i for i, p in enumerate(picks) if p is keep]
    part = replace(
        x,
        labels=[x.labels[i] for i in idx],
        values=array("d", [x.values[i] for i in idx]),
        timestamps=[x.timestamps[i] for i in idx] if x.timestamps is not None else None,
    )
    if keep:  # the live part: counted once, with the windowed part
        part = replace(
            part,
            stale_markers=0,
            duplicates=0,
            over_label_limits=0,
            invalid_timestamps=0,
            repeated_timestamps=0,
            relabel_dropped=0,
        )
    return part
