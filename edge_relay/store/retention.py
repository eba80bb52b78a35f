"""Spool caps: degrade before drop, and write down every sample given up.

When the backlog outgrows ``spool.cap_bytes`` (the link has been down for long), the oldest batches
are first re-downsampled to a coarser resolution, doubling the step each time up to
``spool.max_degrade_factor``; only then are the oldest batches of the lowest priority evicted.
Batches older than ``spool.max_age_seconds`` are evicted too, and a full disk makes room the same way,
so new data always gets in (the newest data is what an operator needs first after an outage).
Every sample merged away or evicted goes into the spool's loss ledger with its reason, series and
time range, which is what ``edge_relay_samples_dropped_total`` and the status message report.

Downsampling keeps real samples at their real timestamps (no synthetic values), so a re-delivered
original and its downsampled copy never disagree at the receiver:
- per series, the first sample and the last sample of each window of ``factor x interval``;
- every stale marker, and the sample just before one (a series' last value);
- for counters (``_total``, ``_count``, ``_sum``, ``_bucket``, and the counters the budget presets and
  classes name, such as ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``), the sample before each reset, so
  ``rate()`` and ``increase()`` over the coarser data stay exact across resets.
"""

from __future__ import annotations

import logging
from array import array
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from edge_relay.ledger import LossReason, LossRecord
from edge_relay.store.encoder import Encoder
from edge_relay.store.spool import InFlight, Order, Replacement, Spool, SpoolRow
from schemas import codec
from schemas.model import Batch, Labels, ScrapeBlock, is_counter, is_stale, metric_name
from vendors.registry import PRESET_COUNTERS

log = logging.getLogger("edge_relay.retention")

_GROUP_ROWS = 16  # batches merged in one degrade step
_MAX_STEPS = 8  # degrade/evict steps per cycle, so a long backlog never stalls scraping
_ROOM_SLACK_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Policy:
    cap_bytes: int  # 0 = no byte cap
    max_age_ms: int  # 0 = no age cap
    max_factor: int  # 1 = never downsample, evict straight away
    interval_ms: int  # the scrape interval: resolution factor 1
    busy_ms: int  # rows published this recently may be in flight: leave them alone
    counters: frozenset[str] = PRESET_COUNTERS  # counters without a counter suffix


def describe(batches: Sequence[Batch]) -> str:
    """A series matcher naming what a loss touched (jobs of the batches)."""
    jobs = sorted({v for b in batches for labels in b.labelsets for k, v in labels if k == "job"})
    if not jobs:
        return "{}"
    return f'{{job="{jobs[0]}"}}' if len(jobs) == 1 else f'{{job=~"{"|".join(jobs)}"}}'


def describe_row(row: SpoolRow) -> str:
    """The jobs of a spool row's series, for its ledger entry (the seq if the payload does not decode)."""
    try:
        return describe([codec.decode_batch(row.payload)])
    except codec.DecodeError:
        return f"spool seq {row.seq}"


def downsample(
    batches: Sequence[Batch], factor: int, interval_ms: int, counters: frozenset[str] = PRESET_COUNTERS
) -> tuple[list[ScrapeBlock], list[Labels], int]:
    """Blocks at the coarser resolution, their label table, and how many samples were merged away."""
    window = max(1, factor * interval_ms)
    series: dict[Labels, dict[int, float]] = defaultdict(dict)
    total = 0
    for b in batches:
        for block in b.scrapes:
            for i, idx in enumerate(block.series):
                series[b.labelsets[idx]][block.sample_timestamp(i)] = block.values[i]  # later copy wins
                total += 1
    by_ts: dict[int, list[tuple[Labels, float]]] = defaultdict(list)
    kept = 0
    for labels, points in series.items():
        counter = is_counter(metric_name(labels), counters)
        ordered = sorted(points.items())
        for j, (ts, value) in enumerate(ordered):
            if j + 1 < len(ordered):
                nts, nvalue = ordered[j + 1]
                keep = (
                    j == 0  # the first sample: increase() over the whole backlog stays exact
                    or nts // window != ts // window
                    or is_stale(value)
                    or is_stale(nvalue)
                    or (counter and nvalue < value)
                )
            else:
                keep = True
            if keep:
                by_ts[ts].append((labels, value))
                kept += 1
    table: dict[Labels, int] = {}
    blocks: list[ScrapeBlock] = []
    for ts in sorted(by_ts):
        ids, values = array("I"), array("d")
        for labels, value in by_ts[ts]:
            ids.append(table.setdefault(labels, len(table)))
            values.append(value)
        blocks.append(ScrapeBlock(ts, ids, values))
    return blocks, list(table), total - kept


