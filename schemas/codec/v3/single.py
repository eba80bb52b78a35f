"""The single-cycle layout of v3 (frame kinds 0x00 key / 0x01 delta): one scrape cycle of a node.

Block j is coded against block j of the state (the same target one cycle earlier).  Values are
written time-major, in the blocks' coded order: each as the delta of its delta ("dod") against the
series' last integer and last delta, a zigzag uvarint in DELTAS; a value the series' kind cannot carry
is an exception in EXC with its new kind and full integer (``schemas/wire-format.md`` section 11).
"""

from __future__ import annotations

from typing import Final

from schemas import columnar
from schemas.codec.errors import refuse
from schemas.codec.header import Header
from schemas.codec.limits import Limits
from schemas.codec.v3.frame import (
    HEAD_SECTIONS,
    Block,
    add_series,
    code_block,
    finish,
    read_added,
    read_block,
    read_exceptions,
    read_sections,
    seal,
)
from schemas.codec.v3.state import (
    F64_STRUCT,
    KIND_NONE,
    KIND_RAW,
    KIND_STALE,
    MAX_K,
    POW10,
    U64_SPAN,
    U64_STRUCT,
    State,
    as_decimal,
    in_range,
    restart,
    zigzag_int,
)
from schemas.columnar import put_uvarint
from schemas.model import STALE_NAN, STALE_NAN_BITS, Batch

# The sections of a single-cycle frame's content, in wire order (each uvarint length + bytes).
V3_SECTIONS: Final = (*HEAD_SECTIONS, "DELTAS")


def encode_frame(base: State | None, batch: Batch, limits: Limits) -> tuple[bytes, State]:
    """(content, state after it) of ``batch`` coded against ``base`` (None: a key frame).

    ``batch`` must have passed ``validate_batch``.  Raises ``Invalid`` (too_many_series,
    too_many_label_pairs) when the dictionary would outgrow its caps: the caller sends a key frame.
    """
    st = State(batch.node) if base is None else base.derive()
    added, to_id = add_series(st, batch, limits)
    blocks_out = bytearray()
    ts_out = bytearray()
    put_uvarint(blocks_out, len(batch.scrapes))
    coded_ids: list[int] = []
    coded_vals: list[float] = []
    new_blocks: list[tuple[int, list[int]]] = []
    for j, block in enumerate(batch.scrapes):
        ref = st.blocks[j] if j < len(st.blocks) else (0, [])
        coded, values = code_block(blocks_out, ts_out, block, to_id, ref)
        coded_ids += coded
        coded_vals += values
        new_blocks.append((block.timestamp_ms, coded))
    st.blocks = new_blocks
    exc, deltas = _encode_values(st, coded_ids, coded_vals)
    return seal(st, base, batch.node, added, (bytes(blocks_out), bytes(ts_out), exc, deltas), limits)


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
            put_uvarint(exc, pos - last - 1)
            exc.append(KIND_STALE)
            last = pos
            n_exc += 1
            continue
        k = kinds[i]
        m: int | None
        if k <= MAX_K:
            m = as_decimal(v, b, k)
        elif k == KIND_RAW:
            m = b - U64_SPAN if b >> 63 else b
        else:
            m = None
        if m is not None:
            x = m - ms[i] - ds[i]
            z = x << 1 if x >= 0 else (-x << 1) - 1  # zigzag_int, inlined: this loop runs per sample
            if z < 0x80:
                deltas.append(z)
                ds[i] = m - ms[i]
                ms[i] = m
                continue
            if z < U64_SPAN:  # raw bits jumping across the sign bit can need more than 64 bits
                put_uvarint(deltas, z)
                ds[i] = m - ms[i]
                ms[i] = m
                continue
        k, m = restart(v, b, k)
        put_uvarint(exc, pos - last - 1)
        exc.append(k)
        put_uvarint(exc, zigzag_int(m))
        last = pos
        n_exc += 1
        kinds[i], ms[i], ds[i] = k, m, 0
    head = bytearray()
    put_uvarint(head, n_exc)
    return bytes(head + exc), bytes(deltas)


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
        refuse("header_mismatch", f"header n={header.sample_count}, frame has {len(ids)} samples")
    values = _decode_values(st, ids, parts[8], parts[9])
    st.blocks = [(t, coded) for t, coded, _ in blocks]
    return finish(st, base, header, content, blocks, values)


def _read_blocks(st: State, buf: bytes, ts_buf: bytes, limits: Limits) -> tuple[list[Block], list[int]]:
    """BLOCKS and TS: the blocks and all their coded ids, in order."""
    r = columnar.Reader(buf, "BLOCKS")
    tr = columnar.Reader(ts_buf, "TS")
    n_blocks = r.count(limits.max_scrapes, "too_many_scrapes", "blocks")
    blocks: list[Block] = []
    ids: list[int] = []
    for j in range(n_blocks):
        block = read_block(r, tr, j, st.blocks[j] if j < len(st.blocks) else (0, []), len(st.labels))
        if len(ids) + len(block[1]) > limits.max_samples:
            refuse("too_many_samples", f"more than {limits.max_samples} samples")
        ids += block[1]
        blocks.append(block)
    r.done()
    tr.done()
    return blocks, ids


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
                refuse("malformed", f"DELTAS: a delta for series {i}, which has no history")
            m = ms[i] + ds[i] + columnar.unzigzag(next(deltas))
            if not in_range(k, m):
                refuse("malformed", f"DELTAS: series {i} leaves its integer range")
            ds[i] = m - ms[i]
            ms[i] = m
        else:
            k, m = e
            if k == KIND_STALE:
                append(STALE_NAN)
                continue
            kinds[i], ms[i], ds[i] = k, m, 0
        append(m / POW10[k] if k <= MAX_K else F64_STRUCT.unpack(U64_STRUCT.pack(m % U64_SPAN))[0])
    return out
