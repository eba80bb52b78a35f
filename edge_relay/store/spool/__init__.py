"""The SQLite spool. Every batch waits here, in one file, until the cloud acknowledges it.

The package is the file and its tables, one module each, built on one ``Store``:

- ``store``: the connection, its lock, durability (WAL, ``synchronous=FULL``), the size cap, and
  recovery from a corrupt file (``recovery`` salvages what still reads back intact);
- ``schema``: the file format (tables, migrations) and the batch row with its CRC;
- ``batches``: the queue of encoded batches by seq (append, ack, quarantine, evict, re-downsample);
- ``sendqueue``: the uplink's narrow view of it (what to send next given what is in flight);
- ``staging``: cycles of an open batch window, durable before they become a batch;
- ``losses``: the loss ledger's table (``edge_relay.ledger`` is the relay-side ledger);
- ``meta``: integers kept across restarts (quota use);
- ``recorder``: the flight recorder's blocks (raw scrapes for a bounded span), always second to the
  backlog.

``Spool`` opens the file and hands out the tables; it knows nothing of MQTT, budgets or encodings. Like
VictoriaMetrics' persistent queue, it stores opaque blocks: the payload is the encoded envelope, sent as
it is. Seqs are strictly increasing per spool file and never reused (``schema.insert_batches``).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge_relay.store.spool.batches import BatchTable, Order
from edge_relay.store.spool.errors import SpoolClosedError, SpoolError, SpoolFullError
from edge_relay.store.spool.losses import LossEntry, LossTable
from edge_relay.store.spool.meta import MetaTable
from edge_relay.store.spool.recorder import RecordedBlock, RecorderStats, RecorderTable
from edge_relay.store.spool.recovery import SpoolRecovery
from edge_relay.store.spool.schema import SCHEMA_VERSION, QuarantinedRow, Replacement, SpoolRow
from edge_relay.store.spool.sendqueue import InFlight, SendQueue
from edge_relay.store.spool.staging import StagedRow, StagingTable
from edge_relay.store.spool.store import Store, wall_ms

__all__ = [
    "SCHEMA_VERSION",
    "BatchTable",
    "InFlight",
    "LossEntry",
    "LossTable",
    "MetaTable",
    "Order",
    "QuarantinedRow",
    "RecordedBlock",
    "RecorderStats",
    "RecorderTable",
    "Replacement",
    "SendQueue",
    "Spool",
    "SpoolClosedError",
    "SpoolError",
    "SpoolFullError",
    "SpoolRecovery",
    "SpoolRow",
    "SpoolStats",
    "StagedRow",
    "StagingTable",
]


@dataclass(frozen=True, slots=True)
class SpoolStats:
    rows: int
    bytes: int  # sum of payload sizes
    samples: int
    oldest_first_ts_ms: int | None  # of batches and staged cycles: the oldest sample not yet sent
    quarantined_rows: int
    file_bytes: int  # database + WAL + shared-memory index on disk
    last_seq: int
    staged_rows: int = 0  # cycles waiting for their batch window (not counted in rows/bytes/samples)
    staged_bytes: int = 0
    staged_samples: int = 0


class Spool:
    """The spool file and its tables; see the package docstring."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        max_bytes: int | None = None,
        busy_timeout_ms: int = 5000,
        check_on_open: bool = True,
        keep_corrupt: int = 3,
        clock_ms: Callable[[], int] = wall_ms,
    ) -> None:
        """Open (creating or migrating) the spool at ``path``.

        ``max_bytes``: approximate cap of the files on disk; ``None`` or 0 = only the disk limits it.
        ``check_on_open``: run ``PRAGMA quick_check`` (reads the whole file once; turn off only where a
        huge spool on slow flash makes start-up too slow; runtime corruption is still handled).
        ``keep_corrupt``: how many moved-aside corrupt files to keep, so repeated corruption cannot fill
        the disk with them.
        """
        self.store = Store(
            path,
            synchronous=synchronous,
            max_bytes=max_bytes,
            busy_timeout_ms=busy_timeout_ms,
            check_on_open=check_on_open,
            keep_corrupt=keep_corrupt,
            clock_ms=clock_ms,
        )
        self.path = self.store.path
        self.losses = LossTable(self.store)
        self.batches = BatchTable(self.store, self.losses)
        self.staging = StagingTable(self.store, self.losses)
        self.meta = MetaTable(self.store)
        self.recorder = RecorderTable(self.store)

    @property
    def recovery(self) -> SpoolRecovery | None:
        """The last recovery from a corrupt file (at open or at run time), or None."""
        return self.store.recovery

    @property
    def incarnation(self) -> int:
        """The spool file's identity (``store.Store.incarnation``), carried by its batches and acks."""
        return self.store.incarnation

    @property
    def recovered_from(self) -> Path | None:
        """Where the last corrupt spool file was moved to, or None if this spool never had to recover."""
        return None if self.store.recovery is None else self.store.recovery.moved_to

    def stats(self) -> SpoolStats:
        def op(conn: sqlite3.Connection) -> SpoolStats:
            rows, size, samples, oldest = conn.execute(
                "SELECT count(*), coalesce(sum(byte_size), 0), coalesce(sum(sample_count), 0), "
                "min(first_ts_ms) FROM batches"
            ).fetchone()
            (quarantined,) = conn.execute("SELECT count(*) FROM quarantine").fetchone()
            (last_seq,) = conn.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
            staged = conn.execute(
                "SELECT count(*), coalesce(sum(byte_size), 0), coalesce(sum(sample_count), 0), "
                "min(first_ts_ms) FROM staging"
            ).fetchone()
            if staged[3] is not None and (oldest is None or staged[3] < oldest):
                oldest = staged[3]
            return SpoolStats(
                rows=int(rows),
                bytes=int(size),
                samples=int(samples),
                oldest_first_ts_ms=None if oldest is None else int(oldest),
                quarantined_rows=int(quarantined),
                file_bytes=self.store.file_bytes(),
                last_seq=int(last_seq),
                staged_rows=int(staged[0]),
                staged_bytes=int(staged[1]),
                staged_samples=int(staged[2]),
            )

        return self.store.run("stats", op)

    def compact(self) -> int:
        return self.store.compact()

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
