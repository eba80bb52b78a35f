"""Wire codec shared by the edge relay (encoder) and the cloud ingester (decoder).

The prose specification is ``schemas/wire-format.md``; golden vectors live in ``schemas/golden/``.

Envelope: ``b"ERB"`` + one format-version byte + a msgpack map (header fields and the ``body``).
Body v1: zstd(msgpack({"labelsets": [...], "scrapes": [...]})) with sample columns as raw
little-endian bytes, so every float64 bit pattern (the Prometheus stale marker in particular)
survives unchanged.  Body v2 ("columnar+zstd", ``encode_batch(..., version=FORMAT_V2)``): 15
separately zstd-compressed streams (timestamp table, series groups, label sets as dictionary columns,
values as decimal-scaled or raw integer deltas, XOR words), built for batches that hold many scrapes
of the same series; the transforms are in ``schemas/columnar.py``.  Decoding dispatches on the
version byte (``_VERSIONS``), so both stay decodable.

The decoder treats its input as hostile: every size is capped before it is allocated, every field
is type-checked, and any bad input raises :class:`DecodeError` (never another exception type;
``MemoryError`` is deliberately not swallowed since it says nothing about the input).
"""

from __future__ import annotations

import io
import json
import math
import re
import sys
import threading
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from operator import attrgetter, itemgetter
from typing import Any, Final, Literal, NamedTuple, NoReturn

import msgpack
import zstandard

from schemas import columnar
from schemas.model import STALE_NAN_BITS, Batch, Labels, ScrapeBlock, float_bits
from schemas.topics import validate_name

MAGIC: Final = b"ERB"
FORMAT_V1: Final = 1
FORMAT_V2: Final = 2
CURRENT_FORMAT_VERSION: Final = FORMAT_V1
CODEC_V1: Final = "msgpack+zstd"
CODEC_V2: Final = "columnar+zstd"
ACK_VERSION: Final = 1
STATUS_VERSION: Final = 1
DEFAULT_ZSTD_LEVEL: Final = 3
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


def _check_timestamp(ts: object, what: str) -> int:
    if not _is_int(ts):
        _fail("malformed", f"{what} must be an integer, not {type(ts).__name__}")
    assert isinstance(ts, int)
    if not 0 <= ts <= INT64_MAX:
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


def validate_batch(batch: Batch, limits: Limits = DEFAULT_LIMITS) -> None:
    """Check a Batch against every rule the decoder enforces; raise EncodeError if it breaks one."""
    try:
        _validate_batch(batch, limits)
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None


def _validate_batch(batch: Batch, limits: Limits) -> None:
    _check_header_names(batch.cluster, batch.node)
    _check_seq(batch.seq)
    labelsets = batch.labelsets
    if len(labelsets) > limits.max_series:
        _fail("too_many_series", f"{len(labelsets)} series > {limits.max_series}")
    if len(batch.scrapes) > limits.max_scrapes:
        _fail("too_many_scrapes", f"{len(batch.scrapes)} scrapes > {limits.max_scrapes}")
    checker = _LabelChecker(limits)
    pairs = 0
    for labels in labelsets:
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


# --------------------------------------------------------------------------------------------------
# Encoding


_tls = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not thread-safe and costly to build: one per thread and level.
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    comp = cache.get(level)
    if comp is None:
        # Content size in the frame lets the decoder refuse oversized bodies before decompressing;
        # the checksum catches spool corruption.
        comp = cache[level] = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=True
        )
    return comp


def _encode_body_v1(batch: Batch) -> bytes:
    scrapes = []
    for block in batch.scrapes:
        scrape: dict[str, Any] = {
            "t": block.timestamp_ms,
            "s": _column_to_bytes(_U32, block.series),
            "v": _column_to_bytes("d", block.values),
        }
        if block.timestamps is not None:
            scrape["ts"] = _column_to_bytes("q", block.timestamps)
        scrapes.append(scrape)
    labelsets = [[part for pair in labels for part in pair] for labels in batch.labelsets]
    return msgpack.packb({"labelsets": labelsets, "scrapes": scrapes}, use_bin_type=True)


def encode_batch(
    batch: Batch,
    level: int = DEFAULT_ZSTD_LEVEL,
    *,
    limits: Limits = DEFAULT_LIMITS,
    validate: bool = True,
    version: int = FORMAT_V1,
) -> bytes:
    """Encode a batch as an envelope of format ``version`` (FORMAT_V1 or FORMAT_V2).

    With ``validate`` (the default) the batch is first checked against every decoder rule, so an
    invalid batch fails here, at the edge, rather than being refused by the cloud after spooling.
    Raises EncodeError (a ValueError).  A v2 batch decodes to the same set of samples as v1 but not
    to the same blocks: one block per distinct timestamp, series in the v2 table order.
    """
    if version not in (FORMAT_V1, FORMAT_V2):
        raise EncodeError("unknown_version", f"format version {version!r}")
    if validate:
        validate_batch(batch, limits)
    try:
        if version == FORMAT_V1:
            raw = _encode_body_v1(batch)
            if len(raw) > limits.max_decompressed_bytes:
                _fail("decompression_limit", f"body of {len(raw)} bytes; split the batch")
            body = _compressor(level).compress(raw)
            n, t0, t1, codec = batch.sample_count, batch.first_timestamp_ms, batch.last_timestamp_ms, CODEC_V1
        else:
            body, n, t0, t1 = _encode_body_v2(batch, level, limits)
            codec = CODEC_V2
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    except (TypeError, ValueError, OverflowError, IndexError, KeyError, AttributeError) as exc:
        raise EncodeError("malformed", f"cannot encode batch: {exc}") from None
    header = {
        "cluster": batch.cluster,
        "node": batch.node,
        "seq": batch.seq,
        "t0": t0,
        "t1": t1,
        "n": n,
        "codec": codec,
        "body": body,
    }
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError("malformed", f"cannot encode header: {exc}") from None
    out = MAGIC + bytes((version,)) + packed
    if len(out) > limits.max_payload_bytes:
        raise EncodeError("oversized", f"encoded batch of {len(out)} bytes > {limits.max_payload_bytes}")
    return out


