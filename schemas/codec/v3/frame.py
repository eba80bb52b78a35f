"""A v3 frame: its body (kind, base state id, zstd content) and the content both layouts share.

The body is a frame kind byte (``FRAME_*``), for a delta frame the id of the state it is coded
against, and the content compressed as one zstd frame.  The content is a list of sections, each a
uvarint length and its bytes.  Both layouts (``single``: one scrape cycle, ``multicycle``: several)
start with the same ones, ``HEAD_SECTIONS``: ADDED and the five label sections (the series new to
the dictionary), BLOCKS and TS (each block's timestamp, membership and explicit timestamps coded
against a reference block) and EXC (the values the history cannot code); what follows them, and
which block is a block's reference, is the layout's.  ``seal`` closes the encoding of a frame
(content and state id), ``finish`` the decoding (the batch, checked against the header).
"""

from __future__ import annotations

from array import array
from typing import Final

from schemas import columnar
from schemas.codec.columns import U32
from schemas.codec.compression import bounded_decompress, compressor
from schemas.codec.errors import refuse
from schemas.codec.header import Header
from schemas.codec.label_columns import encode_labels, read_labels
from schemas.codec.limits import INT64_MAX, Limits
from schemas.codec.v3.state import KIND_STALE, NO_BASE, SID_BYTES, State, in_range, state_id, zigzag_int
from schemas.columnar import put_uvarint
from schemas.model import Batch, Labels, ScrapeBlock

FORMAT_V3: Final = 3
CODEC_V3: Final = "stream+zstd"
FRAME_KEY: Final = 0x00
FRAME_DELTA: Final = 0x01
FRAME_MC_KEY: Final = 0x02  # multi-cycle layout (``multicycle``): a frame of several scrape cycles
FRAME_MC_DELTA: Final = 0x03
FRAME_KINDS: Final = frozenset((FRAME_KEY, FRAME_DELTA, FRAME_MC_KEY, FRAME_MC_DELTA))
# The reason a decoder gives for a frame kind it does not know: an ingester older than the encoder,
# not a broken frame (the relay stops stream coding for a while on it, as on an unknown version).
UNKNOWN_FRAME_KIND: Final = "unknown_codec"

# The sections every frame's content starts with, in wire order (each uvarint length + bytes).
HEAD_SECTIONS: Final = ("ADDED", "LMETA", "LSTRLEN", "LSTR", "LSCHEMA", "LIDS", "BLOCKS", "TS", "EXC")

BLOCK_MEMBERS: Final = 0x01  # block flag: membership differs from the reference block's
BLOCK_TIMESTAMPS: Final = 0x02  # block flag: explicit per-sample timestamps in TS
_BLOCK_FLAGS: Final = BLOCK_MEMBERS | BLOCK_TIMESTAMPS


def pack_body(base: State | None, content: bytes, level: int, *, multicycle: bool = False) -> bytes:
    """The v3 body: frame kind byte, the base state id (delta frames), one zstd frame of the content.
    ``multicycle``: the content is in the multi-cycle layout (module ``multicycle``, kinds 0x02/0x03)."""
    if base is None:
        prefix = bytes((FRAME_MC_KEY if multicycle else FRAME_KEY,))
    else:
        prefix = bytes((FRAME_MC_DELTA if multicycle else FRAME_DELTA,)) + base.sid
    return prefix + compressor(level).compress(content)


def split_frame(body: bytes) -> tuple[int, bytes | None, bytes]:
    """(frame kind, base state id or None for a key frame, the compressed content) of a v3 body."""
    if not body:
        refuse("malformed", "empty v3 body")
    kind = body[0]
    if kind in (FRAME_KEY, FRAME_MC_KEY):
        return kind, None, body[1:]
    if kind in (FRAME_DELTA, FRAME_MC_DELTA):
        if len(body) < 1 + SID_BYTES:
            refuse("malformed", "v3 delta frame shorter than its base state id")
        return kind, body[1 : 1 + SID_BYTES], body[1 + SID_BYTES :]
    refuse(UNKNOWN_FRAME_KIND, f"unknown v3 frame kind 0x{kind:02x}")