class Retention:
    """The caps over ``spool``'s batches.

    ``encoder`` is the relay's own (same wire format, and the batch cap the budget sets); ``inflight``
    is the uplink's set of batches whose ack may be on its way, which are left alone.
    """

    def __init__(
        self, spool: Spool, policy: Policy, *, encoder: Encoder, inflight: InFlight | None = None
    ) -> None:
        self.spool = spool
        self.batches = spool.batches
        self.policy = policy
        self.inflight = inflight if inflight is not None else InFlight()
        self.encoder = encoder

    def _decode(self, rows: Sequence[SpoolRow]) -> list[Batch]:
        return [codec.decode_batch(r.payload) for r in rows]

    def _candidates(self, now_ms: int, order: Order, limit: int) -> list[SpoolRow]:
        rows = self.batches.pending(limit, order=order, exclude=self.inflight.seqs)
        return [r for r in rows if r.last_sent_ms is None or now_ms - r.last_sent_ms > self.policy.busy_ms]

    def enforce(self, now_ms: int) -> None:
        """Apply the age cap, then the byte cap (degrade first, then evict). Bounded work per call."""
        p = self.policy
        if p.max_age_ms:
            old = [
                r
                for r in self._candidates(now_ms, Order.OLDEST_DATA, 256)
                if r.last_ts_ms < now_ms - p.max_age_ms
            ]
            if old:
                n = self.batches.evict(old, LossReason.MAX_AGE, describe_row)
                log.warning("evicted %d batch(es) older than spool.max_age_seconds", n)
        if not p.cap_bytes:
            return
        for _ in range(_MAX_STEPS):
            size = self.spool.stats().bytes
            if size <= p.cap_bytes:
                return
            if not self._degrade(now_ms):
                self._evict_oldest(now_ms, size - p.cap_bytes, LossReason.CAP_BYTES)

    def make_room(self, now_ms: int, need_bytes: int, reason: LossReason = LossReason.SPOOL_FULL) -> int:
        """Make about ``need_bytes`` free (a full disk or hard cap): the flight recorder's oldest blocks
        go first (the backlog wins; they were sent already), then the oldest batches."""
        need = max(need_bytes, 1)
        # Twice the need and a margin: payload bytes freed are not quite pages freed, and a batch must
        # not be evicted while the recorder still held blocks.
        freed = self.spool.recorder.make_room(2 * need + _ROOM_SLACK_BYTES)
        if freed >= 2 * need + _ROOM_SLACK_BYTES:
            return freed
        return freed + self._evict_oldest(now_ms, need, reason)

    def _evict_oldest(self, now_ms: int, need_bytes: int, reason: LossReason) -> int:
        rows = self._candidates(now_ms, Order.EVICTION, 64)
        chosen: list[SpoolRow] = []
        freed = 0
        for row in rows:
            if freed >= need_bytes:
                break
            chosen.append(row)
            freed += row.byte_size
        if chosen:
            self.batches.evict(chosen, reason, describe_row)
            log.warning(
                "spool over its limit (%s): evicted %d batch(es), %d samples, data from %d to %d",
                reason,
                len(chosen),
                sum(r.sample_count for r in chosen),
                chosen[0].first_ts_ms,
                chosen[-1].last_ts_ms,
            )
        return freed

    def _degrade(self, now_ms: int) -> bool:
        """Re-downsample the oldest group of batches one step. False when nothing can degrade further."""
        p = self.policy
        rows = self._candidates(now_ms, Order.OLDEST_DATA, 4 * _GROUP_ROWS)
        if not rows:
            return False
        factors = self.batches.resolution([r.seq for r in rows])
        level = min(factors.values())
        if level * 2 > p.max_factor:
            return False
        group = [r for r in rows if factors[r.seq] == level][:_GROUP_ROWS]
        try:
            batches = self._decode(group)
        except codec.DecodeError as e:
            # Cannot happen for rows that passed their CRC; if it does, do not loop on them.
            log.error("cannot re-downsample spool rows: %s", e)
            return False
        blocks, table, merged = downsample(batches, level * 2, p.interval_ms, p.counters)
        replacements = self._encode(blocks, table)
        first = min(r.first_ts_ms for r in group)
        last = max(r.last_ts_ms for r in group)
        self.batches.replace(
            [r.seq for r in group],
            replacements,
            factor=level * 2,
            loss=LossRecord(LossReason.DOWNSAMPLED, describe(batches), first, last, merged),
        )
        log.warning(
            "spool over spool.cap_bytes: re-downsampled %d batch(es) to %gs resolution (%d samples merged)",
            len(group),
            level * 2 * p.interval_ms / 1000,
            merged,
        )
        return True

    def _encode(self, blocks: list[ScrapeBlock], table: list[Labels]) -> list[Replacement]:
        """Blocks as batches under batch.max_bytes (each batch carries only the label sets it uses)."""
        if not blocks:
            return []
        whole = Batch.of_blocks(self.encoder.cluster, self.encoder.node, blocks, table)
        # A single sample over the cap stays as it was spooled: it was sendable then.
        return [
            Replacement(
                lambda seq, b=batch: self.encoder.encode(b, seq),
                batch.first_timestamp_ms,
                batch.last_timestamp_ms,
                batch.sample_count,
            )
            for batch in self.encoder.fit(whole, keep_oversized=True)
        ]
