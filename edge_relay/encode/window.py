"""The batch window: a budget's cycles collected into one batch per ``uplink.batch_window_seconds``.

A label set is the expensive part of a sample on the wire, so with a budget one batch carries a whole
window of scrapes (each label set once, values as deltas over time). Each cycle is staged durably in the
spool as it is scraped (``add``), so a kill -9 inside the window loses nothing; ``resume`` picks the
staged cycles up after a restart, with or without a budget (a relay that is not windowed, or no longer,
packs them at its next cycle). When the window closes (a cycle of the next window arrives, or the
window's time is up: ``close_if_due``) its cycles are packed into batches (``pack``) that replace the
staged rows in one spool transaction. Windows are aligned to wall time with a per-node offset, so a
fleet does not publish all at the same second.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

from edge_relay.collect.shape import ShapedScrape
from edge_relay.encode.batches import BatchEncoder, decode_stage, dedupe_window, encode_stage, to_batch
from edge_relay.ledger import LossLedger, LossReason, LossRecord
from edge_relay.store.retention import describe
from edge_relay.store.sink import SpoolSink
from edge_relay.store.spool import StagingTable
from schemas.model import Batch

log = logging.getLogger("edge_relay")


class BatchWindow:
    def __init__(
        self,
        staging: StagingTable,
        sink: SpoolSink,
        encoder: BatchEncoder,
        ledger: LossLedger,
        *,
        cluster: str,
        node: str,
        window_ms: int,
    ) -> None:
        self._staging = staging
        self._sink = sink
        self._encoder = encoder
        self._ledger = ledger
        self._cluster = cluster
        self._node = node
        self.window_ms = window_ms
        # Per-node offset of the window grid, so a fleet's windows do not all close at the same second.
        self._offset_ms = zlib.crc32(f"{cluster}/{node}".encode())
        self._ids: list[int] = []
        self._scrapes: list[ShapedScrape] = []
        self._index: int | None = None

    def _window_of(self, ts_ms: int) -> int:
        return (ts_ms - self._offset_ms % self.window_ms) // self.window_ms

    @property
    def open(self) -> bool:
        return bool(self._ids)

    def resume(self) -> None:
        """Cycles staged before a restart belong to the open window."""
        for row in self._staging.staged():
            try:
                self._scrapes.extend(decode_stage(row.payload))
            except ValueError as e:
                log.error(
                    "staged cycle %d cannot be read (%s): its %d samples are lost",
                    row.id,
                    e,
                    row.sample_count,
                )
                self._ledger.record(
                    LossReason.CORRUPT_ROW,
                    f"spool staging {row.id}",
                    row.first_ts_ms,
                    row.last_ts_ms,
                    row.sample_count,
                )
                self._staging.promote([row.id], [])
                continue
            self._ids.append(row.id)
            if self._index is None:
                self._index = self._window_of(row.first_ts_ms)
        if self._ids:
            log.info("resumed an open batch window of %d staged cycle(s)", len(self._ids))

    def add(self, shaped: Sequence[ShapedScrape]) -> tuple[int, int]:
        """Stage one cycle (packing the open window first if this cycle starts a new one).

        Returns (samples staged, bytes of batches packed on the way)."""
        scrapes = [x for x in shaped if len(x)]
        if not scrapes:
            return 0, 0
        first = min(min(x.timestamps) if x.timestamps else x.timestamp_ms for x in scrapes)
        last = max(max(x.timestamps) if x.timestamps else x.timestamp_ms for x in scrapes)
        index = self._window_of(max(x.timestamp_ms for x in scrapes))
        packed = 0
        if self._index is not None and index != self._index:
            packed = self.pack()
        count = sum(len(x) for x in scrapes)
        staged_id = self._sink.stage(
            encode_stage(scrapes),
            first_ts_ms=first,
            last_ts_ms=last,
            sample_count=count,
            series=lambda: describe([to_batch(self._cluster, self._node, scrapes)]),
        )
        if staged_id is None:
            return 0, packed
        self._ids.append(staged_id)
        self._scrapes.extend(scrapes)
        self._index = index
        return count, packed

    def close_if_due(self, now_ms: int) -> int:
        """A window also closes on time, so the last cycles before a quiet spell still go out.
        Returns the bytes of the batches packed."""
        if self._index is not None and self._window_of(now_ms) != self._index:
            return self.pack()
        return 0

    def pack(self) -> int:
        """Turn the open window's staged cycles into batches (one spool transaction); returns their bytes."""
        if not self._ids:
            self._index = None
            return 0
        window, duplicates = dedupe_window(self._scrapes)
        losses: list[LossRecord] = []
        if duplicates:
            # Explicit exporter timestamps that did not advance between scrapes: Prometheus would keep
            # only one sample per series and timestamp too.
            first, last = self._scrapes[0].timestamp_ms, self._scrapes[-1].timestamp_ms
            for target, samples in sorted(duplicates.items()):
                losses.append(
                    LossRecord(LossReason.DUPLICATE_SAMPLE, f'{{job="{target}"}}', first, last, samples)
                )
        packed = self._sink.promote(self._ids, self._encode(window, losses))
        if packed is None:
            return 0  # the cycles stay staged; the next cycle packs them again (and counts losses then)
        for loss in losses:
            self._ledger.record(loss.reason, loss.series, loss.first_ms, loss.last_ms, loss.samples)
        self._ids, self._scrapes, self._index = [], [], None
        return packed

    def _encode(self, window: list[ShapedScrape], losses: list[LossRecord]) -> list[Batch]:
        try:
            return self._encoder.build_window(window)
        except ValueError as e:
            # A window the codec refuses must not stay open for ever: ship it cycle by cycle instead.
            log.error("cannot encode the batch window as one batch (%s): sending it cycle by cycle", e)
        batches, refused = self._encoder.build_each(window)
        for scrape, error in refused:
            log.error(
                "dropping %d samples of %s that cannot be encoded: %s", len(scrape), scrape.target, error
            )
            ts = scrape.timestamp_ms
            losses.append(
                LossRecord(LossReason.ENCODE_ERROR, f'{{job="{scrape.target}"}}', ts, ts, len(scrape))
            )
        return batches
