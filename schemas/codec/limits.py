"""What the wire allows, checked alike by the encoders and by the decoders of ``schemas.codec``.

The bottom layer of the package (it imports no other module of it): the caps (:class:`Limits`), the
header fields a body must agree with (:class:`Header`), the error classes and their ``reason``
slugs, and the checks of label sets, names, sequence numbers and sample columns that the encoder
runs before anything is spooled and the decoders run on hostile input.  The errors are here, not in
``envelope``, because every layer raises them and ``envelope`` sits above the bodies it dispatches to.
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Callable, Container, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from schemas import columnar
from schemas.model import Batch, Labels, ScrapeBlock
from schemas.topics import validate_name

INT64_MAX: Final = 2**63 - 1


# Stable slugs for DecodeError.reason / EncodeError.reason (usable as a metrics label).
REASONS: Final = frozenset(
    {
        "truncated",  # input ends before the envelope does
        "bad_magic",
        "unknown_version",
        "oversized",  # payload (or ack/status message) larger than the limit
        "limit_exceeded",  # a msgpack container/string larger than any legal one
        "malformed",  # not valid msgpack/JSON, wrong types, missing/unknown/duplicate keys
        "bad_header",  # header field with a legal type but an illegal value
        "unknown_codec",
        "bad_compression",  # not exactly one valid, dictionary-less zstd frame
        "decompression_limit",
        "header_mismatch",  # header n/t0/t1 disagree with the body
        "too_many_series",
        "too_many_samples",
        "too_many_scrapes",
        "too_many_labels",
        "too_many_label_pairs",  # label pairs summed over all series of the batch
        "label_too_long",
        "invalid_label_name",
        "invalid_metric_name",
        "missing_metric_name",
        "empty_label_value",
        "unsorted_labels",
        "duplicate_label_name",
        "duplicate_series",
        "duplicate_sample",
        "bad_index",
        "length_mismatch",
        "bad_timestamp",
        "need_state",  # v3 delta frame whose base state the decoder does not hold
    }
)


class WireError(ValueError):
    """Base of codec errors: ``reason`` is a stable slug, ``message`` is for humans."""

    def __init__(self, reason: str, message: str = "") -> None:
        self.reason = reason
        self.message = message or reason
        super().__init__(f"{reason}: {self.message}")


class DecodeError(WireError):
    """Raised by every decoder for any input it refuses."""


class EncodeError(WireError):
    """Raised by encoders for data the decoders would refuse (same reasons)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps the decoder enforces before allocating; the encoder checks the same ones."""

    max_payload_bytes: int = 1 << 20
    max_decompressed_bytes: int = 32 << 20
    max_series: int = 200_000
    max_samples: int = 2_000_000
    max_labels_per_series: int = 64
    max_label_name_bytes: int = 256
    max_label_value_bytes: int = 4096
    # Python objects cost ~20x their msgpack bytes; these two keep a hostile body that stays under
    # max_decompressed_bytes from turning into gigabytes of label strings or empty scrape blocks.
    max_label_pairs: int = 1_000_000
    max_scrapes: int = 100_000
    max_ack_bytes: int = 256 << 10
    max_ack_results: int = 100_000
    max_status_bytes: int = 16 << 10


DEFAULT_LIMITS: Final = Limits()


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


class _Invalid(Exception):
    """Internal: a validation failure, re-raised as DecodeError or EncodeError by the caller."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _fail(reason: str, message: str) -> NoReturn:
    raise _Invalid(reason, message)


def _is_int(value: object) -> bool:
    # bool is an int subclass; msgpack/JSON booleans must never pass as numbers.
    return type(value) is int


# --------------------------------------------------------------------------------------------------
# Platform-neutral column types.  The wire is little-endian; array() is native-endian.

_U32: Final = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN: Final = sys.byteorder == "big"
assert array(_U32).itemsize == 4 and array("d").itemsize == 8 and array("q").itemsize == 8


def _column_from_bytes(typecode: str, data: bytes) -> array:
    col = array(typecode)
    col.frombytes(data)
    if _BIG_ENDIAN:
        col.byteswap()
    return col


def _column_to_bytes(typecode: str, values: Sequence[Any]) -> bytes:
    col = values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)
    if _BIG_ENDIAN:
        col = array(typecode, col)
        col.byteswap()
    return col.tobytes()


