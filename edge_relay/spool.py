"""Stage 5: the SQLite spool. Every encoded batch waits here until the cloud acknowledges it.

One row per encoded batch. The scrape loop appends while the MQTT network thread acks, so the spool owns
a single connection (``check_same_thread=False``) serialised by a ``threading.Lock``; SQLite's own
locking (``busy_timeout``) only matters if another process opens the file, e.g. an operator's sqlite3.

Durability. WAL mode with ``synchronous=FULL`` by default: every commit fsyncs the WAL before ``append``
returns. Edge nodes lose *power*, not just processes; with ``NORMAL`` the last commits before a power cut
may roll back, and a rolled-back ``append`` would hand out its seq a second time after the reboot, although
the first batch with that seq may already be on its way to the cloud, where (node, seq) identifies a
batch. ``NORMAL`` still survives ``kill -9`` (the OS keeps the WAL pages), so it is an option for nodes with
reliable power or slow flash, never the default.

Sequence numbers. ``seq`` is the row's INTEGER PRIMARY KEY but is allocated from ``meta.last_seq`` in the
same transaction as the insert, so it is strictly increasing and never reused, even after every row is
deleted and across restarts (SQLite alone would reuse the highest rowid after a delete). It is allocated
*before* the payload exists because the payload (the encoded envelope) carries it.

Values never live in SQLite columns (SQLite stores NaN as NULL, which would destroy the stale marker):
they stay inside the payload BLOB, guarded by a CRC-32. ``pending`` verifies it and moves any row that
fails into the ``quarantine`` table instead of returning it.

Corrupt file. If opening fails with SQLITE_CORRUPT / SQLITE_NOTADB or ``PRAGMA quick_check`` is not ok (or
an operation hits SQLITE_CORRUPT later), the file and its -wal/-shm are renamed to
``<name>.corrupt-<unix-ms>``, every row that can still be read with a valid checksum is copied into a fresh
spool, and seqs continue from ``max(highest seq still readable + 1, unix_ms * 1000)``. The time-derived
floor is there because what is readable from a corrupt file may be stale (the lost part may have held
higher seqs already sent); ``unix_ms * 1000`` stays above any earlier seq as long as the node averaged
fewer than 1000 batches per millisecond since the previous reset, and stays below 2**53, so the seq is
still exact in JSON. The relay never crash-loops on a corrupt spool; the event is logged at ERROR and kept
in ``Spool.recovery`` / ``Spool.recovered_from``.

Size cap. ``max_bytes`` caps the database pages via ``PRAGMA max_page_count`` and bounds the WAL with
``journal_size_limit`` / ``wal_autocheckpoint``; a full cap or a full disk (SQLITE_FULL) makes ``append``
raise ``SpoolFullError``. Deleted pages go to the freelist and are reused by the next inserts, so acks make
room again without a VACUUM; ``compact()`` gives free pages back to the filesystem when wanted.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar, cast

log = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 3

_SQLITE_CORRUPT: Final = 11
_SQLITE_FULL: Final = 13
_SQLITE_NOTADB: Final = 26
_SEQ_TIME_FACTOR: Final = 1000
_MAX_VARS: Final = 500  # below SQLITE_MAX_VARIABLE_NUMBER (999) of old SQLite builds
_SYNC_MODES: Final = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
_ORDERS: Final = {
    "oldest": "seq ASC",
    "newest": "seq DESC",
    "priority": "priority DESC, seq ASC",
    # By the age of the data, not of the row: a re-downsampled row gets a new seq but old samples.
    "oldest_data": "first_ts_ms ASC, seq ASC",
    # What a cap gives up first: lowest priority, then oldest data.
    "evict": "priority ASC, first_ts_ms ASC, seq ASC",
}
_MIN_CAP_BYTES: Final = 64 * 1024
_WAL_LIMIT_BYTES: Final = 4 * 1024 * 1024
_UNCAPPED_WAL_BYTES: Final = 1024 * 1024
_SIDE_FILES: Final = ("-wal", "-shm", "-journal")
_SALVAGE_CHUNK: Final = 64

_COLUMNS: Final = (
    "seq, payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size, priority, created_ms, "
    "attempts, last_sent_ms"
)

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
# Ledger entries of one reason and series within this window are added up into one row, so a target
# that exposes duplicates every 5 s makes one row an hour, not 720.
_LEDGER_BUCKET_MS: Final = 3_600_000

_T = TypeVar("_T")


class SpoolError(Exception):
    """The spool cannot do what was asked (other than being full)."""


class SpoolFullError(SpoolError):
    """SQLite reported SQLITE_FULL: the ``max_bytes`` cap or the disk is full. Nothing was written."""


class SpoolClosedError(SpoolError):
    """The spool was closed."""


class _CorruptFile(Exception):
    """The file opened but failed ``PRAGMA quick_check``."""


@dataclass(frozen=True, slots=True)
class SpoolRow:
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


@dataclass(frozen=True, slots=True)
class SpoolStats:
    rows: int
    bytes: int  # sum of payload sizes
    samples: int
    oldest_first_ts_ms: int | None
    quarantined_rows: int
    file_bytes: int  # database + WAL + shared-memory index on disk
    last_seq: int
    staged_rows: int = 0  # cycles waiting for their batch window (not counted in rows/bytes/samples)
    staged_bytes: int = 0
    staged_samples: int = 0


@dataclass(frozen=True, slots=True)
class LossEntry:
    """One line of the loss ledger: ``samples`` of ``series`` in [first_ts_ms, last_ts_ms] were dropped
    or merged away for ``reason``."""

    id: int
    ts_ms: int
    reason: str
    series: str
    first_ts_ms: int
    last_ts_ms: int
    samples: int


@dataclass(frozen=True, slots=True)
class StagedRow:
    """Scrapes of one cycle waiting for their batch window to close (not yet a batch: no seq)."""

    id: int
    payload: bytes
    first_ts_ms: int
    last_ts_ms: int
    sample_count: int


@dataclass(frozen=True, slots=True)
class Replacement:
    """A batch that takes the place of others (re-downsampled backlog)."""

    encode: Callable[[int], bytes]
    first_ts_ms: int
    last_ts_ms: int
    sample_count: int


@dataclass(frozen=True, slots=True)
class SpoolRecovery:
    """A corrupt spool file was moved aside and replaced by a fresh one."""

    path: Path
    moved_to: Path
    reason: str
    salvaged_rows: int
    next_seq: int
    at_ms: int


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Spool:
    """SQLite spool of encoded batches; see the module docstring for the guarantees."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        max_bytes: int | None = None,
        busy_timeout_ms: int = 5000,
        check_on_open: bool = True,
        keep_corrupt: int = 3,
        clock_ms: Callable[[], int] = _wall_ms,
    ) -> None:
        """Open (creating or migrating) the spool at ``path``.

        ``max_bytes``: approximate cap of the files on disk; ``None`` or 0 = only the disk limits it.
        ``check_on_open``: run ``PRAGMA quick_check`` (reads the whole file once; turn off only where a
        huge spool on slow flash makes start-up too slow; runtime corruption is still handled).
        ``keep_corrupt``: how many moved-aside corrupt files to keep, so repeated corruption cannot fill
        the disk with them.
        """
        sync = synchronous.upper()
        if sync not in _SYNC_MODES:
            raise ValueError(f"synchronous must be one of {sorted(_SYNC_MODES)}, not {synchronous!r}")
        if max_bytes and max_bytes < _MIN_CAP_BYTES:
            raise ValueError(f"max_bytes must be 0/None or at least {_MIN_CAP_BYTES}, not {max_bytes}")
        if keep_corrupt < 0:
            raise ValueError("keep_corrupt must be >= 0")
        self.path = Path(path)
        self._synchronous = sync
        self._max_bytes = int(max_bytes or 0)
        self._busy_timeout_ms = int(busy_timeout_ms)
        self._check_on_open = check_on_open
        self._keep_corrupt = keep_corrupt
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self._quarantined_total = 0
        self._cap_pages = 0
        self.recovery: SpoolRecovery | None = None
        self._conn: sqlite3.Connection | None = self._open_or_recover()

    # ----------------------------------------------------------------------------------------- public API

    @property
    def recovered_from(self) -> Path | None:
        """Where the last corrupt spool file was moved to, or None if this spool never had to recover."""
        return None if self.recovery is None else self.recovery.moved_to

    @property
    def quarantined_total(self) -> int:
        """Rows this instance moved to quarantine (for a counter metric; ``stats()`` has the table size)."""
        return self._quarantined_total

    def append(
        self,
        encode: Callable[[int], bytes],
        *,
        first_ts_ms: int,
        last_ts_ms: int,
        sample_count: int,
        priority: int = 0,
    ) -> int:
        """Allocate the next seq, store ``encode(seq)`` and commit, all in one transaction; return the seq.

        If ``encode`` raises, nothing is stored and the seq is not consumed (it never left the node).
        Raises ``SpoolFullError`` when the cap or the disk is full; the spool stays usable.
        """
        first, last = operator.index(first_ts_ms), operator.index(last_ts_ms)
        count, prio = operator.index(sample_count), operator.index(priority)
        if count < 0:
            raise ValueError("sample_count must be >= 0")

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            (last_seq,) = conn.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
            (max_row,) = conn.execute("SELECT max(seq) FROM batches").fetchone()
            # max(seq) is belt and braces: meta is the authority, but a row above it must never be shadowed.
            seq = max(int(last_seq), int(max_row or 0)) + 1
            payload = encode(seq)
            if not isinstance(payload, bytes | bytearray | memoryview):
                raise TypeError(f"encode() must return bytes, not {type(payload).__name__}")
            blob = bytes(payload)
            conn.execute(
                f"INSERT INTO batches ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, NULL)",
                (seq, blob, zlib.crc32(blob), first, last, count, len(blob), prio, self._clock_ms()),
            )
            conn.execute("UPDATE meta SET value = ? WHERE key = 'last_seq'", (seq,))
            conn.execute("COMMIT")
            return seq

        return self._run("append", op)

    def pending(self, limit: int, *, exclude: Collection[int] = (), order: str = "oldest") -> list[SpoolRow]:
        """Up to ``limit`` rows not in ``exclude``, in ``order``: "oldest" (seq ascending), "newest" or
        "priority" (highest priority first, then oldest).

        Every returned row has passed its checksum; rows that fail are quarantined and skipped.
        ``exclude`` is only probed with ``len`` and ``in``, so a live ``dict.keys()`` view is fine.
        """
        if order not in _ORDERS:
            raise ValueError(f"order must be one of {sorted(_ORDERS)}, not {order!r}")
        if limit <= 0:
            return []
        excluded: Collection[int] = exclude if isinstance(exclude, AbstractSet) else frozenset(exclude)
        sql = f"SELECT seq FROM batches ORDER BY {_ORDERS[order]} LIMIT ?"

        def op(conn: sqlite3.Connection) -> list[SpoolRow]:
            while True:
                # Excluded rows can take at most len(excluded) places, so this LIMIT always suffices.
                candidates = conn.execute(sql, (limit + len(excluded),)).fetchall()
                seqs = [s for (s,) in candidates if s not in excluded][:limit]
                raw = {r[0]: r for r in self._fetch(conn, seqs)}
                good: list[SpoolRow] = []
                bad: list[tuple[int, str]] = []
                for seq in seqs:
                    if seq not in raw:  # deleted by another process between the two queries
                        continue
                    row = _verify(raw[seq])
                    if isinstance(row, str):
                        bad.append((seq, row))
                    else:
                        good.append(row)
                if not bad:
                    return good
                self._quarantine_locked(conn, bad)
                # Quarantined rows are gone now, so the next pass can fill their places.

        return self._run("pending", op)

    def mark_sent(self, seqs: Iterable[int], now_ms: int) -> int:
        """Record a (re)publication: bump ``attempts``, set ``last_sent_ms``. Returns rows updated.

        Best effort: bookkeeping only, so a full spool logs a warning and returns 0 instead of raising
        (the uplink must keep draining, which is what makes room).
        """
        ids = _seq_list(seqs)
        when = operator.index(now_ms)
        if not ids:
            return 0

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            n = 0
            for chunk in _chunks(ids):
                n += conn.execute(
                    "UPDATE batches SET attempts = attempts + 1, last_sent_ms = ? "
                    f"WHERE seq IN ({_marks(chunk)})",
                    (when, *chunk),
                ).rowcount
            conn.execute("COMMIT")
            return n

        try:
            return self._run("mark_sent", op)
        except SpoolFullError as exc:
            log.warning("%s; attempts of %d batch(es) not recorded", exc, len(ids))
            return 0

    def ack(self, seqs: Iterable[int]) -> int:
        """Delete the acknowledged rows; return how many existed.

        Unknown seqs are ignored: after a replay the cloud acks some batches twice.
        """
        ids = _seq_list(seqs)
        if not ids:
            return 0

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            n = 0
            for chunk in _chunks(ids):
                n += conn.execute(f"DELETE FROM batches WHERE seq IN ({_marks(chunk)})", chunk).rowcount
                conn.execute(f"DELETE FROM resolution WHERE seq IN ({_marks(chunk)})", chunk)
            conn.execute("COMMIT")
            return n

        return self._run("ack", op)

    def quarantine(self, seq: int, reason: str, ledger_reason: str = "corrupt_row") -> None:
        """Move one row out of circulation (e.g. the broker cannot take it). Unknown seq: no-op.
        Its samples go into the loss ledger under ``ledger_reason``."""
        s = operator.index(seq)
        self._run("quarantine", lambda conn: self._quarantine_locked(conn, [(s, str(reason))], ledger_reason))

    def quarantined(self) -> list[QuarantinedRow]:
        def op(conn: sqlite3.Connection) -> list[QuarantinedRow]:
            rows = conn.execute(
                f"SELECT {_COLUMNS}, reason, quarantined_ms FROM quarantine ORDER BY seq"
            ).fetchall()
            return [_quarantined_row(r) for r in rows]

        return self._run("quarantined", op)

    def clear_quarantine(self, seqs: Iterable[int] | None = None) -> int:
        """Delete quarantined rows (all, or the given seqs) once reported; returns how many."""
        ids = None if seqs is None else _seq_list(seqs)

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            if ids is None:
                n = conn.execute("DELETE FROM quarantine").rowcount
            else:
                n = sum(
                    conn.execute(f"DELETE FROM quarantine WHERE seq IN ({_marks(c)})", c).rowcount
                    for c in _chunks(ids)
                )
            conn.execute("COMMIT")
            return n

        return self._run("clear_quarantine", op)

    def get_meta(self, key: str, default: int) -> int:
        """An integer the relay keeps across restarts (e.g. today's quota use)."""

        def op(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (f"x:{key}",)).fetchone()
            return int(row[0]) if row is not None and type(row[0]) is int else default

        return self._run("get_meta", op)

    def set_meta(self, values: dict[str, int]) -> None:
        """Store integers for ``get_meta``; best effort on a full spool (logged, not raised)."""

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [(f"x:{k}", int(v)) for k, v in values.items()],
            )
            conn.execute("COMMIT")

        try:
            self._run("set_meta", op)
        except SpoolFullError as exc:
            log.warning("%s; %s not saved", exc, ", ".join(values))

    # --- the open batch window -------------------------------------------------------------

    def stage(self, payload: bytes, *, first_ts_ms: int, last_ts_ms: int, sample_count: int) -> int:
        """Keep one cycle's scrapes durably until ``promote`` packs them into batches; returns its id.

        Raises ``SpoolFullError`` like ``append``.
        """
        blob = bytes(payload)
        first, last = operator.index(first_ts_ms), operator.index(last_ts_ms)
        count = operator.index(sample_count)

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            cur = conn.execute(
                "INSERT INTO staging (payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size,"
                " created_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (blob, zlib.crc32(blob), first, last, count, len(blob), self._clock_ms()),
            )
            conn.execute("COMMIT")
            return int(cur.lastrowid or 0)

        return self._run("stage", op)

    def staged(self) -> list[StagedRow]:
        """Every staged cycle, oldest first. A row that fails its checksum is deleted and its samples
        go into the loss ledger as ``corrupt_row`` (it was never sent, so nothing else has it)."""

        def op(conn: sqlite3.Connection) -> list[StagedRow]:
            rows = conn.execute(
                "SELECT id, payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size FROM staging"
                " ORDER BY id"
            ).fetchall()
            good: list[StagedRow] = []
            bad: list[tuple[int, int, int, int]] = []
            for rid, payload, checksum, first, last, count, size in rows:
                ok = (
                    isinstance(payload, bytes)
                    and len(payload) == size
                    and zlib.crc32(payload) == checksum
                    and all(type(v) is int for v in (first, last, count))
                )
                if ok:
                    good.append(StagedRow(rid, payload, first, last, count))
                else:
                    bad.append((rid, *(v if type(v) is int else 0 for v in (first, last, count))))
            if bad:
                now = self._clock_ms()
                conn.execute("BEGIN IMMEDIATE")
                for rid, first, last, count in bad:
                    log.error(
                        "staged cycle %d of spool %s is corrupt: its %d samples are lost",
                        rid,
                        self.path,
                        count,
                    )
                    conn.execute("DELETE FROM staging WHERE id = ?", (rid,))
                    self._ledger_add(conn, now, "corrupt_row", f"spool staging {rid}", first, last, count)
                conn.execute("COMMIT")
            return good

        return self._run("staged", op)

    def promote(self, staged_ids: Sequence[int], batches: Sequence[Replacement]) -> list[int]:
        """Replace staged cycles by the batches packed from them (new seqs), in one transaction."""

        def op(conn: sqlite3.Connection) -> list[int]:
            now = self._clock_ms()
            conn.execute("BEGIN IMMEDIATE")
            ids = list(staged_ids)
            for chunk in _chunks(ids):
                conn.execute(f"DELETE FROM staging WHERE id IN ({_marks(chunk)})", chunk)
            seqs = _insert_new(conn, batches, now)
            conn.execute("COMMIT")
            return seqs

        return self._run("promote", op)

    # --- loss ledger, eviction and re-downsampling ----------------------------------------------

    def _ledger_add(
        self,
        conn: sqlite3.Connection,
        now: int,
        reason: str,
        series: str,
        first: int,
        last: int,
        samples: int,
    ) -> None:
        updated = conn.execute(
            "UPDATE ledger SET samples = samples + ?, first_ts_ms = min(first_ts_ms, ?),"
            " last_ts_ms = max(last_ts_ms, ?), ts_ms = ? WHERE id = (SELECT id FROM ledger"
            " WHERE reason = ? AND series = ? AND ts_ms >= ? ORDER BY id DESC LIMIT 1)",
            (samples, first, last, now, reason, series, now - _LEDGER_BUCKET_MS),
        ).rowcount
        if not updated:
            conn.execute(
                "INSERT INTO ledger (ts_ms, reason, series, first_ts_ms, last_ts_ms, samples)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (now, reason, series, first, last, samples),
            )

    def record_loss(self, reason: str, series: str, first_ts_ms: int, last_ts_ms: int, samples: int) -> None:
        """Write a ledger entry (added to the previous one of the same reason and series within an hour)."""

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            self._ledger_add(conn, self._clock_ms(), reason, series, first_ts_ms, last_ts_ms, samples)
            conn.execute("COMMIT")

        self._run("record_loss", op)

    def losses(self, limit: int = 100) -> list[LossEntry]:
        """The newest ledger entries, newest first."""

        def op(conn: sqlite3.Connection) -> list[LossEntry]:
            rows = conn.execute(
                "SELECT id, ts_ms, reason, series, first_ts_ms, last_ts_ms, samples FROM ledger"
                " ORDER BY id DESC LIMIT ?",
                (limit,),
            ).fetchall()
            return [LossEntry(*r) for r in rows]

        return self._run("losses", op)

    def loss_totals(self) -> dict[str, int]:
        """Samples in the ledger by reason, over the spool's whole life."""

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            rows = conn.execute("SELECT reason, sum(samples) FROM ledger GROUP BY reason").fetchall()
            return {reason: int(total) for reason, total in rows}

        return self._run("loss_totals", op)

    def evict(self, rows: Sequence[SpoolRow], reason: str, describe: Callable[[SpoolRow], str]) -> int:
        """Delete ``rows`` and record each in the ledger, in one transaction. Returns rows deleted."""

        def op(conn: sqlite3.Connection) -> int:
            now = self._clock_ms()
            conn.execute("BEGIN IMMEDIATE")
            deleted = 0
            for row in rows:
                if conn.execute("DELETE FROM batches WHERE seq = ?", (row.seq,)).rowcount:
                    deleted += 1
                    conn.execute("DELETE FROM resolution WHERE seq = ?", (row.seq,))
                    self._ledger_add(
                        conn, now, reason, describe(row), row.first_ts_ms, row.last_ts_ms, row.sample_count
                    )
            conn.execute("COMMIT")
            return deleted

        return self._run("evict", op)

    def replace(
        self,
        old: Sequence[int],
        new: Sequence[Replacement],
        *,
        factor: int,
        loss: tuple[str, str, int, int, int] | None,
    ) -> list[int]:
        """Swap rows ``old`` for ``new`` (new seqs, resolution ``factor``) and record ``loss``
        (reason, series, first, last, samples) in one transaction. Returns the new seqs.

        New seqs, not reused ones: an ack still on its way for an old seq then deletes nothing.
        """

        def op(conn: sqlite3.Connection) -> list[int]:
            now = self._clock_ms()
            conn.execute("BEGIN IMMEDIATE")
            for chunk in _chunks(list(old)):
                conn.execute(f"DELETE FROM batches WHERE seq IN ({_marks(chunk)})", chunk)
                conn.execute(f"DELETE FROM resolution WHERE seq IN ({_marks(chunk)})", chunk)
            seqs = _insert_new(conn, new, now)
            for seq in seqs:
                conn.execute("INSERT INTO resolution (seq, factor) VALUES (?, ?)", (seq, factor))
            if loss is not None and loss[4] > 0:
                self._ledger_add(conn, now, *loss)
            conn.execute("COMMIT")
            return seqs

        return self._run("replace", op)

    def resolution(self, seqs: Sequence[int]) -> dict[int, int]:
        """Resolution factor of each seq (1 = as scraped)."""

        def op(conn: sqlite3.Connection) -> dict[int, int]:
            found: dict[int, int] = {}
            for chunk in _chunks(list(seqs)):
                q = f"SELECT seq, factor FROM resolution WHERE seq IN ({_marks(chunk)})"
                found.update(conn.execute(q, chunk).fetchall())
            return {s: found.get(s, 1) for s in seqs}

        return self._run("resolution", op)

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
                file_bytes=self._file_bytes(),
                last_seq=int(last_seq),
                staged_rows=int(staged[0]),
                staged_bytes=int(staged[1]),
                staged_samples=int(staged[2]),
            )

        return self._run("stats", op)

    def compact(self) -> int:
        """Return free pages to the filesystem (incremental vacuum + checkpoint); returns pages freed.

        Not needed for correctness (freed pages are reused by later appends); worth calling after a
        large backlog has drained on a node whose disk is shared with other things.
        """

        def op(conn: sqlite3.Connection) -> int:
            (free,) = conn.execute("PRAGMA freelist_count").fetchone()
            # executescript steps the pragma to completion; execute() would free a single page.
            conn.executescript("PRAGMA incremental_vacuum")
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            if self._cap_pages:
                # The cap cannot be set below the file's size, so one opened over the cap sat higher.
                conn.execute(f"PRAGMA max_page_count = {self._cap_pages}").fetchone()
            return int(free)

        return self._run("compact", op)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------- internals

    def _run(self, what: str, op: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``op`` under the lock; roll back on error; map SQLITE_FULL; recover once from corruption."""
        with self._lock:
            for attempt in range(2):
                conn = self._conn
                if conn is None:
                    raise SpoolClosedError(f"spool {self.path} is closed")
                try:
                    return op(conn)
                except BaseException as exc:
                    _rollback_quietly(conn)
                    if not isinstance(exc, sqlite3.Error):
                        raise
                    if _is_full(exc):
                        if not self._max_bytes:
                            # The disk may have room again (or less): follow it for the next attempt.
                            with contextlib.suppress(sqlite3.Error, OSError):
                                self._configure_size(conn)
                        raise SpoolFullError(f"{what}: spool {self.path} is full ({exc})") from exc
                    if attempt or not _is_corrupt(exc):
                        raise
                    # Corruption found at run time: swap in a fresh spool and retry the operation once.
                    self._conn = None
                    self._conn = self._recover(f"{what}: {type(exc).__name__}: {exc}", conn)
            raise AssertionError("unreachable")

    def _open_or_recover(self) -> sqlite3.Connection:
        conn = self._new_connection()
        try:
            self._prepare(conn)
            return conn
        except _CorruptFile as exc:
            reason = str(exc)
        except sqlite3.DatabaseError as exc:
            if not _is_corrupt(exc):
                conn.close()
                raise
            reason = f"{type(exc).__name__}: {exc}"
        except BaseException:
            conn.close()
            raise
        return self._recover(reason, conn)

    def _new_connection(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return sqlite3.connect(
            self.path,
            timeout=self._busy_timeout_ms / 1000,
            isolation_level=None,  # explicit BEGIN IMMEDIATE / COMMIT only
            check_same_thread=False,  # shared by the scrape loop and the MQTT thread, under self._lock
        )

    def _connect(self) -> sqlite3.Connection:
        conn = self._new_connection()
        try:
            self._prepare(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _prepare(self, conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
        # Must precede the first table; later a no-op. Lets compact() shrink the file.
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        if str(mode).lower() != "wal":
            raise SpoolError(f"spool {self.path}: cannot use WAL mode (journal_mode={mode})")
        conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        if self._check_on_open:
            problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise _CorruptFile("quick_check: " + "; ".join(problems).replace("\n", "; "))
        self._migrate(conn)
        self._configure_size(conn)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            # A newer relay wrote this; its rows are probably fine, so refuse rather than move them aside.
            raise SpoolError(
                f"spool {self.path} has schema {version}, this relay knows up to {SCHEMA_VERSION}"
            )
        conn.execute("BEGIN IMMEDIATE")
        try:
            if version < 1:
                for stmt in _SCHEMA_V1:
                    conn.execute(stmt)
            if version < 2:
                for stmt in _SCHEMA_V2:
                    conn.execute(stmt)
            if version < 3:
                for stmt in _SCHEMA_V3:
                    conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            _rollback_quietly(conn)
            raise

    def _disk_cap(self, conn: sqlite3.Connection, page_size: int) -> tuple[int, int]:
        """Without a configured cap: (WAL limit, bytes the file may grow to on this disk).

        SQLite cannot even delete once the WAL cannot grow, and a checkpoint cannot run once the file
        cannot grow: a spool that fills the disk to the last byte locks itself up. Capping the pages
        below the free space, with room for a small WAL, keeps acks, evictions and the ledger working.
        """
        (page_count,) = conn.execute("PRAGMA page_count").fetchone()
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return _UNCAPPED_WAL_BYTES, 0
        free = st.f_bavail * st.f_frsize
        wal_limit = max(16 * page_size, min(_UNCAPPED_WAL_BYTES, free // 8))
        return wal_limit, page_count * page_size + max(0, free - 2 * wal_limit)

    def _configure_size(self, conn: sqlite3.Connection) -> None:
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        if self._max_bytes:
            # Split the cap between database pages and the WAL, which max_page_count does not cover.
            wal_limit = min(_WAL_LIMIT_BYTES, self._max_bytes // 8)
            cap_bytes = self._max_bytes - wal_limit
        else:
            wal_limit, cap_bytes = self._disk_cap(conn, page_size)
        if cap_bytes:
            pages = self._cap_pages = cap_bytes // page_size
            (got,) = conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()
            if got > pages and self._max_bytes:
                log.warning(
                    "spool %s already holds %d pages, above the cap of %d (%d bytes); it only takes new "
                    "batches once acks have freed room",
                    self.path,
                    got,
                    pages,
                    self._max_bytes,
                )
        # Checkpoint often: a small WAL is one the disk can always hold.
        conn.execute(f"PRAGMA wal_autocheckpoint = {max(16, wal_limit // page_size)}")
        # The WAL is truncated to this size after checkpoints, not to zero: the file that stays allocated
        # is where a delete can still be journaled when the disk itself is full.
        conn.execute(f"PRAGMA journal_size_limit = {wal_limit}")

    def _recover(self, reason: str, failed: sqlite3.Connection) -> sqlite3.Connection:
        """Move the corrupt file aside, salvage what is readable into a fresh spool; return its connection.

        ``failed`` (the connection that met the corruption) is closed only after the rename: closing the
        last connection checkpoints and deletes the -wal by *name*, which would otherwise destroy the WAL
        before it could be salvaged or inspected.
        """
        now = self._clock_ms()
        moved = self._move_aside(now)
        with contextlib.suppress(sqlite3.Error):
            failed.close()
        src = _open_readonly(moved)
        try:
            next_seq = max(now * _SEQ_TIME_FACTOR, (_readable_max_seq(src) if src else 0) + 1, 1)
            conn = self._connect()  # the path is free now, so this is a brand-new file
            try:
                conn.execute("UPDATE meta SET value = max(value, ?) WHERE key = 'last_seq'", (next_seq - 1,))
                salvaged = self._salvage(src, conn) if src else 0
            except BaseException:
                conn.close()
                raise
        finally:
            if src is not None:
                src.close()
        self.recovery = SpoolRecovery(self.path, moved, reason, salvaged, next_seq, now)
        log.error(
            "spool %s is corrupt (%s): moved it to %s and started a fresh spool; salvaged %d batch(es), "
            "next seq %d",
            self.path,
            reason,
            moved,
            salvaged,
            next_seq,
        )
        self._prune_moved_aside()
        return conn

    def _move_aside(self, now_ms: int) -> Path:
        stamp = now_ms
        while True:
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            if not any(Path(f"{target}{s}").exists() for s in ("", *_SIDE_FILES)):
                break
            stamp += 1
        for suffix in ("", *_SIDE_FILES):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{self.path}{suffix}", f"{target}{suffix}")
        _fsync_dir(self.path.parent)
        return target

    def _salvage(self, src: sqlite3.Connection, dst: sqlite3.Connection) -> int:
        """Copy every row of ``src`` that reads back with a valid checksum; best effort, row by row."""
        seqs: list[int] = []
        with contextlib.suppress(sqlite3.Error):
            # Reading only the keys avoids the overflow pages, so one bad payload cannot hide later rows.
            for (seq,) in src.execute("SELECT seq FROM batches ORDER BY seq"):
                if type(seq) is int:
                    seqs.append(seq)
        copied = 0
        for start in range(0, len(seqs), _SALVAGE_CHUNK):
            rows: list[SpoolRow] = []
            for seq in seqs[start : start + _SALVAGE_CHUNK]:
                try:
                    raw = src.execute(f"SELECT {_COLUMNS} FROM batches WHERE seq = ?", (seq,)).fetchone()
                except sqlite3.Error:
                    continue
                row = None if raw is None else _verify(raw)
                if isinstance(row, SpoolRow):
                    rows.append(row)
            try:
                dst.execute("BEGIN IMMEDIATE")
                dst.executemany(
                    f"INSERT OR IGNORE INTO batches ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [_row_tuple(r) for r in rows],
                )
                dst.execute("COMMIT")
            except sqlite3.Error as exc:
                _rollback_quietly(dst)
                if not _is_full(exc):
                    raise
                log.error("spool %s: no room to salvage more than %d batch(es)", self.path, copied)
                break
            copied += len(rows)
        with contextlib.suppress(sqlite3.Error):
            # Staged cycles (an open batch window) too; the CRC check happens when they are read back.
            staged = src.execute(
                "SELECT payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size, created_ms"
                " FROM staging ORDER BY id"
            ).fetchall()
            dst.execute("BEGIN IMMEDIATE")
            dst.executemany(
                "INSERT INTO staging (payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size,"
                " created_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
                staged,
            )
            dst.execute("COMMIT")
        _rollback_quietly(dst)
        return copied

    def _prune_moved_aside(self) -> None:
        prefix = f"{self.path.name}.corrupt-"
        stamps = sorted(
            int(p.name[len(prefix) :])
            for p in self.path.parent.iterdir()
            if p.name.startswith(prefix) and p.name[len(prefix) :].isdigit()
        )
        for stamp in stamps[: max(0, len(stamps) - self._keep_corrupt)]:
            for suffix in ("", *_SIDE_FILES):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{self.path}.corrupt-{stamp}{suffix}")

    def _quarantine_locked(
        self, conn: sqlite3.Connection, items: Sequence[tuple[int, str]], ledger_reason: str = "corrupt_row"
    ) -> None:
        try:
            moved = self._move_to_quarantine(conn, items, keep_payload=True, ledger_reason=ledger_reason)
        except sqlite3.Error as exc:
            _rollback_quietly(conn)
            if not _is_full(exc):
                raise
            # A full spool must still be able to take a bad row out of circulation, or pending() would
            # fail until someone intervenes: keep the evidence minus the payload.
            moved = self._move_to_quarantine(conn, items, keep_payload=False, ledger_reason=ledger_reason)
        for seq, reason in moved:
            self._quarantined_total += 1
            log.error("spool %s: quarantined batch seq=%d: %s", self.path, seq, reason)

    def _move_to_quarantine(
        self,
        conn: sqlite3.Connection,
        items: Sequence[tuple[int, str]],
        *,
        keep_payload: bool,
        ledger_reason: str = "corrupt_row",
    ) -> list[tuple[int, str]]:
        now = self._clock_ms()
        moved: list[tuple[int, str]] = []
        conn.execute("BEGIN IMMEDIATE")
        for seq, reason in items:
            raw = conn.execute(f"SELECT {_COLUMNS} FROM batches WHERE seq = ?", (seq,)).fetchone()
            if raw is None:
                continue
            # Delete first: the freed pages then hold the quarantine copy, so a full spool can do this.
            conn.execute("DELETE FROM batches WHERE seq = ?", (seq,))
            note = reason if keep_payload else f"{reason} (payload dropped: spool full)"
            values = (*raw[:1], raw[1] if keep_payload else None, *raw[2:], note, now)
            conn.execute(
                f"INSERT OR REPLACE INTO quarantine ({_COLUMNS}, reason, quarantined_ms) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                values,
            )
            moved.append((seq, note))
            first, last, count = raw[3], raw[4], raw[5]
            if all(type(v) is int for v in (first, last, count)):
                self._ledger_add(conn, now, ledger_reason, f"spool seq {seq}", first, last, count)
        conn.execute("COMMIT")
        return moved

    @staticmethod
    def _fetch(conn: sqlite3.Connection, seqs: Sequence[int]) -> Iterator[tuple[object, ...]]:
        for chunk in _chunks(seqs):
            yield from conn.execute(f"SELECT {_COLUMNS} FROM batches WHERE seq IN ({_marks(chunk)})", chunk)

    def _file_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total


# ------------------------------------------------------------------------------------------------- helpers


def _verify(raw: Sequence[object]) -> SpoolRow | str:
    """The row if it is intact, else the reason it is not."""
    seq, payload, checksum, first, last, count, size, prio, created, attempts, last_sent = raw
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
    return SpoolRow(s, payload, crc_stored, f, la, n, z, p, c, a, last_sent)


def _row_tuple(r: SpoolRow) -> tuple[object, ...]:
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
    )


def _quarantined_row(r: Sequence[object]) -> QuarantinedRow:
    def num(v: object) -> int | None:
        return v if type(v) is int else None

    seq, payload, *ints, reason, quarantined_ms = r
    checksum, first, last, count, size, prio, created, attempts, last_sent = (num(v) for v in ints)
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
    )


def _open_readonly(path: Path) -> sqlite3.Connection | None:
    """Read-only connection to a moved-aside file, so salvaging cannot alter the evidence."""
    try:
        return sqlite3.connect(
            f"{path.absolute().as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error:
        return None


def _readable_max_seq(src: sqlite3.Connection) -> int:
    best = 0
    for sql in (
        "SELECT value FROM meta WHERE key = 'last_seq'",
        "SELECT max(seq) FROM batches",
        "SELECT max(seq) FROM quarantine",
    ):
        with contextlib.suppress(sqlite3.Error, TypeError):
            (value,) = src.execute(sql).fetchone()
            if type(value) is int:
                best = max(best, value)
    return best


def _primary_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _is_full(exc: sqlite3.Error) -> bool:
    return _primary_code(exc) == _SQLITE_FULL or "database or disk is full" in str(exc)


def _is_corrupt(exc: sqlite3.Error) -> bool:
    code = _primary_code(exc)
    if code is not None:
        return code in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc)
    return "malformed" in text or "not a database" in text


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    # SQLite may already have rolled back (e.g. after SQLITE_FULL); a failing ROLLBACK changes nothing.
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def _fsync_dir(directory: Path) -> None:
    # Makes the renames durable: after a power cut the fresh spool must not reappear under the old name.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _insert_new(conn: sqlite3.Connection, items: Sequence[Replacement], now: int) -> list[int]:
    """Insert ``items`` under the next seqs (inside the caller's transaction); returns the seqs."""
    (last_seq,) = conn.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
    (max_row,) = conn.execute("SELECT max(seq) FROM batches").fetchone()
    seq = max(int(last_seq), int(max_row or 0))
    seqs: list[int] = []
    for item in items:
        seq += 1
        blob = bytes(item.encode(seq))
        conn.execute(
            f"INSERT INTO batches ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, 0, NULL)",
            (
                seq,
                blob,
                zlib.crc32(blob),
                item.first_ts_ms,
                item.last_ts_ms,
                item.sample_count,
                len(blob),
                now,
            ),
        )
        seqs.append(seq)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'last_seq'", (seq,))
    return seqs


def _seq_list(seqs: Iterable[int]) -> list[int]:
    return sorted({operator.index(s) for s in seqs})


def _chunks(items: Sequence[int]) -> Iterator[Sequence[int]]:
    for start in range(0, len(items), _MAX_VARS):
        yield items[start : start + _MAX_VARS]


def _marks(chunk: Sequence[int]) -> str:
    return ", ".join("?" * len(chunk))
