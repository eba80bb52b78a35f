"""Batches that can never be written, kept with the reason so an operator can inspect and replay them.

Batches the receiver rejected, and batches the ingester refused only for samples stamped too far in the
future (a fast clock), are valid data and are all kept (they can be replayed once the cause is fixed or
their time has come). Payloads the ingester itself refused for anything else (undecodable or invalid:
they would be refused again) are kept only for the first ``REFUSED_KEPT_PER_NODE_REASON`` of each node
and reason, enough to diagnose; the rest are counted (``cloud_ingest_dead_letters_total``) but not
stored, so a node that floods garbage cannot fill the store's volume.

The store is capped in bytes (``dead_letter.max_bytes``: pages in use, so rows that a replay deleted,
even from another process, make room again). A letter that does not fit raises ``DeadLetterFull`` and
is not stored: the ingester then does not ack the batch (the edge keeps it and publishes it again)
and counts the overflow, which alerts; a full disk counts as a full store.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REFUSED_KEPT_PER_NODE_REASON = 20
# Per-row bookkeeping besides the payload (columns, record header, index entry), for the cap.
_ROW_OVERHEAD_BYTES = 512
_SQLITE_FULL = 13

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


class DeadLetterFull(Exception):
    """The store is at ``max_bytes`` (or its disk is full): the letter was not stored."""


class DeadLetterStore:
    """``max_bytes``: cap of the pages in use (0 = only the disk limits it)."""

    def __init__(self, path: str | Path, *, max_bytes: int = 0) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
        self.path = str(path)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._refused_kept: dict[tuple[str | None, str], int] = {}
        self.max_bytes = max_bytes

    def keep_refused(self, node: str | None, reason: str) -> bool:
        """Whether a refused payload of this node and reason (a slug) should still be stored."""
        key = (node, reason)
        with self._lock:
            kept = self._refused_kept.get(key)
            if kept is None:
                (kept,) = self._db.execute(
                    "SELECT count(*) FROM dead_letters WHERE node IS ? AND (reason = ? OR reason LIKE ?)",
                    (node, reason, f"{reason}:%"),
                ).fetchone()
            if kept >= REFUSED_KEPT_PER_NODE_REASON:
                self._refused_kept[key] = kept
                return False
            self._refused_kept[key] = kept + 1
            return True

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
        """Store one letter; its id. Raises ``DeadLetterFull`` when it does not fit."""
        size = len(payload) + len(reason) + len(topic) + _ROW_OVERHEAD_BYTES
        with self._lock:
            if self.max_bytes and self._used_bytes_locked() + size > self.max_bytes:
                raise DeadLetterFull(
                    f"dead-letter store {self.path} holds {self._used_bytes_locked()} of "
                    f"{self.max_bytes} bytes; a letter of {size} bytes does not fit"
                )
            try:
                cur = self._db.execute(
                    "INSERT INTO dead_letters (received_ms, topic, cluster, node, seq, reason, payload)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (int(time.time() * 1000), topic, cluster, node, seq, reason, payload),
                )
            except sqlite3.OperationalError as e:
                if getattr(e, "sqlite_errorcode", None) != _SQLITE_FULL:
                    raise
                raise DeadLetterFull(f"dead-letter store {self.path}: the disk is full ({e})") from e
            return int(cur.lastrowid or 0)

    def used_bytes(self) -> int:
        """Bytes of the pages in use (the file minus its free pages)."""
        with self._lock:
            return self._used_bytes_locked()

    def _used_bytes_locked(self) -> int:
        (pages,) = self._db.execute("PRAGMA page_count").fetchone()
        (free,) = self._db.execute("PRAGMA freelist_count").fetchone()
        (page_size,) = self._db.execute("PRAGMA page_size").fetchone()
        return int(pages - free) * int(page_size)

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
