"""The envelope header (:class:`Header`) and the checks of the scalar fields every message carries.

A batch's header, a state message, an ack, a status and a command all name a cluster and a node, and
most carry seqs and timestamps: one check per field, here, so that every message refuses a bad one
with the same reason.  JSON and msgpack hand over untyped values, so each check takes ``object``.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.codec.errors import refuse
from schemas.codec.limits import INT64_MAX, timestamp_in_range
from schemas.topics import validate_name


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    cluster: str
    node: str
    seq: int
    first_ts_ms: int
    last_ts_ms: int
    sample_count: int
    codec: str
    incarnation: int = 0  # the optional header key "inc"; 0 when absent


def is_int(value: object) -> bool:
    # bool is an int subclass; msgpack/JSON booleans must never pass as numbers.
    return type(value) is int


def check_name(what: str, value: object) -> str:
    """A cluster or node name (``what`` says which), as a topic level may hold it."""
    if type(value) is not str:
        refuse("malformed", f"{what} must be a string, not {type(value).__name__}")
    try:
        return validate_name(what, value)
    except ValueError as exc:
        refuse("bad_header", str(exc))


def check_header_names(cluster: object, node: object) -> None:
    check_name("cluster", cluster)
    check_name("node", node)


def check_seq(seq: object) -> int:
    if not is_int(seq):
        refuse("malformed", f"seq must be an integer, not {type(seq).__name__}")
    assert isinstance(seq, int)
    if not 1 <= seq <= INT64_MAX:
        refuse("bad_header", f"seq {seq} is outside 1..2^63-1")
    return seq


def check_timestamp(ts: object, what: str) -> int:
    if not is_int(ts):
        refuse("malformed", f"{what} must be an integer, not {type(ts).__name__}")
    assert isinstance(ts, int)
    if not timestamp_in_range(ts):
        refuse("bad_timestamp", f"{what} {ts} is outside 0..2^63-1")
    return ts
