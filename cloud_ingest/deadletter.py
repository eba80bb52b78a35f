"""Batches that can never be written, kept with the reason so an operator can inspect and replay them."""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    received_ms INTEGER NOT NULL,
    topic TEXT NOT NULL,
    cluster TEXT,
    node TEXT,
    seq INTEGER,
    reason TEXT NOT NULL,
    payload BLOB NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    received_ms: int
    topic: str
    cluster: str | None
    node: str | None
    seq: int | None
    reason: str
    payload_bytes: int


class DeadLetterStore:
    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def put(
        self,
        topic: str,
        payload: bytes,
        reason: str,
        *,
        cluster: str | None,
        node: str | None,
        seq: int | None,
    ) -> int:
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO dead_letters (received_ms, topic, cluster, node, seq, reason, payload)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (int(time.time() * 1000), topic, cluster, node, seq, reason, payload),
            )
            return int(cur.lastrowid or 0)

    def list(self, limit: int = 100) -> list[DeadLetter]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, received_ms, topic, cluster, node, seq, reason, length(payload)"
                " FROM dead_letters ORDER BY id LIMIT ?",
                (limit,),
            ).fetchall()
        return [DeadLetter(*row) for row in rows]

    def payload(self, letter_id: int) -> tuple[str, bytes] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT topic, payload FROM dead_letters WHERE id = ?", (letter_id,)
            ).fetchone()
        return None if row is None else (row[0], bytes(row[1]))

    def delete(self, letter_id: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM dead_letters WHERE id = ?", (letter_id,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