def with_seq(payload: bytes, seq: int) -> bytes:
    """``payload`` (an envelope this module encoded) with another ``seq``: the body is reused as is,
    so a batch sized with a placeholder seq is not encoded a second time."""
    try:
        _check_seq(seq)
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    header = msgpack.unpackb(payload[len(MAGIC) + 1 :], raw=False)
    header["seq"] = seq
    return payload[: len(MAGIC) + 1] + msgpack.packb(header, use_bin_type=True)


# --------------------------------------------------------------------------------------------------
# Body v2: columnar streams (schemas/columnar.py has the transforms, wire-format.md the layout)

# The streams of a v2 body, in wire order.
V2_STREAMS: Final = (
    "TIMES",
    "GROUPS",
    "LMETA",
    "LSTRLEN",
    "LSTR",
    "LSCHEMA",
    "LIDS",
    "VKIND",
    "VFIRST",
    "VDELTA1",
    "VDELTA2",
    "VDELTA4",
    "VDELTA8",
    "VSTALE",
    "VXOR",
)
_VALUE_STREAMS: Final = slice(V2_STREAMS.index("VKIND"), len(V2_STREAMS))


def _series_samples(batch: Batch) -> tuple[list[list[int]], list[list[float]], set[int]]:
    """Per series its timestamps (ascending, distinct) and values; plus timestamps of empty blocks.

    Two samples of one series at one timestamp (from two blocks) become one when their bit patterns
    are equal; different ones are refused (duplicate_sample): v2 has one value per series and time.
    """
    n = len(batch.labelsets)
    times: list[list[int]] = [[] for _ in range(n)]
    values: list[list[float]] = [[] for _ in range(n)]
    empty = {b.timestamp_ms for b in batch.scrapes if not len(b.values)}
    blocks = [b for b in batch.scrapes if len(b.values)]
    explicit = any(b.timestamps is not None for b in blocks)
    if not explicit:
        blocks.sort(key=attrgetter("timestamp_ms"))
        by_time: dict[int, list[ScrapeBlock]] = {}
        for b in blocks:
            by_time.setdefault(b.timestamp_ms, []).append(b)
        # Blocks are time-ordered, so each series' lists come out sorted; only blocks sharing a
        # timestamp can put one series twice at one time.
        clash = any(
            len(same) > 1
            and len(set(chain.from_iterable(b.series for b in same))) < sum(len(b.series) for b in same)
            for same in by_time.values()
        )
        if not clash:
            for b in blocks:
                series = b.series
                # C-level appends: one call per block instead of a Python loop per sample.
                deque(map(list.append, map(values.__getitem__, series), b.values), maxlen=0)
                deque(map(list.append, map(times.__getitem__, series), repeat(b.timestamp_ms)), maxlen=0)
            return times, values, empty
    pairs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for b in blocks:
        stamps = repeat(b.timestamp_ms) if b.timestamps is None else b.timestamps
        # Not strict: repeat() is endless; explicit columns were checked to match by validation.
        found = zip(stamps, b.values, strict=False)
        deque(map(list.append, map(pairs.__getitem__, b.series), found), maxlen=0)
    for s, found in enumerate(pairs):
        if not found:
            continue
        found.sort(key=itemgetter(0))
        stamps = [t for t, _ in found]
        if len(set(stamps)) != len(stamps):
            kept: list[tuple[int, float]] = []
            for t, v in found:
                if kept and kept[-1][0] == t:
                    if float_bits(kept[-1][1]) != float_bits(v):
                        _fail("duplicate_sample", f"series {s} has two values at {t}")
                    continue
                kept.append((t, v))
            found = kept
        times[s] = [t for t, _ in found]
        values[s] = [v for _, v in found]
    return times, values, empty


def _encode_labels_v2(labelsets: Sequence[Labels]) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """LMETA, LSTRLEN, LSTR, LSCHEMA, LIDS: label sets as columns of ids per (schema, label name)."""
    schemas: dict[tuple[str, ...], int] = {}
    rows: list[list[tuple[str, ...]]] = []
    schema_col: list[int] = []
    for labels in labelsets:
        names, values = tuple(zip(*labels, strict=True)) or ((), ())
        sid = schemas.get(names)
        if sid is None:
            sid = schemas[names] = len(schemas)
            rows.append([])
        schema_col.append(sid)
        rows[sid].append(values)
    name_ids = {name: i for i, name in enumerate(sorted({n for names in schemas for n in names}))}
    dicts: dict[str, dict[str, int]] = {name: {} for name in name_ids}
    columns: list[tuple[str, list[int]]] = []
    for names, sid in schemas.items():
        for name, column in zip(names, zip(*rows[sid], strict=True), strict=True):
            ids = dicts[name]
            for value in dict.fromkeys(column):  # new values get the next ids, in first-use order
                if value not in ids:
                    ids[value] = len(ids)
            columns.append((name, list(map(ids.__getitem__, column))))
    meta = bytearray()
    columnar.put_uvarint(meta, len(name_ids))
    columnar.put_uvarint(meta, len(schemas))
    for names in schemas:
        columnar.put_uvarint(meta, len(names))
        for name in names:
            columnar.put_uvarint(meta, name_ids[name])
    for name in name_ids:
        columnar.put_uvarint(meta, len(dicts[name]))
    strings = [s.encode("utf-8") for s in chain(name_ids, *(dicts[name] for name in name_ids))]
    lengths = columnar.uvarints(map(len, strings))
    schema_bytes = columnar.pack_ints(schema_col, columnar.unsigned_width(len(schemas)), signed=False)
    ids_bytes = b"".join(
        columnar.pack_ints(ids, columnar.unsigned_width(len(dicts[name])), signed=False)
        for name, ids in columns
    )
    return bytes(meta), bytes(lengths), b"".join(strings), schema_bytes, ids_bytes


