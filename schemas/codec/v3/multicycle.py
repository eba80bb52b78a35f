"""Multi-cycle layout of wire format v3 (frame kinds 0x02 key / 0x03 delta): a frame of several cycles.

Windowed mode publishes one frame per batch window (12 scrape cycles of every target).  The single-cycle
layout (``single``) codes such a frame as one long cycle: values time-major, each block against the block at
the same index of the previous frame (the same target 12 cycles earlier).  This layout codes the same
dictionary, blocks and values differently (``schemas/wire-format.md`` section 11.5):

- BLOCKS starts with P, the blocks per cycle, and block j is coded against block j - P (the same
  target one cycle earlier: of this frame, or for the first cycle the last blocks of the state);
- values are written series-major: a series' samples of the frame contiguous, series in first-use
  order (the exceptions' positions count in that order);
- ORDER gives each series (first-use order) a predictor order 1..4: the residual is the integer minus
  ``m + d1 + ... + d(order-1)``, the differences of the series' last integers.  Only ``m`` and ``d1``
  come from the state (as v3's), ``d2``/``d3`` from this frame's own samples since the series' last
  exception (0 until there are any), so the state is v3's, unchanged: kinds alternate in one chain;
- the residuals' varints as byte planes: plane k holds byte k of every varint that has one.

The state a frame leaves is the v3 state: the dictionary, the last cycle's P blocks, and per series
its kind, last integer and last delta.  Its id is the same chain hash over the content.
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

MC_SECTIONS: Final = (*HEAD_SECTIONS, "ORDER", "DELTAS")
DEFAULT_LEVEL: Final = 19  # zstd of multi-cycle frames (one per window): docs/stream-codec.md
ORDERS: Final = (1, 2, 3, 4)  # the predictor orders the encoder chooses from by default
MAX_ORDER: Final = 4
_PREFER: Final = (2, 1, 3, 4)  # ties: v3's delta of delta first, then the cheaper predictors
_SIG_HEAD: Final = 8  # series looked at per block to tell blocks of one target apart
_SIG_TRIES: Final = 8  # cycle lengths tried


def cycle_length(batch: Batch) -> int:
    """Blocks per scrape cycle of ``batch`` when it carries more than one cycle, else 0.

    A block's signature is the smallest series index among its first few (a target's series keep their
    indices from cycle to cycle); the cycle is the smallest p whose shift repeats at least half of the
    signatures.  A wrong guess costs bytes, never samples: any p codes any batch.
    """
    blocks = batch.scrapes
    if len(blocks) < 2:
        return 0
    sig = [min(b.series[:_SIG_HEAD]) if len(b.series) else -1 for b in blocks]
    first = sig[0]
    n = len(sig)
    tries = _SIG_TRIES  # bounds the work: at most this many candidates, each O(blocks)
    for p in range(1, n):
        if sig[p] == first:
            same = sum(1 for j in range(p, n) if sig[j] == sig[j - p])
            if 2 * same >= n - p:
                return p
            tries -= 1
            if not tries:
                break
    return 0


def encode_frame(
    base: State | None, batch: Batch, limits: Limits, cycle: int, orders: tuple[int, ...] = ORDERS
) -> tuple[bytes, State]:
    """(content, state after it) of ``batch`` in the multi-cycle layout, ``cycle`` blocks per cycle
    (1..number of blocks; 0 only for a batch without blocks).  As ``single.encode_frame`` otherwise."""
    n = len(batch.scrapes)
    if not (1 <= cycle <= n or cycle == n == 0) or not set(orders) <= set(ORDERS) or not orders:
        raise ValueError(f"cycle {cycle} of {n} blocks, orders {orders}")
    st = State(batch.node) if base is None else base.derive()
    added, to_id = add_series(st, batch, limits)
    blocks_out = bytearray()
    ts_out = bytearray()
    put_uvarint(blocks_out, n)
    put_uvarint(blocks_out, cycle)
    refs = list(st.blocks)  # the state's blocks, then the frame's: block j refers to j - cycle
    off = len(refs) - cycle
    ids: list[int] = []
    values: list[float] = []
    for j, block in enumerate(batch.scrapes):
        ref = refs[off + j] if off + j >= 0 else (0, [])
        coded, vals = code_block(blocks_out, ts_out, block, to_id, ref)
        refs.append((block.timestamp_ms, coded))
        ids += coded
        values += vals
    st.blocks = refs[len(refs) - cycle :] if cycle else []
    exc, order, deltas = _encode_values(st, ids, values, orders)
    return seal(st, base, batch.node, added, (bytes(blocks_out), bytes(ts_out), exc, order, deltas), limits)


def _groups(ids: list[int]) -> dict[int, list[int]]:
    """Series id -> its positions in coded (time-major) order; series in first-use order."""
    groups: dict[int, list[int]] = {}
    for p, i in enumerate(ids):
        g = groups.get(i)
        if g is None:
            groups[i] = [p]
        else:
            g.append(p)
    return groups


def _encode_values(
    st: State, ids: list[int], values: list[float], orders: tuple[int, ...]
) -> tuple[bytes, bytes, bytes]:
    """EXC, ORDER and DELTAS (byte planes) of the coded samples, series-major; updates ``st``."""
    bits_col = columnar.f64_bits(values)
    kinds, ms, ds = st.kinds, st.ms, st.ds
    prefer = [o for o in _PREFER if o in orders]
    exc = bytearray()
    order_out = bytearray()
    zs: list[int] = []
    n_exc = 0
    last = -1
    q = 0  # series-major position of the series' first sample
    for i, ps in _groups(ids).items():
        vs = [values[p] for p in ps]
        bs = [bits_col[p] for p in ps]
        o, toks, (kinds[i], ms[i], ds[i]) = _choose(kinds[i], ms[i], ds[i], vs, bs, prefer)
        order_out.append(o)
        for t, tok in enumerate(toks):
            if type(tok) is int:
                zs.append(tok)
                continue
            k, m = tok
            put_uvarint(exc, q + t - last - 1)
            exc.append(k)
            if k != KIND_STALE:
                put_uvarint(exc, zigzag_int(m))
            last = q + t
            n_exc += 1
        q += len(ps)
    head = bytearray()
    put_uvarint(head, n_exc)
    return bytes(head + exc), bytes(order_out), planes(zs)


_Token = int | tuple[int, int]  # a residual's zigzag, or an exception (kind, integer)
_STALE_TOKEN: Final = (KIND_STALE, 0)


def _choose(
    k: int, m: int, a: int, vs: list[float], bs: list[int], prefer: list[int]
) -> tuple[int, list[_Token], tuple[int, int, int]]:
    """(order, tokens, (kind, m, d1) after) of one series' samples: the residuals of all four orders
    in one walk, then the order whose residuals take the fewest bits."""
    start = k, m, a
    b = c = 0
    deep = False  # b (d2) is this frame's: the series had a delta sample since its last exception
    toks: list[_Token | None] = []
    res: tuple[list[int], ...] = ([], [], [], [])
    r1s, r2s, r3s, r4s = res
    decimal_of = as_decimal  # a local: looked up per sample
    for v, bit in zip(vs, bs, strict=True):
        if bit == STALE_NAN_BITS:
            toks.append(_STALE_TOKEN)
            continue
        x: int | None
        if k <= MAX_K:
            x = decimal_of(v, bit, k)
        elif k == KIND_RAW:
            x = bit - U64_SPAN if bit >> 63 else bit
        else:
            x = None
        if x is None:
            k, x = restart(v, bit, k)
            toks.append((k, x))
            m, a, b, c, deep = x, 0, 0, 0, False
            continue
        r1 = x - m
        r2 = r1 - a
        r3 = r2 - b
        r1s.append(r1)
        r2s.append(r2)
        r3s.append(r3)
        r4s.append(r3 - c)
        toks.append(None)
        m, a, b, c, deep = x, r1, r2, r3 if deep else 0, True
    best = prefer[0]
    zbest: list[int] = []
    if r1s:
        cost = -1
        for o in prefer:
            zz = [r << 1 if r >= 0 else (-r << 1) - 1 for r in res[o - 1]]
            if max(zz) >= U64_SPAN:  # raw bits across the sign bit: this order needs exceptions
                continue
            bits = sum(map(int.bit_length, zz))
            if cost < 0 or bits < cost:
                best, zbest, cost = o, zz, bits
        if cost < 0:  # every order needs an exception somewhere: walk the preferred one exactly
            return best, *_walk(*start, vs, bs, best)
    it = iter(zbest)
    return best, [next(it) if t is None else t for t in toks], (k, m, a)


def _walk(
    k: int, m: int, a: int, vs: list[float], bs: list[int], order: int
) -> tuple[list[_Token], tuple[int, int, int]]:
    """The tokens of one series with predictor ``order``, a residual of 64 bits or more an exception."""
    b = c = 0
    deep = False
    toks: list[_Token] = []
    for v, bit in zip(vs, bs, strict=True):
        if bit == STALE_NAN_BITS:
            toks.append(_STALE_TOKEN)
            continue
        x: int | None = None
        if k <= MAX_K:
            x = as_decimal(v, bit, k)
        elif k == KIND_RAW:
            x = bit - U64_SPAN if bit >> 63 else bit
        if x is not None:
            r1 = x - m
            r2 = r1 - a
            r3 = r2 - b
            r = (r1, r2, r3, r3 - c)[order - 1]
            z = r << 1 if r >= 0 else (-r << 1) - 1
            if z < U64_SPAN:
                toks.append(z)
                m, a, b, c, deep = x, r1, r2, r3 if deep else 0, True
                continue
        k, x = restart(v, bit, k)
        toks.append((k, x))
        m, a, b, c, deep = x, 0, 0, 0, False
    return toks, (k, m, a)


def planes(zs: list[int]) -> bytes:
    """The varints of ``zs`` (each below 2^64) as byte planes: plane k holds byte k of every varint
    that has one, in order.  Plane 0 has one byte per value; plane k+1 one per continuation byte of
    plane k: no lengths needed."""
    out = bytearray()
    while zs:
        rest = []
        for z in zs:
            if z < 0x80:
                out.append(z)
            else:
                out.append((z & 0x7F) | 0x80)
                rest.append(z >> 7)
        zs = rest
    return bytes(out)


def unplanes(buf: bytes, count: int) -> list[int]:
    """The ``count`` values of DELTAS written by ``planes``; the whole section, nothing else."""
    zs = list(buf[:count])
    if len(zs) != count:
        refuse("length_mismatch", f"DELTAS: {len(buf)} bytes for {count} residuals")
    todo = [p for p, z in enumerate(zs) if z & 0x80]
    for p in todo:
        zs[p] &= 0x7F
    pos = count
    shift = 7
    while todo:
        if shift > 63:
            refuse("malformed", "DELTAS: a residual of more than 10 bytes")
        chunk = buf[pos : pos + len(todo)]
        if len(chunk) != len(todo):
            refuse("length_mismatch", f"DELTAS: plane {shift // 7} cut short")
        pos += len(todo)
        nxt = []
        for p, byte in zip(todo, chunk, strict=True):
            zs[p] |= (byte & 0x7F) << shift
            if byte & 0x80:
                nxt.append(p)
        todo = nxt
        shift += 7
    if pos != len(buf):
        refuse("length_mismatch", f"DELTAS: {len(buf) - pos} bytes after the last plane")
    if shift > 63 and max(zs) >= U64_SPAN:
        refuse("malformed", "DELTAS: a residual of 2^64 or more")
    return zs


def decode_frame(base: State | None, header: Header, content: bytes, limits: Limits) -> tuple[Batch, State]:
    """(batch, state after it) of multi-cycle content against ``base``; as ``single.decode_frame``."""
    st = State(header.node) if base is None else base.derive()
    parts = read_sections(content, MC_SECTIONS)
    read_added(st, parts, limits)
    r = columnar.Reader(parts[6], "BLOCKS")
    tr = columnar.Reader(parts[7], "TS")
    n_blocks = r.count(limits.max_scrapes, "too_many_scrapes", "blocks")
    cycle = r.uvarint()
    if not (1 <= cycle <= n_blocks or cycle == n_blocks == 0):
        refuse("malformed", f"BLOCKS: {cycle} blocks per cycle of {n_blocks}")
    refs = [(t, coded) for t, coded in st.blocks]
    off = len(refs) - cycle
    n_dict = len(st.labels)
    blocks: list[Block] = []
    ids: list[int] = []
    for j in range(n_blocks):
        block = read_block(r, tr, j, refs[off + j] if off + j >= 0 else (0, []), n_dict)
        if len(ids) + len(block[1]) > limits.max_samples:
            refuse("too_many_samples", f"more than {limits.max_samples} samples")
        ids += block[1]
        blocks.append(block)
        refs.append((block[0], block[1]))
    r.done()
    tr.done()
    if len(ids) != header.sample_count:
        refuse("header_mismatch", f"header n={header.sample_count}, frame has {len(ids)} samples")
    values = _decode_values(st, ids, parts[8], parts[9], parts[10])
    st.blocks = refs[len(refs) - cycle :] if cycle else []
    return finish(st, base, header, content, blocks, values)


def _decode_values(
    st: State, ids: list[int], exc_buf: bytes, order_buf: bytes, delta_buf: bytes
) -> list[float]:
    total = len(ids)
    exc, n_exc = read_exceptions(exc_buf, total)
    groups = _groups(ids)
    if len(order_buf) != len(groups):
        refuse("length_mismatch", f"ORDER: {len(order_buf)} orders for {len(groups)} series")
    if order_buf and not 1 <= min(order_buf) <= max(order_buf) <= MAX_ORDER:
        refuse("malformed", f"ORDER: predictor order outside 1..{MAX_ORDER}")
    zs = unplanes(delta_buf, total - n_exc)
    kinds, ms, ds = st.kinds, st.ms, st.ds
    out: list[float] = [0.0] * total
    pow10 = POW10
    unpack = F64_STRUCT.unpack
    pack = U64_STRUCT.pack
    fits = in_range
    q = -1
    t = 0
    for (i, ps), o in zip(groups.items(), order_buf, strict=True):
        k, m, a = kinds[i], ms[i], ds[i]
        b = c = 0
        deep = False
        for p in ps:
            q += 1
            e = exc.get(q)
            if e is None:
                if k == KIND_NONE:
                    refuse("malformed", f"DELTAS: a residual for series {i}, which has no history")
                z = zs[t]
                t += 1
                r = z >> 1 if not z & 1 else -((z + 1) >> 1)
                x = m + r + (a if o > 1 else 0) + (b if o > 2 else 0) + (c if o > 3 else 0)
                if not fits(k, x):
                    refuse("malformed", f"DELTAS: series {i} leaves its integer range")
                r1 = x - m
                r2 = r1 - a
                m, a, b, c, deep = x, r1, r2, r2 - b if deep else 0, True
            else:
                kk, mm = e
                if kk == KIND_STALE:
                    out[p] = STALE_NAN
                    continue
                k, m, a, b, c, deep = kk, mm, 0, 0, 0, False
            out[p] = m / pow10[k] if k <= MAX_K else unpack(pack(m % U64_SPAN))[0]
        kinds[i], ms[i], ds[i] = k, m, a
    return out
