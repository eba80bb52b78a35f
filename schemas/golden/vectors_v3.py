"""The golden vectors of format version 3 (``v3/``): key frames of the v2 batches, a stream chain with
its state message, the multi-cycle layout's chain, and invalid frames.  ``make_golden`` writes them;
the tests rebuild the streams from here.  The batches and crafting helpers are ``vectors``'.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack

from schemas import codec
from schemas.golden.vectors import (
    LEVEL,
    T0,
    V2_BATCHES,
    encoder_info,
    f64,
    header_for,
    raw_envelope,
    refused_vector,
    values_from_bits,
)
from schemas.model import STALE_NAN_BITS, Batch, Labels, ScrapeBlock


def v3_stream() -> list[Batch]:
    """Four scrape cycles of two targets: a key frame, then churn, a stale marker and special values."""
    node = ("instance", "edge:9100"), ("job", "node")
    kepler = ("instance", "edge:28282"), ("job", "kepler")
    load = (("__name__", "node_load1"), *node)
    cpu = (("__name__", "node_cpu_seconds_total"), ("cpu", "0"), *node)
    odd = (("__name__", "node_odd_value"), *node)
    a1 = (("__name__", "kepler_container_joules_total"), ("container_id", "a1"), *kepler)
    b2 = (("__name__", "kepler_container_joules_total"), ("container_id", "b2"), *kepler)
    c3 = (("__name__", "kepler_container_joules_total"), ("container_id", "c3"), *kepler)
    stale = f64(STALE_NAN_BITS)
    cycles: list[list[tuple[list[Labels], list[float], list[int] | None]]] = [
        [([load, cpu, odd], [0.52, 1234.5678901234567, 0.0], None), ([a1, b2], [1000.0, 73.5], None)],
        [
            ([load, cpu, odd], [0.61, 1239.5712345678901, -0.0], None),
            ([a1, b2, c3], [1017.125, 75.0, 0.25], None),
        ],
        [
            ([odd, load, cpu], [f64(0x7FF4DEADBEEF0001), 0.58, 1244.58], None),
            ([a1, b2, c3], [1034.25, stale, 17.5], None),
        ],
        [
            ([load, cpu, odd], [1.07, 1249.5887654321, float("inf")], None),
            ([c3, a1], [34.75, 1051.375], [T0 + 16248, T0 + 16250]),
        ],
    ]
    out = []
    for k, cycle in enumerate(cycles):
        table: dict[Labels, int] = {}
        blocks = []
        for j, (ls, values, stamps) in enumerate(cycle):
            ids = array("I", [table.setdefault(lab, len(table)) for lab in ls])
            vals = values_from_bits([struct.unpack("<Q", struct.pack("<d", v))[0] for v in values])
            ts = None if stamps is None else array("q", stamps)
            blocks.append(ScrapeBlock(T0 + 5000 * k + 1250 * j, ids, vals, ts))
        out.append(Batch("lab", "edge-01", k + 1, list(table), blocks))
    return out


def v3_vectors() -> dict[str, tuple[bytes, dict[str, Any]]]:
    """name -> (bytes, JSON view) of the v3 vectors (names relative to ``v3/``), checked as they are made."""
    out: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for name, (make, description) in V2_BATCHES.items():
        data = codec.encode_batch(make(), LEVEL, version=codec.FORMAT_V3)
        header, decoded = codec.decode_batch_with_header(data)
        view = {"kind": "batch", "description": f"key frame: {description}", "encoder": encoder_info()}
        view.update(codec.batch_to_json(header, decoded))
        out[f"v3_{name}"] = (data, view)
    enc = codec.StreamEncoder("lab", "edge-01", keyframe_every=100, level=LEVEL)
    dec = codec.StreamDecoder()
    frames = []
    for k, batch in enumerate(v3_stream()):
        data = enc.encode(batch)
        frames.append(data)
        key = codec.frame_base(data) is None
        view, sid = _frame_view(dec, data, k, f"stream frame {k}" + (" (key frame)" if key else ""))
        out[f"v3_stream_{k}"] = (data, view)
        if k == 2:
            state = enc.state()
            assert sid is not None
            out["v3_state_after_2"] = (state, {"kind": "stream_state", "sid": sid.hex(), "node": "edge-01"})
    invalid = {
        "v3_invalid_need_state": (frames[1], "need_state", "a delta frame decoded without its state"),
        "v3_invalid_frame_kind": (
            _v3_rebody(frames[0], lambda b: b"\x07" + b[1:]),
            codec.v3.UNKNOWN_FRAME_KIND,
            "kind 7: a frame kind this decoder does not know",
        ),
        "v3_invalid_short_base": (_v3_rebody(frames[1], lambda b: b[:9]), "malformed", "base id cut"),
        "v3_invalid_bad_compression": (
            _v3_rebody(frames[0], lambda b: b[:1] + b"junk"),
            "bad_compression",
            "",
        ),
        "v3_invalid_v2_codec": (
            raw_envelope(header_for(b"\x00", codec=codec.CODEC_V2), version=codec.FORMAT_V3),
            "unknown_codec",
            "a v3 envelope naming the v2 codec",
        ),
    }
    out.update(v3_multicycle_vectors())
    for name, (data, reason, description) in invalid.items():
        out[name] = refused_vector(name, data, reason, description or reason)
    return out


def merge_cycles(batches: Sequence[Batch], seq: int) -> Batch:
    """One batch of the cycles ``batches`` (a window): their label sets in first-use order."""
    table: dict[Labels, int] = {}
    blocks = []
    for b in batches:
        for s in b.scrapes:
            ids = array("I", [table.setdefault(b.labelsets[i], len(table)) for i in s.series])
            blocks.append(ScrapeBlock(s.timestamp_ms, ids, array("d", s.values), s.timestamps))
    return Batch(batches[0].cluster, batches[0].node, seq, list(table), blocks)


def v3_multicycle_stream() -> list[Batch]:
    """Windows of the v3 stream's cycles: two cycles (a multi-cycle key frame), one cycle (a single-cycle
    delta frame), then the last cycle and a copy of it 5 s later (a multi-cycle delta frame)."""
    c = v3_stream()
    later = []
    for s in c[3].scrapes:
        stamps = None if s.timestamps is None else array("q", [t + 5000 for t in s.timestamps])
        values = array("d", [v + 1.5 for v in s.values])
        later.append(ScrapeBlock(s.timestamp_ms + 5000, s.series, values, stamps))
    c4 = Batch(c[3].cluster, c[3].node, 5, c[3].labelsets, later)
    return [merge_cycles(c[0:2], 1), merge_cycles(c[2:3], 2), merge_cycles([c[3], c4], 3)]


def v3_multicycle_vectors() -> dict[str, tuple[bytes, dict[str, Any]]]:
    """The multi-cycle layout (frame kinds 0x02/0x03) in a chain with a single-cycle frame."""
    out: dict[str, tuple[bytes, dict[str, Any]]] = {}
    enc = codec.StreamEncoder("lab", "edge-01", keyframe_every=100, level=LEVEL, multicycle_level=LEVEL)
    dec = codec.StreamDecoder()
    kinds = []
    for k, batch in enumerate(v3_multicycle_stream()):
        data = enc.encode(batch)
        kinds.append(msgpack.unpackb(data[4:], raw=False)["body"][0])
        view, _sid = _frame_view(dec, data, k, f"window frame {k}, frame kind 0x{kinds[-1]:02x}")
        out[f"v3_multicycle_{k}"] = (data, view)
    assert kinds == [0x02, 0x01, 0x03], kinds
    state = enc.state()
    out["v3_multicycle_state_after_2"] = (
        state,
        {"kind": "stream_state", "sid": enc.sid.hex(), "node": "edge-01"},
    )
    return out


def _frame_view(
    dec: codec.StreamDecoder, data: bytes, index: int, description: str
) -> tuple[dict[str, Any], bytes | None]:
    """The JSON view of stream frame ``data`` (decoded by ``dec``, which moves on), and its state id."""
    header, decoded, sid = dec.decode_with_header(data)
    base = codec.frame_base(data)
    view = {
        "kind": "stream_frame",
        "description": description,
        "encoder": encoder_info(),
        "index": index,
        "base": None if base is None else base.hex(),
        "sid": None if sid is None else sid.hex(),
    }
    view.update(codec.batch_to_json(header, decoded))
    return view, sid


def _v3_rebody(data: bytes, change: Any) -> bytes:
    header = msgpack.unpackb(data[4:], raw=False)
    header["body"] = change(header["body"])
    return raw_envelope(header, version=codec.FORMAT_V3)
