"""The flight recorder: every scrape kept at full resolution on the edge for a bounded span, whatever the
budget sends, so what happened on a node between 14:02 and 14:05 can be answered from the node later
(anomaly windows, backfill on request).

What is recorded is each target's raw scrape as ``TargetShaper`` made it (target labels, ``up``, stale
markers), before ``BudgetRuntime.shape`` degrades it. It lives in the spool's own SQLite file (table
``recorder``, ``edge_relay.store.spool.recorder``), not beside it: the spool's page cap (``spool.max_bytes``,
or the disk) then covers both, and "the backlog wins" is one rule inside one file. A batch that needs
room takes it from the recorder's oldest blocks first, in the same store, before any batch is evicted;
a second file could only give room back to a full disk, never to a full ``spool.max_bytes``. One file
is also one fsync domain and one recovery path (a corrupt spool is salvaged without its recorder: the
recorder is a convenience copy of data already sent, and the fresh file's room is the backlog's).

The form on disk reuses the wire codec: one envelope (``schemas.codec``) per block of
``recorder.block_seconds`` of cycles. v2 (columnar + zstd) is about 1.6 bytes a sample on the
simulator's workload at 2,000 series, but packing it costs about 3.8 us a sample; v1 is about 4.8 bytes
and 0.7 us (12 cycles of 2,000 series, measured with the block codec alone). So the recorder spends the
CPU only where the room needs it: a block is v1 while ``max_age``'s worth of v1 blocks would fill at
most half of its room (``max_bytes``, or ``spool.max_bytes`` when that is smaller), v2 otherwise and
when there is no age cap (then the room is what sets the span). At the defaults (6 h, 256 MiB) that is
v1 at 2,000 series (about 41 MB for 6 h) and v2 at 20,000 (about 410 MB in v1). Every v1 block is
weighed again, and v2 gives way to v1 again after ``COMPACT_RECHECK_BLOCKS`` blocks, so a node whose
series grow or shrink follows; that weighing first estimates from the last v1 block's bytes a sample,
so a v1 block that could not fit is not packed only to be thrown away. So that every cycle is
durable when it ends (kill -9), a cycle is first written alone in the cheap staging form
(``encode.encode_stage``: msgpack + zstd level 1, ~0.7 us a sample), and the cycle that completes a
block replaces those rows by the block, from the scrapes still in memory, in one transaction: one write
per cycle either way.

Best effort throughout: ``record`` never raises (a recorder failure must never cost a backlog row or a
cycle); failures are logged once per distinct error and counted in ``edge_relay_recorder_errors_total``.
Evictions (``max_age``, ``max_bytes``, ``backlog_room``) are counted in
``edge_relay_recorder_evicted_samples_total``, never in the loss ledger: those samples were sent.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Final

from edge_relay.collect.shape import ShapedScrape
from edge_relay.encode.batches import RecentLabels, decode_stage, encode_checked, encode_stage, to_batch
from edge_relay.store.spool.errors import SpoolFullError
from edge_relay.store.spool.recorder import NewBlock, RecordedBlock, RecorderStats, RecorderTable
from edge_relay.store.spool.store import wall_ms
from schemas import codec
from schemas.model import Batch, Labels, ScrapeBlock

if TYPE_CHECKING:
    from edge_relay.selfmetrics import RelayMetrics

log = logging.getLogger("edge_relay.recorder")

KIND_CYCLE: Final = 1  # one cycle in the staging form: the not yet completed block
# A wire-format envelope: a block of cycles (v1 or v2), or one cycle of the open block as the live lane
# spooled it (v1 or v2; see ``record``).
KIND_ENVELOPE: Final = 2
# A block is the recorder's, never a wire message: it may be larger than a broker takes.
LIMITS: Final = codec.Limits(
    max_payload_bytes=64 << 20, max_decompressed_bytes=512 << 20, max_samples=20_000_000
)
_READ_CHUNK: Final = 8  # blocks read per query, so a long read never holds the spool's lock for long
# v1 blocks while max_age's worth of them fill at most this part of the room: the rest is headroom for
# churn (new series cost their label sets) and for the backlog, which takes the recorder's room first.
_CHEAP_ROOM_FRACTION: Final = 0.5
COMPACT_RECHECK_BLOCKS: Final = 60  # an hour of 60 s blocks in v2 before v1 is weighed again
# A block's v1 bytes a sample vary with its churn and values: a weighing skips v1 only when the last
# v1 block's rate, less this factor, still would not fit.
_CHEAP_ESTIMATE_SLACK: Final = 1.25

Match = Callable[[Labels], bool]


@dataclass(frozen=True, slots=True)
class Gap:
    """Part of a requested range the recorder cannot supply, and why."""

    start_ms: int
    end_ms: int
    # older_than_recorder (evicted, or before the recorder ran), not_recorded (the relay or the recorder
    # was down, or those blocks were given up for the backlog), newer_than_recorder (not scraped yet),
    # disabled (recorder.max_bytes is 0).
    reason: str


class Readout(Iterator[Batch]):
    """What ``FlightRecorder.read`` returns: an iterator of batches at full resolution (one per stored
    block that holds samples in the range, oldest first), plus what it could not supply (``missing``,
    known before iterating: from the blocks held when ``read`` was called). Blocks held then but gone
    by the time the iteration reached them (given up for a batch's room, deleted for a bad checksum,
    undecodable) are in ``lost()`` once the iteration has ended: a paced reader takes minutes.

    ``next_block`` reads one stored block at a time, also one that holds nothing the selector takes
    (None), so that a reader bound to a deadline keeps it whatever the selector matches; iterating
    skips such blocks."""

    def __init__(
        self,
        start_ms: int,
        end_ms: int,
        span: tuple[int, int] | None,
        missing: Sequence[Gap],
        batches: Iterator[Batch | None],
        expected: dict[int, tuple[int, int]] | None = None,
        delivered: set[int] | None = None,
    ) -> None:
        self.start_ms = start_ms
        self.end_ms = end_ms
        self.span = span
        self.missing = tuple(missing)
        self._batches = batches
        self._expected = expected or {}
        self._delivered = delivered if delivered is not None else set()

    def lost(self) -> list[Gap]:
        """The ranges of the blocks that were held at ``read`` and not read (``not_recorded``: their
        samples are not in the recorder any more), clipped to the range, oldest first."""
        out = [
            Gap(max(first, self.start_ms), min(last, self.end_ms), "not_recorded")
            for block_id, (first, last) in self._expected.items()
            if block_id not in self._delivered
        ]
        return sorted(out, key=lambda g: (g.start_ms, g.end_ms))

    @property
    def complete(self) -> bool:
        return not self.missing

    def next_block(self) -> Batch | None:
        """The next block's samples in the range that the selector takes, None when there are none;
        ``StopIteration`` once every block is read."""
        return next(self._batches)

    def __next__(self) -> Batch:
        while True:
            batch = next(self._batches)
            if batch is not None:
                return batch


class FlightRecorder:
    def __init__(
        self,
        table: RecorderTable,
        *,
        cluster: str,
        node: str,
        max_bytes: int,
        max_age_ms: int,
        interval_ms: int,
        block_ms: int = 60_000,
        reserve_bytes: int = 2 << 20,
        spool_max_bytes: int = 0,
        zstd_level: int = 3,
        metrics: RelayMetrics | None = None,
        clock_ms: Callable[[], int] = wall_ms,
    ) -> None:
        """``reserve_bytes``: room under the spool's page cap the recorder leaves to the backlog;
        ``spool_max_bytes``: that cap (0: only the disk), which bounds the recorder's room too."""
        self._table = table
        self.cluster, self.node = cluster, node
        self.max_bytes = max(0, max_bytes)
        self.max_age_ms = max_age_ms
        self.interval_ms = max(1, interval_ms)
        self.cycles_per_block = max(1, round(block_ms / self.interval_ms))
        self.reserve_bytes = reserve_bytes
        self.room_bytes = min(self.max_bytes, spool_max_bytes) if spool_max_bytes > 0 else self.max_bytes
        self.zstd_level = zstd_level
        self._compact_blocks = 0  # blocks still to be packed as v2 before v1 is weighed again
        self._cheap_bytes_per_sample = 0.0  # of the last v1 block packed (0: none yet, so v1 is tried)
        self._metrics = metrics
        self._clock_ms = clock_ms
        # The open block: its cycles' scrapes (kept to encode the block) and their rows on disk.
        self._open: list[list[ShapedScrape]] = []
        self._open_ids: list[int] = []
        self._open_last_ms = 0
        # Label sets a block carried lately: not checked again. Its generations count batches, and a
        # block is ``cycles_per_block`` cycles: 16 blocks (RecentLabels' default) would hold 192 cycles
        # of churn at 12 cycles a block (~160,000 label sets at 20,000 series on the simulator), so a
        # generation here is about 16 cycles, as the live encoder's.
        self._valid = RecentLabels(generation=max(2, -(-16 // self.cycles_per_block)))
        self._last_error: dict[str, str] = {}
        self._seen_evicted: dict[str, int] = dict(table.evicted_samples)
        if metrics is not None:
            for reason in table.evicted_samples:
                metrics.recorder_evicted.labels(reason)
        self._guard("open", self._apply_caps)
        self._guard("stats", self.observe)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    # --- writing -----------------------------------------------------------------------------------

    def record(self, scrapes: Sequence[ShapedScrape], spooled_as: Sequence[bytes] = ()) -> bool:
        """Keep one cycle's scrapes; True when they were stored. Never raises.

        ``spooled_as``: wire envelopes that hold exactly these scrapes (what the live lane just
        spooled, when nothing shaped them). Until its block completes the cycle is stored as those
        bytes, not encoded a second time: the staging form costs about 0.8 us a sample, a copy nothing."""
        if not self.enabled:
            return False
        cycle = [s for s in scrapes if len(s)]
        stored: list[bool] = []
        if cycle:
            self._guard("write", lambda: stored.append(self._record(cycle, spooled_as)))
        self._guard("stats", self.observe)
        return any(stored)

    def _record(self, cycle: list[ShapedScrape], spooled_as: Sequence[bytes]) -> bool:
        if self._open and min(map(_first_ts, cycle)) - self._open_last_ms > 2 * self.interval_ms:
            # Cycles were missed (an overrun, a failed write): a block must not span the gap, or read()
            # could not tell it. The open block's cycles stay stored as they are.
            self._open, self._open_ids = [], []
        samples = sum(len(s) for s in cycle)
        if len(self._open) + 1 >= self.cycles_per_block:
            group, ids = [*self._open, cycle], self._open_ids
            self._open, self._open_ids = [], []
            block = self._encode_block(group)
            if block is not None and self._write([block], ids):
                self._counted(samples)  # the earlier cycles of the block were counted already
                return True
            # Refused by the codec, or a row of the block was given up meanwhile: its stored cycles
            # stay as they are, and this cycle is stored alone.
            stored = bool(self._write(self._cycle_blocks(cycle, spooled_as)))
            self._counted(samples if stored else 0)
            return stored
        ids = self._write(self._cycle_blocks(cycle, spooled_as)) or []
        if not ids:
            return False
        # Only once stored: memory and disk must agree on what the open block holds.
        self._open.append(cycle)
        self._open_ids += ids
        self._open_last_ms = max(map(_last_ts, cycle))
        self._counted(samples)
        return True

    def _write(self, blocks: list[NewBlock], replaces: Sequence[int] = ()) -> list[int] | None:
        def write() -> list[int] | None:
            return self._table.write(
                blocks,
                replaces=replaces,
                max_bytes=self.max_bytes,
                oldest_ms=self._oldest_kept_ms(),
                reserve_bytes=self.reserve_bytes,
            )

        try:
            ids = write()
        except SpoolFullError:
            # The disk is fuller than the file's page cap said: give up our oldest, never a batch.
            self._table.make_room(2 * sum(len(b.payload) for b in blocks) + self.reserve_bytes)
            ids = write()
        if ids == []:
            self._failed("no_room", "the spool has no room beyond what the backlog needs: not recording")
        else:
            self._last_error.pop("no_room", None)  # logged again when it happens again
        return ids

    def _apply_caps(self) -> None:
        # At open: a recorder disabled since gives its room back, an old one its expired blocks.
        self._table.write([], max_bytes=self.max_bytes, oldest_ms=self._oldest_kept_ms(), reserve_bytes=0)

    def _oldest_kept_ms(self) -> int:
        return self._clock_ms() - self.max_age_ms if self.max_age_ms > 0 else -(2**62)

    def _cycle_blocks(self, cycle: list[ShapedScrape], spooled_as: Sequence[bytes]) -> list[NewBlock]:
        if spooled_as:
            headers = [codec.peek_header(p, LIMITS) for p in spooled_as]
            return [
                NewBlock(KIND_ENVELOPE, p, h.first_ts_ms, h.last_ts_ms, h.sample_count)
                for p, h in zip(spooled_as, headers, strict=True)
            ]
        first = min(_first_ts(s) for s in cycle)
        last = max(_last_ts(s) for s in cycle)
        return [NewBlock(KIND_CYCLE, encode_stage(cycle), first, last, sum(len(s) for s in cycle))]

    def _encode_block(self, group: list[list[ShapedScrape]]) -> NewBlock | None:
        batch = to_batch(self.cluster, self.node, [s for cycle in group for s in cycle])
        batch.seq = 1  # a block is never a wire batch; the codec wants a valid seq
        try:
            payload = self._pack(batch, len(group))
        except codec.EncodeError as e:
            # E.g. a series whose own timestamp repeated with another value: the cycles stay as stored.
            self._failed("encode", f"cannot encode a block of {len(group)} cycles: {e}")
            return None
        return NewBlock(
            KIND_ENVELOPE, payload, batch.first_timestamp_ms, batch.last_timestamp_ms, batch.sample_count
        )

    def _pack(self, batch: Batch, cycles: int) -> bytes:
        """The block as v1 when the room affords it (see the module's docstring), else as v2."""
        options = {"level": self.zstd_level, "limits": LIMITS}
        if self.max_age_ms > 0 and self._compact_blocks == 0:
            # max_age holds max_age / interval cycles: the span by the interval, as the relay scrapes.
            span_ms = cycles * self.interval_ms

            def affordable(block_bytes: float) -> bool:
                return block_bytes * self.max_age_ms / span_ms <= _CHEAP_ROOM_FRACTION * self.room_bytes

            # Weighed first by the last v1 block's bytes a sample: a v1 packing that cannot fit is
            # skipped, not made and thrown away (at 20,000 series ~20 MiB of transient memory, once
            # an hour, and the CPU of a block).
            if affordable(batch.sample_count * self._cheap_bytes_per_sample / _CHEAP_ESTIMATE_SLACK):
                cheap = encode_checked(batch, self._valid, version=codec.FORMAT_V1, **options)
                self._cheap_bytes_per_sample = len(cheap) / max(1, batch.sample_count)
                if affordable(len(cheap)):
                    return cheap
            self._compact_blocks = COMPACT_RECHECK_BLOCKS
        else:
            self._compact_blocks = max(0, self._compact_blocks - 1)
        return encode_checked(batch, self._valid, version=codec.FORMAT_V2, **options)

    # --- reading -----------------------------------------------------------------------------------

    def stats(self) -> RecorderStats:
        return self._table.stats()

    def span(self) -> tuple[int, int] | None:
        """(oldest_ms, newest_ms) of the samples held, or None when it holds none."""
        st = self._table.stats()
        if st.oldest_ts_ms is None or st.newest_ts_ms is None:
            return None
        return int(st.oldest_ts_ms), int(st.newest_ts_ms)

    def read(self, start_ms: int, end_ms: int, match: Match | None = None) -> Readout:
        """Every recorded sample with start_ms <= timestamp <= end_ms (of the series ``match`` accepts),
        bit-exact, as batches (one per stored block, oldest first), and what could not be supplied."""
        if end_ms < start_ms:
            raise ValueError(f"end_ms {end_ms} is before start_ms {start_ms}")
        spans = self._table.spans()
        span = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None
        if not self.enabled and not spans:
            missing = [Gap(start_ms, end_ms, "disabled")]
        else:
            missing = gaps(spans, start_ms, end_ms, 2 * self.interval_ms)
        expected = self._table.block_spans(start_ms, end_ms)
        delivered: set[int] = set()
        batches = self._batches(start_ms, end_ms, match, delivered)
        return Readout(start_ms, end_ms, span, missing, batches, expected, delivered)

    def _batches(
        self, start_ms: int, end_ms: int, match: Match | None, delivered: set[int]
    ) -> Iterator[Batch | None]:
        after = 0
        if match is not None:
            match = _remembered(match)
        while True:
            blocks = self._table.blocks(start_ms, end_ms, after_id=after, limit=_READ_CHUNK)
            if not blocks:
                return
            after = blocks[-1].id
            for block in blocks:
                try:
                    batch = self._decode(block)
                except (ValueError, codec.DecodeError) as e:
                    self._failed("read", f"cannot decode recorder block {block.id}: {e}")
                    yield None
                    continue
                delivered.add(block.id)
                yield select(batch, start_ms, end_ms, match)

    def _decode(self, block: RecordedBlock) -> Batch:
        if block.kind == KIND_ENVELOPE:
            return codec.decode_batch(block.payload, LIMITS)
        if block.kind == KIND_CYCLE:
            return to_batch(self.cluster, self.node, decode_stage(block.payload))
        raise ValueError(f"unknown block kind {block.kind}")

    # --- metrics and errors ------------------------------------------------------------------------

    def observe(self) -> None:
        """The recorder's gauges, and the evictions counted since the last call (``Retention`` gives
        blocks up for the backlog between two cycles)."""
        m = self._metrics
        if m is None:
            return
        for reason, total in self._table.evicted_samples.items():
            delta = total - self._seen_evicted.get(reason, 0)
            if delta > 0:
                m.recorder_evicted.labels(reason).inc(delta)
            self._seen_evicted[reason] = total
        st = self._table.stats()
        m.recorder_bytes.set(st.bytes)
        m.recorder_oldest.set(0 if st.oldest_ts_ms is None else st.oldest_ts_ms / 1000)

    def _counted(self, samples: int) -> None:
        if self._metrics is not None and samples > 0:
            self._metrics.recorder_samples.inc(samples)

    def _guard(self, op: str, fn: Callable[[], object]) -> bool:
        try:
            fn()
        except Exception as e:  # best effort: whatever fails here must not reach the cycle
            self._failed(op, f"{type(e).__name__}: {e}")
            return False
        return True

    def _failed(self, op: str, error: str) -> None:
        if self._metrics is not None:
            self._metrics.recorder_errors.labels(op).inc()
        if self._last_error.get(op) != error:  # logged once per distinct error, not every cycle
            # No room is the recorder working as designed (the backlog comes first), not a fault.
            log.log(
                logging.WARNING if op == "no_room" else logging.ERROR, "flight recorder (%s): %s", op, error
            )
            self._last_error[op] = error


def gaps(spans: Sequence[tuple[int, int]], start_ms: int, end_ms: int, max_gap_ms: int) -> list[Gap]:
    """The parts of [start_ms, end_ms] the blocks' spans (sorted by start) do not cover; blocks closer
    than ``max_gap_ms`` (two scrape intervals) are contiguous."""
    if not spans:
        return [Gap(start_ms, end_ms, "not_recorded")]
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1] + max_gap_ms:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out: list[Gap] = []
    if start_ms < merged[0][0]:
        out.append(Gap(start_ms, min(end_ms, merged[0][0] - 1), "older_than_recorder"))
    for (_, prev_end), (next_start, _) in pairwise(merged):
        lo, hi = max(start_ms, prev_end + 1), min(end_ms, next_start - 1)
        if lo <= hi:
            out.append(Gap(lo, hi, "not_recorded"))
    if end_ms > merged[-1][1]:
        out.append(Gap(max(start_ms, merged[-1][1] + 1), end_ms, "newer_than_recorder"))
    return out


def _remembered(match: Match) -> Match:
    """``match`` asked once per label set of a read: the blocks of a range share most of theirs."""
    seen: dict[Labels, bool] = {}

    def remembered(labels: Labels) -> bool:
        hit = seen.get(labels)
        if hit is None:
            hit = seen[labels] = bool(match(labels))
        return hit

    return remembered


def select(batch: Batch, start_ms: int, end_ms: int, match: Match | None) -> Batch | None:
    """``batch`` cut to [start_ms, end_ms] and the series ``match`` accepts; None when nothing is left."""
    keep = [True] * len(batch.labelsets) if match is None else [bool(match(ls)) for ls in batch.labelsets]
    if not any(keep):
        return None
    remap: dict[int, int] = {}
    labelsets: list[Labels] = []
    blocks: list[ScrapeBlock] = []
    for block in batch.scrapes:
        ids, values = array("I"), array("d")
        stamps = None if block.timestamps is None else array("q")
        for i, idx in enumerate(block.series):
            ts = block.timestamp_ms if block.timestamps is None else block.timestamps[i]
            if not keep[idx] or ts < start_ms or ts > end_ms:
                continue
            new = remap.get(idx)
            if new is None:
                new = remap[idx] = len(labelsets)
                labelsets.append(batch.labelsets[idx])
            ids.append(new)
            values.append(block.values[i])
            if stamps is not None:
                stamps.append(ts)
        if len(values):
            blocks.append(ScrapeBlock(block.timestamp_ms, ids, values, stamps))
    if not blocks:
        return None
    return Batch(batch.cluster, batch.node, 0, labelsets, blocks)


def _first_ts(s: ShapedScrape) -> int:
    return s.timestamp_ms if s.timestamps is None else min(s.timestamps)


def _last_ts(s: ShapedScrape) -> int:
    return s.timestamp_ms if s.timestamps is None else max(s.timestamps)
