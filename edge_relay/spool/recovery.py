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
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from edge_relay.spool.errors import is_full, rollback_quietly
from edge_relay.spool.schema import COLUMNS, SpoolRow, row_tuple, verify

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
                f"INSERT OR IGNORE INTO batches ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
    rollback_quietly(dst)
    return copied


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
