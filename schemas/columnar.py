"""Column transforms of the v2 batch body ("columnar+zstd"): pure functions, no envelope, no zstd.

``schemas/wire-format.md`` (section "Body, version 2") specifies the byte layout; ``schemas/codec/v2.py``
puts these pieces together.  What lives here:

- unsigned LEB128 varints, zigzag, a bounds-checked :class:`Reader`;
- fixed-width integer columns, little-endian and byte-shuffled (all byte 0s, then all byte 1s, ...)
  so zstd sees the runs of zero high bytes;
- the constants of the value codec of one series, which lives in ``schemas/values.py``;
- the sorted timestamp table and runs of indices into it.

Decoders treat their input as hostile: every count is checked against what is left of its stream
(or a caller's cap) before anything of that size is built, and every problem raises
:class:`ColumnError` with a stable reason slug (one of ``codec.REASONS``).

Speed matters (pure CPython on small edge CPUs): per-sample work goes through C-level helpers
(``map``, ``itertools.accumulate``, ``array``, slicing) and Python-level loops run per series.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from itertools import accumulate
from operator import sub
from typing import Final, NoReturn

# The wire is little-endian, array() native-endian: columns are byte-swapped on big-endian hosts.
BIG_ENDIAN: Final = sys.byteorder == "big"


def _typecode(size: int, signed: bool) -> str:
    for code in "bhilq" if signed else "BHILQ":
        if array(code).itemsize == size:
            return code
    raise RuntimeError(f"no {size}-byte array type")  # pragma: no cover - every CPython has them


# Width in bytes -> array typecode, whatever the platform's C int sizes are.
SIGNED: Final = {w: _typecode(w, True) for w in (1, 2, 4, 8)}
UNSIGNED: Final = {w: _typecode(w, False) for w in (1, 2, 4, 8)}
WIDTHS: Final = (0, 1, 2, 4, 8)
# Decimal exponents whose power of ten is an exact double (10**22 < 2**53 * 2**22): m / 10**k is then
# one correctly rounded IEEE division, which every implementation reproduces bit for bit.
MAX_EXPONENT: Final = 22
POW10: Final = tuple(float(10**k) for k in range(MAX_EXPONENT + 1))
MAX_MANTISSA: Final = 2**53  # |m| < 2**53: m converts to a double exactly
MAX_VARINT_BYTES: Final = 10  # a uint64

# Series kind byte (stream VKIND): bits 0-4 the decimal exponent k (0..22) or KIND_BITS, bit 5 delta
# order 2, bit 6 stale markers listed in VSTALE; 0x80 alone is XOR.  Anything else is malformed.
KIND_BITS: Final = 0x1F
KIND_ORDER2: Final = 0x20
KIND_STALE: Final = 0x40
KIND_XOR: Final = 0x80
KIND_EXPONENT: Final = 0x1F  # the mask of bits 0-4


class ColumnError(ValueError):
    """A column the decoder refuses; ``reason`` is one of ``codec.REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def fail(reason: str, message: str) -> NoReturn:
    raise ColumnError(reason, message)


# --------------------------------------------------------------------------------------------------
# Varints


def put_uvarint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def uvarints(values: Iterable[int]) -> bytearray:
    out = bytearray()
    for value in values:
        put_uvarint(out, value)
    return out


def zigzag(value: int) -> int:
    # Small magnitudes of either sign become small unsigned numbers (valid for any int64).
    return (value << 1) ^ (value >> 63)


def unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


class Reader:
    """Sequential reader of one stream; reads past its end are ``length_mismatch``."""

    __slots__ = ("buf", "name", "pos")

    def __init__(self, buf: bytes, name: str) -> None:
        self.buf = buf
        self.name = name
        self.pos = 0

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def uvarint(self) -> int:
        buf, pos = self.buf, self.pos
        try:
            byte = buf[pos]
            if byte < 0x80:
                self.pos = pos + 1
                return byte
            value = byte & 0x7F
            shift = 7
            while True:
                pos += 1
                byte = buf[pos]
                value |= (byte & 0x7F) << shift
                if byte < 0x80:
                    break
                shift += 7
                if shift >= 7 * MAX_VARINT_BYTES:
                    fail("malformed", f"{self.name}: varint longer than {MAX_VARINT_BYTES} bytes")
        except IndexError:
            fail("length_mismatch", f"{self.name}: stream ends inside a varint")
        if value >= 1 << 64:
            fail("malformed", f"{self.name}: varint above 2^64-1")
        self.pos = pos + 1
        return value

    def count(self, cap: int, reason: str, what: str) -> int:
        """A count read before the items it announces: at most ``cap`` and what the stream can hold."""
        n = self.uvarint()
        if n > cap:
            fail(reason, f"{self.name}: {n} {what} > {cap}")
        return n

    def uvarints(self, n: int) -> list[int]:
        # Every varint takes at least one byte, so a count above the bytes left fails before allocating.
        if n > self.remaining():
            fail("length_mismatch", f"{self.name}: {n} varints announced, {self.remaining()} bytes left")
        buf, pos = self.buf, self.pos
        end = pos + n
        chunk = buf[pos:end]
        if chunk.isascii():
            # Fast path: n one-byte varints are just the bytes.
            self.pos = end
            return list(chunk)
        read = self.uvarint
        return [read() for _ in range(n)]

    def take(self, n: int) -> bytes:
        if n > self.remaining():
            fail("length_mismatch", f"{self.name}: {n} bytes announced, {self.remaining()} left")
        start = self.pos
        self.pos = start + n
        return self.buf[start : self.pos]

    def done(self) -> None:
        if self.pos != len(self.buf):
            fail("length_mismatch", f"{self.name}: {len(self.buf) - self.pos} bytes left over")


