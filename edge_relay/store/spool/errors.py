"""The spool's errors, and how SQLite's error codes map onto them."""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Final

_SQLITE_CORRUPT: Final = 11
_SQLITE_FULL: Final = 13
_SQLITE_NOTADB: Final = 26


class SpoolError(Exception):
    """The spool cannot do what was asked (other than being full)."""


class SpoolFullError(SpoolError):
    """SQLite reported SQLITE_FULL: the ``max_bytes`` cap or the disk is full. Nothing was written."""


class SpoolClosedError(SpoolError):
    """The spool was closed."""


class CorruptFile(Exception):
    """The file opened but failed ``PRAGMA quick_check``."""


def _primary_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def is_full(exc: sqlite3.Error) -> bool:
    return _primary_code(exc) == _SQLITE_FULL or "database or disk is full" in str(exc)


def is_corrupt(exc: sqlite3.Error) -> bool:
    code = _primary_code(exc)
    if code is not None:
        return code in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc)
    return "malformed" in text or "not a database" in text


def rollback_quietly(conn: sqlite3.Connection) -> None:
    # SQLite may already have rolled back (e.g. after SQLITE_FULL); a failing ROLLBACK changes nothing.
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