def _encode_body_v2(batch: Batch, level: int, limits: Limits) -> tuple[bytes, int, int, int]:
    """(body, n, t0, t1) of a v2 envelope."""
    times_of, values_of, empty = _series_samples(batch)
    table = sorted(set(chain.from_iterable(times_of)) | empty)
    if len(table) > limits.max_scrapes:
        _fail("too_many_scrapes", f"{len(table)} distinct timestamps > {limits.max_scrapes}")
    # Series with the same timestamps form a group: the group stores them once, and its series are
    # contiguous so a decoder slices each block out of the group's series-major value matrix.
    # Groups sort by their timestamps and series by labels, so the bytes do not depend on the order
    # of the input's series or blocks.
    groups: dict[tuple[int, ...], list[int]] = {}
    for s, key in enumerate(map(tuple, times_of)):
        groups.setdefault(key, []).append(s)
    labelsets = batch.labelsets
    index = {t: i for i, t in enumerate(table)}
    group_bytes = bytearray()
    columnar.put_uvarint(group_bytes, len(groups))
    order: list[int] = []
    values = columnar.ValueEncoder()
    n = 0
    for key in sorted(groups):
        members = sorted(groups[key], key=labelsets.__getitem__)
        order += members
        runs = columnar.runs_of([index[t] for t in key])
        columnar.put_uvarint(group_bytes, len(members))
        columnar.put_uvarint(group_bytes, len(runs))
        for gap, length in runs:
            columnar.put_uvarint(group_bytes, gap)
            columnar.put_uvarint(group_bytes, length)
        if key:
            n += len(members) * len(key)
            for s in members:
                values.add(values_of[s])
    streams = (
        bytes(columnar.encode_times(table)),
        bytes(group_bytes),
        *_encode_labels_v2([labelsets[s] for s in order]),
        *values.streams(),
    )
    size = sum(map(len, streams))
    if size > limits.max_decompressed_bytes:
        _fail("decompression_limit", f"body of {size} bytes; split the batch")
    return _pack_streams(streams, level), n, (table[0] if table else 0), (table[-1] if table else 0)


def _pack_streams(streams: Sequence[bytes], level: int) -> bytes:
    """Each stream as uvarint(length) + one zstd frame (length 0: the stream is empty)."""
    comp = _compressor(level)
    out = bytearray()
    for raw in streams:
        frame = comp.compress(raw) if raw else b""
        columnar.put_uvarint(out, len(frame))
        out += frame
    return bytes(out)


# --------------------------------------------------------------------------------------------------
# Decoding

_HEADER_MAX_STR: Final = 1024
_HEADER_MAX_CONTAINER: Final = 32
_REQUIRED_HEADER: Final = ("cluster", "node", "seq", "t0", "t1", "n", "codec", "body")
_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
# Largest output one input byte of a zstd frame can produce: an RLE block is 4 bytes for 128 KiB.
_ZSTD_MAX_RATIO: Final = 1 << 15
_MIN_FEED: Final = 16
_BODY_READ_SIZE: Final = 64 << 10


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


def _decode_envelope_v1(payload: memoryview, limits: Limits) -> tuple[Header, bytes]:
    return _decode_envelope(payload, limits, FORMAT_V1, CODEC_V1)


def _decode_envelope_v2(payload: memoryview, limits: Limits) -> tuple[Header, bytes]:
    # v2 keeps the v1 header map; only the codec (and so the body) differs.
    return _decode_envelope(payload, limits, FORMAT_V2, CODEC_V2)


def _decode_envelope(
    payload: memoryview, limits: Limits, version: int, expected_codec: str
) -> tuple[Header, bytes]:
    unpacker = msgpack.Unpacker(
        None,
        max_buffer_size=max(len(payload), 1),
        raw=False,
        strict_map_key=True,
        use_list=False,
        object_pairs_hook=_strict_map,
        max_bin_len=limits.max_payload_bytes,
        max_str_len=_HEADER_MAX_STR,
        max_array_len=_HEADER_MAX_CONTAINER,
        max_map_len=_HEADER_MAX_CONTAINER,
        max_ext_len=_HEADER_MAX_CONTAINER,
    )
    unpacker.feed(payload)
    try:
        fields = unpacker.unpack()
    except (msgpack.OutOfData, msgpack.exceptions.BufferFull):
        _fail("truncated", "envelope ends inside the header")
    except ValueError as exc:
        _msgpack_error(exc, "header")
    if unpacker.tell() != len(payload):
        _fail("malformed", f"{len(payload) - unpacker.tell()} bytes after the envelope")
    if type(fields) is not dict:
        _fail("malformed", "header is not a map")
    missing = [key for key in _REQUIRED_HEADER if key not in fields]
    if missing:
        _fail("malformed", f"header lacks {', '.join(missing)}")
    # Unknown header keys are ignored: v1 may grow optional header fields without a version bump.
    _check_header_names(fields["cluster"], fields["node"])
    seq = _check_seq(fields["seq"])
    for key in ("t0", "t1", "n"):
        if not _is_int(fields[key]):
            _fail("malformed", f"{key} must be an integer, not {type(fields[key]).__name__}")
    t0, t1, n = fields["t0"], fields["t1"], fields["n"]
    if not (0 <= t0 <= t1 <= INT64_MAX):
        _fail("bad_header", f"t0={t0} t1={t1}: need 0 <= t0 <= t1 < 2^63")
    if n < 0:
        _fail("bad_header", f"negative sample count {n}")
    if n > limits.max_samples:
        _fail("too_many_samples", f"header announces {n} samples > {limits.max_samples}")
    codec = fields["codec"]
    if type(codec) is not str:
        _fail("malformed", "codec must be a string")
    if codec != expected_codec:
        _fail("unknown_codec", f"codec {codec[:64]!r} in a v{version} envelope")
    body = fields["body"]
    if type(body) is not bytes:
        _fail("malformed", f"body must be bytes, not {type(body).__name__}")
    header = Header(version, fields["cluster"], fields["node"], seq, t0, t1, n, codec)
    return header, body


