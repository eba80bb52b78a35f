"""Body of wire format version 3, "stream+zstd": one live frame coded against the state of the previous one.

A frame is one scrape cycle of a node (normally one block per target).  Label sets are named by ids
of a per-node dictionary that grows by the frame's additions; block membership, timestamps and
values are coded against the *reference state* (:class:`State`: what decoding the previous frame
left behind): values as decimal-scaled (or raw-bit) integers, each the delta of its delta ("dod")
against the series' last two values; anything else is an *exception* carrying the full integer.  A
*key frame* is coded against the empty state, so it decodes on its own.  Layout and choice:
``schemas/wire-format.md`` section 11 and ``docs/stream-codec.md``.

This module is the frame transform (``encode_frame`` / ``decode_frame``) and the v3 body framing;
``stream`` keeps the states (encoder, decoder, state messages).  ``decode_body`` (what ``envelope``
dispatches to) decodes key frames only: a delta frame needs state, so it raises ``need_state``.
Frames of several scrape cycles (windowed mode) have a layout of their own, kinds 0x02/0x03 on the
same state: ``v3_multicycle``; this module frames and dispatches them (``split_frame``, ``decode_kind``).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from schemas import columnar
from schemas.codec.compression import _bounded_decompress, _compressor
from schemas.codec.limits import _U32, INT64_MAX, Header, Limits, _fail
from schemas.codec.v2 import _encode_labels_v2, _read_labels_v2
from schemas.model import STALE_NAN, STALE_NAN_BITS, Batch, Labels, ScrapeBlock
from schemas.values import decimals

FORMAT_V3: Final = 3
CODEC_V3: Final = "stream+zstd"
SID_BYTES: Final = 16
NO_BASE: Final = bytes(SID_BYTES)  # the "state" a key frame is coded against
FRAME_KEY: Final = 0x00
FRAME_DELTA: Final = 0x01
FRAME_MC_KEY: Final = 0x02  # multi-cycle layout (``v3_multicycle``): a frame of several scrape cycles
FRAME_MC_DELTA: Final = 0x03
FRAME_KINDS: Final = frozenset((FRAME_KEY, FRAME_DELTA, FRAME_MC_KEY, FRAME_MC_DELTA))
# The reason a decoder gives for a frame kind it does not know: an ingester older than the encoder,
# not a broken frame (the relay stops stream coding for a while on it, as on an unknown version).
UNKNOWN_FRAME_KIND: Final = "unknown_codec"

# The sections of a frame's content, in wire order (each uvarint length + bytes).
V3_SECTIONS: Final = ("ADDED", "LMETA", "LSTRLEN", "LSTR", "LSCHEMA", "LIDS", "BLOCKS", "TS", "EXC", "DELTAS")

# Per-series value kind (state) and exception kind bytes: 0..22 decimal exponent, RAW the int64
# reading of the bit pattern, STALE (exceptions only) the stale marker, NONE (state only) no history.
KIND_RAW: Final = 0x1F
KIND_STALE: Final = 0x40
KIND_NONE: Final = 0xFF
BLOCK_MEMBERS: Final = 0x01  # block flag: membership differs from the reference block's
BLOCK_TIMESTAMPS: Final = 0x02  # block flag: explicit per-sample timestamps in TS
_BLOCK_FLAGS: Final = BLOCK_MEMBERS | BLOCK_TIMESTAMPS

_POW10: Final = columnar.POW10
_MAX_K: Final = columnar.MAX_EXPONENT
_MANT: Final = columnar.MAX_MANTISSA
_U64: Final = 1 << 64
_I64_MIN: Final = -(1 << 63)
_Q: Final = struct.Struct("<Q")
_D: Final = struct.Struct("<d")


@dataclass(slots=True)
class State:
    """What a delta frame is coded against: the dictionary, the blocks and the value history.

    ``sid`` names it (``state_id``): a chain hash of every frame since the key frame, so a frame
    meets exactly the state it was coded against or none at all.  Treated as immutable once built:
    coding a frame makes a new State (``derive``), so a failed frame leaves its base untouched.
    """

    node: str
    sid: bytes = NO_BASE
    labels: list[Labels] = field(default_factory=list)  # id -> label set
    index: dict[Labels, int] = field(default_factory=dict)  # label set -> id
    pairs: int = 0  # label pairs summed over the dictionary (bounded by max_label_pairs)
    blocks: list[tuple[int, list[int]]] = field(default_factory=list)  # (timestamp, coded ids)
    kinds: bytearray = field(default_factory=bytearray)  # id -> KIND_*
    ms: list[int] = field(default_factory=list)  # id -> last integer
    ds: list[int] = field(default_factory=list)  # id -> last delta

    def derive(self) -> State:
        return State(
            self.node,
            self.sid,
            list(self.labels),
            dict(self.index),
            self.pairs,
            list(self.blocks),
            bytearray(self.kinds),
            list(self.ms),
            list(self.ds),
        )

    def add_series(self, labels: Labels) -> int:
        i = len(self.labels)
        self.labels.append(labels)
        self.index[labels] = i
        self.pairs += len(labels)
        self.kinds.append(KIND_NONE)
        self.ms.append(0)
        self.ds.append(0)
        return i


def state_id(node: str, base: bytes, content: bytes) -> bytes:
    """The id of the state a frame leaves: blake2b-128 over node, base state id and frame content."""
    h = hashlib.blake2b(digest_size=SID_BYTES, person=b"erb-v3-state")
    h.update(node.encode("utf-8"))
    h.update(b"\x00")
    h.update(base)
    h.update(content)
    return h.digest()


def _zz(x: int) -> int:
    # zigzag for any Python int (columnar.zigzag assumes int64); callers bound the result.
    return x << 1 if x >= 0 else (-x << 1) - 1


def _as_decimal(v: float, bits: int, k: int) -> int | None:
    """m with m / 10**k bit-identical to v (bits), or None."""
    try:
        m = round(v * _POW10[k])
    except (ValueError, OverflowError):  # NaN, ±Inf
        return None
    if -_MANT < m < _MANT and m / _POW10[k] == v and (m or not bits):  # bits: -0.0 == 0.0
        return m
    return None


def _restart(v: float, bits: int, old: int) -> tuple[int, int]:
    """(kind, m) of a series whose history does not code this value: a decimal exponent no smaller
    than the old one (so 1.5 after 1.25 keeps k=2 and the next delta stays small), else raw bits."""
    need = decimals(v)
    if need is not None and need <= _MAX_K:
        for k in dict.fromkeys((max(need, old if old <= _MAX_K else 0), need)):
            m = _as_decimal(v, bits, k) if k <= _MAX_K else None
            if m is not None:
                return k, m
    return KIND_RAW, bits - _U64 if bits >> 63 else bits


def _put(out: bytearray, value: int) -> None:
    columnar.put_uvarint(out, value)


def encode_frame(base: State | None, batch: Batch, limits: Limits) -> tuple[bytes, State]:
    """(content, state after it) of ``batch`` coded against ``base`` (None: a key frame).

    ``batch`` must have passed ``validate_batch``.  Raises ``_Invalid`` (too_many_series,
    too_many_label_pairs) when the dictionary would outgrow its caps: the caller sends a key frame.
    """
    st = State(batch.node) if base is None else base.derive()
    added, to_id = _add_series(st, batch, limits)
    blocks_out = bytearray()
    ts_out = bytearray()
    _put(blocks_out, len(batch.scrapes))
    coded_ids: list[int] = []
    coded_vals: list[float] = []
    new_blocks: list[tuple[int, list[int]]] = []
    for j, block in enumerate(batch.scrapes):
        ref = st.blocks[j] if j < len(st.blocks) else (0, [])
        coded, values = _code_block(blocks_out, ts_out, block, to_id, ref)
        coded_ids += coded
        coded_vals += values
        new_blocks.append((block.timestamp_ms, coded))
    st.blocks = new_blocks
    exc, deltas = _encode_values(st, coded_ids, coded_vals)
    return _seal(st, base, batch.node, added, (bytes(blocks_out), bytes(ts_out), exc, deltas), limits)


def _add_series(st: State, batch: Batch, limits: Limits) -> tuple[list[Labels], list[int]]:
    """(label sets new to the dictionary, batch series index -> id), the dictionary grown in ``st``."""
    added: list[Labels] = []
    to_id: list[int] = []
    for labels in batch.labelsets:
        i = st.index.get(labels)
        if i is None:
            i = st.add_series(labels)
            added.append(labels)
        to_id.append(i)
    if len(st.labels) > limits.max_series:
        _fail("too_many_series", f"dictionary of {len(st.labels)} series > {limits.max_series}")
    if st.pairs > limits.max_label_pairs:
        _fail("too_many_label_pairs", f"dictionary of {st.pairs} label pairs > {limits.max_label_pairs}")
    return added, to_id


def _code_block(
    out: bytearray, ts_out: bytearray, block: ScrapeBlock, to_id: list[int], ref: tuple[int, list[int]]
) -> tuple[list[int], list[float]]:
    """Code one block against its reference block into BLOCKS (``out``) and TS: returns its coded
    ids (the reference's order, then the new members) and its values in that order."""
    ref_t, ref_ids = ref
    ids = list(map(to_id.__getitem__, block.series))
    flags = BLOCK_TIMESTAMPS if block.timestamps is not None else 0
    if len(ids) == len(ref_ids) and set(ids) == set(ref_ids):
        if ids == ref_ids:
            perm = None
        else:  # the reference's order: the decoder rebuilds membership from it
            where = dict(zip(ids, range(len(ids)), strict=True))
            perm = list(map(where.__getitem__, ref_ids))
        coded = ref_ids
    else:
        flags |= BLOCK_MEMBERS
        now = set(ids)
        before = set(ref_ids)
        gone = [p for p, i in enumerate(ref_ids) if i not in now]
        fresh = [i for i in ids if i not in before]
        coded = [i for i in ref_ids if i in now] + fresh
        where = dict(zip(ids, range(len(ids)), strict=True))
        perm = list(map(where.__getitem__, coded))
    _put(out, flags)
    _put(out, _zz(block.timestamp_ms - ref_t))
    if flags & BLOCK_MEMBERS:
        _put(out, len(gone))
        prev = -1
        for p in gone:
            _put(out, p - prev - 1)
            prev = p
        _put(out, len(fresh))
        for i in fresh:
            _put(out, i)
    values = block.values if perm is None else list(map(block.values.__getitem__, perm))
    if block.timestamps is not None:
        stamps = block.timestamps if perm is None else list(map(block.timestamps.__getitem__, perm))
        t = block.timestamp_ms
        for ts in stamps:
            _put(ts_out, _zz(ts - t))
    return coded, values


def _seal(
    st: State, base: State | None, node: str, added: list[Labels], rest: tuple[bytes, ...], limits: Limits
) -> tuple[bytes, State]:
    """The content (ADDED, the label sections, then ``rest``) and ``st`` named by its state id."""
    head = bytearray()
    _put(head, len(added))
    labels = _encode_labels_v2(added) if added else (b"",) * 5
    content = _sections((bytes(head), *labels, *rest))
    if len(content) > limits.max_decompressed_bytes:
        _fail("decompression_limit", f"frame of {len(content)} bytes; split the batch")
    st.sid = state_id(node, NO_BASE if base is None else base.sid, content)
    return content, st


def _encode_values(st: State, ids: list[int], values: list[float]) -> tuple[bytes, bytes]:
    """EXC and DELTAS of the coded samples, updating the value history of ``st`` as it goes."""
    kinds, ms, ds = st.kinds, st.ms, st.ds
    bits_col = columnar.f64_bits(values)
    exc = bytearray()
    deltas = bytearray()
    n_exc = 0
    last = -1
    pos = -1
    for i, v, b in zip(ids, values, bits_col, strict=True):
        pos += 1
        if b == STALE_NAN_BITS:  # history untouched: the series resumes where it stopped
            _put(exc, pos - last - 1)
            exc.append(KIND_STALE)
            last = pos
            n_exc += 1
            continue
        k = kinds[i]
        m: int | None
        if k <= _MAX_K:
            m = _as_decimal(v, b, k)
        elif k == KIND_RAW:
            m = b - _U64 if b >> 63 else b
        else:
            m = None
        if m is not None:
            x = m - ms[i] - ds[i]
            z = x << 1 if x >= 0 else (-x << 1) - 1  # _zz, inlined: this loop runs per sample
            if z < 0x80:
                deltas.append(z)
                ds[i] = m - ms[i]
                ms[i] = m
                continue
            if z < _U64:  # raw bits jumping across the sign bit can need more than 64 bits
                _put(deltas, z)
                ds[i] = m - ms[i]
                ms[i] = m
                continue
        k, m = _restart(v, b, k)
        _put(exc, pos - last - 1)
        exc.append(k)
        _put(exc, _zz(m))
        last = pos
        n_exc += 1
        kinds[i], ms[i], ds[i] = k, m, 0
    head = bytearray()
    _put(head, n_exc)
    return bytes(head + exc), bytes(deltas)


def _sections(parts: tuple[bytes, ...]) -> bytes:
    out = bytearray()
    for part in parts:
        _put(out, len(part))
        out += part
    return bytes(out)


def pack_body(base: State | None, content: bytes, level: int, *, multicycle: bool = False) -> bytes:
    """The v3 body: frame kind byte, the base state id (delta frames), one zstd frame of the content.
    ``multicycle``: the content is in the multi-cycle layout (``v3_multicycle``, kinds 0x02/0x03)."""
    if base is None:
        prefix = bytes((FRAME_MC_KEY if multicycle else FRAME_KEY,))
    else:
        prefix = bytes((FRAME_MC_DELTA if multicycle else FRAME_DELTA,)) + base.sid
    return prefix + _compressor(level).compress(content)


def split_frame(body: bytes) -> tuple[int, bytes | None, bytes]:
    """(frame kind, base state id or None for a key frame, the compressed content) of a v3 body."""
    if not body:
        _fail("malformed", "empty v3 body")
    kind = body[0]
    if kind in (FRAME_KEY, FRAME_MC_KEY):
        return kind, None, body[1:]
    if kind in (FRAME_DELTA, FRAME_MC_DELTA):
        if len(body) < 1 + SID_BYTES:
            _fail("malformed", "v3 delta frame shorter than its base state id")
        return kind, body[1 : 1 + SID_BYTES], body[1 + SID_BYTES :]
    _fail(UNKNOWN_FRAME_KIND, f"unknown v3 frame kind 0x{kind:02x}")


def split_body(body: bytes) -> tuple[bytes | None, bytes]:
    """(base state id or None for a key frame, the compressed content) of a v3 body."""
    _, base, compressed = split_frame(body)
    return base, compressed


def content_of(compressed: bytes, limits: Limits) -> bytes:
    return bytes(_bounded_decompress(compressed, limits.max_decompressed_bytes))


def decode_frame(base: State | None, header: Header, content: bytes, limits: Limits) -> tuple[Batch, State]:
    """(batch, state after it) of a frame's content decoded against ``base`` (None: a key frame).

    Every count is checked against its limit or against what the frame can hold before anything of
    that size is built; ``base`` is never modified.
    """
    st = State(header.node) if base is None else base.derive()
    parts = read_sections(content, V3_SECTIONS)
    read_added(st, parts, limits)
    blocks, ids = _read_blocks(st, parts[6], parts[7], limits)
    if len(ids) != header.sample_count:
        _fail("header_mismatch", f"header n={header.sample_count}, frame has {len(ids)} samples")
    values = _decode_values(st, ids, parts[8], parts[9])
    st.blocks = [(t, coded) for t, coded, _ in blocks]
    return finish(st, base, header, content, blocks, values)


def read_sections(content: bytes, names: tuple[str, ...]) -> list[bytes]:
    r = columnar.Reader(content, "frame")
    parts = []
    for name in names:
        if not r.remaining():
            _fail("malformed", f"frame ends before section {name}")
        size = r.uvarint()
        parts.append(r.take(size))
    r.done()
    return parts


def read_added(st: State, parts: list[bytes], limits: Limits) -> None:
    """ADDED and the label sections (``parts[0:6]``): the new series, added to ``st``'s dictionary."""
    added_reader = columnar.Reader(parts[0], "ADDED")
    n_added = added_reader.count(limits.max_series - len(st.labels), "too_many_series", "new series")
    added_reader.done()
    if n_added:
        for labels in _read_labels_v2(parts[1:6], n_added, limits):
            if labels in st.index:
                _fail("duplicate_series", "a new series is already in the dictionary")
            st.add_series(labels)
        if st.pairs > limits.max_label_pairs:
            _fail("too_many_label_pairs", f"dictionary of more than {limits.max_label_pairs} label pairs")
    elif any(parts[1:6]):
        _fail("length_mismatch", "label sections without new series")


def finish(
    st: State, base: State | None, header: Header, content: bytes, blocks: list[_Block], values: list[float]
) -> tuple[Batch, State]:
    """The batch of the decoded blocks and values (checked against the header) and ``st`` named."""
    # The batch names only the series this frame uses, in first-use order.
    local: dict[int, int] = {}
    out_blocks = []
    pos = 0
    lo, hi = INT64_MAX, 0
    for t, coded, stamps in blocks:
        n = len(coded)
        series = array(_U32, [local.setdefault(i, len(local)) for i in coded])
        ts_col = None if stamps is None else array("q", stamps)
        if ts_col:
            lo, hi = min(lo, min(ts_col)), max(hi, max(ts_col))
        else:  # as Batch.first_timestamp_ms: a block without samples counts with its own timestamp
            lo, hi = min(lo, t), max(hi, t)
        out_blocks.append(ScrapeBlock(t, series, array("d", values[pos : pos + n]), ts_col))
        pos += n
    bounds = (lo, hi) if lo <= hi else (0, 0)
    if bounds != (header.first_ts_ms, header.last_ts_ms):
        _fail(
            "header_mismatch",
            f"header t0..t1={header.first_ts_ms}..{header.last_ts_ms}, frame has {bounds[0]}..{bounds[1]}",
        )
    st.sid = state_id(header.node, NO_BASE if base is None else base.sid, content)
    labelsets = [st.labels[i] for i in local]
    return Batch(header.cluster, header.node, header.seq, labelsets, out_blocks), st


_Block = tuple[int, list[int], list[int] | None]  # (timestamp, coded ids, explicit timestamps)


def _read_blocks(st: State, buf: bytes, ts_buf: bytes, limits: Limits) -> tuple[list[_Block], list[int]]:
    """BLOCKS and TS: the blocks and all their coded ids, in order."""
    r = columnar.Reader(buf, "BLOCKS")
    tr = columnar.Reader(ts_buf, "TS")
    n_blocks = r.count(limits.max_scrapes, "too_many_scrapes", "blocks")
    blocks: list[_Block] = []
    ids: list[int] = []
    for j in range(n_blocks):
        block = read_block(r, tr, j, st.blocks[j] if j < len(st.blocks) else (0, []), len(st.labels))
        if len(ids) + len(block[1]) > limits.max_samples:
            _fail("too_many_samples", f"more than {limits.max_samples} samples")
        ids += block[1]
        blocks.append(block)
    r.done()
    tr.done()
    return blocks, ids


def read_block(
    r: columnar.Reader, tr: columnar.Reader, j: int, ref: tuple[int, list[int]], n_dict: int
) -> _Block:
    """Block ``j`` from BLOCKS (``r``) and TS (``tr``), coded against its reference block ``ref``."""
    ref_t, ref_ids = ref
    flags = r.uvarint()
    if flags & ~_BLOCK_FLAGS:
        _fail("malformed", f"BLOCKS: unknown block flags 0x{flags:x}")
    t = ref_t + columnar.unzigzag(r.uvarint())
    if not 0 <= t <= INT64_MAX:
        _fail("bad_timestamp", f"BLOCKS: timestamp {t} outside 0..2^63-1")
    if flags & BLOCK_MEMBERS:
        n_gone = r.count(len(ref_ids), "bad_index", "removed series")
        gone = set()
        p = -1
        for _ in range(n_gone):
            p += r.uvarint() + 1
            if p >= len(ref_ids):
                _fail("bad_index", f"BLOCKS: removed position {p} >= {len(ref_ids)}")
            gone.add(p)
        # Every id takes a byte, and the frame's samples are capped: both before the list exists.
        n_fresh = r.count(min(n_dict, r.remaining()), "bad_index", "new block members")
        fresh = r.uvarints(n_fresh)
        if fresh and max(fresh) >= n_dict:
            _fail("bad_index", f"BLOCKS: series id {max(fresh)} >= {n_dict} in the dictionary")
        coded = [i for p, i in enumerate(ref_ids) if p not in gone] + fresh
        if len(set(coded)) != len(coded):
            _fail("duplicate_sample", f"BLOCKS: a series twice in block {j}")
    else:
        coded = ref_ids
    stamps = None
    if flags & BLOCK_TIMESTAMPS:
        stamps = [t + columnar.unzigzag(z) for z in tr.uvarints(len(coded))]
        if stamps and not (min(stamps) >= 0 and max(stamps) <= INT64_MAX):
            _fail("bad_timestamp", "TS: a timestamp outside 0..2^63-1")
    return t, coded, stamps


def _decode_values(st: State, ids: list[int], exc_buf: bytes, delta_buf: bytes) -> list[float]:
    total = len(ids)
    exc, n_exc = read_exceptions(exc_buf, total)
    dr = columnar.Reader(delta_buf, "DELTAS")
    deltas = iter(dr.uvarints(total - n_exc))
    dr.done()
    kinds, ms, ds = st.kinds, st.ms, st.ds
    out: list[float] = []
    append = out.append
    for pos, i in enumerate(ids):
        e = exc.get(pos)
        if e is None:
            k = kinds[i]
            if k == KIND_NONE:
                _fail("malformed", f"DELTAS: a delta for series {i}, which has no history")
            m = ms[i] + ds[i] + columnar.unzigzag(next(deltas))
            if not _in_range(k, m):
                _fail("malformed", f"DELTAS: series {i} leaves its integer range")
            ds[i] = m - ms[i]
            ms[i] = m
        else:
            k, m = e
            if k == KIND_STALE:
                append(STALE_NAN)
                continue
            kinds[i], ms[i], ds[i] = k, m, 0
        append(m / _POW10[k] if k <= _MAX_K else _D.unpack(_Q.pack(m % _U64))[0])
    return out


def read_exceptions(exc_buf: bytes, total: int) -> tuple[dict[int, tuple[int, int]], int]:
    """EXC: position -> (kind, integer) of the exceptions among ``total`` samples, and their count."""
    er = columnar.Reader(exc_buf, "EXC")
    n_exc = er.count(total, "length_mismatch", "exceptions for fewer samples")
    exc: dict[int, tuple[int, int]] = {}
    pos = -1
    for _ in range(n_exc):
        pos += er.uvarint() + 1
        if pos >= total:
            _fail("bad_index", f"EXC: exception at sample {pos} of {total}")
        kind = er.take(1)[0]
        if kind == KIND_STALE:
            exc[pos] = (kind, 0)
            continue
        m = columnar.unzigzag(er.uvarint())
        if not _in_range(kind, m):
            _fail("malformed", f"EXC: kind 0x{kind:02x} with integer {m}")
        exc[pos] = (kind, m)
    er.done()
    return exc, n_exc


def _in_range(kind: int, m: int) -> bool:
    if kind <= _MAX_K:
        return -_MANT < m < _MANT
    return kind == KIND_RAW and _I64_MIN <= m <= INT64_MAX


# --------------------------------------------------------------------------------------------------
# What ``envelope`` dispatches to: a self-contained key frame, the only v3 frame decodable alone.


def encode_body(batch: Batch, level: int, limits: Limits) -> tuple[bytes, int, int, int]:
    """(body, n, t0, t1) of a v3 key frame."""
    content, _ = encode_frame(None, batch, limits)
    return (
        pack_body(None, content, level),
        batch.sample_count,
        batch.first_timestamp_ms,
        batch.last_timestamp_ms,
    )


def decode_body(header: Header, body: bytes, limits: Limits) -> Batch:
    kind, base, compressed = split_frame(body)
    if base is not None:
        _fail("need_state", f"delta frame against state {base.hex()}: decode it with a StreamDecoder")
    batch, _ = decode_kind(kind)(None, header, content_of(compressed, limits), limits)
    return batch


_FrameDecoder = Callable[[State | None, Header, bytes, Limits], tuple[Batch, State]]


def decode_kind(kind: int) -> _FrameDecoder:
    """The content decoder of frame ``kind`` (one of FRAME_KINDS, as ``split_frame`` returns)."""
    if kind in (FRAME_MC_KEY, FRAME_MC_DELTA):
        from schemas.codec import v3_multicycle  # it builds on this module

        return v3_multicycle.decode_frame
    return decode_frame
