"""The spool file's format: tables, migrations, the batch row as stored and as read back, and the
loss ledger's row.

The format is a contract with every spool already on a node: a relay must open what an older relay
wrote (``migrate`` steps it up, one version at a time) and refuse what a newer one wrote. Values never
live in SQLite columns (SQLite stores NaN as NULL, which would destroy the stale marker): they stay inside
the payload BLOB, guarded by a CRC-32 that ``verify`` checks on every read.
"""

from __future__ import annotations

import operator
import sqlite3
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, cast

from edge_relay.ledger import LossRecord
from edge_relay.store.spool.errors import SpoolError, rollback_quietly

SCHEMA_VERSION: Final = 5
_LEDGER_BUCKET_MS: Final = 3_600_000  # ledger entries of one reason and series add up within this

COLUMNS: Final = (
    "seq, payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size, priority, created_ms, "
    "attempts, last_sent_ms, meta_checksum"
)
ROW_MARKS: Final = ", ".join("?" * len(COLUMNS.split(",")))  # one placeholder per column of COLUMNS

_SCHEMA_V1: Final = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    # payload is nullable on purpose: corruption can produce NULL anyway, and pending() must be able to
    # meet (and quarantine) it; the CRC, not a constraint, is what vouches for a row.
    """CREATE TABLE IF NOT EXISTS batches (
        seq INTEGER PRIMARY KEY,
        payload BLOB,
        checksum INTEGER NOT NULL,
        first_ts_ms INTEGER NOT NULL,
        last_ts_ms INTEGER NOT NULL,
        sample_count INTEGER NOT NULL,
        byte_size INTEGER NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        created_ms INTEGER NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        last_sent_ms INTEGER
    )""",
    # No index on priority: it would cost a page write per append on flash, while sorting the few
    # thousand keys of even a long backlog is cheap for the rare priority-ordered read.
    # No constraints but the key: quarantined rows are by definition whatever the disk gave back.
    """CREATE TABLE IF NOT EXISTS quarantine (
        seq INTEGER PRIMARY KEY,
        payload BLOB,
        checksum INTEGER,
        first_ts_ms INTEGER,
        last_ts_ms INTEGER,
        sample_count INTEGER,
        byte_size INTEGER,
        priority INTEGER,
        created_ms INTEGER,
        attempts INTEGER,
        last_sent_ms INTEGER,
        reason TEXT NOT NULL,
        quarantined_ms INTEGER NOT NULL
    )""",
    "INSERT OR IGNORE INTO meta (key, value) VALUES ('last_seq', 0)",
)

