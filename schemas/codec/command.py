"""Command messages: a backfill request (cloud -> edge, on ``.../<node>/cmd``) and its result (edge ->
cloud, on ``.../<node>/cmd_result``), compact versioned JSON like ``control``'s acks and status.

Both sides treat the other's message as hostile: a size cap before parsing, known keys only, types and
ranges checked, and every refusal a ``DecodeError`` whose ``reason`` is one of ``errors.REASONS``
(``malformed``, ``oversized``, ``unknown_version``, ``bad_header``, ``bad_timestamp``). The request's
range is checked against the decoder's clock: ``from_ms < to_ms``, at most ``MAX_RANGE_MS`` long, not
ending more than ``MAX_FUTURE_MS`` ahead. The selector is only capped in length here; its grammar is
``relay_common.selector``'s, which refuses a bad one with a reason in the result.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from schemas.codec.control import MAX_REASON_CHARS, check_reason, check_version, json_dumps, json_loads
from schemas.codec.errors import EncodeError, Invalid, refuse, run_decoder
from schemas.codec.header import check_name, check_timestamp, is_int

COMMAND_VERSION: Final = 1
MAX_REQUEST_BYTES: Final = 4096
MAX_RESULT_BYTES: Final = 16384
MAX_SELECTOR_CHARS: Final = 1024
MAX_RANGE_MS: Final = 24 * 3600 * 1000  # a day: the recorder holds 6 h by default
MAX_FUTURE_MS: Final = 60_000  # clock skew between ingester and node
MAX_MISSING: Final = 64  # gap entries in a result; more are merged into the last one
REQUEST_ID_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
COMMAND_KINDS: Final = frozenset({"backfill"})

CommandOutcome = Literal["done", "refused", "failed"]
OUTCOMES: Final = frozenset({"done", "refused", "failed"})
# Why part of a range was not supplied: the recorder's ``Gap`` reasons, plus the relay's own limits.
MISSING_REASONS: Final = frozenset(
    {"older_than_recorder", "not_recorded", "newer_than_recorder", "disabled", "sample_cap", "spool_full"}
)

_REQUEST_KEYS: Final = frozenset({"v", "id", "kind", "cluster", "node", "from_ms", "to_ms", "match", "ts_ms"})
_REQUEST_REQUIRED: Final = _REQUEST_KEYS - {"match"}
_RESULT_KEYS: Final = frozenset(
    {
        "v",
        "id",
        "cluster",
        "node",
        "result",
        "reason",
        "from_ms",
        "to_ms",
        "samples",
        "series",
        "batches",
        "first_ms",
        "last_ms",
        "missing",
        "ts_ms",
    }
)
_RESULT_REQUIRED: Final = frozenset({"v", "id", "cluster", "node", "result", "ts_ms"})
_COUNTS: Final = ("samples", "series", "batches")


@dataclass(frozen=True, slots=True)
class BackfillRequest:
    """Send the raw samples of [from_ms, to_ms] (of the series ``match`` selects; None: all) again."""

    id: str
    cluster: str
    node: str
    from_ms: int
    to_ms: int
    ts_ms: int  # when the ingester issued it
    match: str | None = None
    kind: str = "backfill"


@dataclass(frozen=True, slots=True)
class MissingRange:
    start_ms: int
    end_ms: int
    reason: str


@dataclass(frozen=True, slots=True)
class CommandResult:
    """The relay's answer. ``done``: ``samples`` raw samples of ``series`` series in ``batches`` batches
    are in its spool (shipped, paced and acked like any backlog), ``missing`` says what was not;
    ``refused``/``failed``: nothing was supplied, ``reason`` says why. ``id`` is None only when the
    request was too broken to carry one."""

    id: str | None
    cluster: str
    node: str
    result: CommandOutcome
    ts_ms: int
    reason: str | None = None
    from_ms: int = 0
    to_ms: int = 0
    samples: int = 0
    series: int = 0
    batches: int = 0
    first_ms: int | None = None
    last_ms: int | None = None
    missing: tuple[MissingRange, ...] = field(default_factory=tuple)


def now_ms() -> int:
    return int(time.time() * 1000)


def _check_id(value: object) -> str:
    if type(value) is not str or not REQUEST_ID_RE.fullmatch(value):
        refuse("malformed", "id must be 1..64 characters of [A-Za-z0-9._-]")
    return value


def _check_request(obj: dict[str, Any], clock_ms: int) -> BackfillRequest:
    check_version(obj, COMMAND_VERSION, "command")
    unknown = obj.keys() - _REQUEST_KEYS
    if unknown:
        refuse("malformed", f"unknown command keys {sorted(unknown)}")
    missing = _REQUEST_REQUIRED - obj.keys()
    if missing:
        refuse("malformed", f"command lacks {', '.join(sorted(missing))}")
    req_id = _check_id(obj["id"])
    if type(obj["kind"]) is not str or obj["kind"] not in COMMAND_KINDS:
        refuse("malformed", f"kind must be one of {sorted(COMMAND_KINDS)}")
    cluster, node = check_name("cluster", obj["cluster"]), check_name("node", obj["node"])
    start, end = check_timestamp(obj["from_ms"], "from_ms"), check_timestamp(obj["to_ms"], "to_ms")
    issued = check_timestamp(obj["ts_ms"], "ts_ms")
    if start >= end:
        refuse("bad_timestamp", f"from_ms {start} must be before to_ms {end}")
    if end - start > MAX_RANGE_MS:
        refuse(
            "bad_timestamp", f"a range of {(end - start) / 1000:.0f}s is longer than {MAX_RANGE_MS // 1000}s"
        )
    if end > clock_ms + MAX_FUTURE_MS or issued > clock_ms + MAX_FUTURE_MS:
        refuse("bad_timestamp", "the range (or ts_ms) is in the future of this node's clock")
    match = obj.get("match")
    if match is not None and (type(match) is not str or not match or len(match) > MAX_SELECTOR_CHARS):
        refuse(
            "oversized" if type(match) is str and match else "malformed",
            "match must be a selector of 1..1024 chars",
        )
    return BackfillRequest(req_id, cluster, node, start, end, issued, match)


def encode_request(req: BackfillRequest, *, clock_ms: int | None = None) -> bytes:
    """``{"v":1,"id":..,"kind":"backfill","cluster":..,"node":..,"from_ms":..,"to_ms":..,"ts_ms":..}``
    plus ``"match"`` when given; checked as the relay will check it."""
    wire: dict[str, Any] = {
        "v": COMMAND_VERSION,
        "id": req.id,
        "kind": req.kind,
        "cluster": req.cluster,
        "node": req.node,
        "from_ms": req.from_ms,
        "to_ms": req.to_ms,
        "ts_ms": req.ts_ms,
    }
    if req.match is not None:
        wire["match"] = req.match
    try:
        _check_request(wire, now_ms() if clock_ms is None else clock_ms)
        out = json_dumps(wire)
    except Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    if len(out) > MAX_REQUEST_BYTES:
        raise EncodeError("oversized", f"command of {len(out)} bytes > {MAX_REQUEST_BYTES}")
    return out


def decode_request(data: bytes, *, clock_ms: int | None = None) -> BackfillRequest:
    """Decode a command; ``clock_ms`` (default: now) is what "in the future" is measured against."""
    clock = now_ms() if clock_ms is None else clock_ms
    req: BackfillRequest = run_decoder(
        lambda: _check_request(json_loads(data, MAX_REQUEST_BYTES, "command"), clock)
    )
    return req


def peek_request_id(data: bytes) -> str | None:
    """The id of a command the decoder refused, when it has a readable one (to echo in the refusal)."""
    if not isinstance(data, bytes | bytearray) or len(data) > MAX_REQUEST_BYTES:
        return None
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    value = obj.get("id") if type(obj) is dict else None
    return value if type(value) is str and REQUEST_ID_RE.fullmatch(value) else None


def _check_count(name: str, value: object) -> int:
    if not is_int(value) or not 0 <= value < 2**53:  # type: ignore[operator]
        refuse("malformed", f"{name} must be an integer in 0..2^53-1")
    assert isinstance(value, int)
    return value


def _check_result(obj: dict[str, Any]) -> CommandResult:
    check_version(obj, COMMAND_VERSION, "command result")
    unknown = obj.keys() - _RESULT_KEYS
    if unknown:
        refuse("malformed", f"unknown command result keys {sorted(unknown)}")
    missing = _RESULT_REQUIRED - obj.keys()
    if missing:
        refuse("malformed", f"command result lacks {', '.join(sorted(missing))}")
    req_id = None if obj["id"] is None else _check_id(obj["id"])
    cluster, node = check_name("cluster", obj["cluster"]), check_name("node", obj["node"])
    outcome = obj["result"]
    if type(outcome) is not str or outcome not in OUTCOMES:
        refuse("malformed", f"result must be one of {sorted(OUTCOMES)}")
    reason = obj.get("reason")
    if outcome == "done":
        if reason is not None:
            refuse("malformed", "a done result carries no reason")
    else:
        check_reason(reason)
    ts = check_timestamp(obj["ts_ms"], "ts_ms")
    start = check_timestamp(obj.get("from_ms", 0), "from_ms")
    end = check_timestamp(obj.get("to_ms", 0), "to_ms")
    samples, series, batches = (_check_count(name, obj.get(name, 0)) for name in _COUNTS)
    first = None if obj.get("first_ms") is None else check_timestamp(obj["first_ms"], "first_ms")
    last = None if obj.get("last_ms") is None else check_timestamp(obj["last_ms"], "last_ms")
    gaps = obj.get("missing", [])
    if type(gaps) is not list or len(gaps) > MAX_MISSING:
        refuse("malformed", f"missing must be an array of at most {MAX_MISSING} entries")
    ranges: list[MissingRange] = []
    for entry in gaps:
        if type(entry) is not list or len(entry) != 3:
            refuse("malformed", "a missing entry is [start_ms, end_ms, reason]")
        lo, hi = check_timestamp(entry[0], "missing start"), check_timestamp(entry[1], "missing end")
        if lo > hi or type(entry[2]) is not str or entry[2] not in MISSING_REASONS:
            refuse("malformed", f"missing entry {entry!r:.80}: start after end, or an unknown reason")
        ranges.append(MissingRange(lo, hi, entry[2]))
    return CommandResult(
        req_id,
        cluster,
        node,
        outcome,
        ts,
        reason,
        start,
        end,
        samples,
        series,
        batches,
        first,
        last,
        tuple(ranges),
    )


def encode_result(res: CommandResult) -> bytes:
    missing = list(res.missing)
    if len(missing) > MAX_MISSING:
        # Many small gaps (a flapping node): the tail is summed up as one range of the last reason.
        tail = missing[MAX_MISSING - 1 :]
        missing = [
            *missing[: MAX_MISSING - 1],
            MissingRange(tail[0].start_ms, tail[-1].end_ms, tail[-1].reason),
        ]
    wire: dict[str, Any] = {
        "v": COMMAND_VERSION,
        "id": res.id,
        "cluster": res.cluster,
        "node": res.node,
        "result": res.result,
        "ts_ms": res.ts_ms,
    }
    if res.reason is not None:
        wire["reason"] = res.reason[:MAX_REASON_CHARS]
    if res.from_ms or res.to_ms:
        wire["from_ms"], wire["to_ms"] = res.from_ms, res.to_ms
    for name in _COUNTS:
        if getattr(res, name):
            wire[name] = getattr(res, name)
    if res.first_ms is not None:
        wire["first_ms"] = res.first_ms
    if res.last_ms is not None:
        wire["last_ms"] = res.last_ms
    if missing:
        wire["missing"] = [[m.start_ms, m.end_ms, m.reason] for m in missing]
    try:
        _check_result(wire)
        out = json_dumps(wire)
    except Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    if len(out) > MAX_RESULT_BYTES:
        raise EncodeError("oversized", f"command result of {len(out)} bytes > {MAX_RESULT_BYTES}")
    return out


def decode_result(data: bytes) -> CommandResult:
    res: CommandResult = run_decoder(
        lambda: _check_result(json_loads(data, MAX_RESULT_BYTES, "command result"))
    )
    return res
