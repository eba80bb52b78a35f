"""The past part of an anomaly window: the flight recorder's raw samples of the affected GPU's series
from ``pre_seconds`` before the event, into the spool at the budget's reserved share.

``edge_relay.anomaly.detector`` decides that a window opens (an ``Event``) and which series it
covers; this stage reads them back from the recorder (``edge_relay.recorder.flight``) and appends
them through the sink, so they are durable, paced and acked like a backlog.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from edge_relay.anomaly.detector import Detector, Event
from edge_relay.collect.shape import ShapedScrape
from edge_relay.encode.batches import BatchEncoder
from edge_relay.selfmetrics import RelayMetrics
from schemas.model import Labels

log = logging.getLogger("edge_relay")


@dataclass(slots=True)
class _Past:
    event: Event
    start_ms: int
    end_ms: int
    match: Callable[[Labels], bool]
    batches: Iterator[Any] | None = None


class PastParts:
    """The past part of each window: the flight recorder's raw samples of the GPU's series for
    [event - pre_seconds, the event's scrape], appended to the spool through the sink (durable, paced
    and acked like a backlog, the oldest data first), at ``reserved_share`` of the allowed rate: a
    credit per cycle, so a window never bursts the link and the live data keeps flowing beside it."""

    def __init__(
        self,
        recorder: Any,
        sink: Any,
        interval_s: float,
        encoder: BatchEncoder | None = None,
        metrics: RelayMetrics | None = None,
    ) -> None:
        self._metrics = metrics
        self._recorder = recorder
        self._sink = sink
        # Cuts a recorder block (block_seconds of cycles) into batches within batch.max_bytes.
        self._encoder = encoder
        self._interval_s = interval_s
        self._jobs: deque[_Past] = deque()
        self._credit = 0.0

    @property
    def pending(self) -> int:
        return len(self._jobs)

    def open(self, events: list[Event], detector: Detector | None, raw: list[ShapedScrape]) -> None:
        """The cycle's new events, logged; each window that opened gets its past part, up to the
        cycle's last scrape (``raw``: the scrapes the events were detected on)."""
        if not events or detector is None:
            return
        end_ms = max((x.timestamp_ms for x in raw if len(x)), default=int(time.time() * 1000))
        cfg = detector.cfg
        for ev in events:
            log.warning(
                "anomaly: %s score=%.1f; %s",
                ev.describe(),
                ev.score,
                f"full resolution from {cfg.pre_seconds:g}s before until {ev.window_end_ms}"
                if ev.opened
                else f"not widened: {cfg.max_windows} windows open",
            )
            if ev.opened and cfg.pre_seconds > 0:
                self.start(ev, detector.match(ev.gpu), cfg.pre_seconds, end_ms)

    def start(self, ev: Event, match: Callable[[Labels], bool], pre_seconds: float, end_ms: int) -> None:
        """The past of ``ev``: from ``pre_seconds`` before its scrape to ``end_ms`` (the cycle's last
        scrape; from the next cycle on, the live part carries the GPU's samples)."""
        self._jobs.append(_Past(ev, ev.at_ms - round(pre_seconds * 1000), max(end_ms, ev.at_ms), match))

    def step(self, rate_bytes_per_s: float, share: float) -> tuple[int, int]:
        """Spool what this cycle's credit allows; returns (samples, bytes) spooled. Call after the
        cycle's scrapes are recorded (the event's own scrape is then in the recorder)."""
        if not self._jobs:
            self._credit = 0.0
            return 0, 0
        allowance = max(1.0, rate_bytes_per_s * share * self._interval_s)
        # At most two cycles' worth saved up: a pause (no jobs) must not turn into a burst later.
        self._credit = min(self._credit + allowance, 2 * allowance)
        samples = nbytes = 0
        while self._jobs and self._credit > 0:
            job = self._jobs[0]
            if job.batches is None:
                readout = self._recorder.read(job.start_ms, job.end_ms, job.match)
                job.event.missing = "; ".join(
                    f"{g.reason} {g.start_ms}..{g.end_ms}" for g in getattr(readout, "missing", ())
                )
                job.batches = readout
            batch = next(job.batches, None)
            if batch is None:
                lost = getattr(job.batches, "lost", list)()
                if lost:  # blocks that went while the part was sent (room for the backlog)
                    gone = "; ".join(f"{g.reason} {g.start_ms}..{g.end_ms}" for g in lost)
                    job.event.missing = f"{job.event.missing}; {gone}" if job.event.missing else gone
                self._jobs.popleft()
                continue
            for part in self._encoder.fit(batch) if self._encoder is not None else [batch]:
                payload = self._sink.append(part)
                if payload is not None:
                    samples += part.sample_count
                    nbytes += len(payload)
                    self._credit -= len(payload)
        if samples and self._metrics is not None:
            self._metrics.anomaly_window_samples.labels("past").inc(samples)
        return samples, nbytes