def _window_cap(cap: int) -> int:
    # zstd window sizes are powers of two; never let a frame demand a window above the output cap.
    return 1 << max(zstandard.WINDOWLOG_MIN, (cap - 1).bit_length())


def _bounded_decompress(body: bytes, cap: int) -> bytes | bytearray:
    """Decompress exactly one zstd frame, never holding much more than ``cap`` output bytes."""
    if len(body) < 4:
        _fail("bad_compression", "body too short for a zstd frame")
    if body[:4] != _ZSTD_MAGIC:
        _fail("bad_compression", "body is not a zstd frame")
    try:
        params = zstandard.get_frame_parameters(body)
    except zstandard.ZstdError as exc:
        _fail("bad_compression", f"bad zstd frame header: {exc}")
    if params.dict_id:
        _fail("bad_compression", "zstd frames with a dictionary are not v1")
    known_size = params.content_size != zstandard.CONTENTSIZE_UNKNOWN
    if known_size and params.content_size > cap:
        _fail("decompression_limit", f"frame declares {params.content_size} bytes > {cap}")
    if params.window_size > _window_cap(cap):
        _fail("decompression_limit", f"frame window of {params.window_size} bytes")
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=_window_cap(cap))
        if known_size and params.content_size:
            # One allocation of the declared size; zstd fails a frame that produces more or less.
            # (A declared size of 0 takes the streaming path: the one-shot call would skip the frame.)
            return dctx.decompress(body, max_output_size=params.content_size, allow_extra_data=False)
        return _stream_decompress(dctx, body, cap)
    except zstandard.ZstdError as exc:
        _fail("bad_compression", f"zstd: {exc}")


