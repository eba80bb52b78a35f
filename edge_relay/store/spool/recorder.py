"""The flight recorder's table: opaque blocks of raw scrapes, kept for a bounded span, always second to
the backlog.

Blocks (``edge_relay.recorder.flight`` encodes them; this module never looks inside) are kept by writing order
under two caps, applied in the transaction that writes a block: an age (``oldest_ms``) and a byte cap
(``max_bytes``, of payloads). The backlog always wins: a write first frees what the spool's page cap
(``spool.max_bytes``, or the disk) needs to keep ``reserve_bytes`` free for batches, and
``make_room`` gives blocks up for a batch that did not fit (``Retention.make_room`` calls it before it
evicts any batch). Evictions are counted here by reason (``evicted_samples``), never ledgered: every
sample recorded was also sent, at the budget's resolution.
"""

from __future__ import annotations

import operator
import sqlite3
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from edge_relay.store.spool.errors import SpoolError
from edge_relay.store.spool.schema import chunks, marks
from edge_relay.store.spool.store import Store

_EVICT_CHUNK: Final = 64  # oldest rows read per eviction step


class Eviction(StrEnum):
    MAX_AGE = "max_age"
    MAX_BYTES = "max_bytes"
    BACKLOG_ROOM = "backlog_room"  # the backlog (or a full disk) needed the room


@dataclass(frozen=True, slots=True)
class NewBlock:
    kind: int  # the encoder's format tag, handed back by ``blocks``
    payload: bytes
    first_ts_ms: int
    last_ts_ms: int
    sample_count: int


@dataclass(frozen=True, slots=True)
class RecordedBlock:
    id: int
    kind: int
    first_ts_ms: int
    last_ts_ms: int
    sample_count: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class RecorderStats:
    blocks: int
    bytes: int  # sum of payload sizes
    samples: int
    oldest_ts_ms: int | None
    newest_ts_ms: int | None


