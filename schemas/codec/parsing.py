"""Strict parsing of the maps in msgpack and JSON messages, and msgpack's errors as refusals.

A map with a key twice is refused (``object_pairs_hook=strict_map``): two readers of one message
must never see different values.  msgpack reports hostile input with several exception types and
messages; :func:`refuse_msgpack_error` turns them into the codec's reasons.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from schemas.codec.errors import refuse


class DuplicateKey(ValueError):
    pass


def strict_map(pairs: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"duplicate map key {key!r}")
        out[key] = value
    return out


def refuse_msgpack_error(exc: Exception, where: str) -> NoReturn:
    if isinstance(exc, DuplicateKey):
        refuse("malformed", f"{where}: {exc}")
    text = str(exc)
    if " exceeds max_" in text:
        refuse("limit_exceeded", f"{where}: {text}")
    refuse("malformed", f"{where}: invalid msgpack ({type(exc).__name__}: {text[:120]})")
