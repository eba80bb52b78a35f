"""Integers the relay keeps across restarts (e.g. today's quota use), beside the spool's own counters.

Keys are stored with an ``x:`` prefix, so they can never collide with the spool's ``last_seq``.
"""

from __future__ import annotations

import logging
import sqlite3

from edge_relay.store.spool.errors import SpoolFullError
from edge_relay.store.spool.store import Store

log = logging.getLogger("edge_relay.spool")


class MetaTable:
    def __init__(self, store: Store) -> None:
        self._store = store

    def get(self, key: str, default: int) -> int:
        def op(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (f"x:{key}",)).fetchone()
            return int(row[0]) if row is not None and type(row[0]) is int else default

        return self._store.run("get_meta", op)

    def set(self, values: dict[str, int]) -> None:
        """Store integers for ``get``; best effort on a full spool (logged, not raised)."""

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [(f"x:{k}", int(v)) for k, v in values.items()],
            )
            conn.execute("COMMIT")

        try:
            self._store.run("set_meta", op)
        except SpoolFullError as exc:
            log.warning("%s; %s not saved", exc, ", ".join(values))
