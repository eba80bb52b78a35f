"""Control messages: acks (cloud -> edge) and status (edge -> cloud), compact versioned JSON.

They share only the checks and errors (``errors``, ``header``, ``limits``) with the batch path, and
version on their own (``v`` field), independently of the envelope's format version.  ``command``'s
messages are compact versioned JSON too: they use this module's JSON helpers and checks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple, NoReturn

from schemas.codec.errors import EncodeError, Invalid, refuse, run_decoder
from schemas.codec.header import check_header_names, check_name, check_seq, check_timestamp, is_int
from schemas.codec.limits import DEFAULT_LIMITS, INT64_MAX, Limits
from schemas.codec.parsing import strict_map

ACK_VERSION: Final = 1
STATUS_VERSION: Final = 1

AckResultKind = Literal["ok", "rejected", "partial", "need_state"]
MAX_REASON_CHARS: Final = 256


class AckResult(NamedTuple):
    """One batch's outcome. ``ok``: every sample written; ``rejected``: none (``reason`` says why);
    ``partial``: ``written`` samples are in the receiver and ``refused`` were refused (``reason``) and
    dead-lettered in the cloud; ``need_state``: nothing written, the (v3 delta) frame's base state is not
    held here: re-publish the seq self-contained. The counts are only carried by ``partial`` (0
    otherwise); ``need_state`` carries no reason (``None`` or ``""``, decoded as ``None``). ``need_state``
    is only sent for v3 frames: relays older than v3 refuse an ack with a key they do not know."""

    seq: int
    result: AckResultKind
    reason: str | None = None
    written: int = 0
    refused: int = 0


@dataclass(frozen=True, slots=True)
class Ack:
    node: str
    results: list[AckResult]
    v: int = ACK_VERSION
    incarnation: int = 0  # the spool incarnation the results are for ("inc"); 0: not given


def json_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"JSON constant {name} is not allowed")


def json_loads(data: bytes, max_bytes: int, what: str) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        refuse("malformed", f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        refuse("oversized", f"{what} of {len(data)} bytes > {max_bytes}")
    try:
        text = data.decode("utf-8")
        obj = json.loads(text, object_pairs_hook=strict_map, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        refuse("malformed", f"{what} is not valid JSON: {str(exc)[:120]}")
    if type(obj) is not dict:
        refuse("malformed", f"{what} is not a JSON object")
    return obj


def check_version(obj: dict[str, Any], expected: int, what: str) -> None:
    if "v" not in obj or not is_int(obj["v"]):
        refuse("malformed", f"{what} lacks an integer v")
    if obj["v"] != expected:
        refuse("unknown_version", f"{what} version {obj['v']}")


def check_reason(reason: object) -> str:
    if type(reason) is not str or not reason or len(reason) > MAX_REASON_CHARS:
        refuse("malformed", f"a reject reason must be a string of 1..{MAX_REASON_CHARS} chars")
    return reason


def _ack_wire(node: str, results: Iterable[AckResult], limits: Limits) -> dict[str, Any]:
    check_name("node", node)
    by_seq: dict[int, AckResult] = {}
    for item in results:
        seq, result, reason, written, refused = item
        check_seq(seq)
        if result == "ok":
            if reason is not None:
                refuse("malformed", f"seq {seq}: an ok result carries no reason")
        elif result == "rejected":
            check_reason(reason)
        elif result == "partial":
            check_reason(reason)
            _check_counts(seq, written, refused)
        elif result == "need_state":
            if reason not in (None, ""):
                refuse("malformed", f"seq {seq}: a need_state result carries no reason")
            reason = None
        else:
            refuse(
                "malformed", f"seq {seq}: result {result!r} is neither ok, rejected, partial nor need_state"
            )
        if result != "partial" and (written or refused):
            refuse("malformed", f"seq {seq}: only a partial result carries counts")
        norm = AckResult(seq, result, reason, written, refused)
        if by_seq.setdefault(seq, norm) != norm:
            refuse("malformed", f"seq {seq} has two different results")
    if len(by_seq) > limits.max_ack_results:
        refuse("oversized", f"{len(by_seq)} ack results > {limits.max_ack_results}")
    ok: list[int | list[int]] = []
    rejected: list[list[int | str]] = []
    partial: list[list[int | str]] = []
    need_state: list[int] = []
    # Runs of consecutive acked seqs become [first, last] ranges: a drained backlog acks in one line.
    run_start = run_end = -1
    for seq in sorted(by_seq):
        res = by_seq[seq]
        if res.result == "rejected":
            assert res.reason is not None
            rejected.append([seq, res.reason])
            continue
        if res.result == "partial":
            assert res.reason is not None
            partial.append([seq, res.written, res.refused, res.reason])
            continue
        if res.result == "need_state":
            need_state.append(seq)
            continue
        if seq == run_end + 1:
            run_end = seq
            continue
        if run_start >= 0:
            ok.append(run_start if run_start == run_end else [run_start, run_end])
        run_start = run_end = seq
    if run_start >= 0:
        ok.append(run_start if run_start == run_end else [run_start, run_end])
    wire: dict[str, Any] = {"v": ACK_VERSION, "node": node}
    if ok:
        wire["ok"] = ok
    if rejected:
        wire["rejected"] = rejected
    if partial:
        wire["partial"] = partial
    if need_state:
        wire["need_state"] = need_state
    return wire


def _check_counts(seq: int, written: object, refused: object) -> None:
    for name, count in (("written", written), ("refused", refused)):
        if type(count) is not int or not 0 < count <= INT64_MAX:
            refuse("malformed", f"seq {seq}: a partial result's {name} count must be in 1..2^63-1")


def encode_ack(
    node: str, results: Iterable[AckResult], limits: Limits = DEFAULT_LIMITS, *, incarnation: int = 0
) -> bytes:
    """``{"v":1,"node":..,"ok":[seq | [first,last], ..],"rejected":[[seq,reason], ..],
    "partial":[[seq,written,refused,reason], ..],"need_state":[seq, ..]}``, and ``"inc"`` when
    ``incarnation`` is given (only for batches whose header carried one: older relays refuse an ack
    with keys they do not know; for the same reason the ingester sends ``partial`` results only to
    relays that send ``inc``, and ``need_state`` only to relays that sent a v3 frame)."""
    try:
        wire = _ack_wire(node, results, limits)
        if incarnation:
            _check_incarnation(incarnation)
            wire["inc"] = incarnation
        out = json_dumps(wire)
    except Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    except (TypeError, ValueError) as exc:
        raise EncodeError("malformed", str(exc)) from None
    if len(out) > limits.max_ack_bytes:
        raise EncodeError("oversized", f"ack of {len(out)} bytes; split it")
    return out


_ACK_KEYS: Final = frozenset({"v", "node", "ok", "rejected", "partial", "need_state", "inc"})


def _decode_ack(data: bytes, limits: Limits) -> Ack:
    obj = json_loads(data, limits.max_ack_bytes, "ack")
    check_version(obj, ACK_VERSION, "ack")
    if not obj.keys() <= _ACK_KEYS or "node" not in obj:
        refuse(
            "malformed",
            f"ack keys {sorted(obj)}: need v, node and optional ok, rejected, partial, need_state, inc",
        )
    incarnation = _check_incarnation(obj["inc"]) if "inc" in obj else 0
    node = obj["node"]
    check_name("node", node)
    ok, rejected, partial = obj.get("ok", []), obj.get("rejected", []), obj.get("partial", [])
    need_state = obj.get("need_state", [])
    if (
        type(ok) is not list
        or type(rejected) is not list
        or type(partial) is not list
        or type(need_state) is not list
    ):
        refuse("malformed", "ok, rejected, partial and need_state must be arrays")
    results: dict[int, AckResult] = {}
    budget = limits.max_ack_results

    def add(item: AckResult) -> None:
        if item.seq in results:
            refuse("malformed", f"seq {item.seq} acked twice")
        if len(results) >= budget:
            refuse("oversized", f"more than {budget} ack results")
        results[item.seq] = item

    for entry in ok:
        if is_int(entry):
            add(AckResult(check_seq(entry), "ok"))
            continue
        if type(entry) is not list or len(entry) != 2:
            refuse("malformed", "an ok entry is a seq or a [first, last] range")
        first, last = check_seq(entry[0]), check_seq(entry[1])
        if first > last:
            refuse("malformed", f"range [{first}, {last}] is reversed")
        # Check the size before expanding so a huge range costs nothing.
        if last - first + 1 > budget - len(results):
            refuse("oversized", f"more than {budget} ack results")
        for seq in range(first, last + 1):
            add(AckResult(seq, "ok"))
    for entry in rejected:
        if type(entry) is not list or len(entry) != 2:
            refuse("malformed", "a rejected entry is [seq, reason]")
        add(AckResult(check_seq(entry[0]), "rejected", check_reason(entry[1])))
    for entry in partial:
        if type(entry) is not list or len(entry) != 4:
            refuse("malformed", "a partial entry is [seq, written, refused, reason]")
        seq = check_seq(entry[0])
        _check_counts(seq, entry[1], entry[2])
        add(AckResult(seq, "partial", check_reason(entry[3]), entry[1], entry[2]))
    for entry in need_state:
        if not is_int(entry):
            refuse("malformed", "a need_state entry is a seq")
        add(AckResult(check_seq(entry), "need_state"))
    return Ack(node, [results[seq] for seq in sorted(results)], incarnation=incarnation)


def _check_incarnation(value: object) -> int:
    if type(value) is not int or not 0 < value <= INT64_MAX:
        refuse("malformed", f"inc must be an integer in 1..2^63-1, not {str(value)[:32]!r}")
    return value


def decode_ack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Ack:
    """Decode an ack; results come back sorted by seq, each seq once."""
    ack: Ack = run_decoder(lambda: _decode_ack(data, limits))
    return ack


StatusState = Literal["online", "offline"]
STATUS_STATES: Final = frozenset({"online", "offline"})
_STATUS_REQUIRED: Final = ("v", "node", "cluster", "state", "ts_ms")
# Optional fields with a defined meaning; each is a non-negative number or null ("none", "unknown").
STATUS_NUMERIC_FIELDS: Final = frozenset(
    {
        "spool_rows",
        "spool_bytes",
        "spool_samples",
        "oldest_unsent_ms",
        "evicted_rows",
        "quarantined_rows",
        "inflight",
        "series",
        "budget_bytes_per_s",
        "wire_bytes_per_s",
        "degrade_level",
        "uptime_s",
    }
)
_STATUS_KEY_RE: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")
_STATUS_MAX_KEYS: Final = 64
_STATUS_MAX_STR: Final = 256


def _check_status(status: object) -> dict[str, Any]:
    if type(status) is not dict:
        refuse("malformed", "status must be an object")
    missing = [key for key in _STATUS_REQUIRED if key not in status]
    if missing:
        refuse("malformed", f"status lacks {', '.join(missing)}")
    check_version(status, STATUS_VERSION, "status")
    check_header_names(status["cluster"], status["node"])
    if type(status["state"]) is not str or status["state"] not in STATUS_STATES:
        refuse("malformed", f"state must be one of {sorted(STATUS_STATES)}")
    check_timestamp(status["ts_ms"], "ts_ms")
    if len(status) > _STATUS_MAX_KEYS:
        refuse("malformed", f"more than {_STATUS_MAX_KEYS} status fields")
    for key, value in status.items():
        if key in _STATUS_REQUIRED:
            continue
        if type(key) is not str or not _STATUS_KEY_RE.fullmatch(key):
            refuse("malformed", f"status key {key!r} must match [a-z][a-z0-9_]{{0,63}}")
        # Numbers must fit an int64 / finite float64 so any JSON consumer reads them exactly.
        numeric = (type(value) is float and math.isfinite(value)) or (
            is_int(value) and -INT64_MAX - 1 <= value <= INT64_MAX
        )
        if key in STATUS_NUMERIC_FIELDS:
            if value is not None and (not numeric or value < 0):
                refuse("malformed", f"status field {key} must be a non-negative number")
        elif not (value is None or type(value) is bool or type(value) is str or numeric):
            # Flat scalars only: status is a dashboard line, not a document.
            refuse("malformed", f"status field {key} must be a finite number, string, bool or null")
        elif type(value) is str and len(value) > _STATUS_MAX_STR:
            refuse("malformed", f"status field {key} is longer than {_STATUS_MAX_STR} chars")
    return status


def encode_status(status: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Encode a status dict (``v`` defaults to the current version); keys in a fixed order."""
    full = {"v": STATUS_VERSION, **status}
    try:
        _check_status(full)
        ordered = {key: full[key] for key in _STATUS_REQUIRED}
        ordered.update(sorted((k, v) for k, v in full.items() if k not in ordered))
        out = json_dumps(ordered)
    except Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    except (TypeError, ValueError) as exc:
        raise EncodeError("malformed", str(exc)) from None
    if len(out) > limits.max_status_bytes:
        raise EncodeError("oversized", f"status of {len(out)} bytes > {limits.max_status_bytes}")
    return out


def decode_status(data: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    status: dict[str, Any] = run_decoder(
        lambda: _check_status(json_loads(data, limits.max_status_bytes, "status"))
    )
    return status