# --------------------------------------------------------------------------------------------------
# Label validation, shared by encoder and decoder so the edge never spools what the cloud refuses.

_LABEL_NAME_RE: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC_NAME_RE: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class _LabelChecker:
    """Validates label sets given as parallel name/value tuples.

    The checks run as C-level set/sort/max calls per label set rather than a Python loop per label.
    Tuples of label names already checked are remembered (most series share theirs with their
    metric family), and so are metric names.
    """

    __slots__ = ("_good_metrics", "_good_names", "_limits", "_schemas")

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._good_names: set[str] = set()
        self._good_metrics: set[str] = set()
        # names tuple -> position of __name__ in it (-1: none); only tuples that passed the checks.
        self._schemas: dict[tuple[Any, ...], int] = {}

    def _check_names(self, names: tuple[Any, ...]) -> int:
        limits = self._limits
        n = len(names)
        if n > limits.max_labels_per_series:
            _fail("too_many_labels", f"{n} labels in one series")
        if not set(map(type, names)) <= _STR_TYPE:
            _fail("malformed", "label names and values must be strings")
        name_set = set(names)
        for name in name_set - self._good_names:
            if len(name) > limits.max_label_name_bytes:
                _fail("label_too_long", f"label name of {len(name)} characters")
            if not _LABEL_NAME_RE.fullmatch(name):
                _fail("invalid_label_name", f"invalid label name {name[:64]!r}")
            self._good_names.add(name)
        if len(name_set) != n:
            _fail("duplicate_label_name", "a label name appears twice in one series")
        if list(names) != sorted(names):
            _fail("unsorted_labels", f"label names not sorted: {list(names)[:8]!r}")
        return names.index("__name__") if "__name__" in name_set else -1

    def check(self, names: tuple[Any, ...], values: tuple[Any, ...]) -> None:
        try:
            metric_at = self._schemas.get(names)
        except TypeError:  # unhashable, so not all strings: _check_names says so
            metric_at = None
        if metric_at is None:
            metric_at = self._schemas[names] = self._check_names(names)
        if not set(map(type, values)) <= _STR_TYPE:
            _fail("malformed", "label names and values must be strings")
        if "" in values:
            _fail("empty_label_value", f"label {names[values.index('')]!r} has an empty value")
        max_value = self._limits.max_label_value_bytes
        # Only encode long values: len(str) <= max/4 guarantees <= max UTF-8 bytes.
        if values and max(map(len, values)) * 4 > max_value:
            for name, value in zip(names, values, strict=True):
                if len(value) * 4 > max_value and len(value.encode("utf-8", "surrogatepass")) > max_value:
                    _fail("label_too_long", f"value of label {name!r} is longer than {max_value} bytes")
        if metric_at < 0:
            _fail("missing_metric_name", "a series has no __name__ label")
        metric = values[metric_at]
        if metric not in self._good_metrics:
            if not _METRIC_NAME_RE.fullmatch(metric):
                _fail("invalid_metric_name", f"invalid metric name {metric[:64]!r}")
            self._good_metrics.add(metric)

    def check_labels(self, labels: object) -> None:
        """Check a model label set: a tuple of (name, value) tuples."""
        if type(labels) is not tuple or not set(map(type, labels)) <= _TUPLE_TYPE:
            _fail("malformed", "a label set must be a tuple of (name, value) tuples")
        if not set(map(len, labels)) <= _PAIR_LEN:
            _fail("malformed", "a label must be a (name, value) pair")
        names, values = tuple(zip(*labels, strict=True)) or ((), ())
        self.check(names, values)


_STR_TYPE: Final = frozenset({str})
_TUPLE_TYPE: Final = frozenset({tuple})
_PAIR_LEN: Final = frozenset({2})


def timestamp_in_range(ts: int) -> bool:
    """A timestamp (ms) the wire can carry: 0..2^63-1, the one rule for scrape and sample timestamps."""
    return 0 <= ts <= INT64_MAX