def split_body(body: bytes) -> tuple[bytes | None, bytes]:
    """(base state id or None for a key frame, the compressed content) of a v3 body."""
    _, base, compressed = split_frame(body)
    return base, compressed


def content_of(compressed: bytes, limits: Limits) -> bytes:
    return bytes(bounded_decompress(compressed, limits.max_decompressed_bytes))


def join_sections(parts: tuple[bytes, ...]) -> bytes:
    out = bytearray()
    for part in parts:
        put_uvarint(out, len(part))
        out += part
    return bytes(out)


def read_sections(content: bytes, names: tuple[str, ...]) -> list[bytes]:
    r = columnar.Reader(content, "frame")
    parts = []
    for name in names:
        if not r.remaining():
            refuse("malformed", f"frame ends before section {name}")
        size = r.uvarint()
        parts.append(r.take(size))
    r.done()
    return parts


def add_series(st: State, batch: Batch, limits: Limits) -> tuple[list[Labels], list[int]]:
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
        refuse("too_many_series", f"dictionary of {len(st.labels)} series > {limits.max_series}")
    if st.pairs > limits.max_label_pairs:
        refuse("too_many_label_pairs", f"dictionary of {st.pairs} label pairs > {limits.max_label_pairs}")
    return added, to_id


def code_block(
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
    put_uvarint(out, flags)
    put_uvarint(out, zigzag_int(block.timestamp_ms - ref_t))
    if flags & BLOCK_MEMBERS:
        put_uvarint(out, len(gone))
        prev = -1
        for p in gone:
            put_uvarint(out, p - prev - 1)
            prev = p
        put_uvarint(out, len(fresh))
        for i in fresh:
            put_uvarint(out, i)
    values = block.values if perm is None else list(map(block.values.__getitem__, perm))
    if block.timestamps is not None:
        stamps = block.timestamps if perm is None else list(map(block.timestamps.__getitem__, perm))
        t = block.timestamp_ms
        for ts in stamps:
            put_uvarint(ts_out, zigzag_int(ts - t))
    return coded, values


def seal(
    st: State, base: State | None, node: str, added: list[Labels], rest: tuple[bytes, ...], limits: Limits
) -> tuple[bytes, State]:
    """The content (ADDED, the label sections, then ``rest``) and ``st`` named by its state id."""
    head = bytearray()
    put_uvarint(head, len(added))
    labels = encode_labels(added) if added else (b"",) * 5
    content = join_sections((bytes(head), *labels, *rest))
    if len(content) > limits.max_decompressed_bytes:
        refuse("decompression_limit", f"frame of {len(content)} bytes; split the batch")
    st.sid = state_id(node, NO_BASE if base is None else base.sid, content)
    return content, st


# --------------------------------------------------------------------------------------------------
# Decoding the shared sections


def read_added(st: State, parts: list[bytes], limits: Limits) -> None:
    """ADDED and the label sections (``parts[0:6]``): the new series, added to ``st``'s dictionary."""
    added_reader = columnar.Reader(parts[0], "ADDED")
    n_added = added_reader.count(limits.max_series - len(st.labels), "too_many_series", "new series")
    added_reader.done()
    if n_added:
        for labels in read_labels(parts[1:6], n_added, limits):
            if labels in st.index:
                refuse("duplicate_series", "a new series is already in the dictionary")
            st.add_series(labels)
        if st.pairs > limits.max_label_pairs:
            refuse("too_many_label_pairs", f"dictionary of more than {limits.max_label_pairs} label pairs")
    elif any(parts[1:6]):
        refuse("length_mismatch", "label sections without new series")


Block = tuple[int, list[int], list[int] | None]  # (timestamp, coded ids, explicit timestamps)


def read_block(
    r: columnar.Reader, tr: columnar.Reader, j: int, ref: tuple[int, list[int]], n_dict: int
) -> Block:
    """Block ``j`` from BLOCKS (``r``) and TS (``tr``), coded against its reference block ``ref``."""
    ref_t, ref_ids = ref
    flags = r.uvarint()
    if flags & ~_BLOCK_FLAGS:
        refuse("malformed", f"BLOCKS: unknown block flags 0x{flags:x}")
    t = ref_t + columnar.unzigzag(r.uvarint())
    if not 0 <= t <= INT64_MAX:
        refuse("bad_timestamp", f"BLOCKS: timestamp {t} outside 0..2^63-1")
    if flags & BLOCK_MEMBERS:
        n_gone = r.count(len(ref_ids), "bad_index", "removed series")
        gone = set()
        p = -1
        for _ in range(n_gone):
            p += r.uvarint() + 1
            if p >= len(ref_ids):
                refuse("bad_index", f"BLOCKS: removed position {p} >= {len(ref_ids)}")
            gone.add(p)
        # Every id takes a byte, and the frame's samples are capped: both before the list exists.
        n_fresh = r.count(min(n_dict, r.remaining()), "bad_index", "new block members")
        fresh = r.uvarints(n_fresh)
        if fresh and max(fresh) >= n_dict:
            refuse("bad_index", f"BLOCKS: series id {max(fresh)} >= {n_dict} in the dictionary")
        coded = [i for p, i in enumerate(ref_ids) if p not in gone] + fresh
        if len(set(coded)) != len(coded):
            refuse("duplicate_sample", f"BLOCKS: a series twice in block {j}")
    else:
        coded = ref_ids
    stamps = None
    if flags & BLOCK_TIMESTAMPS:
        stamps = [t + columnar.unzigzag(z) for z in tr.uvarints(len(coded))]
        if stamps and not (min(stamps) >= 0 and max(stamps) <= INT64_MAX):
            refuse("bad_timestamp", "TS: a timestamp outside 0..2^63-1")
    return t, coded, stamps


def read_exceptions(exc_buf: bytes, total: int) -> tuple[dict[int, tuple[int, int]], int]:
    """EXC: position -> (kind, integer) of the exceptions among ``total`` samples, and their count."""
    er = columnar.Reader(exc_buf, "EXC")
    n_exc = er.count(total, "length_mismatch", "exceptions for fewer samples")
    exc: dict[int, tuple[int, int]] = {}
    pos = -1
    for _ in range(n_exc):
        pos += er.uvarint() + 1
        if pos >= total:
            refuse("bad_index", f"EXC: exception at sample {pos} of {total}")
        kind = er.take(1)[0]
        if kind == KIND_STALE:
            exc[pos] = (kind, 0)
            continue
        m = columnar.unzigzag(er.uvarint())
        if not in_range(kind, m):
            refuse("malformed", f"EXC: kind 0x{kind:02x} with integer {m}")
        exc[pos] = (kind, m)
    er.done()
    return exc, n_exc


def finish(
    st: State, base: State | None, header: Header, content: bytes, blocks: list[Block], values: list[float]
) -> tuple[Batch, State]:
    """The batch of the decoded blocks and values (checked against the header) and ``st`` named."""
    # The batch names only the series this frame uses, in first-use order.
    local: dict[int, int] = {}
    out_blocks = []
    pos = 0
    lo, hi = INT64_MAX, 0
    for t, coded, stamps in blocks:
        n = len(coded)
        series = array(U32, [local.setdefault(i, len(local)) for i in coded])
        ts_col = None if stamps is None else array("q", stamps)
        if ts_col:
            lo, hi = min(lo, min(ts_col)), max(hi, max(ts_col))
        else:  # as Batch.first_timestamp_ms: a block without samples counts with its own timestamp
            lo, hi = min(lo, t), max(hi, t)
        out_blocks.append(ScrapeBlock(t, series, array("d", values[pos : pos + n]), ts_col))
        pos += n
    bounds = (lo, hi) if lo <= hi else (0, 0)
    if bounds != (header.first_ts_ms, header.last_ts_ms):
        refuse(
            "header_mismatch",
            f"header t0..t1={header.first_ts_ms}..{header.last_ts_ms}, frame has {bounds[0]}..{bounds[1]}",
        )
    st.sid = state_id(header.node, NO_BASE if base is None else base.sid, content)
    labelsets = [st.labels[i] for i in local]
    return Batch(header.cluster, header.node, header.seq, labelsets, out_blocks), st
