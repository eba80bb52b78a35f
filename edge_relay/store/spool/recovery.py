"""Salvage of a corrupt spool file: move it aside, copy out every row that still reads back intact.

If opening fails with SQLITE_CORRUPT / SQLITE_NOTADB or ``PRAGMA quick_check`` is not ok (or an
operation hits SQLITE_CORRUPT later), the store renames the file and its -wal/-shm to
``<name>.corrupt-<unix-ms>``, and every row that can still be read with a valid checksum is copied into
a fresh spool. Seqs then continue from ``max(highest seq still readable + 1, unix_ms * 1000)``: what is
readable from a corrupt file may be stale (the lost part may have held higher seqs already sent);
``unix_ms * 1000`` stays above any earlier seq as long as the node averaged fewer than 1000 batches per
millisecond since the previous reset, and stays below 2**53, so the seq is still exact in JSON.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from edge_relay.ledger import LossReason, LossRecord
from edge_relay.store.spool.errors import is_full, rollback_quietly
from edge_relay.store.spool.schema import COLUMNS, ROW_MARKS, SpoolRow, add_loss, row_tuple, verify

log = logging.getLogger("edge_relay.spool")

SEQ_TIME_FACTOR: Final = 1000
SIDE_FILES: Final = ("-wal", "-shm", "-journal")
_SALVAGE_CHUNK: Final = 64


@dataclass(frozen=True, slots=True)
class SpoolRecovery:
    """A corrupt spool file was moved aside and replaced by a fresh one."""

    path: Path
    moved_to: Path
    reason: str
    salvaged_rows: int
    next_seq: int
    at_ms: int


def move_aside(path: Path, now_ms: int) -> Path:
    stamp = now_ms
    while True:
        target = path.with_name(f"{path.name}.corrupt-{stamp}")
        if not any(Path(f"{target}{s}").exists() for s in ("", *SIDE_FILES)):
            break
        stamp += 1
    for suffix in ("", *SIDE_FILES):
        with contextlib.suppress(FileNotFoundError):
            os.replace(f"{path}{suffix}", f"{target}{suffix}")
    _fsync_dir(path.parent)
    return target


def open_readonly(path: Path) -> sqlite3.Connection | None:
    """Read-only connection to a moved-aside file, so salvaging cannot alter the evidence."""
    try:
        return sqlite3.connect(
            f"{path.absolute().as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error:
        return None


def readable_max_seq(src: sqlite3.Connection) -> int:
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


def salvage(src: sqlite3.Connection, dst: sqlite3.Connection, path: Path) -> int:
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
                raw = src.execute(f"SELECT {COLUMNS} FROM batches WHERE seq = ?", (seq,)).fetchone()
            except sqlite3.Error:
                continue
            row = None if raw is None else verify(raw)
            if isinstance(row, SpoolRow):
                rows.append(row)
        try:
            dst.execute("BEGIN IMMEDIATE")
            dst.executemany(
                f"INSERT OR IGNORE INTO batches ({COLUMNS}) VALUES ({ROW_MARKS})",
                [row_tuple(r) for r in rows],
            )
            dst.execute("COMMIT")
        except sqlite3.Error as exc:
            rollback_quietly(dst)
            if not is_full(exc):
                raise
            log.error("spool %s: no room to salvage more than %d batch(es)", path, copied)
            break
        copied += len(rows)
    # What the relay knows about this node beyond its batches goes along, best effort: the loss
    # ledger (or the status would read "data safe" after a loss) and the kept integers (quota use).
    _copy_table(src, dst, "ledger", "ts_ms, reason, series, first_ts_ms, last_ts_ms, samples", _ledger_row_ok)
    _copy_table(
        src, dst, "meta", "key, value", _meta_row_ok, where="key LIKE 'x:%'", verb="INSERT OR REPLACE"
    )
    with contextlib.suppress(sqlite3.Error):
        # Staged cycles (an open batch window) too; the CRC check happens when they are read back.
        staged = src.execute(
            "SELECT payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size, created_ms,"
            " meta_checksum FROM staging ORDER BY id"
        ).fetchall()
        dst.execute("BEGIN IMMEDIATE")
        dst.executemany(
            "INSERT INTO staging (payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size,"
            " created_ms, meta_checksum) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            staged,
        )
        dst.execute("COMMIT")
    rollback_quietly(dst)
    return copied


def _copy_table(
    src: sqlite3.Connection,
    dst: sqlite3.Connection,
    table: str,
    columns: str,
    valid: Callable[[tuple[object, ...]], bool],
    *,
    where: str = "1",
    verb: str = "INSERT",
) -> None:
    """Copy the ``valid`` rows of ``table``, in one transaction; a table that fails is skipped."""
    try:
        rows = [r for r in src.execute(f"SELECT {columns} FROM {table} WHERE {where}") if valid(r)]
    except sqlite3.Error as exc:
        log.error("spool: the %s table of the corrupt file cannot be read (%s); not salvaged", table, exc)
        return
    marks = ", ".join("?" * (columns.count(",") + 1))
    try:
        dst.execute("BEGIN IMMEDIATE")
        dst.executemany(f"{verb} INTO {table} ({columns}) VALUES ({marks})", rows)
        dst.execute("COMMIT")
    except sqlite3.Error as exc:
        rollback_quietly(dst)
        log.error("spool: cannot salvage the %s table (%s)", table, exc)


def _ledger_row_ok(r: tuple[object, ...]) -> bool:
    ts, reason, series, first, last, samples = r
    return (
        isinstance(reason, str)
        and isinstance(series, str)
        and all(type(v) is int for v in (ts, first, last, samples))
    )


def _meta_row_ok(r: tuple[object, ...]) -> bool:
    return isinstance(r[0], str) and type(r[1]) is int


def carry_incarnation(
    src: sqlite3.Connection | None, dst: sqlite3.Connection, salvaged: int, known: int | None = None
) -> int | None:
    """The fresh file keeps the corrupt file's incarnation: its salvaged rows carry it in their
    payloads, so their acks must keep deleting them. When the file cannot tell it, the incarnation
    the running process read before (``known``) is kept: the relay stamps its batches with it, and a
    fresh identity would make it ignore every ack of what it sends from now on. Seqs go on past every
    old one, so keeping it never lets an old ack hit a new batch. Without either, and rows salvaged,
    the incarnation is unknown (0: acks of any incarnation apply); with nothing salvaged the fresh
    file draws an identity of its own."""
    old: object = None
    if src is not None:
        with contextlib.suppress(sqlite3.Error, TypeError):
            (old,) = src.execute("SELECT value FROM meta WHERE key = 'incarnation'").fetchone()
    if type(old) is int and old > 0:
        value = old
    elif known is not None:
        value = known
    elif salvaged:
        value = 0
    else:
        return None  # nothing salvaged: the fresh file draws an identity of its own on first use
    dst.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('incarnation', ?)", (value,))
    return value


def record_recovery(dst: sqlite3.Connection, recovery: SpoolRecovery) -> None:
    """The recovery's own ledger entry, in the fresh file: what was not salvaged is unknown (count 0),
    the entry says how many batches were saved. Written here, so a recovery at run time is recorded
    like one at start."""
    series = f"file moved aside to {recovery.moved_to.name}; {recovery.salvaged_rows} rows salvaged"
    entry = LossRecord(LossReason.SPOOL_FILE_CORRUPT, series, 0, 0, 0)
    try:
        dst.execute("BEGIN IMMEDIATE")
        add_loss(dst, recovery.at_ms, entry)
        dst.execute("COMMIT")
    except sqlite3.Error as exc:
        rollback_quietly(dst)
        log.error("spool: cannot record the recovery in the loss ledger (%s)", exc)


def prune_moved_aside(path: Path, keep: int) -> None:
    """Keep the newest ``keep`` moved-aside files, so repeated corruption cannot fill the disk."""
    prefix = f"{path.name}.corrupt-"
    stamps = sorted(
        int(p.name[len(prefix) :])
        for p in path.parent.iterdir()
        if p.name.startswith(prefix) and p.name[len(prefix) :].isdigit()
    )
    for stamp in stamps[: max(0, len(stamps) - keep)]:
        for suffix in ("", *SIDE_FILES):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{path}.corrupt-{stamp}{suffix}")


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