class SeriesChecker:
    """The codec's rules for one series and one sample, for a producer that drops what breaks them one
    by one instead of failing the whole batch (the edge's shape stage), so both sides keep one rule.

    Label names and schemas that passed are remembered, as in the batch check; the memory grows with
    the distinct label names seen, so a long-lived owner replaces the checker now and then.
    """

    __slots__ = ("_checker",)

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._checker = _LabelChecker(limits)

    def labels_error(self, labels: object) -> str | None:
        """The ``reason`` slug the codec would refuse this label set with, or None if it takes it."""
        try:
            self._checker.check_labels(labels)
        except _Invalid as exc:
            return exc.reason
        return None


def _check_timestamp(ts: object, what: str) -> int:
    if not _is_int(ts):
        _fail("malformed", f"{what} must be an integer, not {type(ts).__name__}")
    assert isinstance(ts, int)
    if not timestamp_in_range(ts):
        _fail("bad_timestamp", f"{what} {ts} is outside 0..2^63-1")
    return ts


def _check_block_columns(
    series: array, values: array, timestamps: array | None, n_labelsets: int, index: int
) -> None:
    n = len(values)
    if len(series) != n:
        _fail("length_mismatch", f"scrape {index}: {len(series)} series indices for {n} values")
    if timestamps is not None and len(timestamps) != n:
        _fail("length_mismatch", f"scrape {index}: {len(timestamps)} timestamps for {n} values")
    if not n:
        return
    if max(series) >= n_labelsets:
        _fail("bad_index", f"scrape {index}: series index {max(series)} >= {n_labelsets} label sets")
    # Indices are < n_labelsets <= max_series, so this set stays small whatever the sample count.
    if len(set(series)) != n:
        _fail("duplicate_sample", f"scrape {index}: a series appears twice in one scrape")
    if timestamps is not None and min(timestamps) < 0:
        _fail("bad_timestamp", f"scrape {index}: negative per-sample timestamp")


def _check_name(what: str, value: object) -> str:
    if type(value) is not str:
        _fail("malformed", f"{what} must be a string, not {type(value).__name__}")
    try:
        return validate_name(what, value)
    except ValueError as exc:
        _fail("bad_header", str(exc))


def _check_header_names(cluster: object, node: object) -> None:
    _check_name("cluster", cluster)
    _check_name("node", node)


def _check_seq(seq: object) -> int:
    if not _is_int(seq):
        _fail("malformed", f"seq must be an integer, not {type(seq).__name__}")
    assert isinstance(seq, int)
    if not 1 <= seq <= INT64_MAX:
        _fail("bad_header", f"seq {seq} is outside 1..2^63-1")
    return seq


def _as_array(column: Any, typecode: str, overflow_reason: str, index: int) -> array:
    if isinstance(column, array):
        return column
    try:
        return array(typecode, column)
    except OverflowError as exc:
        _fail(overflow_reason, f"scrape {index}: {exc}")
    except (TypeError, ValueError) as exc:
        _fail("malformed", f"scrape {index}: {exc}")


def validate_batch(
    batch: Batch,
    limits: Limits = DEFAULT_LIMITS,
    known: Container[Labels] = (),
    distinct: AbstractSet[Labels] | None = None,
) -> None:
    """Check a Batch against every rule the decoder enforces; raise EncodeError if it breaks one.
    Label sets in ``known`` passed the label checks before and are not checked again. ``distinct``:
    the batch's label sets as a set, when the caller built one anyway (from a dict, whose stored
    hashes the set reuses): the checks then hash no label set again."""
    try:
        _validate_batch(batch, limits, known, distinct)
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None


