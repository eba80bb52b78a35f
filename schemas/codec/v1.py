"""Body of wire format version 1, "msgpack+zstd".

One zstd frame of msgpack({"labelsets": [...], "scrapes": [...]}), sample columns as raw
little-endian bytes so every float64 bit pattern (the Prometheus stale marker in particular) survives
unchanged.  ``encode_body`` and ``decode_body`` are what ``envelope`` dispatches to for version 1.
"""

from __future__ import annotations

import io
from itertools import chain
from typing import Any, Final

import msgpack

from schemas.codec.columns import U32, check_block_columns, column_from_bytes, column_to_bytes
from schemas.codec.compression import bounded_decompress, compressor
from schemas.codec.errors import refuse
from schemas.codec.header import Header, check_timestamp
from schemas.codec.labels import LabelChecker
from schemas.codec.lastlabels import LastLabels
from schemas.codec.limits import Limits
from schemas.codec.parsing import refuse_msgpack_error, strict_map
from schemas.model import Batch, Labels, ScrapeBlock

FORMAT_V1: Final = 1
CODEC_V1: Final = "msgpack+zstd"
_BODY_READ_SIZE: Final = 64 << 10


# Packed label sets by label set. The edge writes a live cycle's rows as v1 (the quickest form to
# write), and a cycle's series are mostly the last cycle's: a label set is packed once, not every
# cycle (0.8 -> 0.15 us a sample on the simulator's workload). Two generations, the older dropped
# every GENERATION bodies, so what it holds is the live series plus a few bodies' churn, never every
# series a node ever had; only a cost, never a difference in the bytes. (16 bodies held ~2.4 times the
# live series at 20,000 series on the simulator, 15 MiB; 4 bodies, a cycle's row and the flight
# recorder's block among them, re-pack only what churned since.)
GENERATION: Final = 4
# Raw bodies up to this size are joined and compressed at once (the golden vectors' exact bytes).
_JOIN_MAX_BYTES: Final = 1 << 20
_LABEL_PIECE: Final = 1024  # label sets joined per piece fed to the compressor above that size
_packed: dict[Labels, bytes] = {}
_packed_before: dict[Labels, bytes] = {}
_bodies = 0


def _next_body() -> None:
    global _packed, _packed_before, _bodies
    _bodies += 1
    if _bodies >= GENERATION:
        _packed_before, _packed, _bodies = _packed, {}, 0


def cached_label_sets() -> int:
    """Label sets the packing cache holds now: at most two generations of GENERATION bodies' worth."""
    return len(_packed) + len(_packed_before)


def _packed_labels(labels: Labels) -> bytes:
    try:
        packed = _packed.get(labels)
    except TypeError:  # a label set of lists (not hashable): packed every time
        return _pack_labels(labels)
    if packed is None:
        packed = _packed_before.get(labels)
        if packed is None:
            packed = _pack_labels(labels)
        _packed[labels] = packed
    return packed


def _pack_labels(labels: Labels) -> bytes:
    return msgpack.packb([part for pair in labels for part in pair], use_bin_type=True)  # flat k, v, ...


def body_parts(batch: Batch) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """msgpack({"labelsets": [...], "scrapes": [...]}) as (head, label sets, tail), written piecewise
    so that each label set's packed bytes come from the cache; joined in that order, byte for byte
    what packing the whole map writes."""
    packer = msgpack.Packer(use_bin_type=True)
    # Each scrape packed as it is built (a list's array header, then its items: the same bytes), so
    # its columns are not held twice.
    tail = [packer.pack("scrapes"), packer.pack_array_header(len(batch.scrapes))]
    for block in batch.scrapes:
        scrape: dict[str, Any] = {
            "t": block.timestamp_ms,
            "s": column_to_bytes(U32, block.series),
            "v": column_to_bytes("d", block.values),
        }
        if block.timestamps is not None:
            scrape["ts"] = column_to_bytes("q", block.timestamps)
        tail.append(packer.pack(scrape))
    _next_body()
    head = [
        packer.pack_map_header(2),
        packer.pack("labelsets"),
        packer.pack_array_header(len(batch.labelsets)),
    ]
    return head, _labels_part(batch.labelsets), tail


# The last body's packed label sets: the cache's own bytes objects, so the list costs a pointer each.
_labels_part = LastLabels(lambda labelsets: list(map(_packed_labels, labelsets)))


