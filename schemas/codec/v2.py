"""Body of wire format version 2, "columnar+zstd" (the layout is in ``schemas/wire-format.md``).

15 separately zstd-compressed streams: timestamp table, series groups, label sets as dictionary
columns, values as decimal-scaled or raw integer deltas, XOR words; built for batches that hold many
scrapes of the same series.  The transforms are in ``schemas/columnar.py`` (left outside this package:
they are byte-level building blocks with their own tests, and a body format is their only user
here); the label streams are ``label_columns``' (v3 codes its dictionary in the same layout).
``encode_body`` and ``decode_body`` are what ``envelope`` dispatches to for version 2; ``pack_streams``
and ``split_streams`` frame the streams (the golden vectors and the tests craft bodies with them).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from typing import Final

from schemas import columnar
from schemas.codec.columns import U32
from schemas.codec.compression import bounded_decompress, compressor
from schemas.codec.errors import refuse
from schemas.codec.header import Header
from schemas.codec.label_columns import encode_labels, read_labels
from schemas.codec.lastlabels import LastLabels
from schemas.codec.limits import INT64_MAX, Limits
from schemas.model import Batch, ScrapeBlock, float_bits
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
                        refuse("duplicate_sample", f"series {s} has two values at {t}")
                    continue
                kept.append((t, v))
            found = kept
        times[s] = [t for t, _ in found]
        values[s] = [v for _, v in found]
    return times, values, empty


# Consecutive batches of a node (one per scrape cycle) usually carry the same series in the same order.
_encode_labels_cached = LastLabels(encode_labels)


def encode_body(batch: Batch, level: int, limits: Limits) -> tuple[bytes, int, int, int]:
    """(body, n, t0, t1) of a v2 envelope."""
    times_of, values_of, empty = _series_samples(batch)
    table = sorted(set(chain.from_iterable(times_of)) | empty)
    if len(table) > limits.max_scrapes:
        refuse("too_many_scrapes", f"{len(table)} distinct timestamps > {limits.max_scrapes}")
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
        refuse("decompression_limit", f"body of {size} bytes; split the batch")
    return pack_streams(streams, level), n, (table[0] if table else 0), (table[-1] if table else 0)


def pack_streams(streams: Sequence[bytes], level: int) -> bytes:
    """Each stream as uvarint(length) + one zstd frame (length 0: the stream is empty)."""
    comp = compressor(level)
    out = bytearray()
    for raw in streams:
        frame = comp.compress(raw) if raw else b""
        columnar.put_uvarint(out, len(frame))
        out += frame
    return bytes(out)


def split_streams(body: bytes, limits: Limits) -> list[bytes]:
    """Split a v2 body into its decompressed streams, all of them within max_decompressed_bytes."""
    reader = columnar.Reader(body, "body")
    budget = limits.max_decompressed_bytes
    out: list[bytes] = []
    for name in V2_STREAMS:
        if not reader.remaining():
            refuse("malformed", f"body ends before stream {name}")
        size = reader.uvarint()
        if size > reader.remaining():
            refuse("malformed", f"stream {name}: {size} bytes announced, {reader.remaining()} left")
        if not size:
            out.append(b"")
            continue
        raw = bytes(bounded_decompress(reader.take(size), budget))
        budget -= len(raw)
        out.append(raw)
    if reader.remaining():
        refuse("malformed", f"{reader.remaining()} bytes after the last stream")
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
            refuse("malformed", "GROUPS: a group without series")
        series += size
        if series > limits.max_series:
            refuse("too_many_series", f"more than {limits.max_series} series")
        # A run holds at least one index, so more runs than timestamps cannot be valid.
        runs = reader.count(n_times, "bad_index", "runs")
        indices: list[int] = []
        end = 0
        for r in range(runs):
            gap = reader.uvarint()
            length = reader.uvarint()
            if not length or (r and not gap):
                refuse("malformed", "GROUPS: empty run, or runs not separated")
            start = end + gap
            end = start + length
            if end > n_times:
                refuse("bad_index", f"GROUPS: timestamp index {end - 1} >= {n_times} timestamps")
            # Checked per run, before the run's indices exist: a claim of 10^9 samples fails here.
            samples += size * length
            if samples > limits.max_samples:
                refuse("too_many_samples", f"more than {limits.max_samples} samples")
            indices.extend(range(start, end))
        groups.append((size, indices))
    reader.done()
    return groups, series, samples


def decode_body(header: Header, body: bytes, limits: Limits) -> Batch:
    streams = split_streams(body, limits)
    times = columnar.decode_times(streams[0], limits.max_scrapes, INT64_MAX)
    bounds = (times[0], times[-1]) if times else (0, 0)
    if bounds != (header.first_ts_ms, header.last_ts_ms):
        refuse(
            "header_mismatch",
            f"header t0..t1={header.first_ts_ms}..{header.last_ts_ms}, body has {bounds[0]}..{bounds[1]}",
        )
    groups, n_series, n_samples = _read_groups(streams[1], len(times), limits)
    if n_samples != header.sample_count:
        refuse("header_mismatch", f"header n={header.sample_count}, body has {n_samples} samples")
    labelsets = read_labels(streams[2:7], n_series, limits)
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
            ids = array(U32, range(first, first + size))
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
        series = array(U32)
        values = array("d")
        for ids, matrix, j, width in found:
            series += ids
            values += matrix[j::width]
        blocks.append(ScrapeBlock(t, series, values))
    return Batch(header.cluster, header.node, header.seq, labelsets, blocks)