# v2: the loss ledger (every sample dropped or merged on purpose, by reason) and the resolution of
# re-downsampled rows (absent = as scraped).
_SCHEMA_V2: Final = (
    """CREATE TABLE IF NOT EXISTS ledger (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts_ms INTEGER NOT NULL,
        reason TEXT NOT NULL,
        series TEXT NOT NULL,
        first_ts_ms INTEGER NOT NULL,
        last_ts_ms INTEGER NOT NULL,
        samples INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS ledger_reason_series ON ledger (reason, series, ts_ms)",
    "CREATE TABLE IF NOT EXISTS resolution (seq INTEGER PRIMARY KEY, factor INTEGER NOT NULL)",
)
# v3: scrapes of the open batch window (bandwidth budget): durable from the cycle that scraped them until
# they are packed into one wire batch, so a kill -9 inside a 60 s window loses nothing.
_SCHEMA_V3: Final = (
    """CREATE TABLE IF NOT EXISTS staging (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        payload BLOB,
        checksum INTEGER NOT NULL,
        first_ts_ms INTEGER NOT NULL,
        last_ts_ms INTEGER NOT NULL,
        sample_count INTEGER NOT NULL,
        byte_size INTEGER NOT NULL,
        created_ms INTEGER NOT NULL
    )""",
)
# v4: the flight recorder (``spool.recorder``): every raw scrape at full resolution for a bounded span,
# whatever the budget sent. Metadata columns first and the payload last, so the scans of eviction and
# span() read the rows' leaf cells, not the overflow pages of their payloads. No index but the key: ids
# follow writing order, which is what eviction gives up first, and reads are rare (backfill).
_SCHEMA_V4: Final = (
    """CREATE TABLE IF NOT EXISTS recorder (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        kind INTEGER NOT NULL,
        first_ts_ms INTEGER NOT NULL,
        last_ts_ms INTEGER NOT NULL,
        sample_count INTEGER NOT NULL,
        byte_size INTEGER NOT NULL,
        checksum INTEGER NOT NULL,
        created_ms INTEGER NOT NULL,
        payload BLOB
    )""",
)
# v5: a second checksum over the columns that decide a row's fate (its seq, time range, counts, size,
# priority, creation), so that a corrupt last_ts_ms cannot evict a fresh row as max_age, nor a corrupt
# sample_count ledger the wrong count: the payload's CRC alone left them unchecked. Rows of an older
# spool get theirs from their columns as they are (nothing better is known of them).
_META_CHECKSUM_TABLES: Final = ("batches", "quarantine", "staging")
_MIGRATIONS: Final = (_SCHEMA_V1, _SCHEMA_V2, _SCHEMA_V3, _SCHEMA_V4, ())
_MAX_VARS: Final = 500  # below SQLITE_MAX_VARIABLE_NUMBER (999) of old SQLite builds


def migrate(conn: sqlite3.Connection, path: object) -> None:
    """Bring the file at ``path`` up to ``SCHEMA_VERSION`` in one transaction."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version == SCHEMA_VERSION:
        return
    if version > SCHEMA_VERSION:
        # A newer relay wrote this; its rows are probably fine, so refuse rather than move them aside.
        raise SpoolError(f"spool {path} has schema {version}, this relay knows up to {SCHEMA_VERSION}")
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statements in _MIGRATIONS[version:]:
            for stmt in statements:
                conn.execute(stmt)
        if version < 5:
            for table in _META_CHECKSUM_TABLES:
                columns = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
                if "meta_checksum" not in columns:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN meta_checksum INTEGER")
            _fill_meta_checksums(conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        rollback_quietly(conn)
        raise


def meta_checksum(*columns: int) -> int:
    """CRC-32 of the integer columns that decide a row's fate, in the order the table lists them."""
    try:
        return zlib.crc32(struct.pack(f"<{len(columns)}q", *columns))
    except struct.error:  # out of SQLite's 64-bit range: not a value any column can hold
        return -1


def _fill_meta_checksums(conn: sqlite3.Connection) -> None:
    rows = conn.execute(
        "SELECT seq, first_ts_ms, last_ts_ms, sample_count, byte_size, priority, created_ms FROM batches"
    ).fetchall()
    conn.executemany(
        "UPDATE batches SET meta_checksum = ? WHERE seq = ?",
        [(meta_checksum(*r), r[0]) for r in rows if all(type(v) is int for v in r)],
    )
    rows = conn.execute(
        "SELECT id, first_ts_ms, last_ts_ms, sample_count, byte_size, created_ms FROM staging"
    ).fetchall()
    conn.executemany(
        "UPDATE staging SET meta_checksum = ? WHERE id = ?",
        [(meta_checksum(*r[1:]), r[0]) for r in rows if all(type(v) is int for v in r)],
    )


@dataclass(frozen=True, slots=True)
class SpoolRow:
    """One batch as stored: the payload is the encoded envelope that goes on the wire as it is."""

    seq: int
    payload: bytes
    checksum: int  # zlib.crc32(payload)
    first_ts_ms: int
    last_ts_ms: int
    sample_count: int
    byte_size: int
    priority: int
    created_ms: int
    attempts: int
    last_sent_ms: int | None
    meta_checksum: int  # meta_checksum(seq, first_ts_ms, last_ts_ms, sample_count, byte_size, ...)

    @property
    def was_sent(self) -> bool:
        """Published at least once before (a retry, not a first attempt)."""
        return self.attempts > 0


@dataclass(frozen=True, slots=True)
class QuarantinedRow:
    """A row taken out of circulation. Columns are as found (``None`` where they were not an integer)."""

    seq: int
    reason: str
    quarantined_ms: int
    payload: bytes | None
    checksum: int | None
    first_ts_ms: int | None
    last_ts_ms: int | None
    sample_count: int | None
    byte_size: int | None
    priority: int | None
    created_ms: int | None
    attempts: int | None
    last_sent_ms: int | None
    meta_checksum: int | None = None


@dataclass(frozen=True, slots=True)
class Replacement:
    """A batch to insert under a seq allocated in the inserting transaction (``encode(seq)``)."""

    encode: Callable[[int], bytes]
    first_ts_ms: int
    last_ts_ms: int
    sample_count: int
    priority: int = 0


def verify(raw: Sequence[object]) -> SpoolRow | str:
    """The row if it is intact, else the reason it is not."""
    seq, payload, checksum, first, last, count, size, prio, created, attempts, last_sent, meta = raw
    if payload is None:
        return "payload is NULL"
    if not isinstance(payload, bytes):
        return f"payload stored as {type(payload).__name__}, not BLOB"
    ints = (seq, checksum, first, last, count, size, prio, created, attempts)
    if not all(type(v) is int for v in ints) or not (last_sent is None or type(last_sent) is int):
        return "metadata column is not an integer"
    s, crc_stored, f, la, n, z, p, c, a = cast(tuple[int, ...], ints)
    if len(payload) != z:
        return f"payload is {len(payload)} bytes, byte_size says {z}"
    crc = zlib.crc32(payload)
    if crc != crc_stored:
        return f"checksum mismatch: stored {crc_stored:#010x}, computed {crc:#010x}"
    fate = meta_checksum(s, f, la, n, z, p, c)
    if meta != fate:
        shown = f"{meta:#010x}" if type(meta) is int else repr(meta)
        return f"metadata checksum mismatch: stored {shown}, computed {fate:#010x} (a column was altered)"
    return SpoolRow(s, payload, crc_stored, f, la, n, z, p, c, a, last_sent, fate)


def row_tuple(r: SpoolRow) -> tuple[object, ...]:
    return (
        r.seq,
        r.payload,
        r.checksum,
        r.first_ts_ms,
        r.last_ts_ms,
        r.sample_count,
        r.byte_size,
        r.priority,
        r.created_ms,
        r.attempts,
        r.last_sent_ms,
        r.meta_checksum,
    )


def quarantined_row(r: Sequence[object]) -> QuarantinedRow:
    def num(v: object) -> int | None:
        return v if type(v) is int else None

    seq, payload, *ints, reason, quarantined_ms = r
    checksum, first, last, count, size, prio, created, attempts, last_sent, meta = (num(v) for v in ints)
    return QuarantinedRow(
        seq=cast(int, seq),
        reason=str(reason),
        quarantined_ms=cast(int, quarantined_ms),
        payload=bytes(payload) if isinstance(payload, bytes) else None,
        checksum=checksum,
        first_ts_ms=first,
        last_ts_ms=last,
        sample_count=count,
        byte_size=size,
        priority=prio,
        created_ms=created,
        attempts=attempts,
        last_sent_ms=last_sent,
        meta_checksum=meta,
    )


def insert_batches(conn: sqlite3.Connection, items: Sequence[Replacement], now_ms: int) -> list[int]:
    """Insert ``items`` under the next seqs, inside the caller's transaction; returns the seqs.

    ``seq`` is allocated from ``meta.last_seq`` in the same transaction, so it is strictly increasing and
    never reused, even after every row is deleted (SQLite alone would reuse the highest rowid). It is
    allocated before the payload exists because the payload (the encoded envelope) carries it; if
    ``encode`` raises, the caller's rollback returns the seq too.
    """
    (last_seq,) = conn.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
    (max_row,) = conn.execute("SELECT max(seq) FROM batches").fetchone()
    # max(seq) is belt and braces: meta is the authority, but a row above it must never be shadowed.
    seq = max(int(last_seq), int(max_row or 0))
    seqs: list[int] = []
    for item in items:
        seq += 1
        payload = item.encode(seq)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"encode() must return bytes, not {type(payload).__name__}")
        blob = bytes(payload)
        fate = (seq, item.first_ts_ms, item.last_ts_ms, item.sample_count, len(blob), item.priority, now_ms)
        conn.execute(
            f"INSERT INTO batches ({COLUMNS}) VALUES ({ROW_MARKS})",
            (seq, blob, zlib.crc32(blob), *fate[1:], 0, None, meta_checksum(*fate)),
        )
        seqs.append(seq)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'last_seq'", (seq,))
    return seqs


def seq_list(seqs: Iterable[int]) -> list[int]:
    return sorted({operator.index(s) for s in seqs})


def chunks(items: Sequence[int]) -> Iterator[Sequence[int]]:
    for start in range(0, len(items), _MAX_VARS):
        yield items[start : start + _MAX_VARS]


def marks(chunk: Sequence[int]) -> str:
    return ", ".join("?" * len(chunk))


def add_loss(conn: sqlite3.Connection, now: int, entry: LossRecord) -> None:
    """Add ``entry`` to the loss ledger's table inside the caller's transaction: entries of one reason
    and series within an hour are added up into one row."""
    updated = conn.execute(
        "UPDATE ledger SET samples = samples + ?, first_ts_ms = min(first_ts_ms, ?),"
        " last_ts_ms = max(last_ts_ms, ?), ts_ms = ? WHERE id = (SELECT id FROM ledger"
        " WHERE reason = ? AND series = ? AND ts_ms >= ? ORDER BY id DESC LIMIT 1)",
        (
            entry.samples,
            entry.first_ms,
            entry.last_ms,
            now,
            str(entry.reason),
            entry.series,
            now - _LEDGER_BUCKET_MS,
        ),
    ).rowcount
    if not updated:
        conn.execute(
            "INSERT INTO ledger (ts_ms, reason, series, first_ts_ms, last_ts_ms, samples)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (now, str(entry.reason), entry.series, entry.first_ms, entry.last_ms, entry.samples),
        )
