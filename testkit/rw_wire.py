"""A reader of the remote-write wire format, written from the specs: the protobuf wire format and the
snappy *block* format, independent of ``cloud_ingest.sinks.remote_write``, of cramjam and of any
protobuf runtime (value bits straight off the wire: no protobuf runtime can canonicalise a NaN or drop the
sign of -0 on the way).  Used by the remote-write tests and by ``bench/ingest_load_bench.py``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from schemas.model import Labels


def bits_to_float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", bits))[0])


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The unsigned varint at ``pos``, and the position after it."""
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, pos


def wire_fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a serialized message, in wire order: varints as int, fixed64 and
    length-delimited fields as bytes.  Lazy: taking the first field reads no further."""
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = read_varint(buf, pos)
            yield number, value
        elif wire_type == 1:
            yield number, buf[pos : pos + 8]
            pos += 8
        elif wire_type == 2:
            n, pos = read_varint(buf, pos)
            yield number, buf[pos : pos + n]
            pos += n
        else:
            raise AssertionError(f"unexpected wire type {wire_type}")


def wire_timeseries(buf: bytes) -> tuple[Labels, list[tuple[int, int]]]:
    """A serialized TimeSeries: its labels in wire order and its (timestamp, value bits) in wire order."""
    lset: list[tuple[str, str]] = []
    samples: list[tuple[int, int]] = []
    for number, value in wire_fields(buf):
        assert isinstance(value, bytes)
        if number == 1:
            name = val = ""
            for n, part in wire_fields(value):
                assert isinstance(part, bytes)
                if n == 1:
                    name = part.decode()
                elif n == 2:
                    val = part.decode()
            lset.append((name, val))
        elif number == 2:
            t = bits = 0
            for n, part in wire_fields(value):
                if n == 1:
                    assert isinstance(part, bytes)
                    bits = int.from_bytes(part, "little")
                elif n == 2:
                    assert isinstance(part, int)
                    t = part - (1 << 64) if part >= 1 << 63 else part
            samples.append((t, bits))
    return tuple(lset), samples


def wire_samples(raw: bytes) -> list[list[tuple[int, int]]]:
    """(timestamp, value bits) per TimeSeries, read from the raw WriteRequest bytes."""
    out = []
    for number, ts in wire_fields(raw):
        assert number == 1 and isinstance(ts, bytes)
        out.append(wire_timeseries(ts)[1])
    return out


def snappy_block_decode(data: bytes) -> bytes:
    """Snappy block format (format_description.txt of google/snappy): a varint with the uncompressed
    length, then literals and back-references; written from the spec, shares no code with cramjam."""
    length, pos = read_varint(data, 0)
    out = bytearray()
    while pos < len(data):
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:  # literal
            n = tag >> 2
            if n >= 60:
                extra = n - 59
                n = int.from_bytes(data[pos : pos + extra], "little")
                pos += extra
            n += 1
            assert pos + n <= len(data), "literal runs past the end"
            out += data[pos : pos + n]
            pos += n
            continue
        if kind == 1:
            n = ((tag >> 2) & 7) + 4
            offset = ((tag >> 5) << 8) | data[pos]
            pos += 1
        elif kind == 2:
            n = (tag >> 2) + 1
            offset = int.from_bytes(data[pos : pos + 2], "little")
            pos += 2
        else:
            n = (tag >> 2) + 1
            offset = int.from_bytes(data[pos : pos + 4], "little")
            pos += 4
        assert 0 < offset <= len(out), f"copy offset {offset} outside the {len(out)} bytes decoded"
        if offset >= n:
            start = len(out) - offset
            out += out[start : start + n]
        else:  # overlapping copy: byte by byte
            for _ in range(n):
                out.append(out[-offset])
    assert len(out) == length, f"preamble says {length} bytes, decoded {len(out)}"
    return bytes(out)