def encode_body(batch: Batch, level: int, limits: Limits) -> tuple[bytes, int, int, int]:
    """(body, n, t0, t1) of a v1 envelope."""
    head, labels, tail = body_parts(batch)
    size = sum(map(len, chain(head, labels, tail)))
    if size > limits.max_decompressed_bytes:
        refuse("decompression_limit", f"body of {size} bytes; split the batch")
    comp = compressor(level)
    if size <= _JOIN_MAX_BYTES:
        body = comp.compress(b"".join(chain(head, labels, tail)))
    else:
        # Fed to the compressor piece by piece, never joined: at 20,000 series a cycle's raw body is
        # ~6 MB, almost all label sets. (The frame may differ from a one-shot compression's by a few
        # bytes; it decodes to the same body.)
        stream = comp.compressobj(size=size)
        out = [stream.compress(b"".join(head))]
        for i in range(0, len(labels), _LABEL_PIECE):
            out.append(stream.compress(b"".join(labels[i : i + _LABEL_PIECE])))
        out += [*map(stream.compress, tail), stream.flush()]
        body = b"".join(out)
    return body, batch.sample_count, batch.first_timestamp_ms, batch.last_timestamp_ms


def decode_body(header: Header, body: bytes, limits: Limits) -> Batch:
    raw = bounded_decompress(body, limits.max_decompressed_bytes)
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
        object_pairs_hook=strict_map,
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
            refuse("malformed", f"{size - unpacker.tell()} bytes after the body")
    except (msgpack.OutOfData, msgpack.exceptions.BufferFull):
        # BufferFull: a body shorter than the header it starts (the buffer is capped at its size).
        refuse("malformed", "body ends early")
    except ValueError as exc:
        refuse_msgpack_error(exc, "body")
    batch = Batch(header.cluster, header.node, header.seq, labelsets, scrapes)
    total = batch.sample_count
    if total != header.sample_count:
        refuse("header_mismatch", f"header n={header.sample_count}, body has {total} samples")
    first, last = batch.first_timestamp_ms, batch.last_timestamp_ms
    if (first, last) != (header.first_ts_ms, header.last_ts_ms):
        refuse(
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
            refuse("malformed", f"unknown or repeated body key {str(key)[:64]!r}")
    if labelsets is None or raw_scrapes is None:
        refuse("malformed", "body needs both labelsets and scrapes")
    scrapes = []
    for i, (t, s, v, ts) in enumerate(raw_scrapes):
        series = column_from_bytes(U32, s)
        values = column_from_bytes("d", v)
        timestamps = None if ts is None else column_from_bytes("q", ts)
        check_block_columns(series, values, timestamps, len(labelsets), i)
        scrapes.append(ScrapeBlock(t, series, values, timestamps))
    return labelsets, scrapes


def _read_labelsets(unpacker: msgpack.Unpacker, limits: Limits) -> list[Labels]:
    count = unpacker.read_array_header()
    if count > limits.max_series:
        refuse("too_many_series", f"{count} series > {limits.max_series}")
    labelsets: list[Labels] = []
    checker = LabelChecker(limits)
    # Equal (name, value) pairs are shared between series to keep big batches small in memory.
    shared: dict[tuple[str, str], tuple[str, str]] = {}
    budget = limits.max_label_pairs
    for _ in range(count):
        flat = unpacker.unpack()
        if type(flat) is not tuple:
            refuse("malformed", "a label set must be an array")
        if len(flat) % 2:
            refuse("malformed", "a label set array must have an even length")
        budget -= len(flat) // 2
        if budget < 0:
            refuse("too_many_label_pairs", f"more than {limits.max_label_pairs} labels in the batch")
        names, values = flat[0::2], flat[1::2]
        checker.check(names, values)
        labelsets.append(tuple([shared.setdefault(p, p) for p in zip(names, values, strict=True)]))
    if len(set(labelsets)) != len(labelsets):
        refuse("duplicate_series", "the same label set appears twice")
    return labelsets


def _read_scrapes(unpacker: msgpack.Unpacker, limits: Limits) -> list[_RawScrape]:
    count = unpacker.read_array_header()
    if count > limits.max_scrapes:
        refuse("too_many_scrapes", f"{count} scrapes > {limits.max_scrapes}")
    out: list[_RawScrape] = []
    total = 0
    for i in range(count):
        sc = unpacker.unpack()
        if type(sc) is not dict:
            refuse("malformed", f"scrape {i} is not a map")
        if not {"t", "s", "v"} <= sc.keys() or not sc.keys() <= {"t", "s", "v", "ts"}:
            refuse("malformed", f"scrape {i} keys {sorted(map(str, sc))}: need t, s, v and optional ts")
        t = check_timestamp(sc["t"], f"scrape {i} t")
        s, v, ts = sc["s"], sc["v"], sc.get("ts")
        if type(s) is not bytes or type(v) is not bytes or ("ts" in sc and type(ts) is not bytes):
            refuse("malformed", f"scrape {i}: s, v and ts must be bytes")
        if len(s) % 4 or len(v) % 8 or (ts is not None and len(ts) % 8):
            refuse("length_mismatch", f"scrape {i}: column byte length not a multiple of its item size")
        total += len(v) // 8
        if total > limits.max_samples:
            refuse("too_many_samples", f"more than {limits.max_samples} samples")
        out.append((t, s, v, ts))
    return out
