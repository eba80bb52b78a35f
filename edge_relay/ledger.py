"""The loss ledger: every sample the relay gave up, with its reason, series, time range and count.

A scraped sample ends in the cloud or here; never nowhere. The ledger's rows live in the spool file
(``edge_relay.store.spool.losses``), so they survive restarts and travel with the spool; this module holds the
reasons (one enum that the spool, retention, the uplink and the relay all use) and the relay-side part:
an entry that cannot be written yet (a full disk) waits in memory, still counted in ``totals()``, and is
written by the next ``flush()``. Nothing here imports the spool: the ledger is handed its table, so the
spool can use ``LossReason`` without an import cycle.

Intentional shaping (budget classes merging or suppressing samples) is not loss and is not recorded
here; it is counted in ``edge_relay_budget_samples_total``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

log = logging.getLogger("edge_relay.ledger")


class LossReason(StrEnum):
    """Why samples were given up. The values are what the spool file, the metrics and the status carry."""

    DOWNSAMPLED = "downsampled"  # merged away when the backlog was re-downsampled (spool.cap_bytes)
    CAP_BYTES = "cap_bytes"  # evicted: backlog above spool.cap_bytes and degraded as far as allowed
    MAX_AGE = "max_age"  # evicted: older than spool.max_age_seconds
    SPOOL_FULL = "spool_full"  # evicted or never stored: the disk or spool.max_bytes was full
    CORRUPT_ROW = "corrupt_row"  # a spool row failed its checksum
    OVERSIZED_BATCH = "oversized_batch"  # a batch above the broker's maximum packet size
    DUPLICATE_SERIES = "duplicate_series"  # a second sample of one series in one scrape
    # An explicit timestamp that did not advance: within a batch window, or past its series' last
    # sample in a stateful budget class.
    DUPLICATE_SAMPLE = "duplicate_sample"
    LABEL_LIMITS = "label_limits"  # labels the wire refuses: more or longer than its limits, ...
    ENCODE_ERROR = "encode_error"  # the codec refused a scrape
    INVALID_TIMESTAMP = "invalid_timestamp"  # an explicit timestamp the wire cannot carry (negative)
    SPOOL_FILE_CORRUPT = "spool_file_corrupt"  # the spool file was moved aside (count unknown)
    # The cloud acked the batch "rejected" (invalid, or refused for good by the receiver): its row is
    # deleted, the dead letter (if the cloud kept one) is the only copy left.
    REJECTED_BY_CLOUD = "rejected_by_cloud"
    # Samples a budget class held in aggregation windows still open when the relay was killed.
    OPEN_WINDOW_AT_KILL = "open_window_at_kill"


@dataclass(frozen=True, slots=True)
class LossRecord:
    """``samples`` of ``series`` (a series matcher, e.g. ``{job="kepler"}``) in [first_ms, last_ms]."""

    reason: LossReason
    series: str
    first_ms: int
    last_ms: int
    samples: int


class LossTable(Protocol):
    """Where ledger entries are kept for good (the spool's ``losses`` table)."""

    def record(self, entry: LossRecord) -> bool:
        """Write one entry; False when it cannot be written now (full disk): try again later."""
        ...

    def totals(self) -> dict[str, int]: ...


class LossLedger:
    """Records losses into the spool's table, holding what a full disk refuses until it has room."""

    def __init__(self, table: LossTable) -> None:
        self._table = table
        self._lock = threading.Lock()  # the scrape loop records; the /metrics thread reads totals
        self._pending: list[LossRecord] = []

    def record(self, reason: LossReason, series: str, first_ms: int, last_ms: int, samples: int) -> None:
        with self._lock:
            self._pending.append(LossRecord(reason, series, first_ms, last_ms, samples))
        self.flush()

    def flush(self) -> None:
        """Write pending entries, oldest first; stop at the first one the table cannot take yet."""
        with self._lock:
            while self._pending:
                entry = self._pending[0]
                if not self._table.record(entry):
                    log.error(
                        "cannot write %d %s samples of %s to the loss ledger yet; keeping them in memory",
                        entry.samples,
                        entry.reason,
                        entry.series,
                    )
                    return
                self._pending.pop(0)

    @property
    def pending(self) -> int:
        """Entries waiting in memory for room on disk."""
        return len(self._pending)

    def totals(self) -> dict[str, int]:
        """Samples lost by reason over the spool's life, including entries not yet on disk."""
        with self._lock:  # held across both reads, so a concurrent flush counts nothing twice
            totals = self._table.totals()
            for entry in self._pending:
                totals[entry.reason.value] = totals.get(entry.reason.value, 0) + entry.samples
        return totals