class RecorderTable:
    def __init__(self, store: Store) -> None:
        self._store = store
        # Samples and blocks given up by this process, by reason (for counter metrics).
        self.evicted_samples: dict[str, int] = dict.fromkeys(map(str, Eviction), 0)
        self.evicted_blocks: dict[str, int] = dict.fromkeys(map(str, Eviction), 0)
        self.corrupt_blocks = 0

    def write(
        self,
        blocks: Sequence[NewBlock],
        *,
        replaces: Sequence[int] = (),
        max_bytes: int,
        oldest_ms: int,
        reserve_bytes: int,
    ) -> list[int] | None:
        """Store ``blocks`` in place of the rows ``replaces``, after applying the caps, in one
        transaction; returns the new ids, [] (nothing changed) when the spool has no room for them
        beyond ``reserve_bytes`` even without any block, or None (nothing changed) when a row of
        ``replaces`` is gone (evicted meanwhile: a replacement must never bring evicted data back).

        Raises ``SpoolFullError`` when the spool cannot take them even so; nothing was written then.
        """
        size = sum(len(b.payload) for b in blocks)
        old = sorted({operator.index(i) for i in replaces})

        def op(conn: sqlite3.Connection) -> list[int] | None:
            now = self._store.clock_ms()
            conn.execute("BEGIN IMMEDIATE")
            gone = 0
            for chunk in chunks(old):
                gone += conn.execute(f"DELETE FROM recorder WHERE id IN ({marks(chunk)})", chunk).rowcount
            if gone != len(old):
                conn.execute("ROLLBACK")
                return None
            evicted: list[tuple[Eviction, int, int]] = []
            rows = conn.execute(
                "SELECT id, sample_count, byte_size FROM recorder WHERE last_ts_ms < ?", (oldest_ms,)
            ).fetchall()
            if rows:
                _delete(conn, [r[0] for r in rows])
                evicted += [(Eviction.MAX_AGE, r[1], r[2]) for r in rows]
            # Room the batches may need stays free: the recorder only ever takes what is left over.
            short = size + reserve_bytes - free_bytes(conn) if blocks else 0
            if short > 0:
                room = _evict_oldest(conn, short, Eviction.BACKLOG_ROOM)
                if sum(e[2] for e in room) < short:
                    conn.execute("ROLLBACK")  # no room even without any block: nothing given up
                    return []
                evicted += room
            (held,) = conn.execute("SELECT coalesce(sum(byte_size), 0) FROM recorder").fetchone()
            if held + size > max_bytes:
                evicted += _evict_oldest(conn, held + size - max_bytes, Eviction.MAX_BYTES)
            ids: list[int] = []
            for b in blocks:
                cur = conn.execute(
                    "INSERT INTO recorder (kind, first_ts_ms, last_ts_ms, sample_count, byte_size, checksum,"
                    " created_ms, payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        b.kind,
                        b.first_ts_ms,
                        b.last_ts_ms,
                        b.sample_count,
                        len(b.payload),
                        zlib.crc32(b.payload),
                        now,
                        b.payload,
                    ),
                )
                ids.append(int(cur.lastrowid or 0))
            conn.execute("COMMIT")
            self._count(evicted)  # only once committed: a rolled-back eviction gave nothing up
            return ids

        return self._store.run("record", op)

    def make_room(self, need_bytes: int) -> int:
        """Give up the oldest blocks until about ``need_bytes`` of payload are freed (for the backlog);
        returns the bytes freed (0 when the recorder is empty)."""
        if need_bytes <= 0:
            return 0

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            evicted = _evict_oldest(conn, need_bytes, Eviction.BACKLOG_ROOM)
            conn.execute("COMMIT")
            self._count(evicted)
            return sum(e[2] for e in evicted)

        return self._store.run("recorder_make_room", op)

    def stats(self) -> RecorderStats:
        def op(conn: sqlite3.Connection) -> RecorderStats:
            n, size, samples, oldest, newest = conn.execute(
                "SELECT count(*), coalesce(sum(byte_size), 0), coalesce(sum(sample_count), 0),"
                " min(first_ts_ms), max(last_ts_ms) FROM recorder"
            ).fetchone()
            return RecorderStats(int(n), int(size), int(samples), oldest, newest)

        return self._store.run("recorder_stats", op)

    def spans(self) -> list[tuple[int, int]]:
        """(first_ts_ms, last_ts_ms) of every block, by first timestamp: what the recorder covers."""
        return self._store.run(
            "recorder_spans",
            lambda conn: [
                (int(a), int(b))
                for a, b in conn.execute(
                    "SELECT first_ts_ms, last_ts_ms FROM recorder ORDER BY first_ts_ms, id"
                ).fetchall()
            ],
        )

    def block_spans(self, start_ms: int, end_ms: int) -> dict[int, tuple[int, int]]:
        """id -> (first_ts_ms, last_ts_ms) of the blocks with samples that may lie in [start_ms, end_ms]."""
        return self._store.run(
            "recorder_block_spans",
            lambda conn: {
                int(i): (int(a), int(b))
                for i, a, b in conn.execute(
                    "SELECT id, first_ts_ms, last_ts_ms FROM recorder"
                    " WHERE last_ts_ms >= ? AND first_ts_ms <= ?",
                    (start_ms, end_ms),
                ).fetchall()
            },
        )

    def existing(self, ids: Sequence[int]) -> list[int]:
        """Those of ``ids`` still stored."""

        def op(conn: sqlite3.Connection) -> list[int]:
            found: list[int] = []
            for chunk in chunks(sorted(ids)):
                q = f"SELECT id FROM recorder WHERE id IN ({marks(chunk)}) ORDER BY id"
                found += [int(r[0]) for r in conn.execute(q, chunk)]
            return found

        return self._store.run("recorder_existing", op)

    def blocks(
        self, start_ms: int, end_ms: int, *, after_id: int = 0, limit: int = 16
    ) -> list[RecordedBlock]:
        """Up to ``limit`` blocks with samples that may lie in [start_ms, end_ms], of id > ``after_id``,
        by id. A block that fails its checksum is deleted (and counted in ``corrupt_blocks``)."""

        def op(conn: sqlite3.Connection) -> list[RecordedBlock]:
            rows = conn.execute(
                "SELECT id, kind, first_ts_ms, last_ts_ms, sample_count, byte_size, checksum, payload"
                " FROM recorder WHERE id > ? AND last_ts_ms >= ? AND first_ts_ms <= ? ORDER BY id LIMIT ?",
                (after_id, start_ms, end_ms, limit),
            ).fetchall()
            good: list[RecordedBlock] = []
            bad: list[int] = []
            for rid, kind, first, last, count, size, crc, payload in rows:
                if isinstance(payload, bytes) and len(payload) == size and zlib.crc32(payload) == crc:
                    good.append(RecordedBlock(rid, kind, first, last, count, payload))
                else:
                    bad.append(rid)
            if bad:
                conn.execute("BEGIN IMMEDIATE")
                _delete(conn, bad)
                conn.execute("COMMIT")
                self.corrupt_blocks += len(bad)
            if len(rows) == limit and not good:
                # Every row of this page was bad: let the caller go on after them.
                raise _AllBad(rows[-1][0])
            return good

        try:
            return self._store.run("recorder_read", op)
        except _AllBad as e:
            return self.blocks(start_ms, end_ms, after_id=e.last_id, limit=limit)

    def _count(self, evicted: Sequence[tuple[Eviction, int, int]]) -> None:
        for reason, samples, _ in evicted:
            self.evicted_samples[str(reason)] += samples
            self.evicted_blocks[str(reason)] += 1


class _AllBad(SpoolError):
    def __init__(self, last_id: int) -> None:
        super().__init__(f"recorder blocks up to {last_id} are corrupt")
        self.last_id = last_id


def _delete(conn: sqlite3.Connection, ids: Sequence[int]) -> None:
    for chunk in chunks(list(ids)):
        conn.execute(f"DELETE FROM recorder WHERE id IN ({marks(chunk)})", chunk)


def _evict_oldest(
    conn: sqlite3.Connection, need_bytes: int, reason: Eviction
) -> list[tuple[Eviction, int, int]]:
    """Delete the oldest rows until ``need_bytes`` of payload are gone (or none is left)."""
    out: list[tuple[Eviction, int, int]] = []
    freed = 0
    while freed < need_bytes:
        rows = conn.execute(
            "SELECT id, sample_count, byte_size FROM recorder ORDER BY id LIMIT ?", (_EVICT_CHUNK,)
        ).fetchall()
        if not rows:
            break
        chosen: list[int] = []
        for rid, samples, size in rows:
            if freed >= need_bytes:
                break
            chosen.append(rid)
            out.append((reason, samples, size))
            freed += size
        _delete(conn, chosen)
    return out


def free_bytes(conn: sqlite3.Connection) -> int:
    """Bytes the file can still take under its page cap (``spool.max_bytes`` or the disk's): pages not
    yet allocated plus free pages inside the file."""
    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    (cap,) = conn.execute("PRAGMA max_page_count").fetchone()
    (count,) = conn.execute("PRAGMA page_count").fetchone()
    (free,) = conn.execute("PRAGMA freelist_count").fetchone()
    return (max(0, int(cap) - int(count)) + int(free)) * int(page_size)
