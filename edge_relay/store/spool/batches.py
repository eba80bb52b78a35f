"""The batch queue: encoded batches by seq, from append until the cloud's ack deletes them.

The queue stores opaque payloads (the encoded envelope, sent as it is) with the few columns that
ordering and caps need; it knows nothing of MQTT. Every row read passes its CRC first; a row that fails
is moved to ``quarantine`` with a ledger entry instead of being returned. Orders are named (``Order``),
so callers say what they want ("oldest data first", "what a cap gives up first") rather than SQL.
"""

from __future__ import annotations

import logging
import operator
import sqlite3
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from enum import StrEnum

from edge_relay.ledger import LossReason, LossRecord
from edge_relay.store.spool.errors import SpoolFullError, is_full, rollback_quietly
from edge_relay.store.spool.losses import LossTable
from edge_relay.store.spool.schema import (
    COLUMNS,
    ROW_MARKS,
    QuarantinedRow,
    Replacement,
    SpoolRow,
    chunks,
    insert_batches,
    marks,
    quarantined_row,
    seq_list,
    verify,
)
from edge_relay.store.spool.store import Store

log = logging.getLogger("edge_relay.spool")


class Order(StrEnum):
    OLDEST = "oldest"  # seq ascending: the order of appending
    NEWEST = "newest"
    PRIORITY = "priority"  # highest priority first, then oldest
    # By the age of the data, not of the row: a re-downsampled row gets a new seq but old samples.
    OLDEST_DATA = "oldest_data"
    # What a cap gives up first: lowest priority, then oldest data.
    EVICTION = "evict"


_ORDER_SQL = {
    Order.OLDEST: "seq ASC",
    Order.NEWEST: "seq DESC",
    Order.PRIORITY: "priority DESC, seq ASC",
    Order.OLDEST_DATA: "first_ts_ms ASC, seq ASC",
    Order.EVICTION: "priority ASC, first_ts_ms ASC, seq ASC",
}