def _validate_batch(
    batch: Batch, limits: Limits, known: Container[Labels] = (), distinct: AbstractSet[Labels] | None = None
) -> None:
    # ``known``: label sets checked before (a v3 stream's dictionary), so only new ones cost a check.
    _check_header_names(batch.cluster, batch.node)
    _check_seq(batch.seq)
    labelsets = batch.labelsets
    if len(labelsets) > limits.max_series:
        _fail("too_many_series", f"{len(labelsets)} series > {limits.max_series}")
    if len(batch.scrapes) > limits.max_scrapes:
        _fail("too_many_scrapes", f"{len(batch.scrapes)} scrapes > {limits.max_scrapes}")
    if not _labels_pass(labelsets, known, limits, distinct):
        checker = _LabelChecker(limits)
        pairs = 0
        for labels in labelsets:
            try:
                fresh = labels not in known
            except TypeError:  # unhashable, so not a label set: check_labels says why
                fresh = True
            if fresh:
                checker.check_labels(labels)
            pairs += len(labels)
            if pairs > limits.max_label_pairs:
                _fail("too_many_label_pairs", f"more than {limits.max_label_pairs} labels in the batch")
        if len(set(labelsets)) != len(labelsets):
            _fail("duplicate_series", "the same label set appears twice")
    total = 0
    for i, block in enumerate(batch.scrapes):
        if not isinstance(block, ScrapeBlock):
            _fail("malformed", f"scrape {i} is not a ScrapeBlock")
        _check_timestamp(block.timestamp_ms, f"scrape {i} timestamp")
        series = _as_array(block.series, _U32, "bad_index", i)
        values = _as_array(block.values, "d", "malformed", i)
        timestamps = (
            None if block.timestamps is None else _as_array(block.timestamps, "q", "bad_timestamp", i)
        )
        if series.typecode not in ("B", "H", "I", "L", "Q") or values.typecode != "d":
            _fail("malformed", f"scrape {i}: series must be unsigned ints and values float64")
        if timestamps is not None and (timestamps.typecode not in ("q", "l") or timestamps.itemsize != 8):
            _fail("malformed", f"scrape {i}: timestamps must be int64")
        _check_block_columns(series, values, timestamps, len(labelsets), i)
        total += len(values)
        if total > limits.max_samples:
            _fail("too_many_samples", f"more than {limits.max_samples} samples")


def _labels_pass(
    labelsets: Sequence[Labels],
    known: Container[Labels],
    limits: Limits,
    distinct: AbstractSet[Labels] | None,
) -> bool:
    """True when the label checks of ``_validate_batch`` pass: none twice, the pairs within the limit,
    and every label set checked before or passing its checks now. C-level set passes, for the common
    case of a node's next cycle, with a few series new to it (churn); a problem takes the loop, which
    finds the first one in order."""
    if not known:
        return False
    if distinct is not None and len(distinct) == len(labelsets):
        unique = distinct
    else:
        try:
            unique = set(labelsets)
        except TypeError:
            return False
    if len(unique) != len(labelsets) or sum(map(len, labelsets)) > limits.max_label_pairs:
        return False
    if not isinstance(known, (set, frozenset)):
        return all(map(known.__contains__, unique))
    # Set against set compares the hashes it holds: no label set is hashed a second time.
    fresh = unique - known
    if fresh:
        checker = _LabelChecker(limits)
        try:
            for labels in fresh:
                checker.check_labels(labels)
        except _Invalid:
            return False
    return True


def _check_label_names(names: list[str]) -> None:
    for name in names:
        if not _LABEL_NAME_RE.fullmatch(name):
            _fail("invalid_label_name", f"invalid label name {name[:64]!r}")


def _check_schema(names: list[str]) -> None:
    """The label names of one series: the same rules as _LabelChecker, once per schema."""
    if len(set(names)) != len(names):
        _fail("duplicate_label_name", "a label name appears twice in one series")
    if names != sorted(names):
        _fail("unsorted_labels", f"label names not sorted: {names[:8]!r}")
    if "__name__" not in names:
        _fail("missing_metric_name", "a series has no __name__ label")


# --------------------------------------------------------------------------------------------------
# Strict parsing, and the "DecodeError only" contract of every decoder


class _DuplicateKey(ValueError):
    pass


def _strict_map(pairs: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"duplicate map key {key!r}")
        out[key] = value
    return out


def _msgpack_error(exc: Exception, where: str) -> NoReturn:
    if isinstance(exc, _DuplicateKey):
        _fail("malformed", f"{where}: {exc}")
    text = str(exc)
    if " exceeds max_" in text:
        _fail("limit_exceeded", f"{where}: {text}")
    _fail("malformed", f"{where}: invalid msgpack ({type(exc).__name__}: {text[:120]})")


def _run(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (_Invalid, columnar.ColumnError) as exc:
        raise DecodeError(exc.reason, exc.message) from None
    except MemoryError:
        raise
    except Exception as exc:
        # Safety net for the "DecodeError only" contract; the tests assert it is never reached.
        raise DecodeError("malformed", f"unhandled {type(exc).__name__}: {exc}") from None
