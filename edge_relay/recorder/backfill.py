"""Backfill on request: the raw samples of a time range, from the flight recorder, sent again.

The ingester's identity publishes a ``BackfillRequest`` on the node's ``cmd`` topic
(``cloud-ingest backfill``); the uplink decodes it and hands it to the ``CommandInbox`` (built by the
relay before the uplink and the ``Backfiller``, so neither reaches back into ``Relay``); the relay's loop
calls ``Backfiller.step`` once a cycle. The answer comes from ``FlightRecorder.read`` at full resolution:
the matching samples of the range become ordinary batches appended to the spool through ``SpoolSink``,
so they are durable, paced by the budget's pacer, retried and acked like an outage backlog (and sent
before it: the send queue goes oldest data first). Prometheus takes them only within its out-of-order
window (``storage.tsdb.out_of_order_time_window``), as for a backlog; samples it already holds are
rewritten with identical values. Once the range is spooled, the result (what was supplied, and the
recorder's ``missing`` gaps) goes back on ``cmd_result``.

The work is bounded: one request at a time per relay (a second one while one runs is refused with the
reason ``busy``: the operator sees it at once instead of waiting behind an unknown queue), at most
``MAX_SAMPLES`` samples per request (the rest of the range is reported missing as ``sample_cap``), and
at most a quarter of the scrape interval of work per cycle, so a day-long range never delays a scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from edge_relay.encode.batches import BatchEncoder
from edge_relay.recorder.flight import FlightRecorder, Readout
from relay_common.selector import Selector, SelectorError, parse_selector
from schemas.codec.command import (
    BackfillRequest,
    CommandResult,
    MissingRange,
    encode_result,
)
from schemas.model import Batch, Labels

if TYPE_CHECKING:
    from edge_relay.selfmetrics import RelayMetrics
    from edge_relay.store.sink import SpoolSink

log = logging.getLogger("edge_relay.backfill")

MAX_SAMPLES: Final = 2_000_000  # per request: ~2 h of 2,000 series at 5 s, ~3 MB on the wire in v2
EXPIRES_MS: Final = 600_000  # a request older than this (queued for an offline node) is refused
_MAX_RESULTS: Final = 16  # results waiting for a connection; older ones are dropped
_MAX_ANSWERED: Final = 4096  # answered ids remembered (one request at a time: ~1 a cycle at most)

# --- the inbox between the uplink and the backfiller ----------------------------------------------


class CommandInbox:
    """Requests from the uplink thread to the relay's loop, and results back: one request at a time."""

    def __init__(self, cluster: str, node: str, metrics: RelayMetrics) -> None:
        self.cluster, self.node = cluster, node
        self._metrics = metrics
        self._lock = threading.Lock()
        self._pending: BackfillRequest | None = None
        self._busy: str | None = None  # id of the request taken or pending
        # Ids of the requests answered within the time a request stays valid (EXPIRES_MS): QoS 1 may
        # deliver one again later (a reconnect, a broker's redelivery), and it must not run twice.
        self._answered: OrderedDict[str, int] = OrderedDict()
        self._results: deque[bytes] = deque(maxlen=_MAX_RESULTS)

    def submit(self, req: BackfillRequest) -> None:
        """A decoded request; refused at once (``busy``) while another one is waiting or running."""
        with self._lock:
            if req.id in self._answered:
                return  # QoS 1 delivered it again after it was answered: not done twice
            if self._busy is None:
                self._pending, self._busy = req, req.id
                return
            running = self._busy
        if running == req.id:
            return  # QoS 1 delivered it twice: the one running answers
        self.answer(self.refusal(req.id, f"busy: request {running} is still running", req), "busy", req.kind)

    def refuse(
        self, req_id: str | None, reason: str, result: str = "malformed", kind: str = "unknown"
    ) -> None:
        self.answer(self.refusal(req_id, reason), result, kind)

    def refusal(self, req_id: str | None, reason: str, req: BackfillRequest | None = None) -> CommandResult:
        return CommandResult(
            req_id,
            self.cluster,
            self.node,
            "refused",
            int(time.time() * 1000),
            reason=reason,
            from_ms=req.from_ms if req is not None else 0,
            to_ms=req.to_ms if req is not None else 0,
        )

    def take(self) -> BackfillRequest | None:
        with self._lock:
            req, self._pending = self._pending, None
            return req

    def answer(
        self, res: CommandResult, result: str, kind: str = "backfill", *, finished: bool = False
    ) -> None:
        """Queue ``res`` for the uplink and count it; ``finished``: it ends the request taken (the slot is
        free again). Only the backfiller finishes requests: a refusal by the uplink that happens to carry
        the running id must not free the slot under it."""
        self._metrics.commands.labels(kind, result).inc()
        log.log(
            logging.INFO if res.result == "done" else logging.WARNING,
            "command %s: %s%s",
            res.id,
            res.result,
            f" ({res.reason})" if res.reason else f" ({res.samples} samples, {res.batches} batches)",
        )
        with self._lock:
            self._results.append(encode_result(res))
            if finished:
                self._busy = None
                if res.id is not None:
                    self._remember(res.id)

    def _remember(self, req_id: str) -> None:
        now = int(time.time() * 1000)
        self._answered[req_id] = now
        self._answered.move_to_end(req_id)
        # Kept twice as long as a request stays valid (clocks differ): a redelivery after that is
        # refused as expired anyway.
        while self._answered and (
            len(self._answered) > _MAX_ANSWERED or next(iter(self._answered.values())) < now - 2 * EXPIRES_MS
        ):
            self._answered.popitem(last=False)

    def outgoing(self) -> list[bytes]:
        """The results to publish now (the uplink calls this when connected)."""
        with self._lock:
            out = list(self._results)
            self._results.clear()
            return out

    def requeue(self, payloads: Sequence[bytes]) -> None:
        with self._lock:
            self._results.extendleft(reversed(payloads))