class BatchTable:
    def __init__(self, store: Store, losses: LossTable) -> None:
        self._store = store
        self._losses = losses
        self._quarantined_total = 0

    @property
    def incarnation(self) -> int:
        """The spool file's identity (0: unknown, see ``Store.incarnation``)."""
        return self._store.incarnation

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
        item = Replacement(
            encode,
            operator.index(first_ts_ms),
            operator.index(last_ts_ms),
            operator.index(sample_count),
            operator.index(priority),
        )
        if item.sample_count < 0:
            raise ValueError("sample_count must be >= 0")

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            (seq,) = insert_batches(conn, [item], self._store.clock_ms())
            conn.execute("COMMIT")
            return seq

        return self._store.run("append", op)

    def pending(
        self, limit: int, *, exclude: Collection[int] = (), order: Order | str = Order.OLDEST
    ) -> list[SpoolRow]:
        """Up to ``limit`` rows not in ``exclude``, in ``order``.

        Every returned row has passed its checksum; rows that fail are quarantined and skipped.
        ``exclude`` is only probed with ``len`` and ``in``, so a live ``dict.keys()`` view is fine.
        """
        try:
            sort = _ORDER_SQL[Order(order)]
        except ValueError:
            raise ValueError(
                f"order must be one of {sorted(o.value for o in Order)}, not {order!r}"
            ) from None
        if limit <= 0:
            return []
        excluded: Collection[int] = exclude if isinstance(exclude, AbstractSet) else frozenset(exclude)
        sql = f"SELECT seq FROM batches ORDER BY {sort} LIMIT ?"

        def op(conn: sqlite3.Connection) -> list[SpoolRow]:
            while True:
                # Excluded rows can take at most len(excluded) places, so this LIMIT always suffices.
                candidates = conn.execute(sql, (limit + len(excluded),)).fetchall()
                seqs = [s for (s,) in candidates if s not in excluded][:limit]
                raw = {r[0]: r for r in _fetch(conn, seqs)}
                good: list[SpoolRow] = []
                bad: list[tuple[int, str]] = []
                for seq in seqs:
                    if seq not in raw:  # deleted by another process between the two queries
                        continue
                    row = verify(raw[seq])
                    if isinstance(row, str):
                        bad.append((seq, row))
                    else:
                        good.append(row)
                if not bad:
                    return good
                self._quarantine_locked(conn, bad, LossReason.CORRUPT_ROW)
                # Quarantined rows are gone now, so the next pass can fill their places.

        return self._store.run("pending", op)

    def mark_sent(self, seqs: Iterable[int], now_ms: int) -> int:
        """Record a (re)publication: bump ``attempts``, set ``last_sent_ms``. Returns rows updated.

        Best effort: bookkeeping only, so a full spool logs a warning and returns 0 instead of raising
        (the uplink must keep draining, which is what makes room).
        """
        ids = seq_list(seqs)
        when = operator.index(now_ms)
        if not ids:
            return 0

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            n = 0
            for chunk in chunks(ids):
                n += conn.execute(
                    "UPDATE batches SET attempts = attempts + 1, last_sent_ms = ? "
                    f"WHERE seq IN ({marks(chunk)})",
                    (when, *chunk),
                ).rowcount
            conn.execute("COMMIT")
            return n

        try:
            return self._store.run("mark_sent", op)
        except SpoolFullError as exc:
            log.warning("%s; attempts of %d batch(es) not recorded", exc, len(ids))
            return 0

    def ack(self, seqs: Iterable[int]) -> int:
        """Delete the acknowledged rows; return how many existed.

        Unknown seqs are ignored: after a replay the cloud acks some batches twice.
        """
        ids = seq_list(seqs)
        if not ids:
            return 0

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            n = 0
            for chunk in chunks(ids):
                n += conn.execute(f"DELETE FROM batches WHERE seq IN ({marks(chunk)})", chunk).rowcount
                conn.execute(f"DELETE FROM resolution WHERE seq IN ({marks(chunk)})", chunk)
            conn.execute("COMMIT")
            return n

        return self._store.run("ack", op)

    def count(self) -> int:
        """Rows waiting (cheap: no payload is read)."""
        return self._store.run(
            "count", lambda conn: int(conn.execute("SELECT count(*) FROM batches").fetchone()[0])
        )

    # --- out of circulation: quarantine and eviction ----------------------------------------------

    def quarantine(self, seq: int, reason: str, ledger_reason: LossReason = LossReason.CORRUPT_ROW) -> None:
        """Move one row out of circulation (e.g. the broker cannot take it). Unknown seq: no-op.
        Its samples go into the loss ledger under ``ledger_reason``."""
        s = operator.index(seq)
        self._store.run(
            "quarantine", lambda conn: self._quarantine_locked(conn, [(s, str(reason))], ledger_reason)
        )

    def quarantined(self) -> list[QuarantinedRow]:
        def op(conn: sqlite3.Connection) -> list[QuarantinedRow]:
            rows = conn.execute(
                f"SELECT {COLUMNS}, reason, quarantined_ms FROM quarantine ORDER BY seq"
            ).fetchall()
            return [quarantined_row(r) for r in rows]

        return self._store.run("quarantined", op)

    def clear_quarantine(self, seqs: Iterable[int] | None = None) -> int:
        """Delete quarantined rows (all, or the given seqs) once reported; returns how many."""
        ids = None if seqs is None else seq_list(seqs)

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            if ids is None:
                n = conn.execute("DELETE FROM quarantine").rowcount
            else:
                n = sum(
                    conn.execute(f"DELETE FROM quarantine WHERE seq IN ({marks(c)})", c).rowcount
                    for c in chunks(ids)
                )
            conn.execute("COMMIT")
            return n

        return self._store.run("clear_quarantine", op)

    def evict(self, rows: Sequence[SpoolRow], reason: LossReason, describe: Callable[[SpoolRow], str]) -> int:
        """Delete ``rows`` and record each in the ledger, in one transaction. Returns rows deleted."""

        def op(conn: sqlite3.Connection) -> int:
            now = self._store.clock_ms()
            conn.execute("BEGIN IMMEDIATE")
            deleted = 0
            for row in rows:
                if conn.execute("DELETE FROM batches WHERE seq = ?", (row.seq,)).rowcount:
                    deleted += 1
                    conn.execute("DELETE FROM resolution WHERE seq = ?", (row.seq,))
                    loss = LossRecord(
                        reason, describe(row), row.first_ts_ms, row.last_ts_ms, row.sample_count
                    )
                    self._losses.add(conn, now, loss)
            conn.execute("COMMIT")
            return deleted

        return self._store.run("evict", op)

    def refuse(
        self,
        seq: int,
        reason: LossReason,
        describe: Callable[[SpoolRow], str],
        samples: int | None = None,
    ) -> LossRecord | None:
        """Delete the row ``seq`` that the cloud refused for good and record its samples in the ledger
        under ``reason``, in one transaction. Returns the ledger entry, or None for an unknown seq (an
        ack that came twice). ``samples``: how many of the row's samples were refused (the cloud wrote
        the others), at most the row's count; all of them by default.

        ``describe`` names the row's series (the caller can decode payloads; the spool cannot). A row
        that fails its CRC is still deleted and recorded, by the counts of its columns.
        """
        s = operator.index(seq)

        def op(conn: sqlite3.Connection) -> LossRecord | None:
            now = self._store.clock_ms()
            conn.execute("BEGIN IMMEDIATE")
            raw = conn.execute(f"SELECT {COLUMNS} FROM batches WHERE seq = ?", (s,)).fetchone()
            if raw is None:
                conn.execute("COMMIT")
                return None
            row = verify(raw)
            if isinstance(row, SpoolRow):
                count = row.sample_count if samples is None else min(samples, row.sample_count)
                loss = LossRecord(reason, describe(row), row.first_ts_ms, row.last_ts_ms, count)
            else:
                first, last, count = (v if type(v) is int else 0 for v in raw[3:6])
                count = count if samples is None else min(samples, count)
                loss = LossRecord(reason, f"spool seq {s}", first, last, count)
            conn.execute("DELETE FROM batches WHERE seq = ?", (s,))
            conn.execute("DELETE FROM resolution WHERE seq = ?", (s,))
            self._losses.add(conn, now, loss)
            conn.execute("COMMIT")
            return loss

        return self._store.run("refuse", op)

    # --- re-downsampling ---------------------------------------------------------------------------

    def replace(
        self, old: Sequence[int], new: Sequence[Replacement], *, factor: int, loss: LossRecord | None
    ) -> list[int]:
        """Swap rows ``old`` for ``new`` (new seqs, resolution ``factor``) and record ``loss``, in one
        transaction. Returns the new seqs.

        New seqs, not reused ones: an ack still on its way for an old seq then deletes nothing.
        """

        def op(conn: sqlite3.Connection) -> list[int]:
            now = self._store.clock_ms()
            conn.execute("BEGIN IMMEDIATE")
            for chunk in chunks(list(old)):
                conn.execute(f"DELETE FROM batches WHERE seq IN ({marks(chunk)})", chunk)
                conn.execute(f"DELETE FROM resolution WHERE seq IN ({marks(chunk)})", chunk)
            seqs = insert_batches(conn, new, now)
            for seq in seqs:
                conn.execute("INSERT INTO resolution (seq, factor) VALUES (?, ?)", (seq, factor))
            if loss is not None and loss.samples > 0:
                self._losses.add(conn, now, loss)
            conn.execute("COMMIT")
            return seqs

        return self._store.run("replace", op)

    def resolution(self, seqs: Sequence[int]) -> dict[int, int]:
        """Resolution factor of each seq (1 = as scraped)."""

        def op(conn: sqlite3.Connection) -> dict[int, int]:
            found: dict[int, int] = {}
            for chunk in chunks(list(seqs)):
                q = f"SELECT seq, factor FROM resolution WHERE seq IN ({marks(chunk)})"
                found.update(conn.execute(q, chunk).fetchall())
            return {s: found.get(s, 1) for s in seqs}

        return self._store.run("resolution", op)

    # --- internals ---------------------------------------------------------------------------------

    def _quarantine_locked(
        self, conn: sqlite3.Connection, items: Sequence[tuple[int, str]], ledger_reason: LossReason
    ) -> None:
        try:
            moved = self._move_to_quarantine(conn, items, keep_payload=True, ledger_reason=ledger_reason)
        except sqlite3.Error as exc:
            rollback_quietly(conn)
            if not is_full(exc):
                raise
            # A full spool must still be able to take a bad row out of circulation, or pending() would
            # fail until someone intervenes: keep the evidence minus the payload.
            moved = self._move_to_quarantine(conn, items, keep_payload=False, ledger_reason=ledger_reason)
        for seq, reason in moved:
            self._quarantined_total += 1
            log.error("spool %s: quarantined batch seq=%d: %s", self._store.path, seq, reason)

    def _move_to_quarantine(
        self,
        conn: sqlite3.Connection,
        items: Sequence[tuple[int, str]],
        *,
        keep_payload: bool,
        ledger_reason: LossReason,
    ) -> list[tuple[int, str]]:
        now = self._store.clock_ms()
        moved: list[tuple[int, str]] = []
        conn.execute("BEGIN IMMEDIATE")
        for seq, reason in items:
            raw = conn.execute(f"SELECT {COLUMNS} FROM batches WHERE seq = ?", (seq,)).fetchone()
            if raw is None:
                continue
            # Delete first: the freed pages then hold the quarantine copy, so a full spool can do this.
            conn.execute("DELETE FROM batches WHERE seq = ?", (seq,))
            note = reason if keep_payload else f"{reason} (payload dropped: spool full)"
            values = (*raw[:1], raw[1] if keep_payload else None, *raw[2:], note, now)
            conn.execute(
                f"INSERT OR REPLACE INTO quarantine ({COLUMNS}, reason, quarantined_ms) "
                f"VALUES ({ROW_MARKS}, ?, ?)",
                values,
            )
            moved.append((seq, note))
            first, last, count = raw[3], raw[4], raw[5]
            if all(type(v) is int for v in (first, last, count)):
                self._losses.add(conn, now, LossRecord(ledger_reason, f"spool seq {seq}", first, last, count))
        conn.execute("COMMIT")
        return moved


def _fetch(conn: sqlite3.Connection, seqs: Sequence[int]) -> Iterator[tuple[object, ...]]:
    for chunk in chunks(seqs):
        yield from conn.execute(f"SELECT {COLUMNS} FROM batches WHERE seq IN ({marks(chunk)})", chunk)
