"""Body of wire format version 2, "columnar+zstd" (the layout is in ``schemas/wire-format.md``).

15 separately zstd-compressed streams: timestamp table, series groups, label sets as dictionary
columns, values as decimal-scaled or raw integer deltas, XOR words; built for batches that hold many
scrapes of the same series.  The transforms are in ``schemas/columnar.py`` (left outside this package:
they are byte-level building blocks with their own tests, and a body format is their only user
here).  ``encode_body`` and ``decode_body`` are what ``envelope`` dispatches to for version 2.
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Sequence
from itertools import accumulate, chain, repeat
from operator import attrgetter, itemgetter
from typing import Final

from schemas import columnar
from schemas.codec.compression import _bounded_decompress, _compressor
from schemas.codec.lastlabels import LastLabels
from schemas.codec.limits import (
    _METRIC_NAME_RE,
    _U32,
    INT64_MAX,
    Header,
    Limits,
    _check_label_names,
    _check_schema,
    _fail,
)
from schemas.model import Batch, Labels, ScrapeBlock, float_bits
from schemas.values import ValueDecoder, ValueEncoder

FORMAT_V2: Final = 2
CODEC_V2: Final = "columnar+zstd"

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


def _series_samples(batch: Batch) -> tuple[list[list[int]], Sequence[Sequence[float]], set[int]]:
    """Per series its timestamps (ascending, distinct) and values; plus timestamps of empty blocks.
    Values are float64 arrays where the blocks allow it: 8 bytes a sample, not a float object and
    its list slot (a recorder block of 12 cycles at 20,000 series is 240,000 samples).

    Two samples of one series at one timestamp (from two blocks) become one when their bit patterns
    are equal; different ones are refused (duplicate_sample): v2 has one value per series and time.
    """
    n = len(batch.labelsets)
    times: list[list[int]] = [[] for _ in range(n)]
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
            columns: list[array] = [array("d") for _ in range(n)]
            for b in blocks:
                series = b.series
                # C-level appends: one call per block instead of a Python loop per sample.
                deque(map(array.append, map(columns.__getitem__, series), b.values), maxlen=0)
                deque(map(list.append, map(times.__getitem__, series), repeat(b.timestamp_ms)), maxlen=0)
            return times, columns, empty
    values: list[Sequence[float]] = [[] for _ in range(n)]
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


# Consecutive batches of a node (one per scrape cycle) usually carry the same series in the same order.
_encode_labels_cached = LastLabels(_encode_labels_v2)


def encode_body(batch: Batch, level: int, limits: Limits) -> tuple[bytes, int, int, int]:
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
    values = ValueEncoder()
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
            if len(key) == 1:
                for s in members:
                    values.add_one(values_of[s][0])
            else:
                for s in members:
                    values.add(values_of[s])
    streams = (
        bytes(columnar.encode_times(table)),
        bytes(group_bytes),
        *_encode_labels_cached([labelsets[s] for s in order]),
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


def decode_body(header: Header, body: bytes, limits: Limits) -> Batch:
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
    decoder = ValueDecoder(streams[_VALUE_STREAMS])
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
