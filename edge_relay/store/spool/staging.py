"""Staged cycles: scrapes of the open batch window, durable until they are packed into batches.

With a budget, one wire batch carries a whole window (60 s) of scrapes; staging keeps every cycle on
disk from the cycle that scraped it, so a kill -9 inside the window loses nothing. A staged cycle has
no seq (it was never sent); ``promote`` replaces staged cycles by the batches packed from them in one
transaction, so a crash leaves either the staged cycles or the batches, never both or neither.
"""

from __future__ import annotations

import logging
import operator
import sqlite3
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from edge_relay.ledger import LossReason, LossRecord
from edge_relay.store.spool.losses import LossTable
from edge_relay.store.spool.schema import Replacement, chunks, insert_batches, marks, meta_checksum
from edge_relay.store.spool.store import Store

log = logging.getLogger("edge_relay.spool")


@dataclass(frozen=True, slots=True)
class StagedRow:
    """Scrapes of one cycle waiting for their batch window to close (not yet a batch: no seq)."""

    id: int
    payload: bytes
    first_ts_ms: int
    last_ts_ms: int
    sample_count: int


class StagingTable:
    def __init__(self, store: Store, losses: LossTable) -> None:
        self._store = store
        self._losses = losses

    def stage(self, payload: bytes, *, first_ts_ms: int, last_ts_ms: int, sample_count: int) -> int:
        """Keep one cycle's scrapes durably until ``promote`` packs them into batches; returns its id.

        Raises ``SpoolFullError`` when the cap or the disk is full.
        """
        blob = bytes(payload)
        first, last = operator.index(first_ts_ms), operator.index(last_ts_ms)
        count = operator.index(sample_count)

        def op(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            fate = (first, last, count, len(blob), self._store.clock_ms())
            cur = conn.execute(
                "INSERT INTO staging (payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size,"
                " created_ms, meta_checksum) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (blob, zlib.crc32(blob), *fate, meta_checksum(*fate)),
            )
            conn.execute("COMMIT")
            return int(cur.lastrowid or 0)

        return self._store.run("stage", op)

    def staged(self) -> list[StagedRow]:
        """Every staged cycle, oldest first. A row that fails its checksum is deleted and its samples
        go into the loss ledger as ``corrupt_row`` (it was never sent, so nothing else has it)."""

        def op(conn: sqlite3.Connection) -> list[StagedRow]:
            rows = conn.execute(
                "SELECT id, payload, checksum, first_ts_ms, last_ts_ms, sample_count, byte_size, created_ms,"
                " meta_checksum FROM staging ORDER BY id"
            ).fetchall()
            good: list[StagedRow] = []
            bad: list[tuple[int, int, int, int]] = []
            for rid, payload, checksum, first, last, count, size, created, meta in rows:
                ok = (
                    isinstance(payload, bytes)
                    and len(payload) == size
                    and zlib.crc32(payload) == checksum
                    and all(type(v) is int for v in (first, last, count, created))
                    and meta == meta_checksum(first, last, count, size, created)
                )
                if ok:
                    good.append(StagedRow(rid, payload, first, last, count))
                else:
                    bad.append((rid, *(v if type(v) is int else 0 for v in (first, last, count))))
            if bad:
                now = self._store.clock_ms()
                conn.execute("BEGIN IMMEDIATE")
                for rid, first, last, count in bad:
                    log.error(
                        "staged cycle %d of spool %s is corrupt: its %d samples are lost",
                        rid,
                        self._store.path,
                        count,
                    )
                    conn.execute("DELETE FROM staging WHERE id = ?", (rid,))
                    loss = LossRecord(LossReason.CORRUPT_ROW, f"spool staging {rid}", first, last, count)
                    self._losses.add(conn, now, loss)
                conn.execute("COMMIT")
            return good

        return self._store.run("staged", op)

    def promote(self, staged_ids: Sequence[int], batches: Sequence[Replacement]) -> list[int]:
        """Replace staged cycles by the batches packed from them (new seqs), in one transaction."""

        def op(conn: sqlite3.Connection) -> list[int]:
            now = self._store.clock_ms()
            conn.execute("BEGIN IMMEDIATE")
            ids = list(staged_ids)
            for chunk in chunks(ids):
                conn.execute(f"DELETE FROM staging WHERE id IN ({marks(chunk)})", chunk)
            seqs = insert_batches(conn, batches, now)
            conn.execute("COMMIT")
            return seqs

        return self._store.run("promote", op)