# --- the backfiller -------------------------------------------------------------------------------


@dataclass
class _Job:
    req: BackfillRequest
    readout: Readout
    missing: list[MissingRange]
    samples: int = 0
    batches: int = 0
    series: set[Labels] | None = None
    first_ms: int | None = None
    last_ms: int | None = None
    done: bool = False


class Backfiller:
    def __init__(
        self,
        inbox: CommandInbox,
        recorder: FlightRecorder,
        sink: SpoolSink,
        encoder: BatchEncoder,
        metrics: RelayMetrics,
        *,
        step_seconds: float,
        max_samples: int = MAX_SAMPLES,
        spool_max_age_ms: int = 0,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._monotonic = monotonic
        self._inbox = inbox
        self._recorder = recorder
        self._sink = sink
        self._encoder = encoder
        self._metrics = metrics
        self.step_seconds = step_seconds
        self.max_samples = max_samples
        self.spool_max_age_ms = spool_max_age_ms
        self._clock_ms = clock_ms
        self._job: _Job | None = None

    @property
    def busy(self) -> bool:
        return self._job is not None

    def step(self) -> int:
        """Some work on the request in hand (or the next one): returns the samples spooled now."""
        if self._job is None:
            req = self._inbox.take()
            if req is None:
                return 0
            self._job = self._start(req)
            if self._job is None:
                return 0
        job = self._job
        deadline = self._monotonic() + self.step_seconds
        spooled = blocks = 0
        try:
            # At least one block a step, then as many as the deadline allows, whether or not they
            # hold anything the selector takes: decoding is the work, not spooling.
            while not job.done and (blocks == 0 or self._monotonic() < deadline):
                blocks += 1
                try:
                    batch = job.readout.next_block()
                except StopIteration:
                    lost = job.readout.lost()
                    if lost:
                        log.warning(
                            "backfill %s: %d recorder block(s) in its range went while it was read (room for "
                            "the backlog, a bad checksum): reported as not_recorded",
                            job.req.id,
                            len(lost),
                        )
                    job.missing += [MissingRange(g.start_ms, g.end_ms, g.reason) for g in lost]
                    job.done = True
                    break
                if batch is not None:
                    spooled += self._spool(job, batch)
        except Exception as e:  # a recorder or spool fault ends this request, never the cycle
            log.exception("backfill %s failed", job.req.id)
            self._job = None
            self._inbox.answer(
                replace(
                    self._inbox.refusal(job.req.id, f"{type(e).__name__}: {e}"[:200], job.req),
                    result="failed",
                ),
                "failed",
                finished=True,
            )
            return spooled
        if job.done:
            self._job = None
            self._inbox.answer(self._result(job), "done", finished=True)
        return spooled

    def _start(self, req: BackfillRequest) -> _Job | None:
        now = self._clock_ms()
        why = None
        if req.node != self._inbox.node or req.cluster != self._inbox.cluster:
            why = f"this is {self._inbox.cluster}/{self._inbox.node}, not {req.cluster}/{req.node}"
        elif now - req.ts_ms > EXPIRES_MS:
            why = f"expired: issued {(now - req.ts_ms) / 1000:.0f}s ago (at most {EXPIRES_MS // 1000}s)"
        match: Selector | None = None
        if why is None and req.match is not None:
            try:
                match = parse_selector(req.match)
            except SelectorError as e:
                why = str(e)[:200]
        if why is not None:
            self._inbox.answer(self._inbox.refusal(req.id, why, req), "refused", finished=True)
            return None
        from_ms, missing = req.from_ms, []
        if self.spool_max_age_ms:
            # Spooled now, samples older than spool.max_age_seconds would be evicted at once (and
            # ledgered as lost): out of the recorder's reach too, with a tenth of the age left to send.
            horizon = now - self.spool_max_age_ms * 9 // 10
            if from_ms < horizon:
                missing.append(MissingRange(from_ms, min(horizon, req.to_ms + 1) - 1, "older_than_recorder"))
                from_ms = horizon
        if from_ms > req.to_ms:  # all of it too old: nothing to read
            readout = Readout(req.from_ms, req.to_ms, None, [], iter(()))
        else:
            readout = self._recorder.read(from_ms, req.to_ms, match)
        missing += [MissingRange(g.start_ms, g.end_ms, g.reason) for g in readout.missing]
        log.info("backfill %s: %d..%d %s", req.id, req.from_ms, req.to_ms, req.match or "(all series)")
        return _Job(req, readout, missing, series=set())

    def _spool(self, job: _Job, batch: Batch) -> int:
        if job.samples + batch.sample_count > self.max_samples:
            # Cut at a block: the rest of the range is reported, never silently left out.
            job.missing.append(MissingRange(batch.first_timestamp_ms, job.req.to_ms, "sample_cap"))
            job.done = True
            return 0
        spooled = 0
        for part in self._encoder.fit(batch):
            if self._sink.append(part) is None:
                job.missing.append(MissingRange(part.first_timestamp_ms, job.req.to_ms, "spool_full"))
                job.done = True
                break
            spooled += part.sample_count
            job.batches += 1
            assert job.series is not None
            job.series.update(part.labelsets)
            first, last = part.first_timestamp_ms, part.last_timestamp_ms
            job.first_ms = first if job.first_ms is None else min(job.first_ms, first)
            job.last_ms = last if job.last_ms is None else max(job.last_ms, last)
        job.samples += spooled
        self._metrics.backfill_samples.inc(spooled)
        return spooled

    def _result(self, job: _Job) -> CommandResult:
        req = job.req
        return CommandResult(
            req.id,
            self._inbox.cluster,
            self._inbox.node,
            "done",
            self._clock_ms(),
            from_ms=req.from_ms,
            to_ms=req.to_ms,
            samples=job.samples,
            series=len(job.series or ()),
            batches=job.batches,
            first_ms=job.first_ms,
            last_ms=job.last_ms,
            missing=tuple(job.missing),
        )
