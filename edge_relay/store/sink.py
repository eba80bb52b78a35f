"""Putting data into the spool: the one place that handles a full spool.

Every write of the relay into the spool (a cycle's batch, a staged cycle, a packed batch window) goes
through ``SpoolSink``. On a full spool (the disk, or ``spool.max_bytes``) it makes room by evicting the
oldest backlog (``Retention.make_room``: new data is what an operator needs first after an outage) and
tries once more; what still does not fit is recorded in the loss ledger as ``spool_full``, except a
window being packed, whose staged cycles stay durable and are packed again next cycle. The sink counts
what it stored (``edge_relay_batches_spooled_total``, ``..._samples_spooled_total``,
``..._batch_bytes_total``) and returns the encoded size, which the budget controller counts as demand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from edge_relay.ledger import LossLedger, LossReason
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.encoder import Encoder
from edge_relay.store.recent import RecentBatches
from edge_relay.store.retention import Retention, describe
from edge_relay.store.spool import Replacement, Spool, SpoolError, SpoolFullError
from schemas.model import Batch

log = logging.getLogger("edge_relay")

_T = TypeVar("_T")


class SpoolSink:
    def __init__(
        self,
        spool: Spool,
        retention: Retention,
        ledger: LossLedger,
        encoder: Encoder,
        metrics: RelayMetrics,
        recent: RecentBatches | None = None,
    ) -> None:
        self._recent = recent  # the uplink stream-codes these without decoding their rows
        self._spool = spool
        self._retention = retention
        self._ledger = ledger
        self._encoder = encoder
        self._metrics = metrics

    def _write(self, write: Callable[[], _T], need_bytes: Callable[[], int]) -> _T | None:
        """``write()``; on a full spool make room and try once more; None if it still does not fit."""
        try:
            return write()
        except SpoolFullError as e:
            self._metrics.spool_errors.labels("full").inc()
            log.error("spool is full (%s): evicting the oldest batches to make room", e)
        try:
            self._retention.make_room(int(time.time() * 1000), need_bytes())
        except SpoolError as e:
            log.error("cannot make room in the spool: %s", e)
        try:
            return write()
        except SpoolFullError as e:
            log.error("spool still full (%s)", e)
            return None

    def _spooled(self, batches: Sequence[Batch], nbytes: int) -> None:
        self._metrics.batch_bytes.inc(nbytes)
        for b in batches:
            if self._recent is not None:
                self._recent.put(b)
            self._metrics.batches_spooled.inc()
            self._metrics.samples_spooled.inc(b.sample_count)

    def append(self, batch: Batch, version: int | None = None) -> bytes | None:
        """Store one batch under the next seq (as a wire envelope of ``version``, by default the
        configured one); returns the payload stored, or None if the batch was lost."""
        stored: list[bytes] = []  # the payload of the last encode (the spool encodes under its seq)

        def encode(seq: int) -> bytes:
            stored[:] = [self._encoder.encode(batch, seq, version)]
            return stored[0]

        def need_bytes() -> int:
            return len(stored[0]) if stored else self._encoder.max_bytes

        def append() -> int:
            return self._spool.batches.append(
                encode,
                first_ts_ms=batch.first_timestamp_ms,
                last_ts_ms=batch.last_timestamp_ms,
                sample_count=batch.sample_count,
            )

        if self._write(append, need_bytes) is None:
            log.error("%d samples of this cycle are lost", batch.sample_count)
            self._ledger.record(
                LossReason.SPOOL_FULL,
                describe([batch]),
                batch.first_timestamp_ms,
                batch.last_timestamp_ms,
                batch.sample_count,
            )
            return None
        self._spooled([batch], len(stored[0]))
        return stored[0]

    def stage(
        self,
        payload: bytes,
        *,
        first_ts_ms: int,
        last_ts_ms: int,
        sample_count: int,
        series: Callable[[], str],
    ) -> int | None:
        """Stage one cycle of an open window; returns its staging id, or None if it was lost."""

        def stage() -> int:
            return self._spool.staging.stage(
                payload, first_ts_ms=first_ts_ms, last_ts_ms=last_ts_ms, sample_count=sample_count
            )

        staged = self._write(stage, lambda: len(payload))
        if staged is None:
            log.error("%d samples of this cycle are lost", sample_count)
            self._ledger.record(LossReason.SPOOL_FULL, series(), first_ts_ms, last_ts_ms, sample_count)
        return staged

    def promote(self, staged_ids: Sequence[int], batches: Sequence[Batch]) -> int | None:
        """Replace staged cycles by the batches packed from them; returns their encoded bytes, or None
        when the spool cannot take them now (the staged cycles stay, so nothing is lost)."""
        sizes: list[int] = []

        def encoder_for(batch: Batch) -> Callable[[int], bytes]:
            def encode(seq: int) -> bytes:
                payload = self._encoder.encode(batch, seq)
                sizes.append(len(payload))
                return payload

            return encode

        items = [
            Replacement(encoder_for(b), b.first_timestamp_ms, b.last_timestamp_ms, b.sample_count)
            for b in batches
        ]

        def promote() -> list[int]:
            sizes.clear()  # a failed attempt encoded some already
            return self._spool.staging.promote(staged_ids, items)

        # The packed batches need about as much room as the staged cycles they replace.
        if self._write(promote, lambda: self._spool.stats().staged_bytes) is None:
            log.error("cannot pack the batch window now; its cycles stay staged and are packed next cycle")
            return None
        self._spooled(batches, sum(sizes))
        return sum(sizes)