# --------------------------------------------------------------------------------------------------
# Fixed-width integer columns, byte-shuffled


def shuffle(data: bytes, width: int) -> bytes:
    """All byte 0s of the ``width``-byte items, then all byte 1s, ..."""
    if width <= 1:
        return bytes(data)
    return b"".join(data[i::width] for i in range(width))


def unshuffle(data: bytes, width: int) -> bytes:
    if width <= 1:
        return bytes(data)
    n = len(data) // width
    out = bytearray(len(data))
    for i in range(width):
        out[i::width] = data[i * n : (i + 1) * n]
    return bytes(out)


def pack_ints(values: Sequence[int], width: int, signed: bool = True) -> bytes:
    """Little-endian two's complement (or unsigned) items of ``width`` bytes, shuffled."""
    col = array((SIGNED if signed else UNSIGNED)[width], values)
    if BIG_ENDIAN:
        col.byteswap()
    return shuffle(col.tobytes(), width)


def unpack_ints(data: bytes, width: int, signed: bool = True, name: str = "column") -> array:
    if len(data) % width:
        fail("length_mismatch", f"{name}: {len(data)} bytes is not a multiple of {width}")
    col = array((SIGNED if signed else UNSIGNED)[width])
    col.frombytes(unshuffle(data, width))
    if BIG_ENDIAN:
        col.byteswap()
    return col


def width_for(lo: int, hi: int) -> int:
    """Smallest width in WIDTHS holding every signed value in lo..hi (0: all zero; 16: none does)."""
    if lo == 0 and hi == 0:
        return 0
    if lo >= -0x80 and hi < 0x80:
        return 1
    if lo >= -0x8000 and hi < 0x8000:
        return 2
    if lo >= -0x8000_0000 and hi < 0x8000_0000:
        return 4
    if lo >= -(2**63) and hi < 2**63:
        return 8
    return 16


def unsigned_width(count: int) -> int:
    """Width of an id column whose ids are < count: derived, so never written on the wire."""
    if count <= 0x100:
        return 1
    if count <= 0x1_0000:
        return 2
    return 4


# --------------------------------------------------------------------------------------------------
# Floats <-> bit patterns


def f64_bytes(values: Sequence[float]) -> bytes:
    """Little-endian bytes of a float64 column (any bit pattern kept)."""
    col = array("d", values)
    if BIG_ENDIAN:
        col.byteswap()
    return col.tobytes()


def f64_bits(values: Sequence[float]) -> array:
    bits = array("Q")
    bits.frombytes(f64_bytes(values))
    if BIG_ENDIAN:
        bits.byteswap()
    return bits


# --------------------------------------------------------------------------------------------------
# Timestamps and runs of indices


def encode_times(times: Sequence[int]) -> bytearray:
    """TIMES: count, first timestamp, then the (positive) gaps; ``times`` sorted ascending, distinct."""
    out = bytearray()
    put_uvarint(out, len(times))
    if times:
        put_uvarint(out, times[0])
        for gap in map(sub, times[1:], times):
            put_uvarint(out, gap)
    return out


def decode_times(buf: bytes, max_count: int, max_ts: int) -> list[int]:
    reader = Reader(buf, "TIMES")
    n = reader.count(max_count, "too_many_scrapes", "distinct timestamps")
    if not n:
        reader.done()
        return []
    first = reader.uvarint()
    gaps = reader.uvarints(n - 1)
    reader.done()
    if gaps and min(gaps) == 0:
        fail("bad_timestamp", "TIMES: timestamps not strictly ascending")
    times = list(accumulate(gaps, initial=first))
    if times[-1] > max_ts:
        fail("bad_timestamp", f"TIMES: timestamp {times[-1]} > {max_ts}")
    return times


def runs_of(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ascending indices as (gap before the run, length)."""
    runs: list[tuple[int, int]] = []
    end = 0
    start = prev = -2
    for i in indices:
        if i != prev + 1:
            if start >= 0:
                runs.append((start - end, prev + 1 - start))
                end = prev + 1
            start = i
        prev = i
    if start >= 0:
        runs.append((start - end, prev + 1 - start))
    return runs
