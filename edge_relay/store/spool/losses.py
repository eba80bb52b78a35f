"""The loss ledger's table: where ``edge_relay.ledger`` keeps every sample given up, for good.

Entries of one reason and series within an hour are added up into one row, so a target that exposes
duplicates every 5 s makes one row an hour, not 720. ``add`` runs inside another table's transaction
(an eviction and its ledger entry commit together, or neither does).
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass

from edge_relay.ledger import LossRecord
from edge_relay.store.spool.errors import SpoolError
from edge_relay.store.spool.schema import add_loss
from edge_relay.store.spool.store import Store

log = logging.getLogger("edge_relay.spool")


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


class LossTable:
    def __init__(self, store: Store) -> None:
        self._store = store

    def add(self, conn: sqlite3.Connection, now: int, entry: LossRecord) -> None:
        """Add ``entry`` inside the caller's transaction."""
        add_loss(conn, now, entry)

    def record(self, entry: LossRecord) -> bool:
        """Write one entry in its own transaction; False (logged) when the spool cannot take it now."""

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            self.add(conn, self._store.clock_ms(), entry)
            conn.execute("COMMIT")

        try:
            self._store.run("record_loss", op)
        except SpoolError as e:
            log.error("loss ledger: %s", e)
            return False
        return True

    def entries(self, limit: int = 100) -> list[LossEntry]:
        """The newest ledger entries, newest first."""

        def op(conn: sqlite3.Connection) -> list[LossEntry]:
            rows = conn.execute(
                "SELECT id, ts_ms, reason, series, first_ts_ms, last_ts_ms, samples FROM ledger"
                " ORDER BY id DESC LIMIT ?",
                (limit,),
            ).fetchall()
            return [LossEntry(*r) for r in rows]

        return self._store.run("losses", op)

    def totals(self) -> dict[str, int]:
        """Samples in the ledger by reason, over the spool's whole life."""

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            rows = conn.execute("SELECT reason, sum(samples) FROM ledger GROUP BY reason").fetchall()
            return {reason: int(total) for reason, total in rows}

        return self._store.run("loss_totals", op)