def _stream_decompress(dctx: zstandard.ZstdDecompressor, body: bytes, cap: int) -> bytearray:
    # Frames without a content size (other encoders' streaming mode) are fed a little input at a
    # time: never more than can expand to an eighth of the remaining budget, so the peak stays
    # near the cap whatever the frame claims.
    dobj = dctx.decompressobj()
    out = bytearray()
    pos = 0
    view = memoryview(body)
    while pos < len(body) and not dobj.eof:
        step = max(_MIN_FEED, (cap - len(out)) // (8 * _ZSTD_MAX_RATIO))
        out += dobj.decompress(view[pos : pos + step])
        pos += step
        if len(out) > cap:
            _fail("decompression_limit", f"body decompresses to more than {cap} bytes")
    if not dobj.eof:
        _fail("bad_compression", "zstd frame is incomplete")
    if dobj.unused_data or pos < len(body):
        _fail("bad_compression", "bytes after the zstd frame")
    return out


def _decode_body_v1(header: Header, body: bytes, limits: Limits) -> Batch:
    raw = _bounded_decompress(body, limits.max_decompressed_bytes)
    size = len(raw)
    unpacker = msgpack.Unpacker(
        # Read through a file object: the unpacker then buffers one object at a time instead of a
        # second copy of the whole body.
        io.BytesIO(raw),
        read_size=min(_BODY_READ_SIZE, max(size, 1)),
        max_buffer_size=max(size, 1),
        raw=False,
        strict_map_key=True,
        use_list=False,
        object_pairs_hook=_strict_map,
        max_bin_len=limits.max_decompressed_bytes,
        # Room above the legal maxima so an over-long label is reported as label_too_long.
        max_str_len=4 * max(limits.max_label_value_bytes, limits.max_label_name_bytes, 16),
        # Only label sets and scrape maps are unpacked whole; the two top arrays are streamed.
        max_array_len=2 * limits.max_labels_per_series + 2,
        max_map_len=8,
        max_ext_len=16,
    )
    del raw
    try:
        labelsets, scrapes = _read_body_v1(unpacker, limits)
        if unpacker.tell() != size:
            _fail("malformed", f"{size - unpacker.tell()} bytes after the body")
    except (msgpack.OutOfData, msgpack.exceptions.BufferFull):
        # BufferFull: a body shorter than the header it starts (the buffer is capped at its size).
        _fail("malformed", "body ends early")
    except ValueError as exc:
        _msgpack_error(exc, "body")
    batch = Batch(header.cluster, header.node, header.seq, labelsets, scrapes)
    total = batch.sample_count
    if total != header.sample_count:
        _fail("header_mismatch", f"header n={header.sample_count}, body has {total} samples")
    first, last = batch.first_timestamp_ms, batch.last_timestamp_ms
    if (first, last) != (header.first_ts_ms, header.last_ts_ms):
        _fail(
            "header_mismatch",
            f"header t0..t1={header.first_ts_ms}..{header.last_ts_ms}, body has {first}..{last}",
        )
    return batch


_RawScrape = tuple[int, bytes, bytes, bytes | None]


def _read_body_v1(unpacker: msgpack.Unpacker, limits: Limits) -> tuple[list[Labels], list[ScrapeBlock]]:
    """Stream the body map, checking each count before the objects it announces are built."""
    labelsets: list[Labels] | None = None
    raw_scrapes: list[_RawScrape] | None = None
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key == "labelsets" and labelsets is None:
            labelsets = _read_labelsets(unpacker, limits)
        elif key == "scrapes" and raw_scrapes is None:
            raw_scrapes = _read_scrapes(unpacker, limits)
        else:
            _fail("malformed", f"unknown or repeated body key {str(key)[:64]!r}")
    if labelsets is None or raw_scrapes is None:
        _fail("malformed", "body needs both labelsets and scrapes")
    scrapes = []
    for i, (t, s, v, ts) in enumerate(raw_scrapes):
        series = _column_from_bytes(_U32, s)
        values = _column_from_bytes("d", v)
        timestamps = None if ts is None else _column_from_bytes("q", ts)
        _check_block_columns(series, values, timestamps, len(labelsets), i)
        scrapes.append(ScrapeBlock(t, series, values, timestamps))
    return labelsets, scrapes


def _read_labelsets(unpacker: msgpack.Unpacker, limits: Limits) -> list[Labels]:
    count = unpacker.read_array_header()
    if count > limits.max_series:
        _fail("too_many_series", f"{count} series > {limits.max_series}")
    labelsets: list[Labels] = []
    checker = _LabelChecker(limits)
    # Equal (name, value) pairs are shared between series to keep big batches small in memory.
    shared: dict[tuple[str, str], tuple[str, str]] = {}
    budget = limits.max_label_pairs
    for _ in range(count):
        flat = unpacker.unpack()
        if type(flat) is not tuple:
            _fail("malformed", "a label set must be an array")
        if len(flat) % 2:
            _fail("malformed", "a label set array must have an even length")
        budget -= len(flat) // 2
        if budget < 0:
            _fail("too_many_label_pairs", f"more than {limits.max_label_pairs} labels in the batch")
        names, values = flat[0::2], flat[1::2]
        checker.check(names, values)
        labelsets.append(tuple([shared.setdefault(p, p) for p in zip(names, values, strict=True)]))
    if len(set(labelsets)) != len(labelsets):
        _fail("duplicate_series", "the same label set appears twice")
    return labelsets


def _read_scrapes(unpacker: msgpack.Unpacker, limits: Limits) -> list[_RawScrape]:
    count = unpacker.read_array_header()
    if count > limits.max_scrapes:
        _fail("too_many_scrapes", f"{count} scrapes > {limits.max_scrapes}")
    out: list[_RawScrape] = []
    total = 0
    for i in range(count):
        sc = unpacker.unpack()
        if type(sc) is not dict:
            _fail("malformed", f"scrape {i} is not a map")
        if not {"t", "s", "v"} <= sc.keys() or not sc.keys() <= {"t", "s", "v", "ts"}:
            _fail("malformed", f"scrape {i} keys {sorted(map(str, sc))}: need t, s, v and optional ts")
        t = _check_timestamp(sc["t"], f"scrape {i} t")
        s, v, ts = sc["s"], sc["v"], sc.get("ts")
        if type(s) is not bytes or type(v) is not bytes or ("ts" in sc and type(ts) is not bytes):
            _fail("malformed", f"scrape {i}: s, v and ts must be bytes")
        if len(s) % 4 or len(v) % 8 or (ts is not None and len(ts) % 8):
            _fail("length_mismatch", f"scrape {i}: column byte length not a multiple of its item size")
        total += len(v) // 8
        if total > limits.max_samples:
            _fail("too_many_samples", f"more than {limits.max_samples} samples")
        out.append((t, s, v, ts))
    return out


def _v2_streams(body: bytes, limits: Limits) -> list[bytes]:
    """Split a v2 body into its decompressed streams, all of them within max_decompressed_bytes."""
    reader = columnar.Reader(body, "body")
    budget = limits.max_decompressed_bytes
    out: list[bytes] = []
    for name in V2_STREAMS:
        if not reader.remaining():
            _fail("malformed", f"body ends before stream {name}")
        size = reader.uvarint()
        if size > reader.remaining():
            _fail("malformed", f"stream {name}: {size} bytes announced, {reader.remaining()} left")
        if not size:
            out.append(b"")
            continue
        raw = bytes(_bounded_decompress(reader.take(size), budget))
        budget -= len(raw)
        out.append(raw)
    if reader.remaining():
        _fail("malformed", f"{reader.remaining()} bytes after the last stream")
    return out


_Group = tuple[int, list[int]]  # (series count, indices into the timestamp table)


def _read_groups(buf: bytes, n_times: int, limits: Limits) -> tuple[list[_Group], int, int]:
    """The GROUPS stream: (groups, series count, sample count), counts checked as they add up."""
    reader = columnar.Reader(buf, "GROUPS")
    count = reader.count(limits.max_series, "too_many_series", "groups")
    groups: list[_Group] = []
    series = samples = 0
    for _ in range(count):
        size = reader.uvarint()
        if not size:
            _fail("malformed", "GROUPS: a group without series")
        series += size
        if series > limits.max_series:
            _fail("too_many_series", f"more than {limits.max_series} series")
        # A run holds at least one index, so more runs than timestamps cannot be valid.
        runs = reader.count(n_times, "bad_index", "runs")
        indices: list[int] = []
        end = 0
        for r in range(runs):
            gap = reader.uvarint()
            length = reader.uvarint()
            if not length or (r and not gap):
                _fail("malformed", "GROUPS: empty run, or runs not separated")
            start = end + gap
            end = start + length
            if end > n_times:
                _fail("bad_index", f"GROUPS: timestamp index {end - 1} >= {n_times} timestamps")
            # Checked per run, before the run's indices exist: a claim of 10^9 samples fails here.
            samples += size * length
            if samples > limits.max_samples:
                _fail("too_many_samples", f"more than {limits.max_samples} samples")
            indices.extend(range(start, end))
        groups.append((size, indices))
    reader.done()
    return groups, series, samples


_NameDict = list[tuple[str, str]]


def _read_strings(lengths_buf: bytes, data: bytes, n_names: int, n_values: int, limits: Limits) -> list[str]:
    reader = columnar.Reader(lengths_buf, "LSTRLEN")
    lengths = reader.uvarints(n_names + n_values)
    reader.done()
    if n_names and max(lengths[:n_names]) > limits.max_label_name_bytes:
        _fail("label_too_long", f"a label name longer than {limits.max_label_name_bytes} bytes")
    if n_values and max(lengths[n_names:]) > limits.max_label_value_bytes:
        _fail("label_too_long", f"a label value longer than {limits.max_label_value_bytes} bytes")
    if sum(lengths) != len(data):
        _fail("length_mismatch", f"LSTR: {len(data)} bytes for strings of {sum(lengths)} bytes")
    ends = list(accumulate(lengths))
    try:
        if data.isascii():
            text = data.decode("ascii")  # byte offsets are character offsets: one decode, then slices
            return list(map(text.__getitem__, map(slice, [0, *ends[:-1]], ends)))
        return [data[a:b].decode("utf-8") for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    except UnicodeDecodeError as exc:
        _fail("malformed", f"LSTR: invalid UTF-8 ({exc.reason})")


def _read_labels_v2(streams: Sequence[bytes], n_series: int, limits: Limits) -> list[Labels]:
    meta_buf, lengths_buf, data, schema_buf, ids_buf = streams
    meta = columnar.Reader(meta_buf, "LMETA")
    pair_cap = limits.max_label_pairs
    n_names = meta.count(pair_cap, "too_many_label_pairs", "label names")
    # Every schema is some series' label names: there are never more schemas than series.
    n_schemas = meta.count(n_series, "malformed", "label name sets for fewer series")
    schemas: list[list[int]] = []
    listed = 0
    for _ in range(n_schemas):
        size = meta.count(limits.max_labels_per_series, "too_many_labels", "labels in one series")
        listed += size
        if listed > pair_cap:
            _fail("too_many_label_pairs", f"more than {pair_cap} labels in the batch")
        ids = meta.uvarints(size)
        if ids and max(ids) >= n_names:
            _fail("bad_index", f"LMETA: label name {max(ids)} >= {n_names} names")
        schemas.append(ids)
    dict_sizes = meta.uvarints(n_names)
    meta.done()
    n_values = sum(dict_sizes)
    if n_names + n_values > pair_cap:
        _fail("too_many_label_pairs", f"more than {pair_cap} distinct label names and values")
    strings = _read_strings(lengths_buf, data, n_names, n_values, limits)
    names = strings[:n_names]
    _check_label_names(names)
    pairs: list[_NameDict] = []
    pos = n_names
    for name, size in zip(names, dict_sizes, strict=True):
        values = strings[pos : pos + size]
        pos += size
        if "" in values:
            _fail("empty_label_value", f"label {name!r} has an empty value")
        if name == "__name__":
            for metric in values:
                if not _METRIC_NAME_RE.fullmatch(metric):
                    _fail("invalid_metric_name", f"invalid metric name {metric[:64]!r}")
        pairs.append([(name, value) for value in values])
    for ids in schemas:
        _check_schema([names[i] for i in ids])
    schema_col = columnar.unpack_ints(
        schema_buf, columnar.unsigned_width(n_schemas), signed=False, name="LSCHEMA"
    )
    if len(schema_col) != n_series:
        _fail("length_mismatch", f"LSCHEMA: {len(schema_col)} schema ids for {n_series} series")
    if n_series and max(schema_col) >= n_schemas:
        _fail("bad_index", f"LSCHEMA: schema {max(schema_col)} >= {n_schemas} schemas")
    counts = Counter(schema_col)
    if sum(counts[s] * len(ids) for s, ids in enumerate(schemas)) > pair_cap:
        _fail("too_many_label_pairs", f"more than {pair_cap} labels in the batch")
    reader = columnar.Reader(ids_buf, "LIDS")
    per_schema = []
    for s, ids in enumerate(schemas):
        rows = counts.get(s, 0)
        columns = []
        for name_id in ids:
            table = pairs[name_id]
            width = columnar.unsigned_width(len(table))
            col = columnar.unpack_ints(reader.take(rows * width), width, signed=False, name="LIDS")
            if rows and max(col) >= len(table):
                _fail("bad_index", f"LIDS: value {max(col)} >= {len(table)} values of {names[name_id]!r}")
            columns.append(map(table.__getitem__, col))
        per_schema.append(iter(list(zip(*columns, strict=True))))
    reader.done()
    # Put each schema's label sets back in series order: one C-level next() per series.  (Each
    # iterator holds exactly as many sets as schema_col names it, so no next() runs dry.)
    labelsets: list[Labels] = list(map(next, map(per_schema.__getitem__, schema_col)))
    if len(set(labelsets)) != len(labelsets):
        _fail("duplicate_series", "the same label set appears twice")
    return labelsets


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


def _decode_body_v2(header: Header, body: bytes, limits: Limits) -> Batch:
    streams = _v2_streams(body, limits)
    times = columnar.decode_times(streams[0], limits.max_scrapes, INT64_MAX)
    bounds = (times[0], times[-1]) if times else (0, 0)
    if bounds != (header.first_ts_ms, header.last_ts_ms):
        _fail(
            "header_mismatch",
            f"header t0..t1={header.first_ts_ms}..{header.last_ts_ms}, body has {bounds[0]}..{bounds[1]}",
        )
    groups, n_series, n_samples = _read_groups(streams[1], len(times), limits)
    if n_samples != header.sample_count:
        _fail("header_mismatch", f"header n={header.sample_count}, body has {n_samples} samples")
    labelsets = _read_labels_v2(streams[2:7], n_series, limits)
    decoder = columnar.ValueDecoder(streams[_VALUE_STREAMS])
    # Each group's values are a series-major matrix; block j of the group is every w-th value.
    parts: list[list[tuple[array, array, int, int]]] = [[] for _ in times]
    first = 0
    add = decoder.series
    for size, indices in groups:
        width = len(indices)
        if width:
            matrix = array("d")
            for _ in range(size):
                add(width, matrix)
            ids = array(_U32, range(first, first + size))
            for j, t in enumerate(indices):
                parts[t].append((ids, matrix, j, width))
        first += size
    decoder.done()
    blocks = []
    for t, found in zip(times, parts, strict=True):
        if len(found) == 1:
            ids, matrix, j, width = found[0]
            blocks.append(ScrapeBlock(t, ids[:], matrix[j::width]))
            continue
        # Groups are in series order, so concatenating their parts keeps each block ascending.
        series = array(_U32)
        values = array("d")
        for ids, matrix, j, width in found:
            series += ids
            values += matrix[j::width]
        blocks.append(ScrapeBlock(t, series, values))
    return Batch(header.cluster, header.node, header.seq, labelsets, blocks)


_EnvelopeDecoder = Callable[[memoryview, Limits], tuple[Header, bytes]]
_BodyDecoder = Callable[[Header, bytes, Limits], Batch]
# Format version byte -> decoders; v1 stays decodable for as long as spools may hold v1 rows.
_VERSIONS: Final[dict[int, tuple[_EnvelopeDecoder, _BodyDecoder]]] = {
    FORMAT_V1: (_decode_envelope_v1, _decode_body_v1),
    FORMAT_V2: (_decode_envelope_v2, _decode_body_v2),
}


def _open_envelope(data: bytes, limits: Limits) -> tuple[Header, bytes, _BodyDecoder]:
    if not isinstance(data, bytes | bytearray | memoryview):
        _fail("malformed", f"expected bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) > limits.max_payload_bytes:
        _fail("oversized", f"payload of {len(view)} bytes > {limits.max_payload_bytes}")
    head = bytes(view[:4])
    if head[:3] != MAGIC[: len(head)]:
        _fail("bad_magic", "not an edge-relay batch")
    if len(head) < 4:
        _fail("truncated", f"{len(head)} bytes")
    versions = _VERSIONS.get(head[3])
    if versions is None:
        _fail("unknown_version", f"format version {head[3]}")
    decode_envelope, decode_body = versions
    header, body = decode_envelope(view[4:], limits)
    return header, body, decode_body


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


def peek_header(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Validate and return the envelope header without decompressing the body."""
    header: Header = _run(lambda: _open_envelope(data, limits)[0])
    return header


def decode_batch(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Batch:
    """Decode and fully validate an envelope; raise DecodeError for anything wrong with it."""

    def go() -> Batch:
        header, body, decode_body = _open_envelope(data, limits)
        return decode_body(header, body, limits)

    batch: Batch = _run(go)
    return batch


def decode_batch_with_header(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[Header, Batch]:
    """Like decode_batch, also returning the header (format version, codec)."""

    def go() -> tuple[Header, Batch]:
        header, body, decode_body = _open_envelope(data, limits)
        return header, decode_body(header, body, limits)

    result: tuple[Header, Batch] = _run(go)
    return result


# --------------------------------------------------------------------------------------------------
# Acks (cloud -> edge) and status (edge -> cloud): compact, versioned JSON.

AckResultKind = Literal["ok", "rejected"]
MAX_REASON_CHARS: Final = 256


class AckResult(NamedTuple):
    seq: int
    result: AckResultKind
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    node: str
    results: list[AckResult]
    v: int = ACK_VERSION


def _json_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"JSON constant {name} is not allowed")


def _json_loads(data: bytes, max_bytes: int, what: str) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        _fail("malformed", f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        _fail("oversized", f"{what} of {len(data)} bytes > {max_bytes}")
    try:
        text = data.decode("utf-8")
        obj = json.loads(text, object_pairs_hook=_strict_map, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        _fail("malformed", f"{what} is not valid JSON: {str(exc)[:120]}")
    if type(obj) is not dict:
        _fail("malformed", f"{what} is not a JSON object")
    return obj


def _check_version(obj: dict[str, Any], expected: int, what: str) -> None:
    if "v" not in obj or not _is_int(obj["v"]):
        _fail("malformed", f"{what} lacks an integer v")
    if obj["v"] != expected:
        _fail("unknown_version", f"{what} version {obj['v']}")


def _check_reason(reason: object) -> str:
    if type(reason) is not str or not reason or len(reason) > MAX_REASON_CHARS:
        _fail("malformed", f"a reject reason must be a string of 1..{MAX_REASON_CHARS} chars")
    return reason


def _ack_wire(node: str, results: Iterable[AckResult], limits: Limits) -> dict[str, Any]:
    _check_name("node", node)
    by_seq: dict[int, AckResult] = {}
    for item in results:
        seq, result, reason = item
        _check_seq(seq)
        if result == "ok":
            if reason is not None:
                _fail("malformed", f"seq {seq}: an ok result carries no reason")
        elif result == "rejected":
            _check_reason(reason)
        else:
            _fail("malformed", f"seq {seq}: result {result!r} is neither ok nor rejected")
        norm = AckResult(seq, result, reason)
        if by_seq.setdefault(seq, norm) != norm:
            _fail("malformed", f"seq {seq} has two different results")
    if len(by_seq) > limits.max_ack_results:
        _fail("oversized", f"{len(by_seq)} ack results > {limits.max_ack_results}")
    ok: list[int | list[int]] = []
    rejected: list[list[int | str]] = []
    # Runs of consecutive acked seqs become [first, last] ranges: a drained backlog acks in one line.
    run_start = run_end = -1
    for seq in sorted(by_seq):
        res = by_seq[seq]
        if res.result == "rejected":
            assert res.reason is not None
            rejected.append([seq, res.reason])
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
    return wire


def encode_ack(node: str, results: Iterable[AckResult], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """``{"v":1,"node":..,"ok":[seq | [first,last], ..],"rejected":[[seq,reason], ..]}``."""
    try:
        out = _json_dumps(_ack_wire(node, results, limits))
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    except (TypeError, ValueError) as exc:
        raise EncodeError("malformed", str(exc)) from None
    if len(out) > limits.max_ack_bytes:
        raise EncodeError("oversized", f"ack of {len(out)} bytes; split it")
    return out


def _decode_ack(data: bytes, limits: Limits) -> Ack:
    obj = _json_loads(data, limits.max_ack_bytes, "ack")
    _check_version(obj, ACK_VERSION, "ack")
    if not obj.keys() <= {"v", "node", "ok", "rejected"} or "node" not in obj:
        _fail("malformed", f"ack keys {sorted(obj)}: need v, node and optional ok, rejected")
    node = obj["node"]
    _check_name("node", node)
    ok, rejected = obj.get("ok", []), obj.get("rejected", [])
    if type(ok) is not list or type(rejected) is not list:
        _fail("malformed", "ok and rejected must be arrays")
    results: dict[int, AckResult] = {}
    budget = limits.max_ack_results

    def add(item: AckResult) -> None:
        if item.seq in results:
            _fail("malformed", f"seq {item.seq} acked twice")
        if len(results) >= budget:
            _fail("oversized", f"more than {budget} ack results")
        results[item.seq] = item

    for entry in ok:
        if _is_int(entry):
            add(AckResult(_check_seq(entry), "ok"))
            continue
        if type(entry) is not list or len(entry) != 2:
            _fail("malformed", "an ok entry is a seq or a [first, last] range")
        first, last = _check_seq(entry[0]), _check_seq(entry[1])
        if first > last:
            _fail("malformed", f"range [{first}, {last}] is reversed")
        # Check the size before expanding so a huge range costs nothing.
        if last - first + 1 > budget - len(results):
            _fail("oversized", f"more than {budget} ack results")
        for seq in range(first, last + 1):
            add(AckResult(seq, "ok"))
    for entry in rejected:
        if type(entry) is not list or len(entry) != 2:
            _fail("malformed", "a rejected entry is [seq, reason]")
        add(AckResult(_check_seq(entry[0]), "rejected", _check_reason(entry[1])))
    return Ack(node, [results[seq] for seq in sorted(results)])


def decode_ack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Ack:
    """Decode an ack; results come back sorted by seq, each seq once."""
    ack: Ack = _run(lambda: _decode_ack(data, limits))
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
        _fail("malformed", "status must be an object")
    missing = [key for key in _STATUS_REQUIRED if key not in status]
    if missing:
        _fail("malformed", f"status lacks {', '.join(missing)}")
    _check_version(status, STATUS_VERSION, "status")
    _check_header_names(status["cluster"], status["node"])
    if type(status["state"]) is not str or status["state"] not in STATUS_STATES:
        _fail("malformed", f"state must be one of {sorted(STATUS_STATES)}")
    _check_timestamp(status["ts_ms"], "ts_ms")
    if len(status) > _STATUS_MAX_KEYS:
        _fail("malformed", f"more than {_STATUS_MAX_KEYS} status fields")
    for key, value in status.items():
        if key in _STATUS_REQUIRED:
            continue
        if type(key) is not str or not _STATUS_KEY_RE.fullmatch(key):
            _fail("malformed", f"status key {key!r} must match [a-z][a-z0-9_]{{0,63}}")
        # Numbers must fit an int64 / finite float64 so any JSON consumer reads them exactly.
        numeric = (type(value) is float and math.isfinite(value)) or (
            _is_int(value) and -INT64_MAX - 1 <= value <= INT64_MAX
        )
        if key in STATUS_NUMERIC_FIELDS:
            if value is not None and (not numeric or value < 0):
                _fail("malformed", f"status field {key} must be a non-negative number")
        elif not (value is None or type(value) is bool or type(value) is str or numeric):
            # Flat scalars only: status is a dashboard line, not a document.
            _fail("malformed", f"status field {key} must be a finite number, string, bool or null")
        elif type(value) is str and len(value) > _STATUS_MAX_STR:
            _fail("malformed", f"status field {key} is longer than {_STATUS_MAX_STR} chars")
    return status


def encode_status(status: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Encode a status dict (``v`` defaults to the current version); keys in a fixed order."""
    full = {"v": STATUS_VERSION, **status}
    try:
        _check_status(full)
        ordered = {key: full[key] for key in _STATUS_REQUIRED}
        ordered.update(sorted((k, v) for k, v in full.items() if k not in ordered))
        out = _json_dumps(ordered)
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    except (TypeError, ValueError) as exc:
        raise EncodeError("malformed", str(exc)) from None
    if len(out) > limits.max_status_bytes:
        raise EncodeError("oversized", f"status of {len(out)} bytes > {limits.max_status_bytes}")
    return out


def decode_status(data: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    status: dict[str, Any] = _run(lambda: _check_status(_json_loads(data, limits.max_status_bytes, "status")))
    return status


# --------------------------------------------------------------------------------------------------
# JSON view of a batch, as used by the golden vectors (schemas/golden/*.json).


def float_repr(value: float) -> float | str:
    """A readable value: the float itself when finite, else Prometheus' spelling of it."""
    if math.isnan(value):
        return "StaleNaN" if float_bits(value) == STALE_NAN_BITS else "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return value


def _value_bits(values: array) -> array:
    # Reinterpret the column's bytes rather than round-trip each float through Python.
    bits = array("Q")
    bits.frombytes(_column_to_bytes("d", values))
    if _BIG_ENDIAN:
        bits.byteswap()
    return bits


def batch_to_json(header: Header, batch: Batch) -> dict[str, Any]:
    """Exact JSON view of a decoded batch: values as 16-hex-digit bit patterns plus readable floats."""
    return {
        "header": {
            "version": header.version,
            "cluster": header.cluster,
            "node": header.node,
            "seq": header.seq,
            "first_ts_ms": header.first_ts_ms,
            "last_ts_ms": header.last_ts_ms,
            "sample_count": header.sample_count,
            "codec": header.codec,
        },
        "labelsets": [[list(pair) for pair in labels] for labels in batch.labelsets],
        "scrapes": [
            {
                "t": block.timestamp_ms,
                "series": list(block.series),
                "values_bits": [f"{bits:016x}" for bits in _value_bits(block.values)],
                "values": [float_repr(x) for x in block.values],
                "timestamps": None if block.timestamps is None else list(block.timestamps),
            }
            for block in batch.scrapes
        ],
    }
