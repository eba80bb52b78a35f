"""The spool's SQLite file: one connection, its lock, durability and size settings, and recovery.

The scrape loop writes while the MQTT network thread acks, so the store owns a single connection
(``check_same_thread=False``) serialised by a ``threading.Lock``; every table module runs its SQL through
``Store.run``, which also rolls back on error, maps SQLITE_FULL to ``SpoolFullError`` and recovers once
from corruption. SQLite's own locking (``busy_timeout``) only matters if another process opens the file,
e.g. an operator's sqlite3.

Durability. WAL mode with ``synchronous=FULL`` by default: every commit fsyncs the WAL before it
returns. Edge nodes lose *power*, not just processes; with ``NORMAL`` the last commits before a power cut
may roll back, and a rolled-back append would hand out its seq a second time after the reboot, although
the first batch with that seq may already be on its way to the cloud, where (node, seq) identifies a
batch. ``NORMAL`` still survives ``kill -9`` (the OS keeps the WAL pages), so it is an option for nodes
with reliable power or slow flash, never the default.

Size cap. ``max_bytes`` caps the database pages via ``PRAGMA max_page_count`` and bounds the WAL with
``journal_size_limit`` / ``wal_autocheckpoint``; a full cap or a full disk (SQLITE_FULL) raises
``SpoolFullError``. Deleted pages go to the freelist and are reused by the next inserts, so acks make
room again without a VACUUM; ``compact()`` gives free pages back to the filesystem when wanted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

from edge_relay.store.spool import recovery
from edge_relay.store.spool.errors import (
    CorruptFile,
    SpoolClosedError,
    SpoolError,
    SpoolFullError,
    is_corrupt,
    is_full,
    rollback_quietly,
)
from edge_relay.store.spool.schema import migrate

log = logging.getLogger("edge_relay.spool")

_SYNC_MODES: Final = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
_MIN_CAP_BYTES: Final = 64 * 1024
_WAL_LIMIT_BYTES: Final = 4 * 1024 * 1024
_UNCAPPED_WAL_BYTES: Final = 1024 * 1024

_T = TypeVar("_T")


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Store:
    """The open spool file; see the module docstring."""

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
        self.clock_ms = clock_ms
        self._lock = threading.Lock()
        self._cap_pages = 0
        # The file's identity, drawn when it is created: seqs count per file, so a recreated spool
        # (a new emptyDir, a deleted file) starts at seq 1 again, and (incarnation, seq) names a batch.
        # 0 (only after a recovery that salvaged rows but could not read it): unknown.
        self._incarnation: int | None = None  # read (or drawn) on first use
        self.recovery: recovery.SpoolRecovery | None = None
        self._conn: sqlite3.Connection | None = self._open_or_recover()

    def run(self, what: str, op: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``op`` under the lock; roll back on error; map SQLITE_FULL; recover once from corruption."""
        with self._lock:
            for attempt in range(2):
                conn = self._conn
                if conn is None:
                    raise SpoolClosedError(f"spool {self.path} is closed")
                try:
                    return op(conn)
                except BaseException as exc:
                    rollback_quietly(conn)
                    if not isinstance(exc, sqlite3.Error):
                        raise
                    if is_full(exc):
                        if not self._max_bytes:
                            # The disk may have room again (or less): follow it for the next attempt.
                            with contextlib.suppress(sqlite3.Error, OSError):
                                self._configure_size(conn)
                        raise SpoolFullError(f"{what}: spool {self.path} is full ({exc})") from exc
                    if attempt or not is_corrupt(exc):
                        raise
                    # Corruption found at run time: swap in a fresh spool and retry the operation once.
                    self._conn = None
                    self._conn = self._recover(f"{what}: {type(exc).__name__}: {exc}", conn)
            raise AssertionError("unreachable")

    @property
    def incarnation(self) -> int:
        """The file's identity; read on first use, so opening reads no more of the file than before."""
        if self._incarnation is None:
            value = self.run("incarnation", _incarnation)
            if self._incarnation is None:  # unless a recovery inside run() has set it meanwhile
                self._incarnation = value
        return self._incarnation

    def file_bytes(self) -> int:
        """Database + WAL + shared-memory index on disk."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total

    def compact(self) -> int:
        """Return free pages to the filesystem (incremental vacuum + checkpoint); returns pages freed.

        Not needed for correctness (freed pages are reused by later inserts); worth calling after a
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

        return self.run("compact", op)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

    # --- opening, size and recovery ---------------------------------------------------------------

    def _open_or_recover(self) -> sqlite3.Connection:
        conn = self._new_connection()
        try:
            self._prepare(conn)
            return conn
        except CorruptFile as exc:
            reason = str(exc)
        except sqlite3.DatabaseError as exc:
            if not is_corrupt(exc):
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
                raise CorruptFile("quick_check: " + "; ".join(problems).replace("\n", "; "))
        migrate(conn, self.path)
        self._configure_size(conn)

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
        now = self.clock_ms()
        moved = recovery.move_aside(self.path, now)
        with contextlib.suppress(sqlite3.Error):
            failed.close()
        src = recovery.open_readonly(moved)
        try:
            readable = recovery.readable_max_seq(src) if src else 0
            next_seq = max(now * recovery.SEQ_TIME_FACTOR, readable + 1, 1)
            conn = self._connect()  # the path is free now, so this is a brand-new file
            try:
                conn.execute("UPDATE meta SET value = max(value, ?) WHERE key = 'last_seq'", (next_seq - 1,))
                salvaged = recovery.salvage(src, conn, self.path) if src else 0
                self._incarnation = recovery.carry_incarnation(src, conn, salvaged, self._incarnation)
            except BaseException:
                conn.close()
                raise
        finally:
            if src is not None:
                src.close()
        self.recovery = recovery.SpoolRecovery(self.path, moved, reason, salvaged, next_seq, now)
        recovery.record_recovery(conn, self.recovery)
        log.error(
            "spool %s is corrupt (%s): moved it to %s and started a fresh spool; salvaged %d batch(es), "
            "next seq %d",
            self.path,
            reason,
            moved,
            salvaged,
            next_seq,
        )
        recovery.prune_moved_aside(self.path, self._keep_corrupt)
        return conn


def _incarnation(conn: sqlite3.Connection) -> int:
    """The file's incarnation, drawn at random (1 .. 2^62) the first time the file is opened."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'incarnation'").fetchone()
    if row is not None and type(row[0]) is int:
        return int(row[0])
    value = secrets.randbits(62) + 1
    # An optional meta row, not a schema step: older relays ignore it and still open the file.
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('incarnation', ?)", (value,))
    return value
